"""Unit tests for ``runtime: openvino`` (`serve_app.compiled`) and ``raypipe model optimize``.

Real OpenVINO on the demo model: the compiled SavedModel must answer as TensorFlow fp32 does;
the IR cache converts once under concurrent callers, rebuilds a damaged entry, ignores a stale
model-directory copy; ``raypipe model optimize`` writes a record the gate reads and ``raypipe
model check`` prints.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raypipe.cli import main
from serve_app import compiled, demo_data
from serve_app.model import EmotionModel, cpu_flags
from serve_app.optimize import default_sample, optimize, read_sample, split_sample
from serve_app.runtimes import read_record

pytest.importorskip("openvino")

# Held-out generated sentences and paragraphs (the demo model trained on other seeds).
TEXTS = [t for t, _ in demo_data.sentences(100, seed=4901) + demo_data.paragraphs(100, seed=4902)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test writes to the real per-user cache."""
    cache = tmp_path / "raypipe-cache"
    monkeypatch.setenv("RAYPIPE_CACHE", str(cache))
    return cache / "openvino"


@pytest.fixture
def model_dir(demo_model_dir: Path, tmp_path: Path) -> Path:
    """A writable model directory whose parts link to the demo model's."""
    target = tmp_path / "model"
    target.mkdir()
    for part in ("model.json", "saved_model", "tokenizer"):
        (target / part).symlink_to(demo_model_dir / part)
    return target


