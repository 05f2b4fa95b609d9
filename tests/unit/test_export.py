"""Unit tests for `raypipe model export` / `model check` on small random checkpoints (offline).

Every export here must serve exactly what the source model computes in-process; every broken
source or model directory must fail with its own message naming the part at fault. Sockets
are blocked for the whole module: exporting never touches the network.
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raypipe.cli import main
from serve_app._tf import tensorflow
from serve_app.export import (
    SAMPLE_TEXTS,
    ExportError,
    check_model_dir,
    export_hf_checkpoint,
    export_saved_model,
)
from serve_app.model import EmotionModel, ModelDirError
from tests import hf_checkpoints as ck

LABELS = ("joy", "sadness", "anger")
TEXTS = [*SAMPLE_TEXTS, "happy happy happy", "", "the dog " * 40]  # the last one is truncated


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def tokenizer(root: Path) -> Any:
    return ck.write_wordpiece_tokenizer(root / "tokenizer")


@pytest.fixture(scope="module")
def bert(tokenizer: Any) -> Any:
    return ck.build_classifier(ck.tiny_config("bert", vocab_size=len(tokenizer), labels=LABELS))


@pytest.fixture(scope="module")
def reference(bert: Any, tokenizer: Any) -> np.ndarray:
    probabilities = ck.in_process_probabilities(bert, tokenizer, TEXTS, max_length=64)
    assert probabilities.max() > 0.6  # far from uniform, so agreement means something
    return probabilities


@pytest.fixture(scope="module")
def pt_checkpoint(root: Path, bert: Any, tokenizer: Any) -> Path:
    return ck.save_checkpoint(bert, tokenizer, root / "pt-checkpoint", weights="pt")


@pytest.fixture(scope="module")
def exported(root: Path, pt_checkpoint: Path) -> Path:
    return export_hf_checkpoint(pt_checkpoint, root / "exported")


def _card(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "model.json").read_text(encoding="utf-8"))


def _served(model_dir: Path, texts: list[str] = TEXTS) -> np.ndarray:
    return EmotionModel.load(model_dir).predict(texts).probabilities


def _variant(exported: Path, target: Path, *, skip: str = "", card: dict[str, Any] | None = None) -> Path:
    """A model dir linking to ``exported``'s parts, with one part left out or a new card."""
    target.mkdir()
    for part in ("saved_model", "tokenizer", "model.json"):
        if part != skip and not (part == "model.json" and card is not None):
            (target / part).symlink_to(exported / part)
    if card is not None:
        (target / "model.json").write_text(json.dumps(card), encoding="utf-8")
    return target


# --- export from Hugging Face checkpoints ------------------------------------------------


def test_pytorch_weights_export_serves_the_source_model(
    exported: Path, bert: Any, tokenizer: Any, reference: np.ndarray
) -> None:
    np.testing.assert_allclose(_served(exported), reference, atol=1e-5)
    card = _card(exported)
    assert card["labels"] == list(LABELS)  # from config.json's id2label
    assert card["max_sequence_length"] == 64
    assert card["vocab_size"] == len(tokenizer)
    assert card["parameters"] == bert.count_params()
    assert card["version"].startswith("bert-1x32-")
    assert card["source"]["weights"] == "model.safetensors (PyTorch)"
    assert card["source"]["model_type"] == "bert"


def test_export_measures_the_runtimes_so_the_first_serve_is_fast(exported: Path) -> None:
    """`model export` measures on this CPU what a replica with default settings chooses from:
    TF fp32, OpenVINO fp32 (and bf16 where the CPU has it), in and out of domain."""
    from serve_app.runtimes import read_record

    record = read_record(exported)
    assert record is not None
    settings = {(m.runtime, m.precision): m for m in record.measurements}
    assert {("tensorflow", "fp32"), ("openvino", "fp32")} <= set(settings)
    assert settings["openvino", "fp32"].agreement_in == 1.0
    assert all(m.agreement_out is not None and m.para_per_s > 0 for m in record.measurements)


