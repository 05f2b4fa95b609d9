"""No credential in any log line: `raypipe.redact` on the shapes botocore, urllib3 and raypipe
print, and a `-v` CLI run against S3 (moto on loopback) with a session token. No Ray."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypipe.redact import MASK, RedactingFormatter, redact

REPO = Path(__file__).resolve().parents[2]

KEY_ID = "ASIAQEXAMPLE7KEYID42"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SESSION = "FwoGZXIvYXdzEJr//////////wEaDExampleSessionTokenValue0123456789abcdef=="
CREDENTIALS = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SESSION}


@pytest.mark.parametrize(
    "line",
    [
        f"Sending http request: <AWSPreparedRequest headers={{'X-Amz-Security-Token': b'{SESSION}', "
        f"'Authorization': b'AWS4-HMAC-SHA256 Credential={KEY_ID}/20261127/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0123456789abcdef0123456789abcdef'}>",
        f"https://b.s3.amazonaws.com/k?X-Amz-Credential={KEY_ID}%2F2026&X-Amz-Security-Token={SESSION}&x=1",
        f"aws_secret_access_key={SECRET} aws_session_token: {SESSION}",
        f"{{'AccessKeyId': '{KEY_ID}', 'SecretAccessKey': '{SECRET}', 'SessionToken': '{SESSION}'}}",
    ],
)
def test_credentials_are_masked_in_the_shapes_libraries_log(line: str) -> None:
    # No environment: the shapes alone must catch them.
    out = redact(line, environ={})
    for secret in (KEY_ID, SECRET, SESSION):
        assert secret not in out, out
    assert MASK in out


def test_values_held_in_the_environment_are_masked_whatever_their_shape() -> None:
    env = {"RAYPIPE_SERVICE_TOKEN": "plain-words-token", "AWS_SECRET_ACCESS_KEY": "testing"}
    assert redact("got plain-words-token from x", env) == f"got {MASK} from x"
    assert redact("bucket testing-data", env) == "bucket testing-data", "too short a value is not masked"
    assert redact("authorization: Bearer abc.def-ghi", {}) == f"authorization: Bearer {MASK}"


def test_the_formatter_masks_arguments_and_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION)  # a bare value in a traceback: known by the environment
    formatter = RedactingFormatter(logging.Formatter("%(levelname)s %(message)s"))
    try:
        raise RuntimeError(f"token {SESSION}")
    except RuntimeError:
        record = logging.LogRecord("botocore", logging.DEBUG, __file__, 1, "key %s", (KEY_ID,), sys.exc_info())
    out = formatter.format(record)
    assert KEY_ID not in out and SESSION not in out and "RuntimeError" in out


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    from bench.s3server import MotoServer

    server = MotoServer().start()
    try:
        yield server.endpoint
    finally:
        server.stop()


def test_a_verbose_s3_command_logs_no_session_token_or_key(moto: str, tmp_path: Path) -> None:
    import s3fs

    s3fs.S3FileSystem(endpoint_url=moto, key=KEY_ID, secret=SECRET, token=SESSION).mkdir("creds")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPIPE_", "AWS_"))}
    env.update(CREDENTIALS, AWS_ENDPOINT_URL=moto, AWS_DEFAULT_REGION="us-east-1", RAY_ADDRESS="")
    done = subprocess.run(
        [sys.executable, "-m", "raypipe", "-v", "report", "--output", "s3://creds/out", "--run-id", "r1"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "botocore" in out and "Authorization" in out, "the run logged its S3 requests at DEBUG"
    for secret in (KEY_ID, SECRET, SESSION):
        assert secret not in out
    assert MASK in out
