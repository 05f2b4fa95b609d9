"""The EmotionClassifier Ray Serve deployment, served over Serve's gRPC proxy.

One replica owns a tokenizer and a TensorFlow model (`serve_app.model.EmotionModel`), loaded
and warmed in the constructor, so the replica only reports healthy once it can answer fast.
`Classify` validates the request (malformed ones get INVALID_ARGUMENT and the replica stays
up), applies server-side fault injection if the deployer switched it on, tokenizes the texts
on a tokenizer thread, then hands them to `_infer`, which `@serve.batch` merges across
concurrent callers up to a token budget. A merged batch is cut into length-sorted forward
passes (`EmotionModel.chunks`), and its passes go to the `model_threads` model threads at once
(by default one per replica core, each pass single-threaded: see
`ServerSettings.model_threads`), longest first, so one batch keeps every core busy however
many calls it merged; a second batch may form meanwhile and its passes queue behind. Tokenizing
the next calls overlaps the current passes, so a busy replica's model threads run passes back
to back.

A replica with ``precision: auto`` and no record for its CPU serves the default at once and
measures itself in the background (`serve_app.self_measure`); it may switch to another setting
with the reference's answers, never to one that changes its model version.

A service deployed with a credential (`raypipe serve` always does: `protos.credential`) checks
each call's bearer token against the digest it was given before anything else: a call without
it gets UNAUTHENTICATED and never reaches the tokenizer or the model.

Every answer carries the replica's view of the call in its trailing metadata (`TIMING_KEYS`):
how long it waited in the replica, how long its batch computed, and how many other batches
still had passes waiting for a model thread when its batch queued its own (`_WaitingBatches`).
A client throttles on these (a call that waited behind
more than the next batch means the replica holds more work than it can use), not on raw
latency, which is mostly batching wait on a busy, healthy replica.

Method names equal the RPC names of `raypipe.v1.EmotionClassifier`: Serve routes by them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from protos.credential import token_matches
from protos.raypipe.v1 import emotion_pb2
from protos.wire import TIMING_KEYS
from serve_app.metrics import ServerMetrics
from serve_app.model import Chunk, Tokenized, cpu_flags
from serve_app.self_measure import SelfMeasure
from serve_app.settings import ServerSettings

if TYPE_CHECKING:
    from serve_app.model import EmotionModel
    from serve_app.runtimes import Serving

__all__ = [
    "TIMING_KEYS",
    "Batch",
    "EmotionClassifier",
    "ThreadLayout",
    "batch_weight",
    "concurrent_batches",
    "set_concurrent_batches",
    "thread_layout",
    "usable_cores",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """A Classify request's paragraphs, in either form (`protos/raypipe/v1/emotion.proto`)."""

    ids: list[str]
    texts: list[str]
    columns: bool
    """It came in the column form, and is answered in it."""
    mixed: bool = False
    """It held paragraphs in both forms (malformed)."""

    @classmethod
    def of(cls, request: emotion_pb2.ClassifyRequest) -> Batch:
        if request.ids or request.texts:
            return cls(list(request.ids), list(request.texts), columns=True, mixed=bool(request.paragraphs))
        return cls([p.id for p in request.paragraphs], [p.text for p in request.paragraphs], columns=False)

    def problem(self, *, max_batch_size: int) -> str | None:
        """Why the request is malformed, or None when it may be served."""
        n = len(self.ids)
        if self.mixed:
            return "a request holds paragraphs in one form: `paragraphs`, or `ids` with `texts`"
        if len(self.texts) != n:
            return f"{n} ids but {len(self.texts)} texts: send one text per id"
        if n == 0:
            return "empty batch: send at least one paragraph"
        if n > max_batch_size:
            return f"batch of {n} paragraphs is over the server's maximum of {max_batch_size}"
        distinct = set(self.ids)
        if len(distinct) == n and "" not in distinct:
            return None
        seen: set[str] = set()
        for i, id_ in enumerate(self.ids):
            if not id_:
                return f"paragraph {i} has an empty id"
            if id_ in seen:
                return f"id {id_!r} appears more than once in the batch"
            seen.add(id_)
        return None


