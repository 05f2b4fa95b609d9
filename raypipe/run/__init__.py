"""Running: the run modes and what a run holds while it runs.

`preflight` (checks before anything happens) -> `modes` (backfill, daily, replay) ->
`pipeline` (read -> map_batches(actor) -> commit); a run's state on its output (`state`),
its `lease`, `progress` and `cost`. This package's face imports nothing: `raypipe.run.preflight`
is importable without Ray Data.
"""
