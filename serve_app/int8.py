"""``precision: int8``: a model directory's SavedModel converted to ONNX, quantized to int8, run by ONNX Runtime.

    raypipe model int8 DIR      # optional: writes DIR/int8/, so no replica converts

`load_int8_runner` gives `serve_app.model.EmotionModel` the same ``run`` callable the TensorFlow
signature gives it: ``(input_ids int32[n, L], attention_mask int32[n, L]) -> float32[n, labels]``.

The conversion, in `convert`:

1. tf2onnx turns the ``serving_default`` signature into ONNX with dynamic batch and length
   axes. Keras' exact gelu is ``0.5 x erfc(-x/√2)``, and tf2onnx 1.17 has no ``Erfc``:
   `_erfc` rewrites it as ``1 - Erf``.
2. A probe run (2 texts x 8 tokens) finds the MatMuls that run once per token; only those are
   quantized. The per-text head (pooler, classifier: one row per text, a negligible share of
   the FLOPs, and where an error moves the answer most directly) stays fp32, and so do the
   embeddings (a Gather: nothing to speed up) and attention's activation x activation MatMuls.
3. ONNX Runtime's ``quantize_dynamic`` stores those weights as int8 with one scale per output
   channel (QInt8, ``per_channel``); their inputs are quantized to uint8 per call, from each
   tensor's range. Measured on the fine-tuned real-weights MiniLM (2,000 texts), top-label
   agreement with fp32: 91.2% with the defaults (per-tensor weights, embeddings and head
   quantized), 95.3% as here. Weights and activations are both 8-bit, so agreement depends on
   the model: measure it on yours (``bench/``) before serving int8.

Where the result lives: ``DIR/int8/`` when an explicit `export_int8` wrote it for the current
``saved_model/`` files, else a per-machine cache, ``$RAYPIPE_CACHE/int8/<key>/`` (default
``~/.cache/raypipe/int8/<key>/``), where the key hashes the SavedModel's files and this
module's recipe. A cache entry is built beside its final name and renamed into place under a
lock, so replicas starting together convert once and never see half a file. ``int8.json``
records the SHA-256 of ``model.onnx``: an entry that does not match, or that ONNX Runtime
cannot load, is converted again.

The fast path needs int8 dot products (VNNI or AMX); `serve_app.model.configure_precision`
refuses int8 on CPUs without them (ONNX Runtime's u8s8 kernels are slower there and can
saturate). Converting needs no particular CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from serve_app._tf import quiet_loggers, tensorflow
from serve_app.model import ModelDirError, load_serving_signature

__all__ = [
    "INT8_DIR",
    "Int8Error",
    "convert",
    "default_cache_dir",
    "export_int8",
    "int8_key",
    "load_int8_runner",
]

logger = logging.getLogger(__name__)

#: The model directory's own int8 build (written by `export_int8`).
INT8_DIR = "int8"
_MODEL = "model.onnx"
_META = "int8.json"
_FORMAT = "raypipe-int8/1"
#: Bump when the conversion changes: every cached build is then made again.
_RECIPE = {"recipe": 1, "opset": 17, "weights": "QInt8", "per_channel": True, "quantize": "per-token MatMul"}
_CACHE_ENV = "RAYPIPE_CACHE"
_INPUTS = ("input_ids", "attention_mask")
_OUTPUT = "probabilities"
# The probe's shape: per-token MatMuls see batch x length rows, the per-text head batch rows.
_PROBE_BATCH, _PROBE_LENGTH = 2, 8


class Int8Error(ModelDirError):
    """The int8 model cannot be built or loaded; ``path`` is the file or directory at fault."""


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$RAYPIPE_CACHE/int8``, else ``~/.cache/raypipe/int8``."""
    environ = os.environ if environ is None else environ
    root = environ.get(_CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "raypipe") / "int8"


