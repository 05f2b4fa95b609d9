"""Known native noise kept off an operator's console, and nothing else.

Some lines come from C++ inside libraries, written straight to file descriptor 2, with no
logger to configure and no flag to turn them off. On a healthy run on a CPU machine they look
like failures. `filtered_stderr` routes fd 2 through a pipe for the span of a block and drops
exactly the lines of `NOISE` (each with why it is harmless and where it is tracked upstream);
every other byte reaches the real stderr unchanged and in order.

Why a pipe and not a setting: `RAY_BACKEND_LOG_LEVEL` would silence every C++ error of the
driver's core worker, and `TF_CPP_MIN_LOG_LEVEL` does not cover the lines TensorFlow prints
before absl's logging starts. Both sides use it (raypipe's CLI, serve_app's replicas), so it
lives in the layer below them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = ["NOISE", "filtered_stderr", "is_noise"]

NOISE: dict[str, re.Pattern[str]] = {
    # Ray Data passes a reference into every actor pool worker's constructor; Ray core then
    # logs an ERROR for each actor it creates, whatever the user's code does. Tracked as
    # ray-project/ray#57733 (open); the restart it warns about is exercised by
    # tests/integration/test_multinode.py (a jobs node lost mid-run) and works.
    "ray-data-actor-args": re.compile(
        r"core_worker\.cc:\d+: Actor with class name: 'MapWorker\(.*has constructor arguments in the object store"
    ),
    # TensorFlow's Linux wheel carries CUDA support and says so on every CPU-only machine.
    "tf-no-cuda": re.compile(r"(cudart_stub|cuda_platform|cuda_executor|cuda_diagnostics)\.cc:\d+\]"),
    "tf-absl-preinit": re.compile(
        r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    ),
    "tf-cpu-features": re.compile(
        r"cpu_feature_guard\.cc:\d+\]|To enable the following instructions: .* rebuild TensorFlow"
    ),
}


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE.values())


@contextlib.contextmanager
def filtered_stderr() -> Iterator[None]:
    """Drops `NOISE` lines written to fd 2 (by any thread or native code) within the block.

    Native code writes to descriptor 2 whatever `sys.stderr` is (a Jupyter kernel replaces
    `sys.stderr` and reads descriptor 2 through a pipe of its own), so descriptor 2 is what is
    filtered. A no-op where the process has no descriptor 2.
    """
    stderr_fd = 2
    try:
        os.fstat(stderr_fd)
    except OSError:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(stderr_fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, stderr_fd)
    os.close(write_end)
    sink_fd = os.dup(saved)  # the pump's own copy, made before the block can close `saved`

    def pump() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as source, os.fdopen(sink_fd, "wb", buffering=0) as sink:
            pending = b""
            while chunk := source.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = b"".join(line + b"\n" for line in lines if not is_noise(line.decode("utf-8", "replace")))
                if out:
                    sink.write(out)
            if pending and not is_noise(pending.decode("utf-8", "replace")):
                sink.write(pending)

    thread = threading.Thread(target=pump, name="raypipe-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, stderr_fd)  # closes this process's last write end: the pump sees EOF
        os.close(saved)
        # Child processes started inside the block (a local Ray cluster) may still hold the
        # pipe; the pump then keeps forwarding their lines, as a daemon, until they exit.
        thread.join(timeout=2.0)
