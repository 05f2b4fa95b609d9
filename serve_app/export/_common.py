"""Steps both exports share: resolve local sources, check labels and lengths, build the
directory beside its destination, write the card, and prove it serves what the source computes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.compiled import tree_digest
from serve_app.export.check import SAMPLE_TEXTS, check_model_dir
from serve_app.export.signature import weights_digest
from serve_app.model import MODEL_FORMAT, ModelCard, ModelDirError

logger = logging.getLogger("serve_app.export")

# Served probabilities must equal the source model's on the same tokens to this much.
_AGREEMENT = 1e-4

# A tokenizer's model_max_length above this is transformers' "no limit" sentinel.
NO_LIMIT = 1_000_000

# A version prefix.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A Hub model id ("bert-base-uncased", "org/name"), as opposed to a filesystem path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class ExportError(ModelDirError):
    """A source checkpoint cannot be exported; ``path`` is the file or directory at fault."""


def local_dir(path: Path | str, what: str) -> Path:
    text = str(path)
    p = Path(text).expanduser()
    if p.is_dir():
        return p.absolute()
    if text.startswith(("hf://", "http://", "https://")) or (not p.exists() and _HUB_ID.fullmatch(text)):
        raise ExportError(
            text,
            f"no local {what} directory of that name, and raypipe never downloads models: if this is a "
            f"Hugging Face Hub model id, download it first (e.g. `huggingface-cli download {text} "
            "--local-dir DIR`) and pass DIR",
        )
    raise ExportError(text, f"{what} directory does not exist or is not a directory")


def load_source_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call, unused-ignore]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(path, f"cannot load a tokenizer from here: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(path, "the tokenizer must be a fast (Rust) tokenizer: add tokenizer.json")
    return tokenizer


def vocabulary_size(tokenizer: Any) -> int:
    """Size of the id space the tokenizer uses: its largest id + 1 (ids may have holes)."""
    return max(tokenizer.get_vocab().values()) + 1


def any_token_id(tokenizer: Any) -> int:
    unk = tokenizer.unk_token_id
    return int(unk) if unk is not None and unk != tokenizer.pad_token_id else 0


def resolve_max_length(
    requested: int | None, capacity: int, tokenizer: Any, where: Path, *, need_limit: bool = False
) -> int:
    tokenizer_limit = int(tokenizer.model_max_length) if tokenizer.model_max_length < NO_LIMIT else None
    if requested is None:
        if need_limit and tokenizer_limit is None:
            raise ExportError(where, "cannot tell the model's maximum length: pass max_sequence_length")
        return min(capacity, tokenizer_limit or capacity)
    if requested > capacity:
        raise ExportError(where, f"max length {requested} is beyond the model's {capacity} positions")
    if requested < 3:
        raise ExportError(where, f"max length must be at least 3, got {requested}")
    return requested


def check_labels(labels: tuple[str, ...], where: Path) -> tuple[str, ...]:
    try:
        ModelCard(labels=labels, version="x", max_sequence_length=3)
    except ValueError as e:
        raise ExportError(where, str(e)) from e
    return labels


def check_name(name: str | None) -> str | None:
    if name is not None and not _NAME.fullmatch(name):
        raise ValueError(f"name must be letters, digits, '.', '_' or '-', got {name!r}")
    return name


@contextmanager
def building(out_dir: Path, *, overwrite: bool, source: Path) -> Iterator[Path]:
    """A fresh directory beside ``out_dir``, renamed into place only if the block succeeds."""
    out = out_dir.absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ExportError(out, "already exists; pass overwrite=True (--force) to replace it")
    if out == source or source in out.parents:
        raise ExportError(out, f"the output must not be inside the source {source}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def finish(
    tmp: Path,
    tokenizer: Any,
    labels: tuple[str, ...],
    max_len: int,
    prefix: str,
    source: dict[str, Any],
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    softmax: bool,
) -> None:
    """Tokenizer + card beside the saved signature, then prove the directory serves what the source computes."""
    tokenizer.model_max_length = max_len
    canonical_call_state(tokenizer)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    digest, parameters = weights_digest(tmp / "saved_model")
    # The tokenizer's files: its vocabulary, rules, special tokens and maximum length all change
    # how a text is cut into ids.
    tokenizer_digest = tree_digest(tmp / "tokenizer")
    card = {
        "format": MODEL_FORMAT,
        "labels": list(labels),
        "version": f"{prefix}-{answers_digest(digest, tokenizer_digest, max_len, labels)[:12]}",
        "max_sequence_length": max_len,
        "vocab_size": vocabulary_size(tokenizer),
        "parameters": parameters,
        "weights_sha256": digest,
        "tokenizer_sha256": tokenizer_digest,
        "source": source,
    }
    (tmp / "model.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")

    served = check_model_dir(tmp, SAMPLE_TEXTS).probabilities
    expected = np.empty_like(served)
    for i, text in enumerate(SAMPLE_TEXTS):
        ids = np.asarray([tokenizer(text, truncation=True, max_length=max_len)["input_ids"]], dtype=np.int32)
        out = reference(ids, np.ones_like(ids))
        expected[i] = softmax_rows(out)[0] if softmax else out[0]
    worst = float(np.abs(served - expected).max())
    if worst > _AGREEMENT:
        raise ExportError(
            tmp, f"the exported model differs from the source by up to {worst:.2e} (allowed {_AGREEMENT:g})"
        )
    logger.info("exported %s: %s, served = source within %.1e", card["version"], source["path"], worst)


# Arguments of a tokenizer's last call that a saved tokenizer may keep: the server passes its
# own on every call, so they change no answer.
_CALL_ARGUMENTS = ("max_length", "stride", "truncation_strategy", "padding_strategy", "pad_to_multiple_of")


def canonical_call_state(tokenizer: Any) -> None:
    """Clears what a tokenizer remembers of its last call, so the same tokenizer always saves the
    same files (and an export the same version) whatever it was used for before.

    A fast tokenizer keeps the truncation and padding of its last call in its Rust object (so in
    ``tokenizer.json``), and one saved after a call keeps that call's arguments in
    ``tokenizer_config.json``. The sides it truncates and pads on do change answers: they are
    written out explicitly, so a default and an explicit ``right`` are one tokenizer.
    """
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    for key in _CALL_ARGUMENTS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.init_kwargs["truncation_side"] = tokenizer.truncation_side
    tokenizer.init_kwargs["padding_side"] = tokenizer.padding_side


def answers_digest(weights_sha256: str, tokenizer_sha256: str, max_len: int, labels: tuple[str, ...]) -> str:
    """What an export's version is made of: everything in the directory that changes an answer.

    The weights (`weights_digest`, so the same weights saved from PyTorch or TF files agree),
    the tokenizer's files, the maximum length and the label names in their order (the label
    columns an answer fills). Answer reuse keys on the version, so two exports that differ in
    any of them never share an answer.
    """
    blob = json.dumps(
        {"weights": weights_sha256, "tokenizer": tokenizer_sha256, "max_sequence_length": max_len, "labels": labels},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


#: Texts of the default sample an export measures the runtimes on (in domain for emotion models),
#: all held out (an export builds nothing from them): 1,000, as many as the out-of-domain texts,
#: so a setting that changes at most 4 in 1,000 top labels clears the 99% gate (its lower bound,
#: `serve_app.runtimes`).
MEASURE_TEXTS = 1000


def measure_runtimes(model_dir: Path) -> None:
    """Measure every setting this CPU supports on the check texts and the shipped out-of-domain
    texts (`serve_app.optimize.measure`, no int8) and record it (``runtimes.json``), so the
    exported model is served at the fastest setting that passes the gate from its first start.
    ``raypipe model optimize DIR --sample URI`` refines the figures on the user's own text."""
    import os

    from serve_app.model import cpu_flags
    from serve_app.optimize import Sample, default_sample, measure
    from serve_app.runtimes import choose, write_record
    from serve_app.settings import ServerSettings

    sample = Sample("check texts (export)", calibration=(), held_out=tuple(default_sample(MEASURE_TEXTS)))
    record = measure(model_dir, sample, threads=os.cpu_count() or 1)
    write_record(model_dir, record)
    defaults = ServerSettings()  # what a replica with default settings will serve
    best = choose(
        runtime=defaults.runtime,
        precision=defaults.precision,
        flags=cpu_flags(),
        record=record,
        saved_model=None,
        min_agreement=defaults.min_agreement,
    )
    logger.info("measured the runtimes on this CPU: a replica serves %s (%s)", best.setting, best.reason)


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)
