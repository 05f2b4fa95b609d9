"""The report in words: the summary printed at the end of a run, its HTML table, and the
start-up and cost lines."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypipe.report.run import RunReport


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


def render_text(report: RunReport) -> str:
    """`report` as a human-readable summary, as printed at the end of a run."""
    lines = [
        f"run {report.run_id} ({report.mode}): {report.status.upper()}"
        + (f" - {report.error}" if report.error else ""),
        f"  output        {report.output}",
        f"  model         {report.model_version}"
        + (
            " (rows answered by " + ", ".join(f"{v} {n:,}" for v, n in report.model_versions.items()) + ")"
            if len(report.model_versions) > 1
            else ""
        ),
        f"  rows          in {report.rows_in:,} | results {report.rows_results:,} "
        f"(ok {report.rows_ok:,}, empty text {report.rows_empty_text:,}) | dead letters {report.rows_dead_letters:,}",
        f"  units         {report.units_committed:,}/{report.units_total:,} committed"
        f" | skipped as committed {report.units_skipped_committed:,} ({report.rows_skipped_committed:,} rows)",
        f"  throughput    {report.throughput_rows_per_s:,.1f} rows/s over {report.wall_s:,.1f} s"
        f" ({report.rows_this_attempt:,} rows this attempt) | commits {report.commit_s:,.1f} s",
        f"  calls         {report.calls:,} (retries {report.retries:,}; rows answered without a call"
        f" {report.rows_copied:,}) | latency ms p50 {report.latency_ms.get('p50')}"
        f" p95 {report.latency_ms.get('p95')} p99 {report.latency_ms.get('p99')} max {report.latency_ms.get('max')}"
        f" (quantiles ±{report.latency_relative_error:.0%})",
        f"  breaker       openings {report.breaker_openings} | open {report.breaker_time_open_s:.1f} s"
        f" | probes {report.breaker_probes}",
    ]
    if report.limiter:
        lines.append(
            f"  in-flight     limit min {report.limiter['min']} max {report.limiter['max']}"
            f" final {report.limiter['final']} ({report.limiter['actors']} actor(s))"
        )
    if report.status_counts:
        lines.append("  gRPC status   " + " | ".join(f"{k} {v:,}" for k, v in sorted(report.status_counts.items())))
    if report.answered_by:
        lines.append(
            "  answered by   "
            + " | ".join(f"{k} {v:,} rows" for k, v in sorted(report.answered_by.items(), key=lambda kv: -kv[1]))
            + f" | without a call {report.rows_copied:,}"
        )
    if report.startup:
        lines.append("  start-up      " + render_startup(report.startup))
    if report.cost:
        lines.append("  cost          " + render_cost(report.cost))
    if report.dead_letter_kinds:
        lines.append("  dead letters  " + " | ".join(f"{k} {v:,}" for k, v in sorted(report.dead_letter_kinds.items())))
    if report.window:
        lines.append(f"  window        updated_at in ({report.window.get('after')}, {report.window.get('until')}]")
    files = (report.planning or {}).get("files")
    if files:
        lines.append(
            f"  input files   new {files.get('new', 0):,} | changed {files.get('changed', 0):,}"
            f" | read before {files.get('unchanged', 0):,} | skipped {len(report.skipped_files):,}"
        )
    planned = report.planning or {}
    whole = planned.get("whole_files")
    if whole:
        lines.append(
            f"  planning      {planned.get('footers_read', 0):,} footers read | {whole:,} small files "
            "planned whole from their listed size (checked when read)"
        )
    future = (report.planning or {}).get("future_row_groups")
    if future:
        lines.append(f"  future dates  {future:,} row group(s) with updated_at beyond now + skew (watermark unmoved)")
    for skipped in report.skipped_files[:20]:
        lines.append(f"  SKIPPED       {skipped['path']}: {skipped['reason']}")
    if len(report.skipped_files) > 20:
        lines.append(f"  SKIPPED       ... and {len(report.skipped_files) - 20:,} more (in the JSON report)")
    for bad in report.bad_shards:
        lines.append(f"  BAD SHARD     {bad['shard']}: {bad['error']}")
    return "\n".join(lines)


def render_html(report: RunReport) -> str:
    """The summary of `render_text`, as an HTML table (Jupyter shows it for a bare `report`)."""
    title, *rows = render_text(report).split("\n")
    colour = {"completed": "#1a7f37", "incomplete": "#9a6700"}.get(report.status, "#cf222e")
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(line[2:16].strip())}</th>"
        f"<td style='text-align:left'>{html.escape(line[16:])}</td></tr>"
        for line in rows
    )
    return f"<div><p style='font-weight:bold;color:{colour}'>{html.escape(title)}</p><table>{cells}</table></div>"
