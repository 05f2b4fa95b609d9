"""The README's generated speed sentence says how the bench's clusters authenticated Ray's own
RPCs, from each results file (`bench.docs`; files before `env.ray_auth_mode` ran `disabled`)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import docs


def _results(tmp: Path, stamp: str, auth_mode: str | None) -> Path:
    line = {
        "inproc": {"setting": "openvino:fp32", "para_per_s": 100.0},
        "e2e": {"para_per_s": 90.0, "retries": 0},
        "ratio": 0.9,
        "profile": {"cores_busy": 1.95},
    }
    env = {"git_commit": "abcdef0", "cpu": {"model": "Some CPU", "usable_cpus": 2, "flags": ["avx2"]}}
    if auth_mode is not None:
        env["ray_auth_mode"] = auth_mode
    results_dir = tmp / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"bench-{stamp}.json").write_text(json.dumps({"env": env, "speed": {"models": {"m": line}}}))
    return results_dir


def test_a_run_without_token_auth_says_so(tmp_path):
    for auth_mode in (None, "disabled"):  # a file from before the key, and one that records it
        sentence = docs.readme_block(docs.newest_lines(_results(tmp_path, "20260101T000000Z", auth_mode)))[0]
        assert "without Ray's token authentication (`RAY_AUTH_MODE=disabled`)" in sentence


def test_a_run_with_token_auth_says_nothing_of_it(tmp_path):
    sentence = docs.readme_block(docs.newest_lines(_results(tmp_path, "20260101T000000Z", "token")))[0]
    assert "RAY_AUTH_MODE" not in sentence and "0.900 for m" in sentence
