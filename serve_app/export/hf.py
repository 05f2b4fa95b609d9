"""Export from a local Hugging Face checkpoint: config.json + tokenizer + TF or PyTorch weights.

TF weights (``tf_model.h5``, TF safetensors) load through transformers' ``from_pretrained``.
PyTorch safetensors (single or sharded) are read with numpy and converted to the TF model by
transformers' ``load_pytorch_state_dict_in_tf2_model``: no torch needed (``from_pretrained``
itself cannot read them in transformers 4.57). Missing weights are errors, never random init.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serve_app._tf import tensorflow
from serve_app.export._common import (
    ExportError,
    building,
    check_labels,
    check_name,
    finish,
    load_source_tokenizer,
    local_dir,
    measure_runtimes,
    resolve_max_length,
    vocabulary_size,
)
from serve_app.export.signature import save_hf_classifier

__all__ = ["SUPPORTED_MODEL_TYPES", "export_hf_checkpoint"]

logger = logging.getLogger("serve_app.export")

#: Hugging Face ``model_type`` values that export, with the positions each reserves before
#: the first token (RoBERTa numbers positions from ``padding_idx + 1``).
SUPPORTED_MODEL_TYPES: dict[str, int] = {"bert": 0, "distilbert": 0, "electra": 0, "roberta": 2}


def export_hf_checkpoint(
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    *,
    labels: Sequence[str] | None = None,
    tokenizer_dir: Path | str | None = None,
    max_sequence_length: int | None = None,
    name: str | None = None,
    overwrite: bool = False,
    measure: bool = True,
) -> Path:
    """Export a local Hugging Face sequence-classification checkpoint; return ``out_dir``.

    Reads ``config.json`` (architecture, ``id2label``), the tokenizer (from the checkpoint, or
    ``tokenizer_dir``) and the weights: ``tf_model.h5`` or TF safetensors as they are,
    PyTorch ``model.safetensors`` (sharded too) converted to TF. ``labels`` replaces the
    config's label names; ``max_sequence_length`` lowers the model's limit; ``name`` is the
    version's prefix (default: model type and size, e.g. ``bert-6x384``).
    """
    src = local_dir(checkpoint_dir, "Hugging Face checkpoint")
    config = _read_hf_config(src)
    served_labels = _hf_labels(config, labels, src / "config.json")
    tokenizer = load_source_tokenizer(src if tokenizer_dir is None else local_dir(tokenizer_dir, "tokenizer"))
    vocab = vocabulary_size(tokenizer)
    if vocab > config.vocab_size:
        raise ExportError(
            src if tokenizer_dir is None else Path(tokenizer_dir),
            f"the tokenizer produces token ids up to {vocab - 1} but config.json's vocab_size is "
            f"{config.vocab_size}: the tokenizer belongs to another model",
        )
    capacity = config.max_position_embeddings - SUPPORTED_MODEL_TYPES[config.model_type]
    max_len = resolve_max_length(max_sequence_length, capacity, tokenizer, src / "config.json")
    prefix = check_name(name) or f"{config.model_type}-{config.num_hidden_layers}x{config.hidden_size}"
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
    with building(Path(out_dir), overwrite=overwrite, source=src) as tmp:
        save_hf_classifier(model, tmp / "saved_model")
        finish(tmp, tokenizer, served_labels, max_len, prefix, source, reference, softmax=True)
        if measure:
            measure_runtimes(tmp)
    return Path(out_dir).absolute()


@dataclass(frozen=True)
class _Weights:
    framework: Literal["tf", "pt"]
    files: tuple[Path, ...]

    def describe(self) -> str:
        kind = "TensorFlow" if self.framework == "tf" else "PyTorch"
        if len(self.files) > 1:
            return f"{len(self.files)} safetensors shards ({kind})"
        return f"{self.files[0].name} ({kind})"


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
    return check_labels(labels, config_path)


def _find_weights(src: Path) -> _Weights:
    if (src / "tf_model.h5").is_file():
        return _Weights("tf", (src / "tf_model.h5",))
    files: tuple[Path, ...] = ()
    if (src / "model.safetensors").is_file():
        files = (src / "model.safetensors",)
    elif (src / "model.safetensors.index.json").is_file():
        files = _shards(src / "model.safetensors.index.json")
    if files:
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
    except ExportError:
        raise
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
