"""A unit's outcome rows (`raypipe.commit.rows`): one per input row, in the table's schema."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest

from raypipe.commit.rows import Answers, DeadLetters, unit_rows
from raypipe.commit.schema import outcome_schema, text_hashes

LABELS = ("joy", "anger", "fear")
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def unit_table(texts: list[str | None]) -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            "id": [f"id{i}" for i in range(n)],
            "text": texts,
            "updated_at": pa.array([datetime(2026, 11, 1, tzinfo=UTC)] * n, pa.timestamp("us", tz="UTC")),
            # Rows arrive out of input order (the actor's length sort): the output is in it.
            "_source": ["s3://in/part-0.parquet"] * n,
            "_row": list(reversed(range(n))),
        }
    )


def build(table: pa.Table, answers: list[Answers], dead: list[DeadLetters], empty: list[int]) -> pa.Table:
    return unit_rows(
        table,
        unit="u1",
        run_id="r1",
        labels=LABELS,
        answers=answers,
        dead_letters=dead,
        empty=np.array(empty, np.int64),
        text_hash=text_hashes(table.column("text")),
        inferred_at=NOW,
    )


def test_every_input_row_becomes_one_row_with_its_fate() -> None:
    table = unit_table(["happy", "", "poison", "furious", "calm"])
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]], np.float32)
    answers = [Answers(np.array([0, 3]), probs, np.array([False, True]), "m+1")]
    dead = [DeadLetters(np.array([2]), "request_rejected", "INVALID_ARGUMENT", 3, "x" * 5000)]
    reused = [Answers(np.array([4]), np.array([[0.2, 0.2, 0.6]], np.float32), np.array([False]), "m+0")]
    out = build(table, answers + reused, dead, [1])
    assert out.schema == outcome_schema(LABELS)
    assert out.column("row").to_pylist() == [0, 1, 2, 3, 4]  # sorted by (source, row)
    by_id = {r["id"]: r for r in out.to_pylist()}
    assert set(by_id) == {f"id{i}" for i in range(5)}
    joy = by_id["id0"]
    assert (joy["outcome"], joy["status"], joy["top_label"], joy["model_version"]) == ("result", "ok", "joy", "m+1")
    assert joy["prob_joy"] == pytest.approx(0.7) and joy["top_score"] == pytest.approx(0.7) and not joy["truncated"]
    assert by_id["id3"]["top_label"] == "anger" and by_id["id3"]["truncated"]
    assert by_id["id4"]["model_version"] == "m+0" and by_id["id4"]["top_label"] == "fear"
    empty = by_id["id1"]
    assert (empty["outcome"], empty["status"], empty["prob_joy"], empty["top_label"]) == (
        "result",
        "empty_text",
        None,
        None,
    )
    letter = by_id["id2"]
    assert (letter["outcome"], letter["error_kind"], letter["grpc_status"], letter["attempts"]) == (
        "dead_letter",
        "request_rejected",
        "INVALID_ARGUMENT",
        3,
    )
    assert letter["text"] == "poison" and len(letter["message"]) == 2000 and letter["status"] is None
    assert joy["text"] is None  # results do not keep their text
    assert {r["run_id"] for r in by_id.values()} == {"r1"} and {r["unit"] for r in by_id.values()} == {"u1"}
    assert {r["inferred_at"] for r in by_id.values()} == {NOW}
    assert by_id["id0"]["text_hash"] == text_hashes(["happy"])[0].as_py()


def test_an_answer_that_is_not_finite_keeps_no_probabilities() -> None:
    table = unit_table(["a", "b"])
    probs = np.array([[np.nan, 0.5, 0.5], [0.1, 0.1, 0.8]], np.float32)
    out = build(table, [Answers(np.array([0, 1]), probs, np.zeros(2, bool), "m")], [], [])
    by_id = {r["id"]: r for r in out.to_pylist()}
    assert (
        by_id["id0"]["prob_anger"] is None and by_id["id0"]["top_label"] is None and by_id["id0"]["top_score"] is None
    )
    assert by_id["id1"]["top_label"] == "fear"


def test_a_unit_of_only_dead_letters_or_nothing_still_builds() -> None:
    table = unit_table(["x", None])
    dead = [DeadLetters(np.array([0, 1]), "invalid_text", "", 0, "not UTF-8")]
    out = build(table, [], dead, [])
    assert out.column("outcome").to_pylist() == ["dead_letter", "dead_letter"]
    assert build(unit_table([]), [], [], []).num_rows == 0


def test_a_row_without_a_fate_is_refused() -> None:
    table = unit_table(["a", "b"])
    with pytest.raises(ValueError, match="1 outcomes for 2 input rows"):
        build(table, [Answers(np.array([0]), np.ones((1, 3), np.float32) / 3, np.zeros(1, bool), "m")], [], [])
