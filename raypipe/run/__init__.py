"""Running: the run modes and what a run holds while it runs.

`preflight` (checks before anything happens) -> `modes` (backfill, daily, replay) -> `steps`
(plan, execute, commit or abort, report) -> `pipeline` (read -> map_batches(actor) -> commit);
a run's `progress` and `cost`; the `driver` process around it (Ray joined quietly, SIGTERM as a
stop). What a run does on its output goes through `raypipe.commit.protocol.CommitProtocol`.
This package's face imports nothing: `raypipe.run.preflight` is importable without Ray Data.
"""
