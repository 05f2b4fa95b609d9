"""``runtime: openvino`` on real pretrained weights and through the real Serve app.

- The fine-tuned real-weights MiniLM (`tests.hf_checkpoints.minilm_emotion`), exported and
  compiled by OpenVINO in fp32, answers as TensorFlow fp32 does (probabilities within 1e-4).
- A replica deployed with ``runtime: openvino`` serves the model directory's own IR, says so in
  the setting of its answers (``openvino:fp32``), and answers as a TensorFlow replica does, under
  the same model version (fp32 on either runtime gives the reference's answers).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app import demo_data
from serve_app.compiled import export_ir
from serve_app.model import EmotionModel
from tests import hf_checkpoints as ck

pytest.importorskip("openvino")

TEXTS = [t for t, _ in demo_data.sentences(200, seed=4901) + demo_data.paragraphs(200, seed=4902)]


@pytest.mark.skipif(not ck.minilm_package_version(), reason=f"{ck.MINILM_PACKAGE} is not installed")
def test_real_weights_minilm_on_openvino_answers_as_tensorflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))
    model_dir = shutil.copytree(ck.minilm_exported(), tmp_path / "minilm")  # a copy: export_ir writes into it
    fp32 = EmotionModel.load(model_dir).predict(TEXTS).probabilities
    export_ir(model_dir)
    model = EmotionModel.load(model_dir, runtime="openvino", threads=2)
    assert model._run.path == model_dir / "openvino" / "model.xml"  # type: ignore[attr-defined]
    got = model.predict(TEXTS).probabilities
    np.testing.assert_allclose(got, fp32, atol=1e-4)
    assert (got.argmax(axis=1) == fp32.argmax(axis=1)).all()
    assert not list((tmp_path / "cache").glob("openvino/*/model.xml"))  # the directory's own IR was used


# Two applications of its own beside the session's: more CPU than the default replica leaves.
@pytest.mark.usefixtures("room_beside_session_app")
def test_served_openvino_reports_its_runtime(
    serve_address: str, grpc_port: int, demo_model_dir: Path, tmp_path: Path
) -> None:
    from ray import serve

    from raypipe.call.client import GrpcModelClient
    from serve_app.deploy import DeploymentOptions, deploy
    from serve_app.settings import ServerSettings

    model_dir = tmp_path / "demo"
    model_dir.mkdir()
    for part in ("model.json", "saved_model", "tokenizer"):
        (model_dir / part).symlink_to(demo_model_dir / part)
    export_ir(model_dir)  # so the replica loads it instead of converting into its own cache
    version = json.loads((demo_model_dir / "model.json").read_text(encoding="utf-8"))["version"]
    apps = {
        "openvino": ServerSettings(runtime="openvino", precision="fp32"),
        "tf-reference": ServerSettings(runtime="tensorflow", precision="fp32"),
    }
    address = ""
    for app, settings in apps.items():
        address = deploy(
            model_dir, app_name=app, grpc_port=grpc_port, settings=settings, options=DeploymentOptions(num_cpus=1.0)
        )
    texts = TEXTS[:64]

    async def classify(application: str) -> Any:
        client = GrpcModelClient(address, application=application, timeout_s=60)
        try:
            return await client.classify([f"t{i}" for i in range(len(texts))], texts)
        finally:
            await client.close()

    try:
        ov_answer = asyncio.run(classify("openvino"))
        tf_answer = asyncio.run(classify("tf-reference"))
    finally:
        for app in apps:
            serve.delete(app)
    assert (ov_answer.setting, tf_answer.setting) == ("openvino:fp32", "tensorflow:fp32")
    assert ov_answer.model_version == tf_answer.model_version == version
    np.testing.assert_allclose(ov_answer.probabilities, tf_answer.probabilities, atol=1e-4)
