"""The output's maintenance on a schedule (kuberay/components/maintenance): a weekly CronJob
whose pod runs `raypipe compact`, then `raypipe vacuum`, on the runs' output, in every overlay
with a daily schedule and in none with a watcher. It passes every check the other manifests
pass (Kubernetes schemas, raypipe's deployment rules: pool, requests = limits, non-root,
NetworkPolicies, ServiceAccounts), and each rule of its own fails on a broken copy.
"""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest

from kuberay import entrypoints, policy, validate
from kuberay.validate import Resource

NAME = "raypipe-maintenance"
DAILY_OVERLAYS = ("dev", "prod", "prod-tls", "prod-kuberay-1.5")


def rendered(overlay: str) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


@pytest.fixture(scope="module")
def prod() -> list[Resource]:
    return rendered("prod")


def maintenance(rs: list[Resource]) -> Resource:
    return next(r for r in rs if r["kind"] == "CronJob" and r["metadata"]["name"] == NAME)


def pod(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = maintenance(rs)["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return spec


def problems(rs: list[Resource]) -> list[str]:
    return entrypoints.entrypoint_problems(rs) + policy.project_problems(rs)


@pytest.mark.parametrize("overlay", DAILY_OVERLAYS)
def test_every_overlay_with_a_daily_schedule_runs_compact_then_vacuum_weekly_and_passes_every_check(
    overlay: str,
) -> None:
    rs = rendered(overlay)
    assert [r["metadata"]["name"] for r in rs if validate.is_maintenance(r)] == [NAME]
    spec = pod(rs)
    assert [c["command"][3] for c in spec["initContainers"] + spec["containers"]] == ["compact", "vacuum"]
    assert spec["serviceAccountName"] == "raypipe-jobs" and spec["automountServiceAccountToken"] is False
    assert maintenance(rs)["spec"]["concurrencyPolicy"] == "Forbid"
    assert maintenance(rs)["metadata"]["labels"]["raypipe.io/job"] == "daily"  # applied with the daily
    found = validate.check(rs)
    assert {name: p for name, p in found.items() if p} == {}


def test_the_watcher_s_overlay_has_no_maintenance_it_would_be_refused_every_week() -> None:
    assert not any(validate.is_maintenance(r) for r in rendered("prod-watch"))


@pytest.mark.parametrize("overlay", DAILY_OVERLAYS)
def test_it_runs_after_the_daily_s_deadline_and_before_the_next_tick(overlay: str) -> None:
    """Hours of the week: the daily's tick plus its deadline ends before maintenance starts,
    and maintenance's deadline ends before the next daily tick."""
    rs = rendered(overlay)
    daily = next(r for r in rs if r["kind"] in ("RayCronJob", "CronJob") and not validate.is_maintenance(r))
    minute, hour, _, _, weekday = maintenance(rs)["spec"]["schedule"].split()
    d_minute, d_hour, *_ = daily["spec"]["schedule"].split()
    start = int(weekday) * 24 + int(hour) + int(minute) / 60
    daily_start = int(d_hour) + int(d_minute) / 60  # every day, so also on maintenance's day
    deadline_h = max(
        (daily["spec"]["jobTemplate"]["spec"] if daily["kind"] == "CronJob" else daily["spec"]["jobTemplate"]).get(
            "activeDeadlineSeconds"
        )
        / 3600,
        0,
    )
    own_h = maintenance(rs)["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] / 3600
    day = int(weekday) * 24
    assert day + daily_start + deadline_h <= start, "it would meet the day's daily and be refused"
    assert start + own_h <= day + 24 + daily_start, "the next daily would meet it and be refused"


def broken(rs: list[Resource], change: Any) -> list[Resource]:
    copied = copy.deepcopy(rs)
    change(pod(copied), maintenance(copied))
    return copied


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda p, cj: p["containers"][0]["command"].append("--force"), "--force allows a retention"),
        (
            lambda p, cj: p.update(initContainers=p["containers"], containers=p["initContainers"]),
            "expected `raypipe compact` (init container), then `raypipe vacuum`",
        ),
        (lambda p, cj: p["containers"][0]["command"].__setitem__(5, "s3://elsewhere/"), "--output must be"),
        (lambda p, cj: p["containers"][0]["command"].append("--retention-days=7"), "raypipe's CLI rejects it"),
        (lambda p, cj: p["containers"][0]["command"].append("--retention-hours=24"), "a retention under 168 h"),
        (
            lambda p, cj: p["containers"][0]["env"].append(
                {"name": "RAYPIPE_SERVICE_TOKEN", "valueFrom": {"secretKeyRef": {"name": "raypipe-service-token"}}}
            ),
            "calls no model",
        ),
        (lambda p, cj: cj["spec"].update(concurrencyPolicy="Allow"), "concurrencyPolicy must be Forbid"),
        (lambda p, cj: cj["spec"].pop("timeZone"), "set timeZone"),
        (lambda p, cj: cj["metadata"]["labels"].update({"raypipe.io/job": "maintenance"}), "raypipe.io/job=daily"),
        (lambda p, cj: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilege"),
        (lambda p, cj: p.pop("nodeSelector"), "nodeSelector must pick the pool"),
    ],
)
def test_each_rule_of_the_maintenance_schedule_fails_on_a_broken_copy(
    prod: list[Resource], change: Any, expected: str
) -> None:
    assert problems(prod) == []
    found = problems(broken(prod, change))
    assert any(expected in p for p in found), found


def test_maintenance_beside_a_watcher_is_refused(prod: list[Resource]) -> None:
    watch = rendered("prod-watch")
    found = policy.project_problems([*watch, maintenance(prod)])
    assert any("beside a watcher" in p for p in found), found
