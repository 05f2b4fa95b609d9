"""The replica's thread layout: model threads, TensorFlow pools, and Serve's concurrent batches."""

from __future__ import annotations

import pytest
from ray import serve

from serve_app.app import ThreadLayout, set_concurrent_batches, thread_layout
from serve_app.settings import ServerSettings


@pytest.mark.parametrize(
    ("cpus", "given", "layout"),
    [
        (1.5, {}, ThreadLayout(model=2, intra_op=1, inter_op=2)),  # the default replica on a 2-core node
        (1.0, {}, ThreadLayout(model=1, intra_op=1, inter_op=1)),
        (0.5, {}, ThreadLayout(model=1, intra_op=1, inter_op=1)),
        (8.0, {}, ThreadLayout(model=8, intra_op=1, inter_op=8)),
        (8.0, {"model_threads": 2}, ThreadLayout(model=2, intra_op=4, inter_op=2)),
        (4.0, {"model_threads": 1}, ThreadLayout(model=1, intra_op=4, inter_op=1)),  # the old layout
        (4.0, {"intra_op_threads": 2, "inter_op_threads": 3}, ThreadLayout(model=4, intra_op=2, inter_op=3)),
    ],
)
def test_thread_layout_defaults_to_one_single_threaded_pass_per_core(cpus, given, layout) -> None:
    assert thread_layout(ServerSettings.from_dict(given), cpus, cores_here=64) == layout


@pytest.mark.parametrize(
    ("cpus", "cores_here", "given", "layout"),
    [
        (7.5, 2, {}, ThreadLayout(model=2, intra_op=1, inter_op=2)),  # a node declaring 8 CPUs on 2 cores
        (7.5, 1, {}, ThreadLayout(model=1, intra_op=1, inter_op=1)),
        (3.0, 4, {}, ThreadLayout(model=3, intra_op=1, inter_op=3)),  # fewer CPUs than cores: the CPUs decide
        (7.5, 2, {"model_threads": 4}, ThreadLayout(model=4, intra_op=1, inter_op=4)),  # given: kept
    ],
)
def test_default_threads_never_outnumber_the_cores_the_replica_may_use(cpus, cores_here, given, layout) -> None:
    assert thread_layout(ServerSettings.from_dict(given), cpus, cores_here) == layout


@pytest.mark.parametrize("name", ["model_threads", "intra_op_threads", "inter_op_threads"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_thread_counts_must_be_positive_integers(name, value) -> None:
    with pytest.raises(ValueError, match=name):
        ServerSettings.from_dict({name: value})


class _Batched:
    @serve.batch(max_batch_size=4)
    async def handle(self, items: list[int]) -> list[int]:
        return items


def test_serve_batch_concurrency_can_be_set_before_the_first_request() -> None:
    """Guards the one Serve internal the server relies on: a Ray upgrade that moves it fails here."""
    method = _Batched().handle
    set_concurrent_batches(method, 3)
    assert method.set_max_batch_size.__self__.max_concurrent_batches == 3


def test_serve_batch_concurrency_refuses_a_method_without_the_wrapper() -> None:
    class NotBatched:
        @staticmethod
        def set_max_batch_size(n: int) -> None: ...

    with pytest.raises(RuntimeError, match="max_concurrent_batches"):
        set_concurrent_batches(NotBatched(), 2)


REPLICA_IMPORTS = """
import json, sys
from serve_app.app import EmotionClassifier
replica = EmotionClassifier.func_or_class(sys.argv[1], {"runtime": sys.argv[2], "precision": "fp32"})
print(json.dumps({"setting": replica._setting, "tensorflow": "tensorflow" in sys.modules}))
"""


@pytest.mark.parametrize(("runtime", "imports_tensorflow"), [("openvino", False), ("tensorflow", True)])
def test_a_replica_imports_tensorflow_only_to_serve_it(demo_model_dir, runtime, imports_tensorflow) -> None:
    """TensorFlow's import is seconds of every replica's start and memory for its life: a replica
    serving another runtime never pays it (in a fresh process, as a replica starts)."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", REPLICA_IMPORTS, str(demo_model_dir), runtime],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["setting"].startswith(runtime), seen
    assert seen["tensorflow"] is imports_tensorflow, seen
