"""``runtime: openvino``: a model directory's SavedModel compiled for this CPU by OpenVINO.

    raypipe model optimize DIR      # optional ahead of time: writes DIR/openvino/ (and measures)

`load_openvino_runner` gives `serve_app.model.EmotionModel` the same ``run`` callable the
TensorFlow signature gives it: ``(input_ids int32[n, L], attention_mask int32[n, L]) ->
float32[n, labels]``. TensorFlow stays the reference: export, ``raypipe model check`` and
``runtime: tensorflow`` use the SavedModel as it is.

What is compiled, and where it lives:

1. OpenVINO's TensorFlow frontend (what ``ov.convert_model(saved_model/)`` runs) reads the
   SavedModel directly into an OpenVINO model with dynamic batch and length axes (no ONNX
   step); `openvino.save_model` writes it as IR
   (``model.xml`` + ``model.bin``, fp32 weights). The IR does not depend on the CPU.
2. The OpenVINO CPU plugin compiles the IR at load, for the precision asked (``fp32``; ``bf16``
   as ``INFERENCE_PRECISION_HINT`` where the CPU has native bf16; the candidates between them,
   `BF16_PRECISIONS`, below; an ``int8`` IR is one NNCF quantized, written by ``raypipe model
   optimize``: `serve_app.optimize`). Compiled blobs are
   kept by OpenVINO itself (``CACHE_DIR``) in a directory named for this CPU's flags, since a
   blob compiled for one CPU's kernels is not valid on another, and within it one per precision
   (OpenVINO took a blob compiled for one precision hint as valid for another).

Precisions between fp32 and bf16 (each changes answers less than ``bf16`` and costs more; the
agreement gate decides which, if any, a replica serves: `serve_app.runtimes`):

- ``bf16-dense``: the weight matmuls of the encoder (attention projections, feed-forward) in
  bf16; embeddings, layer norms, attention scores and softmax, and the classifier head in fp32.
- ``bf16-ffn``: only the feed-forward blocks' matmuls in bf16.
- ``bf16-recheck``: all of ``bf16``, then the rows whose two top probabilities are closer than a
  *margin* run again in fp32 (a close call is where bf16's rounding flips the label). The margin
  is the gate's choice, not a constant: how far bf16 moves a probability depends on the model
  (at most 0.02 on the real-weights MiniLM, 0.08 on the trained bert-base), so `measure` times
  and gates each margin of `RECHECK_MARGINS` and the replica serves the fastest that passes
  (`serve_app.runtimes`). A wider margin answers more rows in fp32: closer to fp32's answers,
  slower.
- ``bf16-dense-recheck``: the same over ``bf16-dense`` (`RECHECK_BASES`). It moves probabilities
  less than ``bf16``, so a narrower margin keeps the labels: fewer rows run twice, which can
  more than pay for its slower first pass (the trained bert-base: bench/results).

The first two are built as explicit bf16 matmuls in an fp32 model (`_bf16_matmuls`), compiled with
an fp32 hint: the CPU plugin keeps an IR's own bf16 ops where the CPU has native bf16, whereas its
per-node opt-out under a bf16 hint (the ``precise`` runtime attribute) is lost whenever a node is
fused (layer norms into MVN, ``Tensordot`` matmuls into FullyConnected), so it cannot keep those
parts in fp32. ``compiled_model.get_runtime_model()`` shows each node's runtime precision.

An IR is found, in order, in ``DIR/openvino/`` (when `export_ir` wrote it for the current
``saved_model/`` files and OpenVINO version), else in a per-machine cache,
``$RAYPIPE_CACHE/openvino/<key>/`` (default ``~/.cache/raypipe/openvino/<key>/``), where the key
hashes the SavedModel's files, OpenVINO's version and this module's recipe. A cache entry is
built in a temporary directory beside its final name and renamed into place under a file lock
(`filelock`), so replicas starting together convert once and never read half an IR;
``ir.json`` records the SHA-256 of both IR files, and an entry that does not match is built again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.model import ModelDirError, has_native_bf16

__all__ = [
    "BF16_PRECISIONS",
    "DEFAULT_RECHECK_MARGIN",
    "OPENVINO_DIR",
    "OPENVINO_PRECISIONS",
    "RECHECK_MARGINS",
    "OpenVinoError",
    "RecheckRunner",
    "close_calls",
    "cpu_cache_tag",
    "default_cache_dir",
    "export_ir",
    "ir_key",
    "load_openvino_runner",
    "openvino_version",
    "rechecked",
    "saved_model_digest",
    "tree_digest",
]

logger = logging.getLogger(__name__)

#: The model directory's own OpenVINO build (written by `export_ir` / ``raypipe model optimize``).
OPENVINO_DIR = "openvino"
_FP32 = "model.xml"
_META = "ir.json"
_FORMAT = "raypipe-openvino/1"
#: Bump when the conversion changes: every cached IR is then made again.
_RECIPE = {"recipe": 1, "convert": "tf frontend (saved_model)", "weights": "fp32"}
_CACHE_ENV = "RAYPIPE_CACHE"
_INPUTS = ("input_ids", "attention_mask")
_OUTPUT = "probabilities"
_Run = Callable[[np.ndarray, np.ndarray], np.ndarray]
# CPU flags that change which kernels OpenVINO compiles (the rest do not name the blob).
#: Precisions that need native bf16 (emulated bf16 is slower than fp32); module docstring.
BF16_PRECISIONS = ("bf16", "bf16-dense", "bf16-ffn", "bf16-recheck", "bf16-dense-recheck")
#: The recheck precisions, each with the precision that answers every row first (the close calls
#: are answered again in fp32).
RECHECK_BASES = {"bf16-recheck": "bf16", "bf16-dense-recheck": "bf16-dense"}
#: Every precision `load_openvino_runner` compiles.
OPENVINO_PRECISIONS = ("fp32", *BF16_PRECISIONS, "int8")
#: The margins a recheck precision is measured at (`serve_app.optimize.measure`), narrowest
#: (fastest) first. A label can flip only where the first pass's margin is under twice the largest
#: probability it moved: bf16 moved 0.018-0.021 on the real-weights MiniLM, 0.08-0.1 on the
#: trained bert-base, bf16-dense 0.04 there (bench/results), so the ladder runs from 0.02 to 0.2
#: and is finer where the labels of those models settle (0.02-0.07). A margin whose agreement a
#: narrower one matches is not timed (`serve_app.optimize.undominated_margins`), so rungs that
#: change nothing cost nothing.
RECHECK_MARGINS = (0.02, 0.03, 0.05, 0.07, 0.1, 0.2)
#: The margin of a recheck precision asked for explicitly on a CPU with no record (the one every
#: record before the ladder was measured at).
DEFAULT_RECHECK_MARGIN = 0.05
_KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")


class OpenVinoError(ModelDirError):
    """The OpenVINO model cannot be built or loaded; ``path`` is the file or directory at fault."""


def openvino_version() -> str:
    import openvino

    return str(openvino.__version__)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$RAYPIPE_CACHE/openvino``, else ``~/.cache/raypipe/openvino``."""
    environ = os.environ if environ is None else environ
    root = environ.get(_CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "raypipe") / "openvino"


