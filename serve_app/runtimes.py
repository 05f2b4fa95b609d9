"""Which runtime and precision a replica serves: the measured record, and the gate.

A *setting* is a runtime x precision: TensorFlow fp32 (the reference: export, ``raypipe model
check`` and every agreement are measured against it), TensorFlow bf16 (oneDNN auto mixed
precision), OpenVINO fp32 / bf16 / int8 (`serve_app.compiled`; int8 is the NNCF-quantized IR of
`serve_app.optimize`). ``raypipe model optimize DIR`` measures each setting this CPU supports on
a sample of the user's text and writes the result beside the model card, ``DIR/runtimes.json``
(`RuntimeRecord`): speed, top-label agreement with TensorFlow fp32 on held-out texts, largest
probability difference.

`choose` turns the server settings (``runtime``, ``precision``, ``min_agreement``,
``force_precision``), the record and the CPU's flags into the one `Serving` a replica loads:

- ``precision: auto`` serves the fastest recorded setting this CPU supports whose agreement is
  at least ``min_agreement`` (TensorFlow fp32 always qualifies). With no record (or one made
  for other SavedModel files) it serves fp32: nothing that changes answers is picked unmeasured.
- An explicit precision is served if the CPU supports it, unless the record says its agreement
  is under ``min_agreement``: then the replica refuses to start (`GateError`) unless
  ``force_precision``. int8 exists only as a measured build, so it always has a record.

Answers carry what produced them: `Serving.version_suffix` is appended to the model version
(``""`` for TensorFlow fp32, ``+bf16`` for TensorFlow bf16, ``+ov-fp32``, ``+ov-bf16``, ``+ov-int8``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serve_app.model import ModelDirError, cpu_flags, has_native_bf16
from serve_app.settings import RUNTIME_SETTINGS, ServerSettings

__all__ = [
    "RECORD_FILE",
    "RUNTIME_SETTINGS",
    "GateError",
    "Measurement",
    "RuntimeRecord",
    "Serving",
    "choose",
    "read_record",
    "resolve",
    "supported_settings",
    "write_record",
]

logger = logging.getLogger(__name__)

#: The measured record, beside ``model.json``.
RECORD_FILE = "runtimes.json"
_RECORD_FORMAT = "raypipe-runtimes/1"
REFERENCE = ("tensorflow", "fp32")


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
    """One setting measured against TensorFlow fp32 on the held-out part of a sample."""

    runtime: str
    precision: str
    para_per_s: float
    """In-process paragraphs per second (the model's own batching, this CPU's threads)."""
    agreement: float
    """Fraction of held-out texts whose top label equals TensorFlow fp32's (1.0 for the reference)."""
    max_abs_dp: float
    """Largest absolute difference of any probability from TensorFlow fp32's."""
    speedup: float = 1.0
    """``para_per_s`` over TensorFlow fp32's in the same run."""
    note: str = ""
    """What else the measurement found (e.g. int8 layers kept in fp32)."""

    @property
    def setting(self) -> tuple[str, str]:
        return (self.runtime, self.precision)


@dataclass(frozen=True)
class RuntimeRecord:
    """``DIR/runtimes.json``: what ``raypipe model optimize`` measured, and on what."""

    saved_model: str
    """Fingerprint (`serve_app.compiled.saved_model_digest`) of the SavedModel measured."""
    measurements: tuple[Measurement, ...]
    cpu_flags: tuple[str, ...] = ()
    """The kernel-relevant flags of the CPU that measured (speed ranks are that CPU's)."""
    sample: dict[str, Any] = field(default_factory=dict)
    """Where the texts came from, how many were used for calibration and held out."""
    versions: dict[str, str] = field(default_factory=dict)
    measured_at: str = ""

    def get(self, runtime: str, precision: str) -> Measurement | None:
        return next((m for m in self.measurements if m.setting == (runtime, precision)), None)

    def to_json(self) -> dict[str, Any]:
        return {"format": _RECORD_FORMAT, **asdict(self)}


