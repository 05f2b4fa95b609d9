"""The driver process around a run: Ray joined quietly, SIGTERM as a stop, native noise off stderr.

A run's steps (`raypipe.run.steps`) call `ensure_ray` where they first need the cluster;
`raypipe.run.modes` wraps each run in `quiet` and `sigterm_stops_the_run`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.errors import RunStopped

if TYPE_CHECKING:
    from raypipe.report import RunReport

__all__ = [
    "FAST_START_ENV",
    "LOCAL_CLUSTER_FLAGS",
    "ensure_cluster_token",
    "ensure_ray",
    "no_ray_data_usage_actor",
    "quiet",
    "quiet_ray_loggers",
    "sigterm_stops_the_run",
    "start_local_cluster",
    "start_local_ray",
    "start_ray_data_helpers",
    "with_fast_start",
]

logger = logging.getLogger("raypipe")


#: Ray's settings, as environment variables, for the clusters raypipe starts on the local machine
#: (`start_local_ray`, `start_local_cluster`); the environment's own values win. A raylet connects
#: to its object store, which it has just started on a thread of its own; when the store's socket
#: is not there yet, it tries again after `raylet_client_connect_timeout_milliseconds` (Ray's
#: default: 1,000 ms, 10 attempts). 8 of 19 local starts whose raylet log was read lost exactly
#: that second: `ray.init` of a new local cluster took 2.5-2.7 s or 3.6-3.7 s, and 2.5-2.7 s in 8
#: starts with these. 100 attempts 100 ms apart give up after as long as Ray's default does.
FAST_START_ENV = {
    "RAY_raylet_client_connect_timeout_milliseconds": "100",
    "RAY_raylet_client_num_connect_attempts": "100",
}


def with_fast_start(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with `FAST_START_ENV` where it does not set those variables itself."""
    return {**FAST_START_ENV, **environ}


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init` as raypipe's drivers want it: quiet, and the raypipe logging set up.

    Without RAY_ADDRESS, `ray.init` starts a local cluster with token authentication on (Ray's
    default, which raypipe keeps) and logs a WARNING that it did; that one line is dropped,
    any other (token authentication *disabled*, say) still shows.
    """
    import ray

    auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth_logger.addFilter(_drop_token_auth_enabled)
    on_sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    # A cluster `ray.init` starts takes its settings from this process's environment.
    for key, value in FAST_START_ENV.items():
        os.environ.setdefault(key, value)
    try:
        ray.init(**{"logging_level": logging.WARNING, "log_to_driver": False, **init_kwargs})
    finally:
        auth_logger.removeFilter(_drop_token_auth_enabled)
        if isinstance(on_sigterm, _StopOnSigterm):
            signal.signal(signal.SIGTERM, on_sigterm)  # `ray.init` sets its own (`sys.exit`); a run's stays
    _stop_autoscaler_monitor()
    quiet_ray_loggers()
    _say_if_open()


def _say_if_open() -> None:
    """One WARNING line where the cluster this process joined or started has no token auth."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if not is_token_auth_enabled():
        logger.warning(
            "this Ray cluster has no token authentication (RAY_AUTH_MODE=%s): anyone who reaches its ports can "
            "run code on it; start it with RAY_AUTH_MODE=token (docs/security.md)",
            os.environ.get("RAY_AUTH_MODE", "unset"),
        )


def _stop_autoscaler_monitor() -> None:
    """Stop the autoscaler monitor of a cluster `ray.init` just started in this process.

    It has nothing to scale (one local node, no autoscaling config), and at `ray.shutdown` Ray
    stops it after the GCS: its SIGTERM handler then reports its end to a GCS that is gone and
    is killed after a 1 s wait, on every exit of a demo, notebook or script (the run itself never
    needs it: Ray Data's resource requests only go to the GCS). Nothing to do when `ray.init`
    joined a running cluster: this process then owns no Ray process. Uses Ray's node object,
    which `ray.init` has no option for; a Ray without it leaves the monitor running.
    """
    import ray
    from ray._private.ray_constants import PROCESS_TYPE_MONITOR

    node = getattr(ray._private.worker, "_global_node", None)
    for info in getattr(node, "all_processes", {}).get(PROCESS_TYPE_MONITOR, []):
        process = info.process
        if process.poll() is None:
            process.kill()  # SIGKILL: its handler would report the stop as an autoscaler failure
            process.wait(timeout=5)


#: `ray start --head` flags of the local cluster `raypipe serve --detach` starts when there is none
#: to join. Neither the dashboard (and its modules) nor the log monitor serves a detached Serve app
#: and batch runs; on 2 cores, idle with the Serve app deployed, the cluster's background took 20%
#: of a core with them and 12.6% without (cores the model shares). `ray job submit` needs the
#: dashboard: start such a cluster with `ray start --head` yourself.
LOCAL_CLUSTER_FLAGS = ("--include-dashboard=false", "--include-log-monitor=false")


def ensure_cluster_token(environ: Mapping[str, str]) -> Path | None:
    """The token file a cluster started with `environ` uses, created (mode 0600, Ray's token
    format) when it does not exist, and made 0600 where others could read it; None where the
    token comes from ``RAY_AUTH_TOKEN`` itself.

    ``ray start`` creates a missing token with the process's umask (0644 on most machines),
    readable by every user of the machine; the token lets its holder run code on the cluster.
    """
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    if environ.get("RAY_AUTH_TOKEN"):
        return None
    configured = environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(configured) if configured else Path(environ.get("HOME") or Path.home()) / ".ray" / "auth_token"
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(generate_new_authentication_token())
        logger.info("created the Ray cluster's token file %s (mode 600)", path)
        return path
    if mode & 0o077:
        path.chmod(0o600)
        logger.warning("the Ray token file %s was readable by others (mode %o): made it 600", path, mode)
    return path


def start_local_cluster(*, timeout_s: float = 120.0) -> None:
    """``ray start --head`` with `LOCAL_CLUSTER_FLAGS`: a cluster on the local machine that outlives
    the calling process (``ray stop`` stops it). Raises `RuntimeError` with Ray's own words if it
    does not start within `timeout_s`.

    The cluster has token authentication (``RAY_AUTH_MODE=token``, its token file 0600:
    `ensure_cluster_token`) unless the environment sets ``RAY_AUTH_MODE`` itself; ``ray start``
    alone turns it on only where a token file already exists. An explicit
    ``RAY_AUTH_MODE=disabled`` is obeyed, with one WARNING line."""
    import subprocess
    import sys

    env = with_fast_start(os.environ)
    env.setdefault("RAY_AUTH_MODE", "token")
    if env["RAY_AUTH_MODE"].lower() == "token":
        ensure_cluster_token(env)
    else:
        logger.warning(
            "starting a Ray cluster without token authentication (RAY_AUTH_MODE=%s): anyone who reaches its "
            "ports can run code on it",
            env["RAY_AUTH_MODE"],
        )
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    cmd = [*ray_cli, "start", "--head", "--disable-usage-stats", *LOCAL_CLUSTER_FLAGS]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)  # noqa: S603  argv of Ray's CLI, no shell
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`ray start --head` did not finish within {timeout_s:g} s") from e
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`ray start --head` failed (exit {done.returncode}): {' / '.join(last)}")


class _StopOnSigterm:
    """The SIGTERM handler while a run is on: raises `RunStopped` in the driver, once."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            logger.warning("SIGTERM again: the run is already stopping (writing its report)")
            return
        self.stopping = True
        raise RunStopped("stopped by SIGTERM")


@contextlib.contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """SIGTERM (a deleted pod, `ray job stop`, a scheduler's deadline) stops the run as Ctrl-C
    would: `RunStopped` is raised where the driver is, so the run is aborted, writes its failed
    report (with the calls its actors tallied) and releases the output lease. A second SIGTERM
    while it does so is ignored. Only where Python delivers signals (the main thread); the
    previous handler is back once the run returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _StopOnSigterm())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _drop_token_auth_enabled(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_ray_loggers() -> None:
    """Serve's and Ray Data's INFO lines (execution plans, controller namespaces, per-operator
    progress every few seconds when stderr is no terminal) narrate their internals; raypipe's
    own progress line shows rows, rate, ETA and dead letters. Their warnings and errors stay."""
    from ray.data import DataContext

    for name in ("ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray Data warns once that its bars are off: not news here.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    DataContext.get_current().enable_progress_bars = False


def no_ray_data_usage_actor() -> None:
    """Ray Data's executions in this process record no usage (``RAY_DATA_USAGE_DISABLED=1``,
    unless the environment sets it). Where Ray's usage stats are on (its default, so in a user's
    shell), each execution otherwise sends its operator names to a fourth detached helper, the
    usage collection actor, which a cluster's first run starts, and a thread of the driver asks a
    Prometheus server on localhost every 10 s for the cluster's spills and worker kills. The
    actor's worker process cost a 3,000-paragraph first run 0.8 CPU-seconds to start (1.38 CPU-s
    per 1,000 paragraphs against 1.12 without it) and then about 5 ms of CPU a second for as long
    as the cluster lives, on the cores the model shares. Ray's own usage stats
    (``ray start --disable-usage-stats``, ``RAY_USAGE_STATS_ENABLED``) stay the cluster's choice."""
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")


def start_ray_data_helpers() -> None:
    """Start the cluster-wide helper actors Ray Data starts with a cluster's first dataset, so a
    first run does not: the stats actor and the autoscaling coordinator (with a one-row dataset,
    no map, so no task worker starts) and the actor-location tracker of actor pools. Each is
    detached and named, so it outlives this driver and every later run on the node finds it;
    started on a run's path, the three worker processes take about 0.9 s and 2 CPU-seconds of a
    2-core cluster's first run (measured by `bench/` as the first run's "ray data" cost group).

    The tracker's factory is Ray Data internal: where a Ray version moves it, the run starts
    it itself as before, and only the time is lost.
    """
    import ray

    no_ray_data_usage_actor()
    ray.data.from_items([{"x": 1}]).take_all()
    try:
        from ray.data._internal.execution.node_trackers.actor_location import (
            get_or_create_actor_location_tracker,
        )
    except ImportError:
        return
    ray.get(get_or_create_actor_location_tracker().get_actor_locations.remote([]))


def ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        start_local_ray()


def quiet(run: Callable[..., RunReport]) -> Callable[..., RunReport]:
    """Runs `run` with the known native noise off fd 2 (`protos.quiet`): also for notebook and
    script users of the API, whose cells would otherwise show Ray Data's actor-args ERROR."""

    @functools.wraps(run)
    def run_quietly(*args: Any, **kwargs: Any) -> RunReport:
        from protos.quiet import filtered_stderr

        with filtered_stderr():
            return run(*args, **kwargs)

    return run_quietly
