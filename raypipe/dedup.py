"""Identical work is done once: answers reused by text hash.

Every outcome row carries `text_hash`, a 64-bit BLAKE2b of its text's UTF-8 bytes. Before a
run sends anything, the driver reads the committed results of the same `model_version` (the
version string names the precision/runtime too: `+bf16`, `+ov-fp32`, ...) into a
`TextIndex`: their hashes, sorted, and their answers. The actors look each row's hash up
there; a row whose text already has an answer costs no call, and its result is written under
the row's own id, `updated_at` and run (a paragraph whose metadata changed re-infers nothing).
Within a unit, duplicate texts are sent once.

The index holds what the lookup needs and no more: 8 bytes of hash and one float32 per label
(plus the truncation flag) per distinct text, about 40 bytes a text with 6 labels, read once
per run from the table's committed files in batches, merged as they come: the driver holds
the distinct texts plus about a batch, never every matching row. It is put in Ray's object
store once, and every actor maps it without a copy. `dedup.max_index_rows` bounds it in
distinct texts: over it, the index keeps that many (the smallest hashes) and the run reuses
those, inferring the others again; the log says so and the report's `reuse_index`
(`IndexStats`) shows `capped`. Reuse is never off without saying so.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from raypipe.sinks import OUTCOME_RESULT, RESULT_STATUS_OK, OutcomeTable, label_column, text_hashes

__all__ = ["IndexStats", "TextIndex", "build_index", "hash_texts"]

logger = logging.getLogger("raypipe")


def hash_texts(texts: list[str | None]) -> np.ndarray:
    """The `text_hash` of each text (int64; 0 for a null text)."""
    return text_hashes(texts).fill_null(0).to_numpy()


@dataclass(frozen=True)
class TextIndex:
    """Answers of one model version by text hash (arrays sorted by hash; picklable, zero-copy)."""

    model_version: str
    labels: tuple[str, ...]
    hashes: np.ndarray  # int64 [n], sorted, distinct
    probabilities: np.ndarray  # float32 [n, labels]
    truncated: np.ndarray  # bool [n]

    def __len__(self) -> int:
        return len(self.hashes)

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, the index of its answer, or -1."""
        if not len(self.hashes):
            return np.full(len(hashes), -1, dtype=np.int64)
        pos = np.searchsorted(self.hashes, hashes)
        pos = np.minimum(pos, len(self.hashes) - 1)
        return np.where(self.hashes[pos] == hashes, pos, -1).astype(np.int64)


@dataclass(frozen=True)
class IndexStats:
    """How the reuse index was built: what the run report shows as `reuse_index`."""

    rows_read: int = 0
    """Committed results of the version read (copies of a text included)."""
    distinct_texts: int = 0
    """Distinct texts held: the answers reuse can give."""
    cap: int = 0
    """`dedup.max_index_rows`: the most distinct texts held."""
    capped: bool = False
    """More distinct texts than `cap` were committed: the others are inferred again."""

    def to_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)


_EMPTY = (np.empty(0, np.int64), None, np.empty(0, bool))

#: Rows gathered between two merges, at least: the merge sorts what is held, so gathering as
#: many rows as are held before merging keeps the work linear-logarithmic overall.
_MERGE_ROWS = 1 << 20


def build_index(
    output_uri: str, model_version: str, labels: tuple[str, ...], *, max_rows: int
) -> tuple[TextIndex | None, IndexStats]:
    """The committed answers of `model_version`, one per distinct text, at most `max_rows`.

    Read in batches and merged as it goes, so the driver holds the distinct texts and one
    batch's worth more, never every matching row. Over `max_rows` distinct texts, the index
    keeps `max_rows` of them (the smallest hashes: a fixed choice) and reuse goes on for those;
    the log and the stats (`IndexStats.capped`) say so. None when there are no answers."""
    stats = IndexStats(cap=max_rows)
    table = OutcomeTable(output_uri)
    if not table.exists():
        return None, stats
    ds = table.load().to_pyarrow_dataset()
    if "text_hash" not in ds.schema.names or not all(label_column(x) in ds.schema.names for x in labels):
        return None, stats
    flt = (
        (pc.field("model_version") == model_version)
        & (pc.field("outcome") == OUTCOME_RESULT)
        & (pc.field("status") == RESULT_STATUS_OK)
        & pc.field("text_hash").is_valid()
    )
    columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
    held: tuple[np.ndarray, np.ndarray | None, np.ndarray] = _EMPTY
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    gathered = rows_read = 0
    capped = False
    for batch in ds.to_batches(columns=columns, filter=flt):
        if batch.num_rows == 0:
            continue
        rows_read += batch.num_rows
        parts.append(
            (
                batch.column("text_hash").to_numpy(),
                np.column_stack([batch.column(label_column(x)).to_numpy(zero_copy_only=False) for x in labels]).astype(
                    np.float32
                ),
                batch.column("truncated").fill_null(False).to_numpy(zero_copy_only=False).astype(bool),
            )
        )
        gathered += batch.num_rows
        if gathered >= max(_MERGE_ROWS, len(held[0])):
            held, cut = _merge(held, parts, max_rows)
            capped, parts, gathered = capped or cut, [], 0
    held, cut = _merge(held, parts, max_rows)
    capped = capped or cut
    hashes, probs, truncated = held
    stats = IndexStats(rows_read=rows_read, distinct_texts=len(hashes), cap=max_rows, capped=capped)
    if capped:
        logger.warning(
            "more than %d distinct texts have committed answers of %s: %d of them are reused, the others are "
            "inferred again (raise dedup.max_index_rows to reuse them all)",
            max_rows,
            model_version,
            len(hashes),
        )
    if probs is None or len(hashes) == 0:
        return None, stats
    index = TextIndex(model_version, tuple(labels), hashes, probs, truncated)
    logger.info("reusing answers of %s for %d distinct texts already committed", model_version, len(index))
    return index, stats


def _merge(
    held: tuple[np.ndarray, np.ndarray | None, np.ndarray],
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    cap: int,
) -> tuple[tuple[np.ndarray, np.ndarray | None, np.ndarray], bool]:
    """`held` and `parts` as one sorted set of distinct hashes (the first answer of each), cut
    to the `cap` smallest; True if it was cut."""
    if not parts:
        return held, False
    hashes = np.concatenate([held[0], *(p[0] for p in parts)])
    probs = np.concatenate([*([held[1]] if held[1] is not None else []), *(p[1] for p in parts)])
    truncated = np.concatenate([held[2], *(p[2] for p in parts)])
    order = np.argsort(hashes, kind="stable")  # stable: a text's answer held before stays
    hashes = hashes[order]
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = hashes[1:] != hashes[:-1]
    keep = order[first]
    cut = len(keep) > cap
    keep = keep[:cap]
    return (
        np.ascontiguousarray(hashes[first][:cap]),
        np.ascontiguousarray(probs[keep]),
        np.ascontiguousarray(truncated[keep]),
    ), cut
