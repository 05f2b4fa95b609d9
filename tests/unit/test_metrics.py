"""Metrics sinks against a UDP socket on 127.0.0.1 (no Ray): names, tags, an absent agent, the interceptor."""

from __future__ import annotations

import asyncio
import io
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
    CLIENT_RETRIES,
    INFLIGHT_LIMIT,
    RUN_DEAD_LETTERS,
    RUN_ETA_S,
    RUN_FINISHED,
    RUN_ROWS,
    RUN_SINCE_COMMIT_S,
    RUN_STARTED,
    RUN_UNITS,
    RUN_UNITS_LEFT,
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
from raypipe.report import RunReport, UnitStats
from raypipe.run.progress import Progress
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
    slowest = 0.0
    for i in range(3000):
        started = time.perf_counter()
        CLIENT_CALLS.record(m, 1, {"status": "OK"})
        CLIENT_LATENCY_MS.record(m, 3.0)
        if i % 300 == 0:
            m.flush()
        slowest = max(slowest, time.perf_counter() - started)
        if i % 300 == 0:
            time.sleep(0.005)  # lets the ICMP refusal come back between sends
    m.close()
    assert m.dropped > 0, "the refusals must have been seen (and dropped)"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "raypipe.metrics"
    assert f"127.0.0.1:{port}" in warnings[0].getMessage()
    # A record never waits on the network: a blocked send would wait out a socket timeout (seconds).
    assert slowest < 0.5, f"one record to a closed port took {slowest:.2f} s"


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


def _unit(i: int, *, ok: int, empty: int = 0, dead: int = 0, retries: int = 0) -> UnitStats:
    s = UnitStats(unit=f"u{i}", shard="s", attempt="a", actor="x", rows=ok + empty + dead)
    s.ok, s.empty_text, s.dead_letters, s.retries = ok, empty, dead, retries
    if dead:
        s.dead_letter_kinds["invalid_text"] = dead
    return s


def test_progress_logs_lines_and_counts_units_into_metrics(caplog):
    caplog.set_level(logging.INFO, logger="raypipe")
    rec = Recorder()
    now = [0.0]
    p = Progress(3, 60, 10.0, metrics=rec, bar=False, clock=lambda: now[0])
    now[0] = 2.0
    p.update(_unit(0, ok=18, empty=2, retries=1))
    now[0] = 11.0
    p.update(_unit(1, ok=19, dead=1))
    p.update(None)  # an unreadable shard: no stats
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert lines == [
        "progress: 2/3 units, 40 rows (3.6 rows/s), 1 dead letters, ETA 6 s",
        "progress: 3/3 units, 40 rows (3.6 rows/s), 1 dead letters, ETA 6 s",
    ]
    assert rec.total(RUN_UNITS) == 2
    assert rec.total(RUN_ROWS, outcome="ok") == 37
    assert rec.total(RUN_ROWS, outcome="empty_text") == 2
    assert rec.total(RUN_ROWS, outcome="dead_letter") == 1
    assert rec.total(CLIENT_RETRIES) == 1
    assert rec.total(RUN_DEAD_LETTERS) == 1 and rec.total(RUN_DEAD_LETTERS, kind="invalid_text") == 1
    left = [v for _, n, v, _ in rec.records if n == RUN_UNITS_LEFT.name]
    assert left == [3, 2, 1, 0], "the total when it starts, then one less per finished unit"
    etas = [v for _, n, v, _ in rec.records if n == RUN_ETA_S.name]
    assert etas == [pytest.approx((60 - 20) / 10), pytest.approx((60 - 40) / (40 / 11)), pytest.approx(20 / (40 / 11))]


def test_progress_bar_in_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(2, 40, 10.0, stream=out)
    p.update(_unit(0, ok=20))
    p.update(_unit(1, ok=19, dead=1))
    text = out.getvalue()
    assert "40.0/40.0" in text and "dead letters 1" in text and "units 2/2" in text
    assert Progress(1, 1, 10.0, stream=io.StringIO())._bar is None, "not a terminal: log lines"


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


def test_progress_eta_goes_by_units_when_the_plan_does_not_know_every_units_rows():
    """Files planned whole from their size (and JSON lines) have no row count before they are read."""
    now = [0.0]
    p = Progress(4, None, 10.0, bar=False, stream=io.StringIO(), clock=lambda: now[0])
    assert p.eta_s() is None, "no rate before the first unit"
    now[0] = 3.0
    p.update(_unit(0, ok=50))
    assert p.eta_s() == 9.0, "3 units left at 3 s each"
    now[0] = 4.0
    p.update(_unit(1, ok=500))
    assert p.eta_s() == 4.0
