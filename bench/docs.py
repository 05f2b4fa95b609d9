"""`python -m bench.docs`: the speed figures in README.md and docs/performance.md, written from
`bench/results/*.json`; `--check` exits 1, writing nothing, where either file differs from them.

Each file holds one generated block between `BEGIN` and `END`. The block is built from the
newest results file with a speed line for each (CPU, model), smoke runs (`--quick`) left out:
docs/performance.md gets one table per CPU (its model name and flags), and the README one
sentence for the CPU of the newest speed run. Every row and figure names the results file and the
commit it came from, so an edited figure or a new run shows up as a difference
(`tests/unit/test_bench_docs.py` runs the check; `make bench` runs this after the bench).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import precision

__all__ = ["BEGIN", "END", "SpeedLine", "docs_block", "newest_lines", "readme_block", "rewrite"]

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- speed figures: `python -m bench.docs` writes them from bench/results; edits are overwritten -->"
END = "<!-- end of speed figures -->"


@dataclass(frozen=True)
class SpeedLine:
    """One model's speed line in one results file."""

    model: str
    cpu: str  # the CPU's model name and flags, e.g. "AMD EPYC (avx2, fma)"
    cores: int
    file: str  # the Markdown twin of the JSON, relative to the repository
    commit: str
    started_at: str
    line: dict[str, Any]
    auth_mode: str = "disabled"
    """`RAY_AUTH_MODE` of the bench's processes (results files before it was recorded ran `disabled`)."""


def newest_lines(results_dir: Path) -> dict[str, dict[str, SpeedLine]]:
    """CPU -> model -> the speed line of the newest results file that has one for that model.

    CPUs are ordered newest run first; within a CPU, models keep the order of their newest run.
    """
    found: dict[str, dict[str, SpeedLine]] = {}
    for path in sorted(results_dir.glob("bench-*.json"), reverse=True):  # names sort by start time
        results = json.loads(path.read_text(encoding="utf-8"))
        speed = results.get("speed") or {}
        env = results.get("env") or {}
        if env.get("quick") or "--quick" in str(env.get("command")):
            continue  # a smoke run's counts are too small to quote
        cpu_env = env.get("cpu") or {}
        flags = ", ".join(cpu_env.get("flags") or speed.get("cpu_flags") or [])
        cpu = f"{cpu_env.get('model') or speed.get('cpu') or 'CPU'} ({flags})"
        for model, line in (speed.get("models") or {}).items():
            if "ratio" not in line:  # a line that failed part-way has no ratio
                continue
            found.setdefault(cpu, {}).setdefault(
                model,
                SpeedLine(
                    model=model,
                    cpu=cpu,
                    cores=int(cpu_env.get("usable_cpus") or 0),
                    file=str(path.with_suffix(".md").relative_to(results_dir.parent.parent)),
                    commit=str(env.get("git_commit") or "")[:7],
                    started_at=str(results.get("started_at") or ""),
                    line=line,
                    auth_mode=str(env.get("ray_auth_mode") or "disabled"),
                ),
            )
    return found


def docs_block(lines: dict[str, dict[str, SpeedLine]]) -> list[str]:
    """docs/performance.md's tables: one per CPU."""
    out: list[str] = []
    for cpu, models in lines.items():
        cores = max(s.cores for s in models.values())
        out += [
            f"**{cpu}, {cores} cores**",
            "",
            "| model | setting | in process para/s | e2e para/s | e2e / in process | 6,000 paragraphs / in process "
            "| CPU outside the model / model | cores busy | retries | agreement with TF fp32, in / out of domain "
            "| results file (commit) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for s in sorted(models.values(), key=lambda s: s.model):
            m = s.line
            prof = m.get("profile") or {}
            agree = m.get("agreement") or {}
            out.append(
                f"| {s.model} | {m['inproc']['setting']} | {m['inproc']['para_per_s']:.1f} "
                f"| {m['e2e']['para_per_s']:.1f} "
                f"| **{m['ratio']:.3f}** | {_f(m.get('short_ratio'), 3)} "
                f"| {_f(prof.get('outside_model_over_model'), 3)} "
                f"| {_f(prof.get('cores_busy'))} | {m['e2e'].get('retries', '–')} "
                f"| {_pct(agree.get('in domain'))} / {_pct(agree.get('out of domain'))} | `{s.file}` ({s.commit}) |"
            )
        out.append("")
    return out[:-1]


def readme_block(lines: dict[str, dict[str, SpeedLine]]) -> list[str]:
    """The README's sentence, for the CPU of the newest speed run."""
    if not lines:
        return ["No speed run is recorded yet (`make bench`)."]
    cpu, models = next(iter(lines.items()))
    parts = []
    for s in sorted(models.values(), key=lambda s: s.model):
        busy = (s.line.get("profile") or {}).get("cores_busy")
        # Three digits: the targets are two-digit ratios (0.90), which a rounded 0.897 would seem to meet.
        parts.append(f"{s.line['ratio']:.3f} for {s.model} ({_f(busy)} cores busy, `{s.file}`)")
    cores = max(s.cores for s in models.values())
    modes = sorted({s.auth_mode for s in models.values()})
    auth = (
        ""
        if modes == ["token"]
        else f" These clusters ran without Ray's token authentication (`RAY_AUTH_MODE={'/'.join(modes)}`): "
        "[docs/performance.md](docs/performance.md) says what that leaves out."
    )
    return [
        f"Measured end to end at these defaults against the same setting in process, on {cores} cores "
        f"of an {cpu}: {'; '.join(parts)}. See [docs/performance.md](docs/performance.md).{auth}"
    ]


def rewrite(text: str, block: list[str], *, name: str) -> str:
    """`text` with what lies between its `BEGIN` and `END` lines replaced by `block`."""
    lines = text.split("\n")
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise ValueError(f"{name} has no generated block (the lines {BEGIN!r} and {END!r})") from None
    if end < begin:
        raise ValueError(f"{name}: {END!r} comes before {BEGIN!r}")
    return "\n".join([*lines[: begin + 1], *block, *lines[end:]])


def _targets(root: Path) -> dict[Path, list[str]]:
    lines = newest_lines(root / "bench" / "results")
    from bench.peers import peers_docs_block

    performance = docs_block(lines) + peers_docs_block(root / "bench" / "results")
    return {root / "README.md": readme_block(lines), root / "docs" / "performance.md": performance}


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2%}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file differs from the results; write nothing")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stale = []
    for path, block in _targets(args.root).items():
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, block, name=str(path.relative_to(args.root)))
        new = precision.rewrite_docs(new, args.root / "bench" / "results") if path.name == "performance.md" else new
        if new == text:
            continue
        stale.append(str(path.relative_to(args.root)))
        if not args.check:
            path.write_text(new, encoding="utf-8")
    if stale and args.check:
        print(
            f"speed figures differ from bench/results in {', '.join(stale)}: run `python -m bench.docs`",
            file=sys.stderr,
        )
        return 1
    for name in stale:
        print(f"rewrote the speed figures of {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
