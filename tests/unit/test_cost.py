"""Unit tests for a run's cost (`raypipe.run.cost`) and its line in the report: sweeps are fakes,
but for one node's sweep of real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import psutil

from raypipe.report import RunReport
from raypipe.run.cost import CpuMeter, group_of, process_title, sweep_node


def _node(name: str, **processes: tuple[float, str]) -> dict[str, Any]:
    return {"node": name, "session": "session_x", "processes": dict(processes)}


def test_the_cost_is_every_process_between_the_sweeps_grouped_by_title() -> None:
    sweeps = iter(
        [
            [_node("a", **{"10:1": (5.0, "ray::ServeReplica:raypipe:EmotionClassifier"), "11:1": (1.0, "/x/raylet")})],
            [
                _node(
                    "a",
                    **{
                        "10:1": (25.0, "ray::ServeReplica:raypipe:EmotionClassifier"),  # +20
                        "11:1": (1.5, "/x/raylet"),  # +0.5
                        "12:7": (2.0, "ray::MapWorker(MapBatches(InferenceActor))"),  # new: +2
                    },
                ),
                _node("b", **{"10:1": (3.0, "ray::ProxyActor")}),  # joined between the sweeps: left out
            ],
        ]
    )
    clock = iter([100.0, 110.0])
    driver = iter([1.0, 1.5])
    meter = CpuMeter.start(sweep=lambda: next(sweeps), clock=lambda: next(clock), driver_cpu=lambda: next(driver))
    assert meter is not None
    cost = meter.finish(paragraphs=4000, model_cpu_s=18.0, core_hour_usd=0.04)
    assert cost is not None
    assert cost.groups == {
        "serve replica": 20.0,
        "inference actors": 2.0,
        "ray raylet": 0.5,
        "driver": 0.5,
    }
    assert cost.cpu_s == 23.0 and cost.nodes == 1
    assert cost.cpu_s_per_1k == 5.75
    assert cost.model_share == 18.0 / 23.0
    assert cost.cores_busy == 2.3
    # 5.75 CPU-s per 1,000 -> 5,750 per million -> 1.5972 core-hours -> $0.0639 at $0.04
    assert round(cost.usd_per_million, 4) == 0.0639


def test_the_driver_is_counted_once_when_it_runs_on_a_cluster_node() -> None:
    here = os.uname().nodename
    me = f"{os.getpid()}:1"
    sweeps = iter([[_node(here, **{me: (1.0, "python")})], [_node(here, **{me: (9.0, "python")})]])
    driver = iter([1.0, 9.0])
    meter = CpuMeter.start(sweep=lambda: next(sweeps), driver_cpu=lambda: next(driver))
    assert meter is not None
    cost = meter.finish(paragraphs=1000, model_cpu_s=0.0, core_hour_usd=0.04)
    assert cost is not None and cost.groups == {"driver": 8.0}


def test_a_cluster_that_cannot_be_swept_costs_the_run_nothing_but_its_cost_line() -> None:
    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("no alive node")

    assert CpuMeter.start(sweep=broken) is None


def test_groups_follow_rays_process_titles() -> None:
    assert group_of("ray::ReadParquet->SplitBlocks(4)") == "read tasks"
    assert group_of("ray::ServeController") == "serve controller"
    # Ray Data's own actors of a run, not Ray's system processes.
    assert group_of("ray::_AutoscalingCoordinatorActor") == "ray data"
    assert group_of("ray::ActorLocationTracker") == "ray data"
    assert group_of("/usr/bin/gcs_server") == "ray gcs"
    assert group_of("python log_monitor.py") == "ray log monitor"
    assert group_of("python -m ray.util.client.server") == "ray system"


def test_untitled_python_processes_are_named_by_their_script() -> None:
    python = "/venv/bin/python3.13"
    starting = [python, "/venv/lib/site-packages/ray/_private/workers/default_worker.py", "--node-ip-address=1"]
    assert group_of(process_title(starting)) == "workers starting"
    agent = [python, "-u", "/venv/lib/site-packages/ray/dashboard/agent.py", "--node-ip-address=1"]
    assert group_of(process_title(agent)) == "ray dashboard and agents"
    assert process_title([python, "-m", "ray.util.client.server", "--port=10001"]) == "python -m ray.util.client.server"
    # Ray's own titles and binaries are kept as they are.
    assert process_title(["ray::InferenceActor.__call__", ""]) == "ray::InferenceActor.__call__"
    assert group_of(process_title(["/venv/lib/ray/core/src/ray/gcs/gcs_server", "--log_dir=/x"])) == "ray gcs"
    assert process_title([], "raylet") == "raylet"


def test_the_report_says_what_answered_and_what_it_cost() -> None:
    report = RunReport(run_id="r", mode="backfill", status="completed")
    report.answered_by = {"openvino:bf16": 5400, "openvino:fp32": 600}
    report.rows_copied = 12
    report.cost = {
        "cpu_s_per_1k": 6.5,
        "model_share": 0.69,
        "usd_per_million": 0.0722,
        "core_hour_usd": 0.04,
        "cores_busy": 1.93,
        "nodes": 1,
    }
    text = report.render()
    assert "answered by   openvino:bf16 5,400 rows | openvino:fp32 600 rows | without a call 12" in text
    assert "cost          6.50 CPU-s per 1,000 paragraphs (model 69%) | $0.072 per million at $0.04/core-hour" in text
    assert RunReport.from_dict(report.to_dict()).cost == report.cost


def test_a_worker_that_ended_between_the_sweeps_is_counted_through_its_parent() -> None:
    # A read task's worker: 2 s spent before the first sweep, 3 s more, then it exits and the raylet reaps it.
    before = [_node("a", **{"1:1": (1.0, 0.0, "/x/raylet"), "7:5": (2.0, 0.0, "ray::ReadParquet")})]
    after = [_node("a", **{"1:1": (1.2, 5.0, "/x/raylet")})]
    sweeps = iter([before, after])
    driver = iter([0.0, 0.0])
    meter = CpuMeter.start(sweep=lambda: next(sweeps), driver_cpu=lambda: next(driver))
    assert meter is not None
    meter.stop()
    cost = meter.finish(paragraphs=100, model_cpu_s=0.0, core_hour_usd=0.04)
    assert cost is not None
    assert cost.groups == {"ended workers": 3.0, "ray raylet": 0.2}  # the driver spent nothing: no line


def test_a_sweep_by_session_name_finds_its_processes_and_their_children_only() -> None:
    # What the driver sweeps on its own node: processes naming the session, and their descendants.
    session = f"session_test_{os.getpid()}_{time.monotonic_ns()}"
    sleep = "import time; time.sleep(60)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleep!r}]); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", child, f"/tmp/{session}/logs"])
    other = subprocess.Popen([sys.executable, "-c", sleep])
    try:
        deadline = time.monotonic() + 30
        while True:
            swept = sweep_node(session=session)
            if len(swept["processes"]) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        pids = {int(key.split(":")[0]) for key in swept["processes"]}
        assert swept["session"] == session
        assert parent.pid in pids and len(pids) == 2  # the parent and the child it started
        assert other.pid not in pids and os.getpid() not in pids
    finally:
        for grandchild in psutil.Process(parent.pid).children(recursive=True):
            grandchild.kill()  # reaped by init once its parent is gone
        for proc in (parent, other):
            proc.kill()
            proc.wait()
