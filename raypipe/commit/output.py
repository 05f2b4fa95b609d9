"""One output, as a run holds it: its files (`raypipe.store.OutputStore`) and its table
(`raypipe.commit.table.OutcomeTable`), built once from the URI and passed down.

A run's call builds one (`raypipe.api`, before its checks) and gives it to the checks
(`raypipe.run.preflight`) and the run mode (`raypipe.run.modes`, whose `CommitProtocol` holds
it: the protocol never builds one); the watch builds its own at its entry
(`raypipe.run.watch.mode`), each maintenance command its own (`raypipe.commit.upkeep`); readers
(`raypipe.read_outcomes`, `raypipe.latest`) build their own once per call. A process of its
own (an actor) builds its own from the URI its fence names.
"""

from __future__ import annotations

from dataclasses import dataclass

from raypipe.commit.table import OutcomeTable
from raypipe.store import OutputStore

__all__ = ["Output"]


@dataclass(frozen=True)
class Output:
    """An output location's files and table, one object for one run."""

    store: OutputStore
    table: OutcomeTable

    @classmethod
    def at(cls, uri: str) -> Output:
        return cls(OutputStore(uri), OutcomeTable(uri))

    @property
    def uri(self) -> str:
        return self.store.uri
