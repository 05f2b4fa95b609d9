"""The Serve application builder that a RayService's `serveConfigV2` names.

A RayService deploys applications by import path: Serve imports
`serve_app.builder:app_builder` on the cluster and calls it with the application's `args`
mapping from the config. The builder reads the model directory and the server settings from
those `args` and returns the same bound application that `raypipe serve` runs, by way of
`serve_app.deploy.build_app`, so a cluster and a laptop run the same code.

    applications:
      - name: raypipe
        route_prefix: /raypipe            # the gRPC proxy needs a non-None prefix
        import_path: serve_app.builder:app_builder
        args:
          model_dir: /opt/raypipe/model   # a local directory on every node; never downloaded here
          settings: {max_batch_size: 256} # serve_app.settings.ServerSettings
          token_env: RAYPIPE_SERVICE_TOKEN  # optional: calls must carry the token in this variable
        deployments:
          - name: EmotionClassifier
            num_replicas: auto            # the code pins 1 replica; "auto" lets autoscaling_config rule
            autoscaling_config: {min_replicas: 1, max_replicas: 8}

With `token_env` (the name of an environment variable of the pods, set from a Kubernetes Secret:
the bundled RayService sets `RAYPIPE_SERVICE_TOKEN` from `raypipe-service-token`) or `token_file`
(a file of mode 0600 on the node where the app is built) every call must carry that token as
`authorization: Bearer <token>` (`protos.credential`), as with `raypipe serve`. A variable, not a
Secret volume: Kubernetes adds group read bits to a Secret volume's files when the pod sets
`fsGroup`, as every raypipe pod does, and a token file others may read is refused.

Replica counts, CPUs and autoscaling belong in the config's `deployments` entry, where Serve
applies them over the code's defaults; `args` carries only what the code cannot default.
"""

from __future__ import annotations

import os
from typing import Any, cast

from ray.serve import Application

from protos.credential import read_token, token_digest
from serve_app.deploy import build_app
from serve_app.settings import ServerSettings

__all__ = ["ARGS", "app_builder"]

ARGS = ("model_dir", "settings", "token_env", "token_file")
"""The keys `app_builder` accepts in the application's `args`."""


def app_builder(args: dict[str, Any]) -> Application:
    """Builds the EmotionClassifier application from serveConfigV2 `args`.

    Raises ValueError on an unknown key, a missing `model_dir` or bad settings, and
    `serve_app.model.ModelDirError` when the model directory is unusable, so a typo in the
    config fails the deploy with its name rather than in every replica.
    """
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise ValueError(f"unknown application args: {', '.join(unknown)} (accepted: {', '.join(ARGS)})")
    model_dir = args.get("model_dir")
    if not isinstance(model_dir, str) or not model_dir.strip():
        raise ValueError("application args need model_dir: the model directory's path on the cluster's nodes")
    settings = args.get("settings") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"application args: settings must be a mapping, not {type(settings).__name__}")
    token = _token(args)
    digest = token_digest(token) if token is not None else None
    return cast(Application, build_app(model_dir, ServerSettings.from_dict(settings), token_sha256=digest))


def _token(args: dict[str, Any]) -> str | None:
    """The token named by `token_env` or `token_file`, read where the app is built (the
    controller's node); the replicas get its digest only. None when neither is given."""
    token_env, token_file = args.get("token_env"), args.get("token_file")
    if token_env is not None and token_file is not None:
        raise ValueError("application args: token_env or token_file, not both")
    if token_env is not None:
        if not isinstance(token_env, str) or not token_env.strip():
            raise ValueError("application args: token_env must name an environment variable")
        value = os.environ.get(token_env, "").strip()
        if not value:
            # The name only: the variable may hold the token on another node.
            raise ValueError(f"application args: environment variable {token_env} is not set (or empty) on this node")
        return value
    if token_file is not None:
        token = read_token(str(token_file), environ={})
        if token is None:
            raise ValueError(f"application args: token_file {token_file} does not exist on this node")
        return token
    return None
