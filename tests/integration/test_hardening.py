"""Run modes under a broken service, a retried job and partial input (issue: run-mode hardening).

Each test reproduces one way work used to be lost or redone, on real parts: the Ray cluster,
the Serve gRPC app with its fault setting, real Parquet files, and moto's S3 where S3 matters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.lease import Lease
from raypipe.commit.table import OutcomeTable
from raypipe.errors import LeaseLostError, OutputPermissionError, UnsafeOutputError
from raypipe.samples import write_sample_corpus
from raypipe.store import OutputStore
from serve_app.settings import FaultInjection, ServerSettings
from tests.integration.conftest import wait_for
from tests.integration.helpers import assert_nothing_lost, committed_units, dead_letters, ids, results
from tests.integration.s3_proxy import S3Proxy

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
FAST = {"retry": {"initial_backoff_s": 0.05, "max_backoff_s": 0.3}}


def cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "raypipe", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def served(app: str) -> dict[str, dict[str, int]]:
    return serve.get_app_handle(app).stats.remote().result()


@pytest.mark.timeout(300)
def test_a_broken_service_stops_the_run_and_the_same_run_id_completes_once_fixed(
    tmp_path, ray_cluster, serve_address, deploy_app
):
    """Every call answers INTERNAL (a crash-looping model): the breaker opens, the run stops with
    a clear error and a non-zero exit after few calls, nothing is dead-lettered; rerunning the same
    run id against the fixed service puts every row in the results."""
    app = deploy_app("broken", ServerSettings(fault=FaultInjection(fail_fraction=1.0, status="INTERNAL")))
    # Two units of 500 rows: bisecting one down to single rows would take about 1,000 calls, so
    # the bound below still tells a breaker that stops the run from one that does not; the
    # rerun's promise (every row once) does not depend on the corpus's size.
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=1000, parquet_shards=2, jsonl_shards=0,
                                 bad_fraction=0.0, seed=81)  # fmt: skip
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    args = ["backfill", "--input", corpus.uri, "--output", str(out), "--service", serve_address, "--run-id", "b1",
            "--set", "input.unit_rows=500", "--set", "client.breaker.max_wait_s=6",
            "--set", "client.retry.initial_backoff_s=0.05", "--set", "client.retry.max_backoff_s=0.3"]  # fmt: skip
    failed = cli(*args, "--set", f"service.application={app}", env=env)
    print(failed.stdout[-1500:], failed.stderr[-1500:])
    assert failed.returncode == 1
    assert "CircuitOpenError" in failed.stderr and "model service" in failed.stderr
    calls = served(app)["calls"]
    assert calls.get("OK", 0) == 0
    assert sum(calls.values()) <= 400, calls  # was about 4 calls a row (bisection down to single rows)
    assert dead_letters(out) is None and results(out) is None
    report = json.loads((out / "runs" / "b1.json").read_text())
    assert report["status"] == "failed" and "CircuitOpenError" in report["error"]
    assert report["rows_dead_letters"] == 0
    # The stopped run's report keeps the calls and statuses that explain why it stopped.
    assert report["calls"] > 0 and report["status_counts"].get("INTERNAL", 0) > 0, report["status_counts"]
    assert report["breaker_openings"] >= 1

    fixed = cli(*args, env=env)  # the same run id, the healthy app
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    results_ids, dead = assert_nothing_lost(out, corpus.ids)
    assert dead == [] and len(results_ids) == len(corpus.ids)
    print(f"broken service: {sum(calls.values())} calls before stopping; rerun: {fixed.stdout.splitlines()[0]}")


@pytest.mark.timeout(360)
def test_a_second_attempt_fences_the_first_off_and_nothing_is_written_twice(
    tmp_path, ray_cluster, serve_address, deploy_app
):
    """A retried job takes over the run (here with --force, as an operator would; without it, it waits
    for the lease to expire): the first attempt stops before its next write, and every id ends
    exactly once in the results."""
    # One unit at a time, 2 s a call: the 12 units after the first 3 take the first attempt over
    # 24 s, longer than the second attempt's start even on loaded cores (at 0.3 s a call and two
    # units at a time, a fast machine finished the first attempt before the takeover). The second
    # attempt calls the session's unslowed app (the same model): it has the rest to do.
    app = deploy_app("slow", ServerSettings(fault=FaultInjection(extra_latency_s=2.0)))
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=750, parquet_shards=3, jsonl_shards=0,
                                 bad_fraction=0.0, row_group_size=50, seed=91)  # fmt: skip
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    common = ["--input", corpus.uri, "--output", str(out), "--service", serve_address, "--run-id", "twice",
              "--set", f"service.application={app}", "--set", "input.unit_rows=50",
              "--set", "actors.max_actors=1", "--set", "actors.units_per_actor=1",
              "--set", "output.lease_s=30"]  # fmt: skip
    first = subprocess.Popen([PYTHON, "-m", "raypipe", "backfill", *common], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: committed_units(out, "twice") >= 3, 180, "the first attempt's first units")
        # Without --force the second attempt would wait for the live lease; with it, it takes over now.
        unslowed = [("service.application=raypipe" if a == f"service.application={app}" else a) for a in common]
        second = cli("backfill", *unslowed, "--force", env=env, timeout=300)
        _, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
    print("first:", err1[-800:], "\nsecond:", second.stdout[-600:])
    assert first.returncode != 0, "the first attempt finished before the second took over"
    assert "LeaseLostError" in err1
    assert second.returncode == 0, second.stderr[-2000:]
    results_ids, dead = assert_nothing_lost(out, corpus.ids)
    assert len(results_ids) == len(corpus.ids) and dead == []
    assert OutcomeTable(str(out)).generation() == 2


def _racer(output: str, endpoint: str, version: str, go, results) -> None:
    """One attempt of run `race` in its own process, its S3 traffic through `endpoint`."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    from raypipe.commit.table import OutcomeTable
    from raypipe.errors import LeaseLostError
    from tests.unit.test_table import UNIT, rows

    table = OutcomeTable(output)
    try:
        fence = take_over(table, "race")
        results.put(("took", fence.generation))
        assert go.wait(120)
        answers = {"A": "result", "B": "dead_letter"} if version == "old" else {"A": "result", "B": "result"}
        results.put(
            ("committed", UnitCommitter(fence).commit(UNIT, rows(answers, version=version).replace_schema_metadata()))
        )
    except LeaseLostError as e:
        results.put(("fenced", str(e)))


