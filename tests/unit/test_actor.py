"""InferenceActor on one unit, with a scripted client and a local output (no Ray, no network)."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.actor import ActorSettings, InferenceActor
from raypipe.config import BreakerConfig, ClientConfig, RetryConfig, ServiceConfig
from raypipe.errors import (
    CircuitOpenError,
    RequestRejected,
    ServiceInternal,
    ServiceOverloaded,
    ServiceUnavailable,
)
from raypipe.sinks import committed_units
from raypipe.sources import ColumnNames, list_shards, plan_units, read_unit
from raypipe.store import OutputStore
from tests.fakes import LABELS, ScriptedClient, fake_probs


def make_unit(tmp_path, texts):
    pq.write_table(pa.table({"id": [f"id{i}" for i in range(len(texts))], "text": texts}), tmp_path / "in.parquet")
    units, _ = plan_units(list_shards(str(tmp_path / "in.parquet")), unit_rows=1000, columns=ColumnNames())
    return units[0], read_unit(units[0], ColumnNames())


def settings(tmp_path, **client):
    defaults = {
        "micro_batch_size": 4,
        "retry": RetryConfig(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002),
        "breaker": BreakerConfig(failure_threshold=50),
    }
    cfg = ClientConfig(**{**defaults, **client})
    return ActorSettings(
        output_uri=str(tmp_path / "out"), run_id="r1", attempt="a1", service=ServiceConfig(), client=cfg, labels=LABELS
    )


def run_actor(tmp_path, texts, client, **client_cfg):
    unit, block = make_unit(tmp_path, texts)
    actor = InferenceActor(settings(tmp_path, **client_cfg), client_factory=lambda: client)
    summary = asyncio.run(actor(block))
    store = OutputStore(str(tmp_path / "out"))
    results = (
        pq.read_table(store.results_file("r1", unit.key)) if store.exists(store.results_file("r1", unit.key)) else None
    )
    dl_path = store.dead_letter_file("r1", unit.key)
    dead = pq.read_table(dl_path) if store.exists(dl_path) else None
    return unit, summary, results, dead, store


def test_unit_is_inferred_and_committed_with_every_row_accounted(tmp_path):
    texts = [f"paragraph number {i}" + "!" * i for i in range(10)] + [None, "", "  "]
    unit, summary, results, dead, store = run_actor(tmp_path, texts, ScriptedClient())
    assert dead is None
    assert sorted(results.column("id").to_pylist()) == sorted(f"id{i}" for i in range(13))
    rows = {r["id"]: r for r in results.to_pylist()}
    assert {rows[f"id{i}"]["status"] for i in (10, 11, 12)} == {"empty_text"}
    assert rows["id10"]["prob_joy"] is None and rows["id10"]["top_label"] is None
    for i in range(10):
        r = rows[f"id{i}"]
        expected = fake_probs(texts[i])
        assert [r[f"prob_{label}"] for label in LABELS] == pytest.approx(expected, abs=1e-6)
        assert r["top_label"] == LABELS[max(range(len(LABELS)), key=expected.__getitem__)]
        assert r["status"] == "ok" and r["run_id"] == "r1" and r["model_version"] == "fake-1"
        assert r["source"].endswith("in.parquet") and r["row"] == i
    stats = json.loads(summary.column("summary")[0].as_py())
    assert (stats["rows"], stats["ok"], stats["empty_text"], stats["dead_letters"]) == (13, 10, 3, 0)
    assert stats["calls"] == 3 and stats["status_counts"] == {"OK": 3}  # 10 sendable rows / 4 per call
    assert unit.key in committed_units(store, "r1")


def test_transient_failures_send_the_rows_again_instead_of_dead_lettering_them(tmp_path):
    """A call that exhausts its attempts on a service fault is not the rows' fault: they go back."""
    errors = [ServiceUnavailable("down", status_code="UNAVAILABLE")] * 3  # exhausts one call's 3 attempts
    client = ScriptedClient(errors=errors)
    texts = ["alpha", "beta", "gamma"]  # one micro-batch
    _, summary, results, dead, _ = run_actor(tmp_path, texts, client)
    assert dead is None
    assert sorted(results.column("id").to_pylist()) == ["id0", "id1", "id2"]
    stats = json.loads(summary.column("summary")[0].as_py())
    # Two retries within the call, then the rows are sent again: a third.
    assert stats["status_counts"] == {"UNAVAILABLE": 3, "OK": 1} and stats["retries"] == 3
    assert stats["dead_letters"] == 0 and stats["canaries"] == 0


def test_internal_from_a_dying_replica_is_retried_not_dead_lettered(tmp_path):
    client = ScriptedClient(errors=[ServiceInternal("replica died", status_code="INTERNAL")])
    _, summary, results, dead, _ = run_actor(tmp_path, ["one"], client, micro_batch_size=1)
    assert dead is None and results.column("id").to_pylist() == ["id0"]
    stats = json.loads(summary.column("summary")[0].as_py())
    assert stats["status_counts"] == {"INTERNAL": 1, "OK": 1}


