"""The bench's speed section: end to end at default settings against the CPU's fastest gated setting.

    python -m bench.run --sections speed [--models minilm-l6,bert-base] [--lock FILE]

For each model (the MiniLM-L6 and bert-base shapes, random weights, and the real-weights MiniLM
emotion model) on the CPU the bench runs on:

1. The model's record for this CPU, as a user gets it: the real-weights model is exported with
   ``raypipe model export`` (which measures); the shapes, built from a config, get
   ``raypipe model optimize --no-int8`` (the same measurement on the default sample).
2. **In process**: the setting a replica with default settings resolves to (the fastest that
   passes the gate; `serve_app.runtimes`), called in one process with the model's own batching,
   both thread layouts, the faster kept: the ceiling.
3. **End to end at default settings**: ``ray start --head`` as the README has it, ``raypipe
   serve --model DIR`` with no runtime or precision flag, ``raypipe backfill`` with defaults.
   Its report's cost (`raypipe.run.cost`) gives the CPU of every process of the cluster by group, the
   model's own CPU (the runtime's threads in the replica), and so the CPU outside the model and
   the idle share of the cores. Before the runs, the served cluster is left idle for `IDLE_S`
   seconds and the CPU of its own processes measured by group (`_background`): what every run pays
   per second on top of its paragraphs, whatever it computes.
4. **Agreement** of the default setting's answers with TensorFlow fp32, in process: in domain
   (generated emotion paragraphs of a seed nothing trained on) and out of domain (the shipped
   texts the gate never measures on, `serve_app.gate_texts.held_out`). Meaningful for the
   real-weights model only; the shapes show their record's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import Cluster, heavy_lock

__all__ = ["run_speed", "speed_tables"]

#: Paragraphs per line: long enough that start-up stays a few percent of the wall.
ROWS = {"bert-base": 2000}
DEFAULT_ROWS = 18_000
QUICK_ROWS = {"bert-base": 400}
QUICK_DEFAULT_ROWS = 2000
#: A short run (a daily's size) of the MiniLM shapes, where start-up weighs more.
SHORT_ROWS = 6000
#: Seconds the served cluster is measured idle before the end-to-end runs.
IDLE_S = 10.0


def run_speed(bench: Any, models: dict[str, Path], corpus: Path) -> dict[str, Any]:
    """The section's results: one entry per model label (bench is `bench.run.Bench`)."""
    from serve_app.model import cpu_flags, cpu_model_name

    flags = cpu_flags()
    out: dict[str, Any] = {
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
        "models": {},
    }
    for label, model_dir in models.items():
        print(f"bench: speed {label}", flush=True)
        out["models"][label] = _model(bench, label, model_dir, corpus)
    return out