def test_the_version_covers_everything_that_changes_an_answer(root: Path, pt_checkpoint: Path, exported: Path) -> None:
    """Answer reuse keys on the version: an export with another tokenizer, max length or labels
    (names or order) answers differently, so it gets another version; the same export again
    (here without the runtimes' measurement the module's first export made) keeps it."""
    from transformers import BertTokenizerFast

    cased = root / "tokenizer-cased"  # the same vocabulary, but "Happy" is no longer "happy"
    BertTokenizerFast(vocab_file=str(root / "tokenizer" / "vocab.txt"), do_lower_case=False).save_pretrained(str(cased))
    variants: dict[str, dict[str, Any]] = {
        "again": {},
        "tokenizer": {"tokenizer_dir": cased},
        "max length": {"max_sequence_length": 32},
        "label names": {"labels": ["joy", "sadness", "fury"]},
        "label order": {"labels": ["sadness", "joy", "anger"]},
    }
    versions = {"first": _card(exported)["version"]} | {
        what: _card(export_hf_checkpoint(pt_checkpoint, root / f"version-{i}", measure=False, **options))["version"]
        for i, (what, options) in enumerate(variants.items())
    }
    assert versions.pop("again") == versions["first"]
    assert len(set(versions.values())) == len(versions), versions


@pytest.mark.parametrize("weights", ["tf", "tf-safetensors", "pt-sharded"])
def test_every_weight_format_exports_to_the_same_version(
    root: Path, bert: Any, tokenizer: Any, exported: Path, reference: np.ndarray, weights: str
) -> None:
    # The TF one comes without tokenizer files, as some training scripts save it: pass them apart.
    separate = weights == "tf"
    source = ck.save_checkpoint(bert, None if separate else tokenizer, root / f"checkpoint-{weights}", weights=weights)
    out = export_hf_checkpoint(
        source, root / f"exported-{weights}", tokenizer_dir=root / "tokenizer" if separate else None, measure=False
    )
    assert _card(out)["version"] == _card(exported)["version"]
    assert ("TensorFlow" in _card(out)["source"]["weights"]) == weights.startswith("tf")
    np.testing.assert_allclose(_served(out), reference, atol=1e-5)


@pytest.mark.parametrize("model_type", ["distilbert", "electra", "roberta"])
def test_other_bert_family_models(root: Path, model_type: str) -> None:
    tok_dir = root / f"tokenizer-{model_type}"
    tokenizer = ck.write_bpe_tokenizer(tok_dir) if model_type == "roberta" else ck.write_wordpiece_tokenizer(tok_dir)
    model = ck.build_classifier(ck.tiny_config(model_type, vocab_size=len(tokenizer), labels=LABELS), seed=1)
    source = ck.save_checkpoint(model, tokenizer, root / f"checkpoint-{model_type}", weights="pt")
    out = export_hf_checkpoint(source, root / f"exported-{model_type}", measure=False)
    card = _card(out)
    assert card["max_sequence_length"] == 64  # RoBERTa: 66 positions, 2 reserved
    assert card["version"].startswith(f"{model_type}-1x32-")
    expected = ck.in_process_probabilities(model, tokenizer, TEXTS, max_length=64)
    np.testing.assert_allclose(_served(out), expected, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["bert-base-uncased", "nlptown/bert-base-multilingual-uncased-sentiment", "hf://org/m"]
)
def test_hub_name_is_an_error_that_says_so(tmp_path: Path, name: str) -> None:
    with pytest.raises(ExportError, match=r"never downloads models.*Hugging Face Hub model id"):
        export_hf_checkpoint(name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _copy_checkpoint(source: Path, target: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*drop))
    return target


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}), encoding="utf-8")


