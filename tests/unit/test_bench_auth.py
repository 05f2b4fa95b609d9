"""The bench's clusters run with Ray's token authentication as users' clusters do, and
`bench.auth` reports what it costs against `disabled` (here on made-up runs: no Ray starts)."""

from __future__ import annotations

import stat
from pathlib import Path

from bench.auth import render, summarize
from bench.cluster import bench_env, ensure_ray_token


def test_bench_processes_run_with_token_authentication() -> None:
    assert bench_env()["RAY_AUTH_MODE"] == "token"
    assert bench_env({"RAY_AUTH_MODE": "disabled"})["RAY_AUTH_MODE"] == "disabled"


def test_the_clusters_token_file_is_made_private_before_ray_starts(tmp_path: Path) -> None:
    path = tmp_path / "ray" / "auth_token"
    ensure_ray_token({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(path)})
    assert not path.exists()
    ensure_ray_token({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip()


def _run(mode: str, position: int, para_per_s: float, cpu_ms: float) -> dict[str, object]:
    return {
        "mode": mode,
        "position": position,
        "para_per_s": para_per_s,
        "run_para_per_s": para_per_s * 1.1,
        "cpu_ms_per_para": cpu_ms,
        "serve_s": 20.0,
        "load_avg_1m_after": 2.0,
    }


def test_the_cost_is_token_over_disabled_of_the_medians() -> None:
    runs = [
        _run("disabled", 0, 100.0, 20.0),
        _run("token", 1, 90.0, 22.0),
        _run("token", 2, 96.0, 21.0),
        _run("disabled", 3, 104.0, 19.0),
    ]
    summary = summarize(runs)
    assert summary["median"]["token"]["para_per_s"] == 93.0
    assert summary["median"]["disabled"]["para_per_s"] == 102.0
    assert summary["token_over_disabled"]["para_per_s"] == round(93.0 / 102.0, 4)
    assert summary["token_over_disabled"]["cpu_ms_per_para"] == round(21.5 / 19.5, 4)
    results = {
        "started_at": "2026-11-28T00:00:00+00:00",
        "env": {"command": "python -m bench.auth", "git_commit": "abc", "cpu": {"model": "X"}, "cluster_cpus": 2},
        "model": "minilm-l6",
        "rows": 6000,
        "runs": runs,
        "summary": summary,
    }
    text = render(results)
    assert "| 1 | token | 90.0 |" in text and "throughput 0.912 (command)" in text
    assert "token_over_disabled" not in summarize(runs[:1])  # one mode alone: no ratio