@pytest.mark.timeout(240)
def test_an_older_attempt_whose_writes_are_stalled_past_the_takeover_has_nothing_visible(s3):
    """Two processes race for one run id on S3. The older one's PUTs are held by a proxy (a
    stalled S3 request, a partition, a GC pause) until after the newer one took over and
    committed: the table rejects the older commit, and every id is there once, as the newer
    attempt answered it."""
    import multiprocessing

    from raypipe.commit.outcomes import read_outcomes
    from tests.fakes import LABELS

    out = f"{s3.bucket('race')}/out"
    OutcomeTable(out).ensure(LABELS)
    ctx = multiprocessing.get_context("spawn")
    with S3Proxy(s3.endpoint, "hold_writes") as proxy:
        go_old, go_new, old_q, new_q = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
        old = ctx.Process(target=_racer, args=(out, proxy.endpoint, "old", go_old, old_q))
        old.start()
        assert old_q.get(timeout=90) == ("took", 1)
        proxy.holding = True
        go_old.set()  # the old attempt writes its unit: its first PUT is held
        wait_for(lambda: proxy.held >= 1, 60, "the old attempt's write to stall")
        new = ctx.Process(target=_racer, args=(out, s3.endpoint, "new", go_new, new_q))
        new.start()
        assert new_q.get(timeout=90) == ("took", 2)
        go_new.set()
        assert new_q.get(timeout=90) == ("committed", True)
        proxy.release.set()  # the stalled writes land now, after the takeover
        kind, message = old_q.get(timeout=90)
        old.join(60)
        new.join(60)
    assert kind == "fenced" and "generation 2" in message, (kind, message)
    committed = read_outcomes(out)
    seen = sorted(zip(committed.column("id").to_pylist(), committed.column("outcome").to_pylist(),
                      committed.column("model_version").to_pylist(), strict=True))  # fmt: skip
    assert seen == [("A", "result", "new"), ("B", "result", "new")]


