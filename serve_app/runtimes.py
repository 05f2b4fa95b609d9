"""Which runtime and precision a replica serves: the measured record, and the gate.

A *setting* is a runtime x precision: TensorFlow fp32 (the reference: export, ``raypipe model
check`` and every agreement are measured against it), TensorFlow bf16 (oneDNN auto mixed
precision), OpenVINO fp32 / bf16 / int8 (`serve_app.compiled`; int8 is the NNCF-quantized IR of
`serve_app.optimize`), and OpenVINO's candidates between fp32 and bf16 where the CPU has native
bf16 (``bf16-dense``, ``bf16-ffn`` and the recheck ones: `serve_app.compiled.BF16_PRECISIONS`).
Measuring a setting (`serve_app.optimize.measure`, run by ``raypipe model
export`` on its check texts and by ``raypipe model optimize DIR --sample URI`` on the user's)
gives its speed on this CPU, its top-label agreement with TensorFlow fp32 on two sets of texts,
*in domain* (the user's sample, or the check texts) and *out of domain* (`serve_app.gate_texts`,
prose the project ships), and its largest probability difference. ``DIR/runtimes.json`` holds
one `RuntimeRecord` per CPU that measured (keyed by its kernel flags): a pool of mixed CPUs
keeps one entry for each, and every replica reads its own CPU's.

`choose` turns the server settings (``runtime``, ``precision``, ``min_agreement``,
``force_precision``), this CPU's record and its flags into the one `Serving` a replica loads.
The defaults are ``runtime: auto``, ``precision: auto``: fast by default, never different
unmeasured.

- ``precision: auto`` serves the fastest setting of this CPU's record that passes the gate.
  *Fastest* is beyond the noise: each setting's speed is the median of interleaved rounds with
  its spread (`serve_app.timing`), and a setting is faster than another only when their ranges
  do not overlap. Among settings that tie that way the replica keeps the default: an
  equal-answer setting (in `EQUAL_ANSWER_SETTINGS` order), else the one whose gate figure is
  highest (`fastest`). A measurement a busy machine made noisy therefore keeps the reference's
  answers rather than whichever setting was lucky. Margins of one recheck precision are not
  raced: the narrowest passing one reruns the fewest rows, so it is the one compared. **The
  gate**: a setting that changes answers (bf16, int8) must have both agreements measured, and
  passes when the worse of their *lower confidence bounds* (`agreement_lower_bound`: one sided,
  95%, from the figure and how many texts it was measured on) is at least ``min_agreement``. A
  point figure at the threshold is not evidence the setting reaches it: a setting that agrees on
  990 of 1,000 texts would agree on fewer than 99% of the next 1,000 about half the time. An
  equal-answer setting passes on its figure. With no record for this CPU (or one made for other
  SavedModel files) the replica serves the fastest *equal-answer* setting, OpenVINO fp32 where
  OpenVINO is installed (its probabilities are TensorFlow's within 1e-4: float sums in another
  order), else TensorFlow fp32: nothing that changes answers is picked unmeasured.
- A recheck precision (``bf16-recheck``, ``bf16-dense-recheck``: `serve_app.compiled.RECHECK_BASES`)
  is measured at each margin of a ladder (`serve_app.compiled.RECHECK_MARGINS`), each its own
  `Measurement` (``margin``): the gate and the speed rule treat every margin as a candidate of
  its own, so the replica serves the narrowest (fastest) margin that passes, and
  `Serving.margin` says which.
- An explicit precision is served if the CPU supports it, unless the record says it fails the
  gate: then the replica refuses to start (`GateError`) unless ``force_precision``. int8 exists
  only as a measured build, so it always has a record. An explicit recheck precision is served at
  the fastest recorded margin that passes (the widest recorded when none does, which the gate
  then refuses), at `serve_app.compiled.DEFAULT_RECHECK_MARGIN` with no record.

**The model version** says what produced the answers (`Serving.version_suffix`): equal-answer
settings (fp32 on either runtime) add nothing, so a changed default between them neither
re-infers nor stops reusing a committed answer; settings that change answers add ``+bf16``
(TensorFlow bf16), ``+ov-<precision>`` (``+ov-bf16``, ``+ov-bf16-dense``, ...: each candidate
answers differently, so each is its own version; a recheck precision adds its margin,
``+ov-bf16-recheck-m0.1``, since a wider margin answers more rows in fp32) or
``+ov-int8-<build>`` (the int8 IR's digest: two int8 builds calibrated on other texts answer
differently, so they never share a reuse key). The setting
itself (``openvino:fp32``) travels beside the version in every answer (`Serving.setting`), so
the run report and the metrics say which setting answered how many rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from serve_app.compiled import RECHECK_BASES
from serve_app.model import PRECISIONS, ModelDirError, cpu_flags, has_native_bf16
from serve_app.settings import RUNTIME_SETTINGS, ServerSettings
from serve_app.timing import unbeaten

__all__ = [
    "EQUAL_ANSWER_SETTINGS",
    "RECORD_FILE",
    "RUNTIME_SETTINGS",
    "GateError",
    "Measurement",
    "RuntimeRecord",
    "Serving",
    "agreement_lower_bound",
    "choose",
    "cpu_key",
    "fastest",
    "int8_build",
    "read_record",
    "read_records",
    "resolve",
    "served_version",
    "supported_settings",
    "write_record",
]

logger = logging.getLogger(__name__)

#: The measured record, beside ``model.json``.
RECORD_FILE = "runtimes.json"
_RECORD_FORMAT = "raypipe-runtimes/2"
_RECORD_FORMAT_V1 = "raypipe-runtimes/1"  # one record, no out-of-domain figure: still read
REFERENCE = ("tensorflow", "fp32")
#: Settings whose answers are the reference's (fp32 arithmetic, float sums in another order).
EQUAL_ANSWER_SETTINGS = (("openvino", "fp32"), REFERENCE)
"""Fastest first, as far as every CPU measured so far goes (OpenVINO fp32 ran 1.06-1.4x TF fp32)."""
#: Normal quantile of the gate's one-sided 95% lower bound on agreement.
GATE_Z = 1.645
#: The margin every ``bf16-recheck`` record written before the ladder was measured at.
_LEGACY_RECHECK_MARGIN = 0.05


def agreement_lower_bound(agreement: float, n: int | None, z: float = GATE_Z) -> float:
    """The Wilson score lower bound of a proportion measured as ``agreement`` on ``n`` texts.

    Wilson's interval (not the normal one) because agreements sit near 1, where the normal
    interval overshoots 1 and is too narrow; statsmodels' ``proportion_confint(method="wilson")``
    gives the same figure, but is not a dependency for one formula. ``n`` unknown (None or 0):
    0.0, no evidence.
    """
    if not n:
        return 0.0
    z2 = z * z
    centre = agreement + z2 / (2 * n)
    spread = z * math.sqrt(agreement * (1 - agreement) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


class GateError(ValueError):
    """The settings ask for a runtime x precision this replica must not serve.

    ``runtime`` and ``precision`` name the setting; the message says why (CPU, agreement) and how
    to get past it.
    """

    def __init__(self, runtime: str, precision: str, problem: str) -> None:
        self.runtime = runtime
        self.precision = precision
        super().__init__(f"{runtime} {precision}: {problem}")


@dataclass(frozen=True)
class Measurement:
    """One setting measured against TensorFlow fp32, in domain and out of domain."""

    runtime: str
    precision: str
    para_per_s: float
    """In-process paragraphs per second (the model's own batching, this CPU's threads): the median
    of the interleaved rounds (`serve_app.timing`); in records written before rounds were kept,
    the best round."""
    agreement: float
    """The gate's figure: the worse of `agreement_in` and `agreement_out` (1.0 for the reference)."""
    max_abs_dp: float
    """Largest absolute difference of any probability from TensorFlow fp32's."""
    speedup: float = 1.0
    """``para_per_s`` over TensorFlow fp32's in the same run."""
    note: str = ""
    """What else the measurement found (e.g. int8 layers kept in fp32)."""
    agreement_in: float | None = None
    """Top-label agreement with TensorFlow fp32 on the in-domain texts (the user's sample)."""
    agreement_out: float | None = None
    """The same on the out-of-domain texts the project ships; None when not measured (an old record)."""
    n_in: int | None = None
    """How many in-domain texts `agreement_in` was measured on (from the record's sample when older)."""
    n_out: int | None = None
    """How many out-of-domain texts `agreement_out` was measured on."""
    spread: float = 0.0
    """How noisy the speed was, in paragraphs per second: every round lay within ``para_per_s ±
    spread``. A setting is faster than another only beyond both spreads (`serve_app.timing.beats`);
    0 in records written before rounds were kept (they compare by ``para_per_s`` alone)."""
    rounds: int = 0
    """How many interleaved rounds timed it (0: not recorded)."""
    margin: float | None = None
    """A recheck precision's: the margin under which a row was answered again in fp32 (a record
    keeps one measurement per margin of the ladder); None for every other precision."""

    @property
    def setting(self) -> tuple[str, str]:
        return (self.runtime, self.precision)

    @property
    def candidate(self) -> tuple[str, str, float | None]:
        """What the gate and the speed rule choose between: the setting, and its margin."""
        return (self.runtime, self.precision, self.margin)

    @property
    def name(self) -> str:
        """``runtime precision``, with the margin where there is one (for people)."""
        return f"{self.runtime} {self.precision}" + ("" if self.margin is None else f" (margin {self.margin:g})")

    @property
    def gate_figure(self) -> float:
        """What the gate compares with ``min_agreement``: the agreement itself for an equal-answer
        setting; for one that changes answers, the worse lower confidence bound of the two."""
        if self.setting in EQUAL_ANSWER_SETTINGS:
            return self.agreement
        if self.agreement_in is None or self.agreement_out is None:
            return 0.0
        return min(
            agreement_lower_bound(self.agreement_in, self.n_in), agreement_lower_bound(self.agreement_out, self.n_out)
        )

    def passes(self, min_agreement: float) -> bool:
        """The gate (module docstring)."""
        return self.setting == REFERENCE or self.gate_figure >= min_agreement