def test_source_problems_have_their_own_errors(tmp_path: Path, pt_checkpoint: Path, tokenizer: Any) -> None:
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="does not exist"):
        export_hf_checkpoint(tmp_path / "nowhere" / "ckpt", out)

    no_config = _copy_checkpoint(pt_checkpoint, tmp_path / "no-config", drop=("config.json",))
    with pytest.raises(ExportError, match=r"missing config\.json") as e:
        export_hf_checkpoint(no_config, out)
    assert e.value.path == no_config / "config.json"

    gpt = _copy_checkpoint(pt_checkpoint, tmp_path / "gpt2")
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}), encoding="utf-8")
    with pytest.raises(ExportError, match="'gpt2' is not supported"):
        export_hf_checkpoint(gpt, out)

    multi = _copy_checkpoint(pt_checkpoint, tmp_path / "multi")
    _edit_config(multi, problem_type="multi_label_classification")
    with pytest.raises(ExportError, match="multi-label"):
        export_hf_checkpoint(multi, out)

    with pytest.raises(ExportError, match="2 labels given but the classifier has 3 outputs"):
        export_hf_checkpoint(pt_checkpoint, out, labels=["x", "y"])
    with pytest.raises(ExportError, match="unique"):
        export_hf_checkpoint(pt_checkpoint, out, labels=["x", "x", "y"])
    with pytest.raises(ExportError, match="max length 65 is beyond the model's 64 positions"):
        export_hf_checkpoint(pt_checkpoint, out, max_sequence_length=65)

    bin_only = _copy_checkpoint(pt_checkpoint, tmp_path / "bin", drop=("model.safetensors",))
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ExportError, match="need torch to read") as e:
        export_hf_checkpoint(bin_only, out)
    assert e.value.path == bin_only / "pytorch_model.bin"

    no_weights = _copy_checkpoint(pt_checkpoint, tmp_path / "no-weights", drop=("model.safetensors",))
    with pytest.raises(ExportError, match="no weights found"):
        export_hf_checkpoint(no_weights, out)

    big_tokenizer = _copy_checkpoint(pt_checkpoint, tmp_path / "big-tokenizer")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (big_tokenizer / name).unlink()
    ck.write_wordpiece_tokenizer(big_tokenizer, extra=[f"word{i}" for i in range(50)])
    with pytest.raises(ExportError, match=r"token ids up to 183 but config\.json's vocab_size is 134"):
        export_hf_checkpoint(big_tokenizer, out)
    assert not out.exists()


def test_base_model_without_a_classification_head(tmp_path: Path, bert: Any, tokenizer: Any) -> None:
    from safetensors.numpy import save_file

    # What a pretrained encoder (e.g. for embeddings) looks like: no "bert." prefix, no classifier.
    state = {k.removeprefix("bert."): v for k, v in ck.pytorch_state_dict(bert).items() if "classifier" not in k}
    source = tmp_path / "base"
    source.mkdir()
    bert.config.save_pretrained(str(source))
    tokenizer.save_pretrained(str(source))
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="no trained classification head"):
        export_hf_checkpoint(source, tmp_path / "out")


# --- export from a SavedModel ----------------------------------------------------------


def _foreign_saved_model(model: Any, path: Path, *, length: int, output: str, probabilities: bool) -> Path:
    """A TF-Serving style SavedModel: int64 inputs of a fixed length, token types, its own output name."""
    tf = tensorflow()
    spec = tf.TensorSpec([None, length], tf.int64)

    class Foreign(tf.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        @tf.function(input_signature=[spec, spec, spec])
        def serve(self, input_word_ids: Any, input_mask: Any, input_type_ids: Any) -> dict[str, Any]:
            logits = self.model(
                input_ids=input_word_ids, attention_mask=input_mask, token_type_ids=input_type_ids, training=False
            ).logits
            return {output: tf.nn.softmax(logits) if probabilities else logits}

    module = Foreign()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve.get_concrete_function()})
    return path


@pytest.fixture(scope="module")
def foreign(root: Path, bert: Any) -> Path:
    return _foreign_saved_model(bert, root / "foreign", length=32, output="logits", probabilities=False)