@pytest.fixture
def counted_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Counts real conversions."""
    calls: list[Path] = []
    real = compiled.convert

    def convert(saved_model: Path, out: Path) -> dict[str, Any]:
        calls.append(out)
        return real(saved_model, out)

    monkeypatch.setattr(compiled, "convert", convert)
    return calls


def test_openvino_answers_as_tensorflow_fp32(model_dir: Path) -> None:
    reference = EmotionModel.load(model_dir).predict(TEXTS)
    model = EmotionModel.load(model_dir, runtime="openvino", threads=1)
    got = model.predict(TEXTS)
    np.testing.assert_allclose(got.probabilities, reference.probabilities, atol=1e-4)
    assert (got.probabilities.argmax(1) == reference.probabilities.argmax(1)).all()
    assert got.truncated.tolist() == reference.truncated.tolist()


def test_openvino_runner_is_safe_across_model_threads(model_dir: Path) -> None:
    # A replica's model threads run passes at once: one infer request per thread.
    model = EmotionModel.load(model_dir, runtime="openvino", threads=1, streams=2)
    expected = model.predict(TEXTS).probabilities
    results: list[np.ndarray] = []
    workers = [threading.Thread(target=lambda: results.append(model.predict(TEXTS).probabilities)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert len(results) == 3
    for r in results:
        np.testing.assert_array_equal(r, expected)


def test_concurrent_loads_convert_once(model_dir: Path, private_cache: Path, counted_convert: list[Path]) -> None:
    start = threading.Barrier(4)
    found: list[Path] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            start.wait(timeout=30)
            found.append(compiled.ensure_ir(model_dir, cache_dir=private_cache))
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not errors
    assert len(counted_convert) == 1
    assert len(set(found)) == 1 and found[0].parent == private_cache
    # No temporary or half-written entries are left beside it.
    assert sorted(p.name for p in private_cache.iterdir() if not p.name.endswith(".lock")) == [found[0].name]


def test_damaged_cache_entry_is_rebuilt(model_dir: Path, private_cache: Path, counted_convert: list[Path]) -> None:
    entry = compiled.ensure_ir(model_dir, cache_dir=private_cache)
    with (entry / "model.bin").open("r+b") as f:
        f.write(b"\0\0\0\0")
    assert compiled.ensure_ir(model_dir, cache_dir=private_cache) == entry
    assert len(counted_convert) == 2
    # The rebuilt IR is whole again: it answers as TensorFlow does.
    model = EmotionModel.load(model_dir, runtime="openvino", threads=1)
    np.testing.assert_allclose(
        model.predict(TEXTS[:20]).probabilities,
        EmotionModel.load(model_dir).predict(TEXTS[:20]).probabilities,
        atol=1e-4,
    )


def test_model_dir_copy_is_used_unless_stale(model_dir: Path, private_cache: Path, counted_convert: list[Path]) -> None:
    own = compiled.export_ir(model_dir)
    assert own == model_dir / "openvino"
    assert compiled.ensure_ir(model_dir, cache_dir=private_cache) == own
    assert len(counted_convert) == 1
    meta = json.loads((own / "ir.json").read_text())
    (own / "ir.json").write_text(json.dumps({**meta, "key": "another model"}))
    assert compiled.ensure_ir(model_dir, cache_dir=private_cache).parent == private_cache
    assert len(counted_convert) == 2


def test_compiled_blobs_are_kept_per_cpu(model_dir: Path, private_cache: Path) -> None:
    EmotionModel.load(model_dir, runtime="openvino", threads=1)
    blobs = private_cache / "compiled" / compiled.cpu_cache_tag(cpu_flags())
    assert any(blobs.iterdir())
    assert compiled.cpu_cache_tag(frozenset({"avx2"})) != compiled.cpu_cache_tag(frozenset({"avx2", "avx512_bf16"}))


def test_sample_reads_parquet_and_json_lines_globs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b"], "body": ["one", ""]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"id": ["c"], "body": ["three"]}), tmp_path / "part-1.parquet")
    assert read_sample(str(tmp_path / "*.parquet"), text_column="body") == ["one", "three"]
    (tmp_path / "rows.jsonl").write_text('{"id": "x", "text": "four"}\n{"id": "y", "text": "five"}\n')
    assert read_sample(str(tmp_path / "rows.jsonl"), rows=1) == ["four"]
    with pytest.raises(ValueError, match="no 'text' column"):
        read_sample(str(tmp_path / "part-0.parquet"))
    with pytest.raises(FileNotFoundError):
        read_sample(str(tmp_path / "none-*.parquet"))


def test_split_is_repeatable_and_keeps_held_out_texts_apart() -> None:
    texts = default_sample(200)
    a, b = split_sample(texts, source="x"), split_sample(texts, source="x")
    assert a == b
    assert len(a.calibration) == 60 and len(a.held_out) == 140
    assert sorted(a.calibration + a.held_out) == sorted(texts)
    with pytest.raises(ValueError, match="at least"):
        split_sample(texts[:10], source="x")


def test_optimize_records_openvino_against_tensorflow(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = split_sample(default_sample(240), source="default")
    result = optimize(model_dir, sample, threads=1, int8=False, flags=frozenset({"avx2"}))
    record = read_record(model_dir, flags=frozenset({"avx2"}))
    assert record == result.record
    assert read_record(model_dir, flags=frozenset({"avx2", "avx512_bf16"})) is None  # another CPU class
    settings = {(m.runtime, m.precision): m for m in record.measurements}
    assert set(settings) == {("tensorflow", "fp32"), ("openvino", "fp32")}
    assert settings["openvino", "fp32"].agreement == 1.0
    assert settings["openvino", "fp32"].max_abs_dp < 1e-4
    assert record.sample["held_out"] == len(sample.held_out)
    assert (model_dir / "openvino" / "model.xml").is_file()
    # `raypipe model check` prints the table beside the card.
    assert main(["model", "check", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "openvino    fp32" in out and "pass" in out


def test_int8_is_built_measured_and_gated(model_dir: Path) -> None:
    from serve_app.runtimes import GateError, resolve
    from serve_app.settings import ServerSettings

    sample = split_sample(default_sample(240), source="default")
    result = optimize(model_dir, sample, threads=1, int8_max_reverts=1, flags=frozenset({"avx2"}))
    assert "error" not in result.int8, result.int8
    assert "ops reverted to fp32" in result.int8["accuracy_control"]
    int8 = result.record.get("openvino", "int8")
    assert int8 is not None and 0.5 < int8.agreement <= 1.0 and int8.note.startswith("NNCF:")
    model = EmotionModel.load(model_dir, runtime="openvino", precision="int8", threads=1)
    assert model._run.path == model_dir / "openvino" / "int8.xml"  # type: ignore[attr-defined]
    assert model.predict(TEXTS[:8]).probabilities.shape == (8, len(demo_data.LABELS))
    # The gate reads what was just measured: its lower bound on agreement (counts of texts kept),
    # and a threshold above that bound refuses int8, unless forced.
    assert (int8.n_in, int8.n_out) == (len(sample.held_out), 1000)
    assert int8.gate_figure < int8.agreement
    at_bound = ServerSettings(runtime="openvino", precision="int8", min_agreement=int8.gate_figure)
    assert resolve(model_dir, at_bound, flags=frozenset({"avx2"})).precision == "int8"
    above = ServerSettings(runtime="openvino", precision="int8", min_agreement=int8.agreement)
    with pytest.raises(GateError, match="at 95% confidence"):
        resolve(model_dir, above, flags=frozenset({"avx2"}))
    forced = ServerSettings(runtime="openvino", precision="int8", min_agreement=1.0, force_precision=True)
    assert resolve(model_dir, forced, flags=frozenset({"avx2"})).version_suffix.startswith("+ov-int8-")


# -- the candidates between fp32 and bf16 ---------------------------------------------------------


def _tiny_encoder() -> Any:
    """An OpenVINO model in the shape `_bf16_matmuls` reads: an attention-like square projection,
    a layer norm (ReduceMean), a feed-forward block (8 -> 16 -> 8), a last layer norm, a head."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)

    def weight(k: int, n: int) -> Any:
        return ops.constant((rng.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32))

    def norm(x: Any) -> Any:
        return ops.subtract(x, ops.reduce_mean(x, ops.constant(np.array([-1])), True))

    x = ops.parameter([-1, 8], np.float32, name="x")
    h = norm(ops.add(x, ops.matmul(x, weight(8, 8), False, False)))
    h = norm(ops.add(h, ops.matmul(ops.relu(ops.matmul(h, weight(8, 16), False, False)), weight(16, 8), False, False)))
    out = ops.softmax(ops.matmul(h, weight(8, 3), False, False), -1)
    return ov.Model([out], [x], "tiny")


