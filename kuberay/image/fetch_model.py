"""Copies a model directory to local disk before Ray starts: the model service's init container.

    MODEL_URI=s3://bucket/models/emotion/v3/ MODEL_DIR=/opt/raypipe/models/current \\
        python fetch_model.py

serve_app never downloads anything: it loads a local model directory. On Kubernetes each
model-service pod runs this first, into an emptyDir that the Ray container mounts read-only,
so every node has the directory that serveConfigV2's `model_dir` names. MODEL_URI is an
S3 prefix (any S3-compatible endpoint, through the standard AWS environment) or a local path.

The copy lands in a temporary directory beside MODEL_DIR and is renamed into place only after
its model card (model.json) validates, so the Ray container never sees half a model; a model
URI without a valid model.json fails the pod at once, naming the URI.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fsspec.core import url_to_fs

from serve_app.model import ModelDirError, read_model_card


def fetch(uri: str, model_dir: Path) -> str:
    """Copies the model at `uri` into `model_dir` (replacing it); returns the model's version."""
    fs, root = url_to_fs(uri)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/model.json"):
        raise ModelDirError(Path(uri), "no model.json under this URI (is it the model directory itself?)")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=model_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the Ray container reads it
        fs.get(f"{root}/", f"{staging}/", recursive=True)
        card = read_model_card(staging)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return card.version


def main() -> int:
    uri = os.environ.get("MODEL_URI", "")
    model_dir = Path(os.environ.get("MODEL_DIR", "/opt/raypipe/models/current"))
    if not uri:
        print("fetch_model: set MODEL_URI to the model directory (s3://... or a path)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        version = fetch(uri, model_dir)
    except (ModelDirError, OSError) as e:
        print(f"fetch_model: {uri}: {e}", file=sys.stderr)
        return 1
    print(f"fetch_model: {uri} -> {model_dir} (model version {version}) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
