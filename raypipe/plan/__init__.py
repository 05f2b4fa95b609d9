"""Planning: what a run reads, cut into work units before anything is sent.

Listing the input (`listing`), reading Parquet footers (`footers`), planning small files
whole from their listed sizes (`whole_files`), choosing a daily's files by the files seen
(`inputs`), and the stored `Plan` of a run (`plan`). Planning imports only the floor
(`raypipe.config`, `raypipe.errors`, `raypipe.store`), never the stages that run after it.
"""
