"""The client over TLS: an in-process gRPC server of the proto behind a TLS-terminating loopback
proxy (`tests.tls.TlsProxy`, certificates made per session). No Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import socket
import ssl
import threading
import time

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protos.raypipe.v1 import emotion_pb2_grpc
from raypipe.call.actor import ActorSettings, InferenceActor
from raypipe.call.channel import ChannelSecurity
from raypipe.call.client import GrpcModelClient, check_service
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable
from raypipe.config import ClientConfig, ServiceConfig, load_config
from raypipe.errors import ConfigError, RequestRejected, ServiceTlsError, ServiceUnavailable
from raypipe.plan.planning import list_shards, plan_units
from raypipe.plan.units import ColumnNames
from raypipe.run.read import read_unit
from raypipe.run.steps import _fatal_error
from tests.fakes import LABELS, FakeServicer, fake_probs
from tests.tls import Pki, TlsProxy

TOKEN_ENV = "RAYPIPE_TEST_SERVICE_TOKEN"
TOKEN = "s3cret-token-value"


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


class RecordingServicer(FakeServicer):
    """The fake service, recording every call's metadata; with `expect_token`, it refuses calls
    without `authorization: Bearer <token>` as a checking sidecar would."""

    def __init__(self, expect_token: str | None = None) -> None:
        super().__init__()
        self.expect_token = expect_token
        self.info_metadata: list[dict[str, str]] = []

    async def _authorize(self, context) -> None:
        if self.expect_token is not None:
            got = dict(context.invocation_metadata()).get("authorization")
            if got != f"Bearer {self.expect_token}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def Classify(self, request, context):
        await self._authorize(context)
        return await super().Classify(request, context)

    async def ModelInfo(self, request, context):
        self.info_metadata.append(dict(context.invocation_metadata()))
        await self._authorize(context)
        return await super().ModelInfo(request, context)


@contextlib.asynccontextmanager
async def tls_service(context: ssl.SSLContext, servicer: RecordingServicer | None = None):
    """(servicer, plaintext address, TlsProxy) of a fake service behind a TLS proxy."""
    servicer = servicer or RecordingServicer()
    server = grpc.aio.server()
    emotion_pb2_grpc.add_EmotionClassifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = TlsProxy(port, context).start()
    try:
        yield servicer, f"127.0.0.1:{port}", proxy
    finally:
        proxy.stop()
        await server.stop(None)


def trusting(pki: Pki, **kw) -> ChannelSecurity:
    return ChannelSecurity(tls=True, root_certificates=pki.ca.cert_pem.bytes(), **kw)


def run(coro):
    return asyncio.run(coro)


# --- reaching the service through TLS ---------------------------------------------------------


def test_client_with_the_ca_classifies_through_tls(pki):
    async def scenario():
        async with tls_service(pki.server_context()) as (servicer, _, proxy):
            service = ServiceConfig(address=f"grpcs://{proxy.address}", ca_file=str(pki.ca_file))
            security = ChannelSecurity.of(service)
            info = await asyncio.to_thread(check_service, service.address, timeout_s=5, security=security)
            client = GrpcModelClient(service.address, timeout_s=5, security=security)
            try:
                result = await client.classify(["a", "b"], ["first", "second"])
            finally:
                await client.close()
            return info, result, servicer, proxy.sessions

    info, result, servicer, sessions = run(scenario())
    assert info.labels == LABELS
    assert result.labels == LABELS
    assert result.probabilities[1].tolist() == pytest.approx(fake_probs("second"))
    assert servicer.calls["OK"] == 1
    # Both the check and the client came in over TLS, speaking HTTP/2.
    assert len(sessions) == 2
    assert all(version in ("TLSv1.2", "TLSv1.3") and alpn == "h2" for version, alpn in sessions)


def test_system_roots_are_used_without_a_ca_file(pki):
    """No ca_file: gRPC's default roots, which do not include the test CA."""

    async def scenario():
        async with tls_service(pki.server_context()) as (_, _, proxy):
            with pytest.raises(ServiceTlsError, match="certificate verify failed") as info:
                await asyncio.to_thread(check_service, proxy.address, timeout_s=5, security=ChannelSecurity(tls=True))
            return info.value

    assert "trusting gRPC's default roots" in str(run(scenario()))


