"""A commit that happened though its call raised: every conditional write recognises its own.

On S3 a Delta commit (and the lease) is a conditional PUT. When S3 carries it out and the answer
is lost, the client retries, finds the object there, and reports a conflict for a write that
landed. Here a local table's commit lands and then raises `CommitFailedError` once, as delta-rs
does then (seen against moto through `tests/integration/s3_proxy.py`, which the integration test
`test_e2e_s3.py::test_a_lost_answer_to_a_conditional_put_does_not_stop_a_run` drives on S3).
No Ray.
"""

from __future__ import annotations

from collections import Counter

import deltalake
import pytest
from deltalake.exceptions import CommitFailedError

from raypipe.commit.fence import UnitCommitter, mark_committed, set_pointer, take_over
from raypipe.commit.table import FILES_SEEN_APP, OutcomeTable
from tests.fakes import LABELS
from tests.unit.test_table import UNIT, rows, visible


class LoseAnswer:
    """Makes the next `times` calls of `owner.name` land and then raise `CommitFailedError`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: object, name: str, times: int = 1) -> None:
        self.left = times
        original = getattr(owner, name)

        def landed_then_raised(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.left > 0:
                self.left -= 1
                raise CommitFailedError("Transaction failed: Concurrent transaction failed")
            return out

        monkeypatch.setattr(owner, name, landed_then_raised)


def table_for(tmp_path) -> OutcomeTable:
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    return table


def test_a_take_over_whose_answer_was_lost_holds_the_run(tmp_path, monkeypatch):
    table = table_for(tmp_path)
    lost = LoseAnswer(monkeypatch, deltalake.DeltaTable, "create_write_transaction")
    fence = take_over(table, "r1", holder="a1")
    assert lost.left == 0 and fence.generation == 1 and table.generation() == 1


def test_a_take_over_of_another_attempt_at_the_same_moment_still_stops_this_one(tmp_path, monkeypatch):
    """The read-back recognises this call's own commit only: another attempt's is still a conflict."""
    table = table_for(tmp_path)
    original = deltalake.DeltaTable.create_write_transaction
    other = OutcomeTable(table.output_uri)

    def the_other_takes_over_first(self, *args, **kwargs):
        monkeypatch.setattr(deltalake.DeltaTable, "create_write_transaction", original)
        take_over(other, "r2", holder="other")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(deltalake.DeltaTable, "create_write_transaction", the_other_takes_over_first)
    from raypipe.errors import LeaseLostError

    with pytest.raises(LeaseLostError, match="at the same moment"):
        take_over(table, "r1", holder="a1")


def test_a_unit_commit_whose_answer_was_lost_counts_as_committed_once(tmp_path, monkeypatch):
    table = table_for(tmp_path)
    fence = take_over(table, "r1")
    LoseAnswer(monkeypatch, deltalake, "write_deltalake")
    assert UnitCommitter(fence).commit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m")) is True
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "dead_letter", "m"): 1})


def test_a_run_commit_and_a_pointer_whose_answers_were_lost_are_recorded_once(tmp_path, monkeypatch):
    table = table_for(tmp_path)
    fence = take_over(table, "r1")
    LoseAnswer(monkeypatch, deltalake.DeltaTable, "create_write_transaction", times=2)
    written: list[int] = []

    def write(current: int | None) -> int:
        written.append(len(written) + 7)
        return written[-1]

    before = table.load().version()
    assert set_pointer(table, fence, FILES_SEEN_APP, write, operation="files-seen") == 7
    mark_committed(table, fence, "r1", {})
    assert written == [7], "the state file is written once: the lost answer is not taken for a conflict"
    assert table.pointer(FILES_SEEN_APP) == 7 and table.is_committed("r1")
    assert table.load().version() == before + 2
