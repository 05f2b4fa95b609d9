"""What a run cost: the CPU every process of the cluster spent while it ran, and the model's share.

`CpuMeter.start()` (before the run's first unit) and `CpuMeter.finish()` (after its last) each
take a *sweep*: on every alive node of the Ray cluster, a zero-CPU task pinned to that node
reads the CPU time (user + system, psutil) of every process of the Ray session there — the
processes whose command line names the session directory (GCS, raylet, dashboard, monitors)
and all their descendants (workers: read tasks, inference actors, Serve's proxy, controller and
replicas) — plus the driver itself. The difference between the sweeps, per process and summed,
is the run's CPU; processes are grouped by their title (`group_of`) so the bench can say where
it went. Only nodes in both sweeps count, and a sweep waits at most `SWEEP_WAIT_S` for a node
(one lost a moment ago never answers). A worker that ended between the sweeps is counted
through its parent, which reaped it (its children's CPU time grows by the worker's whole
life; what the worker had spent before the first sweep is taken off): group ``ended
workers``. The second sweep is taken when the run's last unit is in (`CpuMeter.stop`),
before Ray Data tears its actors down. The driver's own node is swept by the driver itself: a
task there would wait most of a second for a worker to start (idle ones are soon stopped), twice
on the path of every run, and that worker's start would count as the run's. On a cluster shared
with other jobs their CPU counts too: the figure is the cluster's cost over the run, which is
what a bill is.

The model's share comes from the replicas themselves: each answer carries the core-seconds of
the forward passes it took part in (`protos.wire.TIMING_KEYS["model_cpu_s"]`), which the actors
sum per unit. `Cost` turns both into CPU-seconds per 1,000 paragraphs and a price per million
paragraphs at the configured price of a core-hour.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Cost", "CpuMeter", "group_of", "sweep_node"]

logger = logging.getLogger(__name__)

# Process titles -> the groups the bench and the report name (first match wins).
_GROUPS: tuple[tuple[str, str], ...] = (
    ("ServeReplica", "serve replica"),
    ("ProxyActor", "serve proxy"),
    ("ServeController", "serve controller"),
    ("InferenceActor", "inference actors"),
    ("MapWorker", "inference actors"),
    ("Read", "read tasks"),
    ("ray::IDLE", "idle workers"),
    ("_StatsActor", "ray data"),
    ("SplitCoordinator", "ray data"),
    ("AutoscalingRequester", "ray data"),
    ("_AutoscalingCoordinatorActor", "ray data"),
    ("ActorLocationTracker", "ray data"),
    ("_UsageCollectionActor", "ray data"),
    ("gcs_server", "ray gcs"),
    ("raylet", "ray raylet"),
    ("dashboard", "ray dashboard and agents"),
    ("DashboardAgent", "ray dashboard and agents"),
    ("RuntimeEnvAgent", "ray dashboard and agents"),
    ("ray-dashboard", "ray dashboard and agents"),
    ("agent.py", "ray dashboard and agents"),
    # A worker process before it took its first task or actor (and its title): Python starting,
    # importing Ray and the task's modules.
    ("default_worker.py", "workers starting"),
    ("log_monitor.py", "ray log monitor"),
)


def group_of(title: str) -> str:
    """The group of a process with this title (Ray sets a worker's title to its task or actor;
    `process_title` names other Python processes by their script)."""
    for needle, group in _GROUPS:
        if needle in title:
            return group
    return "ray system" if title else "other"


def process_title(cmdline: list[str], name: str = "") -> str:
    """What `group_of` reads: the first word of the command line (Ray's title for its workers,
    ``ray::ServeReplica:...``), or for a Python process not titled, the script or module it runs
    (``python default_worker.py``, ``python -m ray.util.client.server``)."""
    if not cmdline:
        return name
    head = cmdline[0]
    if os.path.basename(head).startswith("python"):
        for i, arg in enumerate(cmdline[1:], start=1):
            if arg == "-m" and i + 1 < len(cmdline):
                return f"python -m {cmdline[i + 1]}"
            if arg.endswith(".py"):
                return f"python {os.path.basename(arg)}"
    return head


def sweep_node(extra_pids: tuple[int, ...] = (), *, session: str = "") -> dict[str, Any]:
    """CPU seconds of every process of this node's Ray session, by pid (run on the node).

    The session is `session` (its directory's name) if given, else the one whose raylet started
    the calling worker (its parent)."""
    import psutil

    me = psutil.Process()
    raylet = None if session else me.parent()
    if raylet is not None:
        for arg in raylet.cmdline():
            if "session_" in arg:
                part = next((p for p in arg.split("/") if p.startswith("session_")), "")
                if part:
                    session = part
                    break
    roots: list[psutil.Process] = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if session and any(session in a for a in cmdline):
            roots.append(proc)
    seen: dict[int, psutil.Process] = {}
    for root in roots:
        seen[root.pid] = root
        try:
            for child in root.children(recursive=True):
                seen[child.pid] = child
        except psutil.Error:
            continue
    for pid in extra_pids:
        if pid not in seen:
            try:
                seen[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
    out: dict[str, Any] = {}
    for pid, proc in seen.items():
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                title = process_title(proc.cmdline(), proc.name())
                children = times.children_user + times.children_system
                out[f"{pid}:{int(proc.create_time())}"] = (times.user + times.system, children, title)
        except psutil.Error:
            continue
    return {"node": os.uname().nodename, "session": session, "processes": out}


@dataclass
class Cost:
    """What a run cost (`raypipe.report.RunReport.cost`)."""

    cpu_s: float
    """CPU seconds of every process of the cluster's Ray session and the driver, over the run."""
    paragraphs: int
    """Paragraphs this attempt processed (the cost's denominator)."""
    model_cpu_s: float
    """Core-seconds the replicas spent in forward passes for this run's calls."""
    core_hour_usd: float
    wall_s: float
    nodes: int
    groups: dict[str, float] = field(default_factory=dict)
    """CPU seconds by process group (`group_of`), and ``driver``."""

    @property
    def cpu_s_per_1k(self) -> float:
        return 1000 * self.cpu_s / self.paragraphs if self.paragraphs else 0.0

    @property
    def model_share(self) -> float:
        return min(1.0, self.model_cpu_s / self.cpu_s) if self.cpu_s else 0.0

    @property
    def usd_per_million(self) -> float:
        return self.cpu_s_per_1k * 1000 / 3600 * self.core_hour_usd

    @property
    def cores_busy(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            cpu_s_per_1k=round(self.cpu_s_per_1k, 3),
            model_share=round(self.model_share, 4),
            usd_per_million=round(self.usd_per_million, 4),
            cores_busy=round(self.cores_busy, 3),
        )
        return d


class CpuMeter:
    """Two sweeps of the cluster's processes, around a run (module docstring)."""

    def __init__(
        self,
        before: list[dict[str, Any]],
        *,
        sweep: Callable[[], list[dict[str, Any]]],
        clock: Callable[[], float],
        driver_cpu: Callable[[], float],
    ) -> None:
        self._before = before
        self._sweep = sweep
        self._clock = clock
        self._driver_cpu = driver_cpu
        self._started = clock()
        self._driver_started = driver_cpu()
        self._after: list[dict[str, Any]] | None = None
        self._stopped: float | None = None
        self._driver_stopped: float | None = None

    @classmethod
    def start(
        cls,
        *,
        sweep: Callable[[], list[dict[str, Any]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        driver_cpu: Callable[[], float] | None = None,
    ) -> CpuMeter | None:
        """The first sweep; None (logged) when the cluster cannot be swept. ``sweep``, ``clock``
        and ``driver_cpu`` are seams for tests (default: every alive node, monotonic, this process)."""
        sweep = sweep or _sweep_cluster
        try:
            before = sweep()
        except Exception as e:  # a cost figure is never worth failing a run for
            logger.warning("the run's cost will not be measured: %s", e)
            return None
        return cls(before, sweep=sweep, clock=clock, driver_cpu=driver_cpu or _driver_cpu)

    def stop(self) -> None:
        """The second sweep, now (the run's last unit is in; its workers still run)."""
        try:
            self._after = self._sweep()
        except Exception as e:
            logger.warning("the run's cost could not be measured at its end: %s", e)
            self._after = []
        self._stopped, self._driver_stopped = self._clock(), self._driver_cpu()

    def finish(self, *, paragraphs: int, model_cpu_s: float, core_hour_usd: float) -> Cost | None:
        """The cost between the sweeps (`stop` now unless it ran); None when a sweep failed."""
        if self._after is None:
            self.stop()
        after = self._after
        if not after:
            return None
        assert self._stopped is not None and self._driver_stopped is not None
        wall = self._stopped - self._started
        groups: defaultdict[str, float] = defaultdict(float)
        # Nodes in both sweeps (a node that missed one, or joined between them, would count a
        # whole life, or nothing to subtract from).
        both = {n["node"] for n in self._before} & {n["node"] for n in after}
        after = [n for n in after if n["node"] in both]
        before = {(n["node"], k): v for n in self._before for k, v in n["processes"].items()}
        alive = {(n["node"], k) for n in after for k in n["processes"]}
        own, here = f"{os.getpid()}:", os.uname().nodename
        ended = 0.0
        for node in after:
            for key, entry in node["processes"].items():
                cpu, children, title = _entry(entry)
                was_cpu, was_children, _ = _entry(before.get((node["node"], key), (0.0, 0.0, "")))
                # A worker that ended was reaped by its parent: its whole life moved into the
                # parent's children time.
                ended += max(0.0, children - was_children)
                if node["node"] == here and key.startswith(own):
                    continue  # the driver is counted once, below
                spent = cpu - was_cpu
                if spent > 0:
                    groups[group_of(title)] += spent
        # ... less what such workers had spent before the first sweep (counted there already).
        swept = {n["node"] for n in after}
        ended -= sum(_entry(v)[0] for k, v in before.items() if k not in alive and k[0] in swept)
        if ended > 0:
            groups["ended workers"] += ended
        # The driver, once (it is in the sweep too when it runs as a job on a cluster node).
        driver = self._driver_stopped - self._driver_started
        if driver > 0:
            groups["driver"] += driver
        total = sum(groups.values())
        return Cost(
            cpu_s=round(total, 3),
            paragraphs=paragraphs,
            model_cpu_s=round(model_cpu_s, 3),
            core_hour_usd=core_hour_usd,
            wall_s=round(wall, 3),
            nodes=len(after),
            groups={k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        )


def _entry(entry: Any) -> tuple[float, float, str]:
    """(own CPU, reaped children's CPU, title) of a sweep's entry (older sweeps had no children)."""
    if len(entry) == 2:
        return float(entry[0]), 0.0, str(entry[1])
    return float(entry[0]), float(entry[1]), str(entry[2])


#: Longest a sweep waits for a node's answer (a node that died a moment ago answers never).
SWEEP_WAIT_S = 10.0


def _driver_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _sweep_cluster() -> list[dict[str, Any]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    sweep = ray.remote(num_cpus=0, max_retries=0)(sweep_node)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise RuntimeError("no alive node")
    here = _driver_node(nodes)
    refs = [
        sweep.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        for node_id in nodes
        if here is None or node_id != here[0]
    ]
    local = [sweep_node(session=here[1])] if here is not None else []
    if not refs:
        return local
    # A node lost a moment ago may still be listed alive: never wait on it for long. The nodes
    # that answer are the sweep (a node missing from one sweep is left out of the difference).
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=SWEEP_WAIT_S)
    for ref in late:
        ray.cancel(ref, force=True)
    if not ready and not local:
        raise RuntimeError(f"no node answered the CPU sweep within {SWEEP_WAIT_S:g} s")
    return local + list(ray.get(ready))


def _driver_node(nodes: list[str]) -> tuple[str, str] | None:
    """(node id, session name) of the node this driver runs on, if it is one of `nodes` and
    its session is known; None for a driver off the cluster (a Ray Client driver, say)."""
    import ray
    from ray._private import worker  # Ray has no public accessor of the session's name

    try:
        node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # a driver Ray cannot place (Ray Client): every node is swept by a task
        return None
    session = getattr(getattr(worker, "_global_node", None), "session_name", None)
    if not session or node_id not in nodes:
        return None
    return node_id, str(session)
