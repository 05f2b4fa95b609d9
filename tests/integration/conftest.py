"""Session fixtures for integration tests: real parts, started once, on 127.0.0.1 only.

- `s3`: moto's S3 server (its own process) on a free loopback port; the AWS_* environment points at it, so
  s3fs (driver, Ray workers, `ray job submit` entrypoints) reaches it with no code change.
- `ray_cluster`: `ray start --head` with token authentication on (as production runs),
  its workers inheriting the S3 environment; the test process connects as a driver.
- `serve_address`: Serve's gRPC proxy and the EmotionClassifier app with the demo model, sized as
  `raypipe serve` sizes it with no flag (one replica with every CPU but 0.5): the suite runs what
  users run. Tests needing other server settings (fault injection, small capacity) deploy their
  own application next to it through `deploy_app` and remove it afterwards; that needs CPUs the
  default replica does not leave, so `room_beside_session_app` shrinks it for their module.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.tcp_proxy import free_port

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks set here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the integration tests, and puts them in `make test`'s lanes (`side_lane`, `second_lane`).

    `make test` runs three integration lanes side by side, each in its own pytest process with its
    own session cluster when a test of it needs one: so the waits of one lane (a lost node's
    detection, autoscaling, a lease running out) overlap the runs of the others. The side lane
    holds the tests that need no session cluster or start their own (multi-node pools, S3-only
    fencing, in-process models). Its process never joins a cluster itself: with a session cluster
    joined there, the multi-node tests' state-API lookups found no inference actor and failed. The
    second lane holds the session-cluster tests of `SECOND_LANE_MODULES`; the main lane the rest."""
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if "ray_cluster" not in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.side_lane)
            elif Path(str(item.fspath)).name in SECOND_LANE_MODULES:
                item.add_marker(pytest.mark.second_lane)


#: Modules whose session-cluster tests run in `make test`'s second lane, a pytest process with a
#: session cluster of its own beside the main lane's: the fault modules (killed runs, broken
#: services and deadline storms, which wait on leases, backoffs and breakers much of the time) and
#: the notebooks (a Jupyter kernel each), moved here to shorten the main lane. Without the
#: local-cluster job-submit test the main lane has become the shorter one: in fresh-clone runs
#: this lane ends about a minute after it.
SECOND_LANE_MODULES = frozenset({"test_hardening.py", "test_resilience.py", "test_notebooks.py"})


@dataclass(frozen=True)
class S3:
    endpoint: str
    env: dict[str, str]

    def fs(self):  # a fresh s3fs filesystem against the endpoint
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing", skip_instance_cache=True)

    def bucket(self, name: str) -> str:
        fs = self.fs()
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    from bench.s3server import MotoServer

    server = MotoServer().start()
    endpoint = server.endpoint
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    yield S3(endpoint, env)
    patch.undo()
    server.stop()


@dataclass(frozen=True)
class Cluster:
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]
    """What a client process needs: the token-auth and S3 settings."""


#: Root of the session cluster's temp dirs: short (Ray's socket paths must fit in 107 bytes), and
#: named by the test process, whose cluster's processes carry it in their command lines.
CLUSTER_ROOT = "/tmp/rpt-"


def _stop_orphaned_clusters() -> None:
    """Kills the session clusters of test processes that are gone (killed before their teardown).
    Only those: clusters of live test processes (the other lane's) and of users run on."""
    import shutil

    from bench.cluster import LocalNodes

    for root in Path("/tmp").glob(f"{Path(CLUSTER_ROOT).name}*"):
        owner = root.name.removeprefix(Path(CLUSTER_ROOT).name)
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            LocalNodes._kill_marked(f"{root}/")
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(s3: S3) -> Iterator[Cluster]:
    """One head node (8 logical CPUs) in its own temp dir, torn down by killing its processes:
    `ray stop --force` would also stop the clusters the other lane's tests start beside it."""
    import shutil

    import ray

    from bench.cluster import LocalNodes

    # tests/conftest.py put the token-auth and loopback settings in the environment.
    keys = (
        "RAY_AUTH_MODE",
        "RAY_AUTH_TOKEN_PATH",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        "RAY_USAGE_STATS_ENABLED",
        "HF_HUB_OFFLINE",
        "TF_CPP_MIN_LOG_LEVEL",
    )
    env = {**s3.env, **{k: os.environ[k] for k in keys}}
    # As in an activated virtualenv (or a container image): `python` in a job entrypoint is ours.
    env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    _stop_orphaned_clusters()
    root = Path(f"{CLUSTER_ROOT}{os.getpid()}")
    nodes = LocalNodes(
        root,
        port=free_port(),
        dashboard_port=free_port(),
        env={**os.environ, **env},
        head_cpus=8,  # logical: replicas and actors are mostly waiting, the 2 cores are shared
        object_store_mb=1024,
        multi_node=False,
        # No test reads worker logs through the driver (log_to_driver is off everywhere): the log
        # monitor would only tail every worker's log, a few percent of a core all session.
        start_args=("--include-log-monitor=false",),
    )
    patch = pytest.MonkeyPatch()
    try:
        with nodes:
            env["RAY_ADDRESS"] = nodes.address  # a CLI a test starts joins this cluster, never another
            for key, value in env.items():
                patch.setenv(key, value)
            ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False)
            from ray.data import DataContext

            DataContext.get_current().enable_progress_bars = False
            try:
                yield Cluster(nodes.address, nodes.dashboard_url, env)
            finally:
                try:
                    from ray import serve

                    serve.shutdown()
                finally:
                    ray.shutdown()
    finally:
        patch.undo()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def grpc_port() -> int:
    return free_port()