def _model(bench: Any, label: str, model_dir: Path, corpus: Path) -> dict[str, Any]:
    quick = bench.args.quick
    shape = "bert-base" if "bert-base" in label else "minilm"
    n = (QUICK_ROWS if quick else ROWS).get(shape, QUICK_DEFAULT_ROWS if quick else DEFAULT_ROWS)
    entry: dict[str, Any] = {"model_dir": str(model_dir), "paragraphs": n}
    entry["record"] = _ensure_record(bench, label, model_dir)
    # 2. In process: the setting default settings resolve to, both thread layouts.
    layouts: dict[str, dict[str, Any]] = {}
    for layout in ("intra", "passes"):
        payload = {
            "model_dir": str(model_dir),
            "corpus": str(corpus),
            "n": n,
            "threads": bench.args.threads,
            "layout": layout,
            "runtime": "auto",
            "precision": "auto",
        }
        with heavy_lock(bench.lock):
            layouts[layout] = bench.child("inproc", payload, name=f"speed-{model_dir.name}-inproc-{layout}")
    best = max(layouts.values(), key=lambda line: line["ok"] / line["wall_s"])
    entry["inproc"] = {
        "setting": f"{best['runtime']}:{best['precision']}",
        "layout": best["layout"],
        "para_per_s": best["ok"] / best["wall_s"],
        "layouts_para_per_s": {k: round(v["ok"] / v["wall_s"], 2) for k, v in layouts.items()},
        "cpu_ms_per_para": 1000 * best["cpu_s_self"] / best["ok"],
    }
    # 3. End to end, defaults everywhere: the long run, then (MiniLM shapes) a short one.
    short = 0 if quick or shape == "bert-base" else SHORT_ROWS
    runs = {"e2e": n, **({"short": short} if short else {})}
    with heavy_lock(bench.lock), Cluster(num_cpus=bench.args.cluster_cpus, logs=bench.logs) as cluster:
        address = cluster.serve(model_dir)
        entry["background"] = _background(cluster, IDLE_S)
        for key, rows in runs.items():
            shards = bench.write_shards(corpus, rows, bench.work / f"input-speed-{rows}")
            name = f"speed-{model_dir.name}-{key}"
            line = bench.e2e(cluster, address, shards, name)
            report = json.loads((bench.work / f"out-{name}" / "runs" / f"{name}.json").read_text())
            entry[key] = _e2e_entry(line, report)
    entry["ratio"] = entry["e2e"]["para_per_s"] / entry["inproc"]["para_per_s"]
    entry["run_ratio"] = entry["e2e"]["run_para_per_s"] / entry["inproc"]["para_per_s"]
    if "short" in entry:
        entry["short_ratio"] = entry["short"]["para_per_s"] / entry["inproc"]["para_per_s"]
    entry["profile"] = _profile(entry["e2e"].get("cost") or {}, bench.args.cluster_cpus)
    # 4. Agreement of the default setting with TensorFlow fp32.
    if label == "real-weights MiniLM":
        entry["agreement"] = _agreement(bench, model_dir)
    else:
        served = (entry["record"] or {}).get(entry["inproc"]["setting"], {})
        entry["agreement"] = {
            "source": "the record (random weights: agreement means little)",
            "in domain": served.get("agreement_in"),
            "out of domain": served.get("agreement_out"),
        }
    return entry


