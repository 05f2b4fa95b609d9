"""Secure by default, on real parts: the README's `raypipe serve --detach` with nothing set (no
RAY_AUTH_MODE, no token anywhere, HOME a fresh folder) starts a cluster with token auth that
refuses a client without its token, and a model service on loopback that answers only calls
carrying its credential and refuses messages over its bound.

The cluster is this test's own (its temp dir `RAY_TMPDIR`, its processes killed by that mark at
the end): `ray stop` would stop every cluster on the machine.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from bench.tcp_proxy import free_port
from protos.credential import bearer
from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc
from protos.wire import APPLICATION_KEY, MAX_MESSAGE_BYTES

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

#: Variables the test session sets that a user's shell does not (tests/conftest.py, the fixtures).
_SESSION_ONLY = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAYPIPE_SERVICE_TOKEN")


def _kill_marked(marker: str) -> None:
    from bench.cluster import LocalNodes

    LocalNodes._kill_marked(marker)


@pytest.fixture()
def fresh_user(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A user's environment: a new HOME, none of the session's Ray settings, and a temp dir of the
    cluster's own (short: Ray's socket paths must fit in 107 bytes)."""
    root = Path(f"/tmp/rps-{os.getpid()}")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _SESSION_ONLY}
    env.update(HOME=str(home), RAY_TMPDIR=str(root))
    try:
        yield env
    finally:
        _kill_marked(str(root))
        shutil.rmtree(root, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def _loopback(ip: str) -> bool:
    """127.0.0.1, also as gRPC's dual-stack socket shows it (::ffff:127.0.0.1); never :: or 0.0.0.0."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_serve_detach_starts_a_closed_cluster_and_an_authenticated_local_service(
    fresh_user: dict[str, str], demo_model_dir: Path
) -> None:
    env = fresh_user
    home = Path(env["HOME"])
    port = free_port()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "raypipe", "serve", "--model", str(demo_model_dir), "--detach"),
            *("--grpc-port", str(port), "--http-port", str(free_port()), "--num-cpus", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started a local Ray cluster" in done.stdout

    # The cluster: token auth on, its token private.
    ray_token = home / ".ray" / "auth_token"
    assert _mode(ray_token) == 0o600
    stranger = {**env, "HOME": str(home.parent / "stranger")}  # same machine, without the token
    Path(stranger["HOME"]).mkdir()
    probe = "import ray; ray.init(address='auto', logging_level='ERROR'); print('JOINED')"
    refused = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, env=stranger, cwd=REPO
    )
    assert refused.returncode != 0 and "JOINED" not in refused.stdout, refused.stdout + refused.stderr
    assert "auth" in (refused.stdout + refused.stderr).lower()
    joined = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, env=env, cwd=REPO
    )
    assert "JOINED" in joined.stdout, joined.stderr

    # The service: on loopback only, its token private, the credential checked.
    listening = _listening(port)
    assert listening and all(_loopback(ip) for ip in listening), f"the gRPC proxy listens on {listening}"
    service_token = home / ".raypipe" / "service-token"
    assert _mode(service_token) == 0o600
    token = service_token.read_text().strip()
    request = emotion_pb2.ClassifyRequest(ids=["a"], texts=["what a lovely day"])
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)
        app = (APPLICATION_KEY, "raypipe")
        with pytest.raises(grpc.RpcError) as no_token:
            stub.Classify(request, metadata=[app], timeout=60)
        assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            stub.Classify(request, metadata=[app, bearer("not-the-token")], timeout=60)
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.Classify(request, metadata=[app, bearer(token)], timeout=60)
        assert len(answer.truncated) == 1 and answer.labels
        big = emotion_pb2.ClassifyRequest(ids=["a"], texts=["x" * (MAX_MESSAGE_BYTES + 1)])
        with pytest.raises(grpc.RpcError) as too_big:
            stub.Classify(big, metadata=[app, bearer(token)], timeout=60)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # raypipe's own client reads the same file and is let in.
    check = (
        "from raypipe.call.client import check_service; "
        f"print(check_service('127.0.0.1:{port}', timeout_s=30).model_version)"
    )
    ok = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
