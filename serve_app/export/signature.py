"""The serving signature, defined once: every model directory's SavedModel is saved here.

``serving_default``: ``(input_ids int32[None, None], attention_mask int32[None, None]) ->
{"probabilities": float32[None, n_labels]}`` (see `serve_app.model`). The demo model, Hugging
Face exports and adapted SavedModels all go through `save_serving_model`, so the server meets
one signature whatever the model's origin. `weights_digest` hashes what was saved: the model
version an export writes is derived from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from serve_app._tf import quiet_loggers, tensorflow

__all__ = ["save_hf_classifier", "save_serving_model", "weights_digest"]


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
    with quiet_loggers("absl", "tensorflow"):  # per-save INFO lines on renamed captures and assets
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


def weights_digest(saved_model: Path) -> tuple[str, int]:
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
