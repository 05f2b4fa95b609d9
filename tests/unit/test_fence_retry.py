"""Every commit of the fence (take-over, abort, pointers and run commits, unit commits) goes
through one retry loop: a conflict with another's commit looks again after the injected sleep,
and a conflict that never clears ends in `SinkError` after the loop's tries, having written
nothing. A local Delta table whose commits are made to conflict; no Ray, no real waiting."""

from __future__ import annotations

from collections import Counter

import deltalake
import pytest
from deltalake.exceptions import CommitFailedError

from raypipe.commit.fence import UnitCommitter, fenced_commit, retire, take_over
from raypipe.commit.table import OutcomeTable
from raypipe.errors import SinkError
from tests.fakes import LABELS
from tests.unit.test_table import UNIT, rows, visible


class Conflicts:
    """Makes the next `times` calls of `owner.name` fail as a conflict with another's commit,
    writing nothing (unlike a lost answer, nothing lands)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: object, name: str, times: int) -> None:
        self.left = times
        original = getattr(owner, name)

        def conflicted(*args, **kwargs):
            if self.left > 0:
                self.left -= 1
                raise CommitFailedError("Transaction failed: Concurrent transaction failed")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, conflicted)


@pytest.fixture
def table(tmp_path) -> OutcomeTable:
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    return table


def test_a_unit_commit_that_conflicts_looks_again_after_the_injected_sleep(table, monkeypatch):
    fence = take_over(table, "r1")
    Conflicts(monkeypatch, deltalake, "write_deltalake", times=2)
    slept: list[float] = []
    assert UnitCommitter(fence, sleep=slept.append).commit(UNIT, rows({"A": "result"}, version="m")) is True
    assert len(slept) == 2 and all(0 < s < 1 for s in slept)
    assert visible(table.output_uri) == Counter({("A", "result", "m"): 1})


def test_a_unit_commit_that_always_conflicts_gives_up_after_its_tries_having_written_nothing(table, monkeypatch):
    fence = take_over(table, "r1")
    Conflicts(monkeypatch, deltalake, "write_deltalake", times=10**6)
    slept: list[float] = []
    with pytest.raises(SinkError, match="gave up after 5 conflicting commits"):
        UnitCommitter(fence, sleep=slept.append).commit(UNIT, rows({"A": "result"}, version="m"), max_tries=5)
    assert len(slept) == 4, "a sleep between two tries, none after the last"
    assert visible(table.output_uri) == Counter()


def test_take_over_abort_and_a_fenced_commit_retry_with_the_injected_sleep(table, monkeypatch):
    conflicts = Conflicts(monkeypatch, deltalake.DeltaTable, "create_write_transaction", times=1)
    slept: list[float] = []
    fence = take_over(table, "r1", sleep=slept.append)
    assert fence.generation == 1 and len(slept) == 1

    conflicts.left = 1
    assert fenced_commit(table, fence, lambda dt: ("raypipe-test-app", 7), {}, failure="x", sleep=slept.append) == 7
    assert len(slept) == 2 and table.load().transaction_version("raypipe-test-app") == 7

    conflicts.left = 1
    assert retire(table, fence, sleep=slept.append) is True
    assert len(slept) == 3 and table.generation() == 2


def test_a_take_over_that_always_conflicts_gives_up_with_sink_error(table, monkeypatch):
    Conflicts(monkeypatch, deltalake.DeltaTable, "create_write_transaction", times=10**6)
    slept: list[float] = []
    with pytest.raises(SinkError, match="could not take over run r1"):
        take_over(table, "r1", sleep=slept.append)
    assert len(slept) == 19 and table.generation() == 0
