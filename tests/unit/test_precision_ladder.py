"""A recheck precision's margin as the gate's choice: `serve_app.optimize.measure` gates each margin
of `serve_app.compiled.RECHECK_MARGINS`, records (and times) those a narrower margin does not
match with the agreement each serves, and the gate serves the fastest that passes
(`serve_app.runtimes.choose`).

The model and the compiled runners are fakes (probabilities looked up by token id), so the test
states which texts bf16 flips and by how much, and nothing depends on this CPU's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app import compiled, optimize
from serve_app.compiled import RECHECK_BASES, RECHECK_MARGINS, RecheckRunner
from serve_app.model import Tokenized
from serve_app.optimize import Sample, measure, undominated_margins
from serve_app.runtimes import choose, cpu_key

AMX = frozenset({"avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})
_Run = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} {i}" for i in range(n)]


class _Answers:
    """fp32's and bf16's probabilities per text: bf16 flips ``near`` texts whose fp32 margin is
    0.02 (bf16's margin 0.01: a close call at every margin) and ``far`` ones whose fp32 margin is
    0.14 (bf16's 0.06: rechecked from 0.07 up, not at 0.05 and below)."""

    def __init__(self, texts: Sequence[str], *, near: int, far: int) -> None:
        self.ids = {t: i for i, t in enumerate(texts)}
        n = len(texts)
        self.fp32 = np.tile(np.array([0.8, 0.1, 0.1], np.float32), (n, 1))
        self.bf16 = self.fp32.copy()
        for row in range(near):
            self.fp32[row] = [0.51, 0.49, 0.0]
            self.bf16[row] = [0.495, 0.505, 0.0]
        for row in range(near, near + far):
            self.fp32[row] = [0.57, 0.43, 0.0]
            self.bf16[row] = [0.47, 0.53, 0.0]

    def runner(self, table: np.ndarray, calls: list[int] | None = None) -> _Run:
        def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
            if calls is not None:
                calls.append(len(input_ids))
            return table[input_ids[:, 0]]

        return run


class _Model:
    """What `measure` uses of `EmotionModel`."""

    def __init__(self, answers: _Answers) -> None:
        self.answers = answers
        self.card = type("Card", (), {"labels": ("a", "b", "c")})()
        self._run: _Run = answers.runner(answers.fp32)

    def tokenize(self, texts: Sequence[str]) -> Tokenized:
        return Tokenized(ids=[[self.answers.ids[t]] for t in texts], truncated=np.zeros(len(texts), bool))

    def warmup(self) -> None:
        self._run(np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64))

    def infer(self, tokenized: Tokenized) -> Any:
        ids = np.array(tokenized.ids, np.int64).reshape(len(tokenized), 1)
        return type("Predictions", (), {"probabilities": self._run(ids, np.ones_like(ids))})()


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, list[int]]:
    """A record `measure` writes for 900 texts in domain and 1,000 out of domain, where bf16 flips
    2 near and 10 far texts of each; and the batch sizes fp32 answered through the runners."""
    inside, outside = _texts("in", 900), _texts("out", 1000)
    answers = _Answers([*inside, *outside], near=2, far=10)
    # The out-of-domain texts are the table's rows 900..: flip the same way there.
    answers.fp32[900:912], answers.bf16[900:912] = answers.fp32[:12], answers.bf16[:12]
    exact_calls: list[int] = []
    compiled_runners = {"bf16": answers.runner(answers.bf16), "fp32": answers.runner(answers.fp32, exact_calls)}

    def load(model_dir: Path, *, precision: str, **kw: Any) -> _Run:
        assert precision not in RECHECK_BASES, "a recheck margin is built over its first pass's and fp32's runners"
        return compiled_runners.get(precision, answers.runner(answers.bf16))

    monkeypatch.setattr(compiled, "load_openvino_runner", load)
    monkeypatch.setattr(compiled, "export_ir", lambda d: d)
    monkeypatch.setattr(compiled, "saved_model_digest", lambda d: "abc")
    monkeypatch.setattr(compiled, "openvino_version", lambda: "test")
    monkeypatch.setattr(optimize, "_nncf_version", dict)
    sample = Sample("test", calibration=(), held_out=tuple(inside))
    record = measure(
        tmp_path,
        sample,
        flags=AMX,
        out_of_domain=outside,
        rounds=2,
        model=_Model(answers),  # type: ignore[arg-type]
    )
    return record, exact_calls


