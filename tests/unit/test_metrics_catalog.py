"""The metric catalogs hold what the code emits, no more and no less.

Every emitter of both sides runs against a recorder that checks each record against its side's
catalog (name, kind, tag keys, closed tag values); together the runs must emit every declared
metric. A scan of the sources finds no metric sent by a string name, past the catalog."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest

from protos.raypipe.v1 import emotion_pb2
from protos.telemetry import Catalog, MetricDef, MetricsSpec
from raypipe.call import metrics as client_metrics
from raypipe.call.breaker import CircuitBreaker
from raypipe.call.client import GrpcModelClient
from raypipe.call.limiter import FixedLimiter
from raypipe.call.metrics import (
    ActorGauges,
    MetricsInterceptor,
    RunMetrics,
    emit_unit,
    emit_watch_freshness,
    emit_watch_tick,
)
from raypipe.config import MetricsConfig
from raypipe.errors import ServiceUnavailable
from raypipe.report import RunReport, UnitStats
from raypipe.run.progress import Progress
from serve_app import metrics as server_metrics
from serve_app.metrics import ServerMetrics, ServerMetricsSettings
from tests.fakes import start_fake_server

REPO = Path(__file__).resolve().parents[2]
_SENDS = {"count", "gauge", "distribution"}


class CheckingRecorder:
    """A `Metrics` sink that keeps every record and notes each one its catalog does not declare."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.seen: set[str] = set()
        self.problems: list[str] = []

    def _check(self, kind: str, name: str, tags) -> None:
        self.seen.add(name)
        metric = self.catalog.get(name)
        if metric is None:
            self.problems.append(f"{name}: not in the {self.catalog.side} catalog")
            return
        if metric.kind != kind:
            self.problems.append(f"{name}: sent as a {kind}, declared a {metric.kind}")
        for key, value in (tags or {}).items():
            if key not in metric.tags:
                self.problems.append(f"{name}: tag {key!r} is not declared (declared: {metric.tags})")
            elif (allowed := metric.allowed(key)) is not None and value not in allowed:
                self.problems.append(f"{name}: {key}:{value} is not among the declared values")

    def count(self, name, value=1, tags=None):
        self._check("count", name, tags)

    def gauge(self, name, value, tags=None):
        self._check("gauge", name, tags)

    def distribution(self, name, value, tags=None):
        self._check("distribution", name, tags)

    def event(self, title, text, *, alert_type="info", tags=None):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def _report(status: str) -> RunReport:
    r = RunReport(run_id="r1", mode="backfill", model_version="demo-1", output="/tmp/out")
    r.status = status
    return r


def _run_every_client_emitter(rec: CheckingRecorder, monkeypatch) -> None:
    async def calls():
        server, servicer, address = await start_fake_server()
        client = GrpcModelClient(address, timeout_s=5, interceptors=[MetricsInterceptor(rec)])
        try:
            await client.classify(["a"], ["one"])
            servicer.fail_next = [grpc.StatusCode.UNAVAILABLE]
            with pytest.raises(ServiceUnavailable):
                await client.classify(["b"], ["two"])
            await client.model_info()
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(calls())

    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=10, clock=lambda: now[0])
    gauges = ActorGauges(rec, breaker, FixedLimiter(4), actor="host:1:abc")

    async def open_breaker():
        permit = await breaker.acquire()
        breaker.record(permit, success=False)

    asyncio.run(open_breaker())
    gauges.sample()

    stats = UnitStats(unit="u", shard="s", attempt="a", actor="x", rows=6)
    stats.ok, stats.empty_text, stats.dead_letters, stats.retries, stats.canaries = 3, 2, 1, 1, 1
    stats.dead_letter_kinds["invalid_text"] = 1
    emit_unit(rec, stats)
    progress = Progress(2, 12, 10.0, metrics=rec, bar=False, clock=iter([0.0, 4.0]).__next__)
    progress.update(stats)
    emit_watch_tick(rec, backlog_rows=3, backlog_files=1, oldest_waiting_s=2.5)
    emit_watch_freshness(rec, 4.0, 9.0)

    monkeypatch.setattr(MetricsSpec, "build", lambda self: rec)
    for status in ("completed", "incomplete", "failed"):
        report = _report(status)
        RunMetrics.start(MetricsConfig(), report, app="raypipe").finish(report)


def test_every_client_emitter_sends_only_what_the_catalog_declares_and_all_of_it(monkeypatch):
    rec = CheckingRecorder(client_metrics.CATALOG)
    _run_every_client_emitter(rec, monkeypatch)
    assert rec.problems == []
    assert {m.name for m in client_metrics.CATALOG.metrics} - rec.seen == set(), "declared but never emitted"


def test_every_server_emitter_sends_only_what_the_catalog_declares_and_all_of_it():
    rec = CheckingRecorder(server_metrics.CATALOG)
    m = ServerMetrics(rec)
    m.request("OK", 4)
    m.request("INVALID_ARGUMENT", 1)
    m.timing(queue_s=0.001, replica_s=0.002)
    m.batch(calls=2, rows=5, tokens=80, compute_s=0.01)
    assert rec.problems == []
    assert {m.name for m in server_metrics.CATALOG.metrics} - rec.seen == set(), "declared but never emitted"


def test_the_checking_recorder_notices_a_record_off_the_catalog():
    """The two tests above can fail: a name, a kind, a tag or a value off the catalog is noted."""
    rec = CheckingRecorder(server_metrics.CATALOG)
    MetricDef("server.unknown", "count", "x").record(rec)
    MetricDef("server.queue_ms", "gauge", "x").record(rec, 1)
    server_metrics.REQUESTS.record(rec, 1, {"actor": "a"})
    server_metrics.REQUESTS.record(rec, 1, {"status": "MAYBE"})
    assert len(rec.problems) == 4, rec.problems


def test_the_catalogs_constant_tags_are_the_tags_each_side_sets(monkeypatch):
    run = RunMetrics.start(MetricsConfig(), _report("running"), app="raypipe")
    assert {k for k, _ in run.spec.tags} == set(client_metrics.CATALOG.constant_tags)

    seen: dict[str, str] = {}

    def spec(self, environ, tags):
        seen.update(tags)
        return MetricsSpec()

    monkeypatch.setattr(ServerMetricsSettings, "spec", spec)
    ServerMetrics.build(ServerMetricsSettings(), environ={}, app="raypipe", model_version="v1")
    assert set(seen) == set(server_metrics.CATALOG.constant_tags)


def test_the_declared_methods_are_the_services_rpcs():
    service = emotion_pb2.DESCRIPTOR.services_by_name["EmotionClassifier"]
    assert set(client_metrics.CLIENT_CALLS.allowed("method") or ()) == set(service.methods_by_name)


def test_no_metric_is_sent_by_a_string_name():
    """Emitting code goes through `MetricDef.record`; a literal name would bypass the catalog."""
    found = []
    for package in ("raypipe", "serve_app", "protos"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.relative_to(REPO).as_posix().startswith("protos/raypipe/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _SENDS
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.func.attr}({node.args[0].value!r})")
    assert found == []


def test_catalog_refuses_a_name_declared_twice():
    with pytest.raises(ValueError, match="declared twice"):
        Catalog("x", (), (MetricDef("a", "count", "x"), MetricDef("a", "gauge", "y")))