def _app_name() -> str:
    """The Serve application this replica belongs to (a metrics tag)."""
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().app_name)
    except RayServeException:  # constructed outside Serve: no application
        return ""


@dataclass(frozen=True)
class ThreadLayout:
    """How a replica spends its cores: `model` batches at once, each forward pass on
    `intra_op` threads; TensorFlow's inter-op pool has `inter_op` threads."""

    model: int
    intra_op: int
    inter_op: int


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity): a node may declare more logical CPUs
    to Ray than it has (`ray start --num-cpus`), and threads beyond the cores only take turns."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def thread_layout(settings: ServerSettings, cpus: float, cores_here: int) -> ThreadLayout:
    """The thread counts for a replica with `cpus` CPUs on a host whose process may use
    `cores_here` cores, from the settings or their defaults (explicit settings are kept as given)."""
    cores = max(1, min(math.ceil(cpus - 1e-9), cores_here))
    model = settings.model_threads or cores
    intra = settings.intra_op_threads or max(1, math.ceil(cores / model))
    return ThreadLayout(model=model, intra_op=intra, inter_op=settings.inter_op_threads or model)


def concurrent_batches(threads: ThreadLayout) -> int:
    """Batches a replica runs at once: two per model thread. Their passes share the model
    threads through one FIFO queue, so more batches cost no extra compute; what matters is that
    a thread done with its pass finds the next one queued. With one batch per thread, a thread
    that ended its pass while its neighbour's batch still ran stayed idle until a batch ended
    (Serve starts a batch only when one ends); the bench's speed section shows the cores busy."""
    return 2 * threads.model


def set_concurrent_batches(batch_method: Any, n: int) -> None:
    """Lets `@serve.batch` run `n` batches at once (its decorator argument is fixed at class
    definition; the batch queue reads it when the first request creates it).

    Serve has no public setter for it, unlike max_batch_size; its lazy queue wrapper is the
    object behind the public `set_max_batch_size`. A Ray version that moves it fails here,
    loudly, rather than silently computing one batch at a time.
    """
    wrapper = getattr(batch_method.set_max_batch_size, "__self__", None)
    if wrapper is None or not hasattr(wrapper, "max_concurrent_batches") or getattr(wrapper, "_queue", None):
        raise RuntimeError("cannot set @serve.batch's max_concurrent_batches on this Ray version")
    wrapper.max_concurrent_batches = n


def _replica_cpus() -> float:
    """The CPUs Serve gave this replica; 1 when constructed outside Ray (as `_app_name` says "")."""
    import ray

    if not ray.is_initialized():
        return 1.0
    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
    except AssertionError:  # a driver, not a worker: nothing assigned
        return 1.0


