"""Session fixtures shared by the unit and integration tests.

The Ray settings below must be in the environment before `ray` is imported (Ray reads its
auth mode at import), hence at the top of the first conftest: the test cluster runs with
token authentication, as production clusters do, and only on 127.0.0.1 (by default Ray
swaps 127.0.0.1 for the host's routable address).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

import pytest

_token = Path(tempfile.mkdtemp(prefix="raypipe-test-")) / "ray_auth_token"
_token.write_text(secrets.token_hex(32))
os.environ.update(
    {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(_token),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
)

from serve_app.demo_model import build_demo_model, default_demo_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The offline demo model directory; built on first use, then reused from its cache."""
    return build_demo_model(default_demo_model_dir())
