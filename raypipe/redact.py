"""Credentials out of logs: every line raypipe's CLI writes passes through `redact`.

botocore logs each S3 request's headers at DEBUG (`-v`): the `Authorization` header names the
access key id, and `X-Amz-Security-Token` holds a session token whole; urllib3 and s3fs log
URLs that may carry presigned credentials; an error may quote a token it was given. `redact`
removes two kinds of secret from a line: the values this process holds in its environment
under a credential's name (`SECRET_ENV`: whatever their format), and text shaped like one
(AWS key ids, signatures, session tokens, bearer tokens, secret keys as `key=value`).

`install` puts `RedactingFormatter` on the root logger's handlers, so the message, its
arguments and a traceback are all covered, whichever library logged them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping

__all__ = ["MASK", "SECRET_ENV", "RedactingFormatter", "install", "redact"]

MASK = "[redacted]"

SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "RAYPIPE_SERVICE_TOKEN",
    "RAY_AUTH_TOKEN",
)
"""Environment variables whose values never appear in a log line."""

_SHORTEST_SECRET = 8
"""A value shorter than this (moto's `testing`, say) is too common a word to mask everywhere."""

_PATTERNS = (
    # AWS access key ids: long-term (AKIA), temporary (ASIA) and the other principal prefixes.
    re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AIPA|ANPA|ANVA|AGPA)[A-Z0-9]{12,}\b"),
    # Signature V4 parts, in a header or a presigned URL's query.
    re.compile(r"(?i)(?<=Credential=)[^,&\s'\"]+"),
    re.compile(r"(?i)(?<=Signature=)[0-9a-f]{16,}"),
    # Session tokens and secret keys as a header, query parameter, dict entry or key=value.
    re.compile(
        r"(?i)((?:x-amz-security-token|security[_-]?token|session[_-]?token|secret[_-]?access[_-]?key|"
        r"aws_secret_access_key|secretaccesskey|sessiontoken)['\"]?\s*[:=]\s*b?['\"]?)([^'\"&\s,}]+)"
    ),
    # Bearer tokens (the model service's credential, a Kubernetes token).
    re.compile(r"(?i)(\bBearer\s+)([A-Za-z0-9._~+/=-]+)"),
)


def _secrets(environ: Mapping[str, str]) -> list[str]:
    values = {environ.get(name, "").strip() for name in SECRET_ENV}
    return sorted((v for v in values if len(v) >= _SHORTEST_SECRET), key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` without the credentials it holds (each replaced by `MASK`)."""
    for value in _secrets(os.environ if environ is None else environ):
        text = text.replace(value, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) + MASK) if m.re.groups == 2 else MASK, text)
    return text


class RedactingFormatter(logging.Formatter):
    """Formats with `inner` (default: logging's plain one), then `redact`s the whole line."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def install(handlers: Iterable[logging.Handler] | None = None) -> None:
    """Every handler of the root logger (or `handlers`) formats through `RedactingFormatter`."""
    for handler in list(logging.getLogger().handlers if handlers is None else handlers):
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter))
