"""A Classify request's two forms, as the replica reads and checks them (no Ray, no model)."""

from __future__ import annotations

import pytest

from protos.raypipe.v1 import emotion_pb2
from serve_app.app import Batch


def rows(*pairs: tuple[str, str]) -> emotion_pb2.ClassifyRequest:
    return emotion_pb2.ClassifyRequest(paragraphs=[emotion_pb2.Paragraph(id=i, text=t) for i, t in pairs])


def test_both_forms_read_as_the_same_batch() -> None:
    column = Batch.of(emotion_pb2.ClassifyRequest(ids=["a", "b"], texts=["one", "two"]))
    row = Batch.of(rows(("a", "one"), ("b", "two")))
    assert (column.ids, column.texts, column.columns) == (["a", "b"], ["one", "two"], True)
    assert (row.ids, row.texts, row.columns) == (["a", "b"], ["one", "two"], False)
    assert column.problem(max_batch_size=2) is None and row.problem(max_batch_size=2) is None


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (emotion_pb2.ClassifyRequest(), "empty batch"),
        (emotion_pb2.ClassifyRequest(ids=["a", "b"], texts=["one"]), "2 ids but 1 texts"),
        (emotion_pb2.ClassifyRequest(ids=["a", ""], texts=["one", "two"]), "paragraph 1 has an empty id"),
        (emotion_pb2.ClassifyRequest(ids=["a", "a"], texts=["one", "two"]), "'a' appears more than once"),
        (rows(("a", "x"), ("a", "y")), "'a' appears more than once"),
        (emotion_pb2.ClassifyRequest(ids=list("abc"), texts=list("xyz")), "over the server's maximum of 2"),
        (
            emotion_pb2.ClassifyRequest(ids=["a"], texts=["one"], paragraphs=[emotion_pb2.Paragraph(id="b")]),
            "in one form",
        ),
    ],
)
def test_a_malformed_batch_says_why(request_: emotion_pb2.ClassifyRequest, problem: str) -> None:
    found = Batch.of(request_).problem(max_batch_size=2)
    assert found is not None and problem in found


def test_a_batch_counts_the_batches_whose_passes_still_wait_ahead_of_it() -> None:
    from serve_app.app import _WaitingBatches

    waiting = _WaitingBatches()
    first, ahead = waiting.queued(2)
    assert ahead == 0
    second, ahead = waiting.queued(3)
    assert ahead == 1  # the first batch's two passes wait
    waiting.started(first)
    assert waiting.queued(0)[1] == 2  # one pass of the first still waits; a batch of none never waits
    waiting.started(first)  # every pass of the first batch runs: it no longer waits
    third, ahead = waiting.queued(1)
    assert ahead == 1  # the second batch
    for _ in range(3):
        waiting.started(second)
    assert waiting.queued(1)[1] == 1  # the third batch
    waiting.started(third)
