"""InferenceActor on one unit, with a scripted client and a local output (no Ray, no network)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest

from raypipe.call.actor import ActorSettings, InferenceActor
from raypipe.call.batches import CALL_TEXT_BYTES, micro_batches
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable
from raypipe.config import BreakerConfig, ClientConfig, RetryConfig, ServiceConfig
from raypipe.errors import (
    CircuitOpenError,
    RequestRejected,
    ServiceInternal,
    ServiceOverloaded,
    ServiceUnavailable,
)
from raypipe.plan.planning import list_shards, plan_units
from raypipe.plan.units import ColumnNames
from raypipe.run.read import read_unit
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
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    fence = take_over(table, "r1")  # a new attempt of run r1: a real local Delta table
    return ActorSettings(
        committer=UnitCommitter(fence), run_id="r1", attempt="a1", service=ServiceConfig(), client=cfg, labels=LABELS
    )


def outcomes(tmp_path):
    """(results, dead letters) committed for run r1, or None where there are none."""
    rows = read_outcomes(str(tmp_path / "out"), "r1")
    results = rows.filter(pa.compute.equal(rows.column("outcome"), "result"))
    dead = rows.filter(pa.compute.equal(rows.column("outcome"), "dead_letter"))
    return (results if results.num_rows else None), (dead if dead.num_rows else None)


def run_actor(tmp_path, texts, client, **client_cfg):
    unit, block = make_unit(tmp_path, texts)
    actor = InferenceActor(settings(tmp_path, **client_cfg), client_factory=lambda: client)
    summary = asyncio.run(actor(block))
    results, dead = outcomes(tmp_path)
    return unit, summary, results, dead, OutcomeTable(str(tmp_path / "out"))


def test_unit_is_inferred_and_committed_with_every_row_accounted(tmp_path):
    texts = [f"paragraph number {i}" + "!" * i for i in range(10)] + [None, "", "  "]
    unit, summary, results, dead, table = run_actor(tmp_path, texts, ScriptedClient())
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
    assert table.committed_units("r1") == {unit.key}


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


def test_results_and_dead_letters_of_a_unit_are_one_commit(tmp_path):
    """A unit's results and dead letters appear in the same table version, never one without the other."""
    unit, _, results, dead, table = run_actor(tmp_path, ["x", "y"], ScriptedClient(poison="x"))
    assert dead.column("id").to_pylist() == ["id0"] and results.column("id").to_pylist() == ["id1"]
    dt = table.load()
    before = dt.version() - 1  # the version before the unit's commit: neither of its rows
    dt.load_as_version(before)
    assert dt.to_pyarrow_table().num_rows == 0
    history = [h for h in table.load().history() if h.get("raypipe.unit") == unit.key]
    assert len(history) == 1


def test_a_unit_committed_twice_in_one_generation_is_written_once(tmp_path):
    """A Ray task retried after its actor died past the commit: the second commit does nothing."""
    _, block = make_unit(tmp_path, ["x", "y"])
    cfg = settings(tmp_path)
    for _ in range(2):
        asyncio.run(InferenceActor(cfg, client_factory=lambda: ScriptedClient())(block))
    results, dead = outcomes(tmp_path)
    assert sorted(results.column("id").to_pylist()) == ["id0", "id1"] and dead is None


def test_successes_close_the_breaker_count(tmp_path):
    """Failures then successes: the breaker's consecutive count is reset by successful calls."""
    errors = [ServiceUnavailable("down", status_code="UNAVAILABLE")] * 2
    _unit, block = make_unit(tmp_path, [f"text {i}" for i in range(40)])
    actor = InferenceActor(settings(tmp_path), client_factory=lambda: ScriptedClient(errors=errors))
    asyncio.run(actor(block))
    stats = actor._breaker.stats()
    assert stats.consecutive_failures == 0 and stats.openings == 0


def _down_actor(tmp_path, error, rows=40, **overrides):
    """An actor whose every call fails with `error` (none: answered), quick to give up; its
    `ActorSettings` with `overrides`."""
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
    client = ScriptedClient(errors=[error] * 100_000 if error is not None else [])
    actor = InferenceActor(
        ActorSettings(**{**cfg.__dict__, "client": client_cfg, **overrides}), client_factory=lambda: client
    )
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
    """Every call fails alike: it is the service. The unit commits nothing, in few calls, and
    reports the calls it made with the failure (the driver stops the run on it)."""
    _, block, actor, client = _down_actor(tmp_path, error)
    summary = asyncio.run(actor(block)).to_pylist()[0]
    fatal = json.loads(summary["fatal"])
    assert fatal["kind"] == CircuitOpenError.kind
    stats = json.loads(summary["summary"])
    # Calls out when the unit stopped are cancelled, and counted by neither side.
    assert stats["committed"] is False and stats["calls"] == client.answered > 0
    assert sum(stats["status_counts"].values()) == client.answered
    assert outcomes(tmp_path) == (None, None)
    assert OutcomeTable(str(tmp_path / "out")).committed_units("r1") == set()
    breaker = actor._breaker.stats()
    assert breaker.openings >= 1
    # What reached the service: the calls in flight when it failed (the initial limit, 4), the
    # calls that opened the breaker (threshold 3), then only probes; each call makes 4 attempts,
    # and on a code that may be the rows' fault a canary of 4 attempts more.
    assert client.calls <= 8 * (4 + 3 + breaker.probes)


