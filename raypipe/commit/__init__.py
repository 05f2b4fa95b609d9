"""The results table and the story of a run's output in it.

`table` (the Delta table: schema, output rows, fenced unit commits), `protocol` (set up a
run, commit a unit, commit the run, abort), `outcomes` (`read_outcomes`, `latest`, the
ledger) and `upkeep` (compact, vacuum, migrate).
"""
