"""Report arithmetic: latency sketches merge and stay within their stated error, units fold into run totals."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import raypipe
from raypipe.report import LATENCY_RELATIVE_ERROR, AttemptStats, CallTally, LatencySketch, RunReport, UnitStats

QUANTILES = (0.5, 0.95, 0.99)


def _latencies(n, seed=0):
    """Heavy-tailed call latencies in seconds (lognormal around 20 ms, a slow tail to seconds)."""
    rng = np.random.default_rng(seed)
    return rng.lognormal(mean=np.log(0.02), sigma=1.0, size=n)


def _within(got, exact, rel):
    return abs(got - exact) <= rel * exact + 1e-12


@pytest.mark.parametrize("n", [1, 7, 1000, 50_000])
def test_sketch_quantiles_are_within_the_stated_relative_error_of_exact_ones(n):
    values = _latencies(n, seed=n)
    s = LatencySketch()
    for v in values:
        s.add(float(v))
    assert s.count == n
    for q in QUANTILES:
        # DDSketch's guarantee is on the order statistic at rank q*(n-1) rounded down.
        exact = float(np.quantile(values, q, method="lower"))
        assert _within(s.quantile(q), exact, LATENCY_RELATIVE_ERROR), (q, s.quantile(q), exact)
    assert s.max == pytest.approx(values.max())


def test_sketch_tracks_numpys_interpolated_percentiles_on_dense_data():
    values = _latencies(20_000, seed=3)
    s = LatencySketch()
    for v in values:
        s.add(float(v))
    for q in QUANTILES:
        # Neighbouring order statistics of 20,000 samples differ by far less than 1%.
        assert _within(s.quantile(q), float(np.percentile(values, q * 100)), 2 * LATENCY_RELATIVE_ERROR)


def test_empty_sketch_has_no_quantiles_and_rejects_bad_q():
    s = LatencySketch()
    assert s.quantile(0.5) is None and s.max is None and s.count == 0
    with pytest.raises(ValueError):
        s.quantile(1.5)


def test_sketches_merge_like_one_and_survive_json():
    values = _latencies(3000, seed=1)
    parts = [LatencySketch() for _ in range(3)]
    both = LatencySketch()
    for i, v in enumerate(values):
        parts[i % 3].add(float(v))
        both.add(float(v))
    merged = LatencySketch()
    for part in parts:
        merged.merge(LatencySketch.from_dict(json.loads(json.dumps(part.to_dict()))))
    assert merged.count == both.count
    for q in QUANTILES:
        assert merged.quantile(q) == pytest.approx(both.quantile(q))
    assert merged.max == pytest.approx(both.max)


def test_sketch_memory_is_bounded_by_the_latency_range_not_the_count():
    s = LatencySketch()
    rng = random.Random(0)
    for _ in range(100_000):
        s.add(rng.uniform(0.001, 10.0))  # four decades
    # ~230 bins per decade at 1%: the stored form does not grow with the 100,000 calls.
    assert len(s.to_dict()["keys"]) < 4 * 240


def test_zero_and_negative_latencies_count_as_zero():
    s = LatencySketch()
    for v in (0.0, -0.001, 0.010):
        s.add(v)
    assert s.quantile(0.0) == 0 and s.count == 3
    assert LatencySketch.from_dict(s.to_dict()) == s


def test_legacy_histogram_markers_still_merge():
    counts = [0] * 74
    counts[20] = 5  # five calls in the bucket ending at 0.5 ms x 2**5 = 16 ms
    s = LatencySketch.from_dict(counts)
    assert s.count == 5
    assert _within(s.quantile(0.5), 0.016, LATENCY_RELATIVE_ERROR)


def unit(name, attempt, actor, seq, **kw):
    s = UnitStats(unit=name, shard="s", attempt=attempt, actor=actor, **kw)
    s.actor_stats = {
        "seq": seq,
        "breaker": {"openings": seq, "time_open_s": 1.0 * seq, "probes": seq},
        "limiter": {"min": 1, "max": 4 + seq, "final": 3},
    }
    return s


def test_fold_sums_calls_over_attempts_and_keeps_each_actors_latest_snapshot():
    units = [
        unit("u1", "a1", "x", 1, rows=10, ok=9, empty_text=1, status_counts=Counter({"OK": 3})),
        unit(
            "u2",
            "a1",
            "x",
            2,
            rows=5,
            ok=3,
            dead_letters=2,
            dead_letter_kinds=Counter({"unavailable": 2}),
            status_counts=Counter({"OK": 1, "UNAVAILABLE": 4}),
        ),
        unit("u3", "a2", "y", 1, rows=7, ok=7, status_counts=Counter({"OK": 2})),
    ]
    r = RunReport(run_id="r", mode="backfill")
    units[0].latency.add(0.010)
    units[1].latency.add(0.020)
    units[2].latency.add(0.030)
    attempts = {"a1": AttemptStats(attempt="a1"), "a2": AttemptStats(attempt="a2")}
    for u in units:
        attempts[u.attempt].add(UnitStats.from_dict(u.to_dict()))
    saved = [AttemptStats.from_dict(json.loads(json.dumps(a.to_dict()))) for a in attempts.values()]
    r.fold_attempts(saved)
    r.apply_ledger({"result:ok": 19, "result:empty_text": 1, "dead_letter:unavailable": 2})
    assert (r.rows_in, r.rows_ok, r.rows_empty_text, r.rows_dead_letters) == (22, 19, 1, 2)
    assert r.dead_letter_kinds == {"unavailable": 2}
    assert r.status_counts == {"OK": 6, "UNAVAILABLE": 4}
    assert r.breaker_openings == 2 + 1  # actor x's latest (seq 2) + actor y's
    assert r.limiter["max"] == 6 and r.limiter["actors"] == 2
    assert "UNAVAILABLE 4" in r.render()
    assert _within(r.latency_ms["p50"], 20.0, LATENCY_RELATIVE_ERROR)
    assert r.latency_ms["max"] == pytest.approx(30.0)
    assert r.latency_relative_error == LATENCY_RELATIVE_ERROR
    assert "±1%" in r.render()
    # The report's JSON form reads back (as `raypipe report` does).
    d = json.loads(json.dumps(r.to_dict()))
    d.pop("rows_results")
    assert RunReport(**d).latency_ms == r.latency_ms


# An attempt's statistics as an earlier release saved them (`attempts/<attempt>.json`, flat).
_SAVED_ATTEMPT = {
    "attempt": "a1",
    "units": 2,
    "rows": 15,
    "ok": 12,
    "empty_text": 1,
    "dead_letters": 2,
    "dead_letter_kinds": {"unavailable": 2},
    "copied": 3,
    "calls": 9,
    "status_counts": {"OK": 5, "UNAVAILABLE": 4},
    "retries": 4,
    "canaries": 1,
    "commit_s": 0.25,
    "latency": {"relative_accuracy": 0.01, "keys": [], "counts": [], "zeros": 0, "sum": 0.0, "min": None, "max": None},
    "actors": {"x": {"seq": 2}},
    "answered_by": {"openvino:fp32": 9},
    "model_cpu_s": 1.5,
}


def test_attempt_statistics_saved_by_an_earlier_release_read_back_and_save_the_same_keys():
    a = AttemptStats.from_dict(_SAVED_ATTEMPT)
    assert (a.attempt, a.units, a.calls, a.retries, a.canaries, a.model_cpu_s) == ("a1", 2, 9, 4, 1, 1.5)
    assert a.status_counts == Counter({"OK": 5, "UNAVAILABLE": 4})
    assert a.ledger() == {"result:ok": 12, "result:empty_text": 1, "dead_letter:unavailable": 2}
    assert set(a.to_dict()) == set(_SAVED_ATTEMPT)
    assert AttemptStats.from_dict(json.loads(json.dumps(a.to_dict()))) == a


def test_an_attempt_counts_its_calls_as_a_call_tally_over_the_same_units_does():
    units = [
        unit("u1", "a1", "x", 1, rows=4, ok=4, calls=2, retries=1, model_cpu_s=0.5, status_counts=Counter(OK=2)),
        unit("u2", "a1", "x", 2, rows=3, calls=5, canaries=1, committed=False, status_counts=Counter(UNAVAILABLE=5)),
    ]
    units[0].latency.add(0.01)
    attempt, tally = AttemptStats(attempt="a1"), CallTally()
    for u in units:
        attempt.add(u)
        tally.add(u)
    assert CallTally.from_dict(attempt.to_dict()) == CallTally.from_dict(tally.to_dict())
    assert (attempt.rows, attempt.ok) == (7, 4)  # rows read by both units; outcomes of the committed one
    other = AttemptStats(attempt="a2")
    other.take_calls(tally)
    assert (other.calls, other.units, other.latency.count) == (7, 0, 1)
    tally.latency.add(1.0)  # a copy: the tally goes on without changing the attempt
    assert other.latency.count == 1


def test_unit_stats_round_trip():
    u = unit("u", "a", "x", 1, rows=3, ok=3)
    u.latency.add(0.01)
    u.first_call_at = 1_790_000_000.25
    assert UnitStats.from_dict(u.to_dict()) == u
    earlier = u.to_dict()
    del earlier["first_call_at"]  # a marker an earlier release wrote
    assert UnitStats.from_dict(earlier).first_call_at is None


@pytest.mark.parametrize("status", ["completed", "incomplete", "failed"])
def test_render_mentions_status(status):
    assert status.upper() in RunReport(run_id="r", mode="daily", status=status).render()


def test_render_says_how_many_files_planning_planned_whole_from_their_size():
    r = RunReport(run_id="r", mode="backfill", status="completed")
    assert "planned whole" not in r.render()
    r.planning = {"footers_read": 1000, "whole_files": 49000, "files": {"new": 50000}}
    assert "planning      1,000 footers read | 49,000 small files planned whole" in r.render()


def summaries(n: int):
    """n unit summaries as the actors stream them back, made one at a time."""
    u = UnitStats(unit="u", shard="s", attempt="a", actor="actor", rows=2000, ok=2000, calls=63)
    u.status_counts["OK"] = 63
    for ms in (40, 55, 80):
        u.latency.add(ms / 1000)
    marker = u.to_dict()
    for i in range(n):
        marker["actor_stats"] = {"seq": i, "breaker": {"openings": 0, "time_open_s": 0.0, "probes": 0},
                                 "limiter": {"min": 2, "max": 8, "final": 6}}  # fmt: skip
        marker["actor"] = f"actor{i % 4}"
        yield UnitStats.from_dict(json.loads(json.dumps(marker)))


RAYPIPE_FILES = str(Path(raypipe.__file__).parent / "*")  # the package, not a checkout that happens to be named raypipe


def test_an_attempts_statistics_fold_in_bounded_memory():
    """Summaries are folded as they stream in: what the fold holds does not grow with the units.

    Counted from raypipe's own allocations that are still alive after a collection, so other
    threads of the test process and the collector's schedule (which earlier tests may change)
    do not enter the figure."""
    held = {}
    for n in (500, 5_000):
        attempt = AttemptStats()
        tracemalloc.start(4)
        for u in summaries(n):
            attempt.add(u)
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, RAYPIPE_FILES, all_frames=True)])
        tracemalloc.stop()
        held[n] = sum(stat.size for stat in snapshot.statistics("filename"))
        assert attempt.units == n and attempt.rows == 2000 * n and len(attempt.actors) == 4
        del attempt
    print(f"attempt fold holds: 500 units {held[500] / 1e3:.1f} kB, 5k units {held[5_000] / 1e3:.1f} kB")
    assert held[5_000] < 1.5 * held[500] + 50_000
