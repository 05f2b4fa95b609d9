"""The served model: load a model directory and run it on batches of texts.

A model directory is the contract between whoever produces a model (the offline demo in
`serve_app.demo_model`, later ``raypipe model export``) and the Ray Serve deployment::

    DIR/
      model.json     {"format": "raypipe-model/1", "labels": [...], "version": "...",
                      "max_sequence_length": N, "fingerprint": "..." (optional)}
      saved_model/   TF SavedModel; signature "serving_default":
                     (input_ids int32[None, None], attention_mask int32[None, None])
                       -> {"probabilities": float32[None, n_labels]}
      tokenizer/     Hugging Face fast-tokenizer files, loadable offline

`EmotionModel.predict` is the whole serving path for a batch: tokenize (with honest
truncation flags), sort by token length, pad each chunk only to its length bucket, keep
every chunk under a token budget, run the signature, and put the rows back in input order.
Problems with the directory raise `ModelDirError`, which names the directory and the file.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from serve_app._tf import tensorflow

__all__ = [
    "MODEL_FORMAT",
    "EmotionModel",
    "ModelCard",
    "ModelDirError",
    "Predictions",
    "bucket_lengths",
    "configure_tf_threads",
    "read_model_card",
]

logger = logging.getLogger(__name__)

#: The value of ``model.json["format"]`` this module understands.
MODEL_FORMAT = "raypipe-model/1"

# Smallest padded length. Shorter buckets would add shapes to warm up for little saving:
# [CLS] + [SEP] plus a short sentence already takes ~10-16 tokens.
_MIN_BUCKET = 16
# Characters kept per allowed token before tokenizing. WordPiece tokens average ~4-5
# characters of English, so a text cut here still has far more tokens than the model can
# take, while a 10 MB paragraph costs no more to tokenize than a long one.
_CHARS_PER_TOKEN_CAP = 32


class ModelDirError(ValueError):
    """A model directory is missing, incomplete or malformed.

    ``path`` is the directory or file at fault; the message names it and says what is wrong.
    """

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class ModelCard:
    """The parsed, validated ``model.json`` of a model directory."""

    labels: tuple[str, ...]
    """Label names, in the order of the model's output columns."""
    version: str
    """Model version, written beside every prediction."""
    max_sequence_length: int
    """Most tokens (special tokens included) the model takes; longer texts are cut."""

    def __post_init__(self) -> None:
        if not self.labels or not all(isinstance(x, str) and x for x in self.labels):
            raise ValueError(f"labels must be a non-empty list of non-empty strings, got {self.labels!r}")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be unique, got {self.labels!r}")
        if not isinstance(self.version, str) or not self.version:
            raise ValueError(f"version must be a non-empty string, got {self.version!r}")
        # bool is an int subclass; `true` in JSON is never a length.
        if (
            not isinstance(self.max_sequence_length, int)
            or isinstance(self.max_sequence_length, bool)
            or self.max_sequence_length < 3
        ):
            raise ValueError(f"max_sequence_length must be an integer >= 3, got {self.max_sequence_length!r}")