#: The session's application, shared by the tests that need no server settings of their own.
SESSION_APP = "raypipe"

#: CPUs the session app keeps while a module deploys applications beside it or runs attempts side
#: by side (`room_beside_session_app`): the size it had before the suite served the defaults.
ROOMY_CPUS = 1.0


def default_options():
    """What `raypipe serve` deploys on the connected cluster with no sizing flag (`size_replicas`)."""
    import ray

    from serve_app.deploy import DeploymentOptions, pool_nodes, size_replicas

    replicas, cpus, _ = size_replicas(pool_nodes(ray.nodes()), ray.cluster_resources().get("CPU", 1.0))
    return DeploymentOptions(num_replicas=replicas, num_cpus=cpus)


@pytest.fixture(scope="session")
def serve_address(ray_cluster: Cluster, demo_model_dir: Path, grpc_port: int) -> str:
    from serve_app.deploy import deploy

    return deploy(
        demo_model_dir, app_name=SESSION_APP, grpc_port=grpc_port, http_port=free_port(), options=default_options()
    )


#: The module the session app is shrunk for (`room_beside_session_app`), None while it has the
#: default sizing. Each change of sizing is a redeploy (a new replica loading the model): the
#: default comes back when a test of another module needs the session app, not at each module's
#: end, so modules that shrink it one after another share one shrunk app.
_shrunk_for: dict[str, object] = {"module": None}


@pytest.fixture(scope="module")
def room_beside_session_app(
    request: pytest.FixtureRequest, serve_address: str, demo_model_dir: Path, grpc_port: int
) -> Iterator[None]:
    """The session app at `ROOMY_CPUS` for a module whose tests need CPUs beside it; the default
    sizing comes back before the next test of another module that uses the session app without
    this (`default_sizing_outside_roomy_modules`). The default replica leaves 0.5 CPU of the node:
    one run's actor and its reads fit there, but another replica (`deploy_app`, a notebook's or a
    test's own application) or a second run's actors side by side do not."""
    from ray import serve

    from serve_app.deploy import DeploymentOptions, deploy

    if _shrunk_for["module"] is None:
        deploy(
            demo_model_dir, app_name=SESSION_APP, grpc_port=grpc_port, options=DeploymentOptions(num_cpus=ROOMY_CPUS)
        )
    _shrunk_for["module"] = request.module
    yield
    # The module's applications were deleted without waiting: their CPUs come back once they are gone.
    wait_for(lambda: set(serve.status().applications) <= {SESSION_APP}, 120, "the module's applications to go")


@pytest.fixture(autouse=True)
def default_sizing_outside_roomy_modules(request: pytest.FixtureRequest) -> None:
    """A test of the session app outside the module it was shrunk for runs on the default sizing,
    as if every shrinking module had put it back at its end."""
    shrunk_for = _shrunk_for["module"]
    if shrunk_for is None or shrunk_for is request.module or "serve_address" not in request.fixturenames:
        return
    if "room_beside_session_app" in request.fixturenames:
        return  # a module that shrinks it too: the shrunk app is already there
    from serve_app.deploy import deploy

    demo_model_dir, grpc_port = request.getfixturevalue("demo_model_dir"), request.getfixturevalue("grpc_port")
    deploy(demo_model_dir, app_name=SESSION_APP, grpc_port=grpc_port, options=default_options())
    _shrunk_for["module"] = None


@pytest.fixture
def deploy_app(
    serve_address: str, room_beside_session_app: None, demo_model_dir: Path, grpc_port: int
) -> Iterator[Callable[..., str]]:
    """Deploys an extra application on the shared proxy; returns its name. Removed afterwards.
    Its module runs beside a session app shrunk to make room (`room_beside_session_app`)."""
    from ray import serve

    from serve_app.deploy import deploy

    names: list[str] = []

    def _deploy(name: str, settings=None, options=None) -> str:
        # An earlier test's app of the same name may still be going (deleted without waiting).
        wait_for(lambda: name not in serve.status().applications, 60, f"the earlier {name!r} app to go")
        deploy(demo_model_dir, app_name=name, grpc_port=grpc_port, settings=settings, options=options)
        names.append(name)
        return name

    yield _deploy
    for name in names:
        serve.delete(name, _blocking=False)  # its replica goes while the next test starts


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.2)
