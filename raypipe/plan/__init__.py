"""Planning: what a run reads, cut into work units before anything is sent.

`planning` (listing, footers, whole files, a daily's selection by the files seen, the stored
`Plan`), over the vocabulary of `units` (work unit, column names, window) and the column checks
of `schema`. Planning imports only the floor (`raypipe.config`, `raypipe.errors`,
`raypipe.store`), never the stages that run after it.
"""
