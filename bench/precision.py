"""The precisions between OpenVINO fp32 and bf16, on every model the bench knows, through the gate.

    python -m bench.precision [--models real-weights-minilm,trained-bert-base] [--rounds 5] [--lock FILE]
                              [--int8-max-reverts 3 | --no-int8] [--out FILE]

For each model, every OpenVINO precision this CPU supports (`serve_app.runtimes.supported_settings`:
``bf16`` and the candidates between it and fp32, `serve_app.compiled.BF16_PRECISIONS`, need native
bf16; ``bf16-recheck`` once per margin of `serve_app.compiled.RECHECK_MARGINS`, a row ``bf16-recheck
m<margin>`` each, as the gate measures it) and int8. The int8 build is the one ``raypipe model
optimize`` makes (`ensure_int8`: the fp32 IR, then `serve_app.optimize.build_int8` calibrated on
the default sample's calibration texts, at most ``--int8-max-reverts`` accuracy-control reverts);
a current build is reused, a missing or stale one is built first (minutes), ``--no-int8`` leaves
it out:

1. **Agreement** of the top label with TensorFlow fp32, in domain (the held-out part of
   `serve_app.optimize.default_sample`, what ``raypipe model export`` measures: 900 texts) and out
   of domain (the gate's shipped texts, `serve_app.gate_texts.out_of_domain`: 1,000), the texts
   the gate itself measures on, each with its one-sided 95% lower bound, and the gate's verdict:
   the same `serve_app.runtimes.Measurement.passes` a replica's choice calls (the worse lower
   bound at least 99%). A recheck margin's answers are read off the bf16 and fp32 answers
   (`serve_app.compiled.rechecked`, as `serve_app.optimize.measure` does).
2. **Speed in process against OpenVINO fp32**, on the same texts and threads: each round runs
   fp32, a candidate, fp32, the next candidate, ..., fp32; a candidate's ratio in a round is the
   mean of the fp32 runs either side of it over its own time, so load from other processes moves
   both sides of the ratio alike. The median over rounds is the figure, the lowest and highest
   its spread. Each recheck margin is timed as served (a `serve_app.compiled.RecheckRunner`).
3. **What the gate serves**: the fastest candidate that passes it.

Agreement and speed are two holds of ``--lock`` (each under ten minutes for bert-base's shape on
two cores), so a shared machine's queue moves between them; an int8 build is a hold of its own.

The real-weights MiniLM (`bench.models.ensure_real_weights_model`: pretrained MiniLM-L6 with a
trained emotion head) and trained-bert-base (`bench.models.ensure_trained_model`: bert-base's
shape trained here, not the published checkpoint) are models whose agreement means something;
bert-base is the bench's random-weights model of bert-base's shape (`bench.models.SHAPES`): its
speed is bert-base's, its agreement that of a model which predicts nothing in particular. Results go to
``bench/results/precision-<UTC stamp>.json`` (and ``.md``); `render` turns the newest into the
block of docs/performance.md that ``python -m bench.docs`` writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "ensure_int8", "measure_model", "newest", "render", "rewrite_docs"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN = (
    "<!-- precision candidates: `python -m bench.precision` measures, `python -m bench.docs` writes them"
    " from bench/results; edits are overwritten -->"
)
END = "<!-- end of precision candidates -->"
#: Held-out texts each round times (the speed is per paragraph; agreement uses every text).
SPEED_TEXTS = {"real-weights-minilm": 400, "bert-base": 120, "trained-bert-base": 120}
#: At most this many texts in and out of domain for agreement (bert-base's random weights make its
#: agreement a sanity check, not a figure the gate would decide on; its speed costs the time).
#: The trained bert-base is measured on all of the gate's texts: on 300, a 99.0% point figure has
#: a lower bound of 97.5%, and even a flawless one only 99.1%.
AGREEMENT_TEXTS = {"bert-base": 300}
MIN_AGREEMENT = 0.99


def ensure_int8(model_dir: Path, model: Any, calibration: Any, *, max_reverts: int) -> str:
    """What the current int8 build of ``model_dir`` did, building it first when it is missing or
    stale, the way ``raypipe model optimize`` does (fp32 IR, then `build_int8` with the gate's
    drop); "" with the reason when NNCF could not build one."""
    from serve_app.compiled import OPENVINO_DIR, OpenVinoError, export_ir
    from serve_app.optimize import build_int8, int8_ir

    try:
        int8_ir(model_dir)
    except OpenVinoError:
        export_ir(model_dir)
        info = build_int8(model_dir, model, calibration, max_drop=1 - MIN_AGREEMENT, max_reverts=max_reverts)
        if "error" in info:
            return f"not measured: NNCF could not build it: {info['error']}"
    meta = json.loads((model_dir / OPENVINO_DIR / "int8.json").read_text(encoding="utf-8"))
    return f"NNCF accuracy control: {meta.get('accuracy_control', '?')} (built in {meta.get('seconds', '?')} s)"


def _agree(answers: Any, reference: Any) -> float:
    """Top-label agreement of ``answers`` with ``reference`` (probabilities, a row per text)."""
    return float((answers.argmax(1) == reference.argmax(1)).mean())


def measure_model(
    label: str, model_dir: Path, *, threads: int, rounds: int, int8_max_reverts: int | None, lock: str | None
) -> dict[str, Any]:
    """Steps 1-3 of the module docstring for one model directory."""
    import numpy as np

    from bench.cluster import heavy_lock
    from serve_app.compiled import RECHECK_BASES, RECHECK_MARGINS, RecheckRunner, load_openvino_runner, rechecked
    from serve_app.gate_texts import out_of_domain
    from serve_app.model import EmotionModel, Tokenized, cpu_flags
    from serve_app.optimize import default_sample, int8_ir, split_sample, undominated_margins
    from serve_app.runtimes import Measurement, agreement_lower_bound, supported_settings

    flags = cpu_flags()
    model = EmotionModel.load(model_dir)
    n_labels = len(model.card.labels)
    sample = split_sample(default_sample(), source="default sample")
    cap = AGREEMENT_TEXTS.get(label)
    held = model.tokenize(sample.held_out[:cap])
    outside = model.tokenize(out_of_domain()[:cap])
    supported = [p for r, p in supported_settings(flags, openvino=True) if r == "openvino" and p != "int8"]
    # A recheck precision is a RecheckRunner over its first pass's and fp32's models, once per
    # margin of the ladder (those a narrower margin matches are left out, as `measure` does).
    precisions = [p for p in supported if p not in RECHECK_BASES]
    rechecks = [p for p in supported if p in RECHECK_BASES]
    if int8_max_reverts is None:
        int8_note = "not measured (--no-int8)"
    else:
        with heavy_lock(lock):
            int8_note = ensure_int8(model_dir, model, model.tokenize(sample.calibration), max_reverts=int8_max_reverts)
        try:
            int8_ir(model_dir)
            precisions.append("int8")
        except Exception as e:  # no (current) int8 build: the table says why
            int8_note = f"not measured: {e}"
    runners: dict[str, Any] = {
        p: load_openvino_runner(model_dir, n_labels=n_labels, precision=p, threads=threads, flags=flags)
        for p in precisions
    }
    tensorflow = model._run
    # 1. Agreement with TensorFlow fp32 (the model as loaded), one hold of the lock.
    answers: dict[str, tuple[Any, Any]] = {}
    with heavy_lock(lock):
        reference_in = model.infer(held).probabilities
        reference_out = model.infer(outside).probabilities
        for precision, run in runners.items():
            model._run = run
            answers[precision] = (model.infer(held).probabilities, model.infer(outside).probabilities)
        model._run = tensorflow
    margins: dict[str, tuple[str, float]] = {}
    for recheck in rechecks:
        (fast_in, fast_out), (exact_in, exact_out) = answers[RECHECK_BASES[recheck]], answers["fp32"]
        ladder = {x: (rechecked(fast_in, exact_in, x), rechecked(fast_out, exact_out, x)) for x in RECHECK_MARGINS}
        figures_of = {x: (_agree(i, reference_in), _agree(o, reference_out)) for x, (i, o) in ladder.items()}
        for kept in undominated_margins(figures_of):
            margins[f"{recheck} m{kept:g}"] = (recheck, kept)
            answers[f"{recheck} m{kept:g}"] = ladder[kept]
    figures: dict[str, dict[str, Any]] = {}
    for precision, (inside, beyond) in answers.items():
        a_in = float((inside.argmax(1) == reference_in.argmax(1)).mean())
        a_out = float((beyond.argmax(1) == reference_out.argmax(1)).mean())
        m = Measurement(
            "openvino",
            precision.split()[0],
            para_per_s=0.0,
            agreement=min(a_in, a_out),
            max_abs_dp=0.0,
            agreement_in=a_in,
            agreement_out=a_out,
            n_in=len(held),
            n_out=len(outside),
            margin=margins[precision][1] if precision in margins else None,
        )
        figures[precision] = {
            "agreement_in": a_in,
            "agreement_out": a_out,
            "lower_bound_in": agreement_lower_bound(a_in, len(held)),
            "lower_bound_out": agreement_lower_bound(a_out, len(outside)),
            "max_abs_dp": max(float(np.abs(inside - reference_in).max()), float(np.abs(beyond - reference_out).max())),
            "gate": m.passes(MIN_AGREEMENT),
        }
    # 2. Speed against OpenVINO fp32, interleaved (each recheck margin as served), another hold.
    for name, (recheck, margin) in margins.items():
        fast = runners[RECHECK_BASES[recheck]]
        runners[name] = RecheckRunner(fast, runners["fp32"], margin=margin, precision=recheck)
    n = min(SPEED_TEXTS.get(label, 200), len(held))
    timed = Tokenized(ids=held.ids[:n], truncated=held.truncated[:n])

    def seconds(precision: str) -> float:
        model._run = runners[precision]
        started = time.perf_counter()
        model.infer(timed)
        return time.perf_counter() - started

    with heavy_lock(lock):
        for run in runners.values():
            model._run = run
            model.warmup()
        others = [p for p in runners if p != "fp32"]
        ratios: dict[str, list[float]] = {p: [] for p in others}
        fp32_rates: list[float] = []
        for _ in range(rounds):
            before = seconds("fp32")
            fp32_rates.append(n / before)
            for precision in others:
                own = seconds(precision)
                after = seconds("fp32")
                ratios[precision].append((before + after) / 2 / own)
                before = after
        model._run = tensorflow
    fp32_rate = statistics.median(fp32_rates)
    figures["fp32"].update(speedup=1.0, spread=[1.0, 1.0], para_per_s=fp32_rate)
    for precision, values in ratios.items():
        median = statistics.median(values)
        figures[precision].update(speedup=median, spread=[min(values), max(values)], para_per_s=fp32_rate * median)
    texts = {"in_domain": len(held), "out_of_domain": len(outside), "timed": n, "rounds": rounds}
    return {
        "model_dir": str(model_dir),
        "model": model.card.version,
        "max_sequence_length": model.card.max_sequence_length,
        "shape": _shape(model_dir),
        "texts": texts,
        "precisions": figures,
        "int8": int8_note,
        "served": served(figures, texts),
    }


def served(figures: dict[str, dict[str, Any]], texts: dict[str, int]) -> str:
    """What a replica with ``precision: auto`` serves of these figures, by its own rule
    (`serve_app.runtimes.fastest`): of the settings that pass the gate, one no other is faster
    than beyond the spread (each speed-up's lowest-highest over the rounds), and among those
    that tie, fp32, else the highest gate figure."""
    from serve_app.runtimes import Measurement, fastest

    passing = []
    for name, f in figures.items():
        if not f["gate"]:
            continue
        precision, _, margin = name.partition(" m")
        low, high = f["spread"]
        passing.append(
            Measurement(
                "openvino",
                precision,
                para_per_s=f["speedup"],
                agreement=min(f["agreement_in"], f["agreement_out"]),
                max_abs_dp=f["max_abs_dp"],
                agreement_in=f["agreement_in"],
                agreement_out=f["agreement_out"],
                n_in=texts["in_domain"],
                n_out=texts["out_of_domain"],
                spread=max(f["speedup"] - low, high - f["speedup"]),
                rounds=texts["rounds"],
                margin=float(margin) if margin else None,
            )
        )
    best = fastest(passing)
    return best.precision if best.margin is None else f"{best.precision} m{best.margin:g}"


def trained_note(card: dict[str, Any]) -> str:
    """What a trained bench model is, in words: bert-base's shape trained here, with its quality."""
    q = card.get("trained", {})
    return (
        f"{card.get('note', 'trained here')}. Accuracy against the generator's labels on"
        f" {q.get('in_domain_texts', '?')} held-out in-domain texts: {q.get('in_domain_accuracy', 0):.1%} (chance"
        f" {1 / len(card['labels']):.1%}); median top-label margin (top probability less the second)"
        f" {q.get('median_margin_in', 0):.3f} in domain, {q.get('median_margin_out', 0):.3f} out of domain."
    )


def _shape(model_dir: Path) -> str:
    config = json.loads((model_dir / "model.json").read_text(encoding="utf-8"))
    parameters = config.get("parameters")
    size = f", {parameters / 1e6:.1f}M parameters" if parameters else ""
    return f"{config.get('version', '?')}{size}"


def newest(results_dir: Path = RESULTS) -> tuple[Path, dict[str, Any]] | None:
    """The newest ``precision-*.json`` and its content, or None."""
    files = sorted(results_dir.glob("precision-*.json"))
    if not files:
        return None
    return files[-1], json.loads(files[-1].read_text(encoding="utf-8"))


def render(results: dict[str, Any], *, file: str) -> list[str]:
    """The results as markdown lines: CPU, then one table per model."""
    lines = [
        f"Run started {results['started_at']} on an {results['cpu']} ({results['cores']} cores, {results['threads']}"
        f" threads), CPU flags {' '.join(results['cpu_flags'])}; OpenVINO {results['versions'].get('openvino', '?')}."
        f" Results file: `{file}`. Speed-up: in process, against OpenVINO fp32 in the same rounds (median,"
        " lowest-highest); agreement: top label against TensorFlow fp32, with its 95% lower bound; the gate"
        f" passes a setting whose worse lower bound is at least {MIN_AGREEMENT:.0%}.",
        "",
    ]
    for label, entry in results["models"].items():
        texts = entry["texts"]
        lines += [
            f"**{label}** ({entry['shape']}, max {entry['max_sequence_length']} tokens; {texts['in_domain']} texts in"
            f" domain, {texts['out_of_domain']} out of domain, {texts['timed']} timed x {texts['rounds']} rounds):"
            f" the gate serves **{served(entry['precisions'], texts)}**.",
            "",
            "| precision | speed-up vs OpenVINO fp32 | para/s | in domain (at least) | out of domain (at least)"
            " | max abs dp | gate |",
            "|---|---|---|---|---|---|---|",
        ]
        for precision, f in entry["precisions"].items():
            low, high = f["spread"]
            lines.append(
                f"| {precision} | {f['speedup']:.2f}x ({low:.2f}-{high:.2f}) | {f['para_per_s']:.1f} |"
                f" {f['agreement_in']:.2%} ({f['lower_bound_in']:.2%}) | {f['agreement_out']:.2%}"
                f" ({f['lower_bound_out']:.2%}) | {f['max_abs_dp']:.4f} | {'pass' if f['gate'] else 'refused'} |"
            )
        if entry.get("int8"):
            lines.append(f"\nint8: {entry['int8']}")
        if entry.get("note"):
            lines.append(f"\n{entry['note']}")
        lines.append("")
    return lines


def rewrite_docs(text: str, results_dir: Path = RESULTS) -> str:
    """``text`` (docs/performance.md) with its precision block rendered from the newest results of each model."""
    found = newest(results_dir)
    if found is None or BEGIN not in text:
        return text
    lines = text.split("\n")
    begin, end = lines.index(BEGIN), lines.index(END)
    # The newest file, then each older one for the models no newer file measured (a run of one
    # model leaves the others' figures standing), each under its own CPU line and file name.
    block: list[str] = []
    seen: set[str] = set()
    for path in sorted(results_dir.glob("precision-*.json"), reverse=True):
        results = json.loads(path.read_text(encoding="utf-8"))
        models = {k: v for k, v in results.get("models", {}).items() if k not in seen}
        if models:
            seen |= set(models)
            block += render(
                {**results, "models": models}, file=str(path.with_suffix(".md").relative_to(results_dir.parent.parent))
            )
    return "\n".join([*lines[: begin + 1], *block, *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="real-weights-minilm,trained-bert-base")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lock", default=None, help="flock this file while measuring (shared machines)")
    p.add_argument(
        "--int8-max-reverts",
        type=int,
        default=3,
        help="when int8 is missing or stale, build it with at most this many accuracy-control reverts (minutes each)",
    )
    p.add_argument("--no-int8", action="store_true", help="leave int8 out")
    p.add_argument("--models-cache", default=".cache/bench-models")
    p.add_argument("--out", type=Path, default=None, help="results file (default: a new one in bench/results)")
    args = p.parse_args(argv)

    import openvino

    from serve_app.model import configure_tf_threads, cpu_flags, cpu_model_name

    configure_tf_threads(args.threads, 1)
    cache = Path(args.models_cache)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"precision-{stamp}.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {"models": {}}
    results.update(
        started_at=results.get("started_at") or datetime.now(UTC).isoformat(timespec="seconds"),
        cpu=cpu_model_name(),
        cpu_flags=sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        cores=len(os.sched_getaffinity(0)),
        threads=args.threads,
        versions={"openvino": openvino.__version__},
    )
    if not results["models"]:
        results["started_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    _run(args, results, out, cache)
    print(out)
    return 0


def _run(args: argparse.Namespace, results: dict[str, Any], out: Path, cache: Path) -> None:
    from bench.models import SHAPES, ensure_model, ensure_real_weights_model, ensure_trained_model
    from serve_app.demo_model import build_demo_model, default_demo_model_dir

    for label in args.models.split(","):
        if label == "real-weights-minilm":
            model_dir = ensure_real_weights_model(cache=cache)
            if model_dir is None:
                print("bench: no real-weights MiniLM (its weights package is not installed)", file=sys.stderr)
                continue
        elif label == "trained-bert-base":
            demo = build_demo_model(default_demo_model_dir())
            model_dir = ensure_trained_model(SHAPES["bert-base"], demo_model_dir=demo, cache=cache)
        else:
            model_dir = ensure_model(
                SHAPES[label], demo_model_dir=build_demo_model(default_demo_model_dir()), cache=cache
            )
        print(f"bench: precision {label}", flush=True)
        reverts = None if args.no_int8 else args.int8_max_reverts
        entry = measure_model(
            label, model_dir, threads=args.threads, rounds=args.rounds, int8_max_reverts=reverts, lock=args.lock
        )
        if label == "trained-bert-base":
            entry["note"] = trained_note(json.loads((model_dir / "model.json").read_text(encoding="utf-8")))
        if label == "bert-base":
            entry["note"] = (
                "Random weights of bert-base's shape: the speed is bert-base's, the agreement is not a trained model's."
            )
        results["models"][label] = entry
        out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        out.with_suffix(".md").write_text(
            "\n".join(render(results, file=str(out.with_suffix(".md").relative_to(ROOT)))) + "\n", encoding="utf-8"
        )


if __name__ == "__main__":
    sys.exit(main())
