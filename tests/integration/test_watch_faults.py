"""`raypipe watch` under faults, on real parts (local Ray, Serve gRPC applications with the demo
model, local files or moto's S3 behind a misbehaving proxy):

- a Serve replica killed while a unit's calls are on it: the watcher goes on (the calls are
  sent again to the replica Serve starts in its place) and commits every id once;
- S3 answering 503 SlowDown to one request in five (the driver's and the actors' requests
  alike): every id once;
- the model service gone (its Serve application deleted) longer than `breaker.max_wait_s`: Ray
  Serve sends the calls to the application left, another model's, whose answers are refused; the
  watcher stops, failed, naming the open circuit and the other model, with its lease released
  and the rows it could not answer uncommitted; a successor started once the service is back
  commits every id once.

The watcher SIGKILLed mid-batch and a daily started on a watched output are `test_watch.py`'s.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import botocore.session
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from ray import serve

from raypipe.errors import CircuitOpenError
from raypipe.store import OutputStore
from serve_app.settings import FaultInjection, ServerSettings
from tests.integration.conftest import S3, wait_for
from tests.integration.helpers import assert_nothing_lost, ids, results
from tests.integration.s3_proxy import S3Proxy
from tests.integration.test_watch import Watching, _arrive, _committed

pytestmark = pytest.mark.timeout(240)

FAST_RETRY = {"initial_backoff_s": 0.05, "max_backoff_s": 0.5}
#: Each call held 1 s on the server, so a fault lands while calls are on the replica: a kill
#: between two calls fails none (Serve's router sends the next one to the successor).
HELD = ServerSettings(fault=FaultInjection(extra_latency_s=1.0))


def _settings(app: str, **extra: Any) -> dict[str, Any]:
    return {
        "service": {"application": app, "timeout_s": 20},
        "input": {"unit_rows": 50},
        "client": {"micro_batch_size": 16, "retry": dict(FAST_RETRY), **extra},
    }


def _replica(app: str) -> Any:
    from ray.util.state import list_actors

    alive = [
        a
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        if a.class_name.startswith("ServeReplica:" + app + ":")
    ]
    assert alive, f"no live replica of {app}"
    return ray.get_actor(alive[0].name, namespace="serve")


def _calls_on_the_replica(app: str) -> bool:
    """Some calls answered and some on the replica now: the watcher is mid-unit."""
    stats = serve.get_app_handle(app).stats.remote().result()
    return sum(stats["calls"].values()) >= 2 and stats["in_flight"]["calls"] > 0


def test_a_replica_killed_mid_unit_the_watcher_goes_on_and_commits_every_id_once(
    tmp_path: Path, serve_address: str, deploy_app: Any
) -> None:
    app = deploy_app("watch-killed", HELD)
    replica = _replica(app)  # found before the watch: the state API can take seconds
    in_dir, out = tmp_path / "in", tmp_path / "out"
    expected = _arrive(in_dir, "first", 200)
    watcher = Watching(in_dir, out, serve_address, **_settings(app))
    try:
        wait_for(lambda: _calls_on_the_replica(app), 60, "calls on the replica")
        ray.kill(replica, no_restart=False)
        expected += _arrive(in_dir, "second", 40)  # and the watcher goes on looking
        wait_for(lambda: _committed(out) >= 240, 120, "every row committed")
    finally:
        report = watcher.finish()
    assert _replica(app)._actor_id != replica._actor_id, "the replica was not replaced"
    assert report.status == "stopped" and report.rows == 240 and report.files == 2
    _, dead = assert_nothing_lost(out, expected)
    assert dead == [], "a killed replica is no fault of the rows"


def _watch_through(input_uri: str, output: str, endpoint: str, service: str, settings: dict, answers: Any) -> None:
    """A watcher in its own process whose S3 requests, and its actors', go through `endpoint`."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    ray.init(
        address=os.environ["RAY_ADDRESS"],
        runtime_env={"env_vars": {"AWS_ENDPOINT_URL": endpoint}},
        logging_level="WARNING",
        log_to_driver=False,
    )
    import raypipe

    try:
        report = raypipe.watch(input_uri, output, every_s=0.5, max_wait_s=0, service=service, settings=settings)
        answers.put(report.to_dict())
    except BaseException as e:
        answers.put({"error": f"{type(e).__name__}: {e}"})
        raise


