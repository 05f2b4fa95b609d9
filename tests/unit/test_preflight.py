"""Bad input is refused before anything happens (`raypipe.run.preflight`), through the real CLI
and the Python API: exit 2, one line naming the fix, the model service never called, Ray
never imported, and nothing created in the output. No Ray, no network beyond 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raypipe
from raypipe import api
from raypipe.errors import ConfigError, InputError, NoShardsError, SchemaError
from raypipe.run.preflight import check_ray_address, check_run, parse_since

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def service() -> Iterator[tuple[str, socket.socket]]:
    """A port that listens but never answers: any connection the CLI makes to it is seen."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield f"127.0.0.1:{sock.getsockname()[1]}", sock
    sock.close()


def contacted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONWARNINGS": "ignore"}
    env = {k: v for k, v in env.items() if not k.startswith("RAYPIPE_")}
    return subprocess.run(
        [sys.executable, "-m", "raypipe", *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


def refused(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The one line a refused run prints: exit 2, no traceback, each fragment in it."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("raypipe: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def shard(path: Path, **columns: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns or {"id": ["1", "2"], "text": ["a", "b"]}), path)
    return path


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# -- through the CLI --------------------------------------------------------------------------
def test_a_missing_input_is_named_before_the_service_is_called(tmp_path, service):
    address, sock = service
    out = tmp_path / "out"
    done = cli("backfill", "--input", str(tmp_path / "nonexistent"), "--output", str(out), "--service", address)
    refused(done, f"input {tmp_path / 'nonexistent'} does not exist", "set --input")
    assert not contacted(sock), "the model service was called before the input was checked"
    assert not out.exists()


def test_an_input_of_no_shards_lists_what_it_skipped(tmp_path, service):
    address, sock = service
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "_SUCCESS").write_text("")
    (tmp_path / "in" / "notes.txt").write_text("hi")
    out = tmp_path / "out"
    done = cli("daily", "--input", str(tmp_path / "in"), "--output", str(out), "--service", address)
    refused(done, "matches no shards", "unknown extension .txt", "set --input")
    assert not contacted(sock) and not out.exists()


@pytest.mark.parametrize("mode", ["backfill", "daily"])
def test_a_first_shard_without_the_text_column_names_the_setting(tmp_path, service, mode):
    address, sock = service
    shard(tmp_path / "in" / "a.parquet", id=["1"], body=["x"])
    shard(tmp_path / "in" / "b.parquet", id=["2"], body=["y"])
    out = tmp_path / "out"
    done = cli(mode, "--input", str(tmp_path / "in"), "--output", str(out), "--service", address)
    refused(done, "column 'text' is missing", "a.parquet", "--set input.text_column=NAME")
    assert not contacted(sock) and not out.exists()


def test_a_first_jsonl_shard_that_is_not_json_is_refused(tmp_path, service):
    address, sock = service
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("id,text\n1,hello\n")
    out = tmp_path / "out"
    refused(cli("backfill", "--input", str(tmp_path / "in"), "--output", str(out), "--service", address), "not JSON")
    assert not contacted(sock) and not out.exists()


@pytest.mark.parametrize(
    ("since", "says"),
    [("notadate", "is not an ISO time"), ("2026-11-20T00:00:00", "has no time zone"), ("", "is not an ISO time")],
)
def test_an_unparsable_since_is_refused(tmp_path, service, since, says):
    address, sock = service
    shard(tmp_path / "in" / "a.parquet")
    out = tmp_path / "out"
    done = cli("daily", "--input", str(tmp_path / "in"), "--output", str(out), "--service", address, "--since", since)
    refused(done, says, "2026-11-20T00:00:00Z")
    assert not contacted(sock) and not out.exists()


@pytest.mark.parametrize(
    ("pair", "says"),
    [
        ("input.unit_row=5", "input.unit_row: unknown setting (did you mean input.unit_rows?)"),
        ("servce.address=a:1", "servce: unknown setting (did you mean service?)"),
        ("input.unit_rows", "--set takes section.key=value"),
    ],
)
def test_an_unknown_setting_names_the_nearest_one(tmp_path, service, pair, says):
    address, sock = service
    shard(tmp_path / "in" / "a.parquet")
    out = tmp_path / "out"
    done = cli("backfill", "--input", str(tmp_path / "in"), "--output", str(out), "--service", address, "--set", pair)
    refused(done, says)
    assert not contacted(sock) and not out.exists()


def test_an_output_that_is_a_file_or_inside_the_input_is_refused(tmp_path, service):
    address, sock = service
    shard(tmp_path / "in" / "a.parquet")
    (tmp_path / "file").write_text("not a folder")
    done = cli("backfill", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "file"), "--service", address)
    refused(done, "is a file")
    inside = tmp_path / "in" / "out"
    done = cli("backfill", "--input", str(tmp_path / "in"), "--output", str(inside), "--service", address)
    refused(done, "is inside input", "choose an output outside the input")
    assert not contacted(sock) and not inside.exists()