def _e2e_entry(line: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    keys = ("paragraphs", "ok", "dead_letters", "wall_s", "report_wall_s", "retries", "calls")
    return {
        **{k: line[k] for k in keys},
        "para_per_s": line["paragraphs"] / line["wall_s"],
        "run_para_per_s": line["paragraphs"] / line["report_wall_s"],
        "answered_by": report.get("answered_by"),
        "model_version": report.get("model_version"),
        "cost": report.get("cost"),
        "startup": report.get("startup"),
        "limiter": report.get("limiter"),
        "peak_rss_bytes": line.get("peak_rss_bytes"),
        "peak_rss_started_bytes": line.get("peak_rss_started_bytes"),
    }


def _ensure_record(bench: Any, label: str, model_dir: Path) -> dict[str, Any] | None:
    """This CPU's record of the model ({setting: figures}), measuring it if it has none."""
    from serve_app.runtimes import read_record

    if read_record(model_dir) is None:
        cmd = [sys.executable, "-m", "raypipe", "model", "optimize", str(model_dir), "--no-int8"]
        with heavy_lock(bench.lock):
            done = subprocess.run(cmd, env=bench.env, capture_output=True, text=True, timeout=3600)
        (bench.logs / f"speed-optimize-{model_dir.name}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"raypipe model optimize {model_dir} failed; see {bench.logs}")
    record = read_record(model_dir)
    if record is None:
        return None
    return {
        f"{m.runtime}:{m.precision}": {
            "para_per_s": m.para_per_s,
            "agreement_in": m.agreement_in,
            "agreement_out": m.agreement_out,
            "max_abs_dp": m.max_abs_dp,
        }
        for m in record.measurements
    }


def _profile(cost: dict[str, Any], cores: int) -> dict[str, Any]:
    """CPU per paragraph by process group (ms), the model's share, the CPU outside it, idle."""
    n = cost.get("paragraphs") or 0
    if not n:
        return {}
    groups = dict(cost.get("groups") or {})
    model = float(cost.get("model_cpu_s") or 0.0)
    replica = float(groups.pop("serve replica", 0.0))
    per = {k: 1000 * v / n for k, v in groups.items()}
    per["replica outside the model"] = 1000 * max(0.0, replica - model) / n
    per["the model"] = 1000 * model / n
    total = float(cost["cpu_s"])
    wall = float(cost["wall_s"])
    return {
        "ms_per_para": {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
        "total_ms_per_para": round(1000 * total / n, 3),
        "outside_model_over_model": round((total - model) / model, 3) if model else None,
        "outside_replica_over_replica": round((total - replica) / replica, 3) if replica else None,
        "cores_busy": round(total / wall, 3) if wall else None,
        "idle_ms_per_para": round(1000 * max(0.0, cores * wall - total) / n, 3),
    }


def _background(cluster: Cluster, seconds: float) -> dict[str, Any]:
    """The CPU the served cluster's own processes spend while no run is in it: a run's
    `raypipe.run.cost.CpuMeter` over the processes whose command lines hold the cluster's
    marker (its temp dir, as `ProcessSampler` finds them; no driver), `seconds` apart."""
    from raypipe.run.cost import CpuMeter, sweep_node

    meter = CpuMeter.start(sweep=lambda: [sweep_node(session=cluster.marker)], driver_cpu=lambda: 0.0)
    if meter is None:
        return {}
    time.sleep(seconds)
    cost = meter.finish(paragraphs=0, model_cpu_s=0.0, core_hour_usd=0.0)
    return background_figures(cost.groups, cost.wall_s, cluster.num_cpus) if cost else {}


def background_figures(groups: dict[str, float], wall_s: float, cores: int) -> dict[str, Any]:
    """`_background`'s figures from CPU seconds by group over `wall_s`: ms a second by group, in
    all, and the share of the cluster's cores."""
    total = sum(groups.values())
    return {
        "seconds": round(wall_s, 2),
        "ms_per_s": {g: round(1000 * v / wall_s, 2) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "total_ms_per_s": round(1000 * total / wall_s, 1),
        "cores_share": round(total / wall_s / cores, 4),
    }


def _agreement(bench: Any, model_dir: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from serve_app.gate_texts import held_out

    outside = bench.work / "speed-out-of-domain.parquet"
    texts = held_out()
    pq.write_table(pa.table({"id": [f"o{i}" for i in range(len(texts))], "text": texts}), outside)
    corpora = {"in domain": bench._demo_eval_corpus(), "out of domain": outside}
    out: dict[str, Any] = {"source": "in process, held-out texts"}
    for domain, path in corpora.items():
        base = {"model_dir": str(model_dir), "corpus": str(path), "n": 2000, "threads": bench.args.threads}
        lines = {}
        for name, setting in (("reference", ("tensorflow", "fp32")), ("default", ("auto", "auto"))):
            payload = {**base, "return_top": True, "runtime": setting[0], "precision": setting[1]}
            with heavy_lock(bench.lock):
                lines[name] = bench.child("inproc", payload, name=f"speed-agree-{domain[:2]}-{name}")
        top_ref, top = np.array(lines["reference"]["top"]), np.array(lines["default"]["top"])
        out[domain] = float(np.mean(top == top_ref))
        out[f"{domain} texts"] = len(top)
        out["setting"] = f"{lines['default']['runtime']}:{lines['default']['precision']}"
    return out


def speed_tables(speed: dict[str, Any]) -> list[str]:
    """The section as Markdown: one table for the CPU, then where each model's CPU went."""
    flags = " ".join(speed.get("cpu_flags") or [])
    lines = [
        f"### Speed at default settings: {speed.get('cpu') or 'CPU'} ({flags})",
        "",
        "| model | setting (gated fastest) | in process para/s | e2e para/s (command) | e2e / in process "
        f"| run only | {SHORT_ROWS:,} paragraphs | agreement in / out | outside model / model "
        "| outside replica / replica | cores busy | retries | peak RSS (GiB) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for label, m in speed.get("models", {}).items():
        agree = m.get("agreement") or {}
        a_in, a_out = agree.get("in domain"), agree.get("out of domain")
        prof = m.get("profile") or {}
        short = f"{m['short_ratio']:.2f}" if "short_ratio" in m else "–"
        rss = m["e2e"].get("peak_rss_bytes")
        lines.append(
            f"| {label} | {m['inproc']['setting']} | {m['inproc']['para_per_s']:.1f} | {m['e2e']['para_per_s']:.1f} "
            f"| **{m['ratio']:.2f}** | {m['run_ratio']:.2f} | {short} "
            f"| {_pct(a_in)} / {_pct(a_out)} | {prof.get('outside_model_over_model', '–')} "
            f"| {prof.get('outside_replica_over_replica', '–')} | {prof.get('cores_busy', '–')} "
            f"| {m['e2e'].get('retries', '–')} | {'–' if rss is None else f'{rss / 2**30:.2f}'} |"
        )
    lines += _startup_table(speed)
    lines += _background_table(speed)
    for label, m in speed.get("models", {}).items():
        prof = m.get("profile") or {}
        per = prof.get("ms_per_para") or {}
        if not per:
            continue
        lines += [
            "",
            f"CPU per paragraph, {label} ({m['paragraphs']:,} paragraphs, answered by {m['e2e'].get('answered_by')}): "
            f"{prof.get('total_ms_per_para')} ms in all, idle {prof.get('idle_ms_per_para')} ms",
            "",
            "| group | ms per paragraph |",
            "|---|---:|",
            *(f"| {k} | {v:.3f} |" for k, v in per.items()),
        ]
    return lines


def _startup_table(speed: dict[str, Any]) -> list[str]:
    """Where each end-to-end command's wall went before the model worked: outside the run's own
    clock (the CLI's start and exit), then the report's start-up figures (`RunReport.startup`)."""
    rows = []
    for label, m in speed.get("models", {}).items():
        for key in ("e2e", "short"):
            line = m.get(key)
            startup = (line or {}).get("startup")
            if not startup or startup.get("first_call_s") is None:
                continue
            outside = line["wall_s"] - line["report_wall_s"]
            before = outside + startup["first_call_s"]
            rows.append(
                f"| {label} | {line['paragraphs']:,} | {line['wall_s']:.2f} | {outside:.2f} "
                f"| {startup.get('ray_s', float('nan')):.2f} | {startup['first_call_s']:.2f} "
                f"| {startup.get('first_unit_s', float('nan')):.2f} | {before / line['wall_s']:.3f} |"
            )
    if not rows:
        return []
    return [
        "",
        "Start-up of each end-to-end command (seconds; the run's figures count from its own start):",
        "",
        "| model | paragraphs | command wall | outside the run's clock | Ray ready | first call | first unit done "
        "| share of the wall outside the run or before its first call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _background_table(speed: dict[str, Any]) -> list[str]:
    """What the served cluster's own processes cost with no run in it, per model's cluster, and
    what that is per paragraph at the end-to-end run's rate and as a share of its CPU."""
    groups: list[str] = []
    rows = []
    for label, m in speed.get("models", {}).items():
        bg = m.get("background")
        if not bg:
            continue
        rate = m["e2e"].get("run_para_per_s") or m["e2e"]["para_per_s"]
        per_para = bg["total_ms_per_s"] / rate
        total = (m.get("profile") or {}).get("total_ms_per_para")
        share = f"{per_para / total:.3f}" if total else "–"
        rows.append((label, bg, per_para, share))
        groups += [g for g in bg["ms_per_s"] if g not in groups]
    if not rows:
        return []
    lines = [
        "",
        f"The served cluster with no run in it ({rows[0][1]['seconds']:.0f} s before the runs): CPU of its own "
        "processes in ms a second, the share of the cluster's cores, and that CPU per paragraph at the "
        "end-to-end run's rate and as a share of the run's CPU per paragraph:",
        "",
        f"| model | in all | share of the cores | ms per paragraph | share of the run's CPU | {' | '.join(groups)} |",
        "|---|" + "---:|" * (4 + len(groups)),
    ]
    for label, bg, per_para, share in rows:
        cells = " | ".join(f"{bg['ms_per_s'].get(g, 0.0):.1f}" for g in groups)
        lines.append(
            f"| {label} | {bg['total_ms_per_s']:.1f} | {bg['cores_share']:.3f} | {per_para:.3f} | {share} | {cells} |"
        )
    return lines


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2%}"
