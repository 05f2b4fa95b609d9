"""The benchmark corpus: paragraphs whose token lengths follow a lognormal law.

Real paragraph lengths are close to lognormal: most are a few sentences, a long tail runs to
thousands of tokens and is cut at the model's maximum. Texts are assembled from the demo
generator's sentences (words the demo tokenizer knows, ~1.16 tokens per word with punctuation),
then cut to the drawn length. Everything here is pure and seeded, so tests can check it fast.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

__all__ = ["MEDIAN_TOKENS", "SIGMA", "TOKENS_PER_WORD", "length_stats", "paragraphs", "target_lengths"]

#: Median length in tokens ([CLS] and [SEP] included).
MEDIAN_TOKENS = 60
#: Lognormal shape: p90 ~ 3x the median, p99 ~ 7x, ~0.6% above 512 tokens.
SIGMA = 0.85
#: Demo-tokenizer tokens per whitespace word of the demo sentences (punctuation splits off).
TOKENS_PER_WORD = 1.16
_MAX_TOKENS = 4096  # a generated paragraph never needs more: models cut at 512


def target_lengths(n: int, *, seed: int, median: int = MEDIAN_TOKENS, sigma: float = SIGMA) -> np.ndarray:
    """``n`` token lengths, lognormal with the given median, at least 4 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(lengths), 4, _MAX_TOKENS).astype(np.int64)


def paragraphs(n: int, *, seed: int, median: int = MEDIAN_TOKENS, sigma: float = SIGMA) -> list[str]:
    """``n`` texts whose token lengths follow `target_lengths` (within a token or two)."""
    from serve_app.demo_data import sentences

    pool = [text.split() for text, _ in sentences(3000, seed=seed)]
    rng = random.Random(seed)
    out = []
    for length in target_lengths(n, seed=seed, median=median, sigma=sigma):
        words_wanted = max(1, round((int(length) - 2) / TOKENS_PER_WORD))
        words: list[str] = []
        while len(words) < words_wanted:
            words += rng.choice(pool)
        out.append(" ".join(words[:words_wanted]))
    return out


def length_stats(lengths: Sequence[int] | np.ndarray, *, max_length: int) -> dict[str, float]:
    """Median, p90, p99, mean and the share cut at ``max_length`` of token lengths."""
    a = np.asarray(lengths, dtype=np.float64)
    return {
        "n": int(a.size),
        "median": float(np.median(a)),
        "p90": float(np.quantile(a, 0.9)),
        "p99": float(np.quantile(a, 0.99)),
        "mean": float(a.mean()),
        "mean_after_truncation": float(np.minimum(a, max_length).mean()),
        "truncated_share": float((a > max_length).mean()),
    }
