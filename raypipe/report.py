"""The run report: what happened to every row, every call, and the breaker and limiter.

Actors summarise each unit they commit (`UnitStats`, stored in the commit marker); the driver
merges the summaries of all committed units (this attempt's and earlier attempts') into one
`RunReport`, printed at the end and written to `OUTPUT/runs/<run_id>.json`. Latencies are
kept as log-bucketed histograms so summaries from many actors merge exactly.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LatencyHistogram", "RunReport", "UnitStats"]

# Bucket upper bounds in seconds: 0.5 ms .. ~140 s, about 19% apart.
_BOUNDS = tuple(0.0005 * 2 ** (i / 4) for i in range(73))


@dataclass
class LatencyHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(_BOUNDS) + 1))

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BOUNDS, seconds)] += 1

    def merge(self, other: LatencyHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def percentile(self, q: float) -> float | None:
        """The q-quantile (0..1) in seconds, as its bucket's upper bound; None if empty."""
        total = self.total
        if not total:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return _BOUNDS[i] if i < len(_BOUNDS) else float("inf")
        return None  # pragma: no cover - unreachable: rank <= total


@dataclass
class UnitStats:
    """What one unit's processing saw; stored in its commit marker."""

    unit: str
    shard: str
    attempt: str
    actor: str
    rows: int = 0
    ok: int = 0
    empty_text: int = 0
    dead_letters: int = 0
    dead_letter_kinds: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    status_counts: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    actor_stats: dict[str, Any] = field(default_factory=dict)
    """A snapshot of the actor's breaker and limiter when the unit was committed."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency"] = self.latency.counts
        d["dead_letter_kinds"] = dict(self.dead_letter_kinds)
        d["status_counts"] = dict(self.status_counts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitStats:
        d = dict(d)
        d["latency"] = LatencyHistogram(list(d.get("latency") or LatencyHistogram().counts))
        d["dead_letter_kinds"] = Counter(d.get("dead_letter_kinds") or {})
        d["status_counts"] = Counter(d.get("status_counts") or {})
        return cls(**d)


@dataclass
class RunReport:
    run_id: str
    mode: str
    status: str = "running"
    """`completed` (every unit committed), `incomplete` (bad shards left units out) or `failed`."""
    input: str | None = None
    output: str = ""
    model_version: str = ""
    labels: list[str] = field(default_factory=list)
    started_at: str = ""
    finished_at: str = ""
    wall_s: float = 0.0
    units_total: int = 0
    units_committed: int = 0
    units_skipped_committed: int = 0
    """Units found committed by an earlier attempt of this run and not redone."""
    units_redone: int = 0
    """Units an earlier attempt had started but not committed, processed again."""
    rows_in: int = 0
    rows_ok: int = 0
    rows_empty_text: int = 0
    rows_dead_letters: int = 0
    rows_skipped_committed: int = 0
    rows_redone: int = 0
    rows_this_attempt: int = 0
    dead_letter_kinds: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    """Per gRPC status, one count per call attempt (the reference build's table)."""
    retries: int = 0
    breaker_openings: int = 0
    breaker_time_open_s: float = 0.0
    breaker_probes: int = 0
    limiter: dict[str, Any] = field(default_factory=dict)
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    throughput_rows_per_s: float = 0.0
    bad_shards: list[dict[str, str]] = field(default_factory=list)
    window: dict[str, str | None] | None = None
    replay_of: str | None = None
    error: str | None = None

    @property
    def rows_results(self) -> int:
        return self.rows_ok + self.rows_empty_text

    def merge_units(self, units: list[UnitStats]) -> None:
        """Totals over every committed unit, whichever attempt committed it."""
        kinds: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        hist = LatencyHistogram()
        actors: dict[tuple[str, str], dict[str, Any]] = {}
        for u in units:
            self.rows_in += u.rows
            self.rows_ok += u.ok
            self.rows_empty_text += u.empty_text
            self.rows_dead_letters += u.dead_letters
            kinds.update(u.dead_letter_kinds)
            statuses.update(u.status_counts)
            self.calls += u.calls
            self.retries += u.retries
            hist.merge(u.latency)
            if u.actor_stats:
                key = (u.attempt, u.actor)
                if key not in actors or u.actor_stats.get("seq", 0) >= actors[key].get("seq", 0):
                    actors[key] = u.actor_stats
        self.units_committed = len(units)
        self.dead_letter_kinds = dict(kinds)
        self.status_counts = dict(statuses)
        self.latency_ms = {
            name: None if (p := hist.percentile(q)) is None else round(p * 1000, 2)
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }
        breakers = [a["breaker"] for a in actors.values() if "breaker" in a]
        self.breaker_openings = sum(b["openings"] for b in breakers)
        self.breaker_time_open_s = round(sum(b["time_open_s"] for b in breakers), 3)
        self.breaker_probes = sum(b["probes"] for b in breakers)
        limiters = [a["limiter"] for a in actors.values() if "limiter" in a]
        if limiters:
            self.limiter = {
                "actors": len(limiters),
                "min": min(x["min"] for x in limiters),
                "max": max(x["max"] for x in limiters),
                "final": [x["final"] for x in limiters],
            }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows_results"] = self.rows_results
        return d

    def render(self) -> str:
        """A human-readable summary, as printed at the end of a run."""
        lines = [
            f"run {self.run_id} ({self.mode}): {self.status.upper()}" + (f" - {self.error}" if self.error else ""),
            f"  output        {self.output}",
            f"  model         {self.model_version}",
            f"  rows          in {self.rows_in:,} | results {self.rows_results:,} "
            f"(ok {self.rows_ok:,}, empty text {self.rows_empty_text:,}) | dead letters {self.rows_dead_letters:,}",
            f"  units         {self.units_committed:,}/{self.units_total:,} committed"
            f" | skipped as committed {self.units_skipped_committed:,} ({self.rows_skipped_committed:,} rows)"
            f" | redone {self.units_redone:,} ({self.rows_redone:,} rows)",
            f"  throughput    {self.throughput_rows_per_s:,.1f} rows/s over {self.wall_s:,.1f} s"
            f" ({self.rows_this_attempt:,} rows this attempt)",
            f"  calls         {self.calls:,} (retries {self.retries:,}) | latency ms p50 {self.latency_ms.get('p50')}"
            f" p95 {self.latency_ms.get('p95')} p99 {self.latency_ms.get('p99')}",
            f"  breaker       openings {self.breaker_openings} | open {self.breaker_time_open_s:.1f} s"
            f" | probes {self.breaker_probes}",
        ]
        if self.limiter:
            lines.append(
                f"  in-flight     limit min {self.limiter['min']} max {self.limiter['max']}"
                f" final {self.limiter['final']} ({self.limiter['actors']} actor(s))"
            )
        if self.status_counts:
            lines.append("  gRPC status   " + " | ".join(f"{k} {v:,}" for k, v in sorted(self.status_counts.items())))
        if self.dead_letter_kinds:
            lines.append(
                "  dead letters  " + " | ".join(f"{k} {v:,}" for k, v in sorted(self.dead_letter_kinds.items()))
            )
        if self.window:
            lines.append(f"  window        updated_at in ({self.window.get('after')}, {self.window.get('until')}]")
        for bad in self.bad_shards:
            lines.append(f"  BAD SHARD     {bad['shard']}: {bad['error']}")
        return "\n".join(lines)
