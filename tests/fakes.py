"""Test doubles shared by unit tests: an in-process gRPC EmotionClassifier and a fake client.

The fake server speaks the real proto on 127.0.0.1:<port 0>, so the real `GrpcModelClient`
(channel, metadata, deadlines, error mapping) is exercised without Ray or a model.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc
from raypipe.call.client import BatchResult, ModelInfo
from raypipe.errors import ModelServiceError

LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")


def fake_probs(text: str) -> list[float]:
    """A deterministic distribution derived from the text, so answers can be checked."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = np.array([b + 1 for b in digest[: len(LABELS)]], dtype=np.float64)
    return (raw / raw.sum()).astype(np.float32).tolist()


class FakeServicer(emotion_pb2_grpc.EmotionClassifierServicer):
    """Answers both request forms of the proto; `columns=False` is a server of the row form only
    (it says so in ModelInfo, as an older server does)."""

    def __init__(self, *, columns: bool = True) -> None:
        self.columns = columns
        self.fail_next: list[grpc.StatusCode] = []
        self.delay_s = 0.0
        self.metadata_seen: list[dict[str, str]] = []
        self.calls: Counter[str] = Counter()
        self.forms: Counter[str] = Counter()
        self.poison = "POISON"
        self.answer_fewer = 0
        """Rows left out of each answer (a broken server)."""

    async def Classify(self, request: Any, context: Any) -> Any:
        self.metadata_seen.append(dict(context.invocation_metadata()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_next:
            code = self.fail_next.pop(0)
            self.calls[code.name] += 1
            await context.abort(code, f"fake {code.name}")
        columns = bool(request.ids)
        self.forms["columns" if columns else "rows"] += 1
        ids = list(request.ids) if columns else [p.id for p in request.paragraphs]
        texts = list(request.texts) if columns else [p.text for p in request.paragraphs]
        if self.poison in texts:
            self.calls["INVALID_ARGUMENT"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "poison paragraph")
        self.calls["OK"] += 1
        kept = len(texts) - self.answer_fewer
        probs = [fake_probs(t) for t in texts][:kept]
        truncated = [len(t) > 1000 for t in texts][:kept]
        if columns:
            return emotion_pb2.ClassifyResponse(
                probabilities=np.asarray(probs, dtype="<f4").tobytes(),
                truncated=truncated,
                labels=LABELS,
                model_version="fake-1",
            )
        return emotion_pb2.ClassifyResponse(
            predictions=[
                emotion_pb2.Prediction(id=i, probabilities=p, truncated=cut)
                for i, p, cut in zip(ids, probs, truncated, strict=True)
            ],
            labels=LABELS,
            model_version="fake-1",
        )

    async def ModelInfo(self, request: Any, context: Any) -> Any:
        self.calls["ModelInfo"] += 1
        await asyncio.sleep(0.05)  # long enough for concurrent first calls to overlap
        return emotion_pb2.ModelInfoResponse(
            labels=LABELS, model_version="fake-1", max_sequence_length=128, max_batch_size=64, columns=self.columns
        )


async def start_fake_server(*, columns: bool = True, port: int = 0) -> tuple[grpc.aio.Server, FakeServicer, str]:
    server = grpc.aio.server()
    servicer = FakeServicer(columns=columns)
    emotion_pb2_grpc.add_EmotionClassifierServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


class ScriptedClient:
    """A `ModelClient` without a network: answers with fake_probs, or raises scripted errors."""

    def __init__(self, errors: Sequence[ModelServiceError] = (), poison: str = "POISON") -> None:
        self.errors = list(errors)
        self.poison = poison
        self.calls = 0
        self.answered = 0
        """Calls that got an answer or an error: not those their caller cancelled while out (the
        run report does not count those either, `raypipe.call.metrics.MetricsInterceptor`)."""
        self.paragraphs_ok = 0
        self.texts_sent: list[str] = []

    async def classify(self, ids: Sequence[str], texts: Sequence[str]) -> BatchResult:
        self.calls += 1
        self.texts_sent += texts
        await asyncio.sleep(0)
        self.answered += 1
        if self.errors:
            raise self.errors.pop(0)
        if self.poison in texts:
            from raypipe.errors import RequestRejected

            raise RequestRejected("poison", status_code="INVALID_ARGUMENT")
        self.paragraphs_ok += len(ids)
        probs = np.array([fake_probs(t) for t in texts], dtype=np.float32).reshape(len(ids), len(LABELS))
        return BatchResult(LABELS, "fake-1", probs, np.zeros(len(ids), dtype=bool))

    async def model_info(self) -> ModelInfo:
        return ModelInfo(LABELS, "fake-1", 128, 64)

    async def close(self) -> None:
        pass


class CountingClient:
    """A `ModelClient` without a network that counts, per (id, text), the rows it answered, and
    can be told to reject a class of texts (those starting with `reject_prefix`, refused as
    INVALID_ARGUMENT: the actor bisects them into per-row dead letters) or to be down (every
    call UNAVAILABLE: the breaker opens and the run stops). One instance may serve every actor
    of a test, across runs: `answered` is the history of calls that got an answer."""

    def __init__(self, *, version: str = "fake-1", labels: Sequence[str] = LABELS) -> None:
        self.version = version
        self.labels = tuple(labels)
        self.answered: Counter[tuple[str, str]] = Counter()
        self.reject_prefix: str | None = None
        self.down = False

    async def classify(self, ids: Sequence[str], texts: Sequence[str]) -> BatchResult:
        from raypipe.errors import RequestRejected, ServiceUnavailable

        await asyncio.sleep(0)
        if self.down:
            raise ServiceUnavailable("fake outage", status_code="UNAVAILABLE")
        if self.reject_prefix is not None and any(t.startswith(self.reject_prefix) for t in texts):
            raise RequestRejected("fake rejection", status_code="INVALID_ARGUMENT")
        self.answered.update(zip(ids, texts, strict=True))
        probs = np.array([fake_probs(t) for t in texts], dtype=np.float32).reshape(len(ids), len(LABELS))
        return BatchResult(self.labels, self.version, probs, np.zeros(len(ids), dtype=bool))

    async def model_info(self) -> ModelInfo:
        return ModelInfo(self.labels, self.version, 128, 64)

    async def close(self) -> None:
        pass