def test_replay_of_an_output_with_no_table_or_no_such_run_is_refused(tmp_path, service):
    from raypipe.commit.table import OutcomeTable

    address, sock = service
    empty = tmp_path / "empty"
    refused(cli("replay", "--output", str(empty), "--run-id", "r1", "--service", address), "holds no outcomes table")
    assert not empty.exists()

    out = tmp_path / "out"
    OutcomeTable(str(out)).ensure(("joy", "anger"))
    (out / "runs").mkdir()
    (out / "runs" / "backfill-20261120.json").write_text("{}")
    before = tree(out)
    done = cli("replay", "--output", str(out), "--run-id", "backfill-20261121", "--service", address)
    refused(done, "no run 'backfill-20261121'", "did you mean backfill-20261120?")
    assert not contacted(sock)
    assert tree(out) == before, "a refused replay wrote into the output"


def test_a_refused_run_never_imports_ray(tmp_path):
    """The checks run before Ray is imported, so they cannot have started or joined a cluster."""
    code = (
        "import sys, raypipe\n"
        "try:\n"
        f"    raypipe.backfill({str(tmp_path / 'nonexistent')!r}, {str(tmp_path / 'out')!r}, service='127.0.0.1:1')\n"
        "except raypipe.InputError as e:\n"
        "    print('refused', 'ray' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stdout.strip() == "refused False", done.stdout + done.stderr


# -- the Python API takes the CLI's values ------------------------------------------------------
@pytest.fixture
def no_service(monkeypatch):
    """Fails the test if a run gets past its checks; records the run it would have started."""
    started: list[tuple[str, dict[str, object]]] = []

    def run(mode):
        def start(config, *input, **kwargs):
            started.append((mode, {"config": config, "input": input[0] if input else None, **kwargs}))
            return "started"

        return start

    from raypipe.run import modes

    for mode in ("backfill", "daily", "replay"):
        monkeypatch.setattr(modes, mode, run(mode))
    return started


def test_daily_takes_since_as_an_iso_string_like_the_cli(tmp_path, no_service):
    shard(tmp_path / "in" / "a.parquet")
    assert raypipe.daily(str(tmp_path / "in"), str(tmp_path / "out"), since="2026-11-20T00:00:00Z") == "started"
    assert no_service[0][1]["since"] == datetime(2026, 11, 20, tzinfo=UTC)
    aware = datetime(2026, 11, 20, 1, tzinfo=timezone(timedelta(hours=1)))
    raypipe.daily(str(tmp_path / "in"), str(tmp_path / "out"), since=aware)
    assert no_service[1][1]["since"] == aware
    with pytest.raises(ConfigError, match="has no time zone"):
        raypipe.daily(str(tmp_path / "in"), str(tmp_path / "out"), since=datetime(2026, 11, 20))
    assert len(no_service) == 2 and not (tmp_path / "out").exists()


def test_the_api_refuses_what_the_cli_refuses(tmp_path, no_service):
    with pytest.raises(NoShardsError, match="does not exist"):
        api.backfill(str(tmp_path / "nonexistent"), str(tmp_path / "out"))
    shard(tmp_path / "in" / "a.parquet", id=[1.5], text=["float id"])
    with pytest.raises(SchemaError, match="ids must be strings or integers"):
        api.backfill(str(tmp_path / "in"), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"did you mean input\.unit_rows\?"):
        api.backfill(str(tmp_path / "in"), str(tmp_path / "out"), settings={"input": {"unit_row": 5}})
    with pytest.raises(ConfigError, match="holds no outcomes table"):
        api.replay(str(tmp_path / "out"), run_id="r1")
    assert no_service == [] and not (tmp_path / "out").exists()


def test_a_good_run_passes_its_checks_and_reads_no_rows(tmp_path, no_service, monkeypatch):
    from raypipe.run import read

    shard(tmp_path / "in" / "a.parquet")
    shard(tmp_path / "in" / "b.parquet")
    monkeypatch.setattr(read, "read_unit", lambda *a, **k: pytest.fail("preflight read rows"))
    assert api.backfill(str(tmp_path / "in"), str(tmp_path / "out")) == "started"
    assert [mode for mode, _ in no_service] == ["backfill"] and not (tmp_path / "out").exists()


# -- the checks themselves ---------------------------------------------------------------------
def config(tmp_path: Path, **settings: object) -> raypipe.PipelineConfig:
    return api.build_config(input=str(tmp_path / "in"), output=str(tmp_path / "out"), settings=dict(settings))


def test_a_daily_records_one_bad_shard_but_refuses_a_wrong_column_setting(tmp_path):
    shard(tmp_path / "in" / "a.parquet", id=["1"], body=["x"])
    shard(tmp_path / "in" / "b.parquet")
    check_run(config(tmp_path), "daily")  # one bad file: the daily records it and goes on
    with pytest.raises(SchemaError, match="column 'text' is missing"):
        check_run(config(tmp_path), "backfill")  # a backfill stops on it (on_bad_shard: fail)
    with pytest.raises(SchemaError, match=r"column 'content' is missing.*--set input\.text_column=NAME"):
        check_run(config(tmp_path, input={"text_column": "content"}), "daily")  # first and last lack it


def test_a_corrupt_first_shard_is_refused_by_a_backfill(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="cannot read parquet shard") as e:
        check_run(config(tmp_path), "backfill")
    assert e.value.shard is not None and e.value.shard.endswith("a.parquet")


def test_a_quarantined_first_shard_is_not_checked(tmp_path):
    from raypipe.commit.upkeep import quarantine

    bad = shard(tmp_path / "in" / "a.parquet", id=["1"], body=["x"])
    shard(tmp_path / "in" / "b.parquet")
    quarantine(str(tmp_path / "out"), [str(bad)], reason="test")
    check_run(config(tmp_path), "backfill")


def test_an_unwritable_output_folder_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    shard(tmp_path / "in" / "a.parquet")
    (tmp_path / "locked").mkdir(mode=0o500)
    cfg = api.build_config(input=str(tmp_path / "in"), output=str(tmp_path / "locked" / "out"))
    with pytest.raises(ConfigError, match="is not writable"):
        check_run(cfg, "backfill")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("2026-11-20T00:00:00Z", datetime(2026, 11, 20, tzinfo=UTC)),
        ("2026-11-20T01:00:00+01:00", datetime(2026, 11, 20, tzinfo=UTC)),
        (" 2026-11-20T00:00:00+00:00 ", datetime(2026, 11, 20, tzinfo=UTC)),
    ],
)
def test_parse_since_takes_iso_times_with_a_zone(value, expected):
    assert parse_since(value) == expected


