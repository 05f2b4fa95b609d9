"""How a unit's rows become calls: micro-batches cut by rows and bytes, the rows never sent
(too large, invalid) with their errors, and the answers shared by rows of one text."""

from __future__ import annotations

import numpy as np

from raypipe.call.caller import Outcome
from raypipe.call.client import BatchResult
from raypipe.errors import (
    BadRowError,
    InvalidIdError,
    InvalidRowError,
    InvalidTextError,
    MissingIdError,
    TextTooLargeError,
)

__all__ = ["CALL_TEXT_BYTES", "bad_row", "duplicates_by_first", "micro_batches", "share_answers", "within_bytes"]


#: The most text bytes one call carries, a quarter of the channel's message limit
#: (`raypipe.call.channel`): a micro-batch of very long documents is cut short rather than
#: refused by gRPC (the model reads only its first tokens of each anyway).
CALL_TEXT_BYTES = 16 * 2**20


def micro_batches(order: np.ndarray, nbytes: np.ndarray, size: int, max_bytes: int) -> list[np.ndarray]:
    """`order` cut into runs of at most `size` rows and `max_bytes` of text (`nbytes`, in the
    same order), a longer text alone in its run."""
    starts = np.arange(0, len(order), size)
    if not len(order) or (np.add.reduceat(nbytes, starts) <= max_bytes).all():
        return [order[i : i + size] for i in starts]
    batches, start, total = [], 0, 0
    for i, n in enumerate(nbytes.tolist()):
        if i > start and (i - start == size or total + n > max_bytes):
            batches.append(order[start:i])
            start, total = i, 0
        total += n
    batches.append(order[start:])
    return batches


def within_bytes(rows: np.ndarray, nbytes: np.ndarray, max_bytes: int) -> tuple[np.ndarray, list[Outcome]]:
    """(the rows whose text is at most `max_bytes`, a `too_large` dead letter for each other one)."""
    over = nbytes[rows] > max_bytes
    if not over.any():
        return rows, []
    dead = [
        Outcome(
            np.array([i], np.int64),
            error=TextTooLargeError(
                f"too large: a text of {int(nbytes[i]):,} bytes is over client.max_text_bytes ({max_bytes:,}); "
                "it was not sent (shorten it: the model reads only its first tokens)"
            ),
        )
        for i in rows[over].tolist()
    ]
    return rows[~over], dead


def bad_row(reason: str | None, row_id: str | None) -> BadRowError:
    """The dead letter's error for a row that is never sent (`reason` from `raypipe.run.read`)."""
    if reason is None:
        return MissingIdError("the id is null or empty: the row cannot be told apart; see source and row")
    kind, _, detail = reason.partition(": ")
    error = {cls.kind: cls for cls in (InvalidIdError, InvalidRowError, InvalidTextError)}.get(kind, InvalidTextError)
    return error(f"{kind.replace('_', ' ')}: {detail}")


def duplicates_by_first(rows: np.ndarray, first_of: np.ndarray) -> dict[int, np.ndarray]:
    """{row sent: the later rows with its text}, in row order, from each position's first
    position with the same text (`first_of`); sorted once, not one mask per distinct text."""
    later = np.flatnonzero(first_of != np.arange(len(rows)))
    if not len(later):
        return {}
    later = later[np.argsort(first_of[later], kind="stable")]
    firsts, starts = np.unique(first_of[later], return_index=True)
    return {int(rows[f]): rows[group] for f, group in zip(firsts, np.split(later, starts[1:]), strict=True)}


def share_answers(sent: list[Outcome], duplicates: dict[int, np.ndarray]) -> list[Outcome]:
    """The fates of rows that shared a text with a row sent: the same answer, or the same error."""
    if not duplicates:
        return []
    shared = []
    for o in sent:
        for pos, row in enumerate(o.rows.tolist()):
            dups = duplicates.get(row)
            if dups is None:
                continue
            if o.result is None:
                shared.append(Outcome(dups, error=o.error, attempts=o.attempts))
                continue
            r = o.result
            answer = BatchResult(
                labels=r.labels,
                model_version=r.model_version,
                probabilities=np.repeat(r.probabilities[pos : pos + 1], len(dups), axis=0),
                truncated=np.repeat(r.truncated[pos : pos + 1], len(dups)),
            )
            shared.append(Outcome(dups, result=answer))
    return shared