def test_server_name_names_the_certificate_when_the_address_is_an_ip(pki):
    async def scenario():
        async with tls_service(pki.server_context("model.internal")) as (_, _, proxy):
            ok = await asyncio.to_thread(
                check_service, proxy.address, timeout_s=5, security=trusting(pki, server_name="model.internal")
            )
            client = GrpcModelClient(proxy.address, timeout_s=5, security=trusting(pki, server_name="model.internal"))
            try:
                await client.classify(["a"], ["x"])
            finally:
                await client.close()
            with pytest.raises(ServiceTlsError, match=r"certificate verify failed: .*mismatch"):
                await asyncio.to_thread(check_service, proxy.address, timeout_s=5, security=trusting(pki))
            return ok

    assert run(scenario()).labels == LABELS


# --- failing fast and clearly -----------------------------------------------------------------


def test_wrong_ca_fails_the_check_at_once_naming_the_address_and_tls(pki):
    async def scenario():
        async with tls_service(pki.server_context()) as (servicer, _, proxy):
            wrong = ChannelSecurity(tls=True, root_certificates=pki.other_ca.cert_pem.bytes())
            t0 = time.monotonic()
            with pytest.raises(ServiceTlsError) as info:
                await asyncio.to_thread(check_service, proxy.address, timeout_s=20, security=wrong)
            elapsed = time.monotonic() - t0
            # The actors' client: the same failure is a transient UNAVAILABLE (the breaker's to judge).
            client = GrpcModelClient(proxy.address, timeout_s=5, security=wrong)
            try:
                with pytest.raises(ServiceUnavailable, match=r"(?i)handshake"):
                    await client.classify(["a"], ["x"])
            finally:
                await client.close()
            return info.value, elapsed, servicer, proxy.address

    err, elapsed, servicer, address = run(scenario())
    assert elapsed < 5  # not the 20 s connect timeout: waiting cannot fix a certificate
    assert str(err).startswith(f"TLS handshake with {address} failed: certificate verify failed")
    assert "trusting service.ca_file" in str(err)
    assert err.address == address and err.status_code == "UNAVAILABLE"
    assert err.transient is False and err.kind == "tls"
    assert isinstance(err.__cause__, grpc.RpcError)
    assert servicer.calls.total() == 0 and servicer.info_metadata == []


def test_wrong_server_name_is_a_tls_error(pki):
    async def scenario():
        async with tls_service(pki.server_context()) as (_, _, proxy):
            with pytest.raises(ServiceTlsError, match=r"\(as other\.example\) failed: certificate verify failed"):
                await asyncio.to_thread(
                    check_service, proxy.address, timeout_s=20, security=trusting(pki, server_name="other.example")
                )

    run(scenario())


def test_plaintext_client_to_the_tls_port_fails(pki):
    async def scenario():
        async with tls_service(pki.server_context()) as (servicer, _, proxy):
            t0 = time.monotonic()
            with pytest.raises(ServiceTlsError, match="speaks TLS, but the client is set for plaintext") as info:
                await asyncio.to_thread(check_service, proxy.address, timeout_s=20)
            elapsed = time.monotonic() - t0
            client = GrpcModelClient(proxy.address, timeout_s=5)
            try:
                with pytest.raises(ServiceUnavailable):
                    await client.classify(["a"], ["x"])
            finally:
                await client.close()
            return info.value, elapsed, servicer

    err, elapsed, servicer = run(scenario())
    assert elapsed < 5
    assert "grpcs://" in str(err)
    assert servicer.calls.total() == 0


def test_tls_client_to_a_plaintext_port_fails(pki):
    async def scenario():
        async with tls_service(pki.server_context()) as (_, plain, _):
            with pytest.raises(ServiceTlsError, match="does not seem to speak TLS"):
                await asyncio.to_thread(check_service, plain, timeout_s=20, security=trusting(pki))

    run(scenario())


def test_a_proxy_without_http2_is_named(pki):
    async def scenario():
        async with tls_service(pki.server_context(alpn=False)) as (_, _, proxy):
            with pytest.raises(ServiceTlsError, match=r"ALPN h2"):
                await asyncio.to_thread(check_service, proxy.address, timeout_s=20, security=trusting(pki))

    run(scenario())


def test_unreachable_tls_service_is_unavailable_not_tls(pki):
    from tests.tls import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ServiceUnavailable, match=f"{address} is unreachable.*Connection refused") as info:
        check_service(address, timeout_s=1.0, security=trusting(pki))
    assert not isinstance(info.value, ServiceTlsError)


