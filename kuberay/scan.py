"""checkov's Kubernetes checks over the rendered overlays, run from checkov's own environment.

    python -m kuberay.scan                        # every overlay under kuberay/overlays
    python -m kuberay.scan kuberay/overlays/prod

checkov pins dependencies that clash with raypipe's, so it is not a dependency of the project:
`checkov_executable()` installs the pins of `kuberay/scan-requirements.txt` into a virtual
environment of its own under `.cache/checkov/` on first use (about 40 s) and reuses it while
that file is unchanged. When it cannot be installed, `ScannerUnavailable` says why; nothing
is skipped in silence.

A finding is fixed in the manifest or skipped there, on the resource, with its reason:
`checkov.io/skip1: CKV_K8S_43=why` (metadata.annotations). `scan` reports what failed and what
was skipped, with the reasons, so a skip without one shows.

checkov sees the core kinds (CronJob, NetworkPolicy, RBAC, ConfigMaps, ServiceAccounts), not
the pod templates inside RayService, RayJob and RayCronJob resources; `kuberay.validate`
checks those.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kuberay.validate import OVERLAYS, REPO, render_text

REQUIREMENTS = REPO / "kuberay" / "scan-requirements.txt"
CACHE = REPO / ".cache" / "checkov"
FRAMEWORK = "kubernetes"
VENV_OPTIONS: tuple[str, ...] = ()
"""Extra options of `python -m venv` (the tests pass --without-pip to make an install fail fast)."""


class ScannerUnavailable(RuntimeError):
    """checkov could not be installed or did not run."""


@dataclass(frozen=True)
class Finding:
    overlay: str
    check_id: str
    resource: str
    """checkov's name for it: Kind.namespace.name."""
    check_name: str
    reason: str = ""
    """For a skipped check, the reason given in the manifest's annotation."""


@dataclass
class ScanResult:
    passed: int = 0
    failed: list[Finding] = field(default_factory=list)
    skipped: list[Finding] = field(default_factory=list)
    parsing_errors: list[str] = field(default_factory=list)
    resources: int = 0


def _venv_dir() -> Path:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    return CACHE / f"venv-{digest}"


def checkov_executable() -> Path:
    """checkov from its own virtual environment, installed from the pins on first use."""
    venv = _venv_dir()
    exe = venv / "bin" / "checkov"
    done = venv / ".installed"
    if done.is_file() and exe.is_file():
        return exe
    from filelock import FileLock

    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "install.lock"), timeout=900):
        if done.is_file() and exe.is_file():
            return exe
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        steps = [[sys.executable, "-m", "venv", "--clear", *VENV_OPTIONS, str(venv)], [*pip, "-r", str(REQUIREMENTS)]]
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False)  # noqa: S603  fixed argv of the scanners, no shell
            if proc.returncode != 0:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
                raise ScannerUnavailable(f"cannot install checkov into {venv}: {' '.join(step[:4])}: {tail[0]}")
        if not exe.is_file():
            raise ScannerUnavailable(f"cannot install checkov into {venv}: no {exe} after pip")
        done.touch()
    return exe


def scan(directories: list[Path]) -> ScanResult:
    """checkov's Kubernetes checks over what `kubectl kustomize` renders for each directory."""
    exe = checkov_executable()
    result = ScanResult()
    with tempfile.TemporaryDirectory(prefix="raypipe-checkov-") as tmp:
        for directory in directories:
            (Path(tmp) / f"{Path(directory).name}.yaml").write_text(render_text(directory), encoding="utf-8")
        # --skip-download: no call to the vendor's API (guidelines, severities); offline.
        proc = subprocess.run(  # noqa: S603  fixed argv, no shell
            [str(exe), "--directory", tmp, "--framework", FRAMEWORK, "--output", "json", "--skip-download"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
        )
    # checkov exits 1 when a check fails; anything else, or output that is not its report, is a crash.
    try:
        reports = json.loads(proc.stdout) if proc.stdout.strip() else []
    except json.JSONDecodeError:
        reports = None
    if proc.returncode not in (0, 1) or reports is None:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise ScannerUnavailable(f"checkov exited {proc.returncode}: {tail[0]}")
    for report in reports if isinstance(reports, list) else [reports]:
        if report.get("check_type") not in (None, FRAMEWORK):
            continue
        summary = report.get("summary") or {}
        result.passed += summary.get("passed", 0)
        result.resources += summary.get("resource_count", 0)
        results = report.get("results") or {}
        for kind, into in (("failed_checks", result.failed), ("skipped_checks", result.skipped)):
            for check in results.get(kind) or []:
                into.append(
                    Finding(
                        overlay=Path(check.get("file_path", "?")).stem,
                        check_id=check.get("check_id", "?"),
                        resource=check.get("resource", "?"),
                        check_name=check.get("check_name", ""),
                        reason=str((check.get("check_result") or {}).get("suppress_comment") or ""),
                    )
                )
        result.parsing_errors += list(results.get("parsing_errors") or [])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberay.scan", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomize directories (default: every overlay)")
    args = parser.parse_args(argv)
    directories = args.dirs or sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
    try:
        result = scan(directories)
    except (ScannerUnavailable, RuntimeError) as e:
        print(f"scan: FAILED, cannot run checkov: {e}")
        return 1
    for f in result.failed:
        print(f"FAILED  {f.overlay}: {f.resource}: {f.check_id} {f.check_name}")
    for f in result.skipped:
        print(f"skipped {f.overlay}: {f.resource}: {f.check_id}: {f.reason or 'NO REASON GIVEN'}")
    for error in result.parsing_errors:
        print(f"parsing error: {error}")
    print(
        f"checkov ({FRAMEWORK}) on {len(directories)} rendering(s), {result.resources} resources: "
        f"{result.passed} passed, {len(result.failed)} failed, {len(result.skipped)} skipped"
    )
    unexplained = [f for f in result.skipped if not f.reason.strip()]
    return 1 if result.failed or result.parsing_errors or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