def read_model_card(model_dir: Path | str) -> ModelCard:
    """Read and validate ``model_dir/model.json``; raise `ModelDirError` if it is unusable."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(model_dir, "model directory does not exist or is not a directory")
    path = model_dir / "model.json"
    if not path.is_file():
        raise ModelDirError(path, "missing model.json (the model card)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(path, f"cannot read model.json: {e}") from e
    if not isinstance(raw, dict):
        raise ModelDirError(path, "model.json must hold a JSON object")
    if raw.get("format") != MODEL_FORMAT:
        raise ModelDirError(path, f"format must be {MODEL_FORMAT!r}, got {raw.get('format')!r}")
    missing = [k for k in ("labels", "version", "max_sequence_length") if k not in raw]
    if missing:
        raise ModelDirError(path, f"model.json lacks required field(s): {', '.join(missing)}")
    labels = raw["labels"]
    if not isinstance(labels, list):
        raise ModelDirError(path, f"labels must be a list, got {labels!r}")
    try:
        return ModelCard(
            labels=tuple(labels),
            version=raw["version"],
            max_sequence_length=raw["max_sequence_length"],
        )
    except ValueError as e:
        raise ModelDirError(path, str(e)) from e


@dataclass(frozen=True)
class Predictions:
    """Model output for a batch of texts, rows in input order."""

    probabilities: np.ndarray
    """float32 ``[n, n_labels]``; each row sums to 1."""
    truncated: np.ndarray
    """bool ``[n]``: part of the text did not reach the model (more tokens than allowed)."""


def configure_tf_threads(intra_op: int, inter_op: int) -> None:
    """Size TensorFlow's thread pools (0 lets TensorFlow choose).

    TensorFlow fixes its pools when it first runs anything, so call this before loading a
    model. A later call cannot change them; it logs a warning rather than failing, because
    a replica that already runs is still useful.
    """
    if intra_op < 0 or inter_op < 0:
        raise ValueError(f"thread counts must be >= 0, got intra_op={intra_op}, inter_op={inter_op}")
    tf = tensorflow()
    threading = tf.config.threading
    if (
        threading.get_intra_op_parallelism_threads() == intra_op
        and threading.get_inter_op_parallelism_threads() == inter_op
    ):
        return
    try:
        threading.set_intra_op_parallelism_threads(intra_op)
        threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError as e:
        logger.warning(
            "TensorFlow is already initialised; thread pools stay at intra_op=%d, inter_op=%d (wanted %d, %d): %s",
            threading.get_intra_op_parallelism_threads(),
            threading.get_inter_op_parallelism_threads(),
            intra_op,
            inter_op,
            e,
        )


def bucket_lengths(max_sequence_length: int) -> tuple[int, ...]:
    """Padded lengths a batch may take: powers of two from 16, then the maximum itself."""
    out: list[int] = []
    length = _MIN_BUCKET
    while length < max_sequence_length:
        out.append(length)
        length *= 2
    out.append(max_sequence_length)
    return tuple(out)


# (input_ids, attention_mask) -> probabilities, both int32 [rows, length].
_Runner = Callable[[np.ndarray, np.ndarray], np.ndarray]


class EmotionModel:
    """A loaded model directory: tokenizer + SavedModel signature + card.

    Build with `EmotionModel.load`. ``card.max_sequence_length`` is the length this
    instance actually uses (the file's value, or a lower override).
    """

    def __init__(
        self,
        *,
        card: ModelCard,
        tokenizer: Any,
        run: _Runner,
        token_budget: int = 8192,
    ) -> None:
        _check_token_budget(token_budget, card.max_sequence_length)
        self.card = card
        self.token_budget = token_budget
        self._tokenizer = tokenizer
        self._run = run
        self._buckets = bucket_lengths(card.max_sequence_length)
        self._pad_id = int(tokenizer.pad_token_id or 0)
        # A HF fast tokenizer sets truncation on its shared Rust object for each call, so
        # two threads tokenizing at once could see each other's settings.
        self._tokenize_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model_dir: Path | str,
        *,
        max_sequence_length: int | None = None,
        token_budget: int = 8192,
    ) -> EmotionModel:
        """Load ``model_dir`` without touching the network.

        ``max_sequence_length`` may lower the card's value (cheaper, less context), never
        raise it: the model has no position embeddings beyond it. ``token_budget`` caps
        rows x padded length per call to the model, bounding peak memory.
        """
        model_dir = Path(model_dir)
        card = read_model_card(model_dir)
        if max_sequence_length is not None:
            if max_sequence_length > card.max_sequence_length:
                raise ValueError(
                    f"max_sequence_length={max_sequence_length} exceeds the model's "
                    f"{card.max_sequence_length} ({model_dir / 'model.json'})"
                )
            # replace() re-runs ModelCard's validation (e.g. rejects 0).
            card = replace(card, max_sequence_length=max_sequence_length)
        # Checked before the slow loads, so a bad argument fails fast.
        _check_token_budget(token_budget, card.max_sequence_length)
        tokenizer = _load_tokenizer(model_dir / "tokenizer")
        run = _load_signature(model_dir / "saved_model", n_labels=len(card.labels))
        return cls(card=card, tokenizer=tokenizer, run=run, token_budget=token_budget)

    def predict(self, texts: Sequence[str]) -> Predictions:
        """Class probabilities for each text, in input order."""
        if not all(isinstance(t, str) for t in texts):
            bad = next(type(t).__name__ for t in texts if not isinstance(t, str))
            raise TypeError(f"texts must all be str, got a {bad}")
        n = len(texts)
        n_labels = len(self.card.labels)
        if n == 0:
            return Predictions(
                probabilities=np.zeros((0, n_labels), dtype=np.float32),
                truncated=np.zeros((0,), dtype=bool),
            )
        ids, truncated = self._tokenize(texts)
        probabilities = np.empty((n, n_labels), dtype=np.float32)
        for rows, length in self._chunks([len(x) for x in ids]):
            input_ids = np.full((len(rows), length), self._pad_id, dtype=np.int32)
            attention_mask = np.zeros((len(rows), length), dtype=np.int32)
            for r, i in enumerate(rows):
                input_ids[r, : len(ids[i])] = ids[i]
                attention_mask[r, : len(ids[i])] = 1
            probabilities[rows] = self._run(input_ids, attention_mask)
        return Predictions(probabilities=probabilities, truncated=truncated)

    def warmup(self) -> None:
        """Run one full chunk of every bucket shape, so no real request pays first-run cost."""
        for length in self._buckets:
            rows = self.token_budget // length
            input_ids = np.full((rows, length), self._pad_id, dtype=np.int32)
            attention_mask = np.ones((rows, length), dtype=np.int32)
            self._run(input_ids, attention_mask)

    def _tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], np.ndarray]:
        max_len = self.card.max_sequence_length
        char_cap = max_len * _CHARS_PER_TOKEN_CAP
        capped = [t if len(t) <= char_cap else t[:char_cap] for t in texts]
        with self._tokenize_lock:
            encoded = self._tokenizer(
                capped,
                truncation=True,
                max_length=max_len,
                # The fast tokenizer returns what truncation dropped as extra rows
                # mapped back to their text: the honest "was it cut?" signal.
                return_overflowing_tokens=True,
                stride=0,
                padding=False,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
        mapping = encoded["overflow_to_sample_mapping"]
        ids: list[list[int] | None] = [None] * len(texts)
        truncated = np.array([len(t) > char_cap for t in texts], dtype=bool)
        for row, sample in zip(encoded["input_ids"], mapping, strict=True):
            if ids[sample] is None:
                ids[sample] = row
            else:
                truncated[sample] = True
        return [x if x is not None else [] for x in ids], truncated

    def _chunks(self, lengths: list[int]) -> list[tuple[list[int], int]]:
        """Group row indices by length bucket and split each group to fit the token budget."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        chunks: list[tuple[list[int], int]] = []
        current: list[int] = []
        current_bucket = 0
        for i in order:
            bucket = next(b for b in self._buckets if b >= lengths[i])
            if current and (bucket != current_bucket or (len(current) + 1) * bucket > self.token_budget):
                chunks.append((current, current_bucket))
                current = []
            current.append(i)
            current_bucket = bucket
        if current:
            chunks.append((current, current_bucket))
        return chunks


def _check_token_budget(token_budget: int, max_sequence_length: int) -> None:
    if token_budget < max_sequence_length:
        raise ValueError(
            f"token_budget ({token_budget}) must hold at least one row of "
            f"max_sequence_length ({max_sequence_length}) tokens"
        )


def _load_tokenizer(path: Path) -> Any:
    if not path.is_dir():
        raise ModelDirError(path, "missing tokenizer directory")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call, unused-ignore]
    # transformers reports bad tokenizer files through several unrelated types; this is
    # the one place they become a ModelDirError.
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelDirError(path, f"cannot load tokenizer: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelDirError(path, "tokenizer must be a fast (Rust) tokenizer; add tokenizer.json")
    return tokenizer


def _load_signature(path: Path, *, n_labels: int) -> _Runner:
    if not path.is_dir():
        raise ModelDirError(path, "missing saved_model directory")
    tf = tensorflow()
    try:
        loaded = tf.saved_model.load(str(path))
    except (OSError, ValueError, tf.errors.OpError) as e:
        raise ModelDirError(path, f"cannot load SavedModel: {e}") from e
    signature = loaded.signatures.get("serving_default")
    if signature is None:
        raise ModelDirError(path, "SavedModel has no 'serving_default' signature")
    _, inputs = signature.structured_input_signature
    for name in ("input_ids", "attention_mask"):
        spec = inputs.get(name)
        if spec is None or spec.dtype != tf.int32 or spec.shape.rank != 2:
            raise ModelDirError(path, f"signature input {name!r} must be int32[None, None], got {spec}")
    output = signature.structured_outputs.get("probabilities")
    if output is None:
        raise ModelDirError(path, "signature has no 'probabilities' output")
    width = output.shape[-1] if output.shape.rank == 2 else None
    if width is not None and width != n_labels:
        raise ModelDirError(
            path,
            f"model outputs {width} classes but model.json lists {n_labels} labels",
        )

    return _SignatureRunner(loaded, signature)


class _SignatureRunner:
    """Calls a SavedModel signature on numpy arrays.

    Holds the loaded object too: a signature keeps only a weak reference to the variables'
    owner, and would fail once it is garbage collected.
    """

    def __init__(self, loaded: Any, signature: Any) -> None:
        self._loaded = loaded
        self._signature = signature
        self._tf = tensorflow()

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        tf = self._tf
        out = self._signature(
            input_ids=tf.constant(input_ids, dtype=tf.int32),
            attention_mask=tf.constant(attention_mask, dtype=tf.int32),
        )
        return np.asarray(out["probabilities"].numpy(), dtype=np.float32)