def read_record(model_dir: Path | str) -> RuntimeRecord | None:
    """The model directory's record, or None when it has none; `ModelDirError` when unreadable."""
    path = Path(model_dir) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != _RECORD_FORMAT:
            raise ValueError(f"format must be {_RECORD_FORMAT!r}, got {raw.get('format')!r}")
        return RuntimeRecord(
            saved_model=str(raw["saved_model"]),
            measurements=tuple(Measurement(**m) for m in raw["measurements"]),
            cpu_flags=tuple(raw.get("cpu_flags", ())),
            sample=dict(raw.get("sample", {})),
            versions=dict(raw.get("versions", {})),
            measured_at=str(raw.get("measured_at", "")),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelDirError(path, f"cannot read the runtime record: {e}") from e


def write_record(model_dir: Path | str, record: RuntimeRecord) -> Path:
    """Write ``DIR/runtimes.json`` atomically (a reader sees the old record or the new one)."""
    path = Path(model_dir) / RECORD_FILE
    tmp = path.with_name(f".{RECORD_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def supported_settings(flags: frozenset[str], *, openvino: bool) -> list[tuple[str, str]]:
    """The runtime x precision settings this CPU can serve well (emulated bf16 is slower than fp32).

    int8 runs on OpenVINO on any x86 CPU (its int8 kernels use VNNI/AMX where present, AVX2
    otherwise); whether it is worth serving is the measured record's call, not the flags'.
    """
    out = [REFERENCE]
    if has_native_bf16(flags):
        out.append(("tensorflow", "bf16"))
    if openvino:
        out.append(("openvino", "fp32"))
        if has_native_bf16(flags):
            out.append(("openvino", "bf16"))
        out.append(("openvino", "int8"))
    return out


@dataclass(frozen=True)
class Serving:
    """What a replica loads, and why."""

    runtime: str
    precision: str
    reason: str
    agreement: float | None = None
    """The recorded held-out agreement of this setting, when measured."""

    @property
    def version_suffix(self) -> str:
        if self.runtime == "tensorflow":
            return "" if self.precision == "fp32" else f"+{self.precision}"
        return f"+ov-{self.precision}"


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

    ``saved_model``: the fingerprint of the SavedModel being served; a record made for another
    is ignored (logged). ``openvino``: whether the runtime is installed.
    """
    if runtime not in RUNTIME_SETTINGS:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIME_SETTINGS)}, not {runtime!r}")
    if record is not None and saved_model is not None and record.saved_model != saved_model:
        logger.warning(
            "the runtime record was measured on other SavedModel files; ignoring it (run `raypipe model optimize`)"
        )
        record = None
    supported = supported_settings(flags, openvino=openvino)
    runtimes = ("tensorflow", "openvino") if runtime == "auto" else (runtime,)
    if precision == "auto":
        return _auto(runtimes, supported, record, min_agreement)
    if precision not in ("fp32", "bf16", "int8"):
        raise ValueError(f"precision must be fp32, bf16, int8 or auto, not {precision!r}")
    candidates = [s for s in supported if s[0] in runtimes and s[1] == precision]
    if not candidates:
        raise GateError(
            runtimes[0] if len(runtimes) == 1 else runtime,
            precision,
            _unsupported(precision, runtimes, flags, openvino),
        )
    if len(candidates) > 1 and record is not None:
        # runtime auto with an explicit precision: the fastest measured runtime for it.
        measured = [m for m in (record.get(*s) for s in candidates) if m is not None]
        if measured:
            best = max(measured, key=lambda m: m.para_per_s)
            candidates = [best.setting]
    chosen = candidates[0]
    measurement = record.get(*chosen) if record is not None else None
    if chosen != REFERENCE and measurement is not None and measurement.agreement < min_agreement:
        problem = (
            f"measured top-label agreement with TensorFlow fp32 is {measurement.agreement:.2%}, under the "
            f"required {min_agreement:.2%} (runtimes.json)"
        )
        if not force:
            raise GateError(*chosen, problem + "; set force_precision to serve it anyway")
        logger.warning("%s %s served although %s (force_precision)", *chosen, problem)
        return Serving(*chosen, reason=f"forced: {problem}", agreement=measurement.agreement)
    if chosen[1] == "int8" and measurement is None and not force:
        raise GateError(*chosen, "no measured agreement: build and measure it with `raypipe model optimize DIR`")
    reason = "asked" if measurement is None else f"asked; agreement {measurement.agreement:.2%}"
    return Serving(*chosen, reason=reason, agreement=measurement.agreement if measurement else None)


def resolve(model_dir: Path | str, settings: ServerSettings, *, flags: frozenset[str] | None = None) -> Serving:
    """`choose` for a replica about to load ``model_dir`` with ``settings`` on this CPU."""
    from importlib.util import find_spec

    model_dir = Path(model_dir)
    record = read_record(model_dir)
    fingerprint = None
    if record is not None:
        from serve_app.compiled import saved_model_digest

        fingerprint = saved_model_digest(model_dir / "saved_model")
    return choose(
        runtime=settings.runtime,
        precision=settings.precision,
        flags=cpu_flags() if flags is None else flags,
        record=record,
        saved_model=fingerprint,
        min_agreement=settings.min_agreement,
        force=settings.force_precision,
        openvino=find_spec("openvino") is not None,
    )


def _auto(
    runtimes: Iterable[str], supported: list[tuple[str, str]], record: RuntimeRecord | None, min_agreement: float
) -> Serving:
    allowed = [s for s in supported if s[0] in runtimes]
    fallback = REFERENCE if REFERENCE in allowed else allowed[0]
    if record is None:
        return Serving(*fallback, reason="auto: no measured record for this model (raypipe model optimize), fp32")
    eligible = [
        m
        for m in (record.get(*s) for s in allowed)
        if m is not None and (m.setting == REFERENCE or m.agreement >= min_agreement)
    ]
    if not eligible:
        return Serving(*fallback, reason="auto: no measured setting passes the agreement gate, fp32")
    best = max(eligible, key=lambda m: m.para_per_s)
    reason = (
        f"auto: fastest measured at >= {min_agreement:.2%} agreement "
        f"({best.speedup:.2f}x TF fp32, {best.agreement:.2%})"
    )
    return Serving(best.runtime, best.precision, reason=reason, agreement=best.agreement)


def _unsupported(precision: str, runtimes: tuple[str, ...], flags: frozenset[str], openvino: bool) -> str:
    if precision == "bf16" and not has_native_bf16(flags):
        return "needs a CPU with AVX512_BF16 or AMX; this one has neither (emulated bf16 is slower than fp32)"
    if "openvino" in runtimes and not openvino:
        return "OpenVINO is not installed"
    if precision == "int8":
        return "int8 runs on OpenVINO only (runtime: openvino or auto)"
    return f"not supported on runtime {', '.join(runtimes)}"