def saved_model_digest(saved_model: Path) -> str:
    """SHA-256 of the SavedModel's files (names and bytes): the model's fingerprint."""
    if not saved_model.is_dir():
        raise ModelDirError(saved_model, "missing saved_model directory")
    return tree_digest(saved_model)


def tree_digest(directory: Path) -> str:
    """SHA-256 of the files under ``directory``: their relative names and bytes, in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"\0{path.relative_to(directory).as_posix()}\0".encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def ir_key(saved_model: Path, *, version: str | None = None) -> str:
    """The IR cache key: the SavedModel's fingerprint, OpenVINO's version, the recipe."""
    blob = json.dumps(
        {"saved_model": saved_model_digest(saved_model), "openvino": version or openvino_version(), **_RECIPE}
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def cpu_cache_tag(flags: frozenset[str]) -> str:
    """Names the compiled-blob directory: the kernel-relevant CPU flags this CPU has."""
    present = [f for f in _KERNEL_FLAGS if f in flags]
    return hashlib.sha256(",".join(present).encode()).hexdigest()[:12]


def load_openvino_runner(
    model_dir: Path | str,
    *,
    n_labels: int,
    precision: str = "fp32",
    threads: int = 1,
    streams: int = 1,
    flags: frozenset[str],
    cache_dir: Path | None = None,
    margin: float | None = None,
) -> OpenVinoRunner | RecheckRunner:
    """The OpenVINO model of ``model_dir`` for ``precision`` (see the module docstring).

    ``threads``: threads of one forward pass; ``streams``: forward passes that may run at once
    (the replica's model threads), each on its own infer request. ``int8`` needs the IR
    ``raypipe model optimize`` quantized on a sample of the user's text (``DIR/openvino/int8.xml``).
    ``margin``: a recheck precision's (default `DEFAULT_RECHECK_MARGIN`); other precisions take none.
    """
    if margin is not None and precision not in RECHECK_BASES:
        raise ValueError(f"a recheck margin goes with {' or '.join(RECHECK_BASES)}; precision {precision!r} takes none")
    if precision not in OPENVINO_PRECISIONS:
        raise ValueError(f"OpenVINO precision must be one of {', '.join(OPENVINO_PRECISIONS)}, not {precision!r}")
    if precision in BF16_PRECISIONS and not has_native_bf16(flags):
        raise ValueError(f"precision {precision!r} needs a CPU with AVX512_BF16 or AMX; this one has neither")
    model_dir = Path(model_dir)
    cache_root = cache_dir or default_cache_dir()
    if precision == "int8":
        from serve_app.optimize import int8_ir

        xml = int8_ir(model_dir)
    else:
        xml = ensure_ir(model_dir, cache_dir=cache_root) / _FP32
    blobs = cache_root / "compiled" / cpu_cache_tag(flags)
    if precision in RECHECK_BASES:
        fast, exact = (
            _compile(xml, n_labels=n_labels, precision=p, threads=threads, streams=streams, blobs=blobs)
            for p in (RECHECK_BASES[precision], "fp32")
        )
        margin = DEFAULT_RECHECK_MARGIN if margin is None else margin
        return RecheckRunner(fast, exact, margin=margin, precision=precision)
    return _compile(xml, n_labels=n_labels, precision=precision, threads=threads, streams=streams, blobs=blobs)


def ensure_ir(model_dir: Path, *, cache_dir: Path | None = None) -> Path:
    """The directory holding a valid fp32 IR of ``model_dir``: its own, else the cache (built once)."""
    key = ir_key(model_dir / "saved_model")
    own = model_dir / OPENVINO_DIR
    if (own / _META).exists():
        if _valid(own, key):
            return own
        logger.warning(
            "%s is not an OpenVINO build of this saved_model/ and OpenVINO %s; using the cache. "
            "Run `raypipe model optimize %s` to rebuild it.",
            own,
            openvino_version(),
            model_dir,
        )
    from filelock import FileLock

    cache = (cache_dir or default_cache_dir()) / key
    if _valid(cache, key):
        return cache
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OpenVinoError(
            cache.parent,
            f"cannot create the OpenVINO cache ({e}): set {_CACHE_ENV} to a writable directory, "
            f"or build the model directory's own copy with `raypipe model optimize {model_dir}`",
        ) from e
    with FileLock(cache.parent / f".{key}.lock"):
        # Another replica may have built it while this one waited for the lock.
        if not _valid(cache, key):
            _build_into(cache, model_dir / "saved_model", key)
    return cache


def export_ir(model_dir: Path | str, *, force: bool = False) -> Path:
    """Build ``model_dir/openvino/`` (the fp32 IR), so servers need not convert. Returns the directory."""
    model_dir = Path(model_dir)
    key = ir_key(model_dir / "saved_model")
    out = model_dir / OPENVINO_DIR
    if force or not _valid(out, key):
        from filelock import FileLock

        with FileLock(model_dir / f".{OPENVINO_DIR}.lock"):
            _build_into(out, model_dir / "saved_model", key, keep=("int8.xml", "int8.bin", "int8.json"))
    return out


def convert(saved_model: Path, out: Path) -> dict[str, Any]:
    """Write the fp32 IR of ``saved_model`` to ``out`` (``model.xml``, ``model.bin``)."""
    import openvino as ov
    from openvino.frontend import FrontEndManager

    started = time.monotonic()
    try:
        # The TensorFlow frontend `ov.convert_model` itself calls, without its wrapper: that
        # wrapper sends usage telemetry over the network from a forked process unless the
        # user opted out, and a replica must not reach out (nor fork beside the tokenizer).
        frontend = FrontEndManager().load_by_framework("tf")
        model = frontend.convert(frontend.load(str(saved_model)))
    except (RuntimeError, ValueError, OSError) as e:  # OpenVINO's conversion errors are RuntimeErrors
        raise OpenVinoError(saved_model, f"OpenVINO cannot convert the SavedModel: {e}") from e
    # compress_to_fp16=False: the IR must answer as the SavedModel does; precision is chosen at compile.
    ov.save_model(model, str(out), compress_to_fp16=False)
    return {"seconds": time.monotonic() - started}


# -- internals ------------------------------------------------------------------------------


class OpenVinoRunner:
    """Calls a compiled OpenVINO model on numpy arrays, one infer request per calling thread
    (a request is not thread-safe; the compiled model is, and runs ``streams`` requests at once)."""

    def __init__(self, compiled: Any, path: Path, precision: str) -> None:
        self._compiled = compiled
        self._output = compiled.output(_OUTPUT)
        self._local = threading.local()
        self.path = path
        self.precision = precision

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        out = request.infer({_INPUTS[0]: input_ids, _INPUTS[1]: attention_mask})[self._output]
        return np.array(out, dtype=np.float32)  # a copy: the request reuses its output buffer


class RecheckRunner:
    """A recheck precision (`RECHECK_BASES`): ``fast``'s probabilities, except the rows whose two
    top probabilities are closer than ``margin``, which ``exact`` answers (one more pass over those
    rows only)."""

    def __init__(self, fast: _Run, exact: _Run, *, margin: float, precision: str = "bf16-recheck") -> None:
        if not 0 < margin <= 1:
            raise ValueError(f"a recheck margin is a probability difference in (0, 1], not {margin}")
        if precision not in RECHECK_BASES:
            raise ValueError(f"a recheck precision is one of {', '.join(RECHECK_BASES)}, not {precision!r}")
        self.fast = fast
        self.exact = exact
        self.margin = margin
        self.path = getattr(fast, "path", Path())
        self.precision = precision

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        out = np.array(self.fast(input_ids, attention_mask), dtype=np.float32)
        close = close_calls(out, self.margin)
        if close.size:
            out[close] = self.exact(input_ids[close], attention_mask[close])
        return out


def close_calls(probabilities: np.ndarray, margin: float) -> np.ndarray:
    """The rows whose two top probabilities are closer than ``margin``: the rows `RecheckRunner`
    answers again. One definition for the runner and for `rechecked`, so what the gate measures
    is what a replica serves."""
    if probabilities.shape[1] < 2:
        return np.empty(0, dtype=np.intp)
    top2 = np.partition(probabilities, -2, axis=1)[:, -2:]
    return np.flatnonzero(top2[:, 1] - top2[:, 0] < margin)


def rechecked(fast: np.ndarray, exact: np.ndarray, margin: float) -> np.ndarray:
    """What `RecheckRunner` answers at ``margin`` for rows whose bf16 and fp32 probabilities are
    ``fast`` and ``exact``: each row is one or the other, so the gate measures every margin of
    the ladder from one bf16 pass and one fp32 pass instead of one recheck pass each."""
    out = np.array(fast, dtype=np.float32)
    close = close_calls(out, margin)
    out[close] = exact[close]
    return out


def _bf16_matmuls(model: Any, *, ffn_only: bool) -> int:
    """Turn the encoder's weight matmuls of ``model`` into bf16 ones (inputs converted to bf16,
    the product converted back to fp32); everything else stays fp32. Returns how many.

    A weight matmul is a MatMul whose second input is a constant. The encoder's are those before
    the last ReduceMean (the last layer norm's): the pooler and classifier after it stay fp32.
    ``ffn_only``: only those whose weight is not square (a feed-forward block's up and down
    projections; the attention projections are hidden x hidden).
    """
    import openvino.opset13 as ops

    ordered = list(model.get_ordered_ops())
    last_norm = max((i for i, op in enumerate(ordered) if op.get_type_name() == "ReduceMean"), default=-1)
    changed = 0
    for op in ordered[:last_norm]:
        if op.get_type_name() != "MatMul" or op.input_value(1).get_node().get_type_name() != "Constant":
            continue
        weight = op.input_value(1).get_partial_shape()
        if ffn_only and (weight.rank.get_length() != 2 or weight[0] == weight[1]):
            continue
        attributes = op.get_attributes()
        product = ops.matmul(
            ops.convert(op.input_value(0), "bf16"),
            ops.convert(op.input_value(1), "bf16"),
            attributes["transpose_a"],
            attributes["transpose_b"],
        )
        back = ops.convert(product, "f32")
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(back.output(0))
        changed += 1
    return changed


def _compile(xml: Path, *, n_labels: int, precision: str, threads: int, streams: int, blobs: Path) -> OpenVinoRunner:
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    core = ov.Core()
    config: dict[str, Any] = {
        props.inference_num_threads: max(1, threads) * max(1, streams),
        props.num_streams: max(1, streams),
        # bf16-dense and bf16-ffn carry their bf16 ops in the model: the hint stays fp32 for the rest.
        hints.inference_precision: ov.Type.bf16 if precision == "bf16" else ov.Type.f32,
        # Replicas share a node's cores with the proxy, the tokenizer thread and other
        # replicas; threads pinned to cores would wait for a core another process holds.
        "ENABLE_CPU_PINNING": False,
    }
    # One blob directory per precision: OpenVINO 2026.4's CPU plugin found an fp32 blob of the
    # same model when compiling it under a bf16 hint (and the reverse), and imported it: the
    # answers were garbage or NaN, or the heap was corrupted (measured on an AMX CPU).
    blobs = blobs / precision
    try:
        blobs.mkdir(parents=True, exist_ok=True)
        config[props.cache_dir] = str(blobs)
    except OSError as e:  # no blob cache: compile every start, still correct
        logger.warning("OpenVINO blob cache %s not writable (%s); compiling without it", blobs, e)
    try:
        model = core.read_model(str(xml))
        _check_io(model, xml, n_labels)
        if precision in ("bf16-dense", "bf16-ffn") and not _bf16_matmuls(model, ffn_only=precision == "bf16-ffn"):
            raise OpenVinoError(xml, f"{precision}: the model has no encoder weight matmuls to run in bf16")
        compiled = core.compile_model(model, "CPU", config)
    except RuntimeError as e:
        raise OpenVinoError(xml, f"OpenVINO cannot load or compile the model: {e}") from e
    return OpenVinoRunner(compiled, xml, precision)


def _check_io(model: Any, path: Path, n_labels: int) -> None:
    inputs = {i.get_any_name(): str(i.get_element_type()) for i in model.inputs}
    if set(inputs) != set(_INPUTS):
        raise OpenVinoError(path, f"inputs must be {list(_INPUTS)}, got {sorted(inputs)}")
    outputs = {name: o.get_partial_shape() for o in model.outputs for name in o.get_names()}
    if _OUTPUT not in outputs:
        raise OpenVinoError(path, f"no {_OUTPUT!r} output (outputs: {sorted(outputs)})")
    width = outputs[_OUTPUT][-1]
    if width.is_static and width.get_length() != n_labels:
        raise OpenVinoError(path, f"model outputs {width.get_length()} classes but model.json lists {n_labels} labels")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _valid(directory: Path, key: str) -> bool:
    """Whether ``directory`` holds a complete IR for ``key`` (its bytes as recorded)."""
    try:
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("key") != key:
            return False
        files = meta.get("sha256")
        return isinstance(files, dict) and all(
            _file_sha256(directory / n) == files.get(n) for n in ("model.xml", "model.bin")
        )
    except (OSError, ValueError):
        return False


def _build_into(final: Path, saved_model: Path, key: str, *, keep: tuple[str, ...] = ()) -> None:
    """Convert into a temporary directory beside ``final``, then rename it into place.

    ``keep``: files of an existing ``final`` carried over (the int8 IR beside an fp32 rebuild).
    """
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        logger.info("converting %s to OpenVINO IR (once per SavedModel, OpenVINO version and machine)", saved_model)
        done = convert(saved_model, tmp / _FP32)
        for name in keep:
            if (final / name).is_file():
                shutil.copy2(final / name, tmp / name)
        meta = {
            "format": _FORMAT,
            "key": key,
            "saved_model": str(saved_model.absolute()),
            "openvino": openvino_version(),
            "recipe": _RECIPE,
            "sha256": {n: _file_sha256(tmp / n) for n in ("model.xml", "model.bin")},
            **done,
        }
        (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{threading.get_ident()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        logger.info("OpenVINO IR ready in %.1f s: %s", done["seconds"], final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