def test_every_row_gets_a_fate_invalid_utf8_and_missing_ids_become_dead_letters(tmp_path):
    """One invalid UTF-8 text, a null id and an empty id: each a dead letter with its reason and
    its shard and row; the rest of the unit is inferred."""
    texts = pa.array([b"fine one", b"bad \xff\xfe bytes", b"fine two", b"no id", b"empty id"], pa.binary())
    ids = pa.array(["id0", "id1", "id2", None, ""], pa.string())
    pq.write_table(pa.table({"id": ids, "text": texts.view(pa.string())}), tmp_path / "in.parquet")
    units, _ = plan_units(list_shards(str(tmp_path / "in.parquet")), unit_rows=1000, columns=ColumnNames())
    block = read_unit(units[0], ColumnNames())
    client = ScriptedClient()
    summary = asyncio.run(InferenceActor(settings(tmp_path), client_factory=lambda: client)(block))
    assert summary.column("fatal").to_pylist() == [None]
    results, dead = outcomes(tmp_path)
    assert sorted(results.column("id").to_pylist()) == ["id0", "id2"]
    fates = {r["row"]: r for r in dead.to_pylist()}
    assert {row: r["error_kind"] for row, r in fates.items()} == {1: "invalid_text", 3: "missing_id", 4: "missing_id"}
    assert "fffe" in fates[1]["message"] and fates[1]["id"] == "id1"
    assert all(r["source"].endswith("in.parquet") for r in fates.values())
    assert client.calls == 1  # only the two good rows were sent


def test_an_invalid_utf8_line_of_json_lines_is_a_dead_letter_not_a_replacement_character(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "bad \xff text"}\n')
    units, _ = plan_units(list_shards(str(tmp_path / "in.jsonl")), unit_rows=1000, columns=ColumnNames())
    block = read_unit(units[0], ColumnNames())
    assert block.column("id").to_pylist() == ["a", "b"]
    assert block.column("text").to_pylist() == ["ok", None]
    assert block.column("_bad").to_pylist()[0] is None and block.column("_bad").to_pylist()[1].startswith(
        "invalid_text"
    )


def test_malformed_json_lines_are_dead_letters_with_their_kind_and_the_file_is_inferred(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(
        b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "cut\n"not an object"\n'
        b'{"id": [1], "text": "x"}\n{"id": "e", "text": "fine"}\n'
    )
    units, _ = plan_units(list_shards(str(tmp_path / "in.jsonl")), unit_rows=1000, columns=ColumnNames())
    block = read_unit(units[0], ColumnNames())
    client = ScriptedClient()
    summary = asyncio.run(InferenceActor(settings(tmp_path), client_factory=lambda: client)(block))
    assert summary.column("fatal").to_pylist() == [None]
    results, dead = outcomes(tmp_path)
    assert sorted(results.column("id").to_pylist()) == ["a", "e"]
    fates = {r["row"]: (r["id"], r["error_kind"]) for r in dead.to_pylist()}
    assert fates == {1: ("b", "invalid_row"), 2: (None, "invalid_row"), 3: (None, "invalid_id")}
    assert client.calls == 1


def test_micro_batches_hold_at_most_their_rows_and_bytes_a_longer_text_alone():
    order = np.arange(10)[::-1]
    small = np.full(10, 100)
    assert [b.tolist() for b in micro_batches(order, small, 4, 10_000)] == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    assert micro_batches(order[:0], small[:0], 4, 10_000) == []
    grow = np.array([100, 100, 100, 400, 400, 900, 5000, 5000, 20_000, 30])
    runs = micro_batches(order, grow, 4, 1000)
    assert [b.tolist() for b in runs] == [[9, 8, 7, 6], [5], [4], [3], [2], [1], [0]]  # 700, 400, 900, ...


def test_a_unit_of_long_documents_is_sent_in_calls_under_the_byte_cap(tmp_path):
    texts = ["short one", "x" * (CALL_TEXT_BYTES // 3), "y" * (CALL_TEXT_BYTES // 3), "z" * (CALL_TEXT_BYTES // 2)]
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "text": texts}), tmp_path / "in.parquet")
    units, _ = plan_units(list_shards(str(tmp_path / "in.parquet")), unit_rows=1000, columns=ColumnNames())
    client = ScriptedClient()
    asyncio.run(InferenceActor(settings(tmp_path), client_factory=lambda: client)(read_unit(units[0], ColumnNames())))
    results, dead = outcomes(tmp_path)
    assert sorted(results.column("id").to_pylist()) == ["a", "b", "c", "d"] and dead is None
    assert client.calls == 2  # a, b, c under the cap; d alone


