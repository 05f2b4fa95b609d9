"""Texts the agreement gate measures on besides the user's: prose far from any one domain.

A faster precision can agree with TensorFlow fp32 on the texts a model was tuned for and drift on
others (an emotion model on release notes, a legal model on chat). The gate (`serve_app.runtimes`)
therefore passes a setting only when the worse of its in-domain and out-of-domain agreement
clears the threshold. The out-of-domain texts ship with the project, so every machine measures on
the same ones, offline: ``data/out_of_domain.txt``, 2,000 paragraphs of the Python standard
library's docstrings (prose about code, not feelings; one paragraph per line, shuffled with a
fixed seed). The first `GATE_SIZE` are the gate's; the rest are held out for the benchmark, so a
figure it reports was not measured on the texts that decided the gate.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

__all__ = ["GATE_SIZE", "held_out", "out_of_domain"]

_FILE = Path(__file__).with_name("data") / "out_of_domain.txt"
#: Out-of-domain texts the gate measures on (its figure moves in steps of 0.1%).
GATE_SIZE = 1000


@cache
def _all() -> tuple[str, ...]:
    return tuple(line for line in _FILE.read_text(encoding="utf-8").splitlines() if line.strip())


def out_of_domain(n: int = GATE_SIZE) -> list[str]:
    """The gate's out-of-domain texts (the first ``n``, at most `GATE_SIZE`)."""
    return list(_all()[: min(n, GATE_SIZE)])


def held_out() -> list[str]:
    """Out-of-domain texts the gate never measures on (for the benchmark)."""
    return list(_all()[GATE_SIZE:])
