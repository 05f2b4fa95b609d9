"""Planning: what a run reads, cut into work units before anything is sent.

`planning` is the entry (`plan_input`, `plan_replay`, `resume`, `check_input`, the `Plan`); the
work is done by one module per job: `listing`, `footers` and `jsonl` (a shard's units),
`shards` (many shards at once), `plan` (the stored `Plan`), `selection` (per mode) and `check`
(preflight), over the vocabulary of `units` and the column checks of `schema`. Planning
imports only the floor (`raypipe.config`, `raypipe.errors`), never the stages that run after it.
"""
