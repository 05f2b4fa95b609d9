"""One output, as a run holds it: its settings (`raypipe.config.OutputConfig`: the URI, the
lease, what a resume may change), its files (`raypipe.store.OutputStore`) and its table
(`raypipe.commit.table.OutcomeTable`), built once and passed down.

A run's call builds one from its named output and the config's output section
(`raypipe.api`, before its checks: `Output.for_run`) and gives it to the checks
(`raypipe.run.preflight`) and the run mode (`raypipe.run.modes`, whose `CommitProtocol` holds
it: the protocol never builds one). The run's config (service, actors, metrics) does not
carry the output: what a run writes, and how it holds the output, is this object's alone.
The watch gets its own the same way, each maintenance command its own (`raypipe.commit.upkeep`);
readers (`raypipe.read_outcomes`, `raypipe.latest`) build their own once per call. A process
of its own (an actor) builds its own from the URI its fence names.
"""

from __future__ import annotations

from dataclasses import dataclass

from raypipe.commit.table import OutcomeTable
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError
from raypipe.store import OutputStore

__all__ = ["Output"]


@dataclass(frozen=True)
class Output:
    """An output location's settings, files and table, one object for one run."""

    settings: OutputConfig
    store: OutputStore
    table: OutcomeTable

    @classmethod
    def for_run(cls, settings: OutputConfig, uri: str | None = None) -> Output:
        """The output of a config's output section, at `uri` when one is named (a run's
        `output` argument, the CLI's `--output`, goes over the config's `output.uri`)."""
        if uri is None:
            uri = settings.uri
        else:
            settings = settings.model_copy(update={"uri": uri})  # checked by the store, next
        if uri is None:
            raise ConfigError("no output: name one (--output URI, or output.uri in the config)")
        return cls(settings, OutputStore(uri), OutcomeTable(uri))

    @classmethod
    def at(cls, output: str | OutputConfig | Output) -> Output:
        """The output a URI or an output section names, with the section's settings (a URI's
        are the defaults); an `Output` is itself. Maintenance commands and readers take any."""
        if isinstance(output, Output):
            return output
        if isinstance(output, OutputConfig):
            return cls.for_run(output)
        return cls.for_run(OutputConfig(), output)

    @property
    def uri(self) -> str:
        return self.store.uri
