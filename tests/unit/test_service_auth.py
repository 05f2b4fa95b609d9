"""The model service's credential and address: the token file, the replica's check, the
client's metadata, the proxy's bind address and message bound, the local cluster's token. No Ray
cluster is started (the replica's class is driven without Serve)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import pytest

from protos.credential import (
    TOKEN_ENV,
    CredentialError,
    bearer,
    ensure_token,
    read_token,
    token_digest,
    token_matches,
)
from protos.raypipe.v1 import emotion_pb2
from protos.wire import MAX_MESSAGE_BYTES
from raypipe.call.channel import CHANNEL_OPTIONS, ChannelSecurity, auth_metadata
from raypipe.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_token_is_created_with_mode_600_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "token"
    token, created = ensure_token(path, environ={})
    assert created and len(token) >= 32
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert ensure_token(path, environ={}) == (token, False)
    assert read_token(path, environ={}) == token


def test_the_environment_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    assert ensure_token(path, environ={TOKEN_ENV: "from-env"}) == ("from-env", False)
    assert not path.exists()


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("abc")
    path.chmod(0o644)
    with pytest.raises(CredentialError, match=r"readable by others.*chmod 600"):
        read_token(path, environ={})


def test_the_digest_admits_only_its_token() -> None:
    digest = token_digest("s3cret")
    assert token_matches([("application", "x"), bearer("s3cret")], digest)
    assert not token_matches([bearer("wrong")], digest)
    assert not token_matches([("authorization", "s3cret")], digest)
    assert not token_matches([], digest)


def test_the_client_sends_the_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = tmp_path / "token"
    token, _ = ensure_token(path, environ={})
    assert auth_metadata(ChannelSecurity(token_file=str(path))) == (("authorization", f"Bearer {token}"),)
    with pytest.raises(ConfigError, match="does not exist"):
        auth_metadata(ChannelSecurity(token_file=str(tmp_path / "missing")))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        auth_metadata(ChannelSecurity(token_file=str(path)))


def test_without_a_token_file_the_default_one_is_sent_when_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth_metadata(ChannelSecurity()) == ()
    token, _ = ensure_token(None)
    assert (tmp_path / ".raypipe" / "service-token").exists()
    assert auth_metadata(ChannelSecurity()) == (("authorization", f"Bearer {token}"),)


def test_the_client_channel_refuses_messages_over_the_bound() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    assert MAX_MESSAGE_BYTES <= 64 * 2**20


class _Context:
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class _NoModel:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the model was touched ({name}) by a call without the credential")


def _replica(token: str) -> Any:
    """The deployment's class with only what a refused call may use; the model explodes if touched."""
    from serve_app.app import EmotionClassifier
    from serve_app.settings import ServerSettings

    cls = EmotionClassifier.func_or_class
    replica = cls.__new__(cls)
    replica._token_sha256 = token_digest(token)
    replica._settings = ServerSettings()
    replica._fault = replica._settings.fault
    replica._model = _NoModel()
    replica._calls, replica._paragraphs = Counter(), Counter()
    replica._metrics = mock.Mock()
    replica._in_flight = 0
    return replica


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("authorization", "s3cret")]])
def test_a_call_without_the_credential_is_unauthenticated_and_never_reaches_the_model(
    metadata: list[tuple[str, str]],
) -> None:
    replica = _replica("s3cret")
    context = _Context([("application", "raypipe"), *metadata])
    request = emotion_pb2.ClassifyRequest(ids=["a"], texts=["hello"])
    answer = asyncio.run(replica.Classify(request, context))
    assert context.code == grpc.StatusCode.UNAUTHENTICATED
    assert "credential" in context.details and "s3cret" not in context.details
    assert answer == emotion_pb2.ClassifyResponse()
    info_context = _Context(metadata)
    assert replica.ModelInfo(emotion_pb2.ModelInfoRequest(), info_context) == emotion_pb2.ModelInfoResponse()
    assert info_context.code == grpc.StatusCode.UNAUTHENTICATED
    assert replica._calls == Counter({"UNAUTHENTICATED": 2})


