"""The run report: what happened to every row, every call, and the breaker and limiter.

Actors summarise each unit they commit (`UnitStats`, stored in the commit marker); the driver
merges the summaries of all committed units (this attempt's and earlier attempts') into one
`RunReport`, printed at the end and written to `OUTPUT/runs/<run_id>.json`. Call latencies
are kept in DDSketches (bounded memory, mergeable, every quantile within a stated relative
error of the exact one), so summaries from many actors and attempts merge into one.
"""

from raypipe.report.run import RunReport, render_cost, render_startup
from raypipe.report.stats import LATENCY_RELATIVE_ERROR, AttemptStats, CallTally, LatencySketch, UnitStats

__all__ = [
    "LATENCY_RELATIVE_ERROR",
    "AttemptStats",
    "CallTally",
    "LatencySketch",
    "RunReport",
    "UnitStats",
    "render_cost",
    "render_startup",
]
