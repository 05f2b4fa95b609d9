"""GrpcModelClient against an in-process grpc.aio server on port 0 (no Ray, no model)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from raypipe.client import GrpcModelClient, check_service
from raypipe.errors import (
    RequestRejected,
    ServiceCancelled,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)
from tests.fakes import LABELS, fake_probs, start_fake_server


def run(coro):
    return asyncio.run(coro)


def test_classify_round_trip_keeps_order_labels_and_metadata():
    async def scenario():
        server, servicer, address = await start_fake_server()
        client = GrpcModelClient(address, application="emotions", timeout_s=5)
        try:
            result = await client.classify(["b", "a", "c"], ["second", "first", "x" * 1001])
        finally:
            await client.close()
            await server.stop(None)
        return result, servicer

    result, servicer = run(scenario())
    assert result.labels == LABELS
    assert result.model_version == "fake-1"
    np.testing.assert_allclose(result.probabilities[0], fake_probs("second"))
    np.testing.assert_allclose(result.probabilities[1], fake_probs("first"))
    assert result.truncated.tolist() == [False, False, True]
    assert servicer.metadata_seen[0]["application"] == "emotions"


@pytest.mark.parametrize(
    ("code", "error", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, ServiceUnavailable, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ServiceTimeout, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ServiceOverloaded, True),
        (grpc.StatusCode.CANCELLED, ServiceCancelled, True),
        (grpc.StatusCode.INVALID_ARGUMENT, RequestRejected, False),
        (grpc.StatusCode.INTERNAL, RequestRejected, False),
    ],
)
def test_status_codes_map_to_typed_errors(code, error, transient):
    async def scenario():
        server, servicer, address = await start_fake_server()
        servicer.fail_next = [code]
        client = GrpcModelClient(address, timeout_s=5)
        try:
            with pytest.raises(error) as info:
                await client.classify(["a"], ["text"])
        finally:
            await client.close()
            await server.stop(None)
        return info.value

    err = run(scenario())
    assert err.status_code == code.name
    assert err.transient is transient
    assert err.address is not None and err.address.startswith("127.0.0.1:")
    assert isinstance(err.__cause__, grpc.aio.AioRpcError)


def test_deadline_is_enforced_client_side():
    async def scenario():
        server, servicer, address = await start_fake_server()
        servicer.delay_s = 2.0
        client = GrpcModelClient(address, timeout_s=0.2)
        try:
            with pytest.raises(ServiceTimeout):
                await client.classify(["a"], ["slow"])
        finally:
            await client.close()
            await server.stop(None)

    run(scenario())


def test_unreachable_service_fails_fast_naming_the_address():
    # A port nothing listens on (bind, read the port, close).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServiceUnavailable, match=f"127.0.0.1:{port}"):
        check_service(f"127.0.0.1:{port}", timeout_s=1.0)


def test_check_service_reads_model_info():
    async def scenario():
        server, _, address = await start_fake_server()
        try:
            return await asyncio.to_thread(check_service, address, timeout_s=5)
        finally:
            await server.stop(None)

    info = run(scenario())
    assert info.labels == LABELS
    assert info.max_batch_size == 64


def test_channel_is_created_lazily_and_reused():
    client = GrpcModelClient("127.0.0.1:1")
    assert client._channel is None  # constructing made no channel (no loop needed)

    async def scenario():
        server, _, address = await start_fake_server()
        c = GrpcModelClient(address)
        try:
            await c.classify(["a"], ["x"])
            first = c._channel
            await c.classify(["b"], ["y"])
            assert c._channel is first
        finally:
            await c.close()
            await server.stop(None)

    run(scenario())
