"""The channel to the model service, plaintext or TLS, built in one place.

Ray Serve's gRPC proxy speaks plaintext only (Ray 2.60 has no TLS option; Ray issue #34103).
Encryption in transit comes from a TLS-terminating sidecar or mesh in front of it, and the
client then opens a secure channel described by `ChannelSecurity`: the CAs to trust, the name
the certificate must match, and optionally a bearer token. `blocking_channel` (the driver's
up-front `check_service`) and `aio_channel` (the actors' `GrpcModelClient`) build their
channels from the same settings, so the check proves what the actors will do.

`tls_problem` explains a connection that failed. gRPC reports a failed handshake only as
UNAVAILABLE with free text, like a refused connection; so the check repeats the handshake with
Python's `ssl` (the same roots, name and ALPN h2) and reads the answer from its typed
exceptions instead of parsing gRPC's text.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from protos.credential import CredentialError, bearer, read_token
from protos.wire import MAX_MESSAGE_BYTES
from raypipe.errors import ConfigError

if TYPE_CHECKING:
    from raypipe.config import ServiceConfig

__all__ = ["CHANNEL_OPTIONS", "ChannelSecurity", "aio_channel", "auth_metadata", "blocking_channel", "tls_problem"]

# The same bound as the service's: a call over it is refused here, before it is sent.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Retries live in raypipe.call.retry, one layer only: switch off the channel's own.
    ("grpc.enable_retries", 0),
    # After an outage the channel fails fast until its reconnect backoff expires (by default
    # it grows to 120 s); cap it so a returning service is seen within seconds.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 4000),
)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a channel reaches the service: plaintext (the default) or TLS."""

    tls: bool = False
    root_certificates: bytes | None = field(default=None, repr=False)
    """PEM of the CAs to trust; None: gRPC's default roots."""
    server_name: str | None = None
    """The name the certificate must match (also sent as SNI); None: the address's host."""
    token_env: str | None = None
    """Environment variable holding a bearer token sent on every call (see `auth_metadata`)."""
    token_file: str | None = None
    """File holding the service's token (`raypipe serve` writes it); None: the default file
    (`protos.credential.DEFAULT_TOKEN_FILE`), sent when it exists. Plaintext is allowed: the
    service listens on loopback unless told otherwise (docs/security.md)."""

    def __post_init__(self) -> None:
        if not self.tls and (self.root_certificates is not None or self.server_name or self.token_env):
            raise ValueError("root_certificates, server_name and token_env need tls=True")

    @classmethod
    def of(cls, service: ServiceConfig) -> ChannelSecurity:
        """The security a `ServiceConfig` asks for (its CA bundle as read on the driver)."""
        return cls(
            tls=service.tls,
            root_certificates=service.ca_pem,
            server_name=service.server_name,
            token_env=service.token_env,
            token_file=service.token_file,
        )


def auth_metadata(security: ChannelSecurity) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <token>`: from `token_env` where set, else the service's token
    (`protos.credential.read_token`: `RAYPIPE_SERVICE_TOKEN`, else `token_file`, by default the
    file `raypipe serve` writes); () when there is none (a service that checks no credential).

    Read by the process that makes the calls: the driver for its check, each actor on whatever
    node Ray placed it. The value is never put in the config or Ray's task arguments (which
    Ray keeps in its control store), so it must be there on every node that runs actors.
    """
    name = security.token_env
    if name is None:
        try:
            token = read_token(security.token_file)
        except CredentialError as e:
            raise ConfigError(f"service.token_file: {e}") from None
        if token is None and security.token_file is not None:
            raise ConfigError(
                f"service.token_file: {security.token_file} does not exist on {socket.gethostname()} "
                "(`raypipe serve` writes the token there; copy it to every node that runs inference actors)"
            )
        return () if token is None else (bearer(token),)
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(
            f"service.token_env: environment variable {name} is not set (or empty) in this process on "
            f"{socket.gethostname()}; set it on the driver and on every node that runs inference actors"
        )
    return (("authorization", f"Bearer {value}"),)


def _credentials(security: ChannelSecurity) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    options = list(CHANNEL_OPTIONS)
    if not security.tls:
        return None, options
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    return grpc.ssl_channel_credentials(root_certificates=security.root_certificates), options


def blocking_channel(address: str, security: ChannelSecurity) -> grpc.Channel:
    credentials, options = _credentials(security)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def aio_channel(
    address: str, security: ChannelSecurity, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel; create it inside the event loop that will use it."""
    credentials, options = _credentials(security)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=list(interceptors) or None)


def tls_problem(address: str, security: ChannelSecurity, *, timeout_s: float) -> str | None:
    """Why TLS stands between this client and `address`, or None when it does not.

    With TLS on: the certificate is not trusted or not for the name, the server does not offer
    HTTP/2 (ALPN h2, which gRPC requires) or refuses the handshake with an alert, or the port does
    not speak TLS. With TLS off: the port speaks TLS. Only such definite answers count: a refused,
    reset or silent connection gives None (the check then waits for the service as usual).
    """
    host, port = _split(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    with sock:
        if not security.tls:
            return "the port speaks TLS, but the client is set for plaintext" if _speaks_tls(sock, host) else None
        context = ssl.create_default_context(
            cafile=None if security.root_certificates is not None else _grpc_default_roots(),
            cadata=security.root_certificates.decode("ascii") if security.root_certificates is not None else None,
        )
        context.set_alpn_protocols(["h2"])
        name = security.server_name or host
        try:
            with context.wrap_socket(sock, server_hostname=name) as tls:
                if tls.selected_alpn_protocol() != "h2":
                    return "the server did not negotiate HTTP/2 (ALPN h2), which gRPC needs"
        except ssl.SSLCertVerificationError as e:
            roots = "service.ca_file" if security.root_certificates is not None else "gRPC's default roots"
            return f"certificate verify failed: {e.verify_message} (name {name!r}, trusting {roots})"
        except ssl.SSLEOFError:
            return None  # closed mid-handshake: a restarting proxy looks the same, so wait it out
        except ssl.SSLError as e:
            if e.reason in _NOT_TLS:
                return f"{e.reason}: the port does not seem to speak TLS (a plaintext port?)"
            return f"the server refused the handshake ({e.reason or e})"
        except OSError:
            return None  # reset or timed out: not evidence about TLS
    return None


_NOT_TLS = {"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "HTTP_REQUEST"}
"""OpenSSL's reasons for an answer that is not a TLS record at all."""


def _speaks_tls(sock: socket.socket, host: str) -> bool:
    """Whether a TLS handshake succeeds, trusting anything (only to tell TLS from plaintext)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(sock, server_hostname=host):
            return True
    except OSError:
        return False


def _grpc_default_roots() -> str | None:
    """The roots gRPC trusts when given none: `GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`, else grpcio's bundle."""
    configured = os.environ.get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
    if configured:
        return configured
    bundled = Path(grpc.__file__).parent / "_cython" / "_credentials" / "roots.pem"
    return str(bundled) if bundled.is_file() else None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
