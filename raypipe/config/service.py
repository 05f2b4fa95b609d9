"""The sections that say how the model service is called: its address and credentials
(`service`) and the client's retry, breaker and limiter (`client`)."""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, ValidationInfo, field_validator, model_validator

from raypipe.config.base import Frozen

_SCHEMES = {"grpc": False, "grpcs": True}
"""Address schemes and whether they mean TLS; an address without one follows `tls`."""


class ServiceConfig(Frozen):
    address: str = "127.0.0.1:9000"
    """The model service: `host:port`, `grpc://host:port` (plaintext) or `grpcs://host:port`
    (TLS, as `tls: true`). The scheme is taken off when the config is built: `address` is then
    always `host:port` and `tls` says how to reach it."""
    tls: bool = False
    """Reach the service over TLS (a TLS-terminating sidecar or mesh in front of Serve's
    plaintext gRPC proxy). Implied by a `grpcs://` address; `false` with `grpcs://`, or `true`
    with `grpc://`, is an error."""
    ca_file: str | None = None
    """PEM bundle of the CA(s) to trust for the service's certificate; None trusts gRPC's
    default roots. Read once, when the config is built (on the driver): the certificates travel
    with the config to the actors, so only the driver needs the file. Needs TLS."""
    server_name: str | None = None
    """The name the service's certificate must match (and the TLS SNI), when it is not the
    address's host, e.g. a Kubernetes Service name while `address` is an IP. Needs TLS."""
    token_env: str | None = None
    """Name of an environment variable whose value is sent as `authorization: Bearer <value>`
    metadata on every call, for a sidecar that checks it. Its value is read by the process
    that makes the calls (the driver's up-front check and every inference actor), never
    carried in the config or Ray's task arguments: set it on the driver and on every node
    that runs actors (e.g. from one Kubernetes Secret in the head and worker pod templates).
    Needs TLS, so the token never crosses the network in the clear."""
    token_file: str | None = None
    """File holding the model service's token, sent as `authorization: Bearer <token>` on every
    call (the replicas check it). None: the file `raypipe serve` writes
    (`~/.raypipe/service-token`), sent when it exists; `RAYPIPE_SERVICE_TOKEN` in the
    environment wins over either. Read by the process that makes the calls, like `token_env`:
    the file must be on every node that runs actors (e.g. a Kubernetes Secret mounted there)."""
    application: str = "raypipe"
    """Serve application name, sent as the `application` metadata so the proxy can route."""
    timeout_s: float = Field(120.0, gt=0)
    """Floor of a Classify call's deadline. The deadline is the larger of this and
    `deadline_safety` x the time the call should take: this actor's work in flight with and
    ahead of it, over the rate at which the service has been answering it (Little's law),
    so a busy but healthy service never times out a call. Also the whole deadline until
    the rate is known: the first wave of every actor's calls queues at once, and on a small
    replica (bert-base on 2 cores) the last of that wave waits tens of seconds."""
    max_timeout_s: float = Field(600.0, gt=0)
    """Ceiling of a call's deadline, so a service that stopped answering is still noticed."""
    deadline_safety: float = Field(4.0, ge=1)
    """Multiple of the expected time a call gets before it is given up."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long the up-front reachability check waits before failing the run."""

    _ca_pem: bytes | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _scheme(cls, data: Any) -> Any:
        """Takes `grpc://` or `grpcs://` off the address and into `tls`."""
        if not isinstance(data, Mapping) or not isinstance(data.get("address"), str) or "://" not in data["address"]:
            return data
        scheme, _, rest = data["address"].partition("://")
        if scheme not in _SCHEMES:
            raise ValueError(
                f"address {data['address']!r}: scheme {scheme!r} is not supported (use grpc:// or grpcs://)"
            )
        tls = _SCHEMES[scheme]
        if "tls" in data:
            try:
                asked = TypeAdapter(bool).validate_python(data["tls"])
            except ValidationError:
                return {**data, "address": rest}  # the field's own validation reports the bad value
            if asked != tls:
                raise ValueError(
                    f"address {data['address']!r} says {'TLS' if tls else 'plaintext'} but tls is {str(asked).lower()}"
                )
        return {**data, "address": rest, "tls": tls}

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if not re.fullmatch(r"\[?[\w.\-:]+\]?:\d{1,5}", v):
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("server_name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9\-.]*[A-Za-z0-9])?", v):
            raise ValueError(f"{v!r} is not a host name")
        return v

    @field_validator("token_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        # Never echo the value: a token pasted here by mistake must not land in a log.
        if v is not None and (not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) or _looks_like_a_token(v)):
            raise ValueError("must name an environment variable (letters, digits, _), not hold the token itself")
        return v

    @model_validator(mode="after")
    def _tls_settings(self, info: ValidationInfo) -> ServiceConfig:
        if not self.tls:
            given = [k for k in ("ca_file", "server_name", "token_env") if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} TLS: use a grpcs:// address or "
                    "tls: true" + (" (a token must not cross the network in the clear)" if "token_env" in given else "")
                )
        if self.ca_file is not None and not (info.context or {}).get("offline"):
            self._ca_pem = _read_ca_bundle(Path(self.ca_file))
        return self

    @property
    def ca_pem(self) -> bytes | None:
        """The certificates of `ca_file` (PEM), as read when the config was built."""
        return self._ca_pem