def test_a_row_that_crashes_the_replica_is_isolated_while_others_succeed(tmp_path):
    """INTERNAL on every call holding the poison row, OK elsewhere: only that row is dead-lettered."""

    class CrashingClient(ScriptedClient):
        async def classify(self, ids, texts):
            if "CRASH" in texts:
                self.calls += 1
                raise ServiceInternal("replica died", status_code="INTERNAL")
            return await super().classify(ids, texts)

    texts = ["a1", "b22", "CRASH", "d4444"]
    _, summary, results, dead, _ = run_actor(tmp_path, texts, CrashingClient())
    assert sorted(results.column("id").to_pylist()) == ["id0", "id1", "id3"]
    assert dead.column("id").to_pylist() == ["id2"]
    assert dead.column("error_kind").to_pylist() == ["internal"]
    assert dead.column("attempts").to_pylist() == [3]  # sent alone, it failed a whole call while the canary passed
    stats = json.loads(summary.column("summary")[0].as_py())
    assert stats["canaries"] >= 2


def test_retry_success_counts_every_attempt(tmp_path):
    client = ScriptedClient(errors=[ServiceOverloaded("busy", status_code="RESOURCE_EXHAUSTED")])
    _, summary, results, dead, _ = run_actor(tmp_path, ["one", "two"], client)
    assert dead is None and results.num_rows == 2
    stats = json.loads(summary.column("summary")[0].as_py())
    assert stats["status_counts"] == {"RESOURCE_EXHAUSTED": 1, "OK": 1}


def test_poison_row_is_isolated_by_bisection(tmp_path):
    texts = ["a1", "b22", "POISON", "d4444"]  # one batch of 4; the poison row is rejected
    _, _, results, dead, _ = run_actor(tmp_path, texts, ScriptedClient())
    assert sorted(results.column("id").to_pylist()) == ["id0", "id1", "id3"]
    assert dead.column("id").to_pylist() == ["id2"]
    assert dead.column("grpc_status").to_pylist() == ["INVALID_ARGUMENT"]
    assert dead.column("attempts").to_pylist() == [1]  # permanent: not retried


def test_redo_overwrites_and_removes_stale_files(tmp_path):
    """A unit redone after a crash replaces its files; a stale dead-letter file is removed."""
    unit, _, _, dead, store = run_actor(tmp_path, ["x", "y"], ScriptedClient(poison="x"))
    assert dead is not None
    unit2, _, results, dead2, _ = run_actor(tmp_path, ["x", "y"], ScriptedClient())
    assert unit2.key == unit.key
    assert dead2 is None and not store.exists(store.dead_letter_file("r1", unit.key))
    assert results.num_rows == 2


def test_successes_close_the_breaker_count(tmp_path):
    """Failures then successes: the breaker's consecutive count is reset by successful calls."""
    errors = [ServiceUnavailable("down", status_code="UNAVAILABLE")] * 2
    _unit, block = make_unit(tmp_path, [f"text {i}" for i in range(40)])
    actor = InferenceActor(settings(tmp_path), client_factory=lambda: ScriptedClient(errors=errors))
    asyncio.run(actor(block))
    stats = actor._breaker.stats()
    assert stats.consecutive_failures == 0 and stats.openings == 0


def _down_actor(tmp_path, error, rows=40):
    unit, block = make_unit(tmp_path, [f"row {i}" for i in range(rows)])  # 10 micro-batches of 4
    cfg = settings(tmp_path)
    client_cfg = cfg.client.model_copy(
        update={
            "retry": RetryConfig(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002),
            "breaker": BreakerConfig(
                failure_threshold=3, reset_timeout_s=0.05, max_reset_timeout_s=0.05, max_wait_s=0.3
            ),
        }
    )
    client = ScriptedClient(errors=[error] * 100_000)
    actor = InferenceActor(ActorSettings(**{**cfg.__dict__, "client": client_cfg}), client_factory=lambda: client)
    return unit, block, actor, client


@pytest.mark.parametrize(
    "error",
    [
        ServiceUnavailable("down", status_code="UNAVAILABLE"),
        ServiceInternal("crash-looping model", status_code="INTERNAL"),
        RequestRejected("bad deploy", status_code="UNIMPLEMENTED"),
    ],
    ids=["unavailable", "internal", "unimplemented"],
)
def test_a_broken_service_stops_the_unit_without_dead_letters(tmp_path, error):
    """Every call fails alike: it is the service. The unit raises, commits nothing, in few calls."""
    unit, block, actor, client = _down_actor(tmp_path, error)
    with pytest.raises(CircuitOpenError):
        asyncio.run(actor(block))
    store = OutputStore(str(tmp_path / "out"))
    assert not store.exists(store.dead_letter_file("r1", unit.key))
    assert not store.exists(store.results_file("r1", unit.key))
    assert committed_units(store, "r1") == {}
    breaker = actor._breaker.stats()
    assert breaker.openings >= 1
    # What reached the service: the calls in flight when it failed (the initial limit, 4), the
    # calls that opened the breaker (threshold 3), then only probes; each call makes 4 attempts,
    # and on a code that may be the rows' fault a canary of 4 attempts more.
    assert client.calls <= 8 * (4 + 3 + breaker.probes)
