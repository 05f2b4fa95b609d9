"""Calling the model service: the async actor and what stands between it and the wire.

`actor` (the async callable class Ray Data maps units through) -> `limiter` (in-flight
slots) -> `breaker` (one permit per call) -> `retry` -> `client` (one gRPC call) -> `channel`.
Beside them: `reuse` (answers reused by text hash) and `metrics` (the client's telemetry).
The client and the channel know nothing of Ray.
"""
