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

`EmotionModel.predict` is the whole serving path for a batch, in two steps the deployment
runs on different threads: `tokenize` (with honest truncation flags) and `infer` (sort by
token length, cut into chunks under a token budget, pad each chunk only to its longest row
rounded up to a multiple of 8, run the signature, put the rows back in input order).
Problems with the directory raise `ModelDirError`, which names the directory and the file.

Padding to the chunk's longest row rather than to power-of-two buckets: on the benchmark's
corpus (lognormal lengths, median 60 tokens) buckets padded ~25% more tokens than the rows
hold; TensorFlow's signature takes any shape, so a new length costs no retracing. Multiples
of 8 keep oneDNN's kernels on aligned shapes and bound the distinct shapes to max_len / 8.

The forward pass runs on a *runtime*: TensorFlow (the SavedModel's signature, the reference)
or OpenVINO (`serve_app.compiled`: the SavedModel compiled for this CPU, fp32, bf16 or an NNCF
int8 build). Which one a replica serves is `serve_app.runtimes.choose`'s call.
`configure_precision` turns on TensorFlow's oneDNN bf16 auto mixed precision, on CPUs with
native bf16 (AVX512_BF16 or AMX); it must run before the model's graph first runs.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serve_app._tf import tensorflow

__all__ = [
    "MODEL_FORMAT",
    "PASS_COST_TOKENS",
    "PRECISIONS",
    "RUNTIMES",
    "Chunk",
    "EmotionModel",
    "ModelCard",
    "ModelDirError",
    "Precision",
    "Predictions",
    "Tokenized",
    "check_model_limits",
    "configure_precision",
    "configure_tf_threads",
    "cpu_flags",
    "cpu_model_name",
    "cut_sorted",
    "has_native_bf16",
    "load_serving_signature",
    "padded_length",
    "read_model_card",
]

logger = logging.getLogger(__name__)

#: The value of ``model.json["format"]`` this module understands.
MODEL_FORMAT = "raypipe-model/1"

# Chunks are padded to a multiple of this many tokens (oneDNN prefers aligned shapes).
PAD_MULTIPLE = 8
# Lengths run once at warm-up, so the first real chunks of common lengths pay no first-run cost.
_WARMUP_LENGTHS = (16, 32, 64, 128, 256, 512)
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
    padded_tokens: int = 0
    """Rows x padded length summed over the forward passes: the tokens the model computed."""


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


def padded_length(longest: int, max_sequence_length: int) -> int:
    """The length a chunk whose longest row has `longest` tokens is padded to."""
    return min(max_sequence_length, max(PAD_MULTIPLE, math.ceil(longest / PAD_MULTIPLE) * PAD_MULTIPLE))


#: What a forward pass costs beyond its padded tokens, in tokens: `cut_sorted` makes a pass
#: more only where it saves more padding than this. Measured with OpenVINO on one thread, a
#: pass of r rows x L tokens costs about (c + r x L) tokens' time with c of at most 12 (bert-base
#: fp32, minilm-l6 bf16, L of 64 and 128), and a pass of one or two rows 6-20% more per token
#: than one of four or more: 32 leaves a margin for both.
PASS_COST_TOKENS = 32


def cut_sorted(padded: np.ndarray, budget: int, pass_cost: int = PASS_COST_TOKENS) -> list[tuple[int, int]]:
    """Where to cut rows of ascending padded lengths into passes: consecutive chunks, as
    (start, stop) ranges, each within `budget` rows x its longest row, that minimise the padded
    tokens plus `pass_cost` per pass.

    A shortest-path over the cut points (the cost of a chunk [i, j) is pass_cost + (j - i) x
    padded[j - 1]), one vectorised step per row: about 4 µs a row, under a tenth of a percent of
    the passes it plans (a 128-row call of minilm-l6 takes about 0.7 CPU-seconds). Greedy filling
    (each chunk as full as the budget allows) is one of the paths weighed, so the answer never
    costs more than it.
    """
    n = len(padded)
    best = np.zeros(n + 1)
    prev = np.zeros(n + 1, dtype=np.int64)
    for stop in range(1, n + 1):
        length = int(padded[stop - 1])
        first = max(0, stop - max(1, budget // length))
        cost = best[first:stop] + pass_cost + (stop - np.arange(first, stop)) * length
        k = int(np.argmin(cost))  # the first minimum: the longer chunk where costs tie
        best[stop], prev[stop] = cost[k], first + k
    ranges = []
    while n > 0:
        ranges.append((int(prev[n]), n))
        n = int(prev[n])
    return ranges[::-1]


Precision = Literal["fp32", "bf16", "bf16-dense", "bf16-ffn", "bf16-recheck", "bf16-dense-recheck", "int8", "auto"]
#: The precisions `EmotionModel.load` runs (`serve_app.runtimes.choose` resolves ``auto``); the
#: ``bf16-*`` ones, between fp32 and bf16, and int8 run on OpenVINO only (`serve_app.compiled`).
PRECISIONS = ("fp32", "bf16", "bf16-dense", "bf16-ffn", "bf16-recheck", "bf16-dense-recheck", "int8")
#: The runtimes `EmotionModel.load` runs a model on.
RUNTIMES = ("tensorflow", "openvino")


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name as Linux reports it ("" where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def has_native_bf16(flags: frozenset[str]) -> bool:
    return "avx512_bf16" in flags or "amx_bf16" in flags


def configure_precision(precision: str, flags: frozenset[str] | None = None) -> str:
    """Sets TensorFlow's compute precision for this process; returns it.

    ``bf16`` turns on TensorFlow's oneDNN bf16 auto mixed precision (matmuls in bf16, softmax
    and layer norms kept in fp32); it needs a CPU with native bf16, since emulated bf16 is
    slower than fp32. Call before any graph runs: Grappler rewrites a function when it is first
    instantiated. ``int8`` is not a TensorFlow precision (it runs on OpenVINO), and ``auto`` is
    resolved by `serve_app.runtimes.choose` from measured agreement, not here.
    """
    flags = cpu_flags() if flags is None else flags
    if precision == "bf16":
        if not has_native_bf16(flags):
            raise ValueError("precision 'bf16' needs a CPU with AVX512_BF16 or AMX; this one has neither")
        tensorflow().config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": True})
    elif precision != "fp32":
        raise ValueError(f"TensorFlow precision must be fp32 or bf16, not {precision!r} (int8 runs on OpenVINO)")
    return precision


@dataclass(frozen=True)
class Tokenized:
    """Texts turned into token ids, ready for `EmotionModel.infer`."""

    ids: list[list[int]]
    """Token ids per text, special tokens included, unpadded."""
    truncated: np.ndarray
    """bool ``[n]``: part of the text did not reach the model."""

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def concat(parts: Sequence[Tokenized]) -> Tokenized:
        ids = [row for part in parts for row in part.ids]
        truncated = np.concatenate([p.truncated for p in parts]) if parts else np.zeros(0, dtype=bool)
        return Tokenized(ids=ids, truncated=truncated)


@dataclass(frozen=True)
class Chunk:
    """One forward pass of a batch: which rows (indices into the batch), padded to what length."""

    rows: np.ndarray
    """int64 indices of the batch's rows, shortest first."""
    length: int
    """The padded length: the longest row's, rounded up to a multiple of 8."""

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.length


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
        token_budget: int = 2048,
    ) -> None:
        _check_token_budget(token_budget, card.max_sequence_length)
        self.card = card
        self.token_budget = token_budget
        self._tokenizer = tokenizer
        self._run = run
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
        token_budget: int = 2048,
        precision: str = "fp32",
        runtime: str = "tensorflow",
        threads: int = 0,
        streams: int = 1,
        recheck_margin: float | None = None,
    ) -> EmotionModel:
        """Load ``model_dir`` without touching the network.

        ``max_sequence_length`` may lower the card's value (cheaper, less context), never
        raise it: the model has no position embeddings beyond it. ``token_budget`` caps
        rows x padded length per call to the model, bounding peak memory. ``runtime``
        ``tensorflow`` runs the SavedModel (``precision`` fp32, or bf16 once
        `configure_precision` set it); ``openvino`` runs it compiled by OpenVINO
        (`serve_app.compiled`; fp32, bf16, or the int8 build of ``raypipe model optimize``)
        with ``streams`` forward passes at once, each on ``threads`` threads (0: 1).
        ``recheck_margin``: a recheck precision's margin (`serve_app.runtimes.Serving.margin`).
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        if runtime == "tensorflow" and precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r} runs on OpenVINO only (runtime='openvino')")
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
        run: _Runner
        if runtime == "openvino":
            from serve_app.compiled import load_openvino_runner

            run = load_openvino_runner(
                model_dir,
                n_labels=len(card.labels),
                precision=precision,
                threads=max(1, threads),
                streams=streams,
                flags=cpu_flags(),
                margin=recheck_margin,
            )
        else:
            run = _load_signature(model_dir / "saved_model", n_labels=len(card.labels))
        return cls(card=card, tokenizer=tokenizer, run=run, token_budget=token_budget)

    def predict(self, texts: Sequence[str]) -> Predictions:
        """Class probabilities for each text, in input order."""
        return self.infer(self.tokenize(texts))

    def tokenize(self, texts: Sequence[str]) -> Tokenized:
        """Token ids of each text, cut to the model's length (thread-safe)."""
        if not all(isinstance(t, str) for t in texts):
            bad = next(type(t).__name__ for t in texts if not isinstance(t, str))
            raise TypeError(f"texts must all be str, got a {bad}")
        if not texts:
            return Tokenized(ids=[], truncated=np.zeros((0,), dtype=bool))
        ids, truncated = self._tokenize(texts)
        return Tokenized(ids=ids, truncated=truncated)

    def infer(self, tokenized: Tokenized) -> Predictions:
        """Runs the model on tokenized texts: length-sorted chunks under the token budget, one
        after the other (a replica runs a batch's chunks on its model threads at once)."""
        chunks = self.chunks(tokenized)
        probabilities = np.empty((len(tokenized), len(self.card.labels)), dtype=np.float32)
        for chunk in chunks:
            probabilities[chunk.rows] = self.run_chunk(tokenized, chunk)
        padded = sum(c.padded_tokens for c in chunks)
        return Predictions(probabilities=probabilities, truncated=tokenized.truncated, padded_tokens=padded)

    def chunks(self, tokenized: Tokenized) -> list[Chunk]:
        """The forward passes for `tokenized`: its rows sorted by length, cut into chunks padded
        to their longest row (rounded up to a multiple of 8) whose rows x padded length stays
        within the token budget. Each is one `run_chunk`; they may run in any order, at once.

        Where to cut is `cut_sorted`'s choice: the fewest padded tokens, a pass counted as
        `PASS_COST_TOKENS` more, not the fullest chunks. A replica cuts one batch of calls (a
        few hundred rows): on the bench corpus, filling each chunk to the budget padded such a
        batch to 1.06-1.11x its real tokens where a whole sorted corpus pads 1.04-1.06x; cut
        where the lengths jump, it pads 1.04-1.05x.
        """
        max_len = self.card.max_sequence_length
        lengths = np.fromiter((len(x) for x in tokenized.ids), dtype=np.int64, count=len(tokenized))
        order = np.argsort(lengths, kind="stable")
        padded = np.array([padded_length(int(n), max_len) for n in lengths[order]], dtype=np.int64)
        return [
            Chunk(rows=order[start:stop], length=int(padded[stop - 1]))
            for start, stop in cut_sorted(padded, self.token_budget)
        ]

    def run_chunk(self, tokenized: Tokenized, chunk: Chunk) -> np.ndarray:
        """One forward pass: the chunk's rows, padded, through the runtime; float32 ``[rows, labels]``."""
        input_ids = np.full((len(chunk.rows), chunk.length), self._pad_id, dtype=np.int32)
        attention_mask = np.zeros((len(chunk.rows), chunk.length), dtype=np.int32)
        ids = tokenized.ids
        for r, i in enumerate(chunk.rows.tolist()):
            row = ids[i]
            input_ids[r, : len(row)] = row
            attention_mask[r, : len(row)] = 1
        return np.asarray(self._run(input_ids, attention_mask), dtype=np.float32)

    def warmup(self) -> None:
        """Run one full chunk at a spread of lengths, so no real request pays first-run cost."""
        max_len = self.card.max_sequence_length
        for length in sorted({min(n, max_len) for n in _WARMUP_LENGTHS}):
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


def _check_token_budget(token_budget: int, max_sequence_length: int) -> None:
    if token_budget < max_sequence_length:
        raise ValueError(
            f"token_budget ({token_budget}) must hold at least one row of "
            f"max_sequence_length ({max_sequence_length}) tokens"
        )


def check_model_limits(model: EmotionModel, model_dir: Path | str, *, vocab_size: int | None = None) -> None:
    """Run the model at the edges its directory promises; raise `ModelDirError` if it fails there.

    A directory whose parts do not belong together still loads, and most texts still run:
    the first rare word past the embedding table, or the first text longer than the position
    embeddings, then fails its whole batch on the server. So: the signature must answer one
    row per label on a one-token input, take the largest token id the tokenizer produces, and
    take a row of ``max_sequence_length`` tokens. ``vocab_size`` (an exported card's) is the
    vocabulary the model was exported with; the tokenizer must match it exactly.
    """
    model_dir = Path(model_dir)
    tokenizer = model._tokenizer
    largest = max(tokenizer.get_vocab().values())
    if vocab_size is not None and largest + 1 != vocab_size:
        raise ModelDirError(
            model_dir / "tokenizer",
            f"the tokenizer has {largest + 1} token ids but model.json says the model was exported "
            f"with a vocabulary of {vocab_size}: this is not the model's tokenizer",
        )
    token = tokenizer.unk_token_id
    # Not the padding id: RoBERTa-style models give padding tokens no position at all.
    token = int(token) if token is not None and token != tokenizer.pad_token_id else 0
    _check_output_width(model, model_dir, token)
    _check_vocabulary(model, model_dir, largest)
    _check_max_length(model, model_dir, token)


def _check_output_width(model: EmotionModel, model_dir: Path, token: int) -> None:
    tf = tensorflow()
    n_labels = len(model.card.labels)
    try:
        out = model._run(np.array([[token]], dtype=np.int32), np.ones((1, 1), dtype=np.int32))
    except tf.errors.OpError as e:
        raise ModelDirError(model_dir / "saved_model", f"the signature fails on a one-token input: {e}") from e
    if out.shape != (1, n_labels):
        raise ModelDirError(
            model_dir / "saved_model",
            f"model outputs shape {list(out.shape)} for one text but model.json lists {n_labels} labels",
        )


def _check_vocabulary(model: EmotionModel, model_dir: Path, largest: int) -> None:
    if _runs(model, [largest]):
        return
    rows = _last_passing(0, largest, lambda i: _runs(model, [i])) + 1
    raise ModelDirError(
        model_dir / "tokenizer",
        f"the tokenizer produces token ids up to {largest} but the model's embedding table has "
        f"{rows} rows: this is not the model's tokenizer",
    )


def _check_max_length(model: EmotionModel, model_dir: Path, token: int) -> None:
    max_len = model.card.max_sequence_length
    if _runs(model, [token] * max_len):
        return
    fits = _last_passing(1, max_len, lambda n: _runs(model, [token] * n))
    raise ModelDirError(
        model_dir / "model.json",
        f"max_sequence_length is {max_len} but the model has position embeddings for {fits} "
        f"tokens: set it to {fits} or less",
    )


def _runs(model: EmotionModel, ids: list[int]) -> bool:
    """Whether the signature takes one row of ``ids`` (an out-of-table id fails its gather)."""
    tf = tensorflow()
    row = np.array([ids], dtype=np.int32)
    try:
        model._run(row, np.ones_like(row))
    except tf.errors.InvalidArgumentError:
        return False
    return True


def _last_passing(good: int, bad: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [good, bad) with ok(n), given ok(good) and not ok(bad) (monotone)."""
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


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


def load_serving_signature(path: Path, *, error: type[ModelDirError] = ModelDirError) -> tuple[Any, Any]:
    """The loaded SavedModel at ``path`` and its ``serving_default`` signature, or ``error``.

    Keep the loaded object while the signature is used: a signature holds only a weak
    reference to the variables' owner.
    """
    if not path.is_dir():
        raise error(path, "missing saved_model directory")
    tf = tensorflow()
    try:
        loaded = tf.saved_model.load(str(path))
    except (OSError, ValueError, tf.errors.OpError) as e:
        raise error(path, f"cannot load SavedModel: {e}") from e
    signature = loaded.signatures.get("serving_default")
    if signature is None:
        raise error(path, "SavedModel has no 'serving_default' signature")
    return loaded, signature


def _load_signature(path: Path, *, n_labels: int) -> _Runner:
    tf = tensorflow()
    loaded, signature = load_serving_signature(path)
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
