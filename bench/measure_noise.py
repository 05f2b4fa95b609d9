"""A measurement that survives a busy machine: the recorded choice over repeated exports under load.

    python -m bench.measure_noise [--model DIR] [--exports 5] [--no-load]

Copies the model directory (``--model``; default the demo model) to a temporary one, starts a
competing process busy on one core (a Python spin loop), and runs the measurement ``raypipe
model export`` runs (`serve_app.export._common.measure_runtimes`: every setting this CPU
supports, interleaved rounds, the export's 1,000 check texts and the shipped out-of-domain
texts) ``--exports`` times, each in a fresh process as an export is (``--skip runtime:precision``
leaves a setting out, e.g. one that crashes on this CPU; ``--resume FILE`` continues a run split
to hold the machine briefly). For each it reports the
setting a replica with default settings serves from that record (`serve_app.runtimes.choose`:
faster only beyond the spread) and, beside it, the setting with the highest median alone (what
a rule without the spread would record), with every setting's median, spread and rounds.
Writes bench/results/measure-noise-<UTC>.json and .md (after each export, so a run stopped
early keeps what it measured) with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.flops import cpu_info

RESULTS = Path(__file__).parent / "results"

_SPIN = "while True:\n    pass\n"

_EXPORT = """
import json, os, sys
from serve_app.export._common import MEASURE_TEXTS
from serve_app.model import cpu_flags
from serve_app.optimize import Sample, default_sample, measure
from serve_app.runtimes import choose, supported_settings
from serve_app.settings import ServerSettings

model_dir = sys.argv[1]
sample = Sample("check texts (export)", calibration=(), held_out=tuple(default_sample(MEASURE_TEXTS)))
skipped = {tuple(s.split(":")) for s in sys.argv[2:]}
only = [s for s in supported_settings(cpu_flags(), openvino=True) if s not in skipped]
record = measure(model_dir, sample, threads=os.cpu_count() or 1, only=only)
defaults = ServerSettings()
served = choose(runtime=defaults.runtime, precision=defaults.precision, flags=cpu_flags(), record=record,
                saved_model=None, min_agreement=defaults.min_agreement)
passing = [m for m in record.measurements if m.passes(defaults.min_agreement)]
top = max(passing, key=lambda m: m.para_per_s)
print(json.dumps({
    "served": served.setting,
    "reason": served.reason,
    "highest_median": f"{top.runtime}:{top.precision}",
    "settings": [
        {"setting": f"{m.runtime}:{m.precision}", "para_per_s": m.para_per_s, "spread": m.spread,
         "rounds": m.rounds, "speedup": m.speedup, "passes": m.passes(defaults.min_agreement)}
        for m in record.measurements
    ],
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--exports", type=int, default=5)
    parser.add_argument("--no-load", action="store_true", help="no competing process (a quiet baseline)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        help="a setting not to measure (runtime:precision), e.g. one that crashes",
    )
    parser.add_argument(
        "--resume", type=Path, default=None, help="a results .json of a run to continue until it has --exports exports"
    )
    args = parser.parse_args()
    model = args.model or _demo_model()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    command = "python -m bench.measure_noise" + (f" --model {args.model}" if args.model else "")
    command += f" --exports {args.exports}" + (" --no-load" if args.no_load else "")
    command += "".join(f" --skip {s}" for s in args.skip)
    result: dict[str, Any] = {
        "bench": "measure-noise",
        "utc": stamp,
        "cpu": cpu_info(),
        "cpus": os.cpu_count(),
        "command": command,
        "model": str(model),
        "load": "none" if args.no_load else "one competing process busy on one core (a Python spin loop)",
        "skipped": args.skip,
        "exports": [],
    }
    if args.resume is not None:  # a run split to hold the machine's lock briefly: same file, more exports
        result = json.loads(args.resume.read_text())
        stamp = result["utc"]
    work = Path(tempfile.mkdtemp(prefix="raypipe-measure-noise-"))
    spinner = None if args.no_load else subprocess.Popen([sys.executable, "-c", _SPIN])
    try:
        copy = work / "model"
        shutil.copytree(model, copy, ignore=shutil.ignore_patterns("runtimes.json"))
        for i in range(len(result["exports"]), args.exports):
            done = subprocess.run(
                [sys.executable, "-c", _EXPORT, str(copy), *result["skipped"]],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise SystemExit(f"export {i + 1} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            result["exports"].append(json.loads(done.stdout.strip().splitlines()[-1]))
            _write(result, stamp)
            print(f"export {i + 1}: serves {result['exports'][-1]['served']}", flush=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(_markdown(result))
    print(f"written bench/results/measure-noise-{stamp}.json and .md")


def _demo_model() -> Path:
    from serve_app.demo_model import build_demo_model, default_demo_model_dir

    return build_demo_model(default_demo_model_dir())


def _write(result: dict[str, Any], stamp: str) -> None:
    served = Counter(e["served"] for e in result["exports"])
    result["same_choice"] = f"{served.most_common(1)[0][1]} of {len(result['exports'])}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"measure-noise-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"measure-noise-{stamp}.md").write_text(_markdown(result))


def _markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    rows = [
        f"# The recorded choice under load ({result['utc']})",
        "",
        f"CPU: {cpu.get('model')}, {result['cpus']} cores, flags {' '.join(cpu.get('flags', []))}",
        f"Command: `{result['command']}`",
        f"Model: {result['model']}; load: {result['load']}"
        + (f"; not measured: {', '.join(result['skipped'])}" if result.get("skipped") else ""),
        f"Same served setting in {result.get('same_choice', '-')} exports.",
        "",
        "| export | served (faster only beyond the spread) | highest median | setting: para/s ± spread (rounds)"
        " [speed-up, gate] |",
        "|---|---|---|---|",
    ]
    for i, e in enumerate(result["exports"], 1):
        figures = "; ".join(
            f"{s['setting']}: {s['para_per_s']:.1f} ± {s['spread']:.1f} ({s['rounds']}) "
            f"[{s['speedup']:.2f}x, {'pass' if s['passes'] else 'FAIL'}]"
            for s in e["settings"]
        )
        rows.append(f"| {i} | {e['served']} | {e['highest_median']} | {figures} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
