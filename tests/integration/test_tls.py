"""The client reaches the real Serve gRPC proxy through TLS.

Serve's proxy is plaintext (Ray 2.60); a TLS-terminating proxy on loopback stands in for the
sidecar production puts in front of it (`tests.tls.TlsProxy`, certificates made per session).
The runs are given only the TLS port, so every call of the driver's check and of the actors
crosses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

import raypipe
from raypipe.api import build_config
from raypipe.commit.output import Output
from raypipe.commit.table import OutcomeTable
from raypipe.errors import ConfigError, ServiceTlsError
from raypipe.run import modes
from raypipe.samples import write_sample_corpus
from tests.integration.helpers import dead_letters, results
from tests.tls import Pki, TlsProxy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_proxy(serve_address: str, pki: Pki):
    proxy = TlsProxy(int(serve_address.rsplit(":", 1)[1]), pki.server_context()).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sample_corpus(str(tmp_path_factory.mktemp("in") / "c"), rows=400, parquet_shards=2, jsonl_shards=0)


SETTINGS = {"input": {"unit_rows": 200}, "client": {"micro_batch_size": 16}, "progress_interval_s": 2}


@pytest.mark.timeout(300)
def test_backfill_through_tls_has_every_id_in_the_results(tmp_path, corpus, tls_proxy, pki):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki.ca_file.read_bytes())
    out = str(tmp_path / "out")
    config = build_config(
        input=corpus.uri,
        output=out,
        service=f"grpcs://{tls_proxy.address}",
        settings={**SETTINGS, "service": {"ca_file": str(ca), "timeout_s": 30}},
    )
    ca.unlink()  # read when the config was built: neither the check nor the actors open it
    before = len(tls_proxy.sessions)

    assert config.input is not None
    report = modes.backfill(config, config.input, Output.at(config.output))

    assert report.status == "completed", report.render()
    rows = raypipe.read_outcomes(out)
    results = rows.filter(pc.equal(rows.column("outcome"), "result"))
    assert sorted(results.column("id").to_pylist()) == sorted(corpus.ids)
    assert report.rows_dead_letters == 0 and rows.num_rows == len(corpus.ids)
    sessions = tls_proxy.sessions[before:]
    assert len(sessions) >= 2  # the driver's check, then the actor(s)
    assert all(alpn == "h2" and version.startswith("TLSv1.") for version, alpn in sessions)


@pytest.mark.timeout(180)
def test_wrong_ca_fails_fast_with_the_tls_message_and_commits_nothing(tmp_path, corpus, tls_proxy, pki):
    out = tmp_path / "out"
    settings = {**SETTINGS, "service": {"ca_file": str(pki.other_ca_file), "connect_timeout_s": 60}}
    t0 = time.monotonic()
    with pytest.raises(ServiceTlsError) as info:
        raypipe.backfill(corpus.uri, str(out), service=f"grpcs://{tls_proxy.address}", settings=settings)
    assert time.monotonic() - t0 < 15  # far below the 60 s connect timeout: nothing was waited out
    assert str(info.value).startswith(f"TLS handshake with {tls_proxy.address} failed: certificate verify failed")
    assert not OutcomeTable(str(out)).exists()
    assert not (out / "runs").exists()

    # The same from the CLI, the CA given by the environment: exit 1 and the message, nothing written.
    env = {**os.environ, "RAYPIPE_SERVICE__CA_FILE": str(pki.other_ca_file)}
    cli = subprocess.run(
        [sys.executable, "-m", "raypipe", "backfill", "--input", corpus.uri, "--output", str(out),
         "--service", f"grpcs://{tls_proxy.address}"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert f"TLS handshake with {tls_proxy.address} failed: certificate verify failed" in cli.stderr
    assert not OutcomeTable(str(out)).exists()


@pytest.mark.timeout(300)
def test_a_token_on_the_driver_only_fails_the_run_naming_the_variable(tmp_path, corpus, tls_proxy, pki, monkeypatch):
    """The token is read where the calls are made. This cluster's workers were started without the
    variable, so the driver's check passes and the first actor fails, naming the variable."""
    monkeypatch.setenv("RAYPIPE_TEST_TLS_TOKEN", "driver-only-token")
    out = tmp_path / "out"
    settings = {**SETTINGS, "service": {"ca_file": str(pki.ca_file), "token_env": "RAYPIPE_TEST_TLS_TOKEN"}}
    message = r"environment variable RAYPIPE_TEST_TLS_TOKEN is not set .* every node"
    with pytest.raises(ConfigError, match=message) as info:
        raypipe.backfill(corpus.uri, str(out), service=f"grpcs://{tls_proxy.address}", settings=settings)
    assert "driver-only-token" not in str(info.value)
    assert results(out) is None and dead_letters(out) is None
