"""Metrics sinks against a UDP socket on 127.0.0.1 (no Ray): names, tags, an absent agent, the interceptor."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest

from raypipe.call.breaker import CircuitBreaker
from raypipe.call.client import GrpcModelClient
from raypipe.call.limiter import FixedLimiter
from raypipe.call.metrics import (
    BREAKER_OPEN,
    BREAKER_OPENINGS,
    CLIENT_CALLS,
    CLIENT_LATENCY_MS,
    INFLIGHT_LIMIT,
    RUN_FINISHED,
    RUN_SINCE_COMMIT_S,
    RUN_STARTED,
    ActorGauges,
    DogStatsdMetrics,
    FanoutMetrics,
    MetricsInterceptor,
    MetricsSpec,
    NullMetrics,
    RayMetrics,
    RunMetrics,
    metrics_spec,
)
from raypipe.config import load_config
from raypipe.errors import ServiceUnavailable
from raypipe.report import RunReport
from serve_app.metrics import ServerMetrics, ServerMetricsSettings
from tests.dogstatsd import UdpAgent, closed_udp_port
from tests.fakes import start_fake_server


class Recorder:
    """A `Metrics` that keeps every record."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, float, dict[str, str]]] = []
        self.events: list[tuple[str, str, str]] = []
        self.closed = False

    def count(self, name, value=1, tags=None):
        self.records.append(("count", name, value, dict(tags or {})))

    def gauge(self, name, value, tags=None):
        self.records.append(("gauge", name, value, dict(tags or {})))

    def distribution(self, name, value, tags=None):
        self.records.append(("dist", name, value, dict(tags or {})))

    def event(self, title, text, *, alert_type="info", tags=None):
        self.events.append((title, text, alert_type))

    def flush(self):
        pass

    def close(self):
        self.closed = True

    def total(self, metric, **tags):
        name = getattr(metric, "name", metric)
        return sum(v for _, n, v, t in self.records if n == name and tags.items() <= t.items())


@pytest.fixture
def agent():
    a = UdpAgent()
    yield a
    a.close()


def test_dogstatsd_sends_names_values_and_constant_tags(agent):
    m = DogStatsdMetrics("127.0.0.1", agent.port, tags={"run_id": "r1", "mode": "backfill"})
    CLIENT_CALLS.record(m, 1, {"status": "OK"})
    CLIENT_CALLS.record(m, 2, {"status": "UNAVAILABLE"})
    INFLIGHT_LIMIT.record(m, 8, {"actor": "a1"})
    CLIENT_LATENCY_MS.record(m, 12.5, {"status": "OK"})
    m.event("raypipe backfill r1 started", "two\nlines", alert_type="info")
    m.close()  # flushes
    assert agent.wait_for(lambda a: len(a.samples) == 4 and a.events)
    assert agent.total("raypipe.client.calls", status="OK", run_id="r1", mode="backfill") == 1
    assert agent.total("raypipe.client.calls", status="UNAVAILABLE") == 2
    kinds = {s.name: s.kind for s in agent.samples}
    assert kinds == {
        "raypipe.client.calls": "c",
        "raypipe.client.inflight.limit": "g",
        "raypipe.client.latency_ms": "d",
    }
    (event,) = agent.events
    assert event.title == "raypipe backfill r1 started" and event.text == "two\nlines"
    assert event.tags["run_id"] == "r1"


def test_closed_port_never_raises_never_blocks_and_warns_once(caplog):
    port = closed_udp_port()
    caplog.set_level(logging.DEBUG, logger="datadog")
    m = DogStatsdMetrics("127.0.0.1", port, tags={"run_id": "r1"})
    took: list[float] = []
    for i in range(3000):
        started = time.perf_counter()
        CLIENT_CALLS.record(m, 1, {"status": "OK"})
        CLIENT_LATENCY_MS.record(m, 3.0)
        if i % 300 == 0:
            m.flush()
        took.append(time.perf_counter() - started)
        if i % 300 == 0:
            time.sleep(0.005)  # lets the ICMP refusal come back between sends
    m.close()
    assert m.dropped > 0, "the refusals must have been seen (and dropped)"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "raypipe.metrics"
    assert f"127.0.0.1:{port}" in warnings[0].getMessage()
    # A record never waits on the network: a blocked send would wait out a socket timeout (seconds)
    # at each of the ten flushes. One slow record is the scheduler's (a loaded, niced test process).
    second_slowest = sorted(took)[-2]
    assert second_slowest < 0.5, f"records to a closed port took {sorted(took)[-3:]} s"


def test_unresolvable_host_turns_datadog_off_with_one_warning(monkeypatch, caplog):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    m = DogStatsdMetrics("datadog-agent.invalid", 8125)
    assert not m.enabled
    for _ in range(100):
        CLIENT_CALLS.record(m)
        m.event("t", "x")
    m.flush()
    m.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "does not resolve" in warnings[0].getMessage()


