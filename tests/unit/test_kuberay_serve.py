"""The RayService's serveConfigV2 against Ray Serve, and the application builder it names.

serveConfigV2 parses with Ray's `ServeDeploySchema` (and has no key that schema would
silently drop), its servicer functions and `serve_app.builder:app_builder` import from the
package, and the builder, called with the config's `args` the way Serve's controller calls
it (against a stand-in model card), returns the application the config's deployment
overrides apply to. Broken copies fail. No Ray cluster: building an application is offline.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kuberay import validate
from kuberay.serve_check import serve_problems, unknown_keys
from kuberay.validate import Resource

OVERLAYS = sorted(p.name for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def rendered(overlay: str) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with only its card: enough to build (not to run) the application."""
    from serve_app.model import MODEL_FORMAT

    path = tmp_path_factory.mktemp("model")
    card = {"format": MODEL_FORMAT, "labels": ["anger", "joy"], "version": "kuberay-check", "max_sequence_length": 128}
    (path / "model.json").write_text(json.dumps(card), encoding="utf-8")
    return path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_parses_imports_and_builds(overlay: str, model_dir: Path) -> None:
    assert serve_problems(rendered(overlay), model_dir=model_dir) == []


def test_builder_returns_the_bound_application(model_dir: Path) -> None:
    from ray.serve import Application

    from serve_app.builder import app_builder

    app = app_builder({"model_dir": str(model_dir), "settings": {"max_batch_size": 64}})
    assert isinstance(app, Application)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"model_dir": "/m", "model_uri": "s3://x"}, "unknown application args: model_uri"),
        ({"settings": {}}, "need model_dir"),
        ({"model_dir": "  "}, "need model_dir"),
        ({"model_dir": "/m", "settings": [1]}, "settings must be a mapping"),
    ],
)
def test_builder_rejects_bad_args(args: dict[str, object], message: str) -> None:
    from serve_app.builder import app_builder

    with pytest.raises(ValueError, match=message):
        app_builder(args)


def test_builder_names_a_missing_model_directory(tmp_path: Path) -> None:
    from serve_app.builder import app_builder
    from serve_app.model import ModelDirError

    with pytest.raises(ModelDirError, match="absent"):
        app_builder({"model_dir": str(tmp_path / "absent")})


def test_unknown_keys_walks_nested_models() -> None:
    from ray.serve.schema import ServeDeploySchema

    data = {
        "grpc_options": {"port": 9000, "grpc_servicer_function": []},
        "applications": [
            {
                "name": "a",
                "import_path": "m:f",
                "deployments": [{"name": "D", "autoscaling_config": {"max_replica": 2}}],
            }
        ],
    }
    problems = unknown_keys(data, ServeDeploySchema, "cfg")
    assert problems == [
        "cfg.grpc_options.grpc_servicer_function: gRPCOptionsSchema has no such field",
        "cfg.applications[0].deployments[0].autoscaling_config.max_replica: AutoscalingConfig has no such field",
    ]


def _edit(old: str, new: str) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        spec = next(r for r in resources if r["kind"] == "RayService")["spec"]
        assert old in spec["serveConfigV2"], old
        spec["serveConfigV2"] = spec["serveConfigV2"].replace(old, new)

    return mutate


def _drop_line(line: str) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        spec = next(r for r in resources if r["kind"] == "RayService")["spec"]
        lines = spec["serveConfigV2"].splitlines(keepends=True)
        kept = [x for x in lines if x.strip() != line]
        assert len(kept) == len(lines) - 1, line
        spec["serveConfigV2"] = "".join(kept)

    return mutate


BREAKS: dict[str, tuple[Callable[[list[Resource]], None], str]] = {
    "bad-import-path": (
        _edit("serve_app.builder:app_builder", "serve_app.builder:build"),
        "import_path serve_app.builder:build does not import",
    ),
    "bad-import-module": (
        _edit("serve_app.builder:app_builder", "serve_app.builders:app_builder"),
        "No module named 'serve_app.builders'",
    ),
    "bad-servicer-function": (
        _edit("add_EmotionClassifierServicer_to_server", "add_EmotionServicer_to_server"),
        "grpc servicer function protos.raypipe.v1.emotion_pb2_grpc.add_EmotionServicer_to_server does not import",
    ),
    "grpc-options-typo": (_edit("grpc_options:", "grpc_option:"), "grpc_option: ServeDeploySchema has no such field"),
    "autoscaling-typo": (
        _edit("target_ongoing_requests:", "target_ongoing_request:"),
        "target_ongoing_request: AutoscalingConfig has no such field",
    ),
    "grpc-port-not-declared": (_edit("port: 9000", "port: 9100"), "grpc port 9100 is not the head container's"),
    "no-route-prefix": (_edit("route_prefix: /raypipe", "route_prefix: null"), "needs a route_prefix"),
    "fixed-replicas-with-autoscaling": (
        _edit("num_replicas: auto", "num_replicas: 2"),
        "Manually setting num_replicas is not allowed",
    ),
    "replicas-left-to-code": (_drop_line("num_replicas: auto"), "set num_replicas: auto"),
    "model-dir-not-fetched": (
        _edit("model_dir: /opt/raypipe/models/current", "model_dir: /models/current"),
        "is not where the model is fetched",
    ),
    "unknown-server-setting": (
        _edit("token_budget: 8192", "token_budgett: 8192"),
        "unknown server settings: token_budgett",
    ),
    "unknown-deployment": (
        _edit("- name: EmotionClassifier", "- name: Classifier"),
        "Deployment 'Classifier' does not exist",
    ),
    "replica-fits-no-worker": (_edit("num_cpus: 2", "num_cpus: 6"), "a replica's 6 CPUs fit no worker"),
    "application-renamed": (
        _edit("- name: raypipe\n", "- name: emotions\n"),
        "no application named 'raypipe', the name clients send by default",
    ),
    "not-yaml": (_edit("proxy_location: EveryNode", "proxy_location: [EveryNode"), "not YAML"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_broken_serve_configs_fail(case: str, model_dir: Path) -> None:
    mutate, expected = BREAKS[case]
    resources = rendered("prod")
    mutate(resources)
    problems = serve_problems(resources, model_dir=model_dir)
    assert any(expected in p for p in problems), problems