def test_the_ladder_records_each_margin_no_narrower_one_matches_with_the_agreement_it_serves(
    measured: tuple[Any, list[int]],
) -> None:
    record, exact_calls = measured
    for precision in RECHECK_BASES:
        rechecks = {m.margin: m for m in record.all("openvino", precision)}
        # 0.02-0.05 fix the 2 near flips, not the 10 far ones (0.03 and 0.05 change nothing over
        # 0.02: not recorded); 0.07 fixes both, and 0.1 and 0.2 change nothing over it.
        assert sorted(rechecks) == [0.02, 0.07]
        assert rechecks[0.02].agreement_in == pytest.approx(1 - 10 / 900)
        assert rechecks[0.02].agreement_out == pytest.approx(1 - 10 / 1000)
        assert rechecks[0.07].agreement_in == rechecks[0.07].agreement_out == 1.0
        assert (rechecks[0.07].n_in, rechecks[0.07].n_out) == (900, 1000)
    assert record.get("openvino", "bf16").agreement_in == pytest.approx(1 - 12 / 900)
    assert all(m.margin is None for m in record.measurements if m.precision not in RECHECK_BASES)
    assert record.cpu_flags == cpu_key(AMX)
    # Each margin was timed as served: fp32 answered a recheck's close calls only (batches
    # smaller than the timed texts), besides its own full passes.
    assert any(0 < n < optimize.SPEED_TEXTS for n in exact_calls)


def test_the_gate_refuses_the_margin_under_it_and_serves_a_passing_one(measured: tuple[Any, list[int]]) -> None:
    record, _ = measured
    rechecks = {m.margin: m for m in record.all("openvino", "bf16-recheck")}
    assert not rechecks[0.02].passes(0.99)  # 10 flips in 900: a lower bound of 98.2%
    assert rechecks[0.07].passes(0.99)
    explicit = choose(runtime="openvino", precision="bf16-recheck", flags=AMX, record=record, saved_model="abc")
    assert explicit.margin == 0.07
    assert explicit.version_suffix == "+ov-bf16-recheck-m0.07"
    dense = choose(runtime="openvino", precision="bf16-dense-recheck", flags=AMX, record=record, saved_model="abc")
    assert (dense.margin, dense.version_suffix) == (0.07, "+ov-bf16-dense-recheck-m0.07")


def test_a_recheck_runner_rechecks_what_its_margin_says() -> None:
    answers = _Answers(_texts("t", 20), near=2, far=10)
    ids = np.arange(20).reshape(20, 1)
    for margin, fixed in ((0.05, 2), (0.1, 12), (0.2, 12)):
        calls: list[int] = []
        runner = RecheckRunner(answers.runner(answers.bf16), answers.runner(answers.fp32, calls), margin=margin)
        out = runner(ids, np.ones_like(ids))
        assert calls == [fixed]
        assert int((out.argmax(1) == answers.fp32.argmax(1)).sum()) == 20 - 12 + fixed


def test_a_margin_is_timed_unless_a_narrower_one_agrees_at_least_as_well_on_both_halves() -> None:
    figures = {0.2: (1.0, 1.0), 0.02: (0.98, 0.99), 0.03: (0.98, 0.995), 0.05: (0.98, 0.99), 0.1: (1.0, 1.0)}
    # 0.05 is no better than 0.02 (the same figures); 0.2 no better than 0.1.
    assert undominated_margins(figures) == [0.02, 0.03, 0.1]
    # Better in one half and worse in the other: both are kept, the gate decides.
    assert undominated_margins({0.02: (0.99, 0.97), 0.05: (0.98, 0.99)}) == [0.02, 0.05]
    assert undominated_margins({m: (1.0, 1.0) for m in RECHECK_MARGINS}) == [RECHECK_MARGINS[0]]


def test_a_recheck_runner_answers_first_with_its_own_precision_s_pass() -> None:
    answers = _Answers(_texts("t", 20), near=2, far=10)
    runner = RecheckRunner(
        answers.runner(answers.bf16), answers.runner(answers.fp32), margin=0.1, precision="bf16-dense-recheck"
    )
    assert runner.precision == "bf16-dense-recheck"
    with pytest.raises(ValueError, match="recheck precision"):
        RecheckRunner(answers.runner(answers.bf16), answers.runner(answers.fp32), margin=0.1, precision="bf16")
