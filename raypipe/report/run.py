"""`RunReport`: what happened to every row and call of a run, built from its committed units'
summaries and the table's row counts, and rendered as the summary a run prints (text, or an
HTML table in Jupyter)."""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from raypipe.report.stats import LATENCY_RELATIVE_ERROR, AttemptStats, LatencySketch


def render_startup(startup: dict[str, float]) -> str:
    """The report's start-up line: seconds from the attempt's start to each step reached."""
    steps = (("ray_s", "Ray ready"), ("first_call_s", "first call"), ("first_unit_s", "first unit done"))
    return " | ".join(f"{label} {startup[key]:,.1f} s" for key, label in steps if startup.get(key) is not None)


def render_cost(cost: dict[str, Any]) -> str:
    """The report's cost line from `raypipe.run.cost.Cost.to_dict`."""
    return (
        f"{cost['cpu_s_per_1k']:,.2f} CPU-s per 1,000 paragraphs (model {cost['model_share']:.0%})"
        f" | ${cost['usd_per_million']:,.3f} per million at ${cost['core_hour_usd']:g}/core-hour"
        f" | {cost['cores_busy']:.2f} cores busy on {cost['nodes']} node(s)"
    )


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
        """A human-readable summary, as printed at the end of a run."""
        lines = [
            f"run {self.run_id} ({self.mode}): {self.status.upper()}" + (f" - {self.error}" if self.error else ""),
            f"  output        {self.output}",
            f"  model         {self.model_version}"
            + (
                " (rows answered by " + ", ".join(f"{v} {n:,}" for v, n in self.model_versions.items()) + ")"
                if len(self.model_versions) > 1
                else ""
            ),
            f"  rows          in {self.rows_in:,} | results {self.rows_results:,} "
            f"(ok {self.rows_ok:,}, empty text {self.rows_empty_text:,}) | dead letters {self.rows_dead_letters:,}",
            f"  units         {self.units_committed:,}/{self.units_total:,} committed"
            f" | skipped as committed {self.units_skipped_committed:,} ({self.rows_skipped_committed:,} rows)",
            f"  throughput    {self.throughput_rows_per_s:,.1f} rows/s over {self.wall_s:,.1f} s"
            f" ({self.rows_this_attempt:,} rows this attempt) | commits {self.commit_s:,.1f} s",
            f"  calls         {self.calls:,} (retries {self.retries:,}; rows answered without a call"
            f" {self.rows_copied:,}) | latency ms p50 {self.latency_ms.get('p50')}"
            f" p95 {self.latency_ms.get('p95')} p99 {self.latency_ms.get('p99')} max {self.latency_ms.get('max')}"
            f" (quantiles ±{self.latency_relative_error:.0%})",
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
        if self.answered_by:
            lines.append(
                "  answered by   "
                + " | ".join(f"{k} {v:,} rows" for k, v in sorted(self.answered_by.items(), key=lambda kv: -kv[1]))
                + f" | without a call {self.rows_copied:,}"
            )
        if self.startup:
            lines.append("  start-up      " + render_startup(self.startup))
        if self.cost:
            lines.append("  cost          " + render_cost(self.cost))
        if self.dead_letter_kinds:
            lines.append(
                "  dead letters  " + " | ".join(f"{k} {v:,}" for k, v in sorted(self.dead_letter_kinds.items()))
            )
        if self.window:
            lines.append(f"  window        updated_at in ({self.window.get('after')}, {self.window.get('until')}]")
        files = (self.planning or {}).get("files")
        if files:
            lines.append(
                f"  input files   new {files.get('new', 0):,} | changed {files.get('changed', 0):,}"
                f" | read before {files.get('unchanged', 0):,} | skipped {len(self.skipped_files):,}"
            )
        planned = self.planning or {}
        whole = planned.get("whole_files")
        if whole:
            lines.append(
                f"  planning      {planned.get('footers_read', 0):,} footers read | {whole:,} small files "
                "planned whole from their listed size (checked when read)"
            )
        future = (self.planning or {}).get("future_row_groups")
        if future:
            lines.append(
                f"  future dates  {future:,} row group(s) with updated_at beyond now + skew (watermark unmoved)"
            )
        for skipped in self.skipped_files[:20]:
            lines.append(f"  SKIPPED       {skipped['path']}: {skipped['reason']}")
        if len(self.skipped_files) > 20:
            lines.append(f"  SKIPPED       ... and {len(self.skipped_files) - 20:,} more (in the JSON report)")
        for bad in self.bad_shards:
            lines.append(f"  BAD SHARD     {bad['shard']}: {bad['error']}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The same summary as `render`, as an HTML table (Jupyter shows it for a bare `report`)."""
        title, *rows = self.render().split("\n")
        colour = {"completed": "#1a7f37", "incomplete": "#9a6700"}.get(self.status, "#cf222e")
        cells = "".join(
            f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(line[2:16].strip())}</th>"
            f"<td style='text-align:left'>{html.escape(line[16:])}</td></tr>"
            for line in rows
        )
        return f"<div><p style='font-weight:bold;color:{colour}'>{html.escape(title)}</p><table>{cells}</table></div>"