def test_a_text_with_a_committed_answer_costs_no_call_and_duplicates_are_sent_once(tmp_path):
    """Rows whose text has an answer of this model in the index are copied, under their own ids;
    rows of the unit sharing a text are sent once."""
    from raypipe.call.reuse import TextIndex, hash_texts

    known = "already answered"
    probs = np.array([fake_probs(known)], np.float32)
    index = TextIndex("fake-1", LABELS, hash_texts([known]), probs, np.array([False]))
    texts = [known, "new text", "new text", "other", known]
    _, block = make_unit(tmp_path, texts)
    client = ScriptedClient()
    cfg = dataclasses.replace(settings(tmp_path), text_index=index)
    summary = asyncio.run(InferenceActor(cfg, client_factory=lambda: client)(block))
    results, dead = outcomes(tmp_path)
    assert dead is None and results.num_rows == 5
    rows = {r["id"]: r for r in results.to_pylist()}
    for i, text in enumerate(texts):
        assert [rows[f"id{i}"][f"prob_{label}"] for label in LABELS] == pytest.approx(fake_probs(text), abs=1e-6)
    assert rows["id0"]["text_hash"] == rows["id4"]["text_hash"] == int(hash_texts([known])[0])
    stats = json.loads(summary.column("summary")[0].as_py())
    assert stats["copied"] == 3  # id0 and id4 from the index, id2 from id1's answer
    assert sorted(client.texts_sent) == ["new text", "other"]


def test_an_actor_with_metrics_tells_its_gauges_of_each_committed_unit(tmp_path, monkeypatch):
    """`run.since_commit_s`, the run's heartbeat in Datadog, restarts at every commit."""
    from protos.telemetry import MetricsSpec, NullMetrics
    from raypipe.call.metrics import ActorGauges

    commits = []
    monkeypatch.setattr(MetricsSpec, "build", lambda self: NullMetrics())
    monkeypatch.setattr(ActorGauges, "committed", lambda self: commits.append(self))
    _, block = make_unit(tmp_path, ["one", "two", "three"])
    with_metrics = dataclasses.replace(settings(tmp_path), metrics=MetricsSpec(ray_metrics=True))
    asyncio.run(InferenceActor(with_metrics, client_factory=ScriptedClient)(block))
    assert len(commits) == 1


def test_rows_sharing_a_text_are_grouped_under_the_first_in_row_order():
    from raypipe.call.batches import duplicates_by_first

    rows = np.array([3, 5, 8, 9, 12, 20], np.int64)
    # Positions 0, 2 and 5 share a text; 1 and 4 another; 3 is alone.
    first_of = np.array([0, 1, 0, 3, 1, 0])
    groups = duplicates_by_first(rows, first_of)
    assert sorted(groups) == [3, 5]
    assert groups[3].tolist() == [8, 20] and groups[5].tolist() == [12]
    assert duplicates_by_first(rows, np.arange(6)) == {}


@pytest.mark.parametrize("answer_as", ["version", "labels"])
def test_answers_as_another_model_are_never_committed_and_stop_the_unit_like_an_outage(tmp_path, answer_as):
    """Ray Serve's gRPC proxy sends a call naming an application it does not have (deleted,
    redeploying) to the only one left: the answers come back as another model. They are the
    service's failure, not results: the unit commits nothing and stops once the breaker has waited
    its `max_wait_s`, the message saying why."""
    runs_model = (
        {"model_version": "the-runs-model-2"} if answer_as == "version" else {"labels": (*LABELS[1:], LABELS[0])}
    )
    _, block, actor, _ = _down_actor(tmp_path, None, **runs_model)
    summary = asyncio.run(actor(block)).to_pylist()[0]
    fatal = json.loads(summary["fatal"])
    assert fatal["kind"] == CircuitOpenError.kind
    assert ("model version 'fake-1'" if answer_as == "version" else "labels") in fatal["message"]
    stats = json.loads(summary["summary"])
    assert stats["committed"] is False and stats["status_counts"].get("WRONG_MODEL", 0) > 0
    assert outcomes(tmp_path) == (None, None)


def test_answers_as_the_runs_model_are_committed(tmp_path):
    cfg = settings(tmp_path)
    _, block = make_unit(tmp_path, ["a joyful day", "a sad day"])
    actor = InferenceActor(
        ActorSettings(**{**cfg.__dict__, "model_version": "fake-1"}), client_factory=lambda: ScriptedClient()
    )
    summary = asyncio.run(actor(block)).to_pylist()[0]
    assert summary["fatal"] is None
    results, dead = outcomes(tmp_path)
    assert results.num_rows == 2 and dead is None
