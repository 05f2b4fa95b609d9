"""The model service's credential: a bearer token both sides read the same way.

`raypipe serve` makes the token (`ensure_token`: a file of mode 0600, created when none exists)
and deploys the replicas with its SHA-256 only, so the token itself never sits in Ray's control
store; each replica checks a call's `authorization: Bearer <token>` metadata against the digest
(`token_matches`) before it touches the model. Clients (`raypipe.call.channel`, the demo,
notebooks, bench) read the token from the same file (`service.token_file`, by default
`DEFAULT_TOKEN_FILE`) or from the environment variable `TOKEN_ENV`, which wins where set (a
Kubernetes Secret mounted as a variable, say).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "AUTH_KEY",
    "DEFAULT_TOKEN_FILE",
    "TOKEN_ENV",
    "CredentialError",
    "bearer",
    "default_token_file",
    "ensure_token",
    "read_token",
    "token_digest",
    "token_matches",
]

AUTH_KEY = "authorization"
"""Request metadata carrying `Bearer <token>`."""

TOKEN_ENV = "RAYPIPE_SERVICE_TOKEN"  # noqa: S105  a variable's name, not a token
"""Environment variable holding the token; where set, it wins over the file."""

DEFAULT_TOKEN_FILE = "~/.raypipe/service-token"  # noqa: S105  a path, not a token
"""Where `raypipe serve` keeps the token, and where clients look for it by default."""


class CredentialError(ValueError):
    """A token file that cannot be used (wrong mode, empty, unreadable); the message says why."""


def default_token_file(environ: Mapping[str, str] | None = None) -> Path:
    """`DEFAULT_TOKEN_FILE` under this process's home (``HOME`` of `environ`, when given)."""
    if environ is not None and environ.get("HOME"):
        return Path(environ["HOME"]) / DEFAULT_TOKEN_FILE.removeprefix("~/")
    return Path(DEFAULT_TOKEN_FILE).expanduser()


def read_token(path: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token: `TOKEN_ENV` if set, else the file at `path` (default: `default_token_file`);
    None when neither exists. A file others may read is refused: the token is a password."""
    value = environ.get(TOKEN_ENV, "").strip()
    if value:
        return value
    file = Path(path).expanduser() if path is not None else default_token_file(environ)
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CredentialError(f"service token file {file}: {e.strerror}") from None
    if mode & 0o077:
        raise CredentialError(f"service token file {file} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    token = file.read_text(encoding="ascii", errors="replace").strip()
    if not token:
        raise CredentialError(f"service token file {file} is empty")
    return token


def ensure_token(path: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ) -> tuple[str, bool]:
    """(the token, whether this call created it): `read_token`, or a new random token written to
    `path` with mode 0600 (its folder 0700 when created) where none exists."""
    token = read_token(path, environ)
    if token is not None:
        return token, False
    file = Path(path).expanduser() if path is not None else default_token_file(environ)
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL: never write through a file (or symlink) someone put there meanwhile; 0600 from the start.
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(token + "\n")
    return token, True


def token_digest(token: str) -> str:
    """The SHA-256 (hex) a replica keeps instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str) -> tuple[str, str]:
    """The metadata pair a client sends."""
    return (AUTH_KEY, f"Bearer {token}")


def token_matches(metadata: Iterable[tuple[str, str | bytes]], digest: str) -> bool:
    """Whether `metadata` carries `authorization: Bearer <token>` whose SHA-256 is `digest`
    (compared in constant time)."""
    for key, value in metadata:
        if key.lower() != AUTH_KEY or not isinstance(value, str):
            continue
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token:
            return hmac.compare_digest(token_digest(token.strip()), digest)
    return False
