"""Hugging Face checkpoint directories for the export tests, written offline.

A checkpoint here is what a team brings after fine-tuning: ``config.json`` (with ``id2label``),
tokenizer files and weights, as TF (``tf_model.h5``, TF safetensors) or PyTorch safetensors
(single or sharded), the latter written the way PyTorch's ``save_pretrained`` names them.
No torch is needed: TF weights are renamed and transposed with transformers' own mapping.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serve_app._tf import tensorflow

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
