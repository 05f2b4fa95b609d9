"""Deltas that lose nothing and re-infer nothing, on real parts (local Ray, the Serve gRPC app).

Each test reproduces one way the earlier clock-window deltas lost rows or redid work: a late
file, a mended bad shard, a future-dated sentinel, a metadata-only change, invalid UTF-8.
The server's own counts say what was inferred.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from raypipe.commit.upkeep import quarantine
from tests.integration.helpers import assert_nothing_lost, dead_letters, ids, results

pytestmark = pytest.mark.timeout(420)


def _table(ids_: list[str], texts: list[str], when: datetime | list[datetime | None]) -> pa.Table:
    stamps = when if isinstance(when, list) else [when] * len(ids_)
    return pa.table({"id": ids_, "text": texts, "updated_at": pa.array(stamps, pa.timestamp("us", tz="UTC"))})


def _texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} paragraph number {i}: what a lovely, joyful day it was" for i in range(n)]


APP = "raypipe"  # the session's shared app: the tests run one at a time, so counts since a test began are its own


def _answered() -> int:
    return int(serve.get_app_handle(APP).stats.remote().result()["paragraphs"].get("OK", 0))


@pytest.fixture
def inferred(serve_address: str) -> Callable[[], int]:
    """Paragraphs the shared app answered since the test began."""
    start = _answered()
    return lambda: _answered() - start


def test_a_late_file_of_old_rows_is_inferred_by_the_next_daily(tmp_path, serve_address, inferred):
    """d1 reads up to T; a file of 50 rows updated before T (five with no updated_at) lands
    afterwards (export lag, a producer clock behind): d2, even with `--since` after every one of
    them, infers all 50 and says it read a new file (a window applies only to files read before)."""
    app = APP
    t = datetime.now(UTC) - timedelta(hours=1)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    pq.write_table(_table([f"a{i}" for i in range(100)], _texts("a", 100), t), in_dir / "a.parquet")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}}
    d1 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d1", settings=cfg)
    assert d1.status == "completed" and d1.rows_in == 100
    late = [t - timedelta(minutes=40) + timedelta(seconds=i) for i in range(45)] + [None] * 5
    pq.write_table(_table([f"late{i}" for i in range(50)], _texts("late", 50), late), in_dir / "late.parquet")
    before = inferred()
    since = t + timedelta(minutes=1)
    d2 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d2", since=since, settings=cfg)
    assert d2.status == "completed" and d2.rows_in == 50
    assert inferred() - before == 50
    assert d2.planning["files"] == {"new": 1, "unchanged": 1}
    assert "new 1" in d2.render()
    assert_nothing_lost(out, [*(f"a{i}" for i in range(100)), *(f"late{i}" for i in range(50))])


def test_a_mended_bad_shard_costs_only_its_own_rows_and_blocks_nothing(tmp_path, serve_address, inferred):
    """d1 over three shards, one corrupt: the two healthy ones are committed and recorded (exit 3,
    incomplete); d2 retries the bad one and reports it again; once mended, d3 infers only its rows."""
    app = APP
    t = datetime.now(UTC) - timedelta(hours=2)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    for name in ("a", "b"):
        pq.write_table(_table([f"{name}{i}" for i in range(1000)], _texts(name, 1000), t), in_dir / f"{name}.parquet")
    (in_dir / "c.parquet").write_bytes(b"PAR1 not parquet at all PAR1")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}}
    d1 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d1", settings=cfg)
    assert d1.status == "incomplete" and [Path(b["shard"]).name for b in d1.bad_shards] == ["c.parquet"]
    assert d1.rows_in == 2000 and inferred() == 2000
    d2 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d2", settings=cfg)
    assert d2.status == "incomplete" and [Path(b["shard"]).name for b in d2.bad_shards] == ["c.parquet"]
    assert d2.rows_in == 0 and inferred() == 2000  # the healthy shards are not read again
    pq.write_table(_table([f"c{i}" for i in range(30)], _texts("c", 30), t), in_dir / "c.parquet")
    d3 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d3", settings=cfg)
    assert d3.status == "completed" and d3.rows_in == 30
    assert inferred() == 2030  # was 4,030: every healthy row inferred twice
    # A shard that stays bad can be set aside by an operator: listed as skipped, the run completes.
    (in_dir / "d.parquet").write_bytes(b"PAR1 broken for good PAR1")
    quarantine(out, [str(in_dir / "d.parquet")], reason="vendor export broken")
    d4 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d4", settings=cfg)
    assert d4.status == "completed" and d4.bad_shards == []
    assert [Path(s["path"]).name for s in d4.skipped_files] == ["d.parquet"]
    assert "quarantined" in d4.skipped_files[0]["reason"]


def test_a_future_dated_sentinel_neither_moves_the_watermark_nor_blocks_dailies(tmp_path, serve_address, inferred):
    app = APP
    now = datetime.now(UTC)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    stamps = [now - timedelta(days=1)] * 99 + [datetime(9999, 12, 31, tzinfo=UTC)]
    pq.write_table(_table([f"s{i}" for i in range(100)], _texts("s", 100), stamps), in_dir / "s.parquet")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}}
    back = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="bf", settings=cfg)
    assert back.status == "completed" and back.rows_in == 100
    assert back.planning["future_row_groups"] == 1
    watermark = datetime.fromisoformat(back.planning["read_as_of"])
    assert watermark < now + timedelta(hours=1)
    pq.write_table(_table([f"n{i}" for i in range(100)], _texts("n", 100), now), in_dir / "n.parquet")
    daily = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d1", settings=cfg)
    assert daily.status == "completed" and daily.rows_in == 100  # was: exit 2, 0 of 100 inferred
    assert inferred() == 200


def test_a_metadata_only_change_costs_no_call(tmp_path, serve_address, inferred):
    """A backfill of 2,000 rows; 1,000 of them come back with a newer updated_at and the same
    text: the daily makes no call for them, and their results carry the new updated_at."""
    app = APP
    t = datetime.now(UTC) - timedelta(days=2)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    all_ids, texts = [f"m{i}" for i in range(2000)], _texts("m", 2000)
    pq.write_table(_table(all_ids, texts, t), in_dir / "base.parquet")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}}
    back = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="bf", settings=cfg)
    assert back.status == "completed" and inferred() == 2000
    touched = t + timedelta(days=1)
    pq.write_table(_table(all_ids[:1000], texts[:1000], touched), in_dir / "touched.parquet")
    daily = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d1", settings=cfg)
    assert daily.status == "completed" and daily.rows_in == 1000
    assert daily.rows_copied == 1000 and daily.calls == 0  # was 32 calls, 1,000 rows re-inferred
    assert inferred() == 2000
    latest = {r["id"]: r for r in raypipe.latest(out).to_pylist()}
    assert {latest[i]["run_id"] for i in all_ids[:1000]} == {"d1"}
    assert {latest[i]["updated_at"] for i in all_ids[:1000]} == {touched}
    assert {latest[i]["run_id"] for i in all_ids[1000:]} == {"bf"}


def test_invalid_utf8_in_one_text_is_a_dead_letter_and_the_rest_is_inferred(tmp_path, serve_address):
    """One of 1,000 texts holds invalid UTF-8: it becomes a dead letter (`invalid_text`, its first
    bytes in hex), and the other 999 rows get results (was: the run failed, none had a fate)."""
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    raw = [t.encode() for t in _texts("u", 1000)]
    raw[500] = b"broken \xc3\x28 bytes"
    pq.write_table(
        pa.table({"id": [f"u{i}" for i in range(1000)], "text": pa.array(raw, pa.binary()).view(pa.string())}),
        in_dir / "u.parquet",
    )
    (in_dir / "notes.txt").write_text("not a shard")
    out = str(tmp_path / "out")
    report = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="utf8")
    assert report.status == "completed"
    assert report.rows_dead_letters == 1 and report.dead_letter_kinds == {"invalid_text": 1}
    dead = dead_letters(out).to_pylist()[0]
    assert dead["id"] == "u500" and "c328" in dead["message"] and dead["row"] == 500
    assert len(ids(results(out))) == 999
    assert [Path(s["path"]).name for s in report.skipped_files] == ["notes.txt"]
    assert "unknown extension .txt" in report.render()


def test_a_file_rewritten_in_place_is_read_whole_and_costs_its_changed_texts(tmp_path, serve_address, inferred):
    """A producer rewrites a file with 10 rows changed among 200: the daily reads it whole and
    infers those 10; the 190 unchanged texts are answered from the table, not by the service."""
    app = APP
    t = datetime.now(UTC) - timedelta(days=1)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    ids_, texts = [f"w{i}" for i in range(200)], _texts("w", 200)
    pq.write_table(_table(ids_, texts, t), in_dir / "w.parquet")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}}
    assert raypipe.daily(str(in_dir), out, service=serve_address, run_id="d1", settings=cfg).rows_in == 200
    later = t + timedelta(hours=3)
    texts = [f"rewritten, a furious paragraph {i}" if i < 10 else x for i, x in enumerate(texts)]
    pq.write_table(_table(ids_, texts, [later] * 10 + [t] * 190), in_dir / "w.parquet")
    d2 = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d2", settings=cfg)
    assert d2.status == "completed" and d2.planning["files"] == {"changed": 1}
    assert d2.rows_in == 200 and d2.rows_copied == 190
    assert inferred() == 210


def test_a_file_planned_whole_from_its_size_and_rewritten_costs_its_changed_texts(tmp_path, serve_address, inferred):
    """A backfill over more shards than `input.footer_sample` plans the unsampled ones whole,
    with no footer read; a file rewritten in place afterwards is read whole by the daily, which
    infers its changed texts only: the others are answered from the table, not by the service."""
    app = APP
    t = (datetime.now(UTC) - timedelta(days=1)).replace(microsecond=123_456)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    files = {k: ([f"f{k}-{i}" for i in range(40)], _texts(f"f{k}", 40)) for k in range(4)}
    for k, (ids_, texts) in files.items():
        stamps = [t + timedelta(seconds=i) for i in range(40)]
        pq.write_table(_table(ids_, texts, stamps), in_dir / f"part-{k}.parquet")
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}, "input": {"footer_sample": 1}}
    b = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="b", settings=cfg)
    assert b.status == "completed" and b.rows_in == 160 and b.units_total == 4
    assert (b.planning["footers_read"], b.planning["whole_files"]) == (1, 3)
    ids_, texts = files[2]
    texts = [f"rewritten, a furious paragraph {i}" if i < 5 else x for i, x in enumerate(texts)]
    stamps = [t + timedelta(hours=3)] * 5 + [t + timedelta(seconds=i) for i in range(5, 40)]
    pq.write_table(_table(ids_, texts, stamps), in_dir / "part-2.parquet")
    before = inferred()
    d = raypipe.daily(str(in_dir), out, service=serve_address, run_id="d", settings=cfg)
    assert d.status == "completed" and d.planning["files"] == {"changed": 1, "unchanged": 3}
    assert d.rows_in == 40 and d.rows_copied == 35, "the file whole; its 35 unchanged texts answered by reuse"
    assert inferred() - before == 5
    newest = {r["id"]: r for r in raypipe.latest(out).to_pylist()}
    assert sorted(newest) == sorted(i for ids_, _ in files.values() for i in ids_)
    assert {f"f2-{i}" for i in range(5)} <= {i for i, r in newest.items() if r["run_id"] == "d"}
