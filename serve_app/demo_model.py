"""The offline demo model: a small BERT trained in about half a minute on generated text.

``raypipe model build-demo DIR`` and the test suite call `build_demo_model`, which writes a
model directory in exactly the layout real checkpoints are exported to (see
`serve_app.model`), so the demo, the tests and production share one serving path.

Nothing is downloaded: the WordPiece vocabulary is trained on `serve_app.demo_data`
text, the BERT (2 layers x 128 hidden) starts from random weights and is fine-tuned on the
same generator's labelled sentences and paragraphs.

The build is cached by a fingerprint of `RECIPE` (and the seed): an existing directory
with the same fingerprint is returned at once. Training runs in a child Python process so
that the caller's TensorFlow is left untouched (op determinism, seeds and thread pools are
process-wide and fixed at first use), and the result is built beside ``out_dir`` and
renamed into place, so a killed build never leaves half a model.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serve_app import demo_data
from serve_app.model import MODEL_FORMAT, EmotionModel

__all__ = ["RECIPE", "DemoBuildError", "build_demo_model", "default_demo_model_dir", "recipe_fingerprint"]

logger = logging.getLogger(__name__)

#: Everything that decides the demo model's weights. Change a value, and cached builds
#: are rebuilt; bump ``recipe_version`` when the training code changes.
RECIPE: dict[str, Any] = {
    "recipe_version": 3,
    "data_version": demo_data.DATA_VERSION,
    "vocab_size": 4000,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "train_sentences": 6000,
    "train_paragraphs": 1500,
    # Concatenated paragraphs of ~290-512 tokens, so every position embedding the card
    # promises has been trained.
    "train_long_documents": 64,
    "batch_rows": 64,
    "token_dropout": 0.15,
    "epochs": 2,
    "learning_rate": 1e-3,
}

_ENV_DIR = "RAYPIPE_DEMO_MODEL_DIR"
# Marks the child's progress lines on stderr, among TensorFlow's own output.
_PROGRESS = "[demo-build] "
_SUMMARY = "[demo-build-summary] "
# Generated held-out text is easy (the recipe reaches ~0.99); below this, training broke.
_MIN_EVAL_ACCURACY = 0.9


class DemoBuildError(RuntimeError):
    """Training the demo model failed; ``stderr_tail`` holds the child's last lines."""

    def __init__(self, returncode: int, stderr_tail: str) -> None:
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        super().__init__(f"demo model build failed (exit {returncode}):\n{stderr_tail}")


