"""Bring your own model: export a fine-tuned checkpoint to a served model directory, and check one.

    raypipe model export --from-hf DIR OUT               # a local Hugging Face checkpoint
    raypipe model export --from-savedmodel DIR OUT --labels a,b,c --tokenizer DIR
    raypipe model check DIR

Both exports write the layout `serve_app.model` documents (``model.json`` + ``saved_model/`` +
``tokenizer/``) through `save_serving_model`, the one place the serving signature is defined
(the demo model is saved through it too). The card records where the model came from, its
labels, max length, vocabulary and parameter count; its version is a prefix plus the SHA-256
of the served weights, so the same weights exported from PyTorch or TF files get the same
version, and retrained weights a new one.

An export fails before it writes anything the server would reject: the directory is built
beside ``OUT``, loaded back through `EmotionModel` (the server's loader), checked at its limits
(`serve_app.model.check_model_limits`), compared with the source model on a few sentences, and
only then renamed into place.

Nothing here touches the network. Sources must be local directories (a Hub model id is an
error that says so), and every transformers loader runs with ``local_files_only``. PyTorch
weights are read from safetensors with numpy and converted to TF by transformers, so torch is
not needed. Errors are `ExportError` (a `ModelDirError`: the path at fault and the problem).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serve_app._tf import tensorflow
from serve_app.model import MODEL_FORMAT, EmotionModel, ModelCard, ModelDirError, check_model_limits, read_model_card

__all__ = [
    "SAMPLE_TEXTS",
    "SUPPORTED_MODEL_TYPES",
    "ExportError",
    "ModelCheck",
    "OutputKind",
    "check_model_dir",
    "export_hf_checkpoint",
    "export_saved_model",
    "save_hf_classifier",
    "save_serving_model",
]

logger = logging.getLogger(__name__)

#: Hugging Face ``model_type`` values that export, with the positions each reserves before
#: the first token (RoBERTa numbers positions from ``padding_idx + 1``).
SUPPORTED_MODEL_TYPES: dict[str, int] = {"bert": 0, "distilbert": 0, "electra": 0, "roberta": 2}

#: What `check_model_dir` classifies when given no texts; exports compare on them too.
SAMPLE_TEXTS: tuple[str, ...] = (
    "I passed my driving test on the first try and I'm so happy!",
    "My dog died last week and I still cry every time I see his empty bowl.",
    "I am so angry that my boss yelled at me in front of the whole team.",
    "The meeting moved to Thursday afternoon.",
    "We had waited for this trip for years, and when the plane finally landed I could not stop "
    "smiling, even though the rain had followed us all the way from home and the hotel had lost our booking.",
)

#: Whether a SavedModel's output holds logits (softmax is applied) or probabilities already.
OutputKind = Literal["auto", "logits", "probabilities"]

# Served probabilities must equal the source model's on the same tokens to this much.
_AGREEMENT = 1e-4
# A tokenizer's model_max_length above this is transformers' "no limit" sentinel.
_NO_LIMIT = 1_000_000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A Hub model id ("bert-base-uncased", "org/name"), as opposed to a filesystem path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_INPUT_ALIASES = {
    "input_ids": ("input_ids", "input_word_ids"),
    "attention_mask": ("attention_mask", "input_mask"),
    "token_type_ids": ("token_type_ids", "input_type_ids", "segment_ids"),
}


class ExportError(ModelDirError):
    """A source checkpoint cannot be exported; ``path`` is the file or directory at fault."""


# ---------------------------------------------------------------------------------------
# The serving signature
# ---------------------------------------------------------------------------------------


def save_serving_model(
    owner: Any,
    logits: Callable[[Any, Any], Any],
    path: Path | str,
    *,
    softmax: bool = True,
) -> None:
    """Save ``logits(input_ids, attention_mask)`` as a SavedModel with the serving signature.

    ``owner`` holds the variables ``logits`` reads (a Keras model, a loaded SavedModel); it is
    tracked so they are saved. The signature returns ``{"probabilities": float32[n, labels]}``:
    the softmax of the output, or the output itself when ``softmax`` is False.
    """
    tf = tensorflow()
    module = tf.Module()
    module.owner = owner
    spec = [
        tf.TensorSpec([None, None], tf.int32, name="input_ids"),
        tf.TensorSpec([None, None], tf.int32, name="attention_mask"),
    ]

    @tf.function(input_signature=spec)  # type: ignore[untyped-decorator, unused-ignore]
    def serve(input_ids: Any, attention_mask: Any) -> dict[str, Any]:
        out = tf.cast(logits(input_ids, attention_mask), tf.float32)
        return {"probabilities": tf.nn.softmax(out, axis=-1) if softmax else out}

    module.serve = serve
    tf.saved_model.save(module, str(path), signatures={"serving_default": serve.get_concrete_function()})


def save_hf_classifier(model: Any, path: Path | str) -> None:
    """Save a transformers TF sequence classifier with the serving signature."""
    save_serving_model(
        model,
        lambda input_ids, attention_mask: (
            model(input_ids=input_ids, attention_mask=attention_mask, training=False).logits
        ),
        path,
    )


# ---------------------------------------------------------------------------------------
# Export from a Hugging Face checkpoint
# ---------------------------------------------------------------------------------------


def export_hf_checkpoint(
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    *,
    labels: Sequence[str] | None = None,
    tokenizer_dir: Path | str | None = None,
    max_sequence_length: int | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a local Hugging Face sequence-classification checkpoint; return ``out_dir``.

    Reads ``config.json`` (architecture, ``id2label``), the tokenizer (from the checkpoint, or
    ``tokenizer_dir``) and the weights: ``tf_model.h5`` or TF safetensors as they are,
    PyTorch ``model.safetensors`` (sharded too) converted to TF. ``labels`` replaces the
    config's label names; ``max_sequence_length`` lowers the model's limit; ``name`` is the
    version's prefix (default: model type and size, e.g. ``bert-6x384``).
    """
    src = _local_dir(checkpoint_dir, "Hugging Face checkpoint")
    config = _read_hf_config(src)
    served_labels = _hf_labels(config, labels, src / "config.json")
    tokenizer = _load_source_tokenizer(src if tokenizer_dir is None else _local_dir(tokenizer_dir, "tokenizer"))
    vocab = _vocabulary_size(tokenizer)
    if vocab > config.vocab_size:
        raise ExportError(
            src if tokenizer_dir is None else Path(tokenizer_dir),
            f"the tokenizer produces token ids up to {vocab - 1} but config.json's vocab_size is "
            f"{config.vocab_size}: the tokenizer belongs to another model",
        )
    capacity = config.max_position_embeddings - SUPPORTED_MODEL_TYPES[config.model_type]
    max_len = _max_length(max_sequence_length, capacity, tokenizer, src / "config.json")
    prefix = _check_name(name) or f"{config.model_type}-{config.num_hidden_layers}x{config.hidden_size}"
    weights = _find_weights(src)
    model = _load_hf_model(src, config, weights)

    def reference(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.asarray(model(input_ids=ids, attention_mask=mask, training=False).logits)

    source = {
        "kind": "huggingface",
        "path": str(src),
        "model_type": config.model_type,
        "weights": weights.describe(),
        "max_position_embeddings": config.max_position_embeddings,
    }
    with _building(Path(out_dir), overwrite=overwrite, source=src) as tmp:
        save_hf_classifier(model, tmp / "saved_model")
        _finish(tmp, tokenizer, served_labels, max_len, prefix, source, reference, softmax=True)
    return Path(out_dir).absolute()


@dataclass(frozen=True)
class _Weights:
    framework: Literal["tf", "pt"]
    files: tuple[Path, ...]

    def describe(self) -> str:
        kind = "TensorFlow" if self.framework == "tf" else "PyTorch"
        return f"{self.files[0].name}{f' (+{len(self.files) - 1} shards)' if len(self.files) > 1 else ''} ({kind})"


def _read_hf_config(src: Path) -> Any:
    path = src / "config.json"
    if not path.is_file():
        raise ExportError(path, "missing config.json: not a Hugging Face checkpoint directory")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(src), local_files_only=True)  # type: ignore[no-untyped-call, unused-ignore]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(path, f"cannot read config.json: {e}") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ExportError(
            path,
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    if getattr(config, "problem_type", None) == "multi_label_classification":
        raise ExportError(
            path,
            "a multi-label classifier (problem_type=multi_label_classification) needs sigmoid "
            "outputs; raypipe serves single-label (softmax) classifiers",
        )
    return config


