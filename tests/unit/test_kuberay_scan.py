"""checkov's Kubernetes checks over every rendered overlay (`python -m kuberay.scan`).

checkov runs from its own virtual environment (kuberay/scan-requirements.txt), which the
first test here installs under .cache/checkov/ (about 40 s, once). A checkov that cannot be
installed or run fails these tests; it is never skipped. Every finding is fixed in the
manifests or skipped there with its reason (`checkov.io/skipN: CKV_K8S_xx=reason`), and the
set of skips is pinned here so a new one is a deliberate change.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from kuberay import scan, validate

OVERLAYS = sorted(p for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())

KEPT_SKIPS = {
    # The legacy scheduler pod (prod-kuberay-1.5): reasons in components/daily-cronjob-legacy.
    ("prod-kuberay-1.5", "CronJob.raypipe.raypipe-daily-legacy", "CKV_K8S_15"),  # pull policy
    ("prod-kuberay-1.5", "CronJob.raypipe.raypipe-daily-legacy", "CKV_K8S_38"),  # API token: it creates RayJobs
    ("prod-kuberay-1.5", "CronJob.raypipe.raypipe-daily-legacy", "CKV_K8S_40"),  # uid 1000, the image's user
    ("prod-kuberay-1.5", "CronJob.raypipe.raypipe-daily-legacy", "CKV_K8S_43"),  # tag, not digest
    # The maintenance pod, in every overlay with a daily schedule: reasons in components/maintenance.
    *(
        (overlay, f"CronJob.{namespace}.raypipe-maintenance", check)
        for overlay, namespace in (
            ("dev", "raypipe-dev"),
            ("prod", "raypipe"),
            ("prod-kuberay-1.5", "raypipe"),
            ("prod-tls", "raypipe"),
        )
        for check in (
            "CKV_K8S_15",  # pull policy
            "CKV_K8S_35",  # the optional S3 keys' Secret as variables, as in every job pod
            "CKV_K8S_40",  # uid 1000, the image's user
            "CKV_K8S_43",  # tag, not digest
        )
    ),
}


def _scan(directories: list[Path]) -> scan.ScanResult:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    try:
        return scan.scan(directories)
    except scan.ScannerUnavailable as e:
        pytest.fail(f"checkov could not run, so the manifests were not scanned: {e}")


@pytest.fixture(scope="module")
def overlays_scan() -> scan.ScanResult:
    return _scan(OVERLAYS)


def test_checkov_fails_nothing_on_any_overlay(overlays_scan: scan.ScanResult) -> None:
    assert [f"{f.overlay}: {f.resource}: {f.check_id} {f.check_name}" for f in overlays_scan.failed] == []
    assert overlays_scan.parsing_errors == []
    # 65 resources over the four overlays, 121 checks passed when this was written: a scan that
    # silently saw nothing (an empty rendering, a framework that did not load) shows here.
    assert overlays_scan.resources >= 60 and overlays_scan.passed >= 115, overlays_scan


def test_every_skip_is_a_kept_one_with_its_reason(overlays_scan: scan.ScanResult) -> None:
    assert {(f.overlay, f.resource, f.check_id) for f in overlays_scan.skipped} == KEPT_SKIPS
    assert all(len(f.reason.split()) >= 5 for f in overlays_scan.skipped), overlays_scan.skipped


def test_checkov_catches_a_broken_manifest(tmp_path: Path) -> None:
    """The scan is live: a privileged pod fails, and a skip without a reason is reported as such."""
    (tmp_path / "kustomization.yaml").write_text("resources: [pod.yaml]\n", encoding="utf-8")
    (tmp_path / "pod.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: v1
            kind: Pod
            metadata:
              name: broken
              namespace: raypipe
              annotations:
                checkov.io/skip1: CKV_K8S_43=
            spec:
              containers:
                - name: c
                  image: raypipe:0.1.0
                  securityContext: {privileged: true}
            """
        ),
        encoding="utf-8",
    )
    result = _scan([tmp_path])
    assert "CKV_K8S_16" in {f.check_id for f in result.failed}  # privileged containers
    assert [(f.check_id, f.reason) for f in result.skipped] == [("CKV_K8S_43", "")]
    assert scan.main([str(tmp_path)]) == 1


def test_a_scanner_that_cannot_be_installed_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("checkov==3.3.30\n", encoding="utf-8")
    monkeypatch.setattr(scan, "REQUIREMENTS", requirements)
    monkeypatch.setattr(scan, "VENV_OPTIONS", ("--without-pip",))  # so `pip install` fails, offline and at once
    monkeypatch.setattr(scan, "CACHE", tmp_path / "cache")
    with pytest.raises(scan.ScannerUnavailable, match="cannot install checkov"):
        scan.checkov_executable()
    assert scan.main([str(OVERLAYS[0])]) == 1