def test_a_connection_closed_mid_handshake_is_waited_out_not_called_tls(pki):
    """A listener that accepts and hangs up (a proxy restarting) says nothing about TLS: the check
    waits for the service as usual, then reports it unreachable."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.1)
        stop = threading.Event()

        def hang_up() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    listener.accept()[0].close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        try:
            with pytest.raises(ServiceUnavailable, match=f"{address} is unreachable") as info:
                check_service(address, timeout_s=1.5, security=trusting(pki))
        finally:
            stop.set()
            thread.join()
    assert not isinstance(info.value, ServiceTlsError)
    assert time.monotonic() - t0 >= 1.4


# --- the bearer token -------------------------------------------------------------------------


def test_token_arrives_as_bearer_metadata_on_every_call(pki, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)

    async def scenario():
        servicer = RecordingServicer(expect_token=TOKEN)
        async with tls_service(pki.server_context(), servicer) as (_, _, proxy):
            security = trusting(pki, token_env=TOKEN_ENV)
            await asyncio.to_thread(check_service, proxy.address, timeout_s=5, security=security)
            client = GrpcModelClient(proxy.address, application="emotions", timeout_s=5, security=security)
            try:
                await client.classify(["a"], ["x"])
                await client.classify(["b"], ["y"])
            finally:
                await client.close()
            return servicer

    servicer = run(scenario())
    # check_service's ModelInfo, the client's own (which form the server answers), two Classify calls.
    assert [m["authorization"] for m in servicer.info_metadata + servicer.metadata_seen] == [f"Bearer {TOKEN}"] * 4
    assert servicer.metadata_seen[0]["application"] == "emotions"


def test_without_token_env_no_authorization_is_sent(pki, monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # set, but not asked for
    # and no service token (`raypipe serve`'s file under HOME, or RAYPIPE_SERVICE_TOKEN) to send instead
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAYPIPE_SERVICE_TOKEN", raising=False)

    async def scenario():
        async with tls_service(pki.server_context()) as (servicer, _, proxy):
            await asyncio.to_thread(check_service, proxy.address, timeout_s=5, security=trusting(pki))
            client = GrpcModelClient(proxy.address, timeout_s=5, security=trusting(pki))
            try:
                await client.classify(["a"], ["x"])
            finally:
                await client.close()
            return servicer

    servicer = run(scenario())
    assert all("authorization" not in m for m in servicer.info_metadata + servicer.metadata_seen)
    assert len(servicer.metadata_seen) == 1


def test_a_refused_token_fails_the_check_without_showing_it(pki, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "not-the-token")

    async def scenario():
        async with tls_service(pki.server_context(), RecordingServicer(expect_token=TOKEN)) as (_, _, proxy):
            with pytest.raises(RequestRejected, match="UNAUTHENTICATED") as info:
                await asyncio.to_thread(
                    check_service, proxy.address, timeout_s=5, security=trusting(pki, token_env=TOKEN_ENV)
                )
            return info.value

    assert "not-the-token" not in str(run(scenario()))


def test_token_missing_from_the_environment_is_a_config_error_naming_the_variable(pki, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"environment variable {TOKEN_ENV} is not set .* every node"):
        check_service("127.0.0.1:1", timeout_s=1, security=trusting(pki, token_env=TOKEN_ENV))
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        GrpcModelClient("127.0.0.1:1", security=trusting(pki, token_env=TOKEN_ENV))


def test_the_token_value_stays_out_of_reprs(pki, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    service = ServiceConfig(address="grpcs://h:1", ca_file=str(pki.ca_file), token_env=TOKEN_ENV)
    client = GrpcModelClient(service.address, security=ChannelSecurity.of(service))
    for shown in (repr(service), repr(client.security), str(service.model_dump()), repr(pickle.dumps(service))):
        assert TOKEN not in shown


def test_channel_security_refuses_a_token_or_roots_without_tls(pki):
    with pytest.raises(ValueError, match="need tls=True"):
        ChannelSecurity(token_env=TOKEN_ENV)
    with pytest.raises(ValueError, match="need tls=True"):
        ChannelSecurity(root_certificates=pki.ca.cert_pem.bytes())


# --- the actor builds its client from the config ----------------------------------------------


def tls_actor(tmp_path, service: ServiceConfig) -> InferenceActor:
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    settings = ActorSettings(
        committer=UnitCommitter(take_over(table, "r1")),
        run_id="r1",
        attempt="a1",
        service=service,
        client=ClientConfig(),
        labels=LABELS,
    )
    return InferenceActor(pickle.loads(pickle.dumps(settings)))  # as Ray ships it to a worker


def test_the_actor_builds_a_tls_client_from_its_shipped_settings(pki, tmp_path):
    service = ServiceConfig(address="grpcs://127.0.0.1:1", ca_file=str(pki.ca_file), server_name="model.internal")
    actor = tls_actor(tmp_path, service)

    async def scenario():
        client, _, _ = actor._components()
        assert isinstance(client, GrpcModelClient)
        await client.close()
        return client.security

    assert run(scenario()) == ChannelSecurity(
        tls=True, root_certificates=pki.ca.cert_pem.bytes(), server_name="model.internal"
    )


def test_an_actor_on_a_node_without_the_token_stops_the_run_with_a_config_error(pki, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", "y"]}), tmp_path / "in.parquet")
    units, _ = plan_units(list_shards(str(tmp_path / "in.parquet")), unit_rows=100, columns=ColumnNames())
    service = ServiceConfig(address="grpcs://127.0.0.1:1", ca_file=str(pki.ca_file), token_env=TOKEN_ENV)

    summary = run(tls_actor(tmp_path, service)(read_unit(units[0], ColumnNames()))).to_pylist()

    assert len(summary) == 1 and summary[0]["summary"] is not None
    fatal = json.loads(summary[0]["fatal"])
    assert fatal["kind"] == "config" and f"environment variable {TOKEN_ENV} is not set" in fatal["message"]
    error = _fatal_error(summary[0]["fatal"])  # what the driver raises
    assert type(error) is ConfigError and TOKEN_ENV in str(error)
    assert read_outcomes(str(tmp_path / "out"), "r1").num_rows == 0


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "tls", "target"),
    [
        ("grpcs://svc.ns.svc:9443", True, "svc.ns.svc:9443"),
        ("grpc://127.0.0.1:9000", False, "127.0.0.1:9000"),
        ("127.0.0.1:9000", False, "127.0.0.1:9000"),
        ("grpcs://[::1]:9443", True, "[::1]:9443"),
    ],
)
def test_address_schemes(address, tls, target):
    service = ServiceConfig(address=address)
    assert (service.address, service.tls) == (target, tls)
    assert ServiceConfig.model_validate(service.model_dump()) == service  # round-trips


def load(service: dict, environ: dict | None = None):
    return load_config(None, {"output": {"uri": "/o"}, "service": service}, environ=environ or {}).service


@pytest.mark.parametrize(
    ("service", "message"),
    [
        ({"address": "grpcs://h:1", "tls": False}, "'grpcs://h:1' says TLS but tls is false"),
        ({"address": "grpcs://h:1", "tls": "no"}, "says TLS but tls is false"),
        ({"address": "grpc://h:1", "tls": True}, "says plaintext but tls is true"),
        ({"address": "https://h:1"}, "scheme 'https' is not supported"),
        ({"address": "h:1", "token_env": "T"}, "token_env needs TLS.*in the clear"),
        ({"address": "h:1", "ca_file": "/x.pem"}, "ca_file needs TLS"),
        ({"address": "h:1", "server_name": "a.b"}, "server_name needs TLS"),
        ({"address": "grpcs://h:1", "token_env": "eyJ.abc.def"}, "token_env: .*not hold the token itself"),
        ({"address": "grpcs://h:1", "server_name": "not a name"}, "is not a host name"),
    ],
)
def test_config_errors(service, message):
    with pytest.raises(ConfigError, match=message):
        load(service)


def test_token_looking_token_env_is_not_echoed():
    with pytest.raises(ConfigError) as info:
        load({"address": "grpcs://h:1", "token_env": "eyJ.abc.def"})
    assert "eyJ.abc.def" not in str(info.value)


def test_missing_or_unreadable_ca_file_is_a_config_error_naming_the_path(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"cannot read CA file {missing}: No such file"):
        load({"address": "grpcs://h:1", "ca_file": str(missing)})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"CA file {junk} holds no PEM certificate"):
        load({"address": "grpcs://h:1", "ca_file": str(junk)})


def test_env_overrides_and_the_ca_travels_with_the_config(pki, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki.ca_file.read_bytes())
    env = {
        "RAYPIPE_SERVICE__ADDRESS": "grpcs://model.example:443",
        "RAYPIPE_SERVICE__CA_FILE": str(ca),
        "RAYPIPE_SERVICE__SERVER_NAME": "model.internal",
        "RAYPIPE_SERVICE__TOKEN_ENV": TOKEN_ENV,
    }
    service = load({}, env)
    assert (service.address, service.tls, service.server_name, service.token_env) == (
        "model.example:443",
        True,
        "model.internal",
        TOKEN_ENV,
    )
    assert load({}, {"RAYPIPE_SERVICE__TLS": "true"}).tls
    # Read once on the driver: an actor elsewhere gets the certificates, not the path to open.
    shipped = pickle.dumps(service)
    ca.unlink()
    security = ChannelSecurity.of(pickle.loads(shipped))
    assert security.root_certificates == pki.ca.cert_pem.bytes()
    assert security.server_name == "model.internal"
