"""Benchmark results as Markdown: one table per model, then the memory, daily and precision lines."""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["LINE_TITLES", "derive", "render_markdown"]

LINE_TITLES = {
    "a": "(a) ceiling: in-process, best batching",
    "b": "(b) reference final: 1 RPC/para, semaphore 50, unbatched server",
    "c": "(c) reference start: sync, 1 para at a time",
    "d": "(d) raypipe end to end, default settings",
}


def derive(lines: dict[str, dict[str, Any]], *, gemm_flops_per_s: float | None) -> None:
    """Adds para/s, ratios to (a) and (b), CPU-s/para and GEMM share to each line, in place."""
    for line in lines.values():
        ok, wall = line.get("ok") or 0, line.get("wall_s") or 0.0
        line["para_per_s"] = ok / wall if wall > 0 else None
        cpu = line.get("cpu_s")
        line["cpu_s_per_para"] = cpu / ok if cpu is not None and ok else None
        flops = line.get("useful_flops_per_para")
        rate = line["para_per_s"]
        line["useful_flops_per_s"] = flops * rate if flops and rate else None
        line["gemm_share"] = (
            line["useful_flops_per_s"] / gemm_flops_per_s if line["useful_flops_per_s"] and gemm_flops_per_s else None
        )
        padded, real = line.get("padded_tokens"), line.get("real_tokens")
        line["padded_per_real"] = padded / real if padded and real else None
    for ref in ("a", "b"):
        base = (lines.get(ref) or {}).get("para_per_s")
        for line in lines.values():
            line[f"vs_{ref}"] = line["para_per_s"] / base if base and line["para_per_s"] else None


