"""GrpcModelClient against an in-process grpc.aio server on port 0 (no Ray, no model)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc
from raypipe.call.client import Deadlines, GrpcModelClient, ServerTiming, check_service
from raypipe.errors import (
    RequestRejected,
    ServiceCancelled,
    ServiceInternal,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)
from tests.fakes import LABELS, fake_probs, start_fake_server


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("columns", [True, False], ids=["column form", "row form (an older server)"])
def test_classify_round_trip_keeps_order_labels_and_metadata(columns: bool) -> None:
    async def scenario():
        server, servicer, address = await start_fake_server(columns=columns)
        client = GrpcModelClient(address, application="emotions", timeout_s=5)
        try:
            result = await client.classify(["b", "a", "c"], ["second", "first", "x" * 1001])
            await client.classify(["d"], ["again"])
        finally:
            await client.close()
            await server.stop(None)
        return result, servicer

    result, servicer = run(scenario())
    assert result.labels == LABELS
    assert result.model_version == "fake-1"
    np.testing.assert_allclose(result.probabilities[0], fake_probs("second"))
    np.testing.assert_allclose(result.probabilities[1], fake_probs("first"))
    assert result.probabilities.dtype == np.float32 and result.probabilities.shape == (3, len(LABELS))
    assert result.truncated.tolist() == [False, False, True]
    assert servicer.metadata_seen[0]["application"] == "emotions"
    # The form the server said it answers, for every call.
    assert servicer.forms == {("columns" if columns else "rows"): 2}


def test_concurrent_first_calls_ask_the_servers_form_once() -> None:
    async def scenario():
        server, servicer, address = await start_fake_server()
        client = GrpcModelClient(address, timeout_s=5)
        try:
            await asyncio.gather(*(client.classify([f"r{i}"], [f"text {i}"]) for i in range(8)))
        finally:
            await client.close()
            await server.stop(None)
        return servicer

    servicer = run(scenario())
    assert servicer.calls["ModelInfo"] == 1
    assert servicer.forms == {"columns": 8}


def test_an_answer_with_fewer_probabilities_than_paragraphs_is_data_loss() -> None:
    async def scenario():
        server, servicer, address = await start_fake_server()
        servicer.answer_fewer = 1
        client = GrpcModelClient(address, timeout_s=5)
        try:
            with pytest.raises(RequestRejected) as info:
                await client.classify(["a", "b"], ["one", "two"])
        finally:
            await client.close()
            await server.stop(None)
        return info.value

    err = run(scenario())
    assert err.status_code == "DATA_LOSS" and "answered 1 predictions for 2" in str(err)


@pytest.mark.parametrize(
    ("code", "error", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, ServiceUnavailable, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ServiceTimeout, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ServiceOverloaded, True),
        (grpc.StatusCode.CANCELLED, ServiceCancelled, True),
        (grpc.StatusCode.INVALID_ARGUMENT, RequestRejected, False),
        (grpc.StatusCode.INTERNAL, ServiceInternal, True),
        (grpc.StatusCode.UNKNOWN, ServiceInternal, True),
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


def test_check_service_waits_for_a_service_that_comes_up_within_its_timeout():
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found: list[object] = []
    checking = threading.Thread(target=lambda: found.append(check_service(f"127.0.0.1:{port}", timeout_s=60)))
    checking.start()  # nothing listens yet: its first call fails UNAVAILABLE, then it waits

    async def scenario():
        await asyncio.sleep(0.5)
        server, _, _ = await start_fake_server(port=port)
        try:
            await asyncio.to_thread(checking.join, 60)
        finally:
            await server.stop(None)

    run(scenario())
    assert not checking.is_alive()
    (info,) = found
    assert info.labels == LABELS


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


# --- server timing and deadlines ------------------------------------------------------------


def test_server_timing_parses_trailing_metadata_and_tolerates_its_absence() -> None:
    from raypipe.call.client import ServerTiming

    metadata = [
        ("request_id", "x"),
        ("raypipe-queue-ms", "1500.0"),
        ("raypipe-compute-ms", "800.5"),
        ("raypipe-replica-ms", "2301.0"),
        ("raypipe-batches-ahead", "1"),
    ]
    assert ServerTiming.from_metadata(metadata) == ServerTiming(1.5, 0.8005, 2.301, 1)
    assert ServerTiming.from_metadata([]) is None
    assert ServerTiming.from_metadata(None) is None
    assert ServerTiming.from_metadata([*metadata[:-1], ("raypipe-batches-ahead", "many")]) is None


class _TimedServicer(emotion_pb2_grpc.EmotionClassifierServicer):
    async def Classify(self, request, context):
        context.set_trailing_metadata(
            (
                ("raypipe-queue-ms", "10.0"),
                ("raypipe-compute-ms", "20.0"),
                ("raypipe-replica-ms", "31.0"),
                ("raypipe-batches-ahead", "0"),
            )
        )
        return emotion_pb2.ClassifyResponse(
            predictions=[emotion_pb2.Prediction(id=p.id, probabilities=fake_probs(p.text)) for p in request.paragraphs],
            labels=LABELS,
            model_version="timed-1",
        )


def test_classify_returns_the_servers_timing() -> None:
    async def scenario():
        server = grpc.aio.server()
        emotion_pb2_grpc.add_EmotionClassifierServicer_to_server(_TimedServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = GrpcModelClient(f"127.0.0.1:{port}", timeout_s=5)
        try:
            return await client.classify(["a"], ["text"])
        finally:
            await client.close()
            await server.stop(None)

    result = run(scenario())
    assert result.server == ServerTiming(0.01, 0.02, 0.031, 0)
    assert result.model_version == "timed-1"


def test_fake_server_without_timing_gives_none() -> None:
    async def scenario():
        server, _, address = await start_fake_server()
        client = GrpcModelClient(address, timeout_s=5)
        try:
            return await client.classify(["a"], ["text"])
        finally:
            await client.close()
            await server.stop(None)

    assert run(scenario()).server is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_deadline_is_the_floor_until_the_rate_is_known() -> None:
    d = Deadlines(floor_s=30, max_s=600, clock=_Clock())
    assert d.rate is None
    assert d.start(1_000_000) == 30


def test_deadline_follows_work_in_flight_over_the_measured_rate() -> None:
    clock = _Clock()
    d = Deadlines(floor_s=5, max_s=600, safety=4, clock=clock)
    for _ in range(11):  # 1,000 characters answered per second
        d.start(1000)
        clock.now += 1
        d.finish(1000, answered=True)
    assert d.rate == pytest.approx(1000)
    # A busy service: 40 calls of 1,000 characters ahead of this one should take ~41 s.
    for _ in range(40):
        d.start(1000)
    assert d.start(1000) == pytest.approx(4 * 41)  # 40 calls ahead of this one, and itself
    assert d.start(10**9) == 600  # capped
    d.finish(10**9, answered=False)
    for _ in range(41):
        d.finish(1000, answered=False)  # failures free their work, add no rate sample
    assert d.rate == pytest.approx(1000)
    assert d.start(1000) == 5  # little in flight: the floor


def test_answers_in_one_burst_do_not_make_a_rate() -> None:
    clock = _Clock()
    d = Deadlines(floor_s=5, max_s=600, clock=clock)
    for _ in range(10):  # one batch answers ten calls at once
        d.start(1000)
    for _ in range(10):
        d.finish(1000, answered=True)
    assert d.rate is None


def test_bad_deadline_arguments() -> None:
    with pytest.raises(ValueError):
        Deadlines(floor_s=10, max_s=5)
    with pytest.raises(ValueError):
        Deadlines(floor_s=1, max_s=5, safety=0.5)
