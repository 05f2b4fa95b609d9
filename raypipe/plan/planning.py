"""Planning: what a run reads, cut into work units before anything is sent.

    plan_input(input, mode, history)    a new run's `Plan`, in these steps:
      list_input                          the shards under the input URI (quarantined ones and
                                          hidden files skipped, each listed with why)
      daily selection                     a daily keeps the files no run has read whole yet, by
                                          the files seen (`OutputHistory.files_seen`)
      plan_listing                        small Parquet shards of a large input planned whole
                                          from their listed sizes, the others from their footers
      plan_units                          shards cut into units from their Parquet footers (or a
                                          JSON-lines file's first line); a daily `--since` prunes
                                          the row groups of unchanged files by their statistics
    plan_replay(output, of_run, ...)    a replay's `Plan`: the units of a run holding dead letters
    resume(input, plan, committed)      a resumed run's stored plan, brought up to date
    check_input(input, mode, ...)       the input as preflight checks it: listed, first shard planned

A backfill plans every shard whole. A daily plans the files no run has read whole yet (new
ones, and those whose size or ETag changed), whole, whatever their rows' `updated_at`: it
selects by the files seen, not by a watermark, and never re-reads an unchanged file. A file
rewritten in place is read whole: its unchanged texts are answered by reuse without a call, so
it costs I/O, not inference. `updated_at` orders versions for `latest`; it never decides what
is read, except that `since` adds reads: the unchanged files too, for their rows updated at
or after it (never fewer rows than without it). Shards an operator quarantined
(`raypipe.store.OutputStore.quarantine`) are skipped and listed.

Planning reads only listings, Parquet footers (one ranged GET of a shard's tail each on S3)
and the first line of JSON-lines files, so a missing column fails the run before any
inference, naming the shard and the column. The `Plan` carries what the later steps need of
the input (its columns, the bad-shard policy, the allowed clock skew), so no step after
planning reads the input's settings again.

This module is the entry callers import from; the work is done by one module per job, each
importing only those before it:

    units, schema     the vocabulary (`WorkUnit`, `ColumnNames`, `DeltaWindow`), column checks
    listing           the shards under an input URI, their fingerprints, files skipped
    footers, jsonl    a Parquet shard from its footer, a JSON-lines shard from its lines
    shards            many shards at once (`plan_units`), small ones whole (`plan_listing`)
    plan              the `Plan` and its stored form
    selection         per mode: backfill, daily, replay, and a resumed run's plan
    check             the input as preflight checks it

Planning imports only the floor (`raypipe.config`, `raypipe.errors`).
"""

from __future__ import annotations

from raypipe.plan.check import check_input
from raypipe.plan.footers import FOOTER_TAIL_BYTES, PlanObservations
from raypipe.plan.listing import InputListing, filesystem, fingerprint, list_input, list_shards
from raypipe.plan.plan import Plan
from raypipe.plan.selection import OutputHistory, plan_input, plan_replay, prune_partitions, resume
from raypipe.plan.shards import FOOTER_SAMPLE, PLANNING_THREADS, WHOLE_FILE_MAX_BYTES, plan_listing, plan_units

__all__ = [
    "FOOTER_SAMPLE",
    "FOOTER_TAIL_BYTES",
    "PLANNING_THREADS",
    "WHOLE_FILE_MAX_BYTES",
    "InputListing",
    "OutputHistory",
    "Plan",
    "PlanObservations",
    "check_input",
    "filesystem",
    "fingerprint",
    "list_input",
    "list_shards",
    "plan_input",
    "plan_listing",
    "plan_replay",
    "plan_units",
    "prune_partitions",
    "resume",
]