def _bf16_matmul_count(model: Any) -> int:
    return sum(
        1
        for op in model.get_ops()
        if op.get_type_name() == "MatMul" and op.get_output_element_type(0).to_string() == "bf16"
    )


@pytest.mark.parametrize(("ffn_only", "changed"), [(False, 3), (True, 2)])
def test_bf16_matmuls_leave_the_head_and_everything_but_the_chosen_matmuls_in_fp32(
    ffn_only: bool, changed: int
) -> None:
    model = _tiny_encoder()
    assert compiled._bf16_matmuls(model, ffn_only=ffn_only) == changed
    assert _bf16_matmul_count(model) == changed
    fp32_ops = [op for op in model.get_ops() if op.get_type_name() in ("ReduceMean", "Softmax", "Subtract")]
    assert {op.get_output_element_type(0).to_string() for op in fp32_ops} == {"f32"}
    assert model.output(0).get_element_type().to_string() == "f32"


@pytest.mark.skipif(not compiled.has_native_bf16(cpu_flags()), reason="needs a CPU with native bf16")
def test_the_cpu_plugin_runs_the_bf16_matmuls_in_bf16_and_the_rest_in_fp32() -> None:
    import openvino as ov

    model = _tiny_encoder()
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}
    exact = ov.Core().compile_model(_tiny_encoder(), "CPU", config)(x)[0]
    compiled._bf16_matmuls(model, ffn_only=False)
    mixed = ov.Core().compile_model(model, "CPU", config)
    runtime = {}
    for op in mixed.get_runtime_model().get_ops():
        info = op.get_rt_info()
        runtime.setdefault(info["layerType"].astype(str), set()).add(info["runtimePrecision"].astype(str))
    matmuls = runtime.get("FullyConnected", set()) | runtime.get("MatMul", set())
    assert "bf16" in matmuls
    assert runtime["Softmax"] == {"f32"}
    np.testing.assert_allclose(mixed(x)[0], exact, atol=0.05)


