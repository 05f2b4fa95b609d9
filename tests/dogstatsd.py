"""A DogStatsD agent stand-in for tests: a UDP socket on 127.0.0.1 that parses what arrives."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    kind: str  # c, g, d, h, ms, s
    tags: dict[str, str]


@dataclass(frozen=True)
class Event:
    title: str
    text: str
    alert_type: str | None
    tags: dict[str, str]


def _tags(part: str) -> dict[str, str]:
    out = {}
    for tag in part[1:].split(","):
        key, _, value = tag.partition(":")
        out[key] = value
    return out


def parse_line(line: str) -> Sample | Event | None:
    if not line:
        return None
    if line.startswith("_e{"):
        head, _, rest = line.partition(":")
        title_len, text_len = (int(x) for x in head[3:-1].split(","))
        title, text = rest[:title_len], rest[title_len + 1 : title_len + 1 + text_len]
        alert, tags = None, {}
        for part in rest[title_len + 1 + text_len :].split("|")[1:]:
            if part.startswith("t:"):
                alert = part[2:]
            elif part.startswith("#"):
                tags = _tags(part)
        return Event(title, text.replace("\\n", "\n"), alert, tags)
    if line.startswith("_sc|"):
        return None
    parts = line.split("|")
    name, _, value = parts[0].rpartition(":")
    tags: dict[str, str] = {}
    for part in parts[2:]:
        if part.startswith("#"):
            tags = _tags(part)
    return Sample(name, float(value), parts[1], tags)


@dataclass
class UdpAgent:
    """Listens on 127.0.0.1:<free port> until closed; `samples` and `events` fill as packets come."""

    sock: socket.socket = field(default_factory=lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    packets: int = 0

    def __post_init__(self) -> None:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.packets += 1
                for line in data.decode().split("\n"):
                    item = parse_line(line)
                    if isinstance(item, Sample):
                        self.samples.append(item)
                    elif isinstance(item, Event):
                        self.events.append(item)

    def wait_for(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return True
            time.sleep(0.05)
        return False

    def total(self, name: str, **tags: str) -> float:
        """Sum of a count's values over samples whose tags include `tags`."""
        with self._lock:
            return sum(s.value for s in self.samples if s.name == name and tags.items() <= s.tags.items())

    def by_tag(self, name: str, key: str, **tags: str) -> Counter[str]:
        """Totals of `name` by the value of its tag `key`, over the samples that carry `tags`."""
        counts: Counter[str] = Counter()
        with self._lock:
            for s in self.samples:
                if s.name == name and tags.items() <= s.tags.items():
                    counts[s.tags.get(key, "")] += int(s.value)
        return counts

    def names(self) -> set[str]:
        with self._lock:
            return {s.name for s in self.samples}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def closed_udp_port() -> int:
    """A loopback UDP port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
