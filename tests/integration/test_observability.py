"""Metrics end to end: a UDP listener on 127.0.0.1 stands in for the Datadog agent.

One backfill against a Serve app that fails 10% of calls (so there are several status codes
and retries to count) must send the expected DogStatsD names and tags, from the actors, the
driver and the replica, with counts equal to the run report. The same backfill with
`DD_AGENT_HOST` pointing at a closed port must finish as fast as one with metrics off and log
one warning.
"""

from __future__ import annotations

import logging
import time
import urllib.request

import pytest

import raypipe
from raypipe.call.metrics import CATALOG as client_catalog
from raypipe.samples import write_sample_corpus
from serve_app.metrics import CATALOG as server_catalog
from serve_app.metrics import ServerMetricsSettings
from serve_app.settings import FaultInjection, ServerSettings
from tests.dogstatsd import UdpAgent, closed_udp_port
from tests.integration.helpers import assert_nothing_lost

RUN_TAGS = ("run_id", "mode", "model_version", "app")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sample_corpus(
        str(tmp_path_factory.mktemp("obs") / "in"), rows=600, parquet_shards=2, jsonl_shards=1, bad_fraction=0.02
    )


def settings(app: str, **metrics):
    return {
        "service": {"application": app, "timeout_s": 20},
        "input": {"unit_rows": 100},
        "client": {"micro_batch_size": 16, "retry": {"initial_backoff_s": 0.05, "max_backoff_s": 0.5}},
        "metrics": metrics,
    }


@pytest.fixture
def agent():
    a = UdpAgent()
    yield a
    a.close()


@pytest.mark.timeout(300)
def test_metrics_reach_a_dogstatsd_listener_and_agree_with_the_report(
    tmp_path, corpus, serve_address, deploy_app, agent
):
    app = deploy_app(
        "observed",
        ServerSettings(
            fault=FaultInjection(fail_fraction=0.1, status="UNAVAILABLE", seed=3),
            metrics=ServerMetricsSettings(dogstatsd_host="127.0.0.1", dogstatsd_port=agent.port),
        ),
    )
    started = time.monotonic()
    report = raypipe.backfill(
        corpus.uri,
        str(tmp_path / "out"),
        service=serve_address,
        run_id="observed",
        settings=settings(app, dogstatsd_host="127.0.0.1", dogstatsd_port=agent.port),
    )
    wall = time.monotonic() - started
    assert report.status == "completed"
    assert_nothing_lost(tmp_path / "out", corpus.ids)
    calls = "raypipe.client.calls"
    assert agent.wait_for(lambda a: a.total(calls, method="Classify") >= report.calls, timeout_s=10)
    assert agent.wait_for(lambda a: a.total("raypipe.server.requests") >= report.calls, timeout_s=10)
    time.sleep(1.0)  # anything late (a double count) arrives too
    print(
        f"\nlistener run: {wall:.1f} s; report calls {report.calls} {report.status_counts}, retries {report.retries};"
        f" {agent.packets} packets, names {sorted(agent.names())}"
    )

    # The interceptor's view: one count per attempt, by status, as the report's table.
    assert agent.total(calls, method="Classify") == report.calls
    assert dict(agent.by_tag(calls, "status", method="Classify")) == report.status_counts
    assert report.status_counts.get("UNAVAILABLE", 0) > 0, "the fault injection should have produced failures"
    assert agent.total("raypipe.client.retries") == report.retries > 0
    assert agent.total("raypipe.client.paragraphs", status="OK") == report.rows_ok + report.canaries
    latencies = [
        s for s in agent.samples if s.name == "raypipe.client.latency_ms" and s.tags.get("method") == "Classify"
    ]
    assert len(latencies) == report.calls and all(s.kind == "d" and s.value > 0 for s in latencies)

    # The driver's per-unit counts.
    assert agent.total("raypipe.run.units") == report.units_committed
    assert agent.total("raypipe.run.rows", outcome="ok") == report.rows_ok
    assert agent.total("raypipe.run.rows", outcome="empty_text") == report.rows_empty_text > 0
    assert agent.total("raypipe.run.rows", outcome="dead_letter") == report.rows_dead_letters
    assert agent.total("raypipe.run.started") == 1
    assert agent.total("raypipe.run.finished", status="completed") == 1

    # The actors' gauges.
    limits = [s for s in agent.samples if s.name == "raypipe.client.inflight.limit"]
    assert limits and all(s.kind == "g" and s.value >= 1 and s.tags.get("actor") for s in limits)
    assert any(s.name == "raypipe.client.breaker.open" for s in agent.samples)

    # Every client-side metric carries the run's tags.
    expected = {"run_id": "observed", "mode": "backfill", "model_version": report.model_version, "app": app}
    client_side = [s for s in agent.samples if not s.name.startswith("raypipe.server.")]
    bad = [s for s in client_side if {k: s.tags.get(k) for k in RUN_TAGS} != expected]
    assert not bad, bad[:3]

    # Every name and tag that arrived is declared in its side's catalog (the Datadog assets are
    # checked against the catalogs): what a real run sends, not only what the unit tests drive.
    for sample in agent.samples:
        side = server_catalog if sample.name.startswith("raypipe.server.") else client_catalog
        metric = side.get(sample.name.removeprefix("raypipe."))
        assert metric is not None, sample
        assert set(sample.tags) <= side.tags_of(metric), sample

    # Job events.
    titles = [(e.title, e.alert_type) for e in agent.events]
    assert titles == [("raypipe backfill observed started", "info"), ("raypipe backfill observed succeeded", "success")]
    assert all({k: e.tags.get(k) for k in RUN_TAGS} == expected for e in agent.events)
    assert f"calls {report.calls:,}" in agent.events[1].text

    # The replica's view: the same calls, as it answered them, and its batches.
    server = "raypipe.server.requests"
    assert dict(agent.by_tag(server, "status")) == report.status_counts
    assert agent.total("raypipe.server.errors") == report.calls - report.status_counts["OK"]
    assert agent.total("raypipe.server.paragraphs", status="OK") == report.rows_ok + report.canaries
    batches = [s for s in agent.samples if s.name == "raypipe.server.batch.rows"]
    assert batches and sum(s.value for s in batches) == report.rows_ok + report.canaries
    for name in ("raypipe.server.queue_ms", "raypipe.server.model_ms", "raypipe.server.batch.calls"):
        assert any(s.name == name for s in agent.samples), name
    server_side = [s for s in agent.samples if s.name.startswith("raypipe.server.")]
    assert all(s.tags.get("app") == app and s.tags.get("model_version") for s in server_side)


