"""The outcomes table's schema: one row per input row and run, a result or a dead letter.

Its columns (docs/output-and-sql.md tells each), the probability column of a label, and the
text hash answers are reused by. The table itself, the names its log keeps and its readers are
`raypipe.commit.table`'s.
"""

from __future__ import annotations

import hashlib
import re

import pyarrow as pa

__all__ = [
    "OUTCOME_DEAD_LETTER",
    "OUTCOME_RESULT",
    "RESULT_STATUS_EMPTY",
    "RESULT_STATUS_OK",
    "label_column",
    "outcome_schema",
    "text_hashes",
]

OUTCOME_RESULT = "result"
OUTCOME_DEAD_LETTER = "dead_letter"
RESULT_STATUS_OK = "ok"
RESULT_STATUS_EMPTY = "empty_text"

_TS = pa.timestamp("us", tz="UTC")
# Columns before the labels' probabilities, so Delta's per-file statistics (first 32 columns)
# always cover `unit` (the committed-units listing) and `updated_at` / `inferred_at`.
_HEAD = [
    pa.field("id", pa.string()),
    pa.field("outcome", pa.string()),
    pa.field("unit", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error_kind", pa.string()),
    pa.field("model_version", pa.string()),
    pa.field("updated_at", _TS),
    pa.field("inferred_at", _TS),
    pa.field("text_hash", pa.int64()),
    pa.field("top_label", pa.string()),
    pa.field("top_score", pa.float32()),
    pa.field("truncated", pa.bool_()),
]
_TAIL = [
    pa.field("grpc_status", pa.string()),
    pa.field("attempts", pa.int32()),
    pa.field("message", pa.string()),
    pa.field("text", pa.string()),
    pa.field("source", pa.string()),
    pa.field("row", pa.int64()),
    # A replay's rows: the `inferred_at` they had first, so their run keeps its place in commit
    # order (`LATEST_SQL`); null on rows never replayed. Last, as tables created before it
    # gain it last (`ensure`).
    pa.field("first_inferred_at", _TS),
]


def label_column(label: str) -> str:
    """The column of a label's probability: `prob_<label>`, SQL-safe."""
    return "prob_" + re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


def outcome_schema(labels: tuple[str, ...] | list[str]) -> pa.Schema:
    """One row per input row: a result (`status` ok / empty_text, probabilities) or a dead
    letter (`error_kind`, `grpc_status`, `attempts`, `message`, and its `text` for replays)."""
    return pa.schema([*_HEAD, *[pa.field(label_column(x), pa.float32()) for x in labels], *_TAIL])


def text_hashes(texts: pa.Array | pa.ChunkedArray | list[str | None]) -> pa.Array:
    """A 64-bit BLAKE2b of each text's UTF-8 bytes, as a signed int64 (null for a null text):
    the key `raypipe.call.reuse` reuses answers by."""
    values = texts if isinstance(texts, list) else texts.to_pylist()
    return pa.array(
        [
            None
            if t is None
            else int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True)
            for t in values
        ],
        pa.int64(),
    )
