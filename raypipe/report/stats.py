"""The figures a run's report is built from: call latencies (`LatencySketch`), a unit's summary
(`UnitStats`), an actor's running call tally (`CallTally`) and an attempt's sum (`AttemptStats`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ddsketch import DDSketch

#: Relative error of every latency quantile the report states: the sketch answers a value
#: within this fraction of the exact order statistic (DDSketch's guarantee).
LATENCY_RELATIVE_ERROR = 0.01
# Upper bounds of the log-bucketed histogram commit markers held before the sketch, read
# back so a run started by an older raypipe can still be resumed and reported.
_LEGACY_BOUNDS = tuple(0.0005 * 2 ** (i / 4) for i in range(73))


class LatencySketch:
    """Call latencies (seconds) in a DDSketch with `LATENCY_RELATIVE_ERROR` relative accuracy.

    Memory grows with log(max/min) of the latencies, not with their count (about 230 bins per
    decade at 1%, and only the occupied ones are stored). `to_dict` is the compact form stored
    in commit markers: the mapping's accuracy, then the occupied bin keys and their counts.
    """

    def __init__(self, relative_accuracy: float = LATENCY_RELATIVE_ERROR) -> None:
        self.relative_accuracy = relative_accuracy
        self._sketch = DDSketch(relative_accuracy)

    def add(self, seconds: float, weight: float = 1.0) -> None:
        # A negative duration is a clock artefact; the sketch would file it as a separate sign.
        self._sketch.add(max(0.0, seconds), weight)

    def merge(self, other: LatencySketch) -> None:
        """Adds `other`'s latencies; both must share the relative accuracy."""
        self._sketch.merge(other._sketch)

    @property
    def count(self) -> int:
        return round(self._sketch.count)

    @property
    def max(self) -> float | None:
        """The largest latency added, exactly; None if empty."""
        return float(self._sketch._max) if self.count else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) in seconds, within the relative accuracy; None if empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], not {q}")
        value = self._sketch.get_quantile_value(q)
        return None if value is None else float(value)

    def to_dict(self) -> dict[str, Any]:
        store = self._sketch._store
        keys = [store.offset + i for i, c in enumerate(store.bins) if c]
        return {
            "relative_accuracy": self.relative_accuracy,
            "keys": keys,
            "counts": [round(store.bins[k - store.offset]) for k in keys],
            "zeros": round(self._sketch._zero_count),
            "sum": self._sketch.sum,
            "min": self._sketch._min if self.count else None,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | list[int] | None) -> LatencySketch:
        """Reads `to_dict`'s form; also a legacy histogram's bucket counts (upper bounds)."""
        if d is None or isinstance(d, list):
            sketch = cls()
            for bound, count in zip((*_LEGACY_BOUNDS, _LEGACY_BOUNDS[-1]), d or (), strict=True):
                if count:
                    sketch.add(bound, count)
            return sketch
        sketch = cls(d["relative_accuracy"])
        inner = sketch._sketch
        for key, count in zip(d["keys"], d["counts"], strict=True):
            inner._store.add(key, count)
        inner._zero_count = d["zeros"]
        inner._count = sum(d["counts"]) + d["zeros"]
        inner._sum = d["sum"]
        if inner._count:
            inner._min, inner._max = d["min"], d["max"]
        return sketch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LatencySketch) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"LatencySketch(count={self.count}, relative_accuracy={self.relative_accuracy})"


