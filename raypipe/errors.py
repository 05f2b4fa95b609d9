"""raypipe's errors: one tree, typed fields, no string matching.

    RaypipeError
    ├── ConfigError                 a setting is wrong; raised before any data is read
    │   └── RunNotFoundError        no report for that run id at that output (names the nearest)
    ├── InputError                  the input itself is wrong (shard, column)
    │   ├── NoShardsError           an input URI that matches no shards
    │   ├── SchemaError             a shard lacks a required column or has a wrong type
    │   ├── ShardChangedError       a shard was rewritten between planning and reading
    │   └── BadRowError             one row cannot be sent: a dead letter, the unit goes on
    │       ├── InvalidTextError    text not valid UTF-8
    │       ├── InvalidIdError      id not valid UTF-8
    │       ├── TextTooLargeError   text over client.max_text_bytes (never sent)
    │       └── MissingIdError      id null or empty
    ├── ModelServiceError           a call to the model service failed (status_code, address)
    │   ├── ServiceUnavailable      UNAVAILABLE (or the channel could not connect)   transient, service
    │   ├── ServiceTimeout          DEADLINE_EXCEEDED                                transient, service
    │   ├── ServiceOverloaded       RESOURCE_EXHAUSTED                               transient, service
    │   ├── ServiceCancelled        CANCELLED by the server                          transient, service
    │   ├── ServiceInternal         INTERNAL, UNKNOWN (a replica died mid-call?)     transient, ambiguous
    │   ├── ServiceTlsError         TLS handshake failed (CA, name, TLS mismatch)    permanent, set-up
    │   └── RequestRejected         INVALID_ARGUMENT and every other code            permanent, ambiguous
    ├── CircuitOpenError            the service stayed down past the allowed wait: the run stops
    ├── SinkError                   results, dead letters or commit markers could not be written
    │   └── OutputPermissionError   the output refuses our credentials (403)
    ├── OutputLockedError           another run holds the output's lease
    │   └── LeaseLostError          this attempt was fenced off by a newer one: it stops writing
    └── UnsafeOutputError           the output store ignores conditional writes (no fencing)

    RunStopped (a SystemExit)       SIGTERM stopped the run: its report says failed; the same
                                    run id resumes it. Exit code 143 unless caught.

Two attributes drive the client's decisions, and nothing else is read:
- `ModelServiceError.transient`: the retry layer retries an error only when it is set;
- `ModelServiceError.service_fault`: True when the code says the *service* is at fault
  (it is down, slow or overloaded), so the rows must go back to be sent again and the breaker
  decides when to stop; False when the call may have failed because of its rows (INTERNAL from
  a replica a poison paragraph crashed, INVALID_ARGUMENT): those calls are attributed by a
  canary call before any row is isolated (see `raypipe.call.actor`).

gRPC errors are mapped to this tree in exactly one place, `raypipe.call.client.map_rpc_error`.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BadRowError",
    "CircuitOpenError",
    "ConfigError",
    "InputError",
    "InvalidIdError",
    "InvalidRowError",
    "InvalidTextError",
    "LeaseLostError",
    "MissingIdError",
    "ModelServiceError",
    "NoShardsError",
    "OutputLockedError",
    "OutputPermissionError",
    "RaypipeError",
    "RequestRejected",
    "RunNotFoundError",
    "RunStopped",
    "SchemaError",
    "ServiceCancelled",
    "ServiceInternal",
    "ServiceOverloaded",
    "ServiceTimeout",
    "ServiceTlsError",
    "ServiceUnavailable",
    "ServiceWrongModel",
    "ShardChangedError",
    "SinkError",
    "TextTooLargeError",
    "UnsafeOutputError",
]


class RaypipeError(Exception):
    """Base of every error raypipe raises on purpose."""

    #: Short, stable name of the failure, used in dead letters and reports.
    kind: ClassVar[str] = "error"


class ConfigError(RaypipeError):
    kind = "config"


class RunNotFoundError(ConfigError):
    """No report for `run_id` under `output`; `nearest` is the closest run id there, if any."""

    kind = "run_not_found"

    def __init__(self, message: str, *, run_id: str, output: str, nearest: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.output = output
        self.nearest = nearest


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


class ShardChangedError(InputError):
    """A shard was rewritten between planning and reading: it is re-planned, never mixed."""

    kind = "shard_changed"


class BadRowError(InputError):
    """One row cannot be sent (its fate is a dead letter; the rest of its unit goes on)."""

    kind = "bad_row"


class InvalidTextError(BadRowError):
    """The text is not valid UTF-8 (the message has the first bytes in hex)."""

    kind = "invalid_text"


class InvalidIdError(BadRowError):
    """The id is not valid UTF-8."""

    kind = "invalid_id"


class InvalidRowError(BadRowError):
    """A JSON-lines line that is not a JSON object (the message says what it is, and its line)."""

    kind = "invalid_row"


class TextTooLargeError(BadRowError):
    """The text is over `client.max_text_bytes`: it is never sent (the message says its size)."""

    kind = "too_large"


class MissingIdError(BadRowError):
    """The id is null or empty."""

    kind = "missing_id"


class ModelServiceError(RaypipeError):
    """A call to the model service failed; `status_code` is the gRPC code's name."""

    kind = "service_error"
    transient: ClassVar[bool] = False
    service_fault: ClassVar[bool] = True

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


