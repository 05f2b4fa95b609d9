"""The EmotionClassifier Ray Serve deployment, served over Serve's gRPC proxy.

One replica owns a tokenizer and a TensorFlow model (`serve_app.model.EmotionModel`), loaded
and warmed in the constructor, so the replica only reports healthy once it can answer fast.
`Classify` validates the request (malformed ones get INVALID_ARGUMENT and the replica stays
up), applies server-side fault injection if the deployer switched it on, then hands the texts
to `_infer`, which `@serve.batch` merges across concurrent callers into one length-bucketed
forward pass run on a single worker thread (the model itself uses the replica's cores).

Method names equal the RPC names of `raypipe.v1.EmotionClassifier`: Serve routes by them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from raypipe.v1 import emotion_pb2
from serve_app.settings import ServerSettings

__all__ = ["EmotionClassifier", "validate_request"]

logger = logging.getLogger(__name__)


def validate_request(request: emotion_pb2.ClassifyRequest, *, max_batch_size: int) -> str | None:
    """Returns why the request is malformed, or None when it may be served."""
    n = len(request.paragraphs)
    if n == 0:
        return "empty batch: send at least one paragraph"
    if n > max_batch_size:
        return f"batch of {n} paragraphs is over the server's maximum of {max_batch_size}"
    seen: set[str] = set()
    for i, p in enumerate(request.paragraphs):
        if not p.id:
            return f"paragraph {i} has an empty id"
        if p.id in seen:
            return f"id {p.id!r} appears more than once in the batch"
        seen.add(p.id)
    return None


@serve.deployment(name="EmotionClassifier", max_ongoing_requests=16, health_check_period_s=5)
class EmotionClassifier:
    def __init__(self, model_dir: str, settings: dict[str, Any] | None = None) -> None:
        from serve_app.model import EmotionModel, configure_tf_threads

        self._settings = ServerSettings.from_dict(settings)
        configure_tf_threads(self._intra_op_threads(), self._settings.inter_op_threads)
        self._model = EmotionModel.load(
            model_dir,
            max_sequence_length=self._settings.max_sequence_length,
            token_budget=self._settings.token_budget,
        )
        self._model.warmup()
        self._labels = list(self._model.card.labels)
        self._version = self._model.card.version
        # One thread: forward passes run one at a time, each using all the replica's cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # @serve.batch's wrapper carries these setters; its type stubs do not say so.
        self._infer.set_max_batch_size(self._settings.batch_max_calls)  # type: ignore[attr-defined]
        self._infer.set_batch_wait_timeout_s(self._settings.batch_wait_timeout_s)  # type: ignore[attr-defined]
        self._fault = self._settings.fault
        self._rng = random.Random(self._fault.seed)
        self._calls: Counter[str] = Counter()
        self._paragraphs: Counter[str] = Counter()
        if self._fault.enabled:
            logger.warning("fault injection is ON for this replica: %s", self._fault)

    def _intra_op_threads(self) -> int:
        if self._settings.intra_op_threads is not None:
            return self._settings.intra_op_threads
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        return max(1, math.ceil(cpus))

    async def Classify(
        self, request: emotion_pb2.ClassifyRequest, grpc_context: RayServegRPCContext
    ) -> emotion_pb2.ClassifyResponse:
        problem = validate_request(request, max_batch_size=self._settings.max_batch_size)
        if problem is not None:
            return self._fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, problem, len(request.paragraphs))
        if self._fault.extra_latency_s:
            await asyncio.sleep(self._fault.extra_latency_s)
        if self._fault.fail_fraction and self._rng.random() < self._fault.fail_fraction:
            code = grpc.StatusCode[self._fault.status]
            return self._fail(grpc_context, code, "injected fault", len(request.paragraphs))
        texts = [p.text for p in request.paragraphs]
        probabilities, truncated = await self._infer(texts)
        self._count("OK", len(texts))
        return emotion_pb2.ClassifyResponse(
            predictions=[
                emotion_pb2.Prediction(id=p.id, probabilities=row.tolist(), truncated=bool(cut))
                for p, row, cut in zip(request.paragraphs, probabilities, truncated, strict=True)
            ],
            labels=self._labels,
            model_version=self._version,
        )

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _infer(self, calls: list[list[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        flat = [text for texts in calls for text in texts]
        loop = asyncio.get_running_loop()
        predictions = await loop.run_in_executor(self._executor, self._model.predict, flat)
        out, start = [], 0
        for texts in calls:
            stop = start + len(texts)
            out.append((predictions.probabilities[start:stop], predictions.truncated[start:stop]))
            start = stop
        return out

    def ModelInfo(self, request: emotion_pb2.ModelInfoRequest) -> emotion_pb2.ModelInfoResponse:
        return emotion_pb2.ModelInfoResponse(
            labels=self._labels,
            model_version=self._version,
            max_sequence_length=self._model.card.max_sequence_length,
            max_batch_size=self._settings.max_batch_size,
        )

    def stats(self) -> dict[str, dict[str, int]]:
        """This replica's own counts of answered calls and paragraphs per status code."""
        return {"calls": dict(self._calls), "paragraphs": dict(self._paragraphs)}

    def _count(self, status: str, paragraphs: int) -> None:
        self._calls[status] += 1
        self._paragraphs[status] += paragraphs

    def _fail(
        self, context: RayServegRPCContext, code: grpc.StatusCode, details: str, paragraphs: int
    ) -> emotion_pb2.ClassifyResponse:
        self._count(code.name, paragraphs)
        context.set_code(code)
        context.set_details(details)
        return emotion_pb2.ClassifyResponse()
