"""Random-weight BERTs of real shapes, as model directories the server loads, cached by shape.

Throughput does not depend on the weights, only on the shape, so the benchmark builds
bert-base (12x768) and MiniLM-L6 (6x384) from random weights with the demo tokenizer (the
vocabulary size matches it) in exactly the layout `serve_app.model` reads. Builds run in a
child process (TensorFlow's settings are process-wide) and land under
``.cache/bench-models/<shape>-<key>/``; a directory with ``model.json`` is a finished build.

Agreement between precisions needs a trained model instead: `ensure_real_weights_model` exports
the fine-tuned real-weights MiniLM the tests build (`tests.hf_checkpoints.minilm_emotion`:
pretrained MiniLM-L6 with an emotion head) to ``.cache/bench-models/minilm-emotion-<key>/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.flops import Shape

__all__ = ["SHAPES", "ensure_model", "ensure_real_weights_model"]

#: bert-base keeps its 512 positions; MiniLM-L6 is served at 256, the length
#: sentence-transformers' all-MiniLM-L6-v2 was trained and is used at.
SHAPES: dict[str, Shape] = {
    "bert-base": Shape("bert-base", layers=12, hidden=768, heads=12, intermediate=3072, max_length=512),
    "minilm-l6": Shape("minilm-l6", layers=6, hidden=384, heads=12, intermediate=1536, max_length=256),
}
_BUILD_VERSION = 1


def _key(shape: Shape, tokenizer_dir: Path) -> str:
    vocab = (tokenizer_dir / "vocab.txt").read_bytes()
    blob = json.dumps({"shape": shape.to_dict(), "v": _BUILD_VERSION}, sort_keys=True).encode() + vocab
    return hashlib.sha256(blob).hexdigest()[:10]


def ensure_model(shape: Shape, *, demo_model_dir: Path, cache: Path, env: dict[str, str] | None = None) -> Path:
    """The model directory for ``shape`` (built on first use, ~20-60 s for bert-base)."""
    tokenizer = demo_model_dir / "tokenizer"
    out = cache / f"{shape.name}-{_key(shape, tokenizer)}"
    if (out / "model.json").is_file():
        return out
    tmp = cache / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        cmd = [sys.executable, "-m", "bench.models", json.dumps(shape.to_dict()), str(tokenizer), str(tmp)]
        subprocess.run(cmd, check=True, env=env)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_real_weights_model(*, cache: Path, env: dict[str, str] | None = None) -> Path | None:
    """The exported real-weights MiniLM emotion model (None when its weights package is absent)."""
    from tests import hf_checkpoints as ck

    package = ck.minilm_package_version()
    if not package:
        return None
    blob = json.dumps({"recipe": ck.MINILM_RECIPE, "package": package, "max_length": _REAL_MAX_LENGTH}, sort_keys=True)
    out = cache / f"minilm-emotion-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"
    if (out / "model.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "bench.models", "--real-weights", str(out)]
    subprocess.run(cmd, check=True, env=env)
    return out


# The length test_byom serves it at: the corpus' median paragraph is ~60 tokens.
_REAL_MAX_LENGTH = 128


def _export_real_weights(out: Path) -> None:
    from serve_app.export import export_hf_checkpoint
    from tests import hf_checkpoints as ck

    export_hf_checkpoint(ck.minilm_emotion().tf_dir, out, max_sequence_length=_REAL_MAX_LENGTH, overwrite=True)


def _build(shape: Shape, tokenizer_dir: Path, out: Path) -> None:
    import numpy as np

    from serve_app._tf import tensorflow

    tf = tensorflow()
    import tf_keras
    from transformers import AutoTokenizer, BertConfig, TFBertForSequenceClassification

    from serve_app import demo_data
    from serve_app.model import MODEL_FORMAT

    tf_keras.utils.set_random_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_length,
        num_labels=shape.labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = TFBertForSequenceClassification(config)
    model(input_ids=np.ones((1, 8), np.int32), attention_mask=np.ones((1, 8), np.int32))

    class Serving(tf.Module):  # type: ignore[name-defined]
        def __init__(self, classifier: Any) -> None:
            super().__init__()
            self.classifier = classifier

        @tf.function(
            input_signature=[
                tf.TensorSpec([None, None], tf.int32, name="input_ids"),
                tf.TensorSpec([None, None], tf.int32, name="attention_mask"),
            ]
        )
        def serve(self, input_ids: Any, attention_mask: Any) -> dict[str, Any]:
            logits = self.classifier(input_ids=input_ids, attention_mask=attention_mask, training=False).logits
            return {"probabilities": tf.nn.softmax(logits, axis=-1)}

    serving = Serving(model)
    out.mkdir(parents=True)
    tf.saved_model.save(
        serving, str(out / "saved_model"), signatures={"serving_default": serving.serve.get_concrete_function()}
    )
    shutil.copytree(tokenizer_dir, out / "tokenizer")
    card = {
        "format": MODEL_FORMAT,
        "labels": list(demo_data.LABELS[: shape.labels]),
        "version": f"bench-random-{shape.name}-{shape.layers}x{shape.hidden}-L{shape.max_length}",
        "max_sequence_length": shape.max_length,
    }
    (out / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1] == "--real-weights":
        _export_real_weights(Path(sys.argv[2]))
    else:
        _build(Shape(**json.loads(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3]))