def test_parse_since_refuses_other_types():
    with pytest.raises(ConfigError, match="not int"):
        parse_since(20261120)  # type: ignore[arg-type]


def test_a_ray_address_nobody_answers_at_is_refused(service):
    address, _ = service
    check_ray_address({"RAY_ADDRESS": address})  # something listens: Ray may take it from here
    check_ray_address({"RAY_ADDRESS": f"ray://{address}"})
    for nothing_to_check in ({}, {"RAY_ADDRESS": "auto"}, {"RAY_ADDRESS": "http://127.0.0.1:8265"}):
        check_ray_address(nothing_to_check)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # bound then closed: nothing listens there
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS=127\.0\.0\.1:{port}: no Ray cluster answers there"):
        check_ray_address({"RAY_ADDRESS": f"127.0.0.1:{port}"})


def test_a_run_with_a_dead_ray_address_is_refused_before_its_output_is_touched(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    shard(tmp_path / "in" / "a.parquet")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYPIPE_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "raypipe",
            "backfill",
            "--input",
            str(tmp_path / "in"),
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        cwd=REPO,
    )
    refused(done, "no Ray cluster answers there")
    assert not (tmp_path / "out").exists()


def test_serve_refuses_a_missing_model_or_a_dead_ray_address_before_ray_starts(tmp_path, demo_model_dir):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "raypipe", "serve", "--detach", *args],
            capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
        )  # fmt: skip

    refused(serve("--model", str(tmp_path / "nope")), "model directory does not exist")
    (tmp_path / "settings.yaml").write_text("batch_max_call: 8\n")
    refused(serve("--model", str(demo_model_dir), "--settings", str(tmp_path / "settings.yaml")), "batch_max_call")
    refused(serve("--model", str(demo_model_dir)), f"RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answers there")


