"""The run modes (`raypipe.run.modes`): the story of a run, step by step, over a fake protocol
and fake steps (no Ray, no table, no service); and a replay's id and plan on a real table."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from raypipe.api import build_config
from raypipe.commit.fence import UnitCommitter, mark_committed, take_over
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.schema import outcome_schema
from raypipe.commit.table import OutcomeTable
from raypipe.config import InputConfig, PipelineConfig
from raypipe.errors import ConfigError, LeaseLostError
from raypipe.plan.planning import Plan
from raypipe.report import RunReport
from raypipe.run import modes

LABELS = ("joy", "anger")


def config(tmp_path: Any, **settings: Any) -> PipelineConfig:
    (tmp_path / "in").mkdir(exist_ok=True)
    return build_config(
        input=str(tmp_path / "in"), output=str(tmp_path / "out"), service="127.0.0.1:1", settings=settings
    )


def backfill(cfg: PipelineConfig) -> RunReport:
    assert cfg.input is not None
    return modes.backfill(cfg, cfg.input, Output.at(cfg.output))


class Story:
    """What the run did, in order."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.reports: list[RunReport] = []


def fake_run(monkeypatch: Any, *, committed: bool = False, fail: dict[str, BaseException] | None = None) -> Story:
    """Replaces the protocol and the steps `_run` composes with fakes that tell the story."""
    story, fail = Story(), fail or {}

    def step(name: str) -> None:
        story.said.append(name)
        if name in fail:
            raise fail[name]

    class Protocol:
        def __init__(self, output: Any, mode: str, run_id: str, *, place: Any = None) -> None:
            self.mode, self.run_id = mode, run_id
            step("protocol")

        def setup_run(self, labels: tuple[str, ...]) -> None:
            step("setup")

        def release(self) -> None:
            story.said.append("release")

    class PlanRun:
        def __init__(self, protocol: Any, input: Any, make_plan: Any) -> None:
            pass

        def plan(self, model_version: str, report: RunReport) -> tuple[Plan, list[Any]]:
            step("plan")
            return Plan("backfill", "/in", [], []), []

    class ExecuteRun:
        def __init__(self, protocol: Any, settings: Any, metrics: Any) -> None:
            pass

        def execute(self, plan: Plan, todo: list[Any], model: Any, *, report: RunReport) -> None:
            step("execute")

    class CommitRun:
        def __init__(self, protocol: Any) -> None:
            pass

        def commit(self, *args: Any) -> None:
            step("commit")

        def abort(self) -> None:
            story.said.append("abort")

    class ReportRun:
        def __init__(self, protocol: Any, core_hour_usd: float, metrics: Any, *, t0: float) -> None:
            self.protocol = protocol

        def write(self, report: RunReport, execute: Any, plan: Any, *, write: bool) -> None:
            story.said.append("report" if write else "no report")
            story.reports.append(report)
            self.protocol.release()

    def ask(service: Any, client: Any) -> Any:
        step("ask")
        return SimpleNamespace(labels=LABELS, version="m1", client=client)

    def start(config: Any, report: RunReport, *, app: str) -> Any:
        step("metrics")
        return SimpleNamespace()

    def committed_report(protocol: Any) -> RunReport | None:
        step("committed?")
        return RunReport(run_id=protocol.run_id, mode=protocol.mode, status="completed") if committed else None

    monkeypatch.setattr(modes, "CommitProtocol", Protocol)
    monkeypatch.setattr(modes, "committed_report", committed_report)
    monkeypatch.setattr(modes.ModelService, "ask", staticmethod(ask))
    monkeypatch.setattr(modes.RunMetrics, "start", staticmethod(start))
    for name, fake in (("PlanRun", PlanRun), ("ExecuteRun", ExecuteRun), ("CommitRun", CommitRun)):
        monkeypatch.setattr(modes, name, fake)
    monkeypatch.setattr(modes, "ReportRun", ReportRun)
    return story


def test_a_run_is_told_in_its_order_and_gives_its_lease_back_last(tmp_path, monkeypatch):
    story = fake_run(monkeypatch)
    report = backfill(config(tmp_path))
    assert story.said == [
        "protocol",
        "committed?",
        "ask",
        "setup",
        "metrics",
        "plan",
        "execute",
        "commit",
        "report",
        "release",
    ]
    assert report.run_id.startswith("backfill-") and (report.labels, report.model_version) == (list(LABELS), "m1")


