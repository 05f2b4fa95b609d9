"""Failures the model-based test (`test_model_based.py`) found, each kept as its shortest story.

Each test is the minimal step sequence Hypothesis shrank a failure to, on the same world (the
real run path over local files, no Ray: `tests.modelcheck.world`). A test whose behaviour is
not fixed yet is expected to fail (strict): its `PENDING` entry in the state machine says why,
and a fix that makes it pass must drop that entry, so the machine searches that path again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc
import pytest

from raypipe.commit.outcomes import latest, read_outcomes
from raypipe.commit.output import Output
from raypipe.commit.schema import text_hashes
from raypipe.errors import LeaseLostError
from raypipe.run.preflight import check_replay
from tests.modelcheck.reference import Row
from tests.modelcheck.world import INVALID, World
from tests.unit.test_model_based import PENDING

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def pending(key: str) -> Callable[[Any], Any]:
    """Expected to fail while the state machine's `PENDING` holds `key`."""
    if key in PENDING:
        return pytest.mark.xfail(strict=True, reason=PENDING[key])
    return lambda f: f


@pytest.fixture
def world(tmp_path: Any) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


def answers(world: World) -> dict[str, int | None]:
    """id -> the text hash of its `latest` answer."""
    rows = latest(str(world.output))
    return dict(zip(rows.column("id").to_pylist(), rows.column("text_hash").to_pylist(), strict=True))


def hash_of(text: str) -> int:
    return text_hashes([text])[0].as_py()


def completed(world: World, *args: Any, **kwargs: Any) -> None:
    out = world.run(*args, **kwargs)
    assert out.error is None and out.report is not None and out.report.status == "completed", out.error


@pending("ns_stamps")
def test_an_updated_at_of_timestamp_ns_with_sub_microsecond_digits_is_read(world):
    world.write_file("a.parquet", [Row("r0", "t0", T0)], ns=True)
    completed(world, "backfill", "b1")
    assert answers(world) == {"r0": hash_of("t0")}


def test_an_id_in_two_files_has_a_row_per_input_row_and_one_documented_latest(world):
    """Each input row lands once per run, so an id in two files has two rows in the run; `latest`
    decides between them by the documented rule (same `updated_at`, one run: the greater text
    hash), whichever unit committed first."""
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    world.write_file("b.parquet", [Row("r0", "t1", T0)])
    completed(world, "backfill", "b1")
    ids = read_outcomes(str(world.output), "b1").column("id").to_pylist()
    assert ids == ["r0", "r0"]
    assert answers(world) == {"r0": max(hash_of("t0"), hash_of("t1"))}


def test_a_daily_since_over_a_file_without_updated_at_completes(world):
    world.write_file("a.parquet", [Row("r0", "t0", None)], stamps=False)
    completed(world, "backfill", "b1")
    completed(world, "daily", "d2", since=T0)


@pending("changed_file_read_whole")
def test_a_row_added_to_a_file_read_before_is_read_whatever_its_stamp(world):
    """A file read by a backfill, deleted, and written again under its name with a row without
    `updated_at`: the daily reads the changed file whole."""
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    completed(world, "backfill", "b1")
    world.delete_file("a.parquet")
    world.write_file("a.parquet", [Row("r1", "t0", None)])
    completed(world, "daily", "d2")
    assert answers(world) == {"r0": hash_of("t0"), "r1": hash_of("t0")}


@pending("fenced_invisible")
def test_an_attempt_fenced_off_by_another_run_id_commits_nothing(world):
    """A daily killed just before its unit commit (its actor stalled, not dead); the lease is
    expired and a daily under another run id takes the output over; then the stalled actor
    commits. Nothing of it may become visible."""
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    completed(world, "backfill", "b1")
    world.write_file("b.parquet", [Row("r1", "t1", T0)])
    assert world.run("daily", "d2", kill_at="before_unit").killed
    world.expire_lease()
    completed(world, "daily", "d3")
    zombie = world.zombies.pop()
    with contextlib.suppress(LeaseLostError):
        zombie.committer.commit(zombie.unit, zombie.rows)
    assert read_outcomes(str(world.output), "d2").num_rows == 0


