"""The jobs' entrypoints and the deploy guide's commands parse with raypipe's real CLI.

KubeRay's submitter pastes a RayJob's entrypoint into `bash -c "... ray job submit -- <it>"`,
so `$JOB_*` expand from the submitter container's environment. These tests expand them the
same way from the rendered manifests (ConfigMap keys, the Job-name label) and parse the result
with `raypipe.cli.parser.build_parser()`: an unknown flag fails here rather than after a cluster start.
They also check the flags the deploy guide and the jobs rely on exist, and the run-id rules
that make a retried RayJob resume its run (the lease behaviour itself is tested with the
lease). Broken copies fail.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberay import entrypoints, validate
from kuberay.validate import Resource
from raypipe.cli.parser import build_parser

OVERLAYS = sorted(p.name for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
GUIDE = validate.REPO / "docs" / "kuberay.md"


def rendered(overlay: str) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def uses_tls(resources: list[Resource]) -> bool:
    """The rendering has the model-tls component: the serve Service offers serve-grpcs."""
    rs = next(r for r in resources if r["kind"] == "RayService")
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return any(p["name"] == "serve-grpcs" for p in head["ports"])


def client_has_tls() -> bool:
    """raypipe's client takes `grpcs://` and `service.ca_file` (the client side of issue 20, item 5)."""
    from raypipe.config import ServiceConfig

    return "ca_file" in ServiceConfig.model_fields


def argv_of(job: validate.Job, resources: list[Resource]) -> list[str]:
    """The entrypoint as the head runs it: expanded like the submitter's shell, then split."""
    env = entrypoints.submitter_env(job, resources)
    expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: str(env[m.group(1)]), job.spec["entrypoint"])
    return shlex.split(expanded)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_entrypoints_parse_with_the_real_cli(overlay: str) -> None:
    resources = rendered(overlay)
    commands = {}
    for job in validate.jobs(resources):
        argv = argv_of(job, resources)
        assert argv[:3] == ["python", "-m", "raypipe"], argv
        args = build_parser().parse_args(argv[3:])  # SystemExit(2) on an unknown flag
        commands[args.command] = args
        if uses_tls(resources):
            assert args.service == "grpcs://raypipe-serve-svc:9443"
            assert "service.ca_file=/etc/raypipe/tls/ca.crt" in args.set
        else:
            assert args.service == "raypipe-serve-svc:9000"
        assert args.input.startswith("s3://") and args.output.startswith("s3://")
        if job.scheduled:
            assert args.run_id == job.name  # the RayJob's (generated) name: one run per tick
        elif job.watch:
            assert args.run_id is None  # the watch id, one per input: every retry resumes it
        else:
            assert (
                args.run_id
                == next(r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "raypipe-params")[
                    "data"
                ]["BACKFILL_RUN_ID"]
            )
    if any(job.watch for job in validate.jobs(resources)):
        assert set(commands) == {"backfill", "watch"}  # components/watch, instead of the daily
    else:
        assert set(commands) == {"backfill", "daily"}
        assert commands["daily"].since is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_entrypoints_pass_every_entrypoint_check(overlay: str) -> None:
    resources = rendered(overlay)
    problems = entrypoints.entrypoint_problems(resources)
    if uses_tls(resources) and not client_has_tls():
        # Everything but raypipe's own config check passes; that one waits for the client's TLS
        # settings (grpcs://, service.ca_file), built on another branch of issue 20.
        assert all("invalid configuration" in p for p in problems), problems
        pytest.skip("raypipe's client has no TLS settings yet: its config rejects grpcs:// and service.ca_file")
    assert problems == []


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("backfill", ["--input", "--output", "--service", "--run-id", "--set", "--config"]),
        ("daily", ["--input", "--output", "--service", "--run-id", "--set", "--since"]),
        ("replay", ["--output", "--run-id", "--service"]),
        ("report", ["--output", "--run-id", "--json"]),
    ],
)
def test_the_flags_the_jobs_and_guide_use_exist(command: str, flags: list[str]) -> None:
    sub = _subparser(command)
    known = {opt for action in sub._actions for opt in action.option_strings}
    assert set(flags) <= known, sorted(set(flags) - known)


def test_force_flag_for_taking_a_live_lease() -> None:
    """The guide documents `--force` on backfill and daily: a same-run-id attempt takes the lease at once."""
    for command in ("backfill", "daily"):
        args = build_parser().parse_args([command, "--output", "s3://b/o/", "--run-id", "r", "--force"])
        assert args.force is True
        assert build_parser().parse_args([command, "--output", "s3://b/o/", "--run-id", "r"]).force is False


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices[command]
    return sub


