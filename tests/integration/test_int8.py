"""``precision: int8`` on real pretrained weights and through the real Serve app.

- The fine-tuned real-weights MiniLM (`tests.hf_checkpoints.minilm_emotion`), exported and
  converted to int8, must stay close to its fp32 answers. 8-bit activations move this model
  more than the demo model (its head was trained on frozen features, so its margins are
  narrow): the bound here catches a broken conversion, not a quality target (the bench
  measures agreement on 2,000 texts).
- A replica deployed with ``precision: int8`` serves the model directory's own int8 build,
  says so in its model version, and answers as the fp32 app does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app import demo_data
from serve_app.int8 import export_int8
from serve_app.model import EmotionModel
from tests import hf_checkpoints as ck

TEXTS = [t for t, _ in demo_data.sentences(200, seed=4901) + demo_data.paragraphs(200, seed=4902)]


@pytest.mark.skipif(not ck.minilm_package_version(), reason=f"{ck.MINILM_PACKAGE} is not installed")
def test_real_weights_minilm_int8_stays_close_to_fp32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.export import export_hf_checkpoint

    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))
    model_dir = export_hf_checkpoint(ck.minilm_emotion().tf_dir, tmp_path / "minilm", max_sequence_length=128)
    fp32 = EmotionModel.load(model_dir).predict(TEXTS).probabilities
    export_int8(model_dir)
    meta = json.loads((model_dir / "int8" / "int8.json").read_text(encoding="utf-8"))
    assert (meta["quantized_matmuls"], meta["fp32_matmuls"]) == (36, 2)  # 6 layers x 6; pooler, classifier
    model = EmotionModel.load(model_dir, precision="int8", threads=2)
    assert model._run.path == model_dir / "int8" / "model.onnx"  # type: ignore[attr-defined]
    got = model.predict(TEXTS).probabilities
    agreement = float(np.mean(got.argmax(axis=1) == fp32.argmax(axis=1)))
    diff = float(np.abs(got - fp32).mean())
    print(f"real-weights MiniLM, int8 vs fp32 on {len(TEXTS)} texts: agreement {agreement:.2%}, mean |diff| {diff:.4f}")
    assert agreement >= 0.9
    assert diff < 0.03
    assert not (tmp_path / "cache").exists()  # the model directory's own build was used


def test_served_int8_reports_its_precision(
    serve_address: str, grpc_port: int, demo_model_dir: Path, tmp_path: Path
) -> None:
    from ray import serve

    from raypipe.client import GrpcModelClient
    from serve_app.deploy import DeploymentOptions, deploy
    from serve_app.settings import ServerSettings

    model_dir = tmp_path / "demo"
    model_dir.mkdir()
    for part in ("model.json", "saved_model", "tokenizer"):
        (model_dir / part).symlink_to(demo_model_dir / part)
    export_int8(model_dir)  # so the replica loads it instead of converting into its own cache
    version = json.loads((demo_model_dir / "model.json").read_text(encoding="utf-8"))["version"]
    app = "int8"
    address = deploy(
        model_dir,
        app_name=app,
        grpc_port=grpc_port,
        settings=ServerSettings(precision="int8"),
        options=DeploymentOptions(num_cpus=1.0),
    )
    texts = TEXTS[:64]

    async def classify(application: str) -> Any:
        client = GrpcModelClient(address, application=application, timeout_s=60)
        try:
            return await client.classify([f"t{i}" for i in range(len(texts))], texts)
        finally:
            await client.close()

    try:
        int8_answer = asyncio.run(classify(app))
    finally:
        serve.delete(app)
    fp32_answer = asyncio.run(classify("raypipe"))
    assert int8_answer.model_version == f"{version}+int8"
    assert fp32_answer.model_version == version
    assert (int8_answer.probabilities.argmax(axis=1) == fp32_answer.probabilities.argmax(axis=1)).all()
    assert float(np.abs(int8_answer.probabilities - fp32_answer.probabilities).max()) < 0.05