@pending("non_ascii_names")
def test_a_run_over_a_non_ascii_shard_name_resumes(world):
    """A backfill over a file named in 40 characters of CJK, killed after its first unit commit,
    resumes under its run id and completes."""
    name = "数据" * 20 + ".parquet"
    world.write_file(name, [Row("r0", "t0", T0), Row("r1", "t1", T0), Row("r2", "t2", T0)])
    assert world.run("backfill", "b1", kill_at="after_unit").killed
    completed(world, "backfill", "b1", force=True)
    assert set(answers(world)) == {"r0", "r1", "r2"}


def test_a_lost_answer_to_the_lease_write_does_not_lock_the_output(world):
    """The lease is written but its answer is lost: the attempt reads the lease back, finds its
    own record and goes on (before, the run stopped, and the lease it wrote was nobody's: every
    later run waited it out or needed --force)."""
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    out = world.run("backfill", "b1", lose_answer="lease")
    assert out.error is None and out.report is not None and out.report.status == "completed", out.error
    assert set(answers(world)) == {"r0"}


@pending("invalid_rows_keep_their_reason")
def test_a_replay_keeps_an_invalid_rows_reason(world):
    """A row whose text is not UTF-8 is an `invalid_text` dead letter; a replay of its run
    cannot make it a result (its text was never stored)."""
    world.write_file("a.parquet", [Row("r0", "t0", T0), Row("r1", INVALID, T0)])
    completed(world, "backfill", "b1")
    completed(world, "replay", "b1.replay-1", of_run="b1")
    row = latest(str(world.output)).filter(pc.equal(pc.field("id"), "r1")).to_pylist()[0]
    assert (row["outcome"], row["error_kind"]) == ("dead_letter", "invalid_text")


def test_a_run_after_a_replay_completes(world):
    """Found by the state machine (shrunk, then cut by hand to its three runs): a backfill with
    a rejected row, a replay of it (still rejected: its MERGE rewrites the dead letter), then
    another backfill: building the reuse index failed with "Function 'equal' has no kernel
    matching input types (string, string_view)"."""
    world.client.reject_prefix = "bad"
    world.write_file("a.parquet", [Row("r0", "t0", T0), Row("r1", "bad0", T0)])
    completed(world, "backfill", "b1")
    completed(world, "replay", "b1.replay-1", of_run="b1")
    completed(world, "backfill", "b2")


def test_a_replay_of_a_run_killed_right_after_its_run_commit_completes(world):
    """Found by the state machine: a daily with nothing new is killed right after its run commit,
    before its report is written; its lease expires. The run is committed (`raypipe.latest`
    counts it), so a replay of it finds nothing to do; before, it said "no run 'd2'" (a run
    was known by its report or its rows only)."""
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    completed(world, "backfill", "b1")
    assert world.run("daily", "d2", kill_at="after_commit_run").killed
    world.expire_lease()
    check_replay("d2", Output.at(str(world.output)))  # the CLI's preflight agrees
    completed(world, "replay", "d2.replay-1", of_run="d2")
    assert answers(world) == {"r0": hash_of("t0")}


def test_a_replay_that_rewrites_every_row_of_its_run_leaves_the_run_in_its_place(world):
    """Found by the state machine: a backfill whose one row is a dead letter; the row is changed
    in place (its new stamp may equal the old) and a daily answers the new text; then a replay
    of the backfill rewrites that dead letter. A run's place is its first commit (its earliest
    `inferred_at`): the replay rewrote the run's every row, so the backfill moved after the daily
    and `latest` answered the stale text."""
    world.client.reject_prefix = "bad"
    world.write_file("a.parquet", [Row("r0", "bad0", T0)])
    completed(world, "backfill", "b1")
    world.write_file("a.parquet", [Row("r0", "t0", T0)])
    completed(world, "daily", "d2")
    world.client.reject_prefix = None
    completed(world, "replay", "b1.replay-1", of_run="b1")
    assert answers(world) == {"r0": hash_of("t0")}