def test_the_proxy_binds_the_host_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import default_impl

    from serve_app.deploy import GRPC_HOST_ENV, bind_grpc_proxy_host, proxy_runtime_env

    bound: list[str] = []
    monkeypatch.setattr(default_impl, "add_grpc_address", lambda server, address: bound.append(address))
    monkeypatch.setenv(GRPC_HOST_ENV, "127.0.0.1")
    bind_grpc_proxy_host()
    bind_grpc_proxy_host()  # a second call (another worker start in the same process) wraps once
    default_impl.add_grpc_address(object(), "[::]:9000")
    assert bound == ["127.0.0.1:9000"]

    env = proxy_runtime_env("127.0.0.1", {"A": "1"})
    assert env == {
        "env_vars": {
            "A": "1",
            GRPC_HOST_ENV: "127.0.0.1",
            "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_MESSAGE_BYTES),
            "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "serve_app.deploy.bind_grpc_proxy_host",
        }
    }
    from ray.serve._private.api import _coerce_controller_options

    _coerce_controller_options({"runtime_env": env})  # what serve.start accepts


def test_the_local_cluster_starts_with_token_auth_and_a_private_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raypipe.run import driver

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    seen: list[dict[str, str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(kwargs["env"])
        return subprocess.CompletedProcess(cmd, 0, "started", "")

    monkeypatch.setattr(subprocess, "run", run)
    driver.start_local_cluster()
    assert seen[0]["RAY_AUTH_MODE"] == "token"
    token = tmp_path / ".ray" / "auth_token"
    assert _mode(token) == 0o600 and len(token.read_text()) == 64

    token.chmod(0o644)  # as `ray start` leaves one it created
    driver.start_local_cluster()
    assert _mode(token) == 0o600


def test_a_cluster_started_with_auth_disabled_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from raypipe.run import driver

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    with caplog.at_level("WARNING", logger="raypipe"):
        driver.start_local_cluster()
    assert [r.getMessage() for r in caplog.records if "without token authentication" in r.getMessage()]
    assert not (tmp_path / ".ray").exists()


def test_serve_refuses_a_token_file_others_can_read(tmp_path: Path, demo_model_dir: Path, capsys: Any) -> None:
    from raypipe.cli import main

    token = tmp_path / "token"
    token.write_text("abc")
    os.chmod(token, 0o644)
    assert main(["serve", "--model", str(demo_model_dir), "--token-file", str(token)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "readable by others" in err[0] and "abc" not in err[0]


def test_the_rayservice_builder_deploys_with_the_digest_of_its_token_file(tmp_path: Path, demo_model_dir: Path) -> None:
    from serve_app.builder import app_builder

    path = tmp_path / "token"
    token, _ = ensure_token(path, environ={})
    app = app_builder({"model_dir": str(demo_model_dir), "token_file": str(path)})
    init_args = app._bound_deployment.init_args
    assert init_args[-1] == token_digest(token) and token not in repr(init_args)
    with pytest.raises(ValueError, match="does not exist"):
        app_builder({"model_dir": str(demo_model_dir), "token_file": str(tmp_path / "missing")})
    assert app_builder({"model_dir": str(demo_model_dir)})._bound_deployment.init_args[-1] is None


def test_the_rayservice_builder_deploys_with_the_digest_of_its_token_variable(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled RayService sets RAYPIPE_SERVICE_TOKEN from a Secret and names it in args.token_env."""
    from serve_app.builder import app_builder

    args = {"model_dir": str(demo_model_dir), "token_env": "RAYPIPE_SERVICE_TOKEN"}
    monkeypatch.setenv("RAYPIPE_SERVICE_TOKEN", "s3cr3t-from-a-secret\n")
    init_args = app_builder(args)._bound_deployment.init_args
    assert init_args[-1] == token_digest("s3cr3t-from-a-secret") and "s3cr3t" not in repr(init_args)
    monkeypatch.delenv("RAYPIPE_SERVICE_TOKEN")
    with pytest.raises(ValueError, match="RAYPIPE_SERVICE_TOKEN is not set"):
        app_builder(args)
    with pytest.raises(ValueError, match="not both"):
        app_builder({**args, "token_file": "/nonexistent"})
