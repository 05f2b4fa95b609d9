"""The CPU pool as a cluster runs it: several Ray nodes on this host, as in the manifests.

Two clusters, like the RayService and a RayJob:
- the model service: a head with no CPUs (Serve's controller and proxy only) and two pool
  nodes that advertise `serve_app.deploy.POOL_RESOURCE`, the only nodes replicas may use;
- the jobs: a head with no CPUs (the `raypipe` driver runs beside it) and two worker nodes for
  Ray Data's reads and the inference actors.

The jobs reach the service through its gRPC proxy, as a RayJob reaches `raypipe-serve-svc`.
One host has one port 9000, so the service runs its proxy on the head only; the manifests run
one per pool node behind a Service.

Each test is bounded in time; a node is lost by SIGKILL of every process it runs (a reclaimed
VM), while calls are in flight.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.cluster import LocalNodes, ReplicaWatch
from raypipe.samples import write_sample_corpus
from serve_app.deploy import POOL_RESOURCE, POOL_RESOURCE_PER_NODE
from tests.integration.conftest import S3, free_port, wait_for
from tests.integration.helpers import assert_nothing_lost, dead_letters

ROOT = Path(__file__).resolve().parents[2]
POOL = {POOL_RESOURCE: POOL_RESOURCE_PER_NODE}
#: Each cluster's worker nodes (2 CPUs each) and their custom resources.
SERVICE_NODES = {"pool-a": POOL, "pool-b": POOL}
JOB_NODES: dict[str, dict[str, float]] = {"job-a": {}, "job-b": {}}
NODE_CPUS = 2
# A killed node is declared dead after 8 missed health checks 1 s apart, each given 1 s (Ray's
# defaults: 5, 3 s apart, 10 s each): about 16 s. What the tests prove (nothing lost, the run
# goes on) does not depend on how soon Ray notices; only how long they wait for it does. Fewer
# checks were too few: with the other test lanes on the same 2 cores, a raylet's main thread once
# took 1.5-4.7 s to start each of four worker processes, missed 3 checks and was declared dead
# alive (it then exits), and with it the head node Serve's controller lives on.
FAST_DETECTION = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "8",
}
# Replicas and the proxy report their load to Serve's autoscaler every second (default 10 s), as
# often as the autoscaled app's 5 s look-back needs: it scales on a short backfill.
FAST_AUTOSCALING = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


@dataclass
class Pool:
    service: LocalNodes
    jobs: LocalNodes
    grpc_port: int
    model_dir: Path
    work: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def env(self, nodes: LocalNodes) -> dict[str, str]:
        return {**nodes.env, "RAY_ADDRESS": nodes.address, "PYTHONPATH": str(ROOT)}

    def on_service(self, code: str, timeout_s: float = 120) -> object:
        """Runs `code` (which sets `out`) as a driver of the service cluster; returns `out`."""
        script = (
            "import json, logging, ray\nray.init(address='auto', logging_level=logging.ERROR, log_to_driver=False)\n"
            + code
            + "\nprint('OUT' + json.dumps(out))"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=self.env(self.service),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        for line in done.stdout.splitlines():
            if line.startswith("OUT"):
                return json.loads(line[3:])
        raise AssertionError(f"service-side script failed: {done.stdout[-1500:]}{done.stderr[-3000:]}")

    def serve(self, app: str, *args: str) -> str:
        cmd = [sys.executable, "-m", "raypipe", "serve", "--model", str(self.model_dir), "--app-name", app]
        cmd += ["--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), "--detach", *args]
        done = subprocess.run(cmd, env=self.env(self.service), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    http_port: int = 0

    def delete(self, app: str) -> None:
        code = (
            "from ray import serve\nfrom ray.serve.exceptions import RayServeException\n"
            f"try:\n    serve.delete({app!r})\nexcept RayServeException:  # no Serve yet: nothing to delete\n"
            "    pass\nout = True"
        )
        self.on_service(code)

    def replicas(self, app: str) -> list[str]:
        """Node ids of the alive replicas of `app`, from the service's dashboard (a question over
        HTTP, not a driver process starting Python and `ray.init` at every poll)."""
        from ray.util.state import list_actors

        alive = list_actors(address=self.service.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
        return sorted(str(a.node_id) for a in alive if (a.class_name or "").startswith(f"ServeReplica:{app}:"))

    def backfill(self, corpus_uri: str, out: str, run_id: str, app: str, *extra: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "raypipe", "backfill", "--input", corpus_uri, "--output", out]
        cmd += ["--service", self.address, "--run-id", run_id, "--set", f"service.application={app}"]
        cmd += ["--set", "input.unit_rows=100", "--set", "client.micro_batch_size=16", *extra]
        log = (self.work / f"{run_id}.log").open("w")
        return subprocess.Popen(cmd, env=self.env(self.jobs), stdout=log, stderr=subprocess.STDOUT, text=True)

    def log(self, run_id: str) -> str:
        return (self.work / f"{run_id}.log").read_text()

    def restore(self) -> None:
        """Starts every worker node the clusters lack (all of them at first, a lost one later),
        side by side: each `ray start` mostly waits for its raylet."""
        missing = [(self.service, n, r) for n, r in SERVICE_NODES.items() if n not in self.service.nodes]
        missing += [(self.jobs, n, r) for n, r in JOB_NODES.items() if n not in self.jobs.nodes]
        with ThreadPoolExecutor(max(len(missing), 1)) as starting:
            started = [starting.submit(c.add_node, n, num_cpus=NODE_CPUS, resources=r) for c, n, r in missing]
            for node in started:
                node.result()


@pytest.fixture(scope="module")
def pool(s3: S3, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("multinode")
    # Short temp roots: Ray's socket paths must fit in 107 bytes.
    root = Path(f"/tmp/rpmn-{os.getpid()}")
    # Started as from a fresh shell: the virtualenv is not on PATH, so a job entrypoint's bare
    # `python` is the system's (without raypipe's packages), as a new user meets it.
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {**os.environ, "PATH": path, **FAST_DETECTION}
    # No log monitors: nothing here reads worker logs through a driver, and six of them would
    # tail every worker's log on the two cores the tests share.
    quiet = ("--include-log-monitor=false",)
    service = LocalNodes(
        root / "svc", port=free_port(), dashboard_port=free_port(), env={**env, **FAST_AUTOSCALING}, start_args=quiet
    )
    jobs = LocalNodes(root / "job", port=free_port(), dashboard_port=free_port(), env=env, start_args=quiet)
    with service, jobs:
        p = Pool(service, jobs, free_port(), demo_model_dir, work)
        p.http_port = free_port()
        p.restore()
        yield p


@pytest.fixture(scope="module")
def corpus(s3: S3):
    return write_sample_corpus(
        f"{s3.bucket('multinode')}/in", rows=1800, parquet_shards=6, jsonl_shards=0, bad_fraction=0.0
    )


def report_of(out: str, run_id: str) -> dict:
    import fsspec

    with fsspec.open(f"{out}/runs/{run_id}.json") as f:
        return dict(json.load(f))


def commit_times(out: str) -> list[float]:
    """Unix times of the outcomes table's commits, oldest first."""
    from deltalake import DeltaTable

    from raypipe.commit.table import storage_options

    table = f"{out}/outcomes"
    history = DeltaTable(table, storage_options=storage_options(table)).history()
    return sorted(h["timestamp"] / 1000 for h in history if h.get("operation") in ("WRITE", "MERGE"))


