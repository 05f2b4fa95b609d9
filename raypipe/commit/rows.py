"""A unit's rows for the outcomes table, built beside its schema (`raypipe.commit.table`).

Every input row of a unit becomes exactly one output row: a result (the model's answer, or
``status`` ``empty_text`` for a row with no text to send) or a dead letter (why it has no
answer). The actor says which rows got which fate (`Answers`, `DeadLetters`, the empty rows);
`unit_rows` turns that into the table's columns in one pass over arrays (no Python per row),
sorted by (source, row) so a unit's file reads in input order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pyarrow as pa

from raypipe.commit.schema import (
    OUTCOME_DEAD_LETTER,
    OUTCOME_RESULT,
    RESULT_STATUS_EMPTY,
    RESULT_STATUS_OK,
    label_column,
    outcome_schema,
)

__all__ = ["Answers", "DeadLetters", "unit_rows"]

#: A dead letter's message is cut to this many characters (a row's error, not a log).
MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class Answers:
    """Rows of the unit the model answered (or whose answer was reused)."""

    rows: np.ndarray
    """int64 indices into the unit's table."""
    probabilities: np.ndarray
    """float32 ``[len(rows), labels]``, in the run's label order."""
    truncated: np.ndarray
    """bool ``[len(rows)]``: the text was cut to the model's maximum length."""
    model_version: str


@dataclass(frozen=True)
class DeadLetters:
    """Rows of the unit that end without an answer, and why."""

    rows: np.ndarray
    """int64 indices into the unit's table."""
    kind: str
    """The error's kind (`raypipe.errors`): missing_id, invalid_text, request_rejected, ..."""
    status: str
    """The gRPC status code of the last failed call ("" when the row was never sent)."""
    attempts: int
    message: str


def unit_rows(
    unit_table: pa.Table,
    *,
    unit: str,
    run_id: str,
    labels: tuple[str, ...],
    answers: Sequence[Answers],
    dead_letters: Sequence[DeadLetters],
    empty: np.ndarray,
    text_hash: pa.Array,
    inferred_at: datetime,
) -> pa.Table:
    """The outcome rows of one unit. `unit_table` holds the unit's input rows (``id``, ``text``,
    ``updated_at``, ``_source``, ``_row``); `empty` indexes its rows with no text (results of
    status ``empty_text``); `text_hash` is `raypipe.commit.schema.text_hashes` of its texts.
    Every row of `unit_table` must be in exactly one of `answers`, `dead_letters` and `empty`."""
    n_labels = len(labels)
    results = [np.asarray(empty, np.int64), *(a.rows for a in answers)]
    n_empty = len(empty)
    n_res = sum(len(r) for r in results)
    dead_rows = [d.rows for d in dead_letters]
    n_dead = sum(len(r) for r in dead_rows)
    n = n_res + n_dead
    if n != unit_table.num_rows:
        raise ValueError(f"unit {unit}: {n} outcomes for {unit_table.num_rows} input rows")
    order = pa.array(np.concatenate([*results, *dead_rows]).astype(np.int64), pa.int64())
    taken = unit_table.take(order)

    p = np.concatenate([np.full((n_empty, n_labels), np.nan, np.float32), *(a.probabilities for a in answers)]).astype(
        np.float32, copy=False
    )
    # A result's columns hold its answer; an empty text's (NaN) and a non-finite answer stay null.
    finite = np.isfinite(p).all(axis=1)
    top = np.nan_to_num(p, nan=-1.0).argmax(axis=1) if n_res else np.zeros(0, np.int64)
    top_score = p[np.arange(n_res), top] if n_res else np.zeros(0, np.float32)
    missing = np.concatenate([~finite, np.ones(n_dead, dtype=bool)])
    p_all = np.concatenate([p, np.full((n_dead, n_labels), np.nan, np.float32)])

    def repeat(value: object, count: int, type_: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(value, type_), count)

    def per_group(values: Sequence[object], sizes: Sequence[int], type_: pa.DataType) -> pa.Array:
        """One value per group of rows, repeated over the group."""
        parts = [repeat(v, k, type_) for v, k in zip(values, sizes, strict=True) if k]
        return pa.concat_arrays(parts) if parts else pa.nulls(0, type_)

    answer_sizes = [len(a.rows) for a in answers]
    dead_sizes = [len(r) for r in dead_rows]
    string, none = pa.string(), None
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "id": taken.column("id"),
        "outcome": per_group([OUTCOME_RESULT, OUTCOME_DEAD_LETTER], [n_res, n_dead], string),
        "unit": repeat(unit, n, string),
        "run_id": repeat(run_id, n, string),
        "status": per_group([RESULT_STATUS_EMPTY, RESULT_STATUS_OK, none], [n_empty, n_res - n_empty, n_dead], string),
        "error_kind": per_group([none, *(d.kind for d in dead_letters)], [n_res, *dead_sizes], string),
        "model_version": per_group(
            [none, *(a.model_version for a in answers), none], [n_empty, *answer_sizes, n_dead], string
        ),
        "updated_at": taken.column("updated_at"),
        "inferred_at": repeat(inferred_at, n, pa.timestamp("us", tz="UTC")),
        "text_hash": text_hash.take(order),
        "top_label": pa.concat_arrays(
            [
                pa.array(np.asarray(labels, dtype=object)[top], string, mask=~finite),
                pa.nulls(n_dead, string),
            ]
        ),
        "top_score": pa.array(
            np.concatenate([top_score, np.full(n_dead, np.nan, np.float32)]), pa.float32(), mask=missing
        ),
        "truncated": pa.array(
            np.concatenate([np.zeros(n_empty, bool), *(a.truncated for a in answers), np.zeros(n_dead, bool)]),
            pa.bool_(),
        ),
    }
    for j, label in enumerate(labels):
        columns[label_column(label)] = pa.array(p_all[:, j], pa.float32(), mask=missing)
    columns["grpc_status"] = per_group([none, *(d.status for d in dead_letters)], [n_res, *dead_sizes], string)
    columns["attempts"] = per_group([none, *(d.attempts for d in dead_letters)], [n_res, *dead_sizes], pa.int32())
    columns["message"] = per_group(
        [none, *(d.message[:MESSAGE_CHARS] for d in dead_letters)], [n_res, *dead_sizes], string
    )
    texts = taken.column("text").combine_chunks()
    columns["text"] = pa.concat_arrays([pa.nulls(n_res, string), texts.slice(n_res).cast(string)])
    columns["source"] = taken.column("_source")
    columns["row"] = taken.column("_row")
    columns["first_inferred_at"] = pa.nulls(n, pa.timestamp("us", tz="UTC"))  # a replay's MERGE sets it
    table = pa.table(columns, schema=outcome_schema(labels))
    return table.sort_by([("source", "ascending"), ("row", "ascending")])
