"""Preflight: what a run checks before it calls the model service or writes anything.

A run's first steps have effects: it checks the model service (waiting up to
`service.connect_timeout_s` for it), then takes the output's lease, creates the table, stores
an attempt and, when it fails, a "failed" report. Input, output and settings that are wrong
should cost none of that: a typo in `--input` must not leave a table behind, nor be reported
as a service that is down. So the public run functions (`raypipe.api`, which the CLI calls)
run `check_run` first (`check_input_run` for a backfill or a daily, `check_replay` for a
replay), and a wrong value ends the run in about a second, before Ray starts,
with one line naming the fix (`ConfigError` or `InputError`: exit 2 in the CLI).

What is checked, each as cheaply as it can be (a listing, one footer, no rows):
- times: `since` is an ISO time with a zone, or a timezone-aware `datetime` (`parse_since`);
- the input (backfill, daily), as planning would read it (`raypipe.plan.planning.check_input`):
  it exists, lists at least one shard (quarantined shards left out), and its first shard has
  the id and text columns with usable types (its Parquet footer, or its first JSON line); a
  daily is refused only when its first and its last shard both lack the same column;
- the output: a local path that is a folder or can be made one, not inside the input folder
  (the next run would read its own results as input); an S3 bucket that exists;
- a replay: the output holds an outcomes table and the run to replay;
- the Ray cluster named by `RAY_ADDRESS`, when Ray is not initialised in the process yet:
  something listens there (`check_ray_address`, one TCP connect). `ray.init` to an address
  nobody answers at retries for minutes without a word, after the run took its lease.

Nothing here writes, starts Ray or calls the model service; the run modes check again what
they rely on, later (a shard can change between this look and the run).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import posixpath
import socket
import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlparse

from raypipe.config import InputConfig, PipelineConfig, check_run_id, run_input
from raypipe.errors import ConfigError

if TYPE_CHECKING:
    from raypipe.commit.output import Output

__all__ = ["check_input_run", "check_ray_address", "check_replay", "check_run", "check_watch", "parse_since"]

Mode = Literal["backfill", "daily", "replay"]

_EXAMPLE_TIME = "2026-11-20T00:00:00Z"


def parse_since(value: str | datetime | None) -> datetime | None:
    """`since` as the CLI and the API take it: an ISO 8601 time with a zone (`Z` or `+01:00`),
    or a timezone-aware `datetime`. A time without a zone is refused, not guessed."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ConfigError(
                f"since {value!r} is not an ISO time: give one with a zone, e.g. {_EXAMPLE_TIME}"
            ) from None
    elif isinstance(value, datetime):
        parsed = value
    else:
        raise ConfigError(f"since must be an ISO time string or a datetime, not {type(value).__name__}")
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ConfigError(f"since {value!s} has no time zone: add one, e.g. {_EXAMPLE_TIME} (Z is UTC)")
    return parsed


def check_run(config: PipelineConfig, mode: Mode, *, of_run: str | None = None) -> None:
    """Raises `ConfigError` or `InputError` if the run cannot start; reads, never writes.

    `of_run` is the run a replay re-infers; a backfill or a daily reads `config.input`."""
    from raypipe.commit.output import Output

    place = Output.for_run(config.output)
    if mode == "replay":
        check_replay(of_run, place)
    else:
        check_input_run(run_input(config, None, mode), mode, place)


def check_input_run(input: InputConfig, mode: Literal["backfill", "daily"], place: Output) -> None:
    """`check_run` of a backfill or a daily of `input` (`raypipe.config.run_input`) into
    `place`, the run's output: the output, the input (its quarantined shards left out), the Ray
    address."""
    _check_output(place.uri, input_uri=input.uri)
    from raypipe.plan.planning import check_input

    check_input(input, mode, quarantined=_quarantined(place))
    _check_ray()


def check_watch(config: PipelineConfig, input: InputConfig, place: Output) -> None:
    """`check_run` of a watcher of `input` into `place`: the output, not inside the input, and
    the Ray address. The input may hold no shard yet (a watcher waits for the first), so it is
    not listed. With an events queue: the input is on S3 and the queue can be read."""
    _check_output(place.uri, input_uri=input.uri)
    if config.watch.events_queue:
        from raypipe.plan.events import SqsArrivals

        queue = SqsArrivals(config.watch.events_queue, input_uri=input.uri)
        try:
            queue.check()
        finally:
            queue.close()
    _check_ray()


def check_replay(of_run: str | None, place: Output) -> None:
    """`check_run` of a replay of run `of_run` on `place`, the run's output: the output holds
    it, the Ray address."""
    _check_output(place.uri)
    if of_run is None:
        raise ConfigError("a replay needs the run whose dead letters to replay: --run-id RUN")
    check_run_id(of_run, what="--run-id")
    _check_replay(place, of_run)
    _check_ray()


