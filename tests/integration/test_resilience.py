"""Nothing lost under faults: injected failures, a killed replica, an outage, low capacity, bad requests.

Each test is bounded in time (pytest-timeout) and in the number of calls it makes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray import serve

import raypipe
from bench.tcp_proxy import TcpProxy
from raypipe.errors import CircuitOpenError
from raypipe.samples import write_sample_corpus
from serve_app.deploy import DeploymentOptions
from serve_app.settings import FaultInjection, ServerSettings
from tests.integration.conftest import free_port, wait_for
from tests.integration.helpers import assert_nothing_lost, dead_letters
from tests.integration.helpers import results as committed_results

FAST_RETRY = {"initial_backoff_s": 0.05, "max_backoff_s": 0.5}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sample_corpus(str(tmp_path_factory.mktemp("in") / "c"), rows=1500, parquet_shards=3, jsonl_shards=1)


def settings(app: str, **extra):
    base = {
        "service": {"application": app, "timeout_s": 20},
        "input": {"unit_rows": 250},
        "client": {"micro_batch_size": 16, "retry": dict(FAST_RETRY)},
        "progress_interval_s": 2,
    }
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


@pytest.mark.timeout(300)
def test_20_percent_unavailable_completes_and_counts_match_the_server(tmp_path, corpus, serve_address, deploy_app):
    app = deploy_app("faulty20", ServerSettings(fault=FaultInjection(fail_fraction=0.2, status="UNAVAILABLE", seed=5)))
    report = raypipe.backfill(corpus.uri, str(tmp_path / "out"), service=serve_address, settings=settings(app))
    assert report.status == "completed"
    assert_nothing_lost(tmp_path / "out", corpus.ids)
    server = serve.get_app_handle(app).stats.remote().result()
    print(
        f"20% UNAVAILABLE: client {report.status_counts}, server {server['calls']}, "
        f"retries {report.retries}, dead letters {report.rows_dead_letters}"
    )
    assert report.status_counts.get("UNAVAILABLE", 0) == server["calls"]["UNAVAILABLE"] > 0
    assert report.status_counts["OK"] == server["calls"]["OK"]
    # Every result was answered by the server, once per distinct text (a unit sends a text once).
    assert report.rows_ok == server["paragraphs"]["OK"] + report.rows_copied
    assert report.retries >= server["calls"]["UNAVAILABLE"] - report.rows_dead_letters


@pytest.mark.timeout(300)
def test_poison_rows_are_dead_lettered_alone_then_replayed_into_the_results(tmp_path, serve_address, deploy_app):
    """Rows whose calls fail (INTERNAL) while their neighbours succeed are isolated and recorded;
    a replay against a fixed service merges them back, and nothing is lost or doubled."""
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=400, parquet_shards=2, jsonl_shards=0, seed=71)
    in_dir = tmp_path / "in"
    import pyarrow as pa
    import pyarrow.parquet as pq

    poison_ids = [f"poison{i}" for i in range(5)]
    pq.write_table(pa.table({"id": poison_ids, "text": [f"CRASHME paragraph {i}" for i in range(5)]}),
                   in_dir / "poison.parquet")  # fmt: skip
    app = deploy_app("poisoned", ServerSettings(fault=FaultInjection(poison_text="CRASHME", status="INTERNAL")))
    out = str(tmp_path / "out")
    report = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="dl", settings=settings(app))
    assert report.status == "completed"
    assert report.rows_dead_letters == 5 and report.dead_letter_kinds == {"internal": 5}
    dl = dead_letters(out)
    assert sorted(dl.column("id").to_pylist()) == poison_ids
    assert set(dl.column("grpc_status").to_pylist()) == {"INTERNAL"}
    assert dl.column("text").null_count == 0
    all_ids = [*corpus.ids, *poison_ids]
    assert_nothing_lost(out, all_ids)

    # The model is fixed (the clean app): the replay merges the rows back.
    replayed = raypipe.replay(out, run_id="dl", service=serve_address, settings={"progress_interval_s": 2})
    assert replayed.status == "completed" and replayed.replay_of == "dl"
    assert replayed.run_id == "dl.replay-1"
    assert replayed.rows_in == 5 == replayed.rows_ok
    results, dead = assert_nothing_lost(out, all_ids)
    assert dead == [] and len(results) == len(all_ids)


def backfill_in_background(input_uri, out, service, cfg, started: threading.Event | None = None, begun=None):
    """Starts a backfill in a thread and returns, once its first unit is committed (or `started`
    is set, or `begun()` is true), a `finish` that waits for the run and returns its report (or
    raises its error)."""
    box = {}

    def run():
        try:
            box["report"] = raypipe.backfill(input_uri, str(out), service=service, settings=cfg)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def going() -> bool:
        if begun is not None:
            return bool(begun())
        return (started is not None and started.is_set()) or committed_results(out) is not None

    wait_for(lambda: going() or not thread.is_alive(), 120, "a first committed unit")

    def finish():
        thread.join(timeout=240)
        if "error" in box:
            raise box["error"]
        return box["report"]

    return finish


def _replica_actor(app: str):
    from ray.util.state import list_actors

    alive = [
        a
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        if a.class_name.startswith("ServeReplica:" + app + ":")
    ]
    assert alive, f"no live replica of {app}"
    return ray.get_actor(alive[0].name, namespace="serve")


@pytest.mark.timeout(300)
def test_a_replica_killed_mid_run_loses_nothing(tmp_path, serve_address, deploy_app):
    # Each call is held 1 s on the server, and the kill lands once the replica has answered
    # some calls and holds others: a kill between two units' calls fails none (Serve's router
    # sends calls not yet on a replica to its successor), and the test would prove nothing.
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=300, parquet_shards=2, jsonl_shards=0, seed=29)
    app = deploy_app("killable", ServerSettings(fault=FaultInjection(extra_latency_s=1.0)))
    replica = _replica_actor(app)  # found before the run: the state API can take seconds
    out = tmp_path / "out"

    def holding() -> bool:
        stats = serve.get_app_handle(app).stats.remote().result()
        return sum(stats["calls"].values()) >= 3 and stats["in_flight"]["calls"] > 0

    finish = backfill_in_background(corpus.uri, out, serve_address, settings(app), begun=holding)
    ray.kill(replica, no_restart=False)
    report = finish()
    print(
        f"replica killed: {report.status_counts}, retries {report.retries}, "
        f"dead letters {report.rows_dead_letters}, breaker openings {report.breaker_openings}"
    )
    assert report.status == "completed"
    assert_nothing_lost(out, corpus.ids)
    assert set(report.status_counts) - {"OK"}, "the kill should have failed some calls"


@pytest.mark.timeout(300)
def test_an_outage_opens_the_breaker_and_calls_while_open_stay_bounded(tmp_path, corpus, serve_address, grpc_port):
    # The outage starts at a point of the work, not of the clock: the proxy cuts itself once a
    # fifth of the corpus's distinct text has gone up, so most calls are still to come on any CPU.
    distinct_bytes = sum(len(t.encode()) for t in set(corpus.texts) if t and t.strip())
    proxy = TcpProxy(grpc_port, free_port(), cut_after_up=distinct_bytes // 5).start()
    out = tmp_path / "out"
    threshold, limit_max, outage_s = 5, 8, 15.0
    cfg = settings(
        "raypipe",
        client={
            "breaker": {"failure_threshold": threshold, "reset_timeout_s": 1.0, "max_reset_timeout_s": 4.0},
            "limiter": {"kind": "adaptive", "initial": 4, "max_limit": limit_max},
        },
        actors={"min_actors": 1, "max_actors": 1},
    )
    try:
        finish = backfill_in_background(corpus.uri, out, proxy.address, cfg, started=proxy.cut_fired)
        assert proxy.cut_fired.wait(120), "the run never sent a fifth of its text"
        time.sleep(outage_s)
        proxy.restore()
        report = finish()
    finally:
        proxy.stop()
    print(
        f"outage: status {report.status_counts}, openings {report.breaker_openings}, "
        f"open {report.breaker_time_open_s} s, probes {report.breaker_probes}"
    )
    assert report.status == "completed"
    assert_nothing_lost(out, corpus.ids)
    assert report.rows_dead_letters == 0
    assert report.breaker_openings >= 1 and report.breaker_time_open_s >= 5
    # The bound, per actor: while open, one probe call per reset timeout (1 s doubling to its
    # 4 s cap), plus the probe that closes it; before it opens, the calls in flight (at most the
    # limit) and `threshold` more can fail.
    probes_bound = probes_within(report.breaker_time_open_s) + report.breaker_openings
    assert report.breaker_probes <= probes_bound
    # Attempts, not calls: a call holds its slot through its retries (4 attempts at most).
    failed = sum(n for code, n in report.status_counts.items() if code != "OK")
    calls_bound = limit_max + threshold * report.breaker_openings + probes_bound
    assert failed <= 4 * calls_bound, report.status_counts
    assert report.breaker_time_open_s <= outage_s + 10  # closes soon after the service is back


@pytest.mark.timeout(240)
def test_a_service_failing_every_call_stops_the_run_within_max_wait(tmp_path, serve_address, deploy_app):
    """INTERNAL on every call: the breaker stops the run within max_wait_s + one reset period
    of opening (not once per call), the failed report keeps its calls, a healthy rerun completes."""
    app = deploy_app("broken", ServerSettings(fault=FaultInjection(fail_fraction=1.0, status="INTERNAL")))
    # Two units (the module's corpus is six): no call answers, so the stop does not depend on the
    # corpus's size, and the healthy rerun has less to do.
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=500, parquet_shards=2, jsonl_shards=0, seed=61)
    out = tmp_path / "out"
    max_wait_s, reset_cap_s = 8.0, 2.0
    breaker = {"reset_timeout_s": 1.0, "max_reset_timeout_s": reset_cap_s, "max_wait_s": max_wait_s}
    t0 = time.monotonic()
    with pytest.raises(CircuitOpenError):
        raypipe.backfill(
            corpus.uri,
            str(out),
            service=serve_address,
            run_id="broken",
            settings=settings(app, client={"breaker": breaker}),
        )
    elapsed = time.monotonic() - t0
    stored = json.loads((out / "runs" / "broken.json").read_text())
    print(f"broken service: stopped after {elapsed:.1f} s, {stored['calls']} calls {stored['status_counts']}")
    assert stored["status"] == "failed"
    assert stored["calls"] > 0 and stored["status_counts"].get("INTERNAL", 0) > 0
    assert stored["breaker_openings"] >= 1
    assert stored["rows_dead_letters"] == 0  # a broken service is not bad input
    # Each actor's breaker stops it within max_wait_s + one reset period of opening (its own
    # clock); the run's wall adds the pipeline's start (actors, first calls), which loaded cores
    # stretch, so it only guards against a run that does not stop.
    actors = stored["limiter"]["actors"]
    assert stored["breaker_time_open_s"] <= actors * (max_wait_s + reset_cap_s + 2), (actors, stored)
    assert elapsed <= max_wait_s + reset_cap_s + 120
    report = raypipe.backfill(
        corpus.uri, str(out), service=serve_address, run_id="broken", settings=settings("raypipe")
    )
    assert report.status == "completed"
    assert_nothing_lost(out, corpus.ids)


def tallied_calls(out: Path, run_id: str) -> int:
    """Calls the run's actors have written to the output so far (`raypipe.tally`)."""
    records = (out / "_raypipe" / "runs" / run_id / "attempts").glob("*/actors/*.json")
    return sum(json.loads(p.read_text())["tally"]["calls"] for p in records)


