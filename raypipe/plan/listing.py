"""Listing: the shards under an input URI, and every file skipped, with why. A shard's
`fingerprint` (size and ETag, or size and mtime locally) says whether it changed since it was
listed or read."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from raypipe.errors import NoShardsError
from raypipe.plan.units import ShardFormat

__all__ = ["InputListing", "filesystem", "fingerprint", "list_input", "list_shards", "modified_at"]


# The shards under an input URI, and every file skipped, with why. A shard's `fingerprint` says
# whether it changed since it was listed; a daily's Hive partitions are pruned by date unopened.
_EXTENSIONS: dict[str, ShardFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = url_to_fs(uri)
    return fs, path


def _full_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _shard_format(path: str, forced: str) -> ShardFormat | None:
    if forced != "auto":
        return forced  # type: ignore[return-value]
    lower = path.lower()  # PART-0.PARQUET is Parquet too
    for ext, fmt in _EXTENSIONS.items():
        if lower.endswith(ext):
            return fmt
    return None


def fingerprint(info: dict[str, Any]) -> str:
    """A file's identity for "has it changed?": size and ETag on S3, size and mtime locally."""
    tag = info.get("ETag") or info.get("etag") or info.get("VersionId") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')}:{str(tag).strip(chr(34))}"


@dataclass
class InputListing:
    """What an input URI holds: the shards raypipe reads, and every file it skips, with why."""

    shards: list[tuple[str, ShardFormat]]
    fingerprints: dict[str, str]
    """Shard URI -> `fingerprint` when listed (a shard that differs when read is re-planned)."""
    sizes: dict[str, int]
    """Shard URI -> its size in bytes when listed."""
    skipped: list[dict[str, str]]
    """{path, reason} of each file not read: hidden (`_x`, `.x`), unknown extension, quarantined."""
    modified: dict[str, datetime] = field(default_factory=dict)
    """Shard URI -> when it was last written (S3 `LastModified`, local mtime), UTC, where listed:
    when it arrived, for a watcher's freshness (`raypipe.run.watch`)."""


def modified_at(info: dict[str, Any]) -> datetime | None:
    """When a listed file was last written, UTC: S3's `LastModified`, or the local `mtime`."""
    stamp = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
    if isinstance(stamp, datetime):
        return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)
    if isinstance(stamp, int | float):
        return datetime.fromtimestamp(stamp, UTC)
    return None


def list_input(uri: str, *, format: str = "auto", quarantined: frozenset[str] = frozenset()) -> InputListing:
    """Shards under uri (a file, a folder searched recursively, or a glob), sorted by path.

    Hidden files and folders (`.x`, `_x`, e.g. `_SUCCESS`, `.crc`) and files of unknown
    extensions are skipped, each listed with its reason. An input that matches no shard is an
    error, never an empty run.
    """
    fs, path = filesystem(uri)
    if any(ch in path for ch in "*?["):
        found = fs.glob(path, detail=True)
    else:
        # `find` first, not `isdir`: on S3, `isdir` of a cold folder lists it whole (another 50
        # pages of 1,000 keys for 50k shards, 25 s on moto). `find` of a file finds the file.
        found = fs.find(path, detail=True)
        if list(found) == [path]:
            found = {path: fs.info(path)}  # local `find` gives no details for a file
        elif not found and not fs.exists(path):
            raise NoShardsError(f"input {uri} does not exist")
    listing = InputListing([], {}, {}, [])
    for candidate in sorted(found):
        info = found[candidate]
        if info.get("type") == "directory":
            continue
        full = _full_uri(fs, candidate)
        rel = candidate[len(path) :] if candidate.startswith(path) else candidate
        hidden = [part for part in rel.split("/") if part.startswith((".", "_"))]
        fmt = _shard_format(candidate, format)
        if hidden:
            listing.skipped.append({"path": full, "reason": f"hidden ({hidden[0]!r} starts with '.' or '_')"})
        elif fmt is None:
            ext = posixpath.splitext(candidate)[1] or "(none)"
            listing.skipped.append({"path": full, "reason": f"unknown extension {ext}"})
        elif full in quarantined:
            listing.skipped.append({"path": full, "reason": "quarantined (raypipe shards quarantine)"})
        else:
            listing.shards.append((full, fmt))
            listing.fingerprints[full] = fingerprint(info)
            if isinstance(info.get("size"), int):
                listing.sizes[full] = info["size"]
            if (when := modified_at(info)) is not None:
                listing.modified[full] = when
    if not listing.shards:
        skipped = "; ".join(f"{s['path']}: {s['reason']}" for s in listing.skipped[:5])
        raise NoShardsError(
            f"input {uri} matches no shards (looked for {', '.join(sorted(_EXTENSIONS))} files"
            + ("" if format == "auto" else f" read as {format}")
            + ")"
            + (f"; skipped {len(listing.skipped)}: {skipped}" if skipped else "")
        )
    return listing


def list_shards(uri: str, *, format: str = "auto") -> list[tuple[str, ShardFormat]]:
    """The shards of `list_input`, as (uri, format) pairs."""
    return list_input(uri, format=format).shards