def recipe_fingerprint(seed: int = 0) -> str:
    """Hex digest identifying a build of `RECIPE` with ``seed``."""
    blob = json.dumps({**RECIPE, "seed": seed}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def default_demo_model_dir() -> Path:
    """``$RAYPIPE_DEMO_MODEL_DIR`` if set, else ``./.cache/demo-model``."""
    configured = os.environ.get(_ENV_DIR)
    return Path(configured) if configured else Path.cwd() / ".cache" / "demo-model"


def build_demo_model(out_dir: Path | str, *, seed: int = 0, force: bool = False) -> Path:
    """Build the demo model directory at ``out_dir`` (or reuse it) and return its path.

    Reuses an existing build whose fingerprint matches unless ``force``. Concurrent
    callers on the same ``out_dir`` wait for one another instead of training twice.
    """
    out_dir = Path(out_dir).absolute()
    fingerprint = recipe_fingerprint(seed)
    if not force and _built_fingerprint(out_dir) == fingerprint:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        # Another process may have finished the same build while we waited for the lock.
        if not force and _built_fingerprint(out_dir) == fingerprint:
            return out_dir
        _remove_stale_temp_dirs(out_dir)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        started = time.monotonic()
        try:
            summary = _train_in_child(tmp, seed=seed, fingerprint=fingerprint)
            _swap_into_place(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _record_runtimes(out_dir)
        logger.info(
            "built demo model %s in %.1f s (%s)",
            out_dir,
            time.monotonic() - started,
            summary,
        )
    return out_dir


def _record_runtimes(out_dir: Path) -> None:
    """Measures this CPU's equal-answer settings once, under the build's lock, and leaves their
    record beside the model, as ``raypipe model export`` leaves one beside a user's model: the
    replicas that serve the demo model (the demo's, the notebooks', every test cluster's) then
    start at the recorded choice, instead of each measuring itself in the background at once
    (`serve_app.self_measure`). A measurement that fails leaves no record: a replica measures then."""
    from serve_app.self_measure import SelfMeasureError, measure_in_child

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cores = os.cpu_count() or 1
    try:
        measure_in_child(out_dir, threads=max(1, cores))
    except (SelfMeasureError, OSError, subprocess.TimeoutExpired) as e:
        logger.warning("could not measure the demo model's runtimes (%s); its replicas will measure themselves", e)


def _built_fingerprint(out_dir: Path) -> str | None:
    try:
        card = json.loads((out_dir / "model.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return card.get("fingerprint") if isinstance(card, dict) else None


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(out_dir: Path) -> None:
    # Only the lock holder builds, so any temp dir present now is from a killed build.
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(out_dir.parent / f".{out_dir.name}.old", ignore_errors=True)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    # A directory cannot be renamed over a non-empty one: move the old build aside first.
    # A crash in between leaves no out_dir (the next call rebuilds), never a mixed one.
    old = out_dir.parent / f".{out_dir.name}.old"
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _train_in_child(tmp: Path, *, seed: int, fingerprint: str) -> dict[str, Any]:
    env = dict(os.environ)
    # The child must import this very serve_app, whether or not it is installed.
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "-m", "serve_app.demo_model",
        str(tmp), "--seed", str(seed), "--fingerprint", fingerprint,
    ]  # fmt: skip
    tail: collections.deque[str] = collections.deque(maxlen=30)
    summary: dict[str, Any] = {}
    # One merged stream: reading two pipes one after the other could deadlock on a full one.
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:  # noqa: S603  argv, no shell
        assert proc.stdout is not None
        # Relay progress as it happens (a build takes a minute); keep the tail for errors.
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith(_PROGRESS):
                logger.info("demo model: %s", line[len(_PROGRESS) :].strip())
            elif line.startswith(_SUMMARY):
                summary = json.loads(line[len(_SUMMARY) :])
    if proc.returncode != 0:
        raise DemoBuildError(proc.returncode, "\n".join(tail))
    return summary


# ---------------------------------------------------------------------------------------
# Everything below runs in the child process.
# ---------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(_PROGRESS + message, flush=True)


def _training_data(seed: int) -> tuple[list[str], list[int]]:
    pairs = demo_data.sentences(RECIPE["train_sentences"], seed=seed)
    pairs += demo_data.paragraphs(RECIPE["train_paragraphs"], seed=seed)
    # Long documents: several same-label paragraphs back to back.
    pool = demo_data.paragraphs(RECIPE["train_long_documents"] * 12, seed=seed + 1)
    by_label: dict[int, list[str]] = {}
    for text, label in pool:
        by_label.setdefault(label, []).append(text)
    for i in range(RECIPE["train_long_documents"]):
        label = i % len(demo_data.LABELS)
        texts = by_label[label]
        doc: list[str] = []
        while sum(len(t.split()) for t in doc) < 260 and texts:
            doc.append(texts.pop())
        pairs.append((" ".join(doc), label))
    return [t for t, _ in pairs], [y for _, y in pairs]


def _eval_data(seed: int) -> tuple[list[str], list[int]]:
    pairs = demo_data.sentences(600, seed=seed + 101) + demo_data.paragraphs(300, seed=seed + 102)
    return [t for t, _ in pairs], [y for _, y in pairs]


_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _wordpiece_vocab(texts: list[str], size: int) -> list[str]:
    """A WordPiece vocabulary learned from ``texts``, identical on every run.

    `tokenizers`' own trainer (``BertWordPieceTokenizer.train_from_iterator``) breaks ties
    between equally frequent merges by hash-map order, which Rust seeds randomly per
    process: two builds got different vocabularies and so different weights. This builds
    the same kind of vocabulary deterministically: every corpus word whole (as the trainer
    ends up with once merges run out), the character alphabet (plain and ``##``), then the
    most frequent word-initial and ``##``-final pieces, so unseen words like "cries" still
    share pieces ("cri", "##es") with seen ones. Ties sort alphabetically.
    """
    from collections import Counter

    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    # The same normalisation and splitting BertTokenizerFast(do_lower_case=True) applies.
    normalizer = BertNormalizer(lowercase=True)
    splitter = BertPreTokenizer()
    words: Counter[str] = Counter()
    for text in texts:
        words.update(w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    pieces: Counter[str] = Counter()
    for word, count in words.items():
        for k in range(2, min(len(word), 6)):
            pieces[word[:k]] += count
            pieces["##" + word[-k:]] += count
    chars = sorted({c for word in words for c in word})
    vocab = [*_SPECIAL_TOKENS, *chars, *("##" + c for c in chars)]
    by_count = sorted(words, key=lambda w: (-words[w], w)) + sorted(pieces, key=lambda p: (-pieces[p], p))
    seen = set(vocab)
    for token in by_count:
        if len(vocab) >= size and token not in words:
            break
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab


def _train_tokenizer(texts: list[str], out: Path, scratch: Path) -> Any:
    from transformers import BertTokenizerFast

    scratch.mkdir(parents=True, exist_ok=True)
    vocab_file = scratch / "vocab.txt"
    vocab_file.write_text("\n".join(_wordpiece_vocab(texts, RECIPE["vocab_size"])) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        vocab_file=str(vocab_file),
        do_lower_case=True,
        model_max_length=RECIPE["max_position_embeddings"],
    )
    tokenizer.save_pretrained(str(out))
    return tokenizer


def _batches(ids: list[list[int]], labels: list[int], rng: Any, *, mask_id: int) -> list[tuple[Any, Any, Any]]:
    """Length-sorted batches of ``batch_rows`` (little padding), in a seeded random order.

    A ``token_dropout`` share of each text's tokens (never [CLS]/[SEP]) is replaced by
    [MASK], fresh per epoch, so the model cannot lean on one cue word and learns to use
    every cue in a sentence; that is what carries it to sentences it never saw.
    """
    import numpy as np

    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    rows = RECIPE["batch_rows"]
    out = []
    for start in range(0, len(order), rows):
        members = order[start : start + rows]
        length = max(len(ids[i]) for i in members)
        input_ids = np.zeros((len(members), length), dtype=np.int32)
        mask = np.zeros((len(members), length), dtype=np.int32)
        for r, i in enumerate(members):
            input_ids[r, : len(ids[i])] = ids[i]
            mask[r, : len(ids[i])] = 1
        inner = np.zeros_like(mask, dtype=bool)
        for r, i in enumerate(members):
            inner[r, 1 : len(ids[i]) - 1] = True
        input_ids[inner & (rng.random(input_ids.shape) < RECIPE["token_dropout"])] = mask_id
        out.append((input_ids, mask, np.array([labels[i] for i in members], dtype=np.int32)))
    rng.shuffle(out)
    return out


def _build(out: Path, *, seed: int, fingerprint: str) -> dict[str, Any]:
    import numpy as np

    from serve_app._tf import tensorflow
    from serve_app.export.signature import save_serving_model

    tf = tensorflow()
    import tf_keras
    from transformers import BertConfig, TFBertForSequenceClassification

    started = time.monotonic()
    tf_keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    max_len = RECIPE["max_position_embeddings"]

    texts, labels = _training_data(seed)
    tokenizer = _train_tokenizer(texts, out / "tokenizer", out / ".scratch")
    shutil.rmtree(out / ".scratch")
    ids = tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]
    _progress(f"training on {len(texts)} texts, vocabulary of {len(tokenizer)} tokens")

    config = BertConfig(  # type: ignore[no-untyped-call, unused-ignore]
        vocab_size=len(tokenizer),
        hidden_size=RECIPE["hidden_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        intermediate_size=RECIPE["intermediate_size"],
        max_position_embeddings=max_len,
        num_labels=len(demo_data.LABELS),
        id2label=dict(enumerate(demo_data.LABELS)),
        label2id={name: i for i, name in enumerate(demo_data.LABELS)},
        pad_token_id=tokenizer.pad_token_id,
    )
    model = TFBertForSequenceClassification(config)

    rng = np.random.default_rng(seed)
    epoch_batches = [_batches(ids, labels, rng, mask_id=tokenizer.mask_token_id) for _ in range(RECIPE["epochs"])]
    total_steps = sum(len(b) for b in epoch_batches)
    schedule = tf_keras.optimizers.schedules.PolynomialDecay(
        RECIPE["learning_rate"],
        total_steps,
        end_learning_rate=RECIPE["learning_rate"] / 20,
    )
    optimizer = tf_keras.optimizers.Adam(learning_rate=schedule)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    spec = tf.TensorSpec([None, None], tf.int32)

    @tf.function(input_signature=[spec, spec, tf.TensorSpec([None], tf.int32)])  # type: ignore[untyped-decorator, unused-ignore]
    def train_step(input_ids: Any, mask: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(input_ids=input_ids, attention_mask=mask, training=True).logits
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for epoch, batches in enumerate(epoch_batches):
        losses = [float(train_step(x, m, y)) for x, m, y in batches]
        _progress(f"epoch {epoch + 1}/{len(epoch_batches)}: mean loss {np.mean(losses):.4f}")

    # The same signature every exported model has (serve_app.export.signature), saved over the
    # model's variables alone: saving the Keras model object would also trace every layer's call
    # for Keras' own metadata, which serving never reads (about 4 s of the build on 2 cores).
    weights = tf.Module()
    weights.variables_ = list(model.variables)
    save_serving_model(
        weights,
        lambda input_ids, attention_mask: (
            model(input_ids=input_ids, attention_mask=attention_mask, training=False).logits
        ),
        out / "saved_model",
    )

    _progress("exported the SavedModel")
    card = {
        "format": MODEL_FORMAT,
        "labels": list(demo_data.LABELS),
        "version": f"demo-bert-{RECIPE['num_hidden_layers']}x{RECIPE['hidden_size']}-{fingerprint[:8]}",
        "max_sequence_length": max_len,
        "fingerprint": fingerprint,
    }
    (out / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")

    # Held-out accuracy on other seeds of the generator, measured through the serving
    # path itself, so a broken export fails the build instead of the first request.
    eval_texts, eval_labels = _eval_data(seed)
    served = EmotionModel.load(out).predict(eval_texts).probabilities
    accuracy = float(np.mean(served.argmax(axis=1) == np.array(eval_labels)))
    _progress(f"held-out accuracy {accuracy:.4f}")
    if accuracy < _MIN_EVAL_ACCURACY:
        # Fail here, loudly, rather than cache a model that answers nonsense.
        raise RuntimeError(f"held-out accuracy {accuracy:.4f} is below {_MIN_EVAL_ACCURACY}")
    return {
        "eval_accuracy": round(accuracy, 4),
        "train_examples": len(texts),
        "vocab_size": len(tokenizer),
        "seconds": round(time.monotonic() - started, 1),
    }


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train the demo model into a fresh directory.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--fingerprint", required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=False)
    summary = _build(args.out, seed=args.seed, fingerprint=args.fingerprint)
    print(_SUMMARY + json.dumps(summary), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
