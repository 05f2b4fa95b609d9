"""The local cluster `raypipe serve --detach` starts when it finds none (no Ray started here)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from raypipe.run import driver


def test_the_local_cluster_starts_without_what_a_service_does_not_use(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "started", "")

    monkeypatch.setattr(subprocess, "run", run)
    driver.start_local_cluster()
    (cmd,) = seen
    assert cmd[-len(driver.LOCAL_CLUSTER_FLAGS) :] == list(driver.LOCAL_CLUSTER_FLAGS)
    assert {"start", "--head", "--include-dashboard=false", "--include-log-monitor=false"} <= set(cmd)


def test_a_cluster_that_does_not_start_says_what_ray_said(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "noise\nConnectionError: port 6379 is taken\n")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): .*port 6379 is taken"):
        driver.start_local_cluster()


def test_a_cluster_that_hangs_is_given_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(RuntimeError, match="did not finish within 5 s"):
        driver.start_local_cluster(timeout_s=5)
