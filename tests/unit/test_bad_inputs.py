"""Bad input to the CLI: exit 2, one line naming the fix, nothing written. No Ray is ever
started (RAY_ADDRESS names a closed port, which the preflight refuses last), no network
beyond 127.0.0.1."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from raypipe.cli import main
from tests.unit.test_outcomes import T0, commit


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    for key in ("RAYPIPE_SERVICE_TOKEN", "RAYPIPE_SERVICE__TOKEN_ENV"):
        monkeypatch.delenv(key, raising=False)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and " DEBUG " not in line]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("raypipe: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_token_pasted_into_token_env_is_refused_without_echo(tmp_path: Path, capsys) -> None:
    token = "ghp1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9"
    line = refused(
        [
            *("backfill", "--input", str(tmp_path), "--output", str(tmp_path / "out")),
            *("--set", "service.tls=true", "--set", f"service.token_env={token}"),
        ],
        capsys,
        "service.token_env",
        "not hold the token itself",
    )
    assert token not in line and not (tmp_path / "out").exists()


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys) -> None:
    config = tmp_path / "bad.yaml"
    config.write_bytes(b'service:\n  address: "caf\xe9:9000"\n')
    refused(
        ["backfill", "--input", str(tmp_path), "--output", str(tmp_path / "out"), "--config", str(config)],
        capsys,
        "not UTF-8",
        "save it as UTF-8",
    )
    assert not (tmp_path / "out").exists()


def test_an_unreachable_s3_endpoint_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    refused(["backfill", "--input", "s3://b/in", "--output", "s3://b/out"], capsys, "cannot reach", endpoint)


def test_quarantine_on_a_mistyped_output_does_not_create_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "outptu"
    refused(["shards", "quarantine", "--output", str(out), "s3://b/in/a.parquet"], capsys, "does not exist")
    assert not out.exists()


def test_compact_and_migrate_on_an_empty_output_say_there_is_nothing(tmp_path: Path, capsys) -> None:
    refused(["compact", "--output", str(tmp_path)], capsys, "holds no outcomes table", "check --output")
    refused(["migrate", "--output", str(tmp_path)], capsys, "earlier layout", "check --output")
    assert list(tmp_path.iterdir()) == []


def test_compact_of_an_unfinished_run_is_one_line(tmp_path: Path, capsys) -> None:
    from raypipe.commit.table import OutcomeTable

    commit(tmp_path, "r1", "u1", ["a"], version="A", updated=T0)  # a unit committed, the run not finished
    before = OutcomeTable(str(tmp_path)).load().version()
    refused(["compact", "--output", str(tmp_path), "--run-id", "r1"], capsys, "unfinished", "r1")
    assert OutcomeTable(str(tmp_path)).load().version() == before
    refused(["compact", "--output", str(tmp_path), "--run-id", "../r1"], capsys, "--run-id")