def int8_key(saved_model: Path) -> str:
    """SHA-256 of the SavedModel's files (names and bytes) and the conversion recipe."""
    if not saved_model.is_dir():
        raise ModelDirError(saved_model, "missing saved_model directory")
    digest = hashlib.sha256(json.dumps(_RECIPE, sort_keys=True).encode())
    for path in sorted(p for p in saved_model.rglob("*") if p.is_file()):
        digest.update(f"\0{path.relative_to(saved_model).as_posix()}\0".encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def load_int8_runner(
    model_dir: Path | str,
    *,
    n_labels: int,
    threads: int = 0,
    cache_dir: Path | None = None,
) -> _OnnxRunner:
    """The int8 model of ``model_dir``, converted on first use (see the module docstring).

    ``threads``: ONNX Runtime intra-op threads (0: one per physical core), sized like the
    replica's TensorFlow pools. ``cache_dir``: default `default_cache_dir`.
    """
    model_dir = Path(model_dir)
    key = int8_key(model_dir / "saved_model")
    own = model_dir / INT8_DIR
    if (own / _META).exists():
        runner = _open_valid(own, key, n_labels=n_labels, threads=threads)
        if runner is not None:
            return runner
        logger.warning(
            "%s is not an int8 build of this saved_model/ (stale or damaged); using the cache. "
            "Run `raypipe model int8 %s --force` to rebuild it.",
            own,
            model_dir,
        )
    cache = (cache_dir or default_cache_dir()) / key
    runner = _open_valid(cache, key, n_labels=n_labels, threads=threads)
    if runner is not None:
        return runner
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Int8Error(
            cache.parent,
            f"cannot create the int8 cache ({e}): set {_CACHE_ENV} to a writable directory, "
            f"or build the model directory's own copy with `raypipe model int8 {model_dir}`",
        ) from e
    with _lock(cache.parent / f".{key}.lock"):
        # Another replica may have built it while this one waited for the lock.
        runner = _open_valid(cache, key, n_labels=n_labels, threads=threads)
        if runner is None:
            _build_into(cache, model_dir / "saved_model", key)
            runner = _open_valid(cache, key, n_labels=n_labels, threads=threads)
    if runner is None:
        raise Int8Error(cache / _MODEL, "the int8 model just built does not load")
    return runner


def export_int8(model_dir: Path | str, *, force: bool = False) -> Path:
    """Build ``model_dir/int8/`` (model.onnx + int8.json), so servers need not convert.

    An up-to-date build is kept unless ``force``. Returns the directory.
    """
    model_dir = Path(model_dir)
    key = int8_key(model_dir / "saved_model")
    out = model_dir / INT8_DIR
    if not force and _valid(out, key):
        return out
    _build_into(out, model_dir / "saved_model", key)
    return out


def convert(saved_model: Path, out: Path) -> dict[str, Any]:
    """Write the int8 ONNX model of ``saved_model`` to ``out``; returns what was done.

    Runs TensorFlow (to load and freeze the signature) in this process.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    started = time.monotonic()
    proto = _to_onnx(saved_model)
    per_token, per_text = _probe_matmuls(proto)
    fp32 = out.with_name(out.name + ".fp32")
    try:
        onnx.save(proto, str(fp32))
        del proto
        with quiet_loggers("", level=logging.ERROR):  # quantize_dynamic logs an unconditional root-logger hint
            quantize_dynamic(
                str(fp32),
                str(out),
                weight_type=QuantType.QInt8,
                per_channel=_RECIPE["per_channel"],
                op_types_to_quantize=["MatMul"],
                nodes_to_quantize=per_token,
            )
    finally:
        fp32.unlink(missing_ok=True)
    return {"quantized_matmuls": len(per_token), "fp32_matmuls": len(per_text), "seconds": time.monotonic() - started}


# -- internals ------------------------------------------------------------------------------


class _OnnxRunner:
    """Calls an ONNX Runtime session on numpy arrays (thread-safe, as sessions are)."""

    def __init__(self, session: Any, path: Path) -> None:
        self._session = session
        self.path = path

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        out = self._session.run([_OUTPUT], {_INPUTS[0]: input_ids, _INPUTS[1]: attention_mask})[0]
        return np.asarray(out, dtype=np.float32)


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle pool threads would spin on cores the replica's tokenizer thread and Ray share.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only; warnings name internal fusions
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _valid(directory: Path, key: str) -> bool:
    """Whether ``directory`` holds a complete int8 build for ``key`` (its bytes as recorded)."""
    try:
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("key") != key:
            return False
        return bool(meta.get("onnx_sha256") == _file_sha256(directory / _MODEL))
    except (OSError, ValueError):
        return False


def _open_valid(directory: Path, key: str, *, n_labels: int, threads: int) -> _OnnxRunner | None:
    if not _valid(directory, key):
        return None
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NotImplemented

    path = directory / _MODEL
    try:
        session = _session(path, threads)
    except (Fail, InvalidGraph, InvalidProtobuf, NotImplemented) as e:
        logger.warning("%s does not load (%s); converting again", path, e)
        return None
    _check_io(session, path, n_labels)
    return _OnnxRunner(session, path)


def _check_io(session: Any, path: Path, n_labels: int) -> None:
    inputs = {i.name: i.type for i in session.get_inputs()}
    if set(inputs) != set(_INPUTS) or any(t != "tensor(int32)" for t in inputs.values()):
        raise Int8Error(path, f"inputs must be int32 {list(_INPUTS)}, got {inputs}")
    outputs = {o.name: o.shape for o in session.get_outputs()}
    if _OUTPUT not in outputs:
        raise Int8Error(path, f"no {_OUTPUT!r} output (outputs: {sorted(outputs)})")
    width = outputs[_OUTPUT][-1] if outputs[_OUTPUT] else None
    if isinstance(width, int) and width != n_labels:
        raise Int8Error(path, f"model outputs {width} classes but model.json lists {n_labels} labels")


def _build_into(final: Path, saved_model: Path, key: str) -> None:
    """Convert into a temporary directory beside ``final``, then swap it into place."""
    import onnxruntime
    import tf2onnx

    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        logger.info("converting %s to int8 ONNX (once per SavedModel and machine)", saved_model)
        done = convert(saved_model, tmp / _MODEL)
        meta = {
            "format": _FORMAT,
            "key": key,
            "saved_model": str(saved_model.absolute()),
            "recipe": _RECIPE,
            "onnx_sha256": _file_sha256(tmp / _MODEL),
            "tf2onnx": tf2onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            **done,
        }
        (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        logger.info("int8 model ready in %.1f s: %s", done["seconds"], final)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _to_onnx(saved_model: Path) -> Any:
    tf = tensorflow()
    import tf2onnx

    _loaded, signature = load_serving_signature(saved_model, error=Int8Error)
    spec = [tf.TensorSpec([None, None], tf.int32, name=name) for name in _INPUTS]

    # A tf.function around the signature: tf2onnx freezes it, the loaded variables included.
    @tf.function(input_signature=spec)  # type: ignore[untyped-decorator, unused-ignore]
    def serve(input_ids: Any, attention_mask: Any) -> dict[str, Any]:
        return {_OUTPUT: signature(input_ids=input_ids, attention_mask=attention_mask)[_OUTPUT]}

    with quiet_loggers("tf2onnx", "absl", "tensorflow", level=logging.ERROR):
        try:
            proto, _ = tf2onnx.convert.from_function(
                serve, input_signature=spec, opset=_RECIPE["opset"], custom_op_handlers={"Erfc": (_erfc, [])}
            )
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            raise Int8Error(saved_model, f"tf2onnx cannot convert the signature: {e}") from e
    # tf2onnx leaves ops it cannot map as TensorFlow ops, which ONNX Runtime cannot run.
    foreign = sorted({n.op_type for n in proto.graph.node if n.domain not in ("", "ai.onnx", "com.microsoft")})
    if foreign:
        raise Int8Error(saved_model, f"tf2onnx cannot convert these TensorFlow ops to ONNX: {', '.join(foreign)}")
    return proto


def _erfc(ctx: Any, node: Any, name: str, args: list[Any]) -> None:
    """tf2onnx handler: ``Erfc(x)`` as ``1 - Erf(x)``."""
    from tf2onnx import utils

    node.type = "Erf"
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.array(1, dtype=np.float32))
    ctx.insert_new_node_on_output(
        "Sub", node.output[0], inputs=[one.output[0], node.output[0]], name=utils.make_name(f"{name}_sub")
    )


def _probe_matmuls(proto: Any) -> tuple[list[str], list[str]]:
    """Names of the weight MatMuls that see one row per token, and of those that see one per text."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    constants = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = tuple(numpy_helper.to_array(node.attribute[0].t).shape)
    weight_matmuls = [n for n in proto.graph.node if n.op_type == "MatMul" and len(constants.get(n.input[1], ())) == 2]
    watched = list(dict.fromkeys(n.input[0] for n in weight_matmuls))
    # The MatMuls' inputs as extra outputs, for one run (not a copy: a bert-base graph is 440 MB).
    kept = len(proto.graph.output)
    for name in watched:
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    try:
        serialized = proto.SerializeToString()
    finally:
        del proto.graph.output[kept:]
    session = ort.InferenceSession(serialized, providers=["CPUExecutionProvider"])
    del serialized
    ids = np.ones((_PROBE_BATCH, _PROBE_LENGTH), dtype=np.int32)
    outs = session.run(watched, {_INPUTS[0]: ids, _INPUTS[1]: np.ones_like(ids)})
    rows = {name: int(np.prod(out.shape[:-1])) for name, out in zip(watched, outs, strict=True)}
    per_token = [n.name for n in weight_matmuls if rows[n.input[0]] >= _PROBE_BATCH * _PROBE_LENGTH]
    per_text = [n.name for n in weight_matmuls if rows[n.input[0]] < _PROBE_BATCH * _PROBE_LENGTH]
    return per_token, per_text


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
