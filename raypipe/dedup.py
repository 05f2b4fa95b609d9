"""Identical work is done once: answers reused by text hash.

Every outcome row carries `text_hash`, a 64-bit BLAKE2b of its text's UTF-8 bytes. Before a
run sends anything, the driver reads the committed results of the same `model_version` (the
version string names the precision/runtime too: `+bf16`, `+ov-fp32`, ...) into a
`TextIndex`: their hashes, sorted, and their answers. The actors look each row's hash up
there; a row whose text already has an answer costs no call, and its result is written under
the row's own id, `updated_at` and run (a paragraph whose metadata changed re-infers nothing).
Within a unit, duplicate texts are sent once.

The index holds what the lookup needs and no more: 8 bytes of hash and one float32 per label
(plus the truncation flag) per distinct text, about 40 bytes a row
with 6 labels, read once per run from the table's committed files (`raypipe.read_outcomes`
columns only). It is put in Ray's object store once, and every actor maps it without a copy.
`dedup.max_index_rows` bounds it: a table with more results for the version than that skips
the lookup (and says so) rather than hold them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from raypipe.sinks import OUTCOME_RESULT, RESULT_STATUS_OK, OutcomeTable, label_column, text_hashes

__all__ = ["TextIndex", "build_index", "hash_texts"]

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


def build_index(output_uri: str, model_version: str, labels: tuple[str, ...], *, max_rows: int) -> TextIndex | None:
    """The committed answers of `model_version` (None when there are none, or over `max_rows`)."""
    table = OutcomeTable(output_uri)
    if not table.exists():
        return None
    ds = table.load().to_pyarrow_dataset()
    if "text_hash" not in ds.schema.names or not all(label_column(x) in ds.schema.names for x in labels):
        return None
    flt = (
        (pc.field("model_version") == model_version)
        & (pc.field("outcome") == OUTCOME_RESULT)
        & (pc.field("status") == RESULT_STATUS_OK)
    )
    if ds.count_rows(filter=flt) > max_rows:
        logger.warning(
            "more than %d committed results of %s: answers are not reused by text this run (dedup.max_index_rows)",
            max_rows,
            model_version,
        )
        return None
    columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
    rows = ds.to_table(columns=columns, filter=flt)
    rows = rows.filter(pc.is_valid(rows.column("text_hash")))
    if rows.num_rows == 0:
        return None
    hashes = rows.column("text_hash").to_numpy()
    order = np.argsort(hashes, kind="stable")
    hashes = hashes[order]
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = hashes[1:] != hashes[:-1]  # identical texts: one answer each
    keep = order[first]
    probs = np.column_stack([rows.column(label_column(x)).to_numpy(zero_copy_only=False) for x in labels])
    truncated = rows.column("truncated").fill_null(False).to_numpy(zero_copy_only=False)
    index = TextIndex(
        model_version,
        tuple(labels),
        np.ascontiguousarray(hashes[first]),
        np.ascontiguousarray(probs[keep].astype(np.float32)),
        np.ascontiguousarray(truncated[keep].astype(bool)),
    )
    logger.info("reusing answers of %s for %d distinct texts already committed", model_version, len(index))
    return index