def _f(value: Any, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if value is None else fmt.format(value)


def _model_table(name: str, model: dict[str, Any]) -> list[str]:
    shape = model["shape"]
    gemm = model.get("gemm") or {}
    stats = model.get("corpus_tokens") or {}
    out = [
        f"### {name}: {shape['layers']}×{shape['hidden']}, {shape['heads']} heads, "
        f"{shape['intermediate']} intermediate, max length {shape['max_length']}",
        "",
        f"GEMM fp32 at this model's shapes: {_f(gemm.get('flops_per_s'), '{:.3g}')} FLOP/s "
        f"(numpy {_f(gemm.get('numpy_flops_per_s'), '{:.3g}')}, TF {_f(gemm.get('tf_flops_per_s'), '{:.3g}')}, "
        f"{gemm.get('threads', '?')} threads). Corpus tokens: median {_f(stats.get('median'), '{:.0f}')}, "
        f"p99 {_f(stats.get('p99'), '{:.0f}')}, {_f(stats.get('truncated_share'), '{:.1%}')} truncated.",
        "",
        "| line | paragraphs | para/s | ×(a) | ×(b) | CPU-s/para | padded/real tok | retries "
        "| p50/p99 ms | peak RSS MB | useful GFLOP/s | % of GEMM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, line in model["lines"].items():
        if line.get("skipped"):
            out.append(f"| {LINE_TITLES.get(key, key)} | skipped: {line['skipped']} |||||||||||")
            continue
        lat = line.get("latency_ms") or {}
        rss = line.get("peak_rss_bytes")
        out.append(
            "| "
            + " | ".join(
                [
                    LINE_TITLES.get(key, key),
                    f"{line.get('ok', 0):,}",
                    _f(line.get("para_per_s"), "{:.1f}"),
                    _f(line.get("vs_a")),
                    _f(line.get("vs_b")),
                    _f(line.get("cpu_s_per_para"), "{:.3f}"),
                    _f(line.get("padded_per_real")),
                    str(line.get("retries", "–")),
                    f"{_f(lat.get('p50'), '{:.0f}')}/{_f(lat.get('p99'), '{:.0f}')}",
                    _f(None if rss is None else rss / 2**20, "{:,.0f}"),
                    _f(None if line.get("useful_flops_per_s") is None else line["useful_flops_per_s"] / 1e9, "{:.1f}"),
                    _f(line.get("gemm_share"), "{:.0%}"),
                ]
            )
            + " |"
        )
    layouts = model["lines"].get("a", {}).get("layouts_para_per_s")
    if layouts:
        shown = ", ".join(f"{k} {v:.1f} para/s" for k, v in layouts.items())
        out += ["", f"(a) is the faster thread layout in process: {shown} (intra: one pass on all threads; "
                "passes: one single-threaded pass per thread, side by side)."]  # fmt: skip
    a = model["lines"].get("a", {})
    if a.get("runtime"):
        out += ["", f"(a) and (d) serve `precision: auto`, here {a['runtime']} {a['precision']} "
                "(the fastest setting `raypipe model optimize` measured at >= 99% agreement)."]  # fmt: skip
    return out


def render_markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    cpu = env["cpu"]
    out = [
        f"# raypipe benchmark ({results['started_at']})",
        "",
        f"- commit `{env['git_commit']}`{' (dirty tree)' if env.get('git_dirty') else ''}; command `{env['command']}`",
        f"- CPU: {cpu['model']}, {cpu['usable_cpus']} usable of {cpu['logical_cpus']} logical; "
        f"flags: {', '.join(cpu['flags']) or 'none of interest'}",
        f"- Ray cluster `ray start --head --num-cpus {env['cluster_cpus']}`; server defaults "
        f"`{env['server_defaults']}`; unbatched server for (b)/(c): `{env['unbatched_settings']}`",
        "- Ratios are from this one run on the same cores. CPU-s/para sums every process of the run "
        "(client or driver, Ray, Serve); peak RSS sums their RSS. Useful FLOPs count real tokens only.",
        "",
    ]
    speed = results.get("speed")
    if speed:
        from bench.speed import speed_tables

        out += [*speed_tables(speed), ""]
    if results.get("peers"):
        from bench.peers import peers_tables

        out += [*peers_tables(results["peers"]), ""]
    for name, model in results.get("models", {}).items():
        out += _model_table(name, model)
        out.append("")
    memory = results.get("memory")
    if memory:
        out += ["### Memory: 10× the input", ""]
        if memory.get("skipped"):
            out.append(f"skipped: {memory['skipped']}")
        else:
            out += [
                "| input rows | wall s | peak RSS MB (all) | peak RSS MB (driver tree) |",
                "|---:|---:|---:|---:|",
            ]
            for run in memory["runs"]:
                out.append(
                    f"| {run['rows']:,} | {run['wall_s']:.1f} | {run['peak_rss_bytes'] / 2**20:,.0f} "
                    f"| {run['peak_rss_started_bytes'] / 2**20:,.0f} |"
                )
            out += [
                "",
                f"10×/1× peak RSS: {_f(memory.get('ratio_all'))} (all processes), "
                f"{_f(memory.get('ratio_driver'))} (driver tree); target ≤ 1.15: "
                f"**{'met' if memory.get('met') else 'NOT met'}**.",
            ]
        out.append("")
    daily = results.get("daily")
    if daily:
        out += ["### Daily delta", ""]
        if daily.get("skipped") or daily.get("error"):
            out.append(f"{'skipped' if daily.get('skipped') else 'failed'}: {daily.get('skipped') or daily['error']}")
        else:
            out += [
                f"{daily['input_rows']:,} input rows ({daily['input_bytes'] / 2**20:,.1f} MB in "
                f"{daily['input_objects']} objects, layout `{daily['layout']}`), delta {daily['delta_rows']:,} rows.",
                "",
                "| run | rows out | calls | rows without a call | wall s | bytes read (S3 → client) | share of input |",
                "|---|---:|---:|---:|---:|---:|---:|",
                f"| backfill of the delta alone | {daily['delta_backfill']['rows']:,} "
                f"| {daily['delta_backfill'].get('calls', '?')} | {daily['delta_backfill'].get('rows_copied', '?')} "
                f"| {daily['delta_backfill']['wall_s']:.1f} | {daily['delta_backfill']['bytes_read']:,} "
                f"| {_f(daily['delta_backfill']['bytes_read'] / daily['input_bytes'], '{:.1%}')} |",
                f"| daily over the full input | {daily['daily']['rows']:,} | {daily['daily'].get('calls', '?')} "
                f"| {daily['daily'].get('rows_copied', '?')} | {daily['daily']['wall_s']:.1f} "
                f"| {daily['daily']['bytes_read']:,} | {_f(daily['bytes_share'], '{:.1%}')} |",
                "",
                f"The daily's bytes include the text-hash lookup: {daily.get('lookup_bytes', 0):,} bytes of the "
                "outcomes table (`text_hash`, the probabilities, footers), taken out of the share below "
                f"(with it: {_f(daily.get('bytes_share_with_lookup'), '{:.1%}')}).",
                "",
                f"Input bytes share {_f(daily['bytes_share'], '{:.1%}')} (target ≤ 5%), wall ratio "
                f"{_f(daily['wall_ratio'])}× (target ≤ 3×), calls {_f(daily.get('calls_ratio'))}× the delta "
                f"backfill's: **{'met' if daily.get('met') else 'NOT met'}**.",
            ]
        out.append("")
    driver = results.get("driver")
    if driver:
        out += [
            "### Driver memory",
            "",
            f"{driver['units']:,} units: the plan peaks at {driver['plan_peak_mb']} MB of Python heap "
            f"({driver['plan_json_mb']} MB as JSON); listing the committed units from the table's log takes "
            f"{driver.get('list_committed_s')} s and peaks at {driver.get('list_committed_peak_mb')} MB; folding "
            f"every unit's summary peaks at {driver['fold_peak_mb']} MB ({driver['fold_s']} s).",
            "",
        ]
    planning = results.get("planning")
    if planning:
        out += _planning(planning)
    commits = results.get("commits")
    if commits:
        out += [
            "### Commits (outcomes table on moto S3)",
            "",
            f"{commits['writers']} concurrent writers, {commits['commits']} unit commits of "
            f"{commits['rows_per_commit']:,} rows: **{commits['commits_per_s']} commits/s**; one commit p50 "
            f"{commits['commit_s_p50']} s, max {commits['commit_s_max']} s ({commits['units_committed']} units "
            "in the log afterwards).",
            "",
        ]
    pool = results.get("pool")
    if pool:
        out += _pool_table(pool)
    precision = results.get("precision")
    if precision:
        out += ["### Faster precision", ""]
        if precision.get("skipped"):
            out.append(f"skipped: {precision['skipped']}")
        else:
            out += _precision_tables(precision)
        out.append("")
    return "\n".join(out)


def _precision_tables(precision: dict[str, Any]) -> list[str]:
    out = [f"CPU flags: {' '.join(precision.get('cpu_flags', [])) or '?'}", ""]
    agreement: dict[str, dict[str, Any]] = precision.get("agreement", {})
    if agreement:
        domains = list(agreement)
        out += [
            "Real-weights MiniLM against TensorFlow fp32: top-label agreement (max |Δp|), "
            + ", ".join(f"{d}: {agreement[d].get('texts', '?')} texts" for d in domains),
            "",
            "| setting | " + " | ".join(domains) + " |",
            "|---|" + "---:|" * len(domains),
        ]
        settings = list(dict.fromkeys(k for d in domains for k in agreement[d] if k != "texts"))
        for setting in settings:
            cells = []
            for d in domains:
                entry = agreement[d].get(setting, {})
                cells.append(
                    "error"
                    if "error" in entry
                    else f"{_f(entry.get('agreement'), '{:.2%}')} ({_f(entry.get('max_abs_dp'), '{:.4f}')})"
                )
            out.append(f"| {setting} | " + " | ".join(cells) + " |")
    if precision.get("agreement_skipped"):
        out += ["", f"skipped: {precision['agreement_skipped']}"]
    out += [
        "",
        "Speed against TensorFlow fp32 (in process: the faster thread layout; end to end: `raypipe backfill` "
        "against `raypipe serve` with the setting; auto: what `precision: auto` resolved to):",
        "",
        "| model | setting | in-process ×TF fp32 | in-process para/s | e2e ×TF fp32 | e2e para/s | (d)/(a) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, model in precision.get("models", {}).items():
        resolved = model.get("resolved", {})
        for setting, p in model.get("settings", {}).items():
            shown = f"auto → {resolved.get(setting, '?')}" if setting == "auto:auto" else setting
            out.append(
                f"| {name} | {shown} | {_f(p.get('inproc_speedup'))} | {_f(p.get('inproc_para_per_s'), '{:.1f}')} "
                f"| {_f(p.get('e2e_speedup'))} | {_f(p.get('e2e_para_per_s'), '{:.1f}')} | {_f(p.get('d_over_a'))} |"
            )
        for setting, error in model.get("errors", {}).items():
            out.append(f"| {name} | {setting} | error: {error.splitlines()[0][:80]} | | | | |")
    profiles = [
        (name, setting, p["profile"])
        for name, model in precision.get("models", {}).items()
        for setting, p in model.get("settings", {}).items()
        if isinstance(p.get("profile"), dict) and "shares" in p["profile"]
    ]
    if profiles:
        parts = list(profiles[0][2]["shares"])
        out += [
            "",
            "Where an end-to-end call's time goes (replica's mean timing; proxy/other = client p50 less replica):",
            "",
            "| model | setting | call ms | " + " | ".join(parts) + " |",
            "|---|---|---:|" + "---:|" * len(parts),
        ]
        for name, setting, profile in profiles:
            out.append(
                f"| {name} | {setting} | {profile['call_ms']} | "
                + " | ".join(f"{profile['shares'][k]:.0%}" for k in parts)
                + " |"
            )
    return out


def _pool_table(pool: dict[str, Any]) -> list[str]:
    out = [
        "### The CPU pool (several Ray nodes on this host)",
        "",
        f"{pool['rows']:,} paragraphs per line; pool nodes of {_f(pool['node_cpus'], '{:g}')} CPU, one replica "
        f"each; the jobs' cluster on its own node; {pool['host_cpus']} physical CPUs shared by all. In process, "
        f"the same threads per pass: {_f(pool['inprocess_para_per_s'], '{:.1f}')} para/s, "
        f"{_f(pool['inprocess_cpu_s_per_para'] * 1000, '{:.2f}')} CPU-ms per paragraph.",
        "",
        "| line | nodes | rows/s | retries | every id once | replica CPU-ms/para | × in-process | padded/real tokens "
        "| × in-process per computed token | replicas over time | notes |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for name, line in pool["lines"].items():
        counts = [n for _, n in line.get("replicas_over_time", [])]
        shape = "→".join(str(n) for n, _ in itertools.groupby(counts)) or "–"
        notes = ""
        if "longest_pause_after_kill_s" in line:
            notes = (
                f"pool-1 killed after {line['killed_after_units']} units; longest pause between commits after it "
                f"{_f(line['longest_pause_after_kill_s'])} s (median gap before {_f(line['median_gap_before_kill_s'])}"
                f" s); calls {line['status_counts']}"
            )
        padded = line["padded_tokens"] / line["real_tokens"] if line.get("real_tokens") else None
        once = {True: "yes", False: "**NO**"}.get(line.get("every_id_once"), "–")
        out.append(
            f"| {name} | {line['nodes']} | {_f(line['report_rows_per_s'], '{:.1f}')} | {line['retries']} | {once} | "
            f"{_f(line['replica_cpu_s_per_para'] * 1000)} | {_f(line['replica_cpu_vs_inprocess'])} | "
            f"{_f(padded)} | {_f(line.get('replica_cpu_per_token_vs_inprocess'))} | {shape} | {notes} |"
        )
    out += [
        "",
        f"2 vs 1 pool nodes: **{_f(pool['ratio_2_vs_1_nodes'])}×** rows/s (same run); a node lost mid-run: "
        f"{_f(pool['node_lost_wall_vs_nodes_2'])}× the wall time of the undisturbed 2-node line. In process "
        f"the rows pad to {_f(pool.get('inprocess_padded_per_real'))}× their tokens (all sorted by length at "
        "once); a replica pads each call's length-sorted micro-batch. Replica CPU is every ServeReplica "
        "process's, sampled: on a host whose cores the jobs and Serve's proxies share, contention shows in it.",
        "",
    ]
    return out


def _per_shard(requests: dict[str, int], shards: int) -> str:
    return ", ".join(f"{v / shards:.2f} {k}" for k, v in sorted(requests.items())) or "none"


def _planning(planning: dict[str, Any]) -> list[str]:
    """The planning line: list + plan one shard at a time and in parallel, requests, first commit."""
    shards = planning["shards"]
    out = [
        f"### Planning {shards:,} shards (moto S3)",
        "",
        f"{shards:,} Parquet shards of {planning['rows_per_shard']} rows (id, text, updated_at; "
        f"{planning['input_bytes'] / 2**20:,.1f} MB), uploaded in {planning['upload_s']} s. `list_input` + "
        "`plan_listing`, each in its own process, on the same listing: every footer read (one at a time, "
        "then in parallel), and the defaults (`input.footer_sample` footers read, the other small shards "
        "planned whole from their listed sizes):",
        "",
        "| planning | threads | footers read | files planned whole | list s | plan s | total s | shards/s "
        "| driver CPU s | moto CPU s | driver peak RSS MB | requests per shard (planning) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, run in planning["runs"].items():
        out.append(
            f"| {name} | {run['threads']} | {run.get('footers_read', run['shards']):,} | {run.get('whole_files', 0):,} "
            f"| {run['list_s']} | {run['plan_s']} | **{run['total_s']}** "
            f"| {_f(run['shards'] / run['total_s'] if run['total_s'] else None, '{:.0f}')} | {run['cpu_s']} "
            f"| {run['moto_cpu_s']} | {run['peak_rss_bytes'] / 2**20:,.0f} "
            f"| {_per_shard(run['plan_requests'], shards)} |"
        )
    par = planning["runs"].get("parallel", {})
    out += [
        "",
        f"Parallel over sequential: **{_f(planning.get('speedup'))}×**; the defaults over sequential: "
        f"**{_f(planning.get('speedup_sampled'))}×** (same run, same listing). Listing: "
        f"{_per_shard(par.get('list_requests', {}), 1)} requests in all.",
    ]
    req = planning.get("requests")
    if req:
        out += [
            "",
            f"Requests per footer on {req['sample']:,} shards, one at a time (before: `fs.open` + "
            "`pq.ParquetFile`; now: one suffix-range read of the tail):",
            "",
            "| footer read | s3fs listing cache | requests per shard | ms per shard | driver CPU ms per shard |",
            "|---|---|---|---:|---:|",
        ]
        for key in ("before_warm", "before_cold", "now_warm", "now_cold", "arrow_warm"):
            if key in req:
                name, cache = key.split("_")
                name = {"arrow": "Arrow C++ S3, size from the listing (not used)"}.get(name, name)
                r = req[key]
                calls = ", ".join(f"{v:g} {k}" for k, v in r["per_shard"].items()) or "none"
                out.append(f"| {name} | {cache} | {calls} | {r['ms_per_shard']} | {r.get('cpu_ms_per_shard', '–')} |")
    lat = planning.get("latency")
    if lat:
        out += [
            "",
            f"With {lat['latency_ms']:g} ms added to every request (a proxy), planning the same "
            f"{lat['parallel']['shards']:,} shards: one at a time {lat['sequential']['plan_s']} s, "
            f"{lat['parallel']['threads']} threads {lat['parallel']['plan_s']} s: **{_f(lat.get('speedup'))}×**.",
        ]
    first = planning.get("first_commit")
    if first:
        steps = first.get("steps_s", {})
        out += [
            "",
            f"`raypipe backfill` over the {shards:,} shards (demo model, local Ray cluster), seconds from its "
            f"start: planned at {steps.get('planned', '–')}, pipeline started at {steps.get('pipeline_started', '–')}, "
            f"**first unit committed at {steps.get('first_commit', '–')}**; driver peak RSS "
            f"**{_f(first.get('driver_peak_rss_bytes', 0) / 2**20, '{:,.0f}')} MB** (the driver and its children)."
            + (f" {first['error']}" if first.get("error") else ""),
        ]
    out += [
        "",
        "Goal for 50k shards: planning ≤ 120 s, driver RSS ≤ 1 GiB: "
        f"**{'met' if planning.get('met') else 'NOT met'}**.",
        "",
    ]
    return out
