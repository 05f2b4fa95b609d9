"""The measurement that picks a setting, on a machine that is not quiet (`serve_app.timing`,
`serve_app.optimize._measure_all`, `serve_app.runtimes.choose`).

The clock is injected: each runner advances it by what the script says that call took, so a test
states what load did to which call, and nothing depends on this CPU's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from serve_app.model import Tokenized
from serve_app.optimize import _measure_all
from serve_app.runtimes import Measurement, RuntimeRecord, choose, cpu_key
from serve_app.timing import Timing, beats, interleave, unbeaten

AMX = frozenset({"avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})
TEXTS = 80
TF, OV, OV_BF16 = ("tensorflow", "fp32"), ("openvino", "fp32"), ("openvino", "bf16")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeModel:
    """What `_measure_all` uses of `EmotionModel`: a swappable ``_run``, warmup and infer."""

    def __init__(self) -> None:
        self._run: Callable[[np.ndarray, np.ndarray], np.ndarray] = self._unset

    @staticmethod
    def _unset(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        raise AssertionError("no runner set")

    def warmup(self) -> None:
        self._run(np.zeros((1, 1), np.int32), np.ones((1, 1), np.int32))

    def infer(self, tokenized: Tokenized) -> object:
        probabilities = self._run(np.zeros((len(tokenized), 1), np.int32), np.ones((len(tokenized), 1), np.int32))
        return type("Predictions", (), {"probabilities": probabilities})()


def _runners(
    clock: _Clock, quiet_s: dict[tuple[str, str], float], load: Iterator[float], calls: list[tuple[str, str]]
) -> dict[tuple[str, str], Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """Runners that take ``quiet_s`` seconds on a quiet machine, times the next load factor per
    timed call (warmups, one row, take no time)."""

    def runner(setting: tuple[str, str]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            if len(ids) == TEXTS:
                calls.append(setting)
                clock.now += quiet_s[setting] * next(load)
            return np.full((len(ids), 2), 0.5, np.float32)

        return run

    return {s: runner(s) for s in quiet_s}


def _measured(clock: _Clock, quiet_s: dict[tuple[str, str], float], load: list[float]) -> tuple[RuntimeRecord, list]:
    calls: list[tuple[str, str]] = []
    runners = _runners(clock, quiet_s, iter(load), calls)
    tokenized = Tokenized(ids=[[1]] * TEXTS, truncated=np.zeros(TEXTS, bool))
    timed = _measure_all(_FakeModel(), runners, tokenized, rounds=5, clock=clock)  # type: ignore[arg-type]
    reference = timed[TF][1].median
    measurements = tuple(
        Measurement(
            *setting,
            para_per_s=timing.median,
            agreement=1.0,
            max_abs_dp=0.0,
            speedup=timing.median / reference,
            agreement_in=1.0,
            agreement_out=1.0,
            n_in=1000,
            n_out=1000,
            spread=timing.spread,
            rounds=timing.rounds,
        )
        for setting, (_, timing) in timed.items()
    )
    return RuntimeRecord(saved_model="abc", measurements=measurements, cpu_flags=cpu_key(AMX)), calls


def _auto(record: RuntimeRecord) -> tuple[str, str]:
    serving = choose(runtime="auto", precision="auto", flags=AMX, record=record, saved_model="abc")
    return (serving.runtime, serving.precision)


# The load a competing process put on ten timed calls in a row: a burst on the 2nd, 3rd and 7th.
BUSY = [1.0, 1.45, 1.3, 1.1, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0]


def test_rounds_interleave_a_b_then_b_a() -> None:
    record, calls = _measured(_Clock(), {TF: 1.0, OV: 1.0}, BUSY)
    assert calls == [TF, OV, OV, TF, TF, OV, OV, TF, TF, OV]
    ov = record.get(*OV)
    assert ov is not None and ov.rounds == 5
    # Rounds of OV: calls 2, 3, 6, 7, 10 -> 80/1.45, 80/1.3, 80, 80/1.3, 80 para/s.
    assert ov.para_per_s == pytest.approx(80 / 1.3) and ov.spread == pytest.approx(80 - 80 / 1.3)


def test_a_tie_that_load_made_noisy_keeps_the_default() -> None:
    # Quiet, TensorFlow fp32 and OpenVINO fp32 run alike (as measured: 81.5 and 79.8 para/s); a
    # competing process's bursts slow some of OpenVINO's rounds. One sample each, one after the
    # other, recorded whichever was lucky; the median and its spread call it a tie.
    record, _ = _measured(_Clock(), {TF: 1.0 / 1.02, OV: 1.0}, BUSY)
    tf, ov = record.get(*TF), record.get(*OV)
    assert tf is not None and ov is not None and tf.para_per_s > ov.para_per_s
    assert not beats(tf, ov)
    assert _auto(record) == OV  # the no-record default: the fastest setting with the reference's answers


def test_a_clear_win_beyond_the_spread_wins() -> None:
    record, _ = _measured(_Clock(), {TF: 1.0, OV: 1.0, OV_BF16: 1 / 2.4}, [*BUSY, 1.0, 1.2, 1.0, 1.0, 1.5])
    bf16, ov = record.get(*OV_BF16), record.get(*OV)
    assert bf16 is not None and ov is not None and beats(bf16, ov)
    assert _auto(record) == OV_BF16


def test_a_setting_faster_within_the_spread_is_not_recorded_as_faster() -> None:
    # bf16 (passing the gate) ran a little faster, but within both spreads: the equal-answer
    # setting is kept, so the answers do not change on a coin toss.
    def m(setting: tuple[str, str], rate: float, spread: float) -> Measurement:
        return Measurement(
            *setting,
            rate,
            1.0,
            0.0,
            agreement_in=1.0,
            agreement_out=1.0,
            n_in=5000,
            n_out=5000,
            spread=spread,
            rounds=5,
        )

    record = RuntimeRecord("abc", (m(TF, 100, 6), m(OV, 104, 8), m(OV_BF16, 115, 9)), cpu_flags=cpu_key(AMX))
    assert _auto(record) == OV
    clear = RuntimeRecord("abc", (m(TF, 100, 6), m(OV, 104, 8), m(OV_BF16, 125, 9)), cpu_flags=cpu_key(AMX))
    assert _auto(clear) == OV_BF16
    # Explicit fp32 on runtime auto: TensorFlow only when it beats OpenVINO beyond the spread.
    fp32 = choose(runtime="auto", precision="fp32", flags=AMX, record=record, saved_model="abc")
    assert (fp32.runtime, fp32.precision) == OV


def test_timing_is_the_median_and_the_farthest_round() -> None:
    timing = Timing.of(100, [1.0, 2.0, 1.0, 0.5, 1.25])
    assert timing.rates == (100.0, 50.0, 100.0, 200.0, 80.0)
    assert (timing.median, timing.spread, timing.rounds) == (100.0, 100.0, 5)
    assert all(timing.median - timing.spread <= r <= timing.median + timing.spread for r in timing.rates)


def test_unbeaten_keeps_every_setting_no_other_beats() -> None:
    fast, tied, slow = Timing((100.0, 110.0, 90.0)), Timing((95.0, 104.0, 99.0)), Timing((50.0, 52.0, 48.0))
    assert unbeaten({"fast": fast, "tied": tied, "slow": slow}) == ["fast", "tied"]


def test_interleave_refuses_no_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        interleave({"a": lambda: None}, rounds=0)
