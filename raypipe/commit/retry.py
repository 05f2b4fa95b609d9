"""One commit into the outcomes table, recognised as ours, and the one loop that retries it.

- `commit_once`: one commit on a snapshot, carrying a token of its own (`commit_token`). On S3
  a commit is a conditional PUT of the next log entry; when S3 carries it out and the answer
  is lost, delta-rs raises `CommitFailedError` for a commit that happened. The log after the
  snapshot is read back for the token (`landed`): ours is a success, anything else a conflict.
- `retry_commit`: runs an attempt (one commit; a retry's on a fresh snapshot) until it returns; a
  conflict looks again after a jittered wait, with an injectable sleep (tenacity, as the
  model-service call's retry layer is), and a conflict that never clears ends in the caller's
  error after its tries.

`raypipe.commit.fence` builds every commit of the output (take-over, abort, pointers, run and
unit commits) on these two.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

__all__ = [
    "COMMIT_KEY",
    "commit_failed",
    "commit_once",
    "commit_token",
    "empty_commit",
    "jitter",
    "landed",
    "retry_commit",
]


def commit_failed() -> type[Exception]:
    from deltalake.exceptions import CommitFailedError

    return CommitFailedError


COMMIT_KEY = "raypipe.commit"
"""The commit-info key of a token unique to one commit call (`landed`)."""


def commit_token() -> dict[str, str]:
    """Commit metadata naming this commit call alone, so a retry can recognise it (`landed`)."""
    return {COMMIT_KEY: uuid.uuid4().hex}


def landed(dt: Any, since: int, token: dict[str, str]) -> bool:
    """Did the commit carrying `token` land after version `since`, though its call raised?

    On S3 a commit is a conditional PUT of the next log entry. When S3 carries it out but the
    answer is lost, the client retries, finds the entry taken, and delta-rs checks our commit
    against the one there: its own, whose app transactions conflict with ours, so it raises
    `CommitFailedError` for a commit that happened. The commits after `since` (the snapshot
    the call was built on) are read back for the token. `dt` is refreshed to the latest version."""
    dt.update_incremental()
    newer = dt.version() - since
    if newer <= 0:
        return False
    return any(c.get(COMMIT_KEY) == token[COMMIT_KEY] for c in dt.history(limit=newer))


T = TypeVar("T")


def jitter(low: float, high: float) -> Callable[[int], float]:
    """A wait between `low` and `high` seconds, whatever the attempt."""
    return lambda attempt: random.uniform(low, high)  # noqa: S311  jitter, not a secret


def retry_commit(
    attempt: Callable[[int], T],
    *,
    tries: int,
    wait: Callable[[int], float],
    sleep: Callable[[float], None] = time.sleep,
    failure: Callable[[], Exception],
) -> T:
    """Runs `attempt(n)` (n = 0, 1, ...: one commit, a retry's on a fresh snapshot) until it returns.

    A `CommitFailedError` it raises is a conflict with a commit not ours (it has checked
    `landed` first): after `sleep(wait(n + 1))` it runs again, at most `tries` times in all,
    then `failure()` is raised. Anything else it raises (`LeaseLostError`: fenced off) ends
    the loop at once."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(tries),
        wait=lambda state: wait(state.attempt_number),
        retry=tenacity.retry_if_exception_type(commit_failed()),
        sleep=sleep,
    )
    try:
        for trying in retrying:
            with trying:
                return attempt(trying.retry_state.attempt_number - 1)
    except tenacity.RetryError:
        raise failure() from None
    raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover


def empty_commit(dt: Any, props: Any) -> None:
    """A commit of no rows that carries `props` (app transactions, metadata); `dt` moves past it
    (as `write_deltalake` moves the table it writes to; `create_write_transaction` does not), so
    the holder's next commit from `dt` does not conflict with this one."""
    dt.create_write_transaction([], mode="append", schema=dt.schema(), partition_by=["run_id"], commit_properties=props)
    dt.update_incremental()


def commit_once(
    dt: Any,
    transactions: list[Any],
    metadata: dict[str, str],
    write: Callable[[Any, Any], None] = empty_commit,
) -> None:
    """One commit on snapshot `dt` (`write(dt, properties)`, an empty one by default) carrying
    `transactions` and `metadata` with a token of its own. Returns if it landed, also when its
    call raised though the commit is in the log (`landed`); raises `CommitFailedError` on a
    conflict with another's commit (`retry_commit` looks again)."""
    from deltalake import CommitProperties

    since, token = dt.version(), commit_token()
    try:
        write(dt, CommitProperties(app_transactions=transactions, custom_metadata={**metadata, **token}))
    except commit_failed():
        if not landed(dt, since, token):
            raise
