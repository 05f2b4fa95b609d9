"""The model client: one async call that classifies a micro-batch over gRPC.

`ModelClient` is the seam the actor depends on (classify, model_info, close); tests plug in a
fake or point `GrpcModelClient` at an in-process server on port 0. This module knows nothing
of Ray. It is also the one place where gRPC's errors become raypipe's (`map_rpc_error`).

The channel is created lazily on the first call, inside the running event loop: grpc.aio
channels are bound to the loop they were made in, and actors are constructed outside it.
Plaintext or TLS (and a bearer token) is `raypipe.call.channel.ChannelSecurity`'s business; the
channels of `GrpcModelClient` and `check_service` come from there alike.

Deadlines fit the work (`Deadlines`): a call gets `safety` x the time it should take, which
by Little's law is the work this client has in flight with it (characters) over the rate at
which the service has been answering this client, never less than a floor. A healthy but
busy service is then never timed out, however deep the batching queue, while a stalled one
still is. The server's own view of each call (queue wait, compute time, batches ahead) comes
back in trailing metadata and is handed to the limiter as `BatchResult.server`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc
from protos.wire import APPLICATION_KEY, TIMING_KEYS
from raypipe.call.channel import ChannelSecurity, aio_channel, auth_metadata, blocking_channel, tls_problem
from raypipe.errors import (
    ModelServiceError,
    RequestRejected,
    ServiceCancelled,
    ServiceInternal,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceTlsError,
    ServiceUnavailable,
)

__all__ = [
    "BatchResult",
    "ChannelSecurity",
    "Deadlines",
    "GrpcModelClient",
    "ModelClient",
    "ModelInfo",
    "ServerTiming",
    "check_service",
    "map_rpc_error",
]

_TRANSIENT: dict[grpc.StatusCode, type[ModelServiceError]] = {
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServiceTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServiceOverloaded,
    grpc.StatusCode.CANCELLED: ServiceCancelled,
    # A replica that dies mid-call (killed, OOM, a poison paragraph crashing the model)
    # answers INTERNAL or UNKNOWN: retried, and attributed by the actor before any row is blamed.
    grpc.StatusCode.INTERNAL: ServiceInternal,
    grpc.StatusCode.UNKNOWN: ServiceInternal,
}


@dataclass(frozen=True)
class ServerTiming:
    """The replica's view of one answered call (from its trailing metadata)."""

    queue_s: float
    """Arrival in the replica to the start of the call's batch (tokenizing included)."""
    compute_s: float
    """The forward passes of the call's batch (shared with the other calls in it)."""
    replica_s: float
    """Arrival in the replica to the answer."""
    batches_ahead: int
    """Other batches whose forward passes still waited for a model thread when the call's batch
    queued its own: work the replica held but could not use yet (0: its passes were next)."""
    model_cpu_s: float = 0.0
    """The call's share (by rows) of its batch's forward passes, in core-seconds (0 from older servers)."""

    @classmethod
    def from_metadata(cls, metadata: Sequence[tuple[str, str | bytes]] | None) -> ServerTiming | None:
        """Parses trailing metadata; None when the server sent no (or malformed) timing."""
        values = {k: v for k, v in metadata or () if isinstance(v, str)}
        try:
            ms = {name: float(values[TIMING_KEYS[name]]) for name in ("queue_s", "compute_s", "replica_s")}
            ahead = int(values[TIMING_KEYS["batches_ahead"]])
            model_ms = float(values.get(TIMING_KEYS["model_cpu_s"], 0.0))
        except (KeyError, ValueError):
            return None
        return cls(ms["queue_s"] / 1000, ms["compute_s"] / 1000, ms["replica_s"] / 1000, ahead, model_ms / 1000)


@dataclass(frozen=True)
class BatchResult:
    """The answer to one micro-batch, rows in request order."""

    labels: tuple[str, ...]
    model_version: str
    probabilities: np.ndarray  # float32 [n, len(labels)]
    truncated: np.ndarray  # bool [n]
    server: ServerTiming | None = None
    """What the replica reported about the call, if it did."""
    setting: str = ""
    """The runtime x precision that computed the answers ("openvino:fp32"; "" from an older server)."""


