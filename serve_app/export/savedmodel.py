"""Export from a TF SavedModel, e.g. one built for TF Serving, plus its tokenizer and labels.

The source signature is adapted to the served one rather than required to match it: common
input names (TF Hub / Model Garden BERT's ``input_word_ids``, ``input_mask``, ``input_type_ids``),
int64 inputs, a fixed sequence length (shorter batches are padded to it), and logits or
probabilities under any output name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serve_app._tf import tensorflow
from serve_app.export._common import (
    NO_LIMIT,
    ExportError,
    any_token_id,
    building,
    check_labels,
    check_name,
    finish,
    load_source_tokenizer,
    local_dir,
    measure_runtimes,
    resolve_max_length,
)
from serve_app.export.signature import save_serving_model

__all__ = ["OutputKind", "export_saved_model"]

logger = logging.getLogger("serve_app.export")

#: Whether a SavedModel's output holds logits (softmax is applied) or probabilities already.
OutputKind = Literal["auto", "logits", "probabilities"]

_INPUT_ALIASES = {
    "input_ids": ("input_ids", "input_word_ids"),
    "attention_mask": ("attention_mask", "input_mask"),
    "token_type_ids": ("token_type_ids", "input_type_ids", "segment_ids"),
}


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
    measure: bool = True,
) -> Path:
    """Export a TF SavedModel (e.g. one built for TF Serving) with its tokenizer; return ``out_dir``.

    The ``signature`` may name its inputs ``input_ids``/``input_word_ids``,
    ``attention_mask``/``input_mask`` and optionally ``token_type_ids``/``input_type_ids``/
    ``segment_ids`` (fed zeros), as int32 or int64, of any or a fixed length (shorter inputs
    are padded to it). It serves ``output`` (default: ``probabilities``, else ``logits``, else
    the only output); ``output_kind`` says whether that holds logits or probabilities
    (``auto``: probed). ``labels`` name its columns in order.
    """
    src = local_dir(saved_model_dir, "SavedModel")
    if not any((src / f).is_file() for f in ("saved_model.pb", "saved_model.pbtxt")):
        raise ExportError(src, "no saved_model.pb: not a TF SavedModel directory")
    served_labels = check_labels(tuple(labels), src)
    tok_dir = local_dir(tokenizer_dir, "tokenizer")
    tokenizer = load_source_tokenizer(tok_dir)
    prefix = check_name(name) or "savedmodel"
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
    capacity = adapter.fixed_length or NO_LIMIT
    max_len = resolve_max_length(max_sequence_length, capacity, tokenizer, src, need_limit=adapter.fixed_length is None)

    probe = np.full((2, 4), any_token_id(tokenizer), dtype=np.int32)
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
    with building(Path(out_dir), overwrite=overwrite, source=src) as tmp:
        save_serving_model(loaded, adapter, tmp / "saved_model", softmax=softmax)
        finish(tmp, tokenizer, served_labels, max_len, prefix, source, reference, softmax=softmax)
        if measure:
            measure_runtimes(tmp)
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
