"""The output's layout and file operations (`raypipe.store`) on a local folder: atomic writes,
listings that skip what a writer left half done, the operator's quarantine. No Ray."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa

from raypipe.store import OutputStore


def test_writes_are_whole_or_absent_and_listings_skip_a_writers_temporary_file(tmp_path):
    store = OutputStore(str(tmp_path))
    path = store.run_state("r1", "attempts", "a1.json")
    store.write_json(path, {"calls": 3})
    (tmp_path / "_raypipe" / "runs" / "r1" / "attempts" / "a2.json.tmp-deadbeef").write_text("{half")
    assert store.read_json(path) == {"calls": 3}
    assert store.list_files(store.run_state("r1", "attempts"), ".json") == [path]
    assert [p for p, _ in store.read_many_json([path])] == [path]
    assert store.list_files(store.run_state("nobody")) == []
    assert store.read_json_or_none(store.report_file("nobody")) is None


def test_parquet_round_trips_and_a_pickled_store_opens_its_own_filesystem(tmp_path):
    store = OutputStore(str(tmp_path) + "/")
    table = pa.table({"path": ["a"], "n": [1]})
    store.write_parquet(store.state("files_seen", "1.parquet"), table)
    copy = pickle.loads(pickle.dumps(store))
    assert copy.uri == str(tmp_path) and copy.is_local
    assert copy.read_parquet(store.state("files_seen", "1.parquet")).equals(table)


def test_the_cli_sets_shards_aside_and_releases_them(tmp_path, capsys):
    from raypipe.cli import main
    from raypipe.commit.output import Output
    from raypipe.commit.upkeep import quarantined

    out, shard = str(tmp_path / "out"), "s3://b/in/x.parquet"
    assert main(["shards", "quarantine", "--output", out, shard]) == 2  # a mistyped output is not made
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    assert main(["shards", "quarantine", "--output", out, shard, "--reason", "vendor broke it"]) == 0
    assert json.loads(capsys.readouterr().out) == {"quarantined": [shard]}
    assert quarantined(Output.at(out)) == frozenset({shard})
    assert main(["shards", "release", "--output", out, shard]) == 0
    assert json.loads(capsys.readouterr().out) == {"quarantined": []}
    assert quarantined(Output.at(out)) == frozenset()
