"""What travels beside the protobuf messages: gRPC metadata keys, in one place for both sides."""

from __future__ import annotations

__all__ = ["APPLICATION_KEY", "MAX_MESSAGE_BYTES", "SERVICER_FUNCTION", "TIMING_KEYS"]

APPLICATION_KEY = "application"
"""Request metadata: the Serve application that answers (Serve's gRPC proxy routes by it)."""

MAX_MESSAGE_BYTES = 32 * 2**20
"""Largest gRPC message either side accepts: a call's texts are cut at 16 MiB (the client's call
cap, `raypipe.call.batches.CALL_TEXT_BYTES`); twice that leaves room for ids and framing, and a
bigger message is refused before it is read whole (Serve's own limit is 2 GiB)."""

SERVICER_FUNCTION = "protos.raypipe.v1.emotion_pb2_grpc.add_EmotionClassifierServicer_to_server"
"""What Serve's gRPC proxy registers (`grpc_options.grpc_servicer_functions`)."""

TIMING_KEYS = {
    "queue_s": "raypipe-queue-ms",  # arrival in the replica -> its batch started
    "compute_s": "raypipe-compute-ms",  # the forward passes of its batch
    "replica_s": "raypipe-replica-ms",  # arrival in the replica -> answer
    "batches_ahead": "raypipe-batches-ahead",  # other batches with passes waiting when its batch queued
    "model_cpu_s": "raypipe-model-cpu-ms",  # its rows' share of its batch's forward passes, core-ms
}
"""Trailing metadata of a successful Classify answer (values are decimal strings): the
replica's timing, which the client's in-flight limiter reads, and the model's cost of the call
(`raypipe.run.cost`)."""