def test_a_committed_run_returns_its_report_without_asking_the_service(tmp_path, monkeypatch):
    story = fake_run(monkeypatch, committed=True)
    report = backfill(config(tmp_path, run_id="b1"))
    assert story.said == ["protocol", "committed?"] and report.status == "completed"


def test_metrics_that_cannot_start_give_the_lease_back_at_once(tmp_path, monkeypatch):
    story = fake_run(monkeypatch, fail={"metrics": RuntimeError("no statsd")})
    with pytest.raises(RuntimeError, match="no statsd"):
        backfill(config(tmp_path))
    assert story.said == ["protocol", "committed?", "ask", "setup", "metrics", "release"]


def test_a_failing_step_aborts_the_attempt_and_writes_a_failed_report(tmp_path, monkeypatch):
    story = fake_run(monkeypatch, fail={"execute": RuntimeError("boom")})
    with pytest.raises(RuntimeError, match="boom"):
        backfill(config(tmp_path))
    assert story.said[-4:] == ["execute", "abort", "report", "release"]
    assert (story.reports[0].status, story.reports[0].error) == ("failed", "RuntimeError: boom")


def test_an_attempt_fenced_off_leaves_the_report_to_the_attempt_that_took_over(tmp_path, monkeypatch):
    lost = LeaseLostError("taken over", holder="b", expires_at="?")
    story = fake_run(monkeypatch, fail={"commit": lost})
    with pytest.raises(LeaseLostError):
        backfill(config(tmp_path))
    assert story.said[-3:] == ["commit", "no report", "release"] and "abort" not in story.said


def test_a_daily_needs_an_aware_since(tmp_path):
    from datetime import datetime

    with pytest.raises(ConfigError, match="timezone-aware"):
        cfg = config(tmp_path)
        modes.daily(cfg, InputConfig(uri=str(tmp_path / "in")), Output.at(cfg.output), since=datetime(2026, 1, 1))


# -- replay: its id and its plan, on a real table ---------------------------------------------------
def committed_run(out: str, run_id: str, outcomes: dict[str, str]) -> None:
    """Run `run_id` with one committed unit `u1` holding `outcomes` (id -> result / dead_letter)."""
    table = OutcomeTable(out)
    table.ensure(LABELS)
    ids = sorted(outcomes)
    n = len(ids)
    cols: dict[str, Any] = {f.name: pa.nulls(n, f.type) for f in outcome_schema(LABELS)}
    cols.update(
        id=pa.array(ids),
        outcome=pa.array([outcomes[i] for i in ids]),
        unit=pa.array(["u1"] * n),
        run_id=pa.array([run_id] * n),
        text=pa.array(["t"] * n),
    )
    assert UnitCommitter(take_over(table, run_id)).commit("u1", pa.table(cols, schema=outcome_schema(LABELS)))
    mark_committed(table, take_over(table, run_id), run_id, {})


def test_a_replay_resumes_its_latest_unfinished_attempt_else_starts_the_next(tmp_path):
    out = str(tmp_path / "out")
    place = Output.at(out)
    place.table.ensure(LABELS)
    assert modes.replay_run_id(place, "b1") == "b1.replay-1"  # none yet
    place.store.write_json(place.store.run_state("b1.replay-1", "plan.json"), {})
    assert modes.replay_run_id(place, "b1") == "b1.replay-1"  # started, not committed: resumed
    committed_run(out, "b1.replay-1", {"x": "result"})
    place.table.refresh()  # past the commits made from another object
    assert modes.replay_run_id(place, "b1") == "b1.replay-2"  # committed: the next one


def test_a_replay_plans_a_unit_per_unit_holding_dead_letters(tmp_path):
    out = str(tmp_path / "out")
    committed_run(out, "b1", {"a": "result", "b": "dead_letter", "c": "dead_letter"})
    protocol = CommitProtocol(Output.at(config(tmp_path).output), "replay", "b1.replay-1")
    version, dead = protocol.dead_letters_of("b1") or (None, None)
    assert dead == {"u1": 2} and version == OutcomeTable(out).load().version()
    assert protocol.dead_letters_of("nobody") is None
