"""Random-weight BERTs of real shapes, as model directories the server loads, cached by shape.

Throughput does not depend on the weights, only on the shape, so the benchmark builds
bert-base (12x768) and MiniLM-L6 (6x384) from random weights with the demo tokenizer (the
vocabulary size matches it) in exactly the layout `serve_app.model` reads. Builds run in a
child process (TensorFlow's settings are process-wide) and land under
``.cache/bench-models/<shape>-<key>/``; a directory with ``model.json`` is a finished build.

Agreement between precisions needs a trained model instead: `ensure_real_weights_model` exports
the fine-tuned real-weights MiniLM the tests build (`tests.hf_checkpoints.minilm_emotion`:
pretrained MiniLM-L6 with an emotion head) to ``.cache/bench-models/minilm-emotion-<key>/``, and
`ensure_trained_model` trains a model of a shape here (bert-base's 12x768 from random init on the
demo generator's labelled text, `TRAINED_RECIPE`): no bert-base weights can be downloaded, so this
is bert-base's shape with weights trained on this bench's domain, not the published checkpoint.
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

__all__ = ["SHAPES", "TRAINED_RECIPE", "ensure_model", "ensure_real_weights_model", "ensure_trained_model"]

#: bert-base keeps its 512 positions; MiniLM-L6 is served at 256, the length
#: sentence-transformers' all-MiniLM-L6-v2 was trained and is used at.
SHAPES: dict[str, Shape] = {
    "bert-base": Shape("bert-base", layers=12, hidden=768, heads=12, intermediate=3072, max_length=512),
    "minilm-l6": Shape("minilm-l6", layers=6, hidden=384, heads=12, intermediate=1536, max_length=256),
}
_BUILD_VERSION = 1


def _key(shape: Shape, tokenizer_dir: Path, recipe: dict[str, Any] | None = None) -> str:
    vocab = (tokenizer_dir / "vocab.txt").read_bytes()
    fields: dict[str, Any] = {"shape": shape.to_dict(), "v": _BUILD_VERSION}
    if recipe is not None:
        fields["recipe"] = recipe
    blob = json.dumps(fields, sort_keys=True).encode() + vocab
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


#: Everything that decides the trained model's weights: change a value and it is trained again.
#:
#: From random init on the generator's labels rather than distilled from the real-weights MiniLM:
#: the labels are the truth the bench measures accuracy against, and distilling would inherit
#: MiniLM's mistakes on them for no fewer steps. What is trained is the top ``trained_layers``
#: encoder layers (0 here), the pooler and the head; the embeddings and the layers below keep their
#: random init, the way the real-weights MiniLM's head was trained on frozen (pretrained) features.
#: A full backward pass of 12x768 costs about a minute a step on 2 shared cores (a few hundred
#: steps would take hours), and top layers trained on random features from a cold start barely
#: moved in 300 steps (loss at chance), while the frozen part's output is computed once per text
#: and a head on it trains in seconds. The served model runs all twelve layers as usual: the speed
#: is bert-base's; its answers are a trained head's on random features (accuracy and margins:
#: `quality`). Trained and served at 128 tokens, the length the real-weights MiniLM is served at.
TRAINED_RECIPE: dict[str, Any] = {
    "version": 2,
    "seed": 47,
    "max_length": 128,
    "batch_rows": 32,
    "train_sentences": 900,
    "train_paragraphs": 300,
    "trained_layers": 0,
    "epochs": 40,
    "learning_rate": 1e-3,
    "warmup_steps": 20,
    "checkpoint_every": 200,
}


def ensure_trained_model(
    shape: Shape,
    *,
    demo_model_dir: Path,
    cache: Path,
    env: dict[str, str] | None = None,
    recipe: dict[str, Any] = TRAINED_RECIPE,
) -> Path:
    """The model directory of ``shape`` trained by ``recipe`` (built on first use: 22 min for
    bert-base on 2 cores other work shared, most of it the frozen part's pass over the texts).
    The frozen part's output and the training checkpoints stay in ``.<dir>.work/`` until the
    model is exported, so a killed build resumes where it left off."""
    tokenizer = demo_model_dir / "tokenizer"
    out = cache / f"{shape.name}-trained-{_key(shape, tokenizer, recipe)}"
    if (out / "model.json").is_file():
        return out
    work = cache / f".{out.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "bench.models", "--trained", json.dumps(shape.to_dict()), json.dumps(recipe)]
    subprocess.run([*cmd, str(tokenizer), str(work)], check=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    (work / "model").rename(out)
    shutil.rmtree(work)
    return out


def _training_texts(recipe: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The generator's labelled sentences and paragraphs, less any text the bench measures on."""
    from serve_app import demo_data
    from serve_app.optimize import default_sample

    measured = set(default_sample())
    pairs = demo_data.sentences(recipe["train_sentences"], seed=recipe["seed"])
    pairs += demo_data.paragraphs(recipe["train_paragraphs"], seed=recipe["seed"])
    kept = [(t, y) for t, y in pairs if t not in measured]
    return [t for t, _ in kept], [y for _, y in kept]


def in_domain_labels() -> dict[str, int]:
    """The labels of `serve_app.optimize.default_sample`'s generated texts (same seeds, same rows)."""
    from serve_app import demo_data
    from serve_app.optimize import DEFAULT_ROWS

    generated = demo_data.paragraphs(DEFAULT_ROWS // 2, seed=1901) + demo_data.sentences(DEFAULT_ROWS // 2, seed=1902)
    return dict(generated)


def _bert_config(shape: Shape, tokenizer: Any, *, labels: int) -> Any:
    """The BERT configuration of ``shape`` for ``tokenizer``'s vocabulary, with ``labels`` outputs."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_length,
        num_labels=labels,
        pad_token_id=tokenizer.pad_token_id,
    )


def _batches(lengths: list[int], rows: int) -> list[list[int]]:
    """Row indices of length-sorted batches (little padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + rows] for i in range(0, len(order), rows)]


def _train(shape: Shape, recipe: dict[str, Any], tokenizer_dir: Path, work: Path) -> None:
    """`TRAINED_RECIPE`'s steps: the frozen part's output once per text (kept in ``work``), then
    the top layers, pooler and head trained on it with checkpoints (a killed run resumes), then
    the whole model exported to ``work/model``."""
    import time

    import numpy as np

    from serve_app._tf import tensorflow

    tf = tensorflow()
    import tf_keras
    from transformers import AutoTokenizer, TFBertForSequenceClassification

    from serve_app import demo_data
    from serve_app.export.signature import save_serving_model
    from serve_app.model import MODEL_FORMAT

    tf_keras.utils.set_random_seed(recipe["seed"])
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    texts, labels = _training_texts(recipe)
    ids = tokenizer(texts, truncation=True, max_length=recipe["max_length"])["input_ids"]
    batches = _batches([len(x) for x in ids], recipe["batch_rows"])
    model = TFBertForSequenceClassification(_bert_config(shape, tokenizer, labels=len(demo_data.LABELS)))
    model(input_ids=np.ones((1, 8), np.int32), attention_mask=np.ones((1, 8), np.int32))
    frozen = shape.layers - recipe["trained_layers"]
    layers = model.bert.encoder.layer

    def bias(mask: Any) -> Any:  # the additive attention mask TFBertMainLayer builds
        return (1.0 - tf.cast(mask[:, None, None, :], tf.float32)) * -10000.0

    def run(hidden: Any, mask: Any, part: list[Any], training: bool) -> Any:
        for layer in part:
            hidden = layer(hidden, bias(mask), None, None, None, None, False, training=training)[0]
        return hidden

    # 1. The frozen part's output for every batch, once, one file a batch (the random init is
    #    seeded, so a resumed run's model has the same frozen weights; a killed pass resumes at
    #    the first batch without a file).
    started = time.monotonic()
    (work / "frozen").mkdir(exist_ok=True)
    for b, members in enumerate(batches):
        cached = work / "frozen" / f"{b}.npz"
        if cached.is_file():
            continue
        length = max(len(ids[i]) for i in members)
        input_ids = np.zeros((len(members), length), np.int32)
        mask = np.zeros_like(input_ids)
        for r, i in enumerate(members):
            input_ids[r, : len(ids[i])], mask[r, : len(ids[i])] = ids[i], 1
        hidden = run(model.bert.embeddings(input_ids=input_ids, training=False), mask, layers[:frozen], False)
        np.savez(work / "frozen" / f"{b}.tmp.npz", h=hidden.numpy(), m=mask)
        (work / "frozen" / f"{b}.tmp.npz").rename(cached)
        print(
            f"[bench-train] frozen part: batch {b + 1}/{len(batches)}, {time.monotonic() - started:.0f} s", flush=True
        )
    features = {}
    for b in range(len(batches)):
        with np.load(work / "frozen" / f"{b}.npz") as f:
            features[f"h{b}"], features[f"m{b}"] = f["h"], f["m"]

    # 2. The top layers, pooler and head, `epochs` passes over the cached batches in a seeded order.
    steps = recipe["epochs"] * len(batches)
    plan = np.concatenate(
        [np.random.default_rng([recipe["seed"], e]).permutation(len(batches)) for e in range(recipe["epochs"])]
    )
    peak, warmup = recipe["learning_rate"], recipe["warmup_steps"]

    class Schedule(tf_keras.optimizers.schedules.LearningRateSchedule):  # type: ignore[misc, name-defined, unused-ignore]
        """Linear warm-up, then linear decay to zero."""

        def __call__(self, step: Any) -> Any:
            step = tf.cast(step + 1, tf.float32)
            return peak * tf.minimum(step / warmup, tf.maximum(0.0, (steps - step) / (steps - warmup)))

    optimizer = tf_keras.optimizers.Adam(learning_rate=Schedule())
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trained = [v for layer in layers[frozen:] for v in layer.trainable_variables]
    pooler = model.bert.pooler
    assert pooler is not None  # TFBertForSequenceClassification builds its pooler
    trained += pooler.trainable_variables + model.classifier.trainable_variables
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = tf.train.CheckpointManager(checkpoint, str(work / "checkpoints"), max_to_keep=1)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint)
        print(f"[bench-train] resumed at step {int(step)}", flush=True)
    spec = tf.TensorSpec([None, None], tf.int32)

    @tf.function(
        input_signature=[tf.TensorSpec([None, None, shape.hidden], tf.float32), spec, tf.TensorSpec([None], tf.int32)]
    )  # type: ignore[untyped-decorator, unused-ignore]
    def train_step(hidden: Any, mask: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            pooled = pooler(run(hidden, mask, layers[frozen:], True))
            logits = model.classifier(model.dropout(pooled, training=True))
            loss = loss_fn(y, logits)
        optimizer.apply_gradients(zip(tape.gradient(loss, trained), trained, strict=True))
        return loss

    losses: list[float] = []
    while int(step) < steps:
        b = int(plan[int(step)])
        y = np.array([labels[i] for i in batches[b]], np.int32)
        losses.append(float(train_step(features[f"h{b}"], features[f"m{b}"], y)))
        step.assign_add(1)
        if int(step) % recipe["checkpoint_every"] == 0 or int(step) == steps:
            manager.save()
            print(
                f"[bench-train] step {int(step)}/{steps}: mean loss {np.mean(losses):.4f},"
                f" {time.monotonic() - started:.0f} s",
                flush=True,
            )
            losses = []

    # 3. The whole model, as every model directory is saved.
    out = work / "model"
    shutil.rmtree(out, ignore_errors=True)
    weights = tf.Module()
    weights.variables_ = list(model.variables)
    save_serving_model(
        weights,
        lambda input_ids, attention_mask: (
            model(input_ids=input_ids, attention_mask=attention_mask, training=False).logits
        ),
        out / "saved_model",
    )
    shutil.copytree(tokenizer_dir, out / "tokenizer")
    card: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "labels": list(demo_data.LABELS),
        "version": f"bench-trained-{shape.name}-{shape.layers}x{shape.hidden}-L{recipe['max_length']}",
        "max_sequence_length": recipe["max_length"],
        "parameters": int(sum(np.prod(v.shape) for v in model.variables)),
        "note": (
            f"{shape.name}'s shape trained here on generated text (top {recipe['trained_layers']} layers and the"
            " head; the rest random init), not the published checkpoint"
        ),
        "recipe": recipe,
    }
    (out / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    card["trained"] = quality(out)
    print(f"[bench-train] {card['trained']}", flush=True)
    (out / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")


def quality(model_dir: Path, texts: int = 300) -> dict[str, Any]:
    """Whether a model is a trained one: its accuracy against the generator's labels on the bench's
    held-out in-domain texts, and its median top-label margin (top probability less the second)
    in and out of domain. A random-weights model scores about 1/6 with margins near 0."""
    import numpy as np

    from serve_app.gate_texts import out_of_domain
    from serve_app.model import EmotionModel
    from serve_app.optimize import default_sample, split_sample

    model = EmotionModel.load(model_dir)
    truth = in_domain_labels()
    held = [t for t in split_sample(default_sample(), source="default sample").held_out if t in truth][:texts]
    inside = model.predict(held).probabilities
    outside = model.predict(out_of_domain()[:texts]).probabilities

    def margin(p: Any) -> float:
        top = np.sort(p, axis=1)
        return round(float(np.median(top[:, -1] - top[:, -2])), 4)

    return {
        "in_domain_accuracy": round(float(np.mean(inside.argmax(1) == np.array([truth[t] for t in held]))), 4),
        "in_domain_texts": len(held),
        "median_margin_in": margin(inside),
        "median_margin_out": margin(outside),
        "out_of_domain_texts": len(outside),
    }


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
    from transformers import AutoTokenizer, TFBertForSequenceClassification

    from serve_app import demo_data
    from serve_app.model import MODEL_FORMAT

    tf_keras.utils.set_random_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    model = TFBertForSequenceClassification(_bert_config(shape, tokenizer, labels=shape.labels))
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
    elif sys.argv[1] == "--trained":
        _train(Shape(**json.loads(sys.argv[2])), json.loads(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    elif sys.argv[1] == "--quality":
        print(json.dumps(quality(Path(sys.argv[2]))))
    else:
        _build(Shape(**json.loads(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3]))