@dataclass
class UnitStats:
    """What one unit's processing saw; stored in its commit marker."""

    unit: str
    shard: str
    attempt: str
    actor: str
    rows: int = 0
    ok: int = 0
    empty_text: int = 0
    dead_letters: int = 0
    dead_letter_kinds: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    status_counts: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    canaries: int = 0
    """Canary calls made to tell a broken service from rows at fault."""
    latency: LatencySketch = field(default_factory=LatencySketch)
    actor_stats: dict[str, Any] = field(default_factory=dict)
    """A snapshot of the actor's breaker and limiter when the unit was committed."""
    seconds: float = 0.0
    commit_s: float = 0.0
    """Time spent committing the unit (writing its file and the Delta commit)."""
    committed: bool = True
    """False when the unit was found committed already (a retried task) and nothing was written."""
    copied: int = 0
    """Rows answered without a call: their text had a committed answer, or another row's."""
    answered_by: Counter[str] = field(default_factory=Counter)
    """Rows the service answered, by the runtime x precision that computed them ("openvino:fp32")."""
    model_cpu_s: float = 0.0
    """Core-seconds the replicas' forward passes spent on this unit's calls (their own report)."""
    first_call_at: float | None = None
    """Unix time the unit's first call went out (None: no call, every row answered without one)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency"] = self.latency.to_dict()
        d["dead_letter_kinds"] = dict(self.dead_letter_kinds)
        d["status_counts"] = dict(self.status_counts)
        d["answered_by"] = dict(self.answered_by)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitStats:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}  # markers carry more (e.g. the lease generation)
        d["latency"] = LatencySketch.from_dict(d.get("latency"))
        d["dead_letter_kinds"] = Counter(d.get("dead_letter_kinds") or {})
        d["status_counts"] = Counter(d.get("status_counts") or {})
        d["answered_by"] = Counter(d.get("answered_by") or {})
        return cls(**d)


@dataclass
class CallTally:
    """Call figures summed over units: what an actor's tally (`raypipe.tally`) and an attempt's
    statistics (`AttemptStats`) both count, in one place."""

    units: int = 0
    calls: int = 0
    status_counts: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    canaries: int = 0
    model_cpu_s: float = 0.0
    latency: LatencySketch = field(default_factory=LatencySketch)

    def add(self, u: UnitStats | CallTally) -> None:
        self.units += u.units if isinstance(u, CallTally) else 1
        self.calls += u.calls
        self.status_counts.update(u.status_counts)
        self.retries += u.retries
        self.canaries += u.canaries
        self.model_cpu_s += u.model_cpu_s
        self.latency.merge(u.latency)

    def take_calls(self, other: CallTally) -> None:
        """Replaces the call figures with `other`'s (copies; the unit count stays)."""
        self.calls = other.calls
        self.status_counts = Counter(other.status_counts)
        self.retries = other.retries
        self.canaries = other.canaries
        self.model_cpu_s = other.model_cpu_s
        self.latency = LatencySketch.from_dict(other.latency.to_dict())

    @classmethod
    def over(cls, done: CallTally, live: Iterable[UnitStats]) -> CallTally:
        """`done` plus the units still in flight (their figures as far as they go)."""
        total = cls()
        total.add(done)
        for u in live:
            total.add(u)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "calls": self.calls,
            "status_counts": dict(self.status_counts),
            "retries": self.retries,
            "canaries": self.canaries,
            "model_cpu_s": round(self.model_cpu_s, 6),
            "latency": self.latency.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallTally:
        return cls(
            units=int(d.get("units", 0)),
            calls=int(d.get("calls", 0)),
            status_counts=Counter(d.get("status_counts") or {}),
            retries=int(d.get("retries", 0)),
            canaries=int(d.get("canaries", 0)),
            model_cpu_s=float(d.get("model_cpu_s", 0.0)),
            latency=LatencySketch.from_dict(d.get("latency")),
        )


@dataclass
class AttemptStats(CallTally):
    """What one attempt of a run did: its calls (a `CallTally` over its unit summaries), the
    rows its committed units hold, and the actors' breakers and limiters.

    Folded from the unit summaries the actors stream back (also of units whose commit never
    happened: a run the breaker stopped keeps its calls), saved at the attempt's end, and
    summed over every attempt of the run into the report. O(actors) memory. Saved as one flat
    JSON object (`to_dict`), as earlier releases saved it.
    """

    attempt: str = ""
    rows: int = 0
    ok: int = 0
    empty_text: int = 0
    dead_letters: int = 0
    dead_letter_kinds: Counter[str] = field(default_factory=Counter)
    copied: int = 0
    commit_s: float = 0.0
    actors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each actor's latest breaker/limiter snapshot."""
    answered_by: Counter[str] = field(default_factory=Counter)

    def add(self, u: UnitStats | CallTally) -> None:
        super().add(u)
        if not isinstance(u, UnitStats):
            return
        self.rows += u.rows
        if u.committed:
            self.ok += u.ok
            self.empty_text += u.empty_text
            self.dead_letters += u.dead_letters
            self.dead_letter_kinds.update(u.dead_letter_kinds)
            self.copied += u.copied
            self.answered_by.update(u.answered_by)
        self.commit_s += u.commit_s
        if u.actor_stats:
            prev = self.actors.get(u.actor)
            if prev is None or u.actor_stats.get("seq", 0) >= prev.get("seq", 0):
                self.actors[u.actor] = u.actor_stats

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency"] = self.latency.to_dict()
        d["status_counts"] = dict(self.status_counts)
        d["dead_letter_kinds"] = dict(self.dead_letter_kinds)
        d["answered_by"] = dict(self.answered_by)
        return d

    def ledger(self) -> dict[str, int]:
        """The rows this attempt committed, in `raypipe.commit.outcomes.ledger`'s form (replays, whose
        rows replace another run's, count what they committed this way)."""
        counts = {"result:ok": self.ok, "result:empty_text": self.empty_text}
        counts.update({f"dead_letter:{k}": v for k, v in self.dead_letter_kinds.items()})
        return counts

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttemptStats:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["latency"] = LatencySketch.from_dict(d.get("latency"))
        d["status_counts"] = Counter(d.get("status_counts") or {})
        d["dead_letter_kinds"] = Counter(d.get("dead_letter_kinds") or {})
        d["answered_by"] = Counter(d.get("answered_by") or {})
        return cls(**d)