def test_s3_answering_slowdown_to_a_share_of_requests_every_id_is_committed_once(
    tmp_path: Path, s3: S3, serve_address: str
) -> None:
    s3c = botocore.session.get_session().create_client("s3", region_name="us-east-1")
    bucket = f"slow-{uuid.uuid4().hex[:8]}"
    s3c.create_bucket(Bucket=bucket)

    def put(name: str, n: int) -> list[str]:
        rows = [f"{name}-{i}" for i in range(n)]
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": rows, "text": [f"{r}: what a joyful, lovely surprise" for r in rows]}), buf)
        s3c.put_object(Bucket=bucket, Key=f"in/{name}.parquet", Body=buf.getvalue())
        return rows

    out = f"s3://{bucket}/out"
    expected = put("first", 120)
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    with S3Proxy(s3.endpoint, "slowdown") as proxy:
        settings = {**_settings("raypipe"), "actors": {"min_actors": 1}}
        watcher = ctx.Process(
            target=_watch_through, args=(f"s3://{bucket}/in/", out, proxy.endpoint, serve_address, settings, answers)
        )
        watcher.start()
        try:

            def committed() -> int:
                return len(ids(results(out)))

            wait_for(lambda: committed() >= 120 or not watcher.is_alive(), 150, "the first file committed")
            expected += put("second", 60)
            wait_for(lambda: committed() >= 180 or not watcher.is_alive(), 60, "the file put while it runs")
        finally:
            if watcher.is_alive():
                os.kill(watcher.pid, signal.SIGTERM)  # a graceful stop: its report comes back
            report = answers.get(timeout=60)
            watcher.join(30)
    writes = [path for method, path in proxy.requests if method == "PUT" and "_delta_log" in path]
    print(f"slowdown: {proxy.slowed} of {len(proxy.requests)} requests answered 503, {len(writes)} log writes")
    assert report.get("error") is None, report
    assert report["status"] == "stopped" and report["rows"] == 180 and report["files"] == 2
    assert proxy.slowed >= 10 and writes, "the watcher's S3 traffic did not go through the proxy"
    assert_nothing_lost(out, expected)


@pytest.mark.timeout(420)
def test_the_service_gone_past_the_breakers_wait_stops_the_watcher_and_a_successor_loses_nothing(
    tmp_path: Path, serve_address: str, deploy_app: Any
) -> None:
    # Another version than the session's application (the one left when this one goes): the
    # same weights served at another length.
    other = ServerSettings(max_sequence_length=64)
    app = deploy_app("watch-gone", other)
    in_dir, out = tmp_path / "in", tmp_path / "out"
    gone = {"breaker": {"failure_threshold": 1, "reset_timeout_s": 0.2, "max_wait_s": 3.0}}
    settings = _settings(app, **gone)
    settings["service"]["timeout_s"] = 2
    expected = _arrive(in_dir, "first", 60)
    watcher = Watching(in_dir, out, serve_address, **settings)
    wait_for(lambda: _committed(out) >= 60, 120, "the first file committed")
    serve.delete(app)
    expected += _arrive(in_dir, "second", 40)  # arrives while nothing answers
    watcher.thread.join(120)
    alive = watcher.thread.is_alive()
    watcher.stop.set()
    watcher.thread.join(60)
    assert not alive, "the watcher did not stop with its service gone past breaker.max_wait_s"
    assert isinstance(watcher.error, CircuitOpenError), watcher.error
    assert "model version" in str(watcher.error), "the message says the answers came from another model"
    store = OutputStore(str(out))
    assert not store.exists(store.state("lease.json")), "the lease is released"
    assert _committed(out) == 60, "nothing of the unanswered file is committed"

    deploy_app(app, other)  # the service is back: a successor under the same watch id
    successor = Watching(in_dir, out, serve_address, **_settings(app))
    try:
        wait_for(lambda: _committed(out) >= 100, 120, "the successor committed the rest")
    finally:
        report = successor.finish()
    assert report.rows == 40 and report.files == 1
    _, dead = assert_nothing_lost(out, expected)
    assert dead == [], "a service that was down is no fault of the rows"