class Deadlines:
    """Per-call deadlines from the work in flight and the service's measured rate.

    `start(work)` before a call returns its timeout and counts its work in flight;
    `finish(work, answered=...)` after it. The rate is the work answered over the span of
    the last `window` answers (at least `min_span_s` long, else unknown); until it is known,
    calls get `floor_s`. Work is in any unit proportional to the service's effort
    (characters here).
    """

    def __init__(
        self,
        *,
        floor_s: float,
        max_s: float,
        safety: float = 4.0,
        window: int = 64,
        min_span_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < floor_s <= max_s:
            raise ValueError(f"need 0 < floor_s <= max_s, got {floor_s}, {max_s}")
        if safety < 1:
            raise ValueError(f"safety must be >= 1, got {safety}")
        self.floor_s = floor_s
        self.max_s = max_s
        self._safety = safety
        self._min_span = min_span_s
        self._clock = clock
        self._in_flight = 0.0
        self._answers: deque[tuple[float, float]] = deque(maxlen=window)  # (time, work)

    @property
    def rate(self) -> float | None:
        """Work answered per second, recently; None until measured."""
        if len(self._answers) < 2:
            return None
        span = self._answers[-1][0] - self._answers[0][0]
        if span < self._min_span:
            return None
        return sum(w for _, w in list(self._answers)[1:]) / span

    def start(self, work: float) -> float:
        self._in_flight += work
        rate = self.rate
        if rate is None:
            return self.floor_s
        return min(self.max_s, max(self.floor_s, self._safety * self._in_flight / rate))

    def finish(self, work: float, *, answered: bool) -> None:
        self._in_flight = max(0.0, self._in_flight - work)
        if answered:
            self._answers.append((self._clock(), work))


@dataclass(frozen=True)
class ModelInfo:
    labels: tuple[str, ...]
    model_version: str
    max_sequence_length: int
    max_batch_size: int
    setting: str = ""
    """The runtime x precision the answering replica computes with."""
    columns: bool = False
    """The service answers column-form Classify requests (`protos/raypipe/v1/emotion.proto`)."""

    @classmethod
    def of(cls, info: emotion_pb2.ModelInfoResponse) -> ModelInfo:
        return cls(
            tuple(info.labels),
            info.model_version,
            info.max_sequence_length,
            info.max_batch_size,
            info.setting,
            info.columns,
        )


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

    def __init__(
        self,
        address: str,
        *,
        application: str = "raypipe",
        timeout_s: float = 30.0,
        max_timeout_s: float | None = None,
        deadline_safety: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        security: ChannelSecurity | None = None,
    ) -> None:
        """`timeout_s` is the floor of a Classify deadline (and ModelInfo's deadline);
        `max_timeout_s` its ceiling (None: the floor, i.e. a fixed deadline). `interceptors`
        go on the channel (e.g. `raypipe.call.metrics.MetricsInterceptor`). `security`: TLS and a
        bearer token (plaintext when None); the token is read from this process's environment
        now, so a node without it fails here (`ConfigError`), not call after call."""
        self.address = address
        self.security = security or ChannelSecurity()
        self.timeout_s = timeout_s
        self.deadlines = Deadlines(
            floor_s=timeout_s,
            max_s=timeout_s if max_timeout_s is None else max(timeout_s, max_timeout_s),
            safety=deadline_safety,
            clock=clock,
        )
        self._metadata = ((APPLICATION_KEY, application), *auth_metadata(self.security))
        self._channel: grpc.aio.Channel | None = None
        self._stub: emotion_pb2_grpc.EmotionClassifierStub | None = None
        self._interceptors = list(interceptors)
        self._columns: bool | None = None
        self._columns_asked = asyncio.Lock()  # the first calls start at once; one asks

    def _get_stub(self) -> emotion_pb2_grpc.EmotionClassifierStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self.security, self._interceptors)
            self._stub = emotion_pb2_grpc.EmotionClassifierStub(self._channel)
        return self._stub

    async def classify(self, ids: Sequence[str], texts: Sequence[str]) -> BatchResult:
        if self._columns is None:
            async with self._columns_asked:
                if self._columns is None:
                    self._columns = await self._answers_columns()
        if self._columns:
            request = emotion_pb2.ClassifyRequest(ids=ids, texts=texts)
        else:
            request = emotion_pb2.ClassifyRequest(
                paragraphs=[emotion_pb2.Paragraph(id=i, text=t) for i, t in zip(ids, texts, strict=True)]
            )
        work = float(sum(map(len, texts)))
        timeout = self.deadlines.start(work)
        answered = False
        try:
            call = self._get_stub().Classify(request, timeout=timeout, metadata=self._metadata)
            response = await call
            trailing = await call.trailing_metadata()
            answered = True
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, address=self.address) from e
        finally:
            self.deadlines.finish(work, answered=answered)
        return self._decode(ids, response, ServerTiming.from_metadata(list(trailing or ())))

    async def _answers_columns(self) -> bool:
        """Does the server answer the column form? Asked once per client; a server that does
        not implement ModelInfo speaks the row form (a failure to reach it raises, as a call would)."""
        try:
            return (await self.model_info()).columns
        except RequestRejected as e:
            if e.status_code == grpc.StatusCode.UNIMPLEMENTED.name:
                return False
            raise

    def _decode(
        self, ids: Sequence[str], response: emotion_pb2.ClassifyResponse, server: ServerTiming | None = None
    ) -> BatchResult:
        labels = tuple(response.labels)
        n, width = len(ids), len(labels)
        if self._columns:
            probs = np.frombuffer(response.probabilities, dtype="<f4")
            truncated = np.array(response.truncated, dtype=bool)
            answered = len(truncated) if probs.size == len(truncated) * width else -1
        else:
            preds = response.predictions
            answered = len(preds) if [p.id for p in preds] == list(ids) else -1
            probs = np.array([list(p.probabilities) for p in preds], dtype=np.float32)
            truncated = np.array([p.truncated for p in preds], dtype=bool)
        if answered != n:
            raise RequestRejected(
                f"model service at {self.address} answered {answered if answered >= 0 else 'malformed'} "
                f"predictions for {n} paragraphs, or in another order",
                status_code="DATA_LOSS",
                address=self.address,
            )
        probs = probs.astype(np.float32, copy=False).reshape(n, width)
        return BatchResult(labels, response.model_version, probs, truncated, server, response.setting)

    async def model_info(self) -> ModelInfo:
        try:
            info = await self._get_stub().ModelInfo(
                emotion_pb2.ModelInfoRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, address=self.address) from e
        return ModelInfo.of(info)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None