def test_saved_model_export_adapts_the_signature(root: Path, foreign: Path, bert: Any, tokenizer: Any) -> None:
    out = export_saved_model(foreign, root / "from-savedmodel", labels=LABELS, tokenizer_dir=root / "tokenizer")
    card = _card(out)
    assert card["max_sequence_length"] == 32  # the signature's fixed length
    assert card["version"].startswith("savedmodel-")
    assert card["source"]["output_kind"] == "logits"
    assert card["parameters"] == bert.count_params()
    expected = ck.in_process_probabilities(bert, tokenizer, TEXTS, max_length=32)
    np.testing.assert_allclose(_served(out), expected, atol=1e-5)


def test_saved_model_probabilities_are_not_softmaxed_twice(root: Path, bert: Any, tokenizer: Any) -> None:
    source = _foreign_saved_model(bert, root / "foreign-probs", length=32, output="scores", probabilities=True)
    out = export_saved_model(source, root / "from-probs", labels=LABELS, tokenizer_dir=root / "tokenizer")
    assert _card(out)["source"]["output_kind"] == "probabilities"
    expected = ck.in_process_probabilities(bert, tokenizer, TEXTS, max_length=32)
    np.testing.assert_allclose(_served(out), expected, atol=1e-5)


def test_saved_model_problems(tmp_path: Path, foreign: Path, root: Path) -> None:
    out = tmp_path / "out"
    tokenizer_dir = root / "tokenizer"
    with pytest.raises(ExportError, match=r"shape \[2, 3\].*one column per label \(2 labels given\)"):
        export_saved_model(foreign, out, labels=["a", "b"], tokenizer_dir=tokenizer_dir)
    with pytest.raises(ExportError, match=r"no signature 'predict' \(it has: serving_default\)"):
        export_saved_model(foreign, out, labels=LABELS, tokenizer_dir=tokenizer_dir, signature="predict")
    with pytest.raises(ExportError, match="no output 'probs'"):
        export_saved_model(foreign, out, labels=LABELS, tokenizer_dir=tokenizer_dir, output="probs")
    with pytest.raises(ExportError, match="beyond the model's 32 positions"):
        export_saved_model(foreign, out, labels=LABELS, tokenizer_dir=tokenizer_dir, max_sequence_length=64)
    with pytest.raises(ExportError, match=r"no saved_model\.pb"):
        export_saved_model(tokenizer_dir, out, labels=LABELS, tokenizer_dir=tokenizer_dir)
    with pytest.raises(ExportError, match="cannot load a tokenizer"):
        export_saved_model(foreign, out, labels=LABELS, tokenizer_dir=foreign)
    assert not out.exists()


# --- model check --------------------------------------------------------------------------


def test_check_shows_card_and_predictions(exported: Path, reference: np.ndarray) -> None:
    check = check_model_dir(exported, TEXTS)
    np.testing.assert_allclose(check.probabilities, reference, atol=1e-5)
    text = check.render()
    assert "version     bert-1x32-" in text
    assert "labels      joy, sadness, anger" in text
    assert "vocabulary  134 tokens" in text
    assert "huggingface: " in text


def test_check_accepts_the_demo_model(demo_model_dir: Path) -> None:
    check = check_model_dir(demo_model_dir)  # a card without the export's extra fields
    assert check.probabilities.shape == (len(SAMPLE_TEXTS), 6)


