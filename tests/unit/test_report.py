"""Report arithmetic: histograms merge exactly, units fold into run totals."""

from __future__ import annotations

from collections import Counter

import pytest

from raypipe.report import LatencyHistogram, RunReport, UnitStats


def test_histogram_percentiles_are_bucket_bounds_within_20_percent():
    h = LatencyHistogram()
    for ms in range(1, 1001):
        h.add(ms / 1000)
    for q, exact in ((0.5, 0.5), (0.95, 0.95), (0.99, 0.99)):
        got = h.percentile(q)
        assert exact <= got <= exact * 1.2
    assert LatencyHistogram().percentile(0.5) is None


def test_histograms_merge_like_one():
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, s in enumerate([0.001 * k for k in range(1, 200)]):
        (a if i % 2 else b).add(s)
        both.add(s)
    a.merge(b)
    assert a.counts == both.counts


def unit(name, attempt, actor, seq, **kw):
    s = UnitStats(unit=name, shard="s", attempt=attempt, actor=actor, **kw)
    s.actor_stats = {
        "seq": seq,
        "breaker": {"openings": seq, "time_open_s": 1.0 * seq, "probes": seq},
        "limiter": {"min": 1, "max": 4 + seq, "final": 3},
    }
    return s


def test_merge_sums_rows_and_keeps_each_actors_latest_snapshot():
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
    r.merge_units([UnitStats.from_dict(u.to_dict()) for u in units])
    assert (r.rows_in, r.rows_ok, r.rows_empty_text, r.rows_dead_letters) == (22, 19, 1, 2)
    assert r.rows_results + r.rows_dead_letters == r.rows_in
    assert r.status_counts == {"OK": 6, "UNAVAILABLE": 4}
    assert r.breaker_openings == 2 + 1  # actor x's latest (seq 2) + actor y's
    assert r.limiter["max"] == 6 and r.limiter["actors"] == 2
    assert "UNAVAILABLE 4" in r.render()


def test_unit_stats_round_trip():
    u = unit("u", "a", "x", 1, rows=3, ok=3)
    u.latency.add(0.01)
    assert UnitStats.from_dict(u.to_dict()) == u


@pytest.mark.parametrize("status", ["completed", "incomplete", "failed"])
def test_render_mentions_status(status):
    assert status.upper() in RunReport(run_id="r", mode="daily", status=status).render()
