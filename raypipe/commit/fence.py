"""The output's fence, and every commit into the outcomes table, each carrying it.

The commit protocol (`raypipe.commit.protocol`) is the only caller: it tells the order of a
run's steps; this module holds the mechanics of each commit it makes. Nothing else writes
to the table.

**The fence is the table's own concurrency control**, not a check before a write, and it is
one fence for the whole output, whatever the run id. The output owns `SLOTS` application
transactions (Delta `txn` actions, `raypipe.commit.table.slot_app`) whose version is the
output's generation. Whoever takes the output over (a run of any id, a retried attempt,
maintenance) commits the next generation to every slot (`take_over`). Every later commit of
that holder carries the slots at its generation and is built on a snapshot in which they
still hold it; Delta's conflict checker rejects a commit whose application transaction was
set by any commit after its snapshot. So once a take-over is in the log, every commit of
every older holder fails (`LeaseLostError`), of its own run id or another, however long it
was stalled, and there is no window between a check and a write.

- `UnitCommitter.commit`: a unit's rows (results and dead letters) in **one** Delta commit,
  visible together or not at all; files a failed or fenced-off commit wrote are in no
  commit, so no reader sees them (`raypipe vacuum` removes them). It carries only its unit's
  slot, so a holder's actors commit side by side (two unit commits conflict only when their
  units share a slot; the later one retries on a fresh snapshot), and the unit's own
  transaction, so a unit committed twice in one generation (a Ray task retried after its
  actor died past the commit) is written once. A run's own transactions (units, plan pointer,
  run commit) carry `lastUpdated`, so `delta.setTransactionRetentionDuration` (90 days)
  prunes them; the output's (the slots, files seen, quarantine, watermark) carry none and
  are kept (the rule: `raypipe.commit.table.expires`).
- `set_pointer` (plan, files seen, quarantine, watermark), `mark_committed` (a run's commit)
  and a maintenance commit (`fence_transactions`) carry every slot.
- `retire`: a holder fences off its own writers (`CommitProtocol.abort`).

Every commit here is made by `raypipe.commit.retry`: one commit carries a token of its own, so
one that landed though its call raised (S3 carried the PUT out and lost the answer) is
recognised as ours, not taken for a conflict with another holder; and one retry loop looks again
on a fresh snapshot after a conflict with a commit not ours (a jittered wait, injectable sleep).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raypipe.commit.retry import commit_failed, commit_once, empty_commit, jitter, retry_commit
from raypipe.commit.table import (
    SLOTS,
    OutcomeTable,
    as_sink_error,
    done_app,
    expires,
    generation_of,
    slot_app,
    unit_app,
    unit_slot,
)
from raypipe.errors import LeaseLostError, SinkError

__all__ = [
    "TableFence",
    "UnitCommitter",
    "check_fence",
    "fence_transactions",
    "fenced_commit",
    "mark_committed",
    "retire",
    "set_pointer",
    "take_over",
]


@dataclass(frozen=True)
class TableFence:
    """What a writer needs to commit as the output's holder (picklable: it travels to actors):
    the run id its rows and transactions are of, and the output generation its take-over set."""

    output_uri: str
    run_id: str
    generation: int


def take_over(
    table: OutcomeTable, run_id: str, *, holder: str = "", sleep: Callable[[float], None] = time.sleep
) -> TableFence:
    """Commits the output's next generation to every slot, for run `run_id`: every older
    holder, of any run id, is fenced off.

    Two takers of the same generation cannot both win: the second commit's transactions
    conflict with the first's, and it raises `LeaseLostError`.
    """
    from deltalake import Transaction

    def attempt(_: int) -> TableFence:
        dt = table.refresh()  # the next generation of the latest, not of what the run read earlier
        generation = generation_of(dt) + 1
        metadata = {"raypipe.operation": "take-over", "raypipe.run_id": run_id, "holder": holder}
        slots = [Transaction(slot_app(s), generation) for s in range(SLOTS)]
        try:
            commit_once(dt, slots, metadata)
        except commit_failed():
            if generation_of(table.refresh()) >= generation:
                raise LeaseLostError(
                    f"run {run_id}: another holder took over {table.uri} at the same moment (generation "
                    f"{generation}); this one stops",
                    holder=run_id,
                    expires_at="?",
                ) from None
            raise  # a unit commit of the older holder landed first: our snapshot is stale. Again.
        return TableFence(table.output_uri, run_id, generation)

    return _until_settled(attempt, sleep, f"take over run {run_id}", table)


def retire(table: OutcomeTable, fence: TableFence, *, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Fences off `fence`'s holder itself (the output's slots move to the next generation),
    unless a newer holder took the output already; True if it did (`CommitProtocol.abort`)."""
    from deltalake import Transaction

    def attempt(_: int) -> bool:
        dt = table.refresh()
        if generation_of(dt) != fence.generation:
            return False  # a newer holder took over: the output is its, leave it be
        slots = [Transaction(slot_app(s), fence.generation + 1) for s in range(SLOTS)]
        metadata = {"raypipe.operation": "abort", "raypipe.run_id": fence.run_id}
        commit_once(dt, slots, metadata)  # a conflict (a commit of ours or a take-over) looks again
        return True

    return _until_settled(attempt, sleep, f"abort run {fence.run_id}", table)