def test_recheck_answers_close_calls_with_the_exact_runner() -> None:
    fast_out = np.array([[0.50, 0.48, 0.02], [0.90, 0.05, 0.05], [0.40, 0.20, 0.40]], dtype=np.float32)
    exact_out = np.array([[0.47, 0.51, 0.02], [0.91, 0.05, 0.04], [0.41, 0.20, 0.39]], dtype=np.float32)
    seen: list[np.ndarray] = []

    def fast(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return fast_out[ids[:, 0]]

    def exact(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        seen.append(ids[:, 0].copy())
        return exact_out[ids[:, 0]]

    ids = np.array([[0, 7], [1, 7], [2, 7]], dtype=np.int32)
    got = compiled.RecheckRunner(fast, exact, margin=0.05)(ids, np.ones_like(ids))
    # Rows 0 (0.02 apart) and 2 (a tie) are close calls; row 1 keeps bf16's answer.
    assert [r.tolist() for r in seen] == [[0, 2]]
    np.testing.assert_array_equal(got, np.stack([exact_out[0], fast_out[1], exact_out[2]]))
    # What the gate measures for a margin, from the full bf16 and fp32 answers, is what the runner
    # serves at it, at every margin of the ladder and beyond.
    for margin in (*compiled.RECHECK_MARGINS, 0.01, 1.0):
        served = compiled.RecheckRunner(fast, exact, margin=margin)(ids, np.ones_like(ids))
        np.testing.assert_array_equal(compiled.rechecked(fast_out, exact_out, margin), served)
    # A wider margin answers a row in fp32 that a narrower one leaves to bf16.
    assert compiled.close_calls(fast_out, 0.05).tolist() == [0, 2]
    assert compiled.close_calls(fast_out, 0.9).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="margin"):
        compiled.RecheckRunner(fast, exact, margin=0.0)


@pytest.mark.parametrize(("precision", "first"), [("bf16-recheck", "bf16"), ("bf16-dense-recheck", "bf16-dense")])
def test_a_recheck_precision_compiles_its_first_pass_and_fp32(
    precision: str, first: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    built: list[str] = []
    monkeypatch.setattr(compiled, "ensure_ir", lambda d, cache_dir=None: tmp_path)
    monkeypatch.setattr(compiled, "_compile", lambda xml, *, precision, **kw: built.append(precision) or precision)
    runner = compiled.load_openvino_runner(
        tmp_path, n_labels=3, precision=precision, flags=frozenset({"amx_bf16"}), margin=0.03
    )
    assert isinstance(runner, compiled.RecheckRunner)
    assert (runner.fast, runner.exact, runner.margin, runner.precision) == (first, "fp32", 0.03, precision)
    assert built == [first, "fp32"]
    with pytest.raises(ValueError, match="margin"):
        compiled.load_openvino_runner(
            tmp_path, n_labels=3, precision="bf16-dense", flags=frozenset({"amx_bf16"}), margin=0.03
        )


@pytest.mark.parametrize("precision", ["bf16-dense", "bf16-ffn", "bf16-recheck", "bf16-dense-recheck"])
def test_a_candidate_is_refused_on_a_cpu_without_native_bf16(precision: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="AVX512_BF16"):
        compiled.load_openvino_runner(tmp_path, n_labels=3, precision=precision, flags=frozenset({"avx2"}))


@pytest.mark.skipif(not compiled.has_native_bf16(cpu_flags()), reason="needs a CPU with native bf16")
def test_fp32_and_bf16_compiled_with_one_blob_cache_each_answer_as_themselves(model_dir: Path) -> None:
    # Both precisions of one model, compiled in one process with one cache (what `measure` and a
    # replica after an export do): bf16 must not import fp32's blob (its answers were garbage).
    model = EmotionModel.load(model_dir)
    tokenized = model.tokenize(TEXTS[:40])
    reference = model.infer(tokenized).probabilities
    for precision in ("fp32", "bf16", "fp32"):
        model._run = compiled.load_openvino_runner(
            model_dir, n_labels=len(model.card.labels), precision=precision, flags=cpu_flags()
        )
        got = model.infer(tokenized).probabilities
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, reference, atol=1e-4 if precision == "fp32" else 0.05)