class ServiceWrongModel(ModelServiceError):
    """The service answered, but as another model (version or labels) than the run's. Ray
    Serve's gRPC proxy sends a call naming an application that is not deployed (deleted, being
    redeployed, misspelt) to the only one left, so a service that is gone can answer as another
    model. The service's fault, sent again like an outage: the breaker waits for the run's model
    to come back, and past `breaker.max_wait_s` the run stops with its rows still to do."""

    kind = "wrong_model"
    transient = True


class ServiceCancelled(ModelServiceError):
    kind = "cancelled"
    transient = True


class ServiceInternal(ModelServiceError):
    """INTERNAL or UNKNOWN: a replica that died mid-call answers so, and so does a broken model."""

    kind = "internal"
    transient = True
    service_fault = False


class ServiceTlsError(ModelServiceError):
    """The TLS handshake with the service failed: its certificate is not trusted or not for the
    name asked, or one side speaks TLS and the other does not. Retrying cannot fix it, so
    `raypipe.call.client.check_service` raises it before any data is read."""

    kind = "tls"
    transient = False

    def __init__(self, message: str, *, address: str, reason: str) -> None:
        super().__init__(message, status_code="UNAVAILABLE", address=address)
        self.reason = reason
        """What failed, e.g. `certificate verify failed: unable to get local issuer certificate`."""


class RequestRejected(ModelServiceError):
    kind = "rejected"
    transient = False
    service_fault = False


class CircuitOpenError(RaypipeError):
    """The model service stayed down (breaker open) longer than the configured total wait.

    The run stops with its remaining rows still to do; rerunning the same run id resumes it.
    """

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


class OutputPermissionError(SinkError):
    kind = "permission"


class OutputLockedError(RaypipeError):
    kind = "output_locked"

    def __init__(self, message: str, *, holder: str, expires_at: str) -> None:
        super().__init__(message)
        self.holder = holder
        self.expires_at = expires_at


class LeaseLostError(OutputLockedError):
    """A newer attempt (generation) took this run's lease; this attempt must not write again."""

    kind = "lease_lost"


class UnsafeOutputError(RaypipeError):
    """The output's object store ignores conditional writes, so two writers cannot be fenced."""

    kind = "unsafe_output"


class RunStopped(SystemExit):
    """SIGTERM stopped the run (`raypipe.run.modes`): it was aborted and its report written, status
    `failed`. A `SystemExit` (code 143, as a shell reports a process SIGTERM ended), so no
    `except Exception` swallows it on its way out; rerunning the same run id resumes the run."""

    kind = "stopped"

    def __init__(self, message: str) -> None:
        super().__init__(143)
        self.message = message

    def __str__(self) -> str:
        return self.message