def fence_transactions(fence: TableFence) -> list[Any]:
    """Every slot of the output at `fence`'s generation: what a commit of the whole output
    carries (a pointer, a run commit, a compaction), so any take-over after its snapshot
    makes it fail."""
    from deltalake import Transaction

    return [Transaction(slot_app(s), fence.generation) for s in range(SLOTS)]


def check_fence(dt: Any, fence: TableFence, slot: int = 0) -> None:
    """Raises `LeaseLostError` if the snapshot `dt` is no longer at `fence`'s generation."""
    current = generation_of(dt, slot)
    if current != fence.generation:
        raise LeaseLostError(
            f"run {fence.run_id}: this holder of the output (generation {fence.generation}) was fenced off by "
            f"generation {current}; it stops writing",
            holder=fence.run_id,
            expires_at="?",
        )


def fenced_commit(
    table: OutcomeTable,
    fence: TableFence,
    mark: Callable[[Any], tuple[str, int]],
    metadata: dict[str, str],
    *,
    failure: str,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """One commit of no rows that sets the app transaction `mark(snapshot)` names, with the
    output's slots at `fence`'s generation, on a snapshot where they still hold it: the run's
    own as it stands (moved after its own commits) first, a fresh one after a conflict.

    A conflicting commit makes it look again (`mark` runs again on the new snapshot); once a
    newer holder took over, `LeaseLostError`. Returns the version the app was set to."""

    def attempt(n: int) -> int:
        # The first try commits from the run's snapshot as it stands (the protocol moved it after
        # its own commits); any commit after it that set the same transactions (a take-over, a
        # pointer of another holder, a unit of this one) makes this one conflict, and the next
        # try reads the log again.
        dt = table.refresh() if n else table.load()
        check_fence(dt, fence)
        app, version = mark(dt)
        commit_once(dt, [*fence_transactions(fence), _transaction(app, version, clock)], metadata)
        return version

    return retry_commit(
        attempt, tries=50, wait=jitter(0.01, 0.2), sleep=sleep, failure=lambda: SinkError(failure, path=table.uri)
    )


def _transaction(app: str, version: int, clock: Callable[[], float]) -> Any:
    """`app` at `version`, stamped with the time if it expires (`raypipe.commit.table.expires`)."""
    from deltalake import Transaction

    return Transaction(app, version, last_updated=int(clock() * 1000) if expires(app) else None)


def set_pointer(
    table: OutcomeTable,
    fence: TableFence,
    app: str,
    write: Callable[[int | None], int],
    *,
    operation: str,
    clock: Callable[[], float] = time.time,
) -> int:
    """Points `app` at a new state file (or value), fenced like a unit commit.

    `write(current)` gets the number `app` holds on the snapshot the commit is built on, writes a new immutable
    file (under a name no other writer uses) from it and returns that file's number; one
    commit then sets `app` to it, with the output's slots at `fence`'s generation. A
    concurrent pointer change is a conflict: `write` runs again on the new state. Once a newer
    holder took over, `LeaseLostError`, and the file written stays unreferenced."""

    def mark(dt: Any) -> tuple[str, int]:
        current = dt.transaction_version(app)
        return app, write(None if current is None else int(current))

    return fenced_commit(
        table,
        fence,
        mark,
        {"raypipe.operation": operation, "raypipe.run_id": fence.run_id},
        failure=f"could not record {operation} for run {fence.run_id}",
        clock=clock,
    )


def mark_committed(
    table: OutcomeTable,
    fence: TableFence,
    run_id: str,
    metadata: dict[str, str],
    *,
    clock: Callable[[], float] = time.time,
) -> None:
    """The run commit of `run_id`, fenced (a rerun does nothing new): what makes a run
    committed. `CommitProtocol.commit_run` checks every unit first; `raypipe migrate` records
    the runs an earlier release finished."""
    fenced_commit(
        table,
        fence,
        lambda dt: (done_app(run_id), fence.generation),
        {"raypipe.operation": "run-committed", "raypipe.run_id": run_id, **metadata},
        failure=f"could not record run {run_id} as committed",
        clock=clock,
    )


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _replace_predicate(run_id: str, unit: str) -> str:
    """A replay's MERGE condition. The run and unit as literals let delta-rs prune the scan
    (and the files its conflict check records as read) to the unit's own file; from the source
    columns alone it infers the whole `run_id` partition, and replays of different units of
    one run would conflict with each other."""
    return (
        f"t.run_id = {_sql_string(run_id)} AND t.unit = {_sql_string(unit)} AND t.outcome = 'dead_letter' "
        "AND t.run_id = s.run_id AND t.unit = s.unit AND t.id = s.id AND t.source = s.source AND t.row = s.row"
    )


def _replace_updates(columns: list[str]) -> dict[str, str]:
    """A replay's MERGE assignments: the new row, but `first_inferred_at` keeps the run's place (`LATEST_SQL`)."""
    updates = {f"`{c}`": f"s.`{c}`" for c in columns}
    if "first_inferred_at" in columns:  # every table `ensure` has seen
        updates["`first_inferred_at`"] = "coalesce(t.first_inferred_at, t.inferred_at)"
    return updates


class UnitCommitter:
    """The unit commit: commits units of one holder of the output into the outcomes table
    (picklable: `CommitProtocol.unit_committer` hands one to each actor).

    A unit is committed in **one** Delta commit: its results and dead letters become visible
    together, or not at all. Files a failed or fenced-off commit wrote are in no commit, so no
    reader sees them (`raypipe vacuum` removes them). The commit carries the output's slot of
    its unit at the holder's generation and the unit's own transaction, so it cannot land once
    anyone took the output over, and a unit retried in one generation is committed once.
    Commits of one committer are serialised (one `DeltaTable` per actor, kept up to date
    incrementally); commits of several actors run side by side (the slots: see the module
    docstring).
    """

    def __init__(
        self,
        fence: TableFence,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fence = fence
        self._table = OutcomeTable(fence.output_uri)
        self._sleep = sleep
        self._clock = clock
        self._dt: Any = None
        self._schema: pa.Schema | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"fence": self.fence}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fence"])  # type: ignore[misc]

    def _fresh(self) -> Any:
        self._dt = self._table.refresh()
        return self._dt

    def _conform(self, rows: pa.Table, schema: pa.Schema) -> pa.Table:
        """The rows in the table's full schema (other labels' columns null)."""
        n = rows.num_rows
        columns = [
            rows.column(f.name).cast(f.type) if f.name in rows.column_names else pa.nulls(n, f.type) for f in schema
        ]
        return pa.Table.from_arrays(columns, schema=schema)

    def commit(self, unit: str, rows: pa.Table, *, replace_dead_letters: bool = False, max_tries: int = 50) -> bool:
        """Commits one unit's rows (results and dead letters) in one Delta commit.

        With `replace_dead_letters` (a replay) the rows replace, in the same commit, the
        committed dead letters they re-inferred (same run, unit, id, source and row): each id
        is a result or a dead letter of its run, never both, never neither.

        Returns False if this generation had already committed the unit (nothing is written);
        raises `LeaseLostError` once a newer attempt took over.
        """
        from deltalake import Transaction, write_deltalake

        slot = unit_slot(unit)
        run_id, generation = self.fence.run_id, self.fence.generation

        def write(dt: Any, props: Any) -> None:
            assert self._schema is not None
            if rows.num_rows and replace_dead_letters:
                conformed = self._conform(rows, self._schema)
                (
                    dt.merge(
                        conformed,
                        predicate=_replace_predicate(conformed.column("run_id")[0].as_py(), unit),
                        source_alias="s",
                        target_alias="t",
                        commit_properties=props,
                    )
                    .when_matched_update(updates=_replace_updates(conformed.column_names))
                    .execute()
                )
            elif rows.num_rows:
                conformed = self._conform(rows, self._schema)
                write_deltalake(dt, conformed, mode="append", partition_by=["run_id"], commit_properties=props)
            else:
                empty_commit(dt, props)

        def attempt(n: int) -> bool:
            try:
                dt = self._fresh()
                check_fence(dt, self.fence, slot)
                if dt.transaction_version(unit_app(run_id, unit)) is not None:
                    return False
                if self._schema is None or n:
                    self._schema = pa.schema(dt.schema().to_arrow())
                transactions = [
                    Transaction(slot_app(slot), generation),
                    # Stamped, so the table's transaction retention prunes it: ~47k
                    # units per backfill would otherwise sit in every snapshot forever.
                    _transaction(unit_app(run_id, unit), generation, self._clock),
                ]
                metadata = {"raypipe.unit": unit, "raypipe.generation": str(generation)}
                # Another commit of this slot or unit won: `retry_commit` looks again on a fresh
                # snapshot (a newer generation there fences us off above).
                commit_once(dt, transactions, metadata, write)
                return True
            except (LeaseLostError, SinkError, commit_failed()):
                raise
            except Exception as e:
                raise as_sink_error(e, self._table.uri) from e

        with self._lock:
            return retry_commit(
                attempt,
                tries=max_tries,
                wait=lambda n: random.uniform(0.005, 0.05) * min(n, 10),  # noqa: S311  jitter, not a secret
                sleep=self._sleep,
                failure=lambda: SinkError(
                    f"unit {unit}: gave up after {max_tries} conflicting commits", path=self._table.uri
                ),
            )


def _until_settled(
    attempt: Callable[[int], Any], sleep: Callable[[float], None], what: str, table: OutcomeTable
) -> Any:
    """`attempt` again on a conflict, as a take-over and an abort both retry: 20 tries, short jitter."""
    return retry_commit(
        attempt,
        tries=20,
        wait=jitter(0.01, 0.1),
        sleep=sleep,
        failure=lambda: SinkError(f"could not {what}: the table kept changing under us", path=table.uri),
    )