def _prometheus_text(ray_cluster) -> str:
    import ray

    texts = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                texts.append(r.read().decode())
    return "\n".join(texts)


@pytest.mark.timeout(240)
def test_the_same_counters_reach_ray_metrics(tmp_path, corpus, ray_cluster, serve_address):
    """Ray exports the actors' and replica's metrics to Prometheus (what the dashboard reads)."""
    report = raypipe.backfill(corpus.uri, str(tmp_path / "out"), service=serve_address, run_id="prom",
                              settings=settings("raypipe"))  # fmt: skip
    assert report.status == "completed"
    wanted = ("raypipe_client_calls", "raypipe_client_latency_ms", "raypipe_server_requests", "raypipe_run_rows")
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    text = ""
    while time.monotonic() < deadline:
        text = _prometheus_text(ray_cluster)
        if all(name in text for name in wanted) and 'run_id="prom"' in text:
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, f"not exported by Ray: {missing}"
    lines = [x for x in text.splitlines() if "raypipe_client_calls" in x and not x.startswith("#")]
    assert any('status="OK"' in x and 'run_id="prom"' in x and 'mode="backfill"' in x for x in lines), lines[:5]


def _timed_backfill(corpus, out, address, app, run_id, **metrics):
    started = time.monotonic()
    report = raypipe.backfill(corpus.uri, str(out), service=address, run_id=run_id, settings=settings(app, **metrics))
    return report, time.monotonic() - started


@pytest.mark.timeout(400)
def test_an_absent_agent_costs_nothing_and_warns_once(tmp_path, corpus, serve_address, monkeypatch, caplog):
    off_report, off_s = _timed_backfill(corpus, tmp_path / "off", serve_address, "raypipe", "off", ray_metrics=False)
    port = closed_udp_port()
    monkeypatch.setenv("DD_AGENT_HOST", "127.0.0.1")  # as a pod's environment would say
    monkeypatch.setenv("DD_DOGSTATSD_PORT", str(port))
    caplog.set_level(logging.INFO)
    report, closed_s = _timed_backfill(corpus, tmp_path / "closed", serve_address, "raypipe", "closed")
    print(f"\nmetrics off: {off_s:.1f} s; DogStatsD on a closed port ({port}): {closed_s:.1f} s")
    assert off_report.status == report.status == "completed"
    assert report.rows_results == off_report.rows_results == len(corpus.ids)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("raypipe", "datadog"))]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"127.0.0.1:{port}" in warnings[0].getMessage() and "not accepting" in warnings[0].getMessage()
    # The run itself is as without metrics: the same calls, none retried. (That a record never
    # waits on the closed port is tests/unit/test_metrics.py's; wall times on shared cores are not
    # compared here.)
    assert report.retries == off_report.retries == 0
    assert report.calls == off_report.calls