def _hf_labels(config: Any, override: Sequence[str] | None, config_path: Path) -> tuple[str, ...]:
    width = int(config.num_labels)
    if width < 2:
        raise ExportError(config_path, f"num_labels is {width}: a regression head, not a classifier")
    if override is not None:
        labels = tuple(override)
        if len(labels) != width:
            raise ExportError(config_path, f"{len(labels)} labels given but the classifier has {width} outputs")
    else:
        id2label = {int(k): v for k, v in config.id2label.items()}
        if sorted(id2label) != list(range(width)):
            raise ExportError(config_path, f"id2label must name outputs 0..{width - 1}, got ids {sorted(id2label)}")
        labels = tuple(str(id2label[i]) for i in range(width))
        if labels == tuple(f"LABEL_{i}" for i in range(width)):
            logger.warning("%s has generic label names (LABEL_0, ...); pass labels to name them", config_path)
    return _check_labels(labels, config_path)


def _find_weights(src: Path) -> _Weights:
    if (src / "tf_model.h5").is_file():
        return _Weights("tf", (src / "tf_model.h5",))
    for index_name, single in (("model.safetensors.index.json", None), (None, "model.safetensors")):
        if single is not None and (src / single).is_file():
            files: tuple[Path, ...] = (src / single,)
        elif index_name is not None and (src / index_name).is_file():
            files = _shards(src / index_name)
        else:
            continue
        fmt = _safetensors_format(files[0])
        if fmt not in ("pt", "tf"):
            raise ExportError(files[0], f"safetensors weights of format {fmt!r}; expected PyTorch ('pt') or TF")
        return _Weights("tf" if fmt == "tf" else "pt", files)
    if any((src / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise ExportError(
            src / "pytorch_model.bin",
            "PyTorch pickle weights need torch to read, which raypipe does not install: save the "
            "checkpoint as safetensors (model.save_pretrained(dir, safe_serialization=True)) and export that",
        )
    raise ExportError(src, "no weights found: expected model.safetensors, model.safetensors.index.json or tf_model.h5")


def _shards(index: Path) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(index, f"cannot read the shard index: {e}") from e
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing or not names:
        raise ExportError(index, f"shard files missing: {', '.join(missing) or 'the index lists none'}")
    return tuple(index.parent / n for n in names)


def _safetensors_format(path: Path) -> str:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise ExportError(path, f"cannot read safetensors file: {e}") from e
    # PyTorch's save_pretrained writes {"format": "pt"}; files without metadata come from torch too.
    return str(metadata.get("format", "pt"))


def _load_hf_model(src: Path, config: Any, weights: _Weights) -> Any:
    tf = tensorflow()
    from transformers import TFAutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    at = weights.files[0]
    # We report missing and unused weights ourselves, as errors; transformers' own advice
    # ("You should probably TRAIN this model...") would only confuse a CLI user.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if weights.framework == "tf":
            model, info = TFAutoModelForSequenceClassification.from_pretrained(
                str(src),
                config=config,
                local_files_only=True,
                output_loading_info=True,
                use_safetensors=at.suffix == ".safetensors",
            )
        else:
            from safetensors import SafetensorError
            from safetensors.numpy import load_file
            from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

            state: dict[str, np.ndarray] = {}
            for shard in weights.files:
                try:
                    state.update(load_file(str(shard)))
                except (OSError, SafetensorError, TypeError) as e:
                    raise ExportError(shard, f"cannot read PyTorch weights: {e}") from e
            model = TFAutoModelForSequenceClassification.from_config(config)
            model, info = load_pytorch_state_dict_in_tf2_model(
                model, state, allow_missing_keys=True, output_loading_info=True
            )
    except (OSError, ValueError, KeyError, TypeError, tf.errors.OpError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(at, f"weights do not load into a {config.model_type} classifier: {first_line}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info["missing_keys"] if "dropout" not in k]
    if missing:
        prefix = model.base_model_prefix
        if all(not k.startswith(prefix) for k in missing):
            raise ExportError(
                at,
                f"no trained classification head ({', '.join(missing)} missing): a base model, not a "
                "fine-tuned classifier; fine-tune it for sequence classification first",
            )
        raise ExportError(at, f"weights missing for {len(missing)} layers, e.g. {', '.join(missing[:3])}")
    unused = [k for k in info["unexpected_keys"] if "dropout" not in k]
    if unused:
        logger.warning("%s: %d weights not used by the classifier, e.g. %s", at, len(unused), ", ".join(unused[:3]))
    return model


# ---------------------------------------------------------------------------------------
# Export from a TF SavedModel
# ---------------------------------------------------------------------------------------


def export_saved_model(
    saved_model_dir: Path | str,
    out_dir: Path | str,
    *,
    labels: Sequence[str],
    tokenizer_dir: Path | str,
    signature: str = "serving_default",
    output: str | None = None,
    output_kind: OutputKind = "auto",
    max_sequence_length: int | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a TF SavedModel (e.g. one built for TF Serving) with its tokenizer; return ``out_dir``.

    The ``signature`` may name its inputs ``input_ids``/``input_word_ids``,
    ``attention_mask``/``input_mask`` and optionally ``token_type_ids``/``input_type_ids``/
    ``segment_ids`` (fed zeros), as int32 or int64, of any or a fixed length (shorter inputs
    are padded to it). It serves ``output`` (default: ``probabilities``, else ``logits``, else
    the only output); ``output_kind`` says whether that holds logits or probabilities
    (``auto``: probed). ``labels`` name its columns in order.
    """
    src = _local_dir(saved_model_dir, "SavedModel")
    if not any((src / f).is_file() for f in ("saved_model.pb", "saved_model.pbtxt")):
        raise ExportError(src, "no saved_model.pb: not a TF SavedModel directory")
    served_labels = _check_labels(tuple(labels), src)
    tok_dir = _local_dir(tokenizer_dir, "tokenizer")
    tokenizer = _load_source_tokenizer(tok_dir)
    prefix = _check_name(name) or "savedmodel"
    if output_kind not in ("auto", "logits", "probabilities"):
        raise ValueError(f"output_kind must be auto, logits or probabilities, not {output_kind!r}")
    tf = tensorflow()
    try:
        loaded = tf.saved_model.load(str(src))
    except (OSError, ValueError, tf.errors.OpError) as e:
        raise ExportError(src, f"cannot load SavedModel: {e}") from e
    fn = loaded.signatures.get(signature)
    if fn is None:
        available = ", ".join(sorted(loaded.signatures)) or "none"
        raise ExportError(src, f"SavedModel has no signature {signature!r} (it has: {available})")
    adapter = _SignatureAdapter(fn, src, signature=signature, output=output)
    capacity = adapter.fixed_length or _NO_LIMIT
    max_len = _max_length(max_sequence_length, capacity, tokenizer, src, need_limit=adapter.fixed_length is None)

    probe = np.full((2, 4), _any_token_id(tokenizer), dtype=np.int32)
    probe[1, 0] = 0  # two different rows, so a constant output cannot pass as probabilities
    try:
        out = np.asarray(adapter(probe, np.ones_like(probe)))
    except (tf.errors.OpError, ValueError, TypeError) as e:
        raise ExportError(src, f"signature {signature!r} fails on a small input: {e}") from e
    if out.ndim != 2 or out.shape[1] != len(served_labels):
        raise ExportError(
            src,
            f"signature output {adapter.output!r} has shape {list(out.shape)} for 2 rows: "
            f"it must have one column per label ({len(served_labels)} labels given)",
        )
    softmax = _needs_softmax(output_kind, adapter.output, out)

    def reference(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.asarray(adapter(ids, mask))

    source = {
        "kind": "savedmodel",
        "path": str(src),
        "signature": signature,
        "output": adapter.output,
        "output_kind": "logits" if softmax else "probabilities",
    }
    with _building(Path(out_dir), overwrite=overwrite, source=src) as tmp:
        save_serving_model(loaded, adapter, tmp / "saved_model", softmax=softmax)
        _finish(tmp, tokenizer, served_labels, max_len, prefix, source, reference, softmax=softmax)
    return Path(out_dir).absolute()


class _SignatureAdapter:
    """Calls a foreign serving signature with the served signature's (input_ids, attention_mask)."""

    def __init__(self, fn: Any, src: Path, *, signature: str, output: str | None) -> None:
        tf = tensorflow()
        self._fn = fn
        _, inputs = fn.structured_input_signature
        self._inputs: dict[str, tuple[str, Any]] = {}  # role -> (input name, dtype)
        lengths: set[int] = set()
        for role, aliases in _INPUT_ALIASES.items():
            found = [a for a in aliases if a in inputs]
            if not found:
                continue
            spec = inputs[found[0]]
            if spec.dtype not in (tf.int32, tf.int64) or spec.shape.rank != 2:
                raise ExportError(src, f"signature input {found[0]!r} must be int32/int64 [batch, length], got {spec}")
            if spec.shape[1] is not None:
                lengths.add(int(spec.shape[1]))
            self._inputs[role] = (found[0], spec.dtype)
        known = {name for name, _ in self._inputs.values()}
        unknown = sorted(set(inputs) - known)
        if unknown:
            raise ExportError(src, f"signature {signature!r} takes inputs raypipe cannot feed: {', '.join(unknown)}")
        for role in ("input_ids", "attention_mask"):
            if role not in self._inputs:
                raise ExportError(
                    src,
                    f"signature {signature!r} has no {' or '.join(_INPUT_ALIASES[role])} input (it takes "
                    f"{', '.join(sorted(inputs))}); the server pads batches, so it needs token ids and an "
                    "attention mask",
                )
        if len(lengths) > 1:
            raise ExportError(src, f"signature inputs have different fixed lengths: {sorted(lengths)}")
        self.fixed_length: int | None = lengths.pop() if lengths else None
        outputs = fn.structured_outputs
        if output is None:
            names = [n for n in ("probabilities", "logits") if n in outputs] or (
                list(outputs) if len(outputs) == 1 else []
            )
            if not names:
                raise ExportError(src, f"signature has several outputs ({', '.join(sorted(outputs))}): choose one")
            output = names[0]
        elif output not in outputs:
            raise ExportError(src, f"signature has no output {output!r} (it has: {', '.join(sorted(outputs))})")
        self.output: str = output

    def __call__(self, input_ids: Any, attention_mask: Any) -> Any:
        tf = tensorflow()
        input_ids = tf.convert_to_tensor(input_ids, tf.int32)
        attention_mask = tf.convert_to_tensor(attention_mask, tf.int32)
        if self.fixed_length is not None:
            pad = [[0, 0], [0, self.fixed_length - tf.shape(input_ids)[1]]]
            input_ids = tf.pad(input_ids, pad)
            attention_mask = tf.pad(attention_mask, pad)
        values = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": tf.zeros_like(input_ids)}
        feed = {name: tf.cast(values[role], dtype) for role, (name, dtype) in self._inputs.items()}
        return self._fn(**feed)[self.output]


def _needs_softmax(kind: OutputKind, output: str, sample: np.ndarray) -> bool:
    if kind != "auto":
        return kind == "logits"
    if output in ("logits", "probabilities"):
        return output == "logits"
    looks_like_probabilities = bool((sample >= 0).all() and np.allclose(sample.sum(axis=1), 1.0, atol=1e-3))
    logger.info("output %r looks like %s", output, "probabilities" if looks_like_probabilities else "logits")
    return not looks_like_probabilities


# ---------------------------------------------------------------------------------------
# Shared steps
# ---------------------------------------------------------------------------------------


def _local_dir(path: Path | str, what: str) -> Path:
    text = str(path)
    p = Path(text).expanduser()
    if p.is_dir():
        return p.absolute()
    if text.startswith(("hf://", "http://", "https://")) or (not p.exists() and _HUB_ID.fullmatch(text)):
        raise ExportError(
            text,
            f"no local {what} directory of that name, and raypipe never downloads models: if this is a "
            f"Hugging Face Hub model id, download it first (e.g. `huggingface-cli download {text} "
            "--local-dir DIR`) and pass DIR",
        )
    raise ExportError(text, f"{what} directory does not exist or is not a directory")


def _load_source_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call, unused-ignore]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(path, f"cannot load a tokenizer from here: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(path, "the tokenizer must be a fast (Rust) tokenizer: add tokenizer.json")
    return tokenizer


def _vocabulary_size(tokenizer: Any) -> int:
    """Size of the id space the tokenizer uses: its largest id + 1 (ids may have holes)."""
    return max(tokenizer.get_vocab().values()) + 1


def _any_token_id(tokenizer: Any) -> int:
    unk = tokenizer.unk_token_id
    return int(unk) if unk is not None and unk != tokenizer.pad_token_id else 0


def _max_length(requested: int | None, capacity: int, tokenizer: Any, where: Path, *, need_limit: bool = False) -> int:
    tokenizer_limit = int(tokenizer.model_max_length) if tokenizer.model_max_length < _NO_LIMIT else None
    if requested is None:
        if need_limit and tokenizer_limit is None:
            raise ExportError(where, "cannot tell the model's maximum length: pass max_sequence_length")
        return min(capacity, tokenizer_limit or capacity)
    if requested > capacity:
        raise ExportError(where, f"max length {requested} is beyond the model's {capacity} positions")
    if requested < 3:
        raise ExportError(where, f"max length must be at least 3, got {requested}")
    return requested


def _check_labels(labels: tuple[str, ...], where: Path) -> tuple[str, ...]:
    try:
        ModelCard(labels=labels, version="x", max_sequence_length=3)
    except ValueError as e:
        raise ExportError(where, str(e)) from e
    return labels


def _check_name(name: str | None) -> str | None:
    if name is not None and not _NAME.fullmatch(name):
        raise ValueError(f"name must be letters, digits, '.', '_' or '-', got {name!r}")
    return name


@contextmanager
def _building(out_dir: Path, *, overwrite: bool, source: Path) -> Iterator[Path]:
    """A fresh directory beside ``out_dir``, renamed into place only if the block succeeds."""
    out = out_dir.absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ExportError(out, "already exists; pass overwrite=True (--force) to replace it")
    if out == source or source in out.parents:
        raise ExportError(out, f"the output must not be inside the source {source}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _finish(
    tmp: Path,
    tokenizer: Any,
    labels: tuple[str, ...],
    max_len: int,
    prefix: str,
    source: dict[str, Any],
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    softmax: bool,
) -> None:
    """Tokenizer + card beside the saved signature, then prove the directory serves what the source computes."""
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    digest, parameters = _weights_digest(tmp / "saved_model")
    card = {
        "format": MODEL_FORMAT,
        "labels": list(labels),
        "version": f"{prefix}-{digest[:12]}",
        "max_sequence_length": max_len,
        "vocab_size": _vocabulary_size(tokenizer),
        "parameters": parameters,
        "weights_sha256": digest,
        "source": source,
    }
    (tmp / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")

    served = check_model_dir(tmp, SAMPLE_TEXTS).probabilities
    expected = np.empty_like(served)
    for i, text in enumerate(SAMPLE_TEXTS):
        ids = np.asarray([tokenizer(text, truncation=True, max_length=max_len)["input_ids"]], dtype=np.int32)
        out = reference(ids, np.ones_like(ids))
        expected[i] = _softmax(out)[0] if softmax else out[0]
    worst = float(np.abs(served - expected).max())
    if worst > _AGREEMENT:
        raise ExportError(
            tmp, f"the exported model differs from the source by up to {worst:.2e} (allowed {_AGREEMENT:g})"
        )
    logger.info("exported %s: %s, served = source within %.1e", card["version"], source["path"], worst)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


def _weights_digest(saved_model: Path) -> tuple[str, int]:
    """SHA-256 of a SavedModel's variables (names, dtypes, shapes, values) and its parameter count."""
    tf = tensorflow()
    reader = tf.train.load_checkpoint(str(saved_model / "variables" / "variables"))
    dtypes = reader.get_variable_to_dtype_map()
    digest = hashlib.sha256()
    parameters = 0
    for key in sorted(reader.get_variable_to_shape_map()):
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":  # serialised object graph, not a weight
            continue
        value = np.ascontiguousarray(reader.get_tensor(key))
        digest.update(f"{key}|{value.dtype}|{value.shape}|".encode())
        digest.update(value.tobytes())
        if dtypes[key].is_floating:
            parameters += value.size
    return digest.hexdigest(), parameters


# ---------------------------------------------------------------------------------------
# Check
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCheck:
    """A model directory that loaded as the server loads it, with predictions for some texts."""

    model_dir: Path
    card: dict[str, Any]
    """``model.json`` as written (export adds source, vocabulary and parameter count)."""
    texts: tuple[str, ...]
    probabilities: np.ndarray
    """float32 ``[len(texts), len(labels)]``."""

    def render(self) -> str:
        labels = list(self.card["labels"])
        source = self.card.get("source")
        lines = [
            f"model       {self.model_dir}",
            f"version     {self.card['version']}",
            f"labels      {', '.join(labels)}",
            f"max length  {self.card['max_sequence_length']} tokens",
        ]
        if "vocab_size" in self.card:
            lines.append(f"vocabulary  {self.card['vocab_size']:,} tokens")
        if "parameters" in self.card:
            lines.append(f"parameters  {self.card['parameters']:,}")
        if isinstance(source, dict):
            details = ", ".join(f"{k}={v}" for k, v in source.items() if k not in ("kind", "path"))
            lines.append(f"source      {source.get('kind')}: {source.get('path')} ({details})")
        width = max(8, *(len(label) for label in labels))
        lines += ["", "  ".join(label.rjust(width) for label in labels) + "  text"]
        for text, row in zip(self.texts, self.probabilities, strict=True):
            shown = text if len(text) <= 60 else text[:57] + "..."
            lines.append("  ".join(f"{p:.4f}".rjust(width) for p in row) + f"  {shown}")
        return "\n".join(lines)


def check_model_dir(model_dir: Path | str, texts: Sequence[str] | None = None) -> ModelCheck:
    """Load ``model_dir`` as the server does, check it at its limits, classify ``texts``.

    Raises `ModelDirError` naming the part at fault: an unreadable card, a missing
    ``serving_default`` signature, a label count that differs from the output width, a
    tokenizer that does not belong to the model, a max length beyond the position embeddings.
    """
    model_dir = Path(model_dir).absolute()
    read_model_card(model_dir)  # validated; the raw JSON keeps the export's extra fields
    raw = json.loads((model_dir / "model.json").read_text(encoding="utf-8"))
    model = EmotionModel.load(model_dir)
    vocab_size = raw.get("vocab_size")
    check_model_limits(model, model_dir, vocab_size=vocab_size if isinstance(vocab_size, int) else None)
    chosen = tuple(SAMPLE_TEXTS if texts is None else texts)
    return ModelCheck(model_dir, raw, chosen, model.predict(chosen).probabilities)