def _read_ca_bundle(path: Path) -> bytes:
    """The PEM bundle at `path`, checked to hold at least one certificate OpenSSL can load."""
    try:
        pem = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read CA file {path}: {e.strerror or e}") from e
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as e:
        raise ValueError(f"CA file {path} holds no PEM certificate OpenSSL can load ({e})") from e
    return pem


class RetryConfig(Frozen):
    max_attempts: int = Field(4, ge=1, le=20)
    """Attempts per call on a transient code; also the calls a micro-batch makes on service
    codes before a canary decides whether the service or the rows are at fault. Rows never
    become dead letters by this count (`raypipe.call.actor`)."""
    initial_backoff_s: float = Field(0.1, gt=0)
    """Scale of the exponential backoff (full jitter)."""
    max_backoff_s: float = Field(5.0, gt=0)
    """Cap of one backoff sleep."""


class BreakerConfig(Frozen):
    failure_threshold: int = Field(5, ge=1)
    """Consecutive failed calls (per actor, each after its retries) that open the breaker; a
    call whose rows a canary showed at fault is no failure of the service (`raypipe.call.breaker`)."""
    reset_timeout_s: float = Field(1.0, gt=0)
    """Time open before one probe call is let through; doubles while probes fail."""
    max_reset_timeout_s: float = Field(30.0, gt=0)
    """Cap of the doubled reset timeout."""
    max_wait_s: float = Field(600.0, gt=0)
    """How long an outage may last, counted from the breaker's opening (failed probes
    included, however often a caller asks again); past it every waiting and new call gets
    `CircuitOpenError` and the run stops (exit 1) within `max_wait_s` plus one reset period,
    its rows still to do; rerunning the same run id resumes it. Nothing is dead-lettered for
    a service that is down."""


class LimiterConfig(Frozen):
    kind: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive` finds the in-flight limit from the server's overload signals (AIMD);
    `fixed` holds `initial`."""
    initial: int = Field(2, ge=1)
    """Starting limit (the limit itself for `fixed`), per actor. Small: calls sent before the
    service's rate is measured get the deadline floor (`service.timeout_s`), and a call of 128
    paragraphs of bert-base takes tens of seconds on 2 cores; two calls of many forward passes
    each keep a replica's model threads busy, and the limit grows from there while the
    replica reports no work waiting."""
    min_limit: int = Field(2, ge=1)
    """Lower bound of the adaptive limit: one call in the replica's batch, one waiting."""
    max_limit: int = Field(64, ge=1)
    """Upper bound of the adaptive limit."""
    backoff_ratio: float = Field(0.9, gt=0, lt=1)
    """Multiplicative decrease on an overload signal."""
    queue_tolerance: int = Field(0, ge=0)
    """Whole batches a call may wait behind in the replica (beyond the running one) before
    it counts as overload; 0 keeps about one batch queued, enough to keep the model busy."""
    outside_slack_s: float = Field(0.25, gt=0)
    """Time a call may spend in front of the replica (proxy queue, network) before it counts
    as overload."""

    @model_validator(mode="after")
    def _bounds(self) -> LimiterConfig:
        if self.min_limit > self.max_limit:
            raise ValueError(f"min_limit {self.min_limit} > max_limit {self.max_limit}")
        if self.kind == "adaptive" and not self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(f"initial {self.initial} is outside [{self.min_limit}, {self.max_limit}]")
        return self


class ClientConfig(Frozen):
    max_text_bytes: int = Field(16 * 2**20, ge=1, le=16 * 2**20)
    """Largest text (UTF-8 bytes) that is sent; a longer one is a dead letter `too_large` with its
    size, never a call. At most 16 MiB, the bytes of text one call carries (the service refuses
    messages over 32 MiB); the model reads only its first `max_sequence_length` tokens anyway."""
    micro_batch_size: int = Field(128, ge=1, le=4096)
    """Most paragraphs per Classify call (1: one call per paragraph); a call also stops at
    16 MiB of text (`raypipe.call.batches.CALL_TEXT_BYTES`), so long documents go in smaller
    calls. A call costs the actor, Serve's proxy and the replica a fixed share besides its rows, and a
    call of many length-sorted rows splits into forward passes that pad little and spread
    evenly over the replica's model threads (docs/performance.md, "What a bigger call buys",
    measures 32, 64 and 128)."""
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    limiter: LimiterConfig = LimiterConfig()


def _looks_like_a_token(name: str) -> bool:
    """A value no one names a variable: long, and mixing lower-case letters with digits (a hex
    or base64 token), or longer than any variable name in use."""
    lower_and_digits = any(c.islower() for c in name) and sum(c.isdigit() for c in name) >= 4
    return len(name) > 64 or (len(name) >= 20 and lower_and_digits)