class _ThreadCpu:
    """CPU time of a set of this process's threads (Linux ``/proc``), read as deltas.

    The model's runtime computes on threads of its own (TensorFlow's ``tf_Compute`` pool,
    OpenVINO's stream executors), not on the thread that calls it, so the caller's
    ``thread_time`` sees none of it, and the process's CPU also holds tokenizing, gRPC and Ray.
    The threads that loading and warming the model started are the runtime's: their CPU is the
    model's cost. Elsewhere (no ``/proc``) `spent` is None and the caller estimates.
    """

    _TASKS = "/proc/self/task"

    def __init__(self, ids: set[int]) -> None:
        self._ids = ids
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._total()

    @classmethod
    def thread_ids(cls) -> set[int]:
        try:
            return {int(t) for t in os.listdir(cls._TASKS)}
        except OSError:
            return set()

    def _total(self) -> float | None:
        if not self._ids:
            return None
        ticks = 0
        for tid in self._ids:
            try:
                with open(f"{self._TASKS}/{tid}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a thread that ended: its time is gone with it
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / self._tick

    def add_current_thread(self) -> None:
        """Count the calling thread too (from its next `spent` on, with all it has spent so far)."""
        tid = threading.get_native_id()
        if tid not in self._ids:
            self._ids = self._ids | {tid}
            if self._last is None:
                self._last = 0.0

    def spent(self) -> float | None:
        """CPU seconds of the threads since the previous call (None where it cannot be read)."""
        total = self._total()
        if total is None or self._last is None:
            return None
        spent, self._last = max(0.0, total - self._last), total
        return spent


@dataclass(frozen=True)
class _Job:
    """One call waiting for a batch."""

    tokenized: Tokenized
    weight: float
    """Its share of a batch, in calls: max(1 call, its tokens in units of budget / max calls)."""


@dataclass(frozen=True)
class _Done:
    probabilities: np.ndarray
    truncated: np.ndarray
    started: float
    compute_s: float
    batches_ahead: int
    """Other batches with passes still waiting for a model thread when this one queued its own."""
    model_cpu_s: float
    """This call's rows' share of the batch's forward passes, in core-seconds (wall x threads)."""


class _WaitingBatches:
    """Which batches have forward passes waiting in the model threads' queue (FIFO), so a batch
    can say how many wait ahead of it: the replica's measure of work it holds but cannot use yet.
    `queued` runs on the event loop, `started` on the model threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unstarted: dict[int, int] = {}
        self._next = 0

    def queued(self, passes: int) -> tuple[int, int]:
        """A batch of `passes` passes goes into the queue: (its key, batches waiting ahead of it)."""
        with self._lock:
            self._next += 1
            ahead = len(self._unstarted)
            if passes:
                self._unstarted[self._next] = passes
            return self._next, ahead

    def started(self, key: int) -> None:
        """One of batch `key`'s passes left the queue for a model thread."""
        with self._lock:
            left = self._unstarted.get(key, 0) - 1
            if left > 0:
                self._unstarted[key] = left
            else:
                self._unstarted.pop(key, None)


def batch_weight(jobs: list[_Job]) -> int:
    """`@serve.batch`'s size of a batch, in calls: both a call count and a token budget.

    Serve's batch queue takes one number per batch and compares it with max_batch_size
    (here `batch_max_calls`, which must stay <= max_ongoing_requests). Each job weighs
    its tokens as a fraction of `batch_max_tokens`, scaled to calls, but at least 1, so a
    batch stops at whichever of the two limits it reaches first.
    """
    return max(len(jobs), math.ceil(sum(j.weight for j in jobs) - 1e-9))


_UNAUTHENTICATED = (
    "missing or wrong service credential: send `authorization: Bearer <token>` metadata with the token "
    "`raypipe serve` wrote (service.token_file, default ~/.raypipe/service-token, or RAYPIPE_SERVICE_TOKEN)"
)


@serve.deployment(name="EmotionClassifier", max_ongoing_requests=64, health_check_period_s=5)
class EmotionClassifier:
    def __init__(self, model_dir: str, settings: dict[str, Any] | None = None, token_sha256: str | None = None) -> None:
        """`token_sha256`: the digest of the token every call must carry (None: no credential checked)."""
        self._token_sha256 = token_sha256
        from serve_app.model import read_model_card
        from serve_app.runtimes import resolve, served_version

        self._settings = ServerSettings.from_dict(settings)
        self._threads = thread_layout(self._settings, _replica_cpus(), usable_cores())
        # The runtime x precision the settings, the measured record and this CPU allow (or a GateError).
        serving = resolve(model_dir, self._settings)
        self._precision = serving.precision
        self._model_dir = model_dir
        self._model, self._model_cpu = self._load(serving)
        self._labels = list(self._model.card.labels)
        # The version names what changes answers (`serve_app.runtimes.served_version`); the
        # setting says what computed them.
        self._version = served_version(
            self._model.card.version,
            serving,
            max_sequence_length=self._model.card.max_sequence_length,
            model_max=read_model_card(model_dir).max_sequence_length,
        )
        self._setting = serving.setting
        logger.info("EmotionClassifier %s ready: %s (%s)", self._version, serving.setting, serving.reason)
        # `model_threads` batches compute at once, each on its own thread (and, by default,
        # on one core: see ServerSettings.model_threads). Tokenizing has its own thread, so
        # it overlaps the forward passes.
        self._model_executor = ThreadPoolExecutor(max_workers=self._threads.model, thread_name_prefix="model")
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # @serve.batch's wrapper carries these setters; its type stubs do not say so.
        self._infer.set_max_batch_size(self._settings.batch_max_calls)  # type: ignore[attr-defined]
        self._infer.set_batch_wait_timeout_s(self._settings.batch_wait_timeout_s)  # type: ignore[attr-defined]
        set_concurrent_batches(self._infer, concurrent_batches(self._threads))
        self._tokens_per_call = self._settings.batch_max_tokens / self._settings.batch_max_calls
        self._waiting = _WaitingBatches()
        self._fault = self._settings.fault
        self._rng = random.Random(self._fault.seed)  # noqa: S311  seeded fault injection, not a secret
        self._calls: Counter[str] = Counter()
        self._paragraphs: Counter[str] = Counter()
        self._model_counts: Counter[str] = Counter()
        self._timing_us: Counter[str] = Counter()
        self._in_flight = 0  # calls arrived and not yet answered
        if self._fault.enabled:
            logger.warning("fault injection is ON for this replica: %s", self._fault)
        self._metrics = ServerMetrics.build(
            self._settings.metrics,
            environ=os.environ,
            app=_app_name(),
            model_version=self._version,
            setting=self._setting,
        )
        # No record for this CPU: serve the default now, measure in the background, and switch only
        # among settings with the reference's answers (`serve_app.self_measure`).
        self._self_measure: threading.Thread | None = None
        flags = cpu_flags()
        if SelfMeasure.wanted(serving, self._settings, flags=flags, openvino=find_spec("openvino") is not None):
            self._self_measure = SelfMeasure(
                model_dir,
                serving,
                self._settings,
                switch=self._switch,
                flags=flags,
                threads=self._threads.model * self._threads.intra_op,
            ).start()

    def _load(self, serving: Serving) -> tuple[EmotionModel, _ThreadCpu]:
        """The model of ``serving`` loaded and warmed up, and its runtime's compute threads."""
        from serve_app.model import EmotionModel, configure_precision, configure_tf_threads

        if serving.runtime == "tensorflow":
            # Before TensorFlow first runs a graph (warmup): its thread pools are fixed then, and
            # Grappler rewrites the graph then. Other runtimes never import TensorFlow (seconds
            # of every replica's start).
            configure_tf_threads(self._threads.intra_op, self._threads.inter_op)
            configure_precision(serving.precision)
        threads_before = _ThreadCpu.thread_ids()
        model = EmotionModel.load(
            self._model_dir,
            max_sequence_length=self._settings.max_sequence_length,
            token_budget=self._settings.token_budget,
            precision=serving.precision,
            runtime=serving.runtime,
            threads=self._threads.intra_op,
            streams=self._threads.model,  # OpenVINO: one stream per model thread, as TensorFlow's passes
            recheck_margin=serving.margin,
        )
        model.warmup()
        # The runtime's own compute threads are the ones loading and warming it up started.
        return model, _ThreadCpu(_ThreadCpu.thread_ids() - threads_before)

    def _switch(self, serving: Serving) -> None:
        """Answer with ``serving`` from the next forward pass on (`serve_app.self_measure`: an
        equal-answer setting, so the model version stays). Passes already running finish on the
        model they started on; both models cut texts alike (same card, same token budget)."""
        model, model_cpu = self._load(serving)
        self._model, self._model_cpu, self._setting, self._precision = (
            model,
            model_cpu,
            serving.setting,
            serving.precision,
        )
        logger.info("EmotionClassifier %s now serves %s (%s)", self._version, serving.setting, serving.reason)

    async def Classify(
        self, request: emotion_pb2.ClassifyRequest, grpc_context: RayServegRPCContext
    ) -> emotion_pb2.ClassifyResponse:
        self._in_flight += 1
        try:
            return await self._classify(request, grpc_context)
        finally:
            self._in_flight -= 1

    async def _classify(
        self, request: emotion_pb2.ClassifyRequest, grpc_context: RayServegRPCContext
    ) -> emotion_pb2.ClassifyResponse:
        arrived = time.monotonic()
        if not self._authorized(grpc_context):
            return self._fail(grpc_context, grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED, 0)
        batch = Batch.of(request)
        problem = batch.problem(max_batch_size=self._settings.max_batch_size)
        if problem is not None:
            return self._fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, problem, len(batch.ids))
        texts = batch.texts
        if self._fault.extra_latency_s:
            await asyncio.sleep(self._fault.extra_latency_s)
        poisoned = self._fault.poison_text is not None and any(self._fault.poison_text in t for t in texts)
        if poisoned or (self._fault.fail_fraction and self._rng.random() < self._fault.fail_fraction):
            code = grpc.StatusCode[self._fault.status]
            return self._fail(grpc_context, code, "injected fault", len(texts))
        loop = asyncio.get_running_loop()
        tokenize_started = time.monotonic()
        tokenized = await loop.run_in_executor(self._tokenize_executor, self._model.tokenize, texts)
        tokenize_s = time.monotonic() - tokenize_started
        tokens = min(tokenized.tokens, self._settings.batch_max_tokens)
        job = _Job(tokenized, max(1.0, tokens / self._tokens_per_call))
        done: _Done = await self._infer(job)
        self._count("OK", len(texts))
        timing = {
            "queue_s": done.started - arrived,
            "compute_s": done.compute_s,
            "replica_s": time.monotonic() - arrived,
            "model_cpu_s": done.model_cpu_s,
        }
        metadata = [(TIMING_KEYS[k], f"{v * 1000:.1f}") for k, v in timing.items()]
        metadata.append((TIMING_KEYS["batches_ahead"], str(done.batches_ahead)))
        grpc_context.set_trailing_metadata(metadata)
        # Sums over answered calls, for the bench's profile of where a call's time goes.
        self._timing_us.update(
            calls=1, tokenize=round(tokenize_s * 1e6), **{k: round(v * 1e6) for k, v in timing.items()}
        )
        self._metrics.timing(queue_s=timing["queue_s"], replica_s=timing["replica_s"])
        return self._answer(batch, done)

    def _answer(self, batch: Batch, done: _Done) -> emotion_pb2.ClassifyResponse:
        """The response in the request's form: packed columns, or one Prediction per paragraph."""
        if batch.columns:
            return emotion_pb2.ClassifyResponse(
                probabilities=np.ascontiguousarray(done.probabilities, dtype="<f4").tobytes(),
                truncated=done.truncated.tolist(),
                labels=self._labels,
                model_version=self._version,
                setting=self._setting,
            )
        return emotion_pb2.ClassifyResponse(
            predictions=[
                emotion_pb2.Prediction(id=i, probabilities=row.tolist(), truncated=bool(cut))
                for i, row, cut in zip(batch.ids, done.probabilities, done.truncated, strict=True)
            ],
            labels=self._labels,
            model_version=self._version,
            setting=self._setting,
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, batch_size_fn=batch_weight)
    async def _infer(self, jobs: list[_Job]) -> list[_Done]:
        merged = Tokenized.concat([j.tokenized for j in jobs])
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        # The batch's forward passes go to the model threads at once, longest first, so the
        # threads finish together; the next batch's passes queue behind them (FIFO).
        chunks = sorted(self._model.chunks(merged), key=lambda c: -c.padded_tokens)
        key, ahead = self._waiting.queued(len(chunks))
        outputs = await asyncio.gather(
            *(loop.run_in_executor(self._model_executor, self._run_chunk, merged, c, key) for c in chunks)
        )
        probabilities = np.empty((len(merged), len(self._labels)), dtype=np.float32)
        for chunk, answer in zip(chunks, outputs, strict=True):
            probabilities[chunk.rows] = answer
        padded = sum(c.padded_tokens for c in chunks)
        compute_s = time.monotonic() - started
        self._model_counts["batches"] += 1
        self._model_counts["passes"] += len(chunks)
        self._model_counts["tokens"] += merged.tokens
        self._model_counts["busy_ms"] += round(compute_s * 1000)
        self._model_counts["padded_tokens"] += padded
        self._metrics.batch(calls=len(jobs), rows=len(merged), tokens=merged.tokens, compute_s=compute_s)
        # Core-seconds the runtime's threads spent since the last batch ended, shared by rows
        # (batches running side by side share them in the order they end: the sum is exact).
        spent = self._model_cpu.spent()
        if spent is None:  # no per-thread figures here: a pass runs on `intra_op` threads
            spent = compute_s * self._threads.intra_op * min(len(chunks), self._threads.model)
        per_row = spent / max(1, len(merged))
        out: list[_Done] = []
        start = 0
        for job in jobs:
            stop = start + len(job.tokenized)
            out.append(
                _Done(
                    probabilities[start:stop],
                    merged.truncated[start:stop],
                    started,
                    compute_s,
                    ahead,
                    per_row * (stop - start),
                )
            )
            start = stop
        return out

    def _run_chunk(self, tokenized: Tokenized, chunk: Chunk, batch: int) -> np.ndarray:
        """One forward pass of `batch` on a model thread, which counts as the model's CPU: a
        runtime on one thread (one OpenVINO stream, say) computes on the thread that calls it."""
        self._waiting.started(batch)
        self._model_cpu.add_current_thread()
        return self._model.run_chunk(tokenized, chunk)

    def ModelInfo(
        self, request: emotion_pb2.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> emotion_pb2.ModelInfoResponse:
        if not self._authorized(grpc_context):
            self._fail(grpc_context, grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED, 0)
            return emotion_pb2.ModelInfoResponse()
        return emotion_pb2.ModelInfoResponse(
            labels=self._labels,
            model_version=self._version,
            max_sequence_length=self._model.card.max_sequence_length,
            max_batch_size=self._settings.max_batch_size,
            setting=self._setting,
            columns=True,
        )

    def stats(self) -> dict[str, dict[str, int]]:
        """This replica's own counts of answered calls and paragraphs per status code, of its
        forward passes (`model`: batches, tokens, busy_ms), and the summed timing of answered
        calls in microseconds (`timing_us`: calls, tokenize, queue_s (tokenize included),
        compute_s, replica_s; the `TIMING_KEYS` names), and the calls it holds now
        (`in_flight`: calls)."""
        return {
            "in_flight": {"calls": self._in_flight},
            "calls": dict(self._calls),
            "paragraphs": dict(self._paragraphs),
            "model": dict(self._model_counts),
            "timing_us": dict(self._timing_us),
        }

    def _authorized(self, context: RayServegRPCContext) -> bool:
        return self._token_sha256 is None or token_matches(context.invocation_metadata(), self._token_sha256)

    def _count(self, status: str, paragraphs: int) -> None:
        self._calls[status] += 1
        self._paragraphs[status] += paragraphs
        self._metrics.request(status, paragraphs)

    def _fail(
        self, context: RayServegRPCContext, code: grpc.StatusCode, details: str, paragraphs: int
    ) -> emotion_pb2.ClassifyResponse:
        self._count(code.name, paragraphs)
        context.set_code(code)
        context.set_details(details)
        return emotion_pb2.ClassifyResponse()
