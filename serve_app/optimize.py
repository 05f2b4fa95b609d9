"""``raypipe model optimize DIR [--sample URI]``: build the compiled runtimes and measure them on the user's text.

1. A sample of the user's corpus (`read_sample`: a Parquet or JSON-lines file, or a glob of them,
   local or ``s3://``; without one, `default_sample`: the check texts and generated demo
   paragraphs) is shuffled with a fixed seed and split into a *calibration* part and a
   *held-out* part (`split_sample`). The held-out texts are never used to build anything.
2. The fp32 OpenVINO IR is written to ``DIR/openvino/`` (`serve_app.compiled.export_ir`).
3. int8: NNCF post-training quantization of that IR with accuracy control
   (`nncf.quantize_with_accuracy_control`), calibrated on the calibration texts, its metric the
   top-label agreement with TensorFlow fp32 on them; NNCF reverts the layers that cost the most
   agreement to fp32 until the drop is within ``1 - threshold`` or it has reverted
   ``int8_max_reverts`` groups. Written as
   ``DIR/openvino/int8.xml`` (+ ``int8.json``: the IR key it was built from, what was reverted).
4. `measure`: every setting this CPU supports (`serve_app.runtimes.supported_settings`) is run
   against TensorFlow fp32 on the held-out texts (speed in interleaved rounds, median and spread:
   `serve_app.timing`; top-label agreement in domain) and on
   the out-of-domain texts the project ships (`serve_app.gate_texts`; agreement out of domain),
   with the largest probability difference of either. A recheck precision (``bf16-recheck``,
   ``bf16-dense-recheck``) is gated at each margin of `serve_app.compiled.RECHECK_MARGINS` (its
   agreement read off its first pass's and fp32's answers, `serve_app.compiled.rechecked`) and
   timed as served at the margins a narrower one does not match (`undominated_margins`). This
   CPU's entry of ``DIR/runtimes.json`` (`serve_app.runtimes.RuntimeRecord`) is replaced;
   ``precision: auto`` and the gate read it, and ``raypipe model check`` prints it. ``raypipe
   model export`` runs `measure` (no int8) on the default sample, so an exported model is served
   at its fastest gated setting from the start; ``optimize --sample`` refines the in-domain
   figure on the user's own text.

TensorFlow bf16 is not measured here: its oneDNN rewrite is process-wide (it would change the
reference run), and OpenVINO bf16 is the faster bf16 path where the CPU has it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from serve_app.model import EmotionModel, Tokenized, configure_tf_threads, cpu_flags, cpu_model_name
from serve_app.runtimes import (
    EQUAL_ANSWER_SETTINGS,
    REFERENCE,
    Measurement,
    RuntimeRecord,
    cpu_key,
    supported_settings,
    write_record,
)
from serve_app.timing import Timing, interleave

__all__ = [
    "OptimizeResult",
    "Sample",
    "build_int8",
    "default_sample",
    "int8_ir",
    "measure",
    "optimize",
    "read_sample",
    "render_table",
    "split_sample",
    "undominated_margins",
]

logger = logging.getLogger(__name__)

_INT8_XML = "int8.xml"
_INT8_META = "int8.json"
_INT8_FORMAT = "raypipe-openvino-int8/1"
#: Most texts read from a sample, and most held out (more only costs time).
DEFAULT_ROWS = 1200
_CALIBRATION_SHARE = 0.3
_MAX_CALIBRATION = 300
_SEED = 19
#: Held-out texts each setting's speed is timed on in each round (`measure`; its agreement uses
#: all of them): five rounds of 200 time as many texts as two of 400 did, and give a median and
#: a spread.
SPEED_TEXTS = 200
_Runner = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: A setting as measured: runtime, precision, and a recheck precision's margin (else None).
_Candidate = tuple[str, str, float | None]
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Sample:
    """Texts to measure on: ``calibration`` builds int8, ``held_out`` decides the gate."""

    source: str
    calibration: tuple[str, ...]
    held_out: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        digest = hashlib.sha256("\0".join((*self.calibration, "\1", *self.held_out)).encode()).hexdigest()
        return {
            "source": self.source,
            "calibration": len(self.calibration),
            "held_out": len(self.held_out),
            "sha256": digest,
        }


def read_sample(uri: str, *, text_column: str = "text", rows: int = DEFAULT_ROWS) -> list[str]:
    """Up to ``rows`` non-empty texts from a Parquet or JSON-lines file or glob, local or ``s3://``
    (S3 through fsspec/s3fs, so the standard AWS environment applies)."""
    import fsspec
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    files = fsspec.open_files(uri, mode="rb")
    if not files:
        raise FileNotFoundError(f"no files match {uri!r}")
    texts: list[str] = []
    for f in sorted(files, key=lambda f: f.path):
        with f as handle:
            if f.path.endswith(".parquet"):
                parquet = pq.ParquetFile(handle)
                names = parquet.schema_arrow.names
                table = parquet.read(columns=[text_column] if text_column in names else names[:1])
            elif f.path.endswith((".json", ".jsonl", ".ndjson")):
                table = pj.read_json(handle)
            else:
                raise ValueError(
                    f"{f.path}: a sample must be Parquet (.parquet) or JSON lines (.json, .jsonl, .ndjson)"
                )
        if text_column not in table.column_names:
            raise ValueError(f"{f.path}: no {text_column!r} column (columns: {', '.join(table.column_names)})")
        texts += [t for t in table.column(text_column).to_pylist() if isinstance(t, str) and t.strip()]
        if len(texts) >= rows:
            break
    if not texts:
        raise ValueError(f"{uri}: no non-empty texts in column {text_column!r}")
    return texts[:rows]


def default_sample(rows: int = DEFAULT_ROWS) -> list[str]:
    """The model check's texts and generated demo paragraphs and sentences (seeds the demo model
    did not train on): a stand-in for a user sample, in the demo's domain."""
    from serve_app import demo_data
    from serve_app.export.check import SAMPLE_TEXTS

    generated = demo_data.paragraphs(rows // 2, seed=1901) + demo_data.sentences(rows // 2, seed=1902)
    return [*SAMPLE_TEXTS, *(t for t, _ in generated)][:rows]


def split_sample(texts: Sequence[str], *, source: str, seed: int = _SEED) -> Sample:
    """Shuffle (fixed seed) and split: ~30% (at most 300) calibration, the rest held out."""
    shuffled = list(texts)
    random.Random(seed).shuffle(shuffled)  # noqa: S311  a seeded split, not a secret
    n_cal = min(_MAX_CALIBRATION, max(1, round(len(shuffled) * _CALIBRATION_SHARE)))
    if len(shuffled) - n_cal < 20:
        raise ValueError(f"a sample needs at least {n_cal + 20} texts to hold 20 out; got {len(shuffled)}")
    return Sample(source, tuple(shuffled[:n_cal]), tuple(shuffled[n_cal:]))


@dataclass(frozen=True)
class OptimizeResult:
    record: RuntimeRecord
    record_path: Path
    int8: dict[str, Any]
    """What the int8 build did (or why it was skipped)."""


def optimize(
    model_dir: Path | str,
    sample: Sample,
    *,
    threshold: float = 0.99,
    threads: int = 2,
    int8: bool = True,
    int8_max_reverts: int = 6,
    flags: frozenset[str] | None = None,
) -> OptimizeResult:
    """Steps 2-4 of the module docstring; returns the record written."""
    from serve_app.compiled import export_ir

    model_dir = Path(model_dir)
    configure_tf_threads(threads, 1)
    model = EmotionModel.load(model_dir)
    calibration = model.tokenize(sample.calibration)
    export_ir(model_dir)
    int8_info: dict[str, Any] = {"skipped": "not asked (--no-int8)"}
    if int8:
        int8_info = build_int8(model_dir, model, calibration, max_drop=1 - threshold, max_reverts=int8_max_reverts)
    record = measure(
        model_dir,
        sample,
        threads=threads,
        int8=int8 and "error" not in int8_info,
        flags=flags,
        model=model,
        note=f"NNCF: {int8_info.get('accuracy_control', '?')}",
    )
    return OptimizeResult(record, write_record(model_dir, record), int8_info)


def measure(
    model_dir: Path | str,
    sample: Sample,
    *,
    threads: int = 2,
    int8: bool = False,
    flags: frozenset[str] | None = None,
    out_of_domain: Sequence[str] | None = None,
    rounds: int = 5,
    model: EmotionModel | None = None,
    note: str = "",
    only: Collection[tuple[str, str]] | None = None,
) -> RuntimeRecord:
    """Every setting this CPU supports against TensorFlow fp32: speed on the held-out texts,
    top-label agreement on them (in domain) and on `serve_app.gate_texts` (out of domain).

    Writes the fp32 IR (``DIR/openvino/``) if it is missing; measures int8 only when asked (its
    build is `build_int8`'s), and only the settings in ``only`` when given (TensorFlow fp32, the
    reference, always). Returns this CPU's record; the caller writes it (`write_record`).
    """
    import tensorflow as tf  # already imported by the model; for its version

    from serve_app.compiled import (
        RECHECK_BASES,
        RECHECK_MARGINS,
        RecheckRunner,
        export_ir,
        load_openvino_runner,
        openvino_version,
        rechecked,
        saved_model_digest,
    )
    from serve_app.gate_texts import out_of_domain as shipped

    model_dir = Path(model_dir)
    flags = cpu_flags() if flags is None else flags
    if model is None:
        configure_tf_threads(threads, 1)
        model = EmotionModel.load(model_dir)
    n_labels = len(model.card.labels)
    export_ir(model_dir)
    held = model.tokenize(sample.held_out)
    outside_texts = list(shipped() if out_of_domain is None else out_of_domain)
    outside = model.tokenize(outside_texts)
    wanted = [REFERENCE]
    for runtime, precision in supported_settings(flags, openvino=True):
        if runtime != "openvino" or (precision == "int8" and not int8):
            continue
        if only is None or (runtime, precision) in only:
            wanted.append((runtime, precision))
    # A recheck precision is not compiled on its own: each margin of the ladder is a `RecheckRunner`
    # over the models of its first pass and of fp32 (what `load_openvino_runner` builds for it).
    rechecks = [p for _, p in wanted if p in RECHECK_BASES]
    sources = [s for s in wanted if s[1] not in RECHECK_BASES]
    for p in rechecks:
        sources += [s for s in (("openvino", RECHECK_BASES[p]), ("openvino", "fp32")) if s not in sources]
    runners: dict[tuple[str, str], _Runner] = {REFERENCE: model._run}
    for runtime, precision in sources[1:]:
        runners[runtime, precision] = load_openvino_runner(
            model_dir, n_labels=n_labels, precision=precision, threads=threads, flags=flags
        )
    # Agreement first: on all held-out texts and the out-of-domain texts, once per compiled model.
    # A recheck margin's answers are its first pass's and fp32's row by row
    # (`serve_app.compiled.rechecked`), so every margin of the ladder is gated at no cost.
    inside_answers = {s: p for s, (p, _) in _measure_all(model, runners, held).items()}
    outside_answers = {s: p for s, (p, _) in _measure_all(model, runners, outside).items()}
    reference, reference_out = inside_answers[REFERENCE], outside_answers[REFERENCE]

    def answers(found: dict[tuple[str, str], np.ndarray], candidate: _Candidate) -> np.ndarray:
        runtime, precision, margin = candidate
        if margin is None:
            return found[runtime, precision]
        return rechecked(found["openvino", RECHECK_BASES[precision]], found["openvino", "fp32"], margin)

    def agreement(candidate: _Candidate) -> tuple[float, float, float]:
        inside, beyond = answers(inside_answers, candidate), answers(outside_answers, candidate)
        return (
            float((inside.argmax(axis=1) == reference.argmax(axis=1)).mean()),
            float((beyond.argmax(axis=1) == reference_out.argmax(axis=1)).mean()),
            max(float(np.abs(inside - reference).max()), float(np.abs(beyond - reference_out).max())),
        )

    figures: dict[_Candidate, tuple[float, float, float]] = {
        (*s, None): agreement((*s, None)) for s in wanted if s in runners
    }
    for p in rechecks:
        ladder = {m: agreement(("openvino", p, m)) for m in RECHECK_MARGINS}
        figures |= {("openvino", p, m): ladder[m] for m in undominated_margins({m: f[:2] for m, f in ladder.items()})}
    # Speed: every candidate kept (each recheck margin as served) in `rounds` interleaved rounds on
    # the first `SPEED_TEXTS` held-out texts (shuffled).
    candidates: dict[_Candidate, _Runner] = {}
    for c in figures:
        runtime, precision, margin = c
        if margin is None:
            candidates[c] = runners[runtime, precision]
        else:
            fast, exact = runners["openvino", RECHECK_BASES[precision]], runners["openvino", "fp32"]
            candidates[c] = RecheckRunner(fast, exact, margin=margin, precision=precision)
    first = Tokenized(ids=held.ids[:SPEED_TEXTS], truncated=held.truncated[:SPEED_TEXTS])
    timings = {c: timing for c, (_, timing) in _measure_all(model, candidates, first, rounds=rounds).items()}
    reference_rate = timings[(*REFERENCE, None)].median
    measurements = []
    for candidate, timing in timings.items():
        runtime, precision, margin = candidate
        inside, outside_agreement, dp = figures[candidate]
        measurements.append(
            Measurement(
                runtime,
                precision,
                para_per_s=timing.median,
                agreement=min(inside, outside_agreement),
                max_abs_dp=dp,
                speedup=timing.median / reference_rate,
                note=note if precision == "int8" else "",
                agreement_in=inside,
                agreement_out=outside_agreement,
                n_in=len(held),
                n_out=len(outside),
                spread=timing.spread,
                rounds=timing.rounds,
                margin=margin,
            )
        )
    return RuntimeRecord(
        saved_model=saved_model_digest(model_dir / "saved_model"),
        measurements=tuple(measurements),
        cpu_flags=cpu_key(flags),
        sample={**sample.describe(), "out_of_domain": len(outside_texts)},
        versions={"openvino": openvino_version(), "tensorflow": tf.__version__, **_nncf_version()},
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        cpu=cpu_model_name(),
    )


def undominated_margins(figures: Mapping[float, tuple[float, float]]) -> list[float]:
    """The margins of a recheck ladder worth timing, narrowest first: ``figures`` maps each margin
    to its agreement (in domain, out of domain). A wider margin answers a superset of a narrower
    one's rows again in fp32, so it is slower; where a narrower margin agrees at least as well on
    both halves, the gate can never prefer the wider one, and it is not timed (nor recorded)."""
    kept: list[float] = []
    for margin in sorted(figures):
        if not any(all(a >= b for a, b in zip(figures[k], figures[margin], strict=True)) for k in kept):
            kept.append(margin)
    return kept


def build_int8(
    model_dir: Path, model: EmotionModel, calibration: Tokenized, *, max_drop: float, max_reverts: int = 6
) -> dict[str, Any]:
    """Quantize ``DIR/openvino/model.xml`` with NNCF's accuracy control; write ``DIR/openvino/int8.xml``.

    ``model`` is the TensorFlow reference (its ``_run``), loaded from the directory to build.
    The calibration texts serve both as NNCF's calibration set and as its validation set (the
    gate is decided on other, held-out texts). NNCF stops after ``max_reverts`` iterations
    (each reverts one more group of ops to fp32, then ranks the rest again: ~2 min each on 2
    cores for MiniLM; NNCF's own default is unbounded, and past a handful of reverts int8 has
    lost its speed-up anyway) even when ``max_drop`` is not reached. That build is still
    written; the gate reads its held-out agreement and keeps it from being served.
    Returns what was done, or ``{"error": ...}`` when NNCF fails outright.
    """
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    from serve_app.compiled import OPENVINO_DIR, ir_key

    directory = model_dir / OPENVINO_DIR
    chunks = _recorded_chunks(model, calibration)
    # Each validation item carries the reference's top labels, so the metric is agreement.
    items = [(inputs, model._run(inputs["input_ids"], inputs["attention_mask"]).argmax(axis=1)) for inputs in chunks]

    def agreement(compiled: Any, data: Any) -> float:
        output = compiled.output("probabilities")
        same = total = 0
        for inputs, top in data:
            got = np.asarray(compiled(inputs)[output]).argmax(axis=1)
            same += int((got == top).sum())
            total += len(top)
        return same / total

    started = time.monotonic()
    core = ov.Core()
    fp32 = core.read_model(str(directory / "model.xml"))
    outcome = _NncfOutcome()
    logging.getLogger("nncf").addHandler(outcome)
    try:
        quantized = nncf.quantize_with_accuracy_control(
            fp32,
            calibration_dataset=nncf.Dataset(items, lambda item: item[0]),
            validation_dataset=nncf.Dataset(items),
            validation_fn=agreement,
            max_drop=max_drop,
            drop_type=nncf.DropType.ABSOLUTE,
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(items),
            advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(max_num_iterations=max_reverts),
        )
    except (RuntimeError, ValueError) as e:  # NNCF's own failures (no quantizable op, bad data)
        logger.warning("int8: NNCF could not build a model within the agreement drop: %s", e)
        return {"error": str(e), "seconds": time.monotonic() - started}
    finally:
        logging.getLogger("nncf").removeHandler(outcome)
    ov.save_model(quantized, str(directory / _INT8_XML), compress_to_fp16=False)
    info = {
        "format": _INT8_FORMAT,
        "key": ir_key(model_dir / "saved_model"),
        "calibration_texts": len(calibration),
        "max_drop": max_drop,
        "accuracy_control": outcome.summary(),
        "seconds": round(time.monotonic() - started, 1),
    }
    (directory / _INT8_META).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def int8_ir(model_dir: Path) -> Path:
    """``DIR/openvino/int8.xml`` when it was built from the current SavedModel and OpenVINO; else raise."""
    from serve_app.compiled import OPENVINO_DIR, OpenVinoError, ir_key

    directory = model_dir / OPENVINO_DIR
    try:
        meta = json.loads((directory / _INT8_META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OpenVinoError(directory, f"no int8 build ({e}): run `raypipe model optimize {model_dir}`") from e
    if meta.get("format") != _INT8_FORMAT or meta.get("key") != ir_key(model_dir / "saved_model"):
        raise OpenVinoError(
            directory / _INT8_META, f"the int8 build is stale: run `raypipe model optimize {model_dir}`"
        )
    return directory / _INT8_XML


def render_table(record: RuntimeRecord, *, threshold: float) -> str:
    """The record as a table, one line per setting, marking those the gate refuses."""
    lines = [
        f"measured {record.measured_at or '?'} on {record.cpu or 'a CPU with ' + ' '.join(record.cpu_flags)}: "
        f"{record.sample.get('held_out', '?')} held-out texts in domain ({record.sample.get('source', '?')}), "
        f"{record.sample.get('out_of_domain', 'no')} out of domain; gate {threshold:.0%} on the worse of the two",
        "runtime     precision                para/s   ± spread  speed-up  in domain  out of domain  max |dp|"
        "  at least  gate",
    ]
    for m in record.measurements:
        inside = "-" if m.agreement_in is None else f"{m.agreement_in:.2%}"
        outside = "-" if m.agreement_out is None else f"{m.agreement_out:.2%}"
        bound = "-" if m.setting in EQUAL_ANSWER_SETTINGS else f"{m.gate_figure:.2%}"
        spread = f"{m.spread / m.para_per_s:.1%}" if m.rounds and m.para_per_s else "-"
        precision = m.precision if m.margin is None else f"{m.precision} {m.margin:g}"
        lines.append(
            f"{m.runtime:<11} {precision:<23} {m.para_per_s:>7.1f}  {spread:>8}  {m.speedup:>7.2f}x  "
            f"{inside:>9}  {outside:>13}  {m.max_abs_dp:>8.4f}  {bound:>8}  {'pass' if m.passes(threshold) else 'FAIL'}"
            f"{'  ' + m.note if m.note else ''}"
        )
    if any(m.margin is not None for m in record.measurements):
        lines.append(
            "bf16-recheck m, bf16-dense-recheck m: rows whose first pass's top two probabilities are closer"
            " than m are answered again in fp32"
        )
    lines.append(
        "para/s: the median of interleaved rounds; ± spread: every round lay within it (a setting is"
        " faster than another only beyond both spreads)"
    )
    lines.append(
        "at least: the worse of the two agreements' lower bounds at 95% confidence, what the gate compares"
        " for a setting that changes answers (fp32 settings give the reference's answers)"
    )
    return "\n".join(lines)


# -- internals ------------------------------------------------------------------------------


def _measure_all(
    model: EmotionModel,
    runners: Mapping[K, _Runner],
    tokenized: Tokenized,
    *,
    rounds: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, tuple[np.ndarray, Timing]]:
    """Probabilities of the tokenized texts through each runner, and its speed over ``rounds``
    interleaved rounds (`serve_app.timing.interleave`: A B, B A, ...; median and spread), so load
    from elsewhere slows the settings alike instead of deciding between them."""
    original = model._run
    probabilities: dict[K, np.ndarray] = {}

    def through(setting: K, run: _Runner) -> Callable[[], None]:
        def call() -> None:
            model._run = run
            probabilities[setting] = model.infer(tokenized).probabilities

        return call

    try:
        for run in runners.values():
            model._run = run
            model.warmup()
        seconds = interleave({s: through(s, run) for s, run in runners.items()}, rounds=rounds, clock=clock)
    finally:
        model._run = original
    return {s: (probabilities[s], Timing.of(len(tokenized), seconds[s])) for s in runners}


def _recorded_chunks(model: EmotionModel, tokenized: Tokenized) -> list[dict[str, np.ndarray]]:
    """The (input_ids, attention_mask) chunks `EmotionModel.infer` runs for these texts."""
    chunks: list[dict[str, np.ndarray]] = []
    original = model._run

    def record(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        chunks.append({"input_ids": input_ids, "attention_mask": attention_mask})
        return np.zeros((len(input_ids), len(model.card.labels)), dtype=np.float32)

    model._run = record
    try:
        model.infer(tokenized)
    finally:
        model._run = original
    return chunks


class _NncfOutcome(logging.Handler):
    """What NNCF's accuracy control did, read from its log: it returns only the model, and
    says only there how many ops it reverted and whether the drop was reached."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.reverted = 0
        self.reached = True

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        match = re.match(r"Reverted (\d+) operations", message)
        if match:
            self.reverted += int(match.group(1))
        elif "could not achieve the required accuracy drop" in message:
            self.reached = False

    def summary(self) -> str:
        return f"{self.reverted} ops reverted to fp32, drop {'reached' if self.reached else 'not reached'}"


def _nncf_version() -> dict[str, str]:
    try:
        import nncf
    except ImportError:
        return {}
    return {"nncf": str(nncf.__version__)}