@pytest.fixture
def broken(tmp_path: Path, exported: Path, root: Path) -> Iterator[Any]:
    """Builds a model directory with one thing wrong; returns it with the path and message expected."""
    tf = tensorflow()
    card = _card(exported)

    def make(kind: str) -> tuple[Path, Path, str]:
        target = tmp_path / kind
        if kind == "missing signature":
            model_dir = _variant(exported, target, skip="saved_model")
            module = tf.Module()
            module.weights = tf.Variable([1.0])
            tf.saved_model.save(module, str(model_dir / "saved_model"))
            return model_dir, model_dir / "saved_model", "no 'serving_default' signature"
        if kind == "label count":
            model_dir = _variant(exported, target, card={**card, "labels": [*LABELS, "fear"]})
            return model_dir, model_dir / "saved_model", "outputs 3 classes but model.json lists 4 labels"
        if kind in ("bigger tokenizer", "other tokenizer"):
            model_dir = _variant(exported, target, skip="tokenizer", card=dict(card))
            extra = [f"word{i}" for i in range(50)] if kind == "bigger tokenizer" else ["zebra"]
            ck.write_wordpiece_tokenizer(model_dir / "tokenizer", extra=extra)
            if kind == "bigger tokenizer":
                # Without the card's vocab_size only running the model can tell.
                (model_dir / "model.json").write_text(
                    json.dumps({k: v for k, v in card.items() if k != "vocab_size"}), encoding="utf-8"
                )
                return model_dir, model_dir / "tokenizer", "ids up to 183 but the model's embedding table has 134 rows"
            return model_dir, model_dir / "tokenizer", "has 135 token ids but model.json says .* vocabulary of 134"
        if kind == "max length":
            model_dir = _variant(exported, target, card={**card, "max_sequence_length": 100})
            return model_dir, model_dir / "model.json", "max_sequence_length is 100 but .* for 64 tokens"
        raise ValueError(kind)

    yield make


KINDS = ["missing signature", "label count", "bigger tokenizer", "other tokenizer", "max length"]


@pytest.mark.parametrize("kind", KINDS)
def test_check_names_each_problem(broken: Any, kind: str) -> None:
    model_dir, at_fault, message = broken(kind)
    with pytest.raises(ModelDirError, match=message) as e:
        check_model_dir(model_dir)
    assert e.value.path == at_fault


# --- CLI ------------------------------------------------------------------------------------


def test_cli_export_with_options_overwrite_and_check(
    root: Path, pt_checkpoint: Path, bert: Any, tokenizer: Any, exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = root / "cli-exported"
    options = ["--labels", "a, b,c", "--max-length", "16", "--name", "emotions"]
    assert main(["model", "export", "--from-hf", str(pt_checkpoint), str(out), *options]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    card = _card(out)
    assert card["labels"] == ["a", "b", "c"]
    assert card["max_sequence_length"] == 16
    assert card["version"].startswith("emotions-")
    assert card["weights_sha256"] == _card(exported)["weights_sha256"]
    expected = ck.in_process_probabilities(bert, tokenizer, TEXTS, max_length=16)
    served = EmotionModel.load(out).predict(TEXTS)
    np.testing.assert_allclose(served.probabilities, expected, atol=1e-5)
    assert served.truncated[-1]

    assert main(["model", "export", "--from-hf", str(pt_checkpoint), str(out)]) == 2
    assert "already exists; pass overwrite=True (--force)" in capsys.readouterr().err
    assert main(["model", "export", "--from-hf", str(pt_checkpoint), str(out), "--force"]) == 0
    assert _card(out)["labels"] == list(LABELS)
    assert [p.name for p in root.iterdir() if p.name.startswith(".cli-exported")] == []  # no temp dirs left

    capsys.readouterr()
    assert main(["model", "check", str(out), "--text", "I am so happy"]) == 0
    shown = capsys.readouterr().out
    assert "labels      joy, sadness, anger" in shown
    assert "I am so happy" in shown


def test_cli_errors_exit_2_with_the_reason(
    root: Path, foreign: Path, broken: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "export", "--from-hf", "bert-base-uncased", str(root / "x")]) == 2
    assert "never downloads models" in capsys.readouterr().err
    assert main(["model", "export", "--from-savedmodel", str(foreign), str(root / "x")]) == 2
    assert "--labels and --tokenizer" in capsys.readouterr().err
    model_dir, _, _ = broken("max length")
    assert main(["model", "check", str(model_dir)]) == 2
    assert "position embeddings for 64 tokens" in capsys.readouterr().err
