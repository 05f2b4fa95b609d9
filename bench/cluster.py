"""A local Ray cluster started as a user would, and CPU/RSS sampling of every process it runs.

`Cluster` runs ``ray start --head --num-cpus N`` with its own temp dir and ports, so its
processes (GCS, raylet, dashboard, Serve's controller/proxy/replicas, Ray Data workers) are
recognised by that dir in their command lines; `ProcessSampler` adds them to the processes
the benchmark itself started (clients, the `raypipe` driver) and integrates CPU time and the
summed RSS over a measured interval. ``ray stop --force`` always runs at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.tcp_proxy import free_port
from raypipe.run.driver import LOCAL_CLUSTER_FLAGS, ensure_cluster_token, with_fast_start

__all__ = [
    "Cluster",
    "LocalNodes",
    "Node",
    "ProcessSampler",
    "ReplicaWatch",
    "TreeUsage",
    "bench_env",
    "ensure_ray_token",
    "watch_replicas",
]

RAY_PORT = 6391
DASHBOARD_PORT = 8271
GRPC_PORT = 9191
HTTP_PORT = 8191
TEMP_DIR = "/tmp/rpbench"


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every process of the benchmark runs with. Ray's token authentication is
    on, as on the clusters `raypipe serve --detach` starts (`RAY_AUTH_MODE=token`; the token file
    is the user's, `RAY_AUTH_TOKEN_PATH` where set, created 0600 when missing by
    `ensure_ray_token`); `bench.auth` measures what it costs against `disabled`."""
    env = dict(os.environ)
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_ADDRESS": f"127.0.0.1:{RAY_PORT}",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), env.get("PYTHONPATH", "")])),
        }
    )
    env.update(extra or {})
    return env


def ensure_ray_token(env: dict[str, str]) -> None:
    """The cluster's token file exists (mode 0600) before ``ray start`` runs with `env`, as
    `raypipe serve --detach` makes sure (``ray start`` alone would write it readable by all)."""
    if env.get("RAY_AUTH_MODE", "").lower() == "token":
        ensure_cluster_token(env)


@dataclass
class TreeUsage:
    """CPU seconds and peak summed RSS of a set of processes over an interval."""

    cpu_s: float = 0.0
    peak_rss_bytes: int = 0
    """Peak of the summed RSS of every sampled process (shared pages count once per process)."""
    peak_rss_started_bytes: int = 0
    """The same, over only the processes the benchmark started (client or driver) and their children."""
    processes: int = 0


