"""How fast a setting runs on a machine that is not quiet, and when one counts as faster.

A busy machine slows one sample by more than two settings differ: timed once each, one after
the other, two settings that ran at the same speed alone were recorded 28% apart because other
work ran during one of them. So settings are timed in **interleaved rounds** (`interleave`):
each round times every setting once, the order reversed every other round (A B, B A, A B, ...),
so a burst of load lands on the settings alike and none always runs right after the same
neighbour. A setting's figure is the **median** of its rounds (`Timing`), and its **spread** is
how far its farthest round lay from that median: every round it ran lay within median ± spread,
so the spread says how noisy the measurement was.

**The rule** (`beats`): a setting is faster than another only when its slowest plausible rate
(median - spread) is above the other's fastest (median + spread): the two ranges do not
overlap. Otherwise the two tie, and the caller keeps the one it prefers (`serve_app.runtimes`:
the setting whose answers are the reference's, or closest to them). A tie that load makes
noisy therefore keeps the default, and only a win larger than the noise changes the choice.
Non-overlapping ranges order settings transitively, so among any settings some are beaten by
none. Figures without a spread (records written before rounds were kept) compare by median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Rated", "Timing", "beats", "interleave", "unbeaten"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Timing:
    """The rates one setting ran at, round by round (paragraphs per second)."""

    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("a timing needs at least one round")

    @classmethod
    def of(cls, items: int, seconds: list[float] | tuple[float, ...]) -> Timing:
        """``items`` paragraphs per round, each round taking ``seconds[i]``."""
        return cls(tuple(items / max(s, 1e-12) for s in seconds))

    @property
    def median(self) -> float:
        return float(statistics.median(self.rates))

    @property
    def para_per_s(self) -> float:
        """The figure a setting is recorded at: the median."""
        return self.median

    @property
    def spread(self) -> float:
        """Every round lay within ``median ± spread``."""
        median = self.median
        return max(abs(r - median) for r in self.rates)

    @property
    def rounds(self) -> int:
        return len(self.rates)


class Rated(Protocol):
    """A measured rate and its noise (`Timing`, or a recorded `serve_app.runtimes.Measurement`)."""

    @property
    def para_per_s(self) -> float: ...

    @property
    def spread(self) -> float: ...


def beats(a: Rated, b: Rated) -> bool:
    """``a`` is faster than ``b`` beyond the noise of both (module docstring: the rule)."""
    return a.para_per_s - a.spread > b.para_per_s + b.spread


def unbeaten(rated: Mapping[K, Rated]) -> list[K]:
    """The keys no other key `beats`, in the mapping's order (never empty for a non-empty mapping)."""
    return [k for k, r in rated.items() if not any(beats(other, r) for o, other in rated.items() if o != k)]


def interleave(
    runners: Mapping[K, Callable[[], object]],
    *,
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, list[float]]:
    """Seconds each runner took, round by round: every round calls each runner once, in the
    mapping's order in even rounds and reversed in odd ones. ``clock`` is injectable, so a test
    can script what load did to each call."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    order = list(runners)
    seconds: dict[K, list[float]] = {k: [] for k in order}
    for i in range(rounds):
        for key in order if i % 2 == 0 else reversed(order):
            started = clock()
            runners[key]()
            seconds[key].append(clock() - started)
    return seconds