def test_a_live_lease_of_another_run_is_refused_and_of_the_same_run_waited_out(s3):
    """What is asserted is the order of events against the lease's own expiry, not how long any
    step took: on a busy machine an S3 call can take seconds."""
    from raypipe.errors import OutputLockedError

    store = OutputStore(f"{s3.bucket('fence')}/out")
    live = Lease(store, "run-a", duration_s=120)
    live.acquire()
    live._stop.set()  # it hangs: no more heartbeats, but it is far from expiring
    with pytest.raises(OutputLockedError, match="run-a"):
        Lease(store, "run-b", duration_s=2).acquire()

    store = OutputStore(f"{s3.bucket('fence')}/out-2")
    holder = Lease(store, "run-a", duration_s=2)
    holder.acquire()
    holder._stop.set()
    record, _ = holder._read()
    assert record is not None
    retried = Lease(store, "run-a", duration_s=2)
    retried.acquire()  # waits for the expiry, then takes over with a conditional (If-Match) replace
    assert time.time() >= record["expires_at"]
    assert retried.generation == 2 and not holder.held()
    retried.release()


def _proxied_store(s3, bucket: str, proxy: S3Proxy) -> OutputStore:
    import s3fs

    store = OutputStore(f"{s3.bucket(bucket)}/out")
    store._fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, key="testing", secret="testing",
                                  skip_instance_cache=True)  # fmt: skip
    return store


def test_an_s3_endpoint_without_conditional_writes_is_refused(s3):
    with S3Proxy(s3.endpoint, "strip_conditions") as proxy:
        store = _proxied_store(s3, "nocond", proxy)
        with pytest.raises(UnsafeOutputError, match="ignores conditional writes"):
            Lease(store, "run-a").check_conditional_writes()
    Lease(OutputStore(f"{s3.bucket('nocond')}/out"), "run-a").check_conditional_writes()  # moto itself is fine


def test_a_permission_error_says_so(s3):
    with S3Proxy(s3.endpoint, "deny_writes") as proxy:
        store = _proxied_store(s3, "denied", proxy)
        with pytest.raises(OutputPermissionError, match="permission"):
            Lease(store, "run-a").acquire()


@pytest.mark.timeout(360)
def test_a_killed_replay_never_shows_an_id_twice_and_resumes_by_run_id(
    tmp_path, ray_cluster, serve_address, deploy_app
):
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=300, parquet_shards=1, jsonl_shards=0, bad_fraction=0.0,
                                 seed=95)  # fmt: skip
    in_dir = tmp_path / "in"
    poison = [f"p{i}" for i in range(30)]
    for k in range(6):  # six shards of poison rows: six dead-letter files, six replay units
        chunk = poison[k * 5 : (k + 1) * 5]
        pq.write_table(pa.table({"id": chunk, "text": [f"CRASHME {i}" for i in chunk]}), in_dir / f"poison{k}.parquet")
    app = deploy_app("poison2", ServerSettings(fault=FaultInjection(poison_text="CRASHME", status="INTERNAL")))
    out = tmp_path / "out"
    all_ids = [*corpus.ids, *poison]
    report = raypipe.backfill(str(in_dir), str(out), service=serve_address, run_id="rp",
                              settings={"service": {"application": app}, "client": FAST})  # fmt: skip
    assert report.rows_dead_letters == 30

    slow = deploy_app("slowfix", ServerSettings(fault=FaultInjection(extra_latency_s=0.5)))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    args = ["replay", "--output", str(out), "--run-id", "rp", "--service", serve_address]
    slow_args = ["--set", f"service.application={slow}", "--set", "actors.max_actors=1", "--set", "output.lease_s=10",
                 "--set", "actors.units_per_actor=1", "--set", "client.micro_batch_size=1"]  # fmt: skip
    replay = subprocess.Popen([PYTHON, "-m", "raypipe", *args, *slow_args], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def still_dead() -> int:
        return len(ids(dead_letters(out)))

    try:
        wait_for(lambda: still_dead() <= 25, 200, "a first replayed unit")  # of five rows, 0.5 s each
    finally:
        replay.send_signal(signal.SIGKILL)
        replay.wait(timeout=30)
    assert still_dead() > 0, "the replay finished before it could be killed"
    # Each replayed unit replaced its dead letters in the same commit: no id twice, none missing,
    # in the run's committed rows and in the latest view alike.
    assert_nothing_lost(out, all_ids)
    latest = raypipe.latest(str(out)).column("id").to_pylist()
    assert len(latest) == len(set(latest)) == len(all_ids)

    time.sleep(2)
    resumed = cli(*args, env=env)  # the same command, no replay id: it resumes the killed replay
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "rp.replay-1" in resumed.stdout
    results_ids, dead = assert_nothing_lost(out, all_ids)
    assert dead == [] and len(results_ids) == len(all_ids)


@pytest.mark.timeout(120)
def test_a_lease_whose_store_went_away_is_lost_before_it_expires():
    """The real lease on a real S3 endpoint that stops answering (its own moto server, stopped):
    botocore raises `EndpointConnectionError`, not an `OSError`; every such renewal counts as
    missed, and once the lease would have expired the attempt knows it lost it."""
    from bench.s3server import MotoServer

    server = MotoServer().start()
    try:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="testing", secret="testing", skip_instance_cache=True)
        fs.mkdir("gone")
        store = OutputStore("s3://gone/out")
        store._fs = fs
        lease = Lease(store, "run-a", duration_s=3)
        lease.acquire()
        server.stop()
        wait_for(lambda: lease.lost, 30, "the lease to be lost")
        with pytest.raises(LeaseLostError):
            lease.check()
    finally:
        server.stop()