@dataclass
class ProcessSampler:
    """Samples processes matching ``marker`` in their command line, plus ``roots`` and their children.

    CPU of a process is its last sampled time minus its time at the start (0 if it appeared
    later); a process that ends between two samples loses at most one interval of CPU.
    """

    marker: str | None = None
    interval_s: float = 1.0
    """Seconds between samples. The sampler shares the cores it measures: at 0.25 s, with every
    process's command line read at each sample, it took 12-15% of a core from a 2-core run."""
    rescan_s: float = 5.0
    """Seconds between looks for new processes (the process table and command lines); samples
    in between read the known ones only."""
    _roots: set[int] = field(default_factory=set)
    _members_cache: tuple[float, list[psutil.Process], set[int]] | None = None
    _base: dict[int, float] = field(default_factory=dict)
    _last: dict[int, float] = field(default_factory=dict)
    _peak: int = 0
    _peak_roots: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def add_root(self, pid: int) -> None:
        self._roots.add(pid)

    def _members(self) -> tuple[list[psutil.Process], set[int]]:
        found: dict[int, psutil.Process] = {}
        for pid in list(self._roots):
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                found[pid] = root
                for child in root.children(recursive=True):
                    found[child.pid] = child
        from_roots = set(found)
        if self.marker:
            for p in psutil.process_iter(["cmdline"]):
                cmd = p.info.get("cmdline") or []
                if any(self.marker in arg for arg in cmd):
                    found[p.pid] = p
                    # Workers (Serve replicas, Ray Data tasks) are the raylet's children and
                    # rename themselves ("ray::ServeReplica..."), dropping the marker.
                    with contextlib.suppress(psutil.Error):
                        for child in p.children(recursive=True):
                            found[child.pid] = child
        found.pop(os.getpid(), None)
        return list(found.values()), from_roots

    def _known_members(self, *, fresh: bool) -> tuple[list[psutil.Process], set[int]]:
        now = time.monotonic()
        cached = self._members_cache
        if fresh or cached is None or now - cached[0] >= self.rescan_s:
            members, from_roots = self._members()
            self._members_cache = (now, members, from_roots)
            return members, from_roots
        return cached[1], cached[2]

    def _sample(self, *, first: bool = False, fresh: bool = False) -> None:
        rss = rss_roots = 0
        members, from_roots = self._known_members(fresh=first or fresh)
        for p in members:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
                mem = p.memory_info().rss
            except psutil.Error:
                continue
            if p.pid not in self._base:
                self._base[p.pid] = cpu if first else 0.0
            self._last[p.pid] = cpu
            rss += mem
            if p.pid in from_roots:
                rss_roots += mem
        self._peak = max(self._peak, rss)
        self._peak_roots = max(self._peak_roots, rss_roots)

    def __enter__(self) -> ProcessSampler:
        self._sample(first=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample(fresh=True)

    def usage(self) -> TreeUsage:
        cpu = sum(self._last[pid] - self._base.get(pid, 0.0) for pid in self._last)
        return TreeUsage(cpu, self._peak, self._peak_roots, len(self._last))


def run_measured(
    cmd: list[str], *, env: dict[str, str], marker: str | None, timeout_s: float, log: Path
) -> tuple[float, TreeUsage, int]:
    """Runs ``cmd`` to its end while sampling it and the cluster; (wall s, usage, exit code)."""
    sampler = ProcessSampler(marker=marker)
    with log.open("w") as out:
        started = time.perf_counter()
        with sampler:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            sampler.add_root(proc.pid)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        wall = time.perf_counter() - started
    return wall, sampler.usage(), code


def measured_backfill(
    cluster: Cluster, address: str, shards: Path, output: Path, name: str, log: Path, extra: Sequence[str] = ()
) -> tuple[float, TreeUsage, dict[str, Any]]:
    """`raypipe backfill` as a user runs it (plus `extra` flags) into a fresh `output`: the
    command's wall time, the cluster's usage while it ran, and the run report."""
    shutil.rmtree(output, ignore_errors=True)
    cmd = [sys.executable, "-m", "raypipe", "backfill", "--input", str(shards), "--output", str(output)]
    cmd += ["--service", address, "--run-id", name, *extra]
    wall, usage, code = run_measured(cmd, env=cluster.env, marker=cluster.marker, timeout_s=1800, log=log)
    report_path = output / "runs" / f"{name}.json"
    if code != 0 or not report_path.exists():
        raise RuntimeError(f"raypipe backfill {name} failed (exit {code}); see {log}")
    return wall, usage, json.loads(report_path.read_text())


class Cluster:
    """``ray start --head --num-cpus N`` on private ports, stopped (``--force``) on exit: the
    cluster `raypipe serve --detach` starts where there is none (`LOCAL_CLUSTER_FLAGS`: no
    dashboard or log monitor; `FAST_START_ENV`), unless `lean` is False (Ray's defaults)."""

    def __init__(self, *, num_cpus: int = 2, env: dict[str, str] | None = None, logs: Path, lean: bool = True) -> None:
        self.num_cpus = num_cpus
        self.lean = lean
        self.env = with_fast_start(bench_env(env)) if lean else bench_env(env)
        self.logs = logs
        self.marker = TEMP_DIR

    @staticmethod
    def marker_of() -> str:
        """What every process of a bench cluster has in its command line."""
        return TEMP_DIR

    def _ray(self, *args: str, check: bool = True) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        with (self.logs / "ray-cli.log").open("a") as out:
            subprocess.run([ray, *args], env=self.env, check=check, stdout=out, stderr=subprocess.STDOUT, timeout=180)

    def __enter__(self) -> Cluster:
        self.logs.mkdir(parents=True, exist_ok=True)
        ensure_ray_token(self.env)
        self._ray("stop", "--force", check=False)
        self._ray(
            "start",
            "--head",
            f"--num-cpus={self.num_cpus}",
            f"--port={RAY_PORT}",
            f"--dashboard-port={DASHBOARD_PORT}",
            f"--temp-dir={TEMP_DIR}",
            "--disable-usage-stats",
            *(LOCAL_CLUSTER_FLAGS if self.lean else ()),
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self._ray("stop", "--force", check=False)

    def serve(
        self,
        model_dir: Path,
        *,
        app: str = "raypipe",
        settings: dict[str, Any] | None = None,
        num_cpus: float | None = None,
    ) -> str:
        """``raypipe serve --model DIR --detach`` (CLI defaults unless given); returns host:port."""
        cmd = [
            sys.executable,
            "-m",
            "raypipe",
            "serve",
            "--model",
            str(model_dir),
            "--grpc-port",
            str(GRPC_PORT),
            "--http-port",
            str(HTTP_PORT),
            "--app-name",
            app,
            "--detach",
        ]
        if num_cpus is not None:
            cmd += ["--num-cpus", str(num_cpus)]
        if settings:
            path = self.logs / f"settings-{app}.json"  # JSON is YAML
            path.write_text(json.dumps(settings))
            cmd += ["--settings", str(path)]
        with (self.logs / f"serve-{app}.log").open("w") as out:
            subprocess.run(cmd, env=self.env, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        return f"127.0.0.1:{GRPC_PORT}"

    def delete_app(self, app: str) -> None:
        code = f"import ray; from ray import serve; ray.init(address='auto'); serve.delete({app!r})"
        subprocess.run([sys.executable, "-c", code], env=self.env, check=True, capture_output=True, timeout=120)

    def replica_stats(self, app: str) -> dict[str, Any] | None:
        """The replica's own `stats()` (calls, paragraphs, and token counts if it keeps them)."""
        code = (
            "import json, ray; from ray import serve; ray.init(address='auto', logging_level='ERROR');"
            f"print('STATS' + json.dumps(serve.get_app_handle({app!r}).stats.remote().result(timeout_s=30)))"
        )
        done = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
        for line in done.stdout.splitlines():
            if line.startswith("STATS"):
                return dict(json.loads(line[5:]))
        return None


@contextlib.contextmanager
def heavy_lock(path: str | None) -> Iterator[None]:
    """Holds an exclusive flock on ``path`` (shared machines), or nothing when None."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class Node:
    name: str
    temp_dir: Path
    num_cpus: float
    resources: dict[str, float]
    node_id: str | None = None


class LocalNodes:
    """Several Ray nodes on this host, as a Kubernetes pool runs them: a head with no CPUs
    (nothing is scheduled there but Serve's controller and the drivers), and worker nodes
    added by ``ray start --address`` with their own temp dirs, CPUs and custom resources.

    Each node's processes carry its temp dir in their command lines, so `kill_node` can take
    one node away (its raylet and every process it started, SIGKILL, as a reclaimed VM) while
    the others run on. Leaving the block kills every node's processes the same way, and only
    them: another Ray cluster on the host (a test session's) runs on untouched.
    """

    def __init__(
        self,
        root: Path,
        *,
        port: int,
        dashboard_port: int,
        env: dict[str, str],
        head_cpus: float = 0,
        object_store_mb: int = 300,
        multi_node: bool = True,
        start_args: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.port = port
        self.dashboard_port = dashboard_port
        # Several nodes behind one loopback address: Ray refuses a multi-node cluster on a host it
        # thinks is a laptop unless told, and every node binds 127.0.0.1 explicitly. A single
        # node keeps the caller's setting.
        # Ray's connect retries as on the clusters raypipe starts (`raypipe.run.driver.FAST_START_ENV`).
        env = with_fast_start(env)
        self.env = {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"} if multi_node else env
        self.head_cpus = head_cpus
        self.object_store_mb = object_store_mb
        self.start_args = start_args
        """More `ray start` flags for every node."""
        self.nodes: dict[str, Node] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _ray(self, *args: str, log: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        done = subprocess.run([ray, *args], env=self.env, capture_output=True, text=True, timeout=180)
        (self.root / f"{log}.log").write_text(done.stdout + done.stderr)
        if check and done.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed: {(done.stdout + done.stderr)[-2000:]}")
        return done

    def _start(self, name: str, num_cpus: float, resources: dict[str, float], head: bool) -> Node:
        temp_dir = self.root / name
        temp_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "start",
            *(("--head", f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
               # Ray Client's server: a process of its own that `ray start --head` leaves beside the
               # raylet, on 10001 unless told (clusters side by side would contend for it).
               f"--ray-client-server-port={free_port()}")
              if head else (f"--address={self.address}",)),
            "--node-ip-address=127.0.0.1",
            # Fixed defaults (the agent's HTTP port 52365, the metrics port) would collide between
            # nodes of one host: the second node's agent could not bind, and a head without its
            # agent takes no `ray job submit` ("No available agent to submit job").
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--num-cpus={num_cpus:g}",
            f"--object-store-memory={self.object_store_mb * 2**20}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            *self.start_args,
        ]  # fmt: skip
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        self._ray(*args, log=f"start-{name}")
        node = Node(name, temp_dir, num_cpus, resources)
        node.node_id = self._node_id(temp_dir)
        self.nodes[name] = node
        return node

    @staticmethod
    def _raylet(temp_dir: Path) -> psutil.Process | None:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if cmd and cmd[0].endswith("raylet") and f"--temp_dir={temp_dir}" in cmd:
                return p
        return None

    def _node_id(self, temp_dir: Path) -> str | None:
        raylet = self._raylet(temp_dir)
        for arg in raylet.cmdline() if raylet else []:
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
        return None

    def __enter__(self) -> LocalNodes:
        self.root.mkdir(parents=True, exist_ok=True)
        ensure_ray_token(self.env)
        self._kill_marked(str(self.root))  # leftovers of an earlier run in the same root
        self._start("head", self.head_cpus, {}, head=True)
        return self

    @staticmethod
    def _kill_marked(marker: str, *, whole_arg: bool = False) -> int:
        """Kills every process with `marker` in an argument (`whole_arg`: as an argument), and
        a marked raylet's children."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if marker in cmd if whole_arg else any(marker in arg for arg in cmd):
                found[p.pid] = p
                if cmd[0].endswith("raylet"):
                    with contextlib.suppress(psutil.Error):
                        for child in p.children(recursive=True):
                            found[child.pid] = child
        found.pop(os.getpid(), None)
        for p in found.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(list(found.values()), timeout=10)
        return len(found)

    def add_node(self, name: str, *, num_cpus: float, resources: dict[str, float] | None = None) -> Node:
        return self._start(name, num_cpus, dict(resources or {}), head=False)

    def kill_node(self, name: str) -> int:
        """SIGKILLs every process of the node (its raylet's tree and whatever names its temp
        dir) at once; returns how many there were."""
        return self._kill_marked(f"{self.nodes.pop(name).temp_dir}/")

    def __exit__(self, *exc: object) -> None:
        self._kill_marked(str(self.root))
        # Ray Client's server names neither the temp dir nor a raylet as its parent: it names the
        # GCS. Left alone, it outlived every test cluster.
        self._kill_marked(f"--address={self.address}", whole_arg=True)


def watch_replicas(app: str, interval_s: float, out: Any) -> None:
    """Prints one JSON line per `interval_s`: seconds since start and the node of every alive
    replica of `app` (run as ``python -m bench.cluster watch APP``, RAY_ADDRESS set)."""
    import ray
    from ray.util.state import list_actors

    ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    prefix = f"ServeReplica:{app}:"
    t0 = time.monotonic()
    while True:
        try:
            alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000, raise_on_missing_output=False)
            nodes = sorted(str(a.node_id) for a in alive if (a.class_name or "").startswith(prefix))
            out.write(json.dumps({"t": round(time.monotonic() - t0, 2), "replicas": nodes}) + "\n")
            out.flush()
        except Exception as e:
            out.write(json.dumps({"t": round(time.monotonic() - t0, 2), "error": str(e)[:200]}) + "\n")
            out.flush()
        time.sleep(interval_s)


class ReplicaWatch:
    """`watch_replicas` in its own process for the span of a `with` block; `.samples` after."""

    def __init__(self, app: str, *, env: dict[str, str], log: Path, interval_s: float = 1.0) -> None:
        self.app, self.env, self.log, self.interval_s = app, env, log, interval_s
        self.samples: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def __enter__(self) -> ReplicaWatch:
        cmd = [sys.executable, "-m", "bench.cluster", "watch", self.app, str(self.interval_s)]
        self._file = self.log.open("w")
        self.started = time.monotonic()
        self._proc = subprocess.Popen(cmd, env=self.env, stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def read(self) -> list[dict[str, Any]]:
        """The samples so far, with `t` on the clock of `time.monotonic() - self.started`, roughly."""
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._file.close()
        self.samples = self.read()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "watch":
        watch_replicas(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 1.0, sys.stdout)
