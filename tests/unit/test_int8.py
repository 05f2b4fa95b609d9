"""Unit tests for ``precision: int8`` (`serve_app.int8`): conversion, agreement, the cache.

The conversion itself must be exact (tf2onnx's fp32 graph answers as TensorFlow does, gelu's
``Erfc`` included) for every model family an export accepts; the int8 build of the trained demo
model must agree with fp32; a converted model is reused, never half-written, and rebuilt when
damaged or stale. Cache tests replace the converter with a copy of one real build, so they
check the bookkeeping without converting again.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raypipe.cli import main
from serve_app import demo_data, int8
from serve_app.export import save_hf_classifier
from serve_app.model import EmotionModel, ModelDirError, configure_precision
from serve_app.settings import ServerSettings
from tests import hf_checkpoints as ck

# Held-out generated sentences and paragraphs (the demo model trained on other seeds).
TEXTS = [t for t, _ in demo_data.sentences(200, seed=4901) + demo_data.paragraphs(200, seed=4902)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test writes to the real per-user cache."""
    cache = tmp_path / "raypipe-cache"
    monkeypatch.setenv("RAYPIPE_CACHE", str(cache))
    return cache / "int8"


@pytest.fixture(scope="module")
def built(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real int8 build of the demo model: its entry in a cache at ``<root>/int8``."""
    cache = tmp_path_factory.mktemp("raypipe-cache") / "int8"
    runner = int8.load_int8_runner(demo_model_dir, n_labels=len(demo_data.LABELS), threads=1, cache_dir=cache)
    return runner.path.parent


@pytest.fixture
def model_dir(demo_model_dir: Path, tmp_path: Path) -> Path:
    """A writable model directory whose parts link to the demo model's."""
    target = tmp_path / "model"
    target.mkdir()
    for part in ("model.json", "saved_model", "tokenizer"):
        (target / part).symlink_to(demo_model_dir / part)
    return target


@pytest.fixture
def fake_convert(built: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces the converter with a copy of the real build; returns the paths it wrote."""
    calls: list[Path] = []
    meta = json.loads((built / "int8.json").read_text(encoding="utf-8"))

    def convert(saved_model: Path, out: Path) -> dict[str, Any]:
        calls.append(out)
        shutil.copyfile(built / "model.onnx", out)
        return {k: meta[k] for k in ("quantized_matmuls", "fp32_matmuls", "seconds")}

    monkeypatch.setattr(int8, "convert", convert)
    return calls


def _load(model_dir: Path) -> Any:
    return int8.load_int8_runner(model_dir, n_labels=len(demo_data.LABELS), threads=1)


# --- settings and CPU -------------------------------------------------------------------------


def test_settings_accept_int8() -> None:
    assert ServerSettings.from_dict({"precision": "int8"}).precision == "int8"
    with pytest.raises(ValueError, match="fp32, bf16, int8 or auto"):
        ServerSettings(precision="int4")


@pytest.mark.parametrize(
    ("flags", "asked", "chosen"),
    [
        ({"avx512f", "avx512_vnni"}, "int8", "int8"),
        ({"avx2", "avx_vnni"}, "int8", "int8"),
        ({"amx_int8", "amx_tile"}, "int8", "int8"),
        ({"avx512f", "avx512_vnni"}, "auto", "fp32"),  # never int8 by itself
        ({"avx512_vnni", "avx512_bf16"}, "auto", "bf16"),
    ],
)
def test_int8_follows_the_cpu(flags: set[str], asked: str, chosen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    seen: list[dict[str, bool]] = []
    monkeypatch.setattr(tf.config.optimizer, "set_experimental_options", seen.append)
    assert configure_precision(asked, frozenset(flags)) == chosen  # type: ignore[arg-type]
    assert seen == ([{"auto_mixed_precision_onednn_bfloat16": True}] if chosen == "bf16" else [])


def test_int8_without_vnni_is_refused() -> None:
    with pytest.raises(ValueError, match="AVX512_VNNI, AVX_VNNI or AMX-INT8"):
        configure_precision("int8", frozenset({"avx2", "avx512f", "avx512_bf16"}))


def test_load_rejects_an_unknown_precision(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        EmotionModel.load(demo_model_dir, precision="auto")


# --- conversion --------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", "distilbert", "electra", "roberta"])
def test_onnx_conversion_is_exact(model_type: str, tmp_path: Path) -> None:
    """Before quantizing, the ONNX graph computes what the SavedModel does (gelu's Erfc too)."""
    import onnxruntime as ort

    from serve_app._tf import tensorflow

    tf = tensorflow()
    tokenizer = ck.write_wordpiece_tokenizer(tmp_path / "tokenizer")
    config = ck.tiny_config(model_type, vocab_size=len(tokenizer), labels=("a", "b", "c"))
    save_hf_classifier(ck.build_classifier(config, seed=3), tmp_path / "saved_model")
    proto = int8._to_onnx(tmp_path / "saved_model")
    assert "Erfc" not in {n.op_type for n in proto.graph.node}
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = rng.integers(5, len(tokenizer), size=(3, 12), dtype=np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    signature = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    expected = signature(input_ids=tf.constant(ids), attention_mask=tf.constant(mask))["probabilities"].numpy()
    (got,) = session.run(["probabilities"], {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_demo_model_int8_agrees_with_fp32(demo_model_dir: Path, built: Path) -> None:
    meta = json.loads((built / "int8.json").read_text(encoding="utf-8"))
    # 2 layers x (query, key, value, attention output, intermediate, output); pooler and classifier stay fp32.
    assert (meta["quantized_matmuls"], meta["fp32_matmuls"]) == (12, 2)
    model = EmotionModel.load(demo_model_dir)
    fp32 = model.predict(TEXTS).probabilities
    model._run = int8.load_int8_runner(demo_model_dir, n_labels=6, threads=1, cache_dir=built.parent)
    got = model.predict(TEXTS).probabilities
    agreement = float(np.mean(got.argmax(axis=1) == fp32.argmax(axis=1)))
    diff = np.abs(got - fp32)
    print(f"int8 vs fp32 on {len(TEXTS)} texts: agreement {agreement:.2%}, mean |diff| {diff.mean():.1e}")
    assert agreement >= 0.99
    assert diff.mean() < 1e-3 and diff.max() < 0.05
    assert diff.max() > 1e-6  # it is a different computation, not the fp32 one
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)


def test_load_with_int8_runs_onnx_runtime(demo_model_dir: Path, built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYPIPE_CACHE", str(built.parent.parent))  # the module's build, found by key
    model = EmotionModel.load(demo_model_dir, precision="int8", threads=1)
    assert isinstance(model._run, int8._OnnxRunner) and model._run.path == built / "model.onnx"
    model.warmup()
    assert model.predict(["I am so happy today!"]).probabilities.argmax() == demo_data.LABELS.index("joy")


def test_unreadable_saved_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="missing saved_model"):
        int8.int8_key(tmp_path / "saved_model")
    (tmp_path / "saved_model").mkdir()
    (tmp_path / "saved_model" / "saved_model.pb").write_bytes(b"not a SavedModel")
    with pytest.raises(int8.Int8Error, match="cannot load SavedModel") as caught:
        int8.convert(tmp_path / "saved_model", tmp_path / "model.onnx")
    assert caught.value.path == tmp_path / "saved_model"


# --- the cache -----------------------------------------------------------------------------------


def test_second_load_reuses_the_build(model_dir: Path, fake_convert: list[Path], private_cache: Path) -> None:
    first = _load(model_dir)
    assert len(fake_convert) == 1
    assert first.path.parent.parent == private_cache
    second = _load(model_dir)
    assert len(fake_convert) == 1
    assert second.path == first.path
    assert sorted(p.name for p in private_cache.iterdir() if not p.name.endswith(".lock")) == [first.path.parent.name]


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.joinpath("model.onnx").write_bytes(d.joinpath("model.onnx").read_bytes()[:1000]),  # truncated
        lambda d: d.joinpath("model.onnx").unlink(),
        lambda d: d.joinpath("int8.json").write_text("{not json", encoding="utf-8"),
        lambda d: d.joinpath("int8.json").unlink(),
    ],
    ids=["truncated-model", "missing-model", "bad-meta", "missing-meta"],
)
def test_damaged_cache_entry_is_rebuilt(
    model_dir: Path, fake_convert: list[Path], damage: Callable[[Path], None], built: Path
) -> None:
    entry = _load(model_dir).path.parent
    damage(entry)
    runner = _load(model_dir)
    assert len(fake_convert) == 2
    assert runner.path.parent == entry
    assert (entry / "model.onnx").read_bytes() == (built / "model.onnx").read_bytes()
    assert [p.name for p in entry.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_entry_that_does_not_load_is_rebuilt(
    model_dir: Path, fake_convert: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    entry = _load(model_dir).path.parent
    # Bytes that match their recorded hash but are no ONNX model (e.g. written by a broken converter).
    (entry / "model.onnx").write_bytes(b"\x08\x07garbage")
    meta = json.loads((entry / "int8.json").read_text(encoding="utf-8"))
    meta["onnx_sha256"] = int8._file_sha256(entry / "model.onnx")
    (entry / "int8.json").write_text(json.dumps(meta), encoding="utf-8")
    runner = _load(model_dir)
    assert len(fake_convert) == 2
    assert "does not load" in caplog.text
    assert runner(np.ones((1, 4), np.int32), np.ones((1, 4), np.int32)).shape == (1, 6)


def test_unwritable_cache_says_what_to_do(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("RAYPIPE_CACHE", str(blocker))
    with pytest.raises(int8.Int8Error, match="RAYPIPE_CACHE") as caught:
        _load(model_dir)
    assert "raypipe model int8" in str(caught.value)


def test_replicas_loading_at_once_convert_once(
    model_dir: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    copy = int8.convert

    def slow(saved_model: Path, out: Path) -> dict[str, Any]:
        assert release.wait(30)
        return copy(saved_model, out)

    monkeypatch.setattr(int8, "convert", slow)
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(_load(model_dir).path)) for _ in range(3)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(30)
    assert len(paths) == 3 and len(set(paths)) == 1
    assert len(fake_convert) == 1


def test_model_dir_build_is_preferred_and_checked(
    model_dir: Path, fake_convert: list[Path], private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = int8.export_int8(model_dir)
    assert out == model_dir / "int8" and len(fake_convert) == 1
    assert int8.export_int8(model_dir) == out and len(fake_convert) == 1  # up to date: kept
    assert _load(model_dir).path == out / "model.onnx"
    assert len(fake_convert) == 1 and not private_cache.exists()

    # Built from other saved_model files: ignored with a warning, the cache is used instead.
    meta = json.loads((out / "int8.json").read_text(encoding="utf-8"))
    (out / "int8.json").write_text(json.dumps({**meta, "key": "0" * 64}), encoding="utf-8")
    assert _load(model_dir).path.parent.parent == private_cache
    assert "not an int8 build of this saved_model" in caplog.text
    assert int8.export_int8(model_dir) == out and len(fake_convert) == 3  # export rebuilds it


def test_cli_builds_the_model_dir_copy(
    model_dir: Path, fake_convert: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "int8", str(model_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"{model_dir / 'int8' / 'model.onnx'}  (12 MatMuls int8, 2 fp32)")
    assert main(["model", "int8", str(model_dir), "--force"]) == 0
    assert len(fake_convert) == 2
    assert main(["model", "int8", str(model_dir.parent / "nowhere")]) == 2
    assert "missing saved_model" in capsys.readouterr().err


def test_key_follows_the_saved_model_files(demo_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "saved_model"
    shutil.copytree(demo_model_dir / "saved_model", copy)
    assert int8.int8_key(copy) == int8.int8_key(demo_model_dir / "saved_model")
    (copy / "variables" / "extra").write_bytes(b"x")
    assert int8.int8_key(copy) != int8.int8_key(demo_model_dir / "saved_model")


def test_default_cache_dir() -> None:
    assert int8.default_cache_dir({"RAYPIPE_CACHE": "/data/c"}) == Path("/data/c/int8")
    assert int8.default_cache_dir({}) == Path.home() / ".cache" / "raypipe" / "int8"
