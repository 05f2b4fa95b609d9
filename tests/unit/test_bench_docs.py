"""The speed figures of README.md and docs/performance.md are the results files' (`bench.docs`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import docs

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_and_the_performance_page_show_the_newest_results_files_figures():
    # Edit a figure by hand, or add a speed run without `python -m bench.docs`: this fails.
    assert docs.main(["--check", "--root", str(ROOT)]) == 0


def _results(tmp: Path, stamp: str, flags: list[str], models: dict[str, float]) -> None:
    line = {
        "inproc": {"setting": "openvino:fp32", "para_per_s": 100.0},
        "e2e": {"para_per_s": 0.0, "retries": 0},
        "profile": {"cores_busy": 1.95, "outside_model_over_model": 0.1},
        "agreement": {"in domain": 1.0, "out of domain": 0.995},
    }
    speed = {name: {**line, "ratio": r, "e2e": {"para_per_s": 100.0 * r, "retries": 0}} for name, r in models.items()}
    results = {
        "started_at": stamp,
        "env": {"git_commit": f"{stamp}abcdef", "cpu": {"model": "Some CPU", "usable_cpus": 2, "flags": flags}},
        "speed": {"models": speed},
    }
    (tmp / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (tmp / "bench" / "results" / f"bench-{stamp}.json").write_text(json.dumps(results))


def test_each_cpu_and_model_takes_its_newest_run_and_names_the_file(tmp_path):
    _results(tmp_path, "20260101T000000Z", ["avx2"], {"small": 0.70, "big": 0.60})
    _results(tmp_path, "20260102T000000Z", ["avx2"], {"small": 0.80})  # newer, small only
    _results(tmp_path, "20260103T000000Z", ["avx2", "amx_bf16"], {"small": 0.90})  # another CPU
    lines = docs.newest_lines(tmp_path / "bench" / "results")
    assert list(lines) == ["Some CPU (avx2, amx_bf16)", "Some CPU (avx2)"]  # newest run's CPU first
    avx2 = lines["Some CPU (avx2)"]
    assert (avx2["small"].line["ratio"], avx2["small"].file) == (0.80, "bench/results/bench-20260102T000000Z.md")
    assert (avx2["big"].line["ratio"], avx2["big"].file) == (0.60, "bench/results/bench-20260101T000000Z.md")

    readme = "\n".join(docs.readme_block(lines))
    assert "0.900 for small" in readme and "bench-20260103T000000Z.md" in readme
    assert "0.800" not in readme  # the README speaks of the newest run's CPU only
    table = "\n".join(docs.docs_block(lines))
    assert "| small | openvino:fp32 | 100.0 | 80.0 | **0.800** |" in table
    assert "`bench/results/bench-20260101T000000Z.md` (2026010) |" in table
    assert "99.50%" in table


def test_main_rewrites_only_between_the_markers_and_check_reports_a_stale_file(tmp_path, capsys):
    _results(tmp_path, "20260101T000000Z", ["avx2"], {"small": 0.70})
    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/performance.md"):
        (tmp_path / name).write_text(f"before\n{docs.BEGIN}\nhand-written 0.99\n{docs.END}\nafter\n")
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "README.md, docs/performance.md" in capsys.readouterr().err
    assert "0.99" in (tmp_path / "README.md").read_text()  # --check writes nothing

    assert docs.main(["--root", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("before\n") and readme.endswith(f"{docs.END}\nafter\n")
    assert "0.99" not in readme and "0.700 for small" in readme
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0


def test_a_file_without_the_markers_is_an_error():
    with pytest.raises(ValueError, match="no generated block"):
        docs.rewrite("no markers here", ["x"], name="README.md")


def test_a_smoke_run_is_never_quoted(tmp_path):
    _results(tmp_path, "20260101T000000Z", ["avx2"], {"small": 0.70})
    _results(tmp_path, "20260102T000000Z", ["avx2"], {"small": 0.20})
    newest = tmp_path / "bench" / "results" / "bench-20260102T000000Z.json"
    results = json.loads(newest.read_text())
    results["env"]["quick"] = True
    newest.write_text(json.dumps(results))
    lines = docs.newest_lines(tmp_path / "bench" / "results")
    assert lines["Some CPU (avx2)"]["small"].line["ratio"] == 0.70
