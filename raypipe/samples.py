"""Sample corpora for the demo, the tests and the benchmark: seeded paragraph shards.

Writes Parquet shards (several row groups each) and JSON-lines shards with `id`, `text` and
`updated_at`, to a local folder or an `s3://` prefix. Optionally mixes in bad rows the
pipeline must record, not send: null, empty and whitespace-only texts.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

__all__ = ["SampleCorpus", "write_sample_corpus"]

_BAD_TEXTS = (None, "", "   ", "\n\t ")


@dataclass(frozen=True)
class SampleCorpus:
    uri: str
    ids: list[str]
    texts: list[str | None]
    """The text written for each id, in the order of `ids`."""
    bad_ids: list[str]
    """Rows whose text is null, empty or whitespace: recorded with status `empty_text`."""
    labels: dict[str, int]
    """The label index each good paragraph was generated around."""


def write_sample_corpus(
    uri: str,
    *,
    rows: int = 3000,
    parquet_shards: int = 4,
    jsonl_shards: int = 1,
    bad_fraction: float = 0.01,
    seed: int = 7,
    id_prefix: str = "p",
    updated_at: datetime | None = None,
    row_group_size: int = 250,
) -> SampleCorpus:
    """Writes `rows` paragraphs split over the shards and returns what was written."""
    from serve_app.demo_data import paragraphs

    rng = random.Random(seed)  # noqa: S311  seeded sample data, not a secret
    generated = paragraphs(rows, seed=seed)
    when = updated_at or datetime(2026, 1, 1, tzinfo=UTC)
    ids, texts, stamps, bad_ids, labels = [], [], [], [], {}
    for i, (text, label) in enumerate(generated):
        pid = f"{id_prefix}{i:07d}"
        ids.append(pid)
        stamps.append(when - timedelta(seconds=rng.randrange(3600)))
        if rng.random() < bad_fraction:
            texts.append(rng.choice(_BAD_TEXTS))
            bad_ids.append(pid)
        else:
            texts.append(text)
            labels[pid] = label
    fs, root = url_to_fs(uri)
    fs.makedirs(root, exist_ok=True)
    shards = parquet_shards + jsonl_shards
    bounds = [round(k * rows / shards) for k in range(shards + 1)]
    for k in range(shards):
        lo, hi = bounds[k], bounds[k + 1]
        if k < parquet_shards:
            table = pa.table(
                {
                    "id": pa.array(ids[lo:hi], pa.string()),
                    "text": pa.array(texts[lo:hi], pa.string()),
                    "updated_at": pa.array(stamps[lo:hi], pa.timestamp("us", tz="UTC")),
                }
            )
            buf = io.BytesIO()
            pq.write_table(table, buf, row_group_size=row_group_size)
            fs.pipe_file(f"{root}/part-{k:03d}.parquet", buf.getvalue())
        else:
            lines = [
                json.dumps({"id": ids[i], "text": texts[i], "updated_at": stamps[i].isoformat()}) for i in range(lo, hi)
            ]
            fs.pipe_file(f"{root}/part-{k:03d}.jsonl", ("\n".join(lines) + "\n").encode())
    return SampleCorpus(uri, ids, texts, bad_ids, labels)