def cpu_key(flags: Iterable[str]) -> tuple[str, ...]:
    """The kernel-relevant CPU flags a record is kept under (speed ranks are that CPU class's)."""
    return tuple(sorted(f for f in flags if f.startswith(("avx", "amx"))))


@dataclass(frozen=True)
class RuntimeRecord:
    """One CPU's entry of ``DIR/runtimes.json``: what was measured, and on what."""

    saved_model: str
    """Fingerprint (`serve_app.compiled.saved_model_digest`) of the SavedModel measured."""
    measurements: tuple[Measurement, ...]
    cpu_flags: tuple[str, ...] = ()
    """The kernel-relevant flags of the CPU that measured (`cpu_key`)."""
    sample: dict[str, Any] = field(default_factory=dict)
    """Where the texts came from, how many were used for calibration and held out, in and out of domain."""
    versions: dict[str, str] = field(default_factory=dict)
    measured_at: str = ""
    cpu: str = ""
    """The CPU's model name, for people (the key is `cpu_flags`)."""

    def get(self, runtime: str, precision: str) -> Measurement | None:
        """The setting's measurement (a recheck precision: the first margin's; `all` gives each)."""
        return next((m for m in self.measurements if m.setting == (runtime, precision)), None)

    def all(self, runtime: str, precision: str) -> list[Measurement]:
        """Every measurement of the setting: one, or one per margin for a recheck precision."""
        return [m for m in self.measurements if m.setting == (runtime, precision)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RuntimeRecord:
        measurements = []
        sample = dict(raw.get("sample", {}))
        for m in raw["measurements"]:
            m = dict(m)
            m.setdefault("agreement_in", m["agreement"])  # a v1 record measured one set of texts
            # Records written before the counts were kept: the sample says how many texts.
            m.setdefault("n_in", sample.get("held_out"))
            m.setdefault("n_out", sample.get("out_of_domain") if m.get("agreement_out") is not None else None)
            if m["precision"] == "bf16-recheck" and m.get("margin") is None:
                m["margin"] = _LEGACY_RECHECK_MARGIN  # the one margin measured before the ladder
            measurements.append(Measurement(**m))
        return cls(
            saved_model=str(raw["saved_model"]),
            measurements=tuple(measurements),
            cpu_flags=tuple(raw.get("cpu_flags", ())),
            sample=sample,
            versions=dict(raw.get("versions", {})),
            measured_at=str(raw.get("measured_at", "")),
            cpu=str(raw.get("cpu", "")),
        )


def read_records(model_dir: Path | str) -> list[RuntimeRecord]:
    """Every CPU's record in the model directory (empty when it has none); `ModelDirError` when unreadable."""
    path = Path(model_dir) / RECORD_FILE
    if not path.is_file():
        return []
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") == _RECORD_FORMAT_V1:
            return [RuntimeRecord.from_json(raw)]
        if raw.get("format") != _RECORD_FORMAT:
            raise ValueError(f"format must be {_RECORD_FORMAT!r}, got {raw.get('format')!r}")
        return [RuntimeRecord.from_json(r) for r in raw["records"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelDirError(path, f"cannot read the runtime record: {e}") from e


def read_record(model_dir: Path | str, *, flags: frozenset[str] | None = None) -> RuntimeRecord | None:
    """The record of the CPU with these flags (default: this one), or None when it was never measured here."""
    key = cpu_key(cpu_flags() if flags is None else flags)
    return next((r for r in read_records(model_dir) if r.cpu_flags == key), None)


def write_record(model_dir: Path | str, record: RuntimeRecord) -> Path:
    """Put ``record`` in ``DIR/runtimes.json`` in place of its CPU's entry, atomically (a reader
    sees the old file or the new one). Entries of other SavedModel files are dropped."""
    path = Path(model_dir) / RECORD_FILE
    try:
        kept = [r for r in read_records(model_dir) if r.cpu_flags != record.cpu_flags]
    except ModelDirError:
        kept = []  # a damaged file is replaced
    kept = [r for r in kept if r.saved_model == record.saved_model]
    body = {"format": _RECORD_FORMAT, "records": [r.to_json() for r in [*kept, record]]}
    tmp = path.with_name(f".{RECORD_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def supported_settings(flags: frozenset[str], *, openvino: bool) -> list[tuple[str, str]]:
    """The runtime x precision settings this CPU can serve well (emulated bf16 is slower than fp32).

    int8 runs on OpenVINO on any x86 CPU (its int8 kernels use VNNI/AMX where present, AVX2
    otherwise); whether it is worth serving is the measured record's call, not the flags'. The
    candidates between fp32 and bf16 (`serve_app.compiled.BF16_PRECISIONS`) need native bf16.
    """
    from serve_app.compiled import BF16_PRECISIONS

    out = [REFERENCE]
    if has_native_bf16(flags):
        out.append(("tensorflow", "bf16"))
    if openvino:
        out.append(("openvino", "fp32"))
        if has_native_bf16(flags):
            out += [("openvino", p) for p in BF16_PRECISIONS]
        out.append(("openvino", "int8"))
    return out


@dataclass(frozen=True)
class Serving:
    """What a replica loads, and why."""

    runtime: str
    precision: str
    reason: str
    agreement: float | None = None
    """The recorded gate agreement of this setting, when measured."""
    build: str = ""
    """int8: a digest of the quantized IR that answers (`int8_build`). Its weights depend on the
    calibration texts ``raypipe model optimize`` was given, so two int8 builds of one model give
    different answers."""
    unmeasured: bool = False
    """``precision: auto`` found no record for this CPU (and these SavedModel files): the default
    is served, and the replica may measure itself (`serve_app.self_measure`)."""
    margin: float | None = None
    """A recheck precision's: the margin under which rows are answered again in fp32 (the gate's
    pick, `Measurement.margin`); None for every other precision."""

    def __post_init__(self) -> None:
        if (self.precision in RECHECK_BASES) != (self.margin is not None):
            raise ValueError(f"a margin goes with a recheck precision and only with one (precision {self.precision!r})")

    @property
    def setting(self) -> str:
        """``runtime:precision``, as answers, the run report and the metrics name it."""
        return f"{self.runtime}:{self.precision}"

    @property
    def version_suffix(self) -> str:
        """Appended to the model version: nothing for an equal-answer setting (module docstring)."""
        if self.precision == "fp32":
            return ""
        if self.runtime == "tensorflow":
            return f"+{self.precision}"
        margin = "" if self.margin is None else f"-m{self.margin:g}"
        return f"+ov-{self.precision}{margin}" + (f"-{self.build}" if self.build else "")


def int8_build(model_dir: Path) -> str:
    """The first 8 hex digits of the SHA-256 of ``DIR/openvino/int8.xml`` and ``int8.bin``;
    "" when there is no int8 build (the loader then says so)."""
    import hashlib

    from serve_app.compiled import OPENVINO_DIR

    digest = hashlib.sha256()
    for name in ("int8.xml", "int8.bin"):
        path = model_dir / OPENVINO_DIR / name
        if not path.is_file():
            return ""
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:8]


def served_version(base: str, serving: Serving, *, max_sequence_length: int, model_max: int) -> str:
    """The model version a replica answers with: the card's, then what changes answers.

    ``+len{N}`` when the server cuts texts shorter than the model takes (`ServerSettings.
    max_sequence_length`: a text's answer depends on it), then `Serving.version_suffix`. Answer
    reuse keys on the version, so an answer made under other such settings is never reused.
    """
    length = f"+len{max_sequence_length}" if max_sequence_length < model_max else ""
    return f"{base}{length}{serving.version_suffix}"


def choose(
    *,
    runtime: str,
    precision: str,
    flags: frozenset[str],
    record: RuntimeRecord | None,
    saved_model: str | None,
    min_agreement: float = 0.99,
    force: bool = False,
    openvino: bool = True,
) -> Serving:
    """The setting a replica serves (see the module docstring).

    ``record``: this CPU's record; one measured on a CPU with other kernel flags, or for another
    SavedModel (``saved_model``: the fingerprint of the one being served), is ignored (logged).
    ``openvino``: whether the runtime is installed.
    """
    if runtime not in RUNTIME_SETTINGS:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIME_SETTINGS)}, not {runtime!r}")
    if record is not None and saved_model is not None and record.saved_model != saved_model:
        logger.warning(
            "the runtime record was measured on other SavedModel files; ignoring it (run `raypipe model optimize`)"
        )
        record = None
    if record is not None and record.cpu_flags != cpu_key(flags):
        logger.info("the runtime record was measured on another CPU class; this replica's CPU has none")
        record = None
    supported = supported_settings(flags, openvino=openvino)
    runtimes = ("tensorflow", "openvino") if runtime == "auto" else (runtime,)
    if precision == "auto":
        return _auto(runtimes, supported, record, min_agreement)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or auto, not {precision!r}")
    candidates = [s for s in supported if s[0] in runtimes and s[1] == precision]
    if not candidates:
        raise GateError(
            runtimes[0] if len(runtimes) == 1 else runtime,
            precision,
            _unsupported(precision, runtimes, flags, openvino),
        )
    if len(candidates) > 1:
        # runtime auto with an explicit precision: the fastest measured runtime for it, else the
        # equal-answer order (OpenVINO first) for fp32.
        measured = [m for s in candidates for m in record.all(*s)] if record else []
        if measured:
            candidates = [fastest(measured).setting]
        elif precision == "fp32":
            candidates = [s for s in EQUAL_ANSWER_SETTINGS if s in candidates]
    chosen = candidates[0]
    measurement = _asked(record.all(*chosen), min_agreement) if record is not None else None
    margin = _margin(chosen[1], measurement)
    if chosen != REFERENCE and measurement is not None and not measurement.passes(min_agreement):
        problem = f"{_figures(measurement)}, under the required {min_agreement:.2%} (runtimes.json)"
        if not force:
            raise GateError(*chosen, problem + "; set force_precision to serve it anyway")
        logger.warning("%s served although %s (force_precision)", measurement.name, problem)
        return Serving(*chosen, reason=f"forced: {problem}", agreement=measurement.agreement, margin=margin)
    if chosen[1] == "int8" and measurement is None and not force:
        raise GateError(*chosen, "no measured agreement: build and measure it with `raypipe model optimize DIR`")
    reason = "asked" if measurement is None else f"asked; agreement {measurement.agreement:.2%}"
    return Serving(*chosen, reason=reason, agreement=measurement.agreement if measurement else None, margin=margin)


def _asked(measured: list[Measurement], min_agreement: float) -> Measurement | None:
    """Of an explicitly asked setting's measurements (one per margin for a recheck precision): the
    fastest that passes the gate, else the one closest to passing (the gate then refuses it)."""
    if not measured:
        return None
    passing = [m for m in measured if m.passes(min_agreement)]
    return fastest(passing) if passing else max(measured, key=lambda m: m.gate_figure)


def _margin(precision: str, measurement: Measurement | None) -> float | None:
    """The margin a replica serves ``precision`` at: the measured one, the default unmeasured."""
    if precision not in RECHECK_BASES:
        return None
    if measurement is not None and measurement.margin is not None:
        return measurement.margin
    from serve_app.compiled import DEFAULT_RECHECK_MARGIN

    return DEFAULT_RECHECK_MARGIN


def resolve(model_dir: Path | str, settings: ServerSettings, *, flags: frozenset[str] | None = None) -> Serving:
    """`choose` for a replica about to load ``model_dir`` with ``settings`` on this CPU."""
    from importlib.util import find_spec

    model_dir = Path(model_dir)
    flags = cpu_flags() if flags is None else flags
    record = read_record(model_dir, flags=flags)
    fingerprint = None
    if record is not None:
        from serve_app.compiled import saved_model_digest

        fingerprint = saved_model_digest(model_dir / "saved_model")
    serving = choose(
        runtime=settings.runtime,
        precision=settings.precision,
        flags=flags,
        record=record,
        saved_model=fingerprint,
        min_agreement=settings.min_agreement,
        force=settings.force_precision,
        openvino=find_spec("openvino") is not None,
    )
    if serving.precision == "int8":
        return replace(serving, build=int8_build(model_dir))
    return serving


def _auto(
    runtimes: Iterable[str], supported: list[tuple[str, str]], record: RuntimeRecord | None, min_agreement: float
) -> Serving:
    allowed = [s for s in supported if s[0] in runtimes]
    equal = [s for s in EQUAL_ANSWER_SETTINGS if s in allowed]
    fallback = equal[0] if equal else allowed[0]
    if record is None:
        return Serving(
            *fallback,
            reason="auto: no measured record for this CPU, the fastest setting with the reference's answers",
            unmeasured=True,
        )
    eligible = [m for s in allowed for m in record.all(*s) if m.passes(min_agreement)]
    if not eligible:
        return Serving(*fallback, reason="auto: no measured setting passes the agreement gate; the reference's answers")
    best = fastest(eligible)
    reason = (
        f"auto: fastest measured that passes the gate ({best.speedup:.2f}x TF fp32{_noise(best)}, {_figures(best)})"
    )
    if best.margin is not None:
        reason += f", margin {best.margin:g}"
    top = max(eligible, key=lambda m: m.para_per_s)
    if top is not best:
        reason += f"; {top.name} ran {top.para_per_s:.1f}{_noise(top, speedup=False)}: within the spread"
    return Serving(
        best.runtime, best.precision, reason=reason, agreement=best.agreement, margin=_margin(best.precision, best)
    )


def fastest(measurements: Iterable[Measurement]) -> Measurement:
    """The setting served among measured ones: of those no other is faster than beyond the spread
    (`serve_app.timing.beats`), the one whose answers are the reference's, or closest to them
    (`_preference`). A tie that noise makes keeps the default; only a clear win changes it.

    Margins of one recheck precision are not raced: a wider margin answers a superset of a
    narrower one's rows again in fp32, so of those given (the caller's passing ones) the
    narrowest is the fastest by construction, and noise is not asked to say so."""
    given = list(measurements)
    margins = [(m.setting, m.margin) for m in given if m.margin is not None]
    narrowest = {setting: min(x for s, x in margins if s == setting) for setting, _ in margins}
    by_candidate = {m.candidate: m for m in given if m.margin is None or m.margin == narrowest.get(m.setting)}
    return min((by_candidate[c] for c in unbeaten(by_candidate)), key=_preference)


def _preference(m: Measurement) -> tuple[int, float, float]:
    """Among settings whose speeds tie: the reference's answers first, in `EQUAL_ANSWER_SETTINGS`
    order (the no-record default first), then the higher gate figure, then the higher median."""
    if m.setting in EQUAL_ANSWER_SETTINGS:
        return (0, EQUAL_ANSWER_SETTINGS.index(m.setting), 0.0)
    return (1, -m.gate_figure, -m.para_per_s)


def _noise(m: Measurement, *, speedup: bool = True) -> str:
    if not m.rounds:
        return ""
    if speedup:
        return f" ± {m.spread / max(m.para_per_s, 1e-12):.0%} over {m.rounds} rounds"
    return f" ± {m.spread:.1f} para/s"


def _figures(m: Measurement) -> str:
    inside = "?" if m.agreement_in is None else f"{m.agreement_in:.2%}"
    outside = "not measured" if m.agreement_out is None else f"{m.agreement_out:.2%}"
    figures = f"top-label agreement with TensorFlow fp32 {inside} in domain, {outside} out of domain"
    if m.margin is not None:
        figures = f"at margin {m.margin:g}, {figures}"
    if m.setting in EQUAL_ANSWER_SETTINGS or m.agreement_out is None:
        return figures
    return f"{figures} (at least {m.gate_figure:.2%} at 95% confidence, on {m.n_in} and {m.n_out} texts)"


def _unsupported(precision: str, runtimes: tuple[str, ...], flags: frozenset[str], openvino: bool) -> str:
    if precision.startswith("bf16") and not has_native_bf16(flags):
        return "needs a CPU with AVX512_BF16 or AMX; this one has neither (emulated bf16 is slower than fp32)"
    if "openvino" in runtimes and not openvino:
        return "OpenVINO is not installed"
    if precision not in ("fp32", "bf16"):
        return f"{precision} runs on OpenVINO only (runtime: openvino or auto)"
    return f"not supported on runtime {', '.join(runtimes)}"
