"""What travels beside the protobuf messages: gRPC metadata keys, in one place for both sides."""

from __future__ import annotations

__all__ = ["APPLICATION_KEY", "SERVICER_FUNCTION", "TIMING_KEYS"]

APPLICATION_KEY = "application"
"""Request metadata: the Serve application that answers (Serve's gRPC proxy routes by it)."""

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