def test_report_of_an_unknown_run_names_the_nearest_one(tmp_path):
    (tmp_path / "out" / "runs").mkdir(parents=True)
    (tmp_path / "out" / "runs" / "daily-20261120.json").write_text("{}")
    refused(
        cli("report", "--output", str(tmp_path / "out"), "--run-id", "daily-20261210"), "did you mean daily-20261120?"
    )


def test_check_run_takes_a_replay_to_its_checks_and_a_backfill_to_the_input_checks(tmp_path):
    """`check_run` is `check_replay` for a replay (its run named first) and `check_input_run`
    for a backfill or a daily (an input required): the same refusals either way in."""
    from raypipe.commit.output import Output
    from raypipe.config import run_input
    from raypipe.run.preflight import check_replay

    for check in (lambda c: check_run(c, "replay"), lambda c: check_replay(None, Output.at(c.output))):
        with pytest.raises(ConfigError, match="needs the run whose dead letters to replay"):
            check(config(tmp_path))
    no_input = config(tmp_path).model_copy(update={"input": None})
    with pytest.raises(ConfigError, match="a backfill needs an input"):
        check_run(no_input, "backfill")
    with pytest.raises(ConfigError, match="a backfill needs an input"):
        run_input(no_input, None, "backfill")


@pytest.mark.parametrize(
    "command",
    [
        ["compact"],
        ["vacuum"],
        ["migrate"],
        ["lease", "show"],
        ["shards", "release", "s3://b/in/a.parquet"],
        ["report", "--run-id", "r1"],
        ["backfill", "--input", "IN", "--service", "127.0.0.1:1"],
    ],
)
def test_an_output_that_is_no_uri_is_refused_by_every_command_before_a_filesystem_is_asked(tmp_path, command):
    """A `gs://` output (no such scheme here) was handed to fsspec and delta-rs by the output
    commands, which asked a cloud metadata server and died with a traceback."""
    (tmp_path / "in").mkdir()
    args = [str(tmp_path / "in") if a == "IN" else a for a in command]
    refused(cli(*args, "--output", "gs://bucket/out"), "scheme 'gs' is not supported")


def test_a_reader_refuses_an_output_that_is_no_uri():
    import raypipe

    for read in (raypipe.read_outcomes, raypipe.latest):
        with pytest.raises(ConfigError, match="scheme 'gs' is not supported"):
            read("gs://bucket/out")