@pytest.mark.timeout(600)
def test_replicas_only_on_pool_nodes_and_the_readme_job_submit_reaches_them_from_a_fresh_shell(pool, s3):
    """Placement as in the manifests, and the README's `ray job submit`, typed in a shell without
    the virtualenv activated against a cluster started the same way: the entrypoint must not
    depend on what `python` means on PATH. A healthy service: no retry, no dead letter."""
    printed = pool.serve("fixed")
    assert "2 replicas" in printed and "on 2 pool nodes" in printed, printed
    nodes = pool.replicas("fixed")
    pool_ids = {pool.service.nodes[n].node_id for n in ("pool-a", "pool-b")}
    assert len(nodes) == 2 and set(nodes) == pool_ids, (nodes, pool_ids)  # one per pool node, none on the head
    # Ray Data's cluster-wide helpers were started by `serve`, not by a first run's start.
    helpers = pool.on_service(
        "from ray.util.state import list_actors\n"
        "out = sorted(a.class_name for a in list_actors(filters=[('state', '=', 'ALIVE')], limit=1000))"
    )
    assert {"_StatsActor", "ActorLocationTracker"} <= set(helpers), helpers  # type: ignore[call-overload]

    words = readme_job_submit()
    assert words[:3] == ["ray", "job", "submit"], words
    # What the job proves (it starts, reaches the service and completes without a retry) does not
    # depend on the corpus's size: a small one of its own, not the node-loss tests' long run.
    corpus = write_sample_corpus(
        f"{s3.bucket('multinode')}/in-job", rows=300, parquet_shards=3, jsonl_shards=0, bad_fraction=0.0
    )
    out = f"{s3.bucket('multinode')}/out-job"
    values = {
        "http://HEAD:8265": pool.jobs.dashboard_url,
        "s3://corpus/paragraphs/": corpus.uri,
        "s3://out/emotions/": out,
        "SERVE_HOST:9000": pool.address,
        ".": str(ROOT),
    }
    cmd = [str(Path(sys.executable).parent / "ray")]
    cmd += [values.get(w, w).replace("$PWD", str(ROOT)) for w in words[1:]]
    cmd += ["--set", "service.application=fixed"]
    done = subprocess.run(cmd, env=pool.env(pool.jobs), capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = report_of(out, words[words.index("--run-id") + 1])
    assert report["status"] == "completed" and report["retries"] == 0, report
    assert_nothing_lost(out, corpus.ids)
    assert dead_letters(out) is None  # the corpus has no malformed rows


def readme_job_submit() -> list[str]:
    """The README's local `ray job submit` command, as words (a bash block under its heading)."""
    import shlex

    text = (ROOT / "README.md").read_text()
    block = text.split("### `ray job submit`", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def _actor_nodes(nodes: LocalNodes, class_part: str) -> set[str]:
    from ray.util.state import list_actors

    alive = list_actors(address=nodes.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return {str(a.node_id) for a in alive if class_part in (a.class_name or "")}


@pytest.mark.timeout(900)
def test_a_pool_node_then_the_jobs_node_hosting_the_inference_actor_lost_mid_run_lose_nothing(pool, corpus, s3):
    """One backfill loses a pool node (and its replica), runs on, then loses the jobs node that
    hosts its inference actor, and completes with every row once. Each loss lands while the run
    has work left: units are committed after each, on the nodes that remain."""
    pool.serve("fixed")  # already there from the first test, or deployed now
    out = f"{s3.bucket('multinode')}/out-node-loss"
    # One actor, so the node that hosts it is known; every unit goes through it. Calls of 4 rows
    # keep the run going for a while after its first commits.
    run = pool.backfill(
        corpus.uri, out, "mn-node-loss", "fixed", "--set", "actors.max_actors=1", "--set", "client.micro_batch_size=4"
    )
    hosts: set[str] = set()

    def one_host() -> bool:
        nonlocal hosts
        hosts = _actor_nodes(pool.jobs, "InferenceActor")
        return len(hosts) == 1

    lost: dict[str, float] = {}
    try:
        # The actor's node is looked up while the run starts: looked up after its first commits,
        # on busy cores, the run was once over before the state API answered (no ALIVE actor left).
        wait_for(one_host, 300, "the inference actor to start")
        (job_node,) = [n for n, node in pool.jobs.nodes.items() if node.node_id in hosts]
        seen: dict[str, bool] = {}
        wait_for(lambda: _commits(s3, out, seen) >= 2, 300, "the first committed units")
        assert run.poll() is None, "the run ended before a pool node could be lost: " + pool.log("mn-node-loss")
        lost["pool-b"] = time.time()
        before_pool_loss = _commits(s3, out, seen)
        assert pool.service.kill_node("pool-b") > 0
        # The pool node went while the run had work left, and its replica with it: the run goes on
        # against the other one. (Serve's router sends the dead replica's unstarted requests to the
        # other replica, so the client may see no error at all: the report's calls say which.)
        wait_for(
            lambda: _commits(s3, out, seen) >= before_pool_loss + 3, 300, "units committed after the pool node's loss"
        )
        assert run.poll() is None, "the run ended before its actor's node could be lost: " + pool.log("mn-node-loss")
        lost[job_node] = time.time()
        assert pool.jobs.kill_node(job_node) > 0
        assert run.wait(timeout=400) == 0, pool.log("mn-node-loss")
        assert_nothing_lost(out, corpus.ids)
        report = report_of(out, "mn-node-loss")
        assert report["status"] == "completed" and dead_letters(out) is None, report
        times = commit_times(out)
        after_pool = [t for t in times if lost["pool-b"] < t <= lost[job_node]]
        after_job = [t for t in times if t > lost[job_node]]
        assert len(after_pool) >= 3 and len(after_job) >= 3, (lost, times)
        wait_for(lambda: len(pool.replicas("fixed")) == 1, 120, "the lost node's replica to be declared dead")
        print(
            f"\nnodes lost: pool-b, then {job_node} hosting the actor; the run ended "
            f"{after_job[-1] - lost[job_node]:.1f} s after the second loss; {report['retries']} retries, "
            f"calls {report['status_counts']}"
        )
    finally:
        if run.poll() is None:
            run.kill()
        pool.restore()  # the lost nodes back for the tests after this one, pass or fail


def _commits(s3: S3, out: str, seen: dict[str, bool]) -> int:
    """Unit commits in the outcomes table's log so far: entries that add a data file (the run's
    set-up, take-over and plan are commits too, with no rows). `seen` (the caller's, one per
    table) keeps what each entry held: an entry never changes once written, so each is read
    once, not at every poll (five a second)."""
    fs = s3.fs()
    try:
        entries = [p for p in fs.ls(f"{out}/outcomes/_delta_log") if p.endswith(".json")]
    except FileNotFoundError:
        return 0
    for p in entries:
        if p not in seen:
            seen[p] = '"add"' in fs.cat_file(p).decode()
    return sum(seen[p] for p in entries)


@pytest.mark.timeout(600)
def test_autoscaled_replicas_follow_a_backfill_up_to_the_pool_and_back(pool, s3):
    pool.delete("fixed")  # the pool's CPUs are the autoscaled app's alone
    # The demo model answers a backfill of this size in ~10 s, faster than Serve's autoscaler
    # looks; 0.3 s more per call keeps the load up long enough for it to act, as a heavy model does.
    settings = pool.work / "slow.json"
    settings.write_text(json.dumps({"fault": {"extra_latency_s": 0.3}}))
    printed = pool.serve(
        "auto", "--num-replicas", "auto", "--settings", str(settings), "--target-ongoing-requests", "2",
        "--upscale-delay-s", "1", "--downscale-delay-s", "10", "--look-back-period-s", "5",
    )  # fmt: skip
    assert "1-2 replicas (auto)" in printed, printed  # max: what the pool's CPUs hold
    corpus = write_sample_corpus(
        f"{s3.bucket('multinode')}/in-auto", rows=4800, parquet_shards=6, jsonl_shards=0, bad_fraction=0.0
    )
    out = f"{s3.bucket('multinode')}/out-auto"
    watch_env = pool.env(pool.service)
    with ReplicaWatch("auto", env=watch_env, log=pool.work / "replicas-auto.jsonl") as watch:
        run = pool.backfill(corpus.uri, out, "mn-auto", "auto")
        assert run.wait(timeout=400) == 0, pool.log("mn-auto")
        ended = time.monotonic() - watch.started
        wait_for(lambda: [len(s.get("replicas", [])) for s in watch.read()][-1:] == [1], 120, "a scale-down to 1")
    counts = [(s["t"], len(s["replicas"])) for s in watch.samples if "replicas" in s]
    up = [t for t, n in counts if n == 2]
    assert up and up[0] < ended, counts  # scaled up while the backfill ran
    down = [t for t, n in counts if t > up[-1] and n == 1]
    assert down, counts
    assert_nothing_lost(out, corpus.ids)
    report = report_of(out, "mn-auto")
    # Replicas came and went under a healthy service: no row failed. While a replica is added or
    # removed, Serve may answer a call UNAVAILABLE (2 of 314 calls in one run, 10 of 322 in
    # another: how many depends on the machine's timing, not on raypipe). Each such call is
    # retried, the breaker never takes the service for down, and they stay a small share.
    assert report["status"] == "completed" and report["rows_dead_letters"] == 0, report
    assert set(report["status_counts"]) <= {"OK", "UNAVAILABLE"}, report
    assert report["retries"] == report["status_counts"].get("UNAVAILABLE", 0) <= report["calls"] // 10, report
    assert report["breaker_openings"] == 0, report
    nodes = {s for sample in watch.samples for s in sample.get("replicas", [])}
    assert nodes <= {pool.service.nodes[n].node_id for n in ("pool-a", "pool-b")}, nodes
    print(
        f"\nautoscaling: 2 replicas {up[0]:.0f} s after the start, run ended at {ended:.0f} s, "
        f"back to 1 at {down[0]:.0f} s; {report['throughput_rows_per_s']:.0f} rows/s; replicas over time {counts}"
    )
