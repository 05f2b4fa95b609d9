"""Identical work is done once: answers reused by text hash.

Every outcome row carries `text_hash`, a 64-bit BLAKE2b of its text's UTF-8 bytes. Before a
run sends anything, the committed results of the same `model_version` (the version string
names every setting that changes answers: `+len128`, `+bf16`, `+ov-int8`, ...; fp32 on either
runtime answers as the reference and keeps the card's version) become a `TextIndex`: per
distinct text its hash and its answer (one float32 per label and the truncation flag, 33
bytes a text with 6 labels). The actors look each row's hash up there; a row whose text
already has an answer costs no call, and its result is written under the row's own id,
`updated_at` and run (a paragraph whose metadata changed re-infers nothing). Within a unit,
duplicate texts are sent once.

Three modules, one job each, arrows pointing one way (`scan` -> `stored` -> `index`):

- `index`: `TextIndex`, the in-memory lookup. It is cut by hash range into shards
  (`IndexShard`: sorted hashes and their answers), each covering an equal slice of the int64
  space, so a lookup routes each hash to its shard and finds it there by binary search, whole
  batches at a time in numpy. A long-lived actor adds the answers it commits
  (`TextIndex.add_committed`).
- `scan`: `build_index`, the read of the committed answers. With Ray running it is a shuffle
  of Ray tasks whose shards stay in Ray's object store (the driver holds only references, and
  the actors map every shard without a copy); without Ray (tests, a notebook) the same steps
  run in the calling process.
- `stored`: `StoredIndex`, the index kept beside the table (a small Delta table of distinct
  texts and their answers that names the table version it covers), so a run reads it and only
  the files the log committed since, not every committed row; a lost, corrupt or unusable one
  is replaced by the full read.

`dedup.max_index_rows` bounds the index in distinct texts: over it, the index keeps that many
(the smallest hashes) and the run reuses those, inferring the others again; the log says so
and the report's `reuse_index` (`IndexStats`) shows `capped`. Reuse is never off without
saying so.
"""

from raypipe.call.reuse.index import IndexShard, TextIndex, hash_texts, shard_bounds
from raypipe.call.reuse.scan import IndexStats, build_index
from raypipe.call.reuse.stored import INDEX_DIR, StoredIndex

__all__ = [
    "INDEX_DIR",
    "IndexShard",
    "IndexStats",
    "StoredIndex",
    "TextIndex",
    "build_index",
    "hash_texts",
    "shard_bounds",
]