def guide_commands() -> list[str]:
    """`python -m raypipe ...` lines of the guide's code blocks (continuations joined)."""
    text = GUIDE.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(("python -m raypipe ", "raypipe ")):
                commands.append(line)
    return commands


def test_guide_has_raypipe_commands() -> None:
    assert len(guide_commands()) >= 3


@pytest.mark.parametrize("command", guide_commands())
def test_guide_commands_parse_with_the_real_cli(command: str) -> None:
    argv = shlex.split(command)
    argv = argv[3:] if argv[0] == "python" else argv[1:]
    build_parser().parse_args(argv)


def test_guide_documents_the_lease_rules() -> None:
    text = " ".join(GUIDE.read_text(encoding="utf-8").split())
    for phrase in ("waits until the live lease expires", "OutputLockedError", "exits 1", "--force", "resumes"):
        assert phrase in text


# --- broken copies ------------------------------------------------------------------------


def _backfill(rs: list[Resource]) -> dict[str, Any]:
    return next(r for r in rs if r["kind"] == "RayJob")["spec"]


def _daily(rs: list[Resource]) -> dict[str, Any]:
    return next(r for r in rs if r["kind"] == "RayCronJob")["spec"]["jobTemplate"]


def _replace(
    spec_of: Callable[[list[Resource]], dict[str, Any]], old: str, new: str
) -> Callable[[list[Resource]], None]:
    def mutate(rs: list[Resource]) -> None:
        spec = spec_of(rs)
        assert old in spec["entrypoint"], old
        spec["entrypoint"] = spec["entrypoint"].replace(old, new)

    return mutate


BREAKS: dict[str, tuple[Callable[[list[Resource]], None], str]] = {
    "unknown-flag": (_replace(_backfill, "--input", "--inputs"), "unrecognized arguments: --inputs"),
    "unknown-flag-daily": (_replace(_daily, "--run-id", "--runid"), "unrecognized arguments: --runid"),
    "unknown-command": (_replace(_backfill, "raypipe backfill", "raypipe backfil"), "invalid choice: 'backfil'"),
    "not-raypipe": (
        _replace(_backfill, "python -m raypipe", "python -m raypipe2"),
        "must start with `python -m raypipe`",
    ),
    "unknown-setting": (
        _replace(_backfill, "actors.max_actors", "actors.max_actor"),
        "actors.max_actor: unknown setting",
    ),
    "unset-variable": (_replace(_backfill, "$JOB_INPUT_URI", "$JOB_INPUT"), "$JOB_INPUT not set"),
    "shell-syntax": (_replace(_backfill, "--set", "; rm -rf / ; --set"), "shell syntax other than $VAR"),
    "wrong-service": (_replace(_backfill, "raypipe-serve-svc", "raypipe-head-svc"), "no RayService renders a Service"),
    "wrong-port": (_replace(_daily, "raypipe-serve-svc:9000", "raypipe-serve-svc:8000"), "gRPC port is 9000"),
    "other-namespace": (
        _replace(_backfill, "raypipe-serve-svc:9000", "raypipe-serve-svc.default.svc:9000"),
        "not the Service raypipe-serve-svc in namespace raypipe",
    ),
    "no-service": (_replace(_backfill, "--service raypipe-serve-svc:9000", ""), "--service is missing"),
    "no-run-id": (_replace(_backfill, '--run-id "$JOB_RUN_ID"', ""), "--run-id is missing"),
    "fixed-daily-run-id": (
        _replace(_daily, '--run-id "$JOB_RUN_ID"', "--run-id daily"),
        "a scheduled run must take its id from its Job's name",
    ),
    "daily-with-since": (
        _replace(_daily, "--set", "--since 2026-01-01T00:00:00+00:00 --set"),
        "--since re-reads every file on every tick",
    ),
    "scheduled-backfill": (_replace(_daily, "raypipe daily", "raypipe backfill"), "expected daily"),
    "bad-output-uri": (
        lambda rs: next(r for r in rs if r["metadata"]["name"] == "raypipe-params")["data"].update(
            JOB_OUTPUT_URI="gs://bucket/out/"
        ),
        "scheme 'gs' is not supported",
    ),
}


TLS = "--service grpcs://raypipe-serve-svc:9443 --set service.ca_file=/etc/raypipe/tls/ca.crt"