def _quarantined(output: Output) -> frozenset[str]:
    """The shards quarantined on the output, which planning skips; none if it cannot be read
    (the output's own check reports an unreadable output)."""
    from raypipe.commit.upkeep import quarantined

    try:
        return quarantined(output)
    except OSError:
        return frozenset()


def _check_ray() -> None:
    if not _ray_initialized():
        check_ray_address(os.environ)


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # not imported: not initialised (and importing it costs a second)
    return bool(ray is not None and ray.is_initialized())


#: How long `check_ray_address` waits for a TCP connection to the cluster's address.
RAY_CONNECT_TIMEOUT_S = 5.0


def check_ray_address(environ: Mapping[str, str], *, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Raises `ConfigError` if `RAY_ADDRESS` names a `host:port` (or `ray://host:port`) that
    accepts no TCP connection within `timeout_s`. Unset, `auto` or `local`: nothing to check
    (Ray finds or starts a cluster itself, and says so at once when it cannot)."""
    address = (environ.get("RAY_ADDRESS") or "").strip()
    if not address or address in ("auto", "local"):
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or "/" in hostport or not port.isdigit():
        return  # a form Ray resolves itself (e.g. an http:// dashboard address for jobs)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
            "start one (`ray start --head`), point RAY_ADDRESS at yours, or unset it to start a local one"
        ) from None


# -- output -----------------------------------------------------------------------------------
def _check_output(uri: str, *, input_uri: str | None = None) -> None:
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        _check_bucket(uri, parsed.netloc)
    else:
        _check_local_output(Path(parsed.path if parsed.scheme == "file" else uri))
    if input_uri is not None:
        _check_not_inside(uri, input_uri)


def _check_local_output(path: Path) -> None:
    path = path.expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output {path} is a file: give a folder (it is created if missing)")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"output {path} cannot be created: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"output {path} is not writable: {parent} refuses this user; choose another output")


def _check_bucket(uri: str, bucket: str) -> None:
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(uri)
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise ConfigError(f"output {uri}: bucket {bucket!r} does not exist; create it or choose another") from None
    except (EndpointConnectionError, ConnectTimeoutError) as e:
        endpoint = e.kwargs.get("endpoint_url", "the S3 endpoint")
        raise ConfigError(
            f"output {uri}: cannot reach {endpoint} (check AWS_ENDPOINT_URL, the network or a proxy)"
        ) from None
    except OSError:
        pass  # e.g. 403 on the bucket itself while its prefix is writable: the run reports what it cannot do


def _check_not_inside(output: str, input: str) -> None:
    """The output must not sit in what the input reads: the next run would read its results.

    Paths are compared after `os.path.realpath` (so `..` and symlinks count) and S3 keys after
    normalising; a glob reads below its literal folder, so an output there counts as inside when
    the glob's next part could name it (`*` or `**` does; `*.jsonl` does not match `out`)."""
    out, inp = _comparable(output), _comparable(input)
    if out is None or inp is None:
        return
    base, rest = _split_glob(inp)
    if out == base or out.startswith(base.rstrip("/") + "/"):
        below = out[len(base) :].strip("/").split("/")
        if not rest or "**" in rest or (below[0] and fnmatch.fnmatchcase(below[0], rest[0])) or out == base:
            raise ConfigError(
                f"output {output} is inside input {input}: the next run would read its results as input; "
                "choose an output outside the input"
            )


def _split_glob(path: str) -> tuple[str, list[str]]:
    """(the literal folder a glob starts from, its parts from the first with a wildcard on);
    (path, []) for a path without one."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if any(ch in part for ch in "*?["):
            return "/".join(parts[:i]) or "/", parts[i:]
    return path, []


def _comparable(uri: str) -> str | None:
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        return posixpath.normpath(f"s3/{parsed.netloc}/{parsed.path.lstrip('/')}")
    if parsed.scheme in ("", "file"):
        path = os.path.expanduser(parsed.path if parsed.scheme == "file" else uri)
        base, rest = _split_glob(os.path.abspath(path))
        # realpath of the literal part only: a wildcard must not be resolved as a file name.
        return "/".join([os.path.realpath(base), *rest])
    return None


# -- replay -----------------------------------------------------------------------------------
def _check_replay(place: Output, of_run: str) -> None:
    from raypipe.commit.protocol import run_known

    output, store = place.uri, place.store
    if not place.table.exists():
        raise ConfigError(
            f"output {output} holds no outcomes table: give --output of the run to replay "
            "(an output of the earlier layout needs `raypipe migrate` first)"
        )
    if run_known(place, of_run):
        return
    runs = [posixpath.basename(p)[: -len(".json")] for p in store.list_files(store.path("runs"), ".json")]
    runs = [r for r in runs if ".replay-" not in r]
    near = difflib.get_close_matches(of_run, runs, n=1)
    hint = (
        f"did you mean {near[0]}?"
        if near
        else f"its runs: {', '.join(runs[-5:])}"
        if runs
        else "no run has finished there"
    )
    raise ConfigError(f"no run {of_run!r} at {output}: {hint}")