def _lost_answers_attempt(output: str, endpoint: str, results) -> None:
    """One attempt of run `lost` through the protocol's steps (no Ray), its S3 traffic through
    `endpoint`: lease, take-over, a unit commit, the files seen, the run commit."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    from raypipe.commit.output import Output
    from raypipe.commit.protocol import CommitProtocol
    from raypipe.config import OutputConfig
    from raypipe.plan.planning import Plan
    from raypipe.plan.units import WorkUnit
    from tests.fakes import LABELS
    from tests.unit.test_table import rows

    protocol = CommitProtocol(Output.at(OutputConfig(uri=output, lease_s=60, lease_wait_s=5)), "backfill", "lost")
    try:
        protocol.setup_run(LABELS)
        plan = Plan("backfill", "/in", [WorkUnit("/in/a.parquet", "parquet", 0, None, fingerprint="fp-a")], [])
        unit = plan.units[0].key
        answers = rows({"A": "result", "B": "result"}, version="m")
        answers = answers.set_column(answers.schema.get_field_index("unit"), "unit", pa.array([unit, unit]))
        committed = protocol.commit_unit(unit, answers)
        seen = protocol.record_files_seen(plan, {u.key for u in plan.units})
        protocol.commit_run(plan)
        results.put(("completed", committed, seen, protocol.files_seen()))
    except Exception as e:
        results.put(("failed", f"{type(e).__name__}: {e}"))
    finally:
        protocol.release()


@pytest.mark.timeout(300)
def test_a_lost_answer_to_a_conditional_put_does_not_stop_a_run(s3):
    """S3 carries out a conditional PUT and the answer is lost (a dropped connection): the client
    retries and finds the object there. Each of the run's conditional writes (the lease, the
    take-over, the unit commit, the files-seen pointer, the run commit) loses its first answer,
    and the run recognises each as its own: it completes, with every id once."""
    import multiprocessing

    from raypipe.commit.outcomes import read_outcomes

    out = f"{s3.bucket('lost-answers')}/out"
    ctx = multiprocessing.get_context("spawn")
    with S3Proxy(s3.endpoint, "drop_answer") as proxy:
        proxy.drop_answers = 100
        proxy.drop_key = ""
        q = ctx.Queue()
        attempt = ctx.Process(target=_lost_answers_attempt, args=(out, proxy.endpoint, q))
        attempt.start()
        outcome = q.get(timeout=240)
        attempt.join(60)
        dropped = list(proxy.dropped)
    print("answers lost:", dropped)
    assert outcome[0] == "completed", outcome
    assert any(k.endswith("/lease.json") for k in dropped)
    assert sum("_delta_log/" in k for k in dropped) >= 4  # table, take-over, unit, files seen, run
    assert outcome[1] is True and outcome[2] == 1
    committed = read_outcomes(out)
    assert sorted(committed.column("id").to_pylist()) == ["A", "B"]
    assert OutcomeTable(out).is_committed("lost")