TLS_BREAKS: dict[str, tuple[str, Callable[[list[Resource]], None], str]] = {
    "plaintext-to-tls-only": (
        "prod-tls",
        _replace(_backfill, TLS, "--service raypipe-serve-svc:9000"),
        "plaintext, but raypipe-serve-svc offers TLS only: call grpcs://raypipe-serve-svc:9443",
    ),
    "plaintext-to-the-tls-port": (
        "prod-tls",
        _replace(_daily, TLS, "--service raypipe-serve-svc:9443"),
        "plaintext, but raypipe-serve-svc offers TLS only",
    ),
    "tls-to-the-wrong-port": (
        "prod-tls",
        _replace(_backfill, "raypipe-serve-svc:9443", "raypipe-serve-svc:9000"),
        "the RayService's TLS port is 9443",
    ),
    "tls-without-the-component": (
        "prod",
        _replace(_backfill, "--service raypipe-serve-svc:9000", "--service grpcs://raypipe-serve-svc:9443"),
        "TLS, but raypipe-serve-svc offers plaintext gRPC only",
    ),
    "tls-by-setting-without-the-component": (
        "prod",
        _replace(_daily, "--service raypipe-serve-svc:9000", "--service raypipe-serve-svc:9000 --set service.tls=true"),
        "TLS, but raypipe-serve-svc offers plaintext gRPC only",
    ),
    "other-scheme": (
        "prod-tls",
        _replace(_backfill, "grpcs://", "https://"),
        "host:port or grpcs://host:port, not https://",
    ),
    "ca-file-not-mounted": (
        "prod-tls",
        _replace(_daily, "/etc/raypipe/tls/ca.crt", "/etc/ssl/raypipe/ca.crt"),
        "service.ca_file /etc/ssl/raypipe/ca.crt is mounted in no volume of rayClusterSpec.headGroupSpec.template",
    ),
    "ca-file-without-tls": (
        "prod",
        _replace(_backfill, "--set actors", "--set service.ca_file=/etc/raypipe/tls/ca.crt --set actors"),
        "service.ca_file and service.token_env need TLS",
    ),
    "token-without-tls": (
        "prod",
        _replace(_backfill, "--set actors", "--set service.token_env=RAYPIPE_SERVICE_TOKEN --set actors"),
        "service.ca_file and service.token_env need TLS",
    ),
    "token-variable-unset": (
        "prod-tls",
        _replace(_backfill, "--set actors", "--set service.token_env=GATEWAY_TOKEN --set actors"),
        "service.token_env GATEWAY_TOKEN is not set in rayClusterSpec.workerGroupSpecs[0].template",
    ),
}


@pytest.mark.parametrize("case", sorted(TLS_BREAKS))
def test_tls_address_and_the_tls_component_agree(case: str) -> None:
    overlay, mutate, expected = TLS_BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = entrypoints.entrypoint_problems(resources)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "service",
    [
        "grpcs://raypipe-serve-svc:9443",
        "raypipe-serve-svc:9443 --set service.tls=true",
        "grpcs://raypipe-serve-svc.raypipe.svc:9443",
    ],
)
def test_tls_addresses_the_tls_component_takes(service: str) -> None:
    resources = rendered("prod-tls")
    _replace(_backfill, "grpcs://raypipe-serve-svc:9443", service)(resources)
    problems = [p for p in entrypoints.entrypoint_problems(resources) if "invalid configuration" not in p]
    assert problems == []


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_broken_entrypoints_fail(case: str) -> None:
    mutate, expected = BREAKS[case]
    resources = rendered("prod")
    mutate(resources)
    problems = entrypoints.entrypoint_problems(resources)
    assert any(expected in p for p in problems), problems


def test_legacy_template_entrypoint_is_checked() -> None:
    resources = rendered("prod-kuberay-1.5")
    cm = next(r for r in resources if r["kind"] == "ConfigMap" and "rayjob-template" in r["metadata"]["name"])
    key = next(iter(cm["data"]))
    cm["data"][key] = cm["data"][key].replace("--output", "--outptu")
    problems = entrypoints.entrypoint_problems(resources)
    assert any("rayjob-daily-template.yaml].entrypoint" in p and "--outptu" in p for p in problems), problems


def test_guide_exists_beside_the_manifests() -> None:
    assert GUIDE.is_file()
    assert Path(validate.REPO / "kuberay" / "base" / "kustomization.yaml").is_file()