@pytest.mark.timeout(360)  # the scenario is bounded to 240 s below (on loaded cores); the rest is the shared fixtures
def test_a_run_stopped_by_sigterm_fails_cleanly_and_keeps_its_calls(
    tmp_path, corpus, ray_cluster, serve_address, deploy_app
):
    """Every call answers UNAVAILABLE and the breaker would wait 10 minutes, so no unit ends;
    SIGTERM to the driver stops the run: exit 143, and a failed report with the calls made."""
    app = deploy_app("down", ServerSettings(fault=FaultInjection(fail_fraction=1.0, status="UNAVAILABLE")))
    out = tmp_path / "out"
    args = ["backfill", "--input", corpus.uri, "--output", str(out), "--service", serve_address,
            "--run-id", "stopped", "--set", f"service.application={app}", "--set", "input.unit_rows=250",
            "--set", "client.breaker.max_wait_s=600", "--set", "client.retry.initial_backoff_s=0.05",
            "--set", "client.retry.max_backoff_s=0.3"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    driver = subprocess.Popen([sys.executable, "-m", "raypipe", *args], env=env, cwd=Path(__file__).parents[2],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: tallied_calls(out, "stopped") > 0 or driver.poll() is not None, 180, "the first calls")
        assert driver.poll() is None, "the run ended before it was stopped"
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    served = serve.get_app_handle(app).stats.remote().result()["calls"]
    report = json.loads((out / "runs" / "stopped.json").read_text())
    print(f"stopped by SIGTERM: exit {driver.returncode}, report {report['calls']} calls, server {served}")
    assert driver.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err
    assert report["status"] == "failed" and "SIGTERM" in report["error"]
    assert 0 < report["calls"] <= served.get("UNAVAILABLE", 0)
    assert report["status_counts"] == {"UNAVAILABLE": report["calls"]}
    assert report["rows_dead_letters"] == 0


def probes_within(open_s: float, reset_s: float = 1.0, cap_s: float = 4.0) -> int:
    """How many reset periods start within open_s seconds of opening (doubling, capped)."""
    n, t, period = 0, 0.0, reset_s
    while t + period <= open_s + 1e-9:
        t += period
        n += 1
        period = min(cap_s, 2 * period)
    return n


@pytest.fixture(scope="module")
def storm_corpus(tmp_path_factory):
    """200 calls of 4 rows: a fixed limit of 200 sends them all at once."""
    return write_sample_corpus(str(tmp_path_factory.mktemp("in") / "s"), rows=800, parquet_shards=2, jsonl_shards=0)


@pytest.mark.timeout(420)
def test_adaptive_limit_avoids_the_deadline_storm_a_fixed_200_causes(tmp_path, storm_corpus, serve_address, deploy_app):
    app = deploy_app(
        "small",
        ServerSettings(batch_max_calls=1, fault=FaultInjection(extra_latency_s=0.02)),
        DeploymentOptions(max_ongoing_requests=2),
    )

    def limited(limiter):
        return settings(
            app,
            service={"timeout_s": 1.5},
            # Short waits after failures: what is compared is the storm, not how long it lasts.
            client={
                "micro_batch_size": 4,
                "limiter": limiter,
                "retry": {"max_backoff_s": 0.5},
                "breaker": {"max_reset_timeout_s": 1.0},
            },
            actors={"min_actors": 1, "max_actors": 1, "units_per_actor": 2},
            input={"unit_rows": 400},
        )

    fixed = raypipe.backfill(
        storm_corpus.uri,
        str(tmp_path / "fixed"),
        service=serve_address,
        settings=limited({"kind": "fixed", "initial": 200}),
    )
    adaptive = raypipe.backfill(
        storm_corpus.uri,
        str(tmp_path / "adaptive"),
        service=serve_address,
        settings=limited({"kind": "adaptive", "initial": 4, "max_limit": 200}),
    )
    print(
        "fixed 200:",
        fixed.status_counts,
        fixed.rows_dead_letters,
        "| adaptive:",
        adaptive.status_counts,
        adaptive.limiter,
        adaptive.rows_dead_letters,
    )
    for run, out in ((fixed, "fixed"), (adaptive, "adaptive")):
        assert run.status == "completed"
        assert_nothing_lost(tmp_path / out, storm_corpus.ids)
    storm = fixed.status_counts.get("DEADLINE_EXCEEDED", 0)
    calm = adaptive.status_counts.get("DEADLINE_EXCEEDED", 0)
    assert storm >= 50
    # A stall of the shared cores past the deadline can time out the few calls the adaptive limit
    # holds at once: a fifth of the storm at most, not its twentieth.
    assert calm <= max(10, storm // 5)
    assert adaptive.limiter["max"] < 200