def check_service(
    address: str,
    *,
    application: str = "raypipe",
    timeout_s: float = 10.0,
    security: ChannelSecurity | None = None,
) -> ModelInfo:
    """Asks the service what it serves, failing fast (with the address) if it cannot be reached.

    Runs before any data is read, so a wrong address costs seconds, not a cluster's start-up.
    A first call fails at once when the connection does. If TLS is the reason (an untrusted
    certificate, a wrong name, TLS on one side only) it raises `ServiceTlsError` at once, since
    waiting cannot help; otherwise it waits up to `timeout_s` for the service to come up.
    A blocking channel, so it works from notebooks whose event loop is already running.
    """
    security = security or ChannelSecurity()
    metadata = ((APPLICATION_KEY, application), *auth_metadata(security))
    deadline = time.monotonic() + timeout_s
    with blocking_channel(address, security) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)
        request = emotion_pb2.ModelInfoRequest()
        try:
            try:
                info = stub.ModelInfo(request, timeout=timeout_s, metadata=metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                _raise_if_tls(address, security, e, timeout_s=max(0.5, deadline - time.monotonic()))
                # Not TLS: the service may still be starting. gRPC waits for the connection within
                # the deadline (wait_for_ready), so no connection (or a connection that never
                # answers) ends as DEADLINE_EXCEEDED, and an UNAVAILABLE now is the service's own
                # answer (handled below, as any other).
                # Not `grpc.channel_ready_future`: its polling thread can outlive the channel's
                # close and die with "Channel closed!".
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    info = stub.ModelInfo(request, timeout=remaining, metadata=metadata, wait_for_ready=True)
                except grpc.RpcError as again:
                    if again.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    raise ServiceUnavailable(
                        f"model service at {address} is unreachable: no answer within {timeout_s:g}s "
                        f"(last error: {e.details()})",
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
    return ModelInfo.of(info)


def _raise_if_tls(address: str, security: ChannelSecurity, error: grpc.RpcError, *, timeout_s: float) -> None:
    """Raises `ServiceTlsError` (from `error`) when TLS is why `address` cannot be reached."""
    reason = tls_problem(address, security, timeout_s=timeout_s)
    if reason is None:
        return
    if security.tls:
        name = f" (as {security.server_name})" if security.server_name else ""
        message = f"TLS handshake with {address}{name} failed: {reason}"
    else:
        message = (
            f"model service at {address}: {reason}; use a grpcs:// address (or service.tls: true) with service.ca_file"
        )
    raise ServiceTlsError(message, address=address, reason=reason) from error
