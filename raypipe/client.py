"""The model client: one async call that classifies a micro-batch over gRPC.

`ModelClient` is the seam the actor depends on (classify, model_info, close); tests plug in a
fake or point `GrpcModelClient` at an in-process server on port 0. This module knows nothing
of Ray. It is also the one place where gRPC's errors become raypipe's (`map_rpc_error`).

The channel is created lazily on the first call, inside the running event loop: grpc.aio
channels are bound to the loop they were made in, and actors are constructed outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from raypipe.errors import (
    ModelServiceError,
    RequestRejected,
    ServiceCancelled,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)
from raypipe.v1 import emotion_pb2, emotion_pb2_grpc

__all__ = ["BatchResult", "GrpcModelClient", "ModelClient", "ModelInfo", "check_service", "map_rpc_error"]

_TRANSIENT: dict[grpc.StatusCode, type[ModelServiceError]] = {
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServiceTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServiceOverloaded,
    grpc.StatusCode.CANCELLED: ServiceCancelled,
}

# Large enough for a micro-batch of long paragraphs (and their answers) in one message.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Retries live in raypipe.retry, one layer only: switch off the channel's own.
    ("grpc.enable_retries", 0),
    # After an outage the channel fails fast until its reconnect backoff expires (by default
    # it grows to 120 s); cap it so a returning service is seen within seconds.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 4000),
)


@dataclass(frozen=True)
class BatchResult:
    """The answer to one micro-batch, rows in request order."""

    labels: tuple[str, ...]
    model_version: str
    probabilities: np.ndarray  # float32 [n, len(labels)]
    truncated: np.ndarray  # bool [n]


@dataclass(frozen=True)
class ModelInfo:
    labels: tuple[str, ...]
    model_version: str
    max_sequence_length: int
    max_batch_size: int


class ModelClient(Protocol):
    """What the actor needs from a model service."""

    async def classify(self, ids: Sequence[str], texts: Sequence[str]) -> BatchResult: ...

    async def model_info(self) -> ModelInfo: ...

    async def close(self) -> None: ...


def map_rpc_error(err: grpc.aio.AioRpcError, *, address: str) -> ModelServiceError:
    """Maps a failed call to the error tree; the caller raises it `from err`."""
    code = err.code()
    cls = _TRANSIENT.get(code, RequestRejected)
    details = err.details() or ""
    return cls(f"{code.name} from model service at {address}: {details}", status_code=code.name, address=address)


class GrpcModelClient:
    """`ModelClient` over a grpc.aio channel to a Ray Serve gRPC proxy (or any server of the proto)."""

    def __init__(self, address: str, *, application: str = "raypipe", timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("application", application),)
        self._channel: grpc.aio.Channel | None = None
        self._stub: emotion_pb2_grpc.EmotionClassifierStub | None = None

    def _get_stub(self) -> emotion_pb2_grpc.EmotionClassifierStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            self._stub = emotion_pb2_grpc.EmotionClassifierStub(self._channel)
        return self._stub

    async def classify(self, ids: Sequence[str], texts: Sequence[str]) -> BatchResult:
        request = emotion_pb2.ClassifyRequest(
            paragraphs=[emotion_pb2.Paragraph(id=i, text=t) for i, t in zip(ids, texts, strict=True)]
        )
        try:
            response = await self._get_stub().Classify(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, address=self.address) from e
        return self._decode(ids, response)

    def _decode(self, ids: Sequence[str], response: emotion_pb2.ClassifyResponse) -> BatchResult:
        labels = tuple(response.labels)
        preds = response.predictions
        answered = [p.id for p in preds]
        if answered != list(ids):
            raise RequestRejected(
                f"model service at {self.address} answered {len(answered)} predictions for {len(ids)} "
                "paragraphs, or in another order",
                status_code="DATA_LOSS",
                address=self.address,
            )
        probs = np.array([list(p.probabilities) for p in preds], dtype=np.float32).reshape(len(preds), len(labels))
        truncated = np.array([p.truncated for p in preds], dtype=bool)
        return BatchResult(labels, response.model_version, probs, truncated)

    async def model_info(self) -> ModelInfo:
        try:
            info = await self._get_stub().ModelInfo(
                emotion_pb2.ModelInfoRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, address=self.address) from e
        return ModelInfo(tuple(info.labels), info.model_version, info.max_sequence_length, info.max_batch_size)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None


def check_service(address: str, *, application: str = "raypipe", timeout_s: float = 10.0) -> ModelInfo:
    """Asks the service what it serves, failing fast (with the address) if it cannot be reached.

    Runs before any data is read, so a wrong address costs seconds, not a cluster's start-up.
    A blocking channel, so it works from notebooks whose event loop is already running.
    """
    with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            info = stub.ModelInfo(
                emotion_pb2.ModelInfoRequest(), timeout=timeout_s, metadata=(("application", application),)
            )
        except grpc.FutureTimeoutError as e:
            raise ServiceUnavailable(
                f"model service at {address} is unreachable: no connection within {timeout_s:g}s",
                status_code="UNAVAILABLE",
                address=address,
            ) from e
        except grpc.RpcError as e:
            err = map_rpc_error(e, address=address)
            raise type(err)(
                f"model service at {address} (application {application!r}) failed the check: {err}",
                status_code=err.status_code,
                address=address,
            ) from e
    return ModelInfo(tuple(info.labels), info.model_version, info.max_sequence_length, info.max_batch_size)
