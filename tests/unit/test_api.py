"""The public API's small calls: `raypipe.read_report` and what `raypipe` exports."""

from __future__ import annotations

import json
from typing import Any

import pytest

import raypipe
from raypipe import errors
from raypipe.report import RunReport


def write_report(output, report: RunReport) -> None:
    (output / "runs").mkdir(parents=True, exist_ok=True)
    (output / "runs" / f"{report.run_id}.json").write_text(json.dumps(report.to_dict()))


def test_read_report_from_a_local_output(tmp_path):
    stored = RunReport(run_id="backfill-1", mode="backfill", status="failed", calls=42, rows_in=7)
    stored.status_counts = {"OK": 40, "UNAVAILABLE": 2}
    write_report(tmp_path, stored)

    report = raypipe.read_report(str(tmp_path), "backfill-1")

    assert isinstance(report, raypipe.RunReport)
    assert (report.run_id, report.status, report.calls, report.rows_in) == ("backfill-1", "failed", 42, 7)
    assert report.status_counts == {"OK": 40, "UNAVAILABLE": 2}
    assert report.to_dict() == stored.to_dict()


def test_read_report_of_a_missing_run_names_the_nearest_one(tmp_path):
    for run_id in ("daily-20261120", "backfill-20261101"):
        write_report(tmp_path, RunReport(run_id=run_id, mode="daily"))

    with pytest.raises(raypipe.RunNotFoundError, match=r"did you mean daily-20261120\?") as info:
        raypipe.read_report(str(tmp_path), "daily-20261210")

    assert isinstance(info.value, raypipe.ConfigError)  # the CLI's exit 2
    assert (info.value.run_id, info.value.nearest) == ("daily-20261210", "daily-20261120")


def test_read_report_of_an_output_without_runs_says_so(tmp_path):
    with pytest.raises(raypipe.RunNotFoundError, match=f"no report for run x at {tmp_path}$") as info:
        raypipe.read_report(str(tmp_path), "x")
    assert info.value.nearest is None


def test_every_name_exported_resolves_and_the_list_is_sorted():
    assert raypipe.__all__ == sorted(raypipe.__all__)
    for name in raypipe.__all__:
        assert getattr(raypipe, name) is not None
    assert {"connect", "read_report", "NoShardsError", "SchemaError"} <= set(raypipe.__all__)


# Raised only inside a run and turned into dead letters or retries there; never reaches a caller.
INTERNAL_ERRORS = {
    "BadRowError",
    "InvalidIdError",
    "InvalidRowError",
    "InvalidTextError",
    "MissingIdError",
    "RequestRejected",
    "ServiceCancelled",
    "ServiceInternal",
    "ServiceOverloaded",
    "ServiceTimeout",
    "ServiceWrongModel",
    "ShardChangedError",
    "TextTooLargeError",
}


def test_every_error_a_caller_may_catch_is_exported():
    assert set(errors.__all__) - set(raypipe.__all__) == INTERNAL_ERRORS
    for name in set(errors.__all__) - INTERNAL_ERRORS:
        assert getattr(raypipe, name) is getattr(errors, name)


@pytest.mark.parametrize("mode", ["backfill", "daily"])
def test_a_run_call_builds_its_outputs_owner_once_and_gives_that_one_to_the_checks_and_the_run(
    tmp_path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The output URI is turned into its `Output` (files + table) once per call; the preflight
    (its quarantine look) and the run mode get that object, and neither builds another."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raypipe.commit.output import Output
    from raypipe.run import modes

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["a"], "text": ["hello"]}), tmp_path / "in" / "part-0.parquet")
    built: list[Output] = []
    real = Output.for_run.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Output], *args: Any, **kwargs: Any) -> Output:
        built.append(real(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(Output, "for_run", classmethod(counting))
    monkeypatch.setattr(Output, "at", None)  # nothing on the way builds one from a bare URI
    given: list[Output | None] = []
    configs: list[Any] = []
    monkeypatch.setattr(
        modes,
        mode,
        lambda config, source, *place, **kw: configs.append(config) or given.extend(place or [None]) or "report",
    )
    run = getattr(raypipe, mode)

    out = str(tmp_path / "out")
    assert run(str(tmp_path / "in"), out, service="127.0.0.1:1", settings={"output": {"lease_s": 7}}) == "report"
    assert len(built) == 1 and given == built
    # The owner holds the named output with the config's output settings; the run's config does
    # not carry the output, so nothing downstream can write anywhere but through the owner.
    assert (built[0].uri, built[0].settings.lease_s) == (out, 7)
    assert configs[0].output.uri is None
