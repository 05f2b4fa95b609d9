"""A text over `client.max_text_bytes` (64 MiB here, against the 16 MiB default) is a dead letter
`too_large` with its size, never a call: the actor and raypipe's gRPC client against an
in-process gRPC server on loopback (the fake model). No Ray."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.call.actor import ActorSettings, InferenceActor
from raypipe.call.client import GrpcModelClient
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable
from raypipe.config import ClientConfig, RetryConfig, ServiceConfig
from raypipe.plan.planning import list_shards, plan_units
from raypipe.plan.units import ColumnNames
from raypipe.run.read import read_unit
from tests.fakes import LABELS, start_fake_server

HUGE = 64 * 2**20


def test_a_64_mib_text_is_a_too_large_dead_letter_and_the_rest_is_inferred(tmp_path) -> None:
    huge = "x" * HUGE
    texts = ["fine one", huge, "fine two", huge]  # the repeat shares the first one's fate
    pq.write_table(pa.table({"id": ["a", "big", "b", "big2"], "text": texts}), tmp_path / "in.parquet")
    del huge, texts
    units, _ = plan_units(list_shards(str(tmp_path / "in.parquet")), unit_rows=1000, columns=ColumnNames())
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    retry = RetryConfig(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.002)

    async def scenario() -> tuple[pa.Table, dict[str, int]]:
        server, servicer, address = await start_fake_server()
        try:
            settings = ActorSettings(
                committer=UnitCommitter(take_over(table, "r1")),
                run_id="r1",
                attempt="a1",
                service=ServiceConfig(address=address),
                client=ClientConfig(retry=retry),
                labels=LABELS,
            )
            actor = InferenceActor(settings, client_factory=lambda: GrpcModelClient(address, timeout_s=30))
            # Units may be cut by bytes: each is read and inferred in turn, as Ray Data would hand them over.
            summaries = [await actor(read_unit(unit, ColumnNames())) for unit in units]
            return pa.concat_tables(summaries), dict(servicer.calls)
        finally:
            await server.stop(None)

    summary, calls = asyncio.run(scenario())
    assert set(summary.column("fatal").to_pylist()) == {None}
    rows = read_outcomes(str(tmp_path / "out"), "r1").to_pylist()
    fates = {r["id"]: r for r in rows}
    assert {i: r["outcome"] for i, r in fates.items()} == {
        "a": "result",
        "b": "result",
        "big": "dead_letter",
        "big2": "dead_letter",
    }
    for i in ("big", "big2"):
        assert fates[i]["error_kind"] == "too_large"
        assert "67,108,864 bytes" in fates[i]["message"] and "client.max_text_bytes" in fates[i]["message"]
    assert calls.get("OK", 0) <= len(units) and not set(calls) - {"OK", "ModelInfo"}, "the large texts were never sent"
