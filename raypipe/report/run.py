"""`RunReport`: what happened to every row and call of a run, built from its committed units'
summaries and the table's row counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from raypipe.report.render import render_html, render_text
from raypipe.report.stats import LATENCY_RELATIVE_ERROR, AttemptStats, LatencySketch


@dataclass
class RunReport:
    run_id: str
    mode: str
    status: str = "running"
    """`completed` (every unit committed), `incomplete` (bad shards left units out) or `failed`."""
    input: str | None = None
    output: str = ""
    model_version: str = ""
    model_versions: dict[str, int] = field(default_factory=dict)
    """The run's committed results by the model version that answered them, over every attempt:
    more than one only when a resume was allowed to change model (`output.allow_model_change`)."""
    labels: list[str] = field(default_factory=list)
    started_at: str = ""
    finished_at: str = ""
    wall_s: float = 0.0
    units_total: int = 0
    units_committed: int = 0
    units_skipped_committed: int = 0
    """Units found committed by an earlier attempt of this run and not redone."""
    rows_in: int = 0
    rows_ok: int = 0
    rows_empty_text: int = 0
    rows_dead_letters: int = 0
    rows_skipped_committed: int = 0
    rows_this_attempt: int = 0
    dead_letter_kinds: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    """Per gRPC status, one count per call attempt (the reference build's table)."""
    retries: int = 0
    canaries: int = 0
    breaker_openings: int = 0
    breaker_time_open_s: float = 0.0
    breaker_probes: int = 0
    limiter: dict[str, Any] = field(default_factory=dict)
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    """Call latency quantiles (p50, p95, p99, max) over every call attempt, in ms."""
    latency_relative_error: float = LATENCY_RELATIVE_ERROR
    """Each `latency_ms` quantile is within this fraction of the exact one (max is exact)."""
    throughput_rows_per_s: float = 0.0
    commit_s: float = 0.0
    """Seconds the actors spent committing units (summed over actors and attempts)."""
    rows_copied: int = 0
    """Rows answered without a call: their text already had a committed answer of this model
    version (a paragraph whose metadata changed), or another row of the unit had the same text."""
    bad_shards: list[dict[str, str]] = field(default_factory=list)
    skipped_files: list[dict[str, str]] = field(default_factory=list)
    """Files under the input that were not read, with why (hidden, unknown extension, quarantined)."""
    window: dict[str, str | None] | None = None
    replay_of: str | None = None
    planning: dict[str, Any] | None = None
    """What planning saw without reading rows: row groups pruned by a daily's window, rows with a
    null updated_at (never in a window), the point a backfill read its input as of."""
    answered_by: dict[str, int] = field(default_factory=dict)
    """Rows the service answered, by runtime x precision ("openvino:bf16"), over every attempt: on a
    pool of mixed CPUs each replica serves its own CPU's fastest gated setting."""
    startup: dict[str, float] | None = None
    """Seconds from this attempt's start until Ray was ready (`ray_s`: joined or started), the
    first call went out (`first_call_s`: the inference actors started, their first unit read) and
    the first unit was done (`first_unit_s`): what a short run spends before the model works."""
    cost: dict[str, Any] | None = None
    """What this attempt cost (`raypipe.run.cost.Cost.to_dict`): CPU-seconds of every process of the
    cluster per 1,000 paragraphs, the model's share, the price per million paragraphs."""
    error: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunReport:
        """A report read back from `runs/<run_id>.json` (derived and unknown keys dropped)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def rows_results(self) -> int:
        return self.rows_ok + self.rows_empty_text

    def fold_attempts(self, attempts: Iterable[AttemptStats]) -> None:
        """Call statistics summed over every attempt of the run (this one and earlier ones)."""
        statuses: Counter[str] = Counter()
        answered_by: Counter[str] = Counter()
        latency = LatencySketch()
        actors: list[dict[str, Any]] = []
        self.calls = self.retries = self.canaries = self.rows_copied = 0
        self.commit_s = 0.0
        for a in attempts:
            self.rows_copied += a.copied
            statuses.update(a.status_counts)
            answered_by.update(a.answered_by)
            self.calls += a.calls
            self.retries += a.retries
            self.canaries += a.canaries
            self.commit_s += a.commit_s
            latency.merge(a.latency)
            actors += a.actors.values()
        self.commit_s = round(self.commit_s, 3)
        self.status_counts = dict(statuses)
        self.answered_by = dict(answered_by)
        self.latency_ms = {  # a quantile within the sketch's error may pass the exact max: cap it
            name: None if (p := latency.quantile(q)) is None else round(min(p, latency.max or p) * 1000, 3)
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }
        self.latency_ms["max"] = None if latency.max is None else round(latency.max * 1000, 3)
        self.latency_relative_error = latency.relative_accuracy
        breakers = [a["breaker"] for a in actors if "breaker" in a]
        self.breaker_openings = sum(b["openings"] for b in breakers)
        self.breaker_time_open_s = round(sum(b["time_open_s"] for b in breakers), 3)
        self.breaker_probes = sum(b["probes"] for b in breakers)
        limiters = [a["limiter"] for a in actors if "limiter" in a]
        if limiters:
            self.limiter = {
                "actors": len(limiters),
                "min": min(x["min"] for x in limiters),
                "max": max(x["max"] for x in limiters),
                "final": [x["final"] for x in limiters],
            }

    def apply_ledger(self, counts: dict[str, int]) -> None:
        """Row counts from the run's committed rows in the table (`raypipe.commit.outcomes.ledger`)."""
        self.rows_ok = counts.get("result:ok", 0)
        self.rows_empty_text = counts.get("result:empty_text", 0)
        self.dead_letter_kinds = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("dead_letter:")}
        self.rows_dead_letters = sum(self.dead_letter_kinds.values())
        self.rows_in = self.rows_results + self.rows_dead_letters

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows_results"] = self.rows_results
        return d

    def render(self) -> str:
        """A human-readable summary, as printed at the end of a run (`render_text`)."""
        return render_text(self)

    def _repr_html_(self) -> str:
        """The same summary as `render`, as an HTML table (Jupyter shows it for a bare `report`)."""
        return render_html(self)