def test_spec_builds_only_what_is_configured():
    assert isinstance(MetricsSpec().build(), NullMetrics)
    assert isinstance(MetricsSpec(ray_metrics=True).build(), RayMetrics)
    both = MetricsSpec(dogstatsd_host="127.0.0.1", dogstatsd_port=closed_udp_port(), ray_metrics=True).build()
    assert isinstance(both, FanoutMetrics) and len(both.sinks) == 2
    both.close()


def test_ray_metrics_drop_records_until_ray_is_connected():
    """In a fresh process (the suite's integration tests connect this one to a cluster)."""
    script = """
import ray
from raypipe.call.metrics import CLIENT_CALLS, CLIENT_LATENCY_MS, INFLIGHT_LIMIT, RayMetrics
m = RayMetrics(tags={"run_id": "r"})
CLIENT_CALLS.record(m, 1, {"status": "OK"})  # no cluster: dropped, no error
INFLIGHT_LIMIT.record(m, 3)
CLIENT_LATENCY_MS.record(m, 2.0)
print("initialized:", ray.is_initialized())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized: False" in done.stdout


def test_config_takes_the_agent_address_from_the_environment_only_when_built():
    assert load_config(overrides={"output": {"uri": "/tmp/o"}}).metrics.dogstatsd_host is None
    env = {"DD_AGENT_HOST": "dd-agent", "DD_DOGSTATSD_PORT": "9125"}
    cfg = load_config(overrides={"output": {"uri": "/tmp/o"}}, environ=env)
    assert (cfg.metrics.dogstatsd_host, cfg.metrics.dogstatsd_port) == ("dd-agent", 9125)
    explicit = load_config(overrides={"output": {"uri": "/tmp/o"}, "metrics": {"dogstatsd_host": "x"}}, environ=env)
    assert explicit.metrics.dogstatsd_host == "x"
    off = load_config(overrides={"output": {"uri": "/tmp/o"}}, environ={**env, "RAYPIPE_METRICS__DOGSTATSD_HOST": ""})
    assert off.metrics.dogstatsd_host is None


def test_spec_from_config_carries_run_tags_and_extra_tags():
    cfg = load_config(overrides={"output": {"uri": "/tmp/o"}, "metrics": {"tags": {"env": "test"}}})
    spec = metrics_spec(cfg.metrics, {"run_id": "r1", "app": "raypipe"})
    assert dict(spec.tags) == {"env": "test", "run_id": "r1", "app": "raypipe"}


def test_interceptor_counts_each_attempt_with_its_status(agent):
    async def scenario():
        server, servicer, address = await start_fake_server()
        sink = DogStatsdMetrics("127.0.0.1", agent.port, tags={"app": "raypipe"})
        client = GrpcModelClient(address, timeout_s=5, interceptors=[MetricsInterceptor(sink)])
        try:
            await client.classify(["a", "b"], ["one", "two"])
            servicer.fail_next = [grpc.StatusCode.UNAVAILABLE]
            with pytest.raises(ServiceUnavailable):
                await client.classify(["c"], ["three"])
            result = await client.classify(["d", "e", "f"], ["4", "5", "6"])
            await client.model_info()
        finally:
            await client.close()
            await server.stop(None)
            sink.close()
        return result

    result = asyncio.run(scenario())
    assert result.probabilities.shape == (3, 6), "the interceptor must hand the answer through untouched"
    # The client's own ModelInfo before its first call (which form the server answers), and ours.
    assert agent.wait_for(lambda a: a.total("raypipe.client.calls") == 5)
    assert agent.by_tag("raypipe.client.calls", "status") == Counter({"OK": 4, "UNAVAILABLE": 1})
    assert agent.total("raypipe.client.calls", method="Classify") == 3
    assert agent.total("raypipe.client.calls", method="ModelInfo") == 2
    assert agent.total("raypipe.client.paragraphs", status="OK") == 5
    latencies = [s for s in agent.samples if s.name == "raypipe.client.latency_ms"]
    assert len(latencies) == 5 and all(s.value > 0 and s.tags["app"] == "raypipe" for s in latencies)


def test_interceptor_does_not_count_a_call_the_caller_cancelled():
    async def scenario():
        server, servicer, address = await start_fake_server()
        servicer.delay_s = 5
        rec = Recorder()
        client = GrpcModelClient(address, timeout_s=10, interceptors=[MetricsInterceptor(rec)])
        task = asyncio.ensure_future(client.classify(["a"], ["x"]))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()
        await server.stop(None)
        return rec

    assert asyncio.run(scenario()).total(CLIENT_CALLS, method="Classify") == 0


def test_actor_gauges_sample_breaker_state_openings_and_limit():
    rec = Recorder()
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=10, clock=lambda: now[0])
    gauges = ActorGauges(rec, breaker, FixedLimiter(6), actor="a1")
    gauges.sample()

    async def fail_once():
        permit = await breaker.acquire()
        breaker.record(permit, success=False)

    asyncio.run(fail_once())
    gauges.sample()
    gauges.sample()
    opens = [v for _, n, v, _ in rec.records if n == BREAKER_OPEN.name]
    assert opens == [0, 1, 1]
    assert rec.total(BREAKER_OPENINGS, actor="a1") == 1, "an opening is counted once, not per sample"
    assert rec.total(INFLIGHT_LIMIT) == 18  # 3 samples of 6


def test_actor_gauges_tell_the_time_since_the_actor_last_committed_a_unit():
    rec = Recorder()
    now = [100.0]
    gauges = ActorGauges(rec, CircuitBreaker(), FixedLimiter(2), actor="a1", clock=lambda: now[0])
    now[0] = 130.0
    gauges.sample()  # no unit yet: the time since the actor started
    gauges.committed()
    now[0] = 142.5
    gauges.sample()
    since = [v for _, n, v, t in rec.records if n == RUN_SINCE_COMMIT_S.name and t == {"actor": "a1"}]
    assert since == [30.0, 12.5]


def _report(**kw) -> RunReport:
    r = RunReport(run_id="r1", mode="backfill", model_version="demo-1", output="/tmp/out", **kw)
    r.rows_in, r.rows_ok, r.rows_dead_letters, r.calls = 100, 98, 2, 5
    r.status_counts = {"OK": 4, "UNAVAILABLE": 1}
    return r


def test_run_metrics_send_start_and_end_events_with_the_run_tags(agent):
    from raypipe.config import MetricsConfig

    config = MetricsConfig(dogstatsd_host="127.0.0.1", dogstatsd_port=agent.port, ray_metrics=False)
    report = _report()
    run = RunMetrics.start(config, report, app="raypipe")
    assert dict(run.spec.tags) == {"run_id": "r1", "mode": "backfill", "model_version": "demo-1", "app": "raypipe"}
    report.status = "completed"
    run.finish(report)
    assert agent.wait_for(lambda a: len(a.events) == 2)
    started, finished = agent.events
    assert started.title == "raypipe backfill r1 started" and started.alert_type == "info"
    assert finished.title == "raypipe backfill r1 succeeded" and finished.alert_type == "success"
    assert "dead letters 2" in finished.text and "UNAVAILABLE 1" in finished.text
    assert finished.tags == {"run_id": "r1", "mode": "backfill", "model_version": "demo-1", "app": "raypipe"}
    assert agent.total("raypipe." + RUN_STARTED.name) == 1
    assert agent.total("raypipe." + RUN_FINISHED.name, status="completed") == 1


def test_failed_run_sends_an_error_event():
    rec = Recorder()
    run = RunMetrics(MetricsSpec(), _report())
    run.metrics = rec
    report = _report(status="failed", error="CircuitOpenError: down")
    run.finish(report)
    ((title, text, alert),) = rec.events
    assert title.endswith("failed") and alert == "error" and "CircuitOpenError" in text
    assert rec.closed


def test_server_metrics_count_requests_errors_batches_and_times():
    rec = Recorder()
    m = ServerMetrics(rec)
    m.request("OK", 32)
    m.request("INVALID_ARGUMENT", 3)
    m.timing(queue_s=0.004, replica_s=0.020)
    m.batch(calls=3, rows=70, tokens=900, compute_s=0.015)
    assert rec.total("server.requests") == 2
    assert rec.total("server.paragraphs", status="OK") == 32
    assert rec.total("server.errors") == 1 and rec.total("server.errors", status="INVALID_ARGUMENT") == 1
    assert rec.total("server.queue_ms") == pytest.approx(4.0)
    assert rec.total("server.model_ms") == pytest.approx(15.0)
    assert rec.total("server.batch.rows") == 70


def test_server_metrics_settings_read_the_agent_from_the_replica_environment():
    s = ServerMetricsSettings(ray_metrics=False)
    spec = s.spec({"DD_AGENT_HOST": "node-ip", "DD_DOGSTATSD_PORT": "8126"}, {"app": "raypipe"})
    assert (spec.dogstatsd_host, spec.dogstatsd_port, dict(spec.tags)) == ("node-ip", 8126, {"app": "raypipe"})
    assert ServerMetricsSettings(dogstatsd_host="", ray_metrics=False).spec({"DD_AGENT_HOST": "x"}, {}).enabled is False
    with pytest.raises(ValueError):
        ServerMetricsSettings(dogstatsd_port=0)


def test_report_renders_as_html_for_notebooks():
    html = _report(status="completed")._repr_html_()
    assert "<table" in html and "r1" in html and "UNAVAILABLE" in html and "COMPLETED" in html
