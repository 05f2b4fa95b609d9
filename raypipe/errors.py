"""raypipe's errors: one tree, typed fields, no string matching.

    RaypipeError
    ├── ConfigError                 a setting is wrong; raised before any data is read
    ├── InputError                  the input itself is wrong (shard, column)
    │   ├── NoShardsError           an input URI that matches no shards
    │   └── SchemaError             a shard lacks a required column or has a wrong type
    ├── ModelServiceError           a call to the model service failed (status_code, address)
    │   ├── ServiceUnavailable      UNAVAILABLE (or the channel could not connect)   transient
    │   ├── ServiceTimeout          DEADLINE_EXCEEDED                                transient
    │   ├── ServiceOverloaded       RESOURCE_EXHAUSTED                               transient
    │   ├── ServiceCancelled        CANCELLED by the server                          transient
    │   └── RequestRejected         INVALID_ARGUMENT and every other code            permanent
    ├── CircuitOpenError            the breaker stayed open past the allowed wait
    ├── SinkError                   results, dead letters or commit markers could not be written
    └── OutputLockedError           another run holds the output's lease

`ModelServiceError.transient` says whether a retry can help; the retry layer reads that
attribute and nothing else. gRPC errors are mapped to this tree in exactly one place,
`raypipe.client.map_rpc_error`.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "CircuitOpenError",
    "ConfigError",
    "InputError",
    "ModelServiceError",
    "NoShardsError",
    "OutputLockedError",
    "RaypipeError",
    "RequestRejected",
    "SchemaError",
    "ServiceCancelled",
    "ServiceOverloaded",
    "ServiceTimeout",
    "ServiceUnavailable",
    "SinkError",
]


class RaypipeError(Exception):
    """Base of every error raypipe raises on purpose."""

    #: Short, stable name of the failure, used in dead letters and reports.
    kind: ClassVar[str] = "error"


class ConfigError(RaypipeError):
    kind = "config"


class InputError(RaypipeError):
    kind = "bad_input"

    def __init__(self, message: str, *, shard: str | None = None) -> None:
        super().__init__(message if shard is None else f"{message} (shard {shard})")
        self.shard = shard


class NoShardsError(InputError):
    kind = "no_shards"


class SchemaError(InputError):
    kind = "schema"

    def __init__(self, message: str, *, shard: str | None = None, column: str | None = None) -> None:
        super().__init__(message, shard=shard)
        self.column = column


class ModelServiceError(RaypipeError):
    """A call to the model service failed; `status_code` is the gRPC code's name."""

    kind = "service_error"
    transient: ClassVar[bool] = False

    def __init__(self, message: str, *, status_code: str, address: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.address = address
        #: How many calls were made before this error was final; set by the retry layer.
        self.attempts = 1


class ServiceUnavailable(ModelServiceError):
    kind = "unavailable"
    transient = True


class ServiceTimeout(ModelServiceError):
    kind = "deadline_exceeded"
    transient = True


class ServiceOverloaded(ModelServiceError):
    kind = "resource_exhausted"
    transient = True


class ServiceCancelled(ModelServiceError):
    kind = "cancelled"
    transient = True


class RequestRejected(ModelServiceError):
    kind = "rejected"
    transient = False


class CircuitOpenError(RaypipeError):
    """The breaker stayed open longer than the configured total wait."""

    kind = "circuit_open"

    def __init__(self, message: str, *, waited_s: float, retry_after_s: float) -> None:
        super().__init__(message)
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s
        self.attempts = 0


class SinkError(RaypipeError):
    kind = "sink"

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message if path is None else f"{message} ({path})")
        self.path = path


class OutputLockedError(RaypipeError):
    kind = "output_locked"

    def __init__(self, message: str, *, holder: str, expires_at: str) -> None:
        super().__init__(message)
        self.holder = holder
        self.expires_at = expires_at
