"""The results table and the story of a run's output in it.

`protocol` (one owner of a run's output: set up a run, commit a unit, commit the run, abort;
the plan, the files seen and the watermark beside them, in `state`'s formats), `fence` (the output's fence and the
mechanics of every commit into the table, driven by the protocol), `lease` (liveness: one run
id at a time per output, on `conditional` writes; `holder` tells a gone holder's process),
`table` (the Delta table: the names its log keeps, readers; its `schema`), `outcomes`
(`read_outcomes`, `latest`, the ledger) and `upkeep` (compact, vacuum, migrate, quarantine:
each holding the output as a run does).
"""
