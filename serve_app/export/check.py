"""``raypipe model check``: load a model directory as the server does, check it, show it.

`check_model_dir` goes through `EmotionModel.load` (card, tokenizer, signature, label count),
then `serve_app.model.check_model_limits` (embedding table and position embeddings, run at
their edges), and classifies a few texts. Exports run it on what they wrote before renaming it
into place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.model import EmotionModel, check_model_limits, read_model_card

__all__ = ["SAMPLE_TEXTS", "ModelCheck", "check_model_dir"]

#: What `check_model_dir` classifies when given no texts; exports compare on them too.
SAMPLE_TEXTS: tuple[str, ...] = (
    "I passed my driving test on the first try and I'm so happy!",
    "My dog died last week and I still cry every time I see his empty bowl.",
    "I am so angry that my boss yelled at me in front of the whole team.",
    "The meeting moved to Thursday afternoon.",
    "We had waited for this trip for years, and when the plane finally landed I could not stop "
    "smiling, even though the rain had followed us all the way from home and the hotel had lost our booking.",
)


@dataclass(frozen=True)
class ModelCheck:
    """A model directory that loaded as the server loads it, with predictions for some texts."""

    model_dir: Path
    card: dict[str, Any]
    """``model.json`` as written (export adds source, vocabulary and parameter count)."""
    texts: tuple[str, ...]
    probabilities: np.ndarray
    """float32 ``[len(texts), len(labels)]``."""

    def render(self) -> str:
        labels = list(self.card["labels"])
        source = self.card.get("source")
        lines = [
            f"model       {self.model_dir}",
            f"version     {self.card['version']}",
            f"labels      {', '.join(labels)}",
            f"max length  {self.card['max_sequence_length']} tokens",
        ]
        if "vocab_size" in self.card:
            lines.append(f"vocabulary  {self.card['vocab_size']:,} tokens")
        if "parameters" in self.card:
            lines.append(f"parameters  {self.card['parameters']:,}")
        if isinstance(source, dict):
            details = ", ".join(f"{k}={v}" for k, v in source.items() if k not in ("kind", "path"))
            lines.append(f"source      {source.get('kind')}: {source.get('path')} ({details})")
        width = max(8, *(len(label) for label in labels))
        lines += ["", "  ".join(label.rjust(width) for label in labels) + "  text"]
        for text, row in zip(self.texts, self.probabilities, strict=True):
            shown = text if len(text) <= 60 else text[:57] + "..."
            lines.append("  ".join(f"{p:.4f}".rjust(width) for p in row) + f"  {shown}")
        return "\n".join(lines)


def check_model_dir(model_dir: Path | str, texts: Sequence[str] | None = None) -> ModelCheck:
    """Load ``model_dir`` as the server does, check it at its limits, classify ``texts``.

    Raises `ModelDirError` naming the part at fault: an unreadable card, a missing
    ``serving_default`` signature, a label count that differs from the output width, a
    tokenizer that does not belong to the model, a max length beyond the position embeddings.
    """
    model_dir = Path(model_dir).absolute()
    read_model_card(model_dir)  # validated; the raw JSON keeps the export's extra fields
    raw = json.loads((model_dir / "model.json").read_text(encoding="utf-8"))
    model = EmotionModel.load(model_dir)
    vocab_size = raw.get("vocab_size")
    check_model_limits(model, model_dir, vocab_size=vocab_size if isinstance(vocab_size, int) else None)
    chosen = tuple(SAMPLE_TEXTS if texts is None else texts)
    return ModelCheck(model_dir, raw, chosen, model.predict(chosen).probabilities)
