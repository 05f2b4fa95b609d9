"""protos.quiet: known native noise dropped from fd 2, everything else kept, in order."""

from __future__ import annotations

import subprocess
import sys
import textwrap

NOISY = [
    "[2026-11-24 04:29:31,586 E 11938 11938] core_worker.cc:2465: Actor with class name: "
    "'MapWorker(ReadRaypipeUnits->MapBatches(InferenceActor))' and ID: 'bb8b' has constructor arguments in the "
    "object store and max_restarts > 0. If the arguments ...",
    "E0000 00:00:1795493212.770075    7261 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error",
    "I0000 00:00:1795493208.196928    7261 cudart_stub.cc:31] Could not find cuda drivers on your machine.",
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
]
KEPT = [
    "[2026-11-24 04:29:31,586 E 11938 11938] core_worker.cc:1234: something else went wrong",
    "E0000 00:00:1795493212.770075    7261 some_kernel.cc:52] a real TensorFlow error",
    "Traceback (most recent call last):",
]


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_native_writes_lose_only_the_known_noise_and_keep_their_order():
    lines = [x for pair in zip(KEPT, NOISY, strict=False) for x in pair] + NOISY[len(KEPT) :]
    done = run(
        f"""
        import os, sys
        from protos.quiet import filtered_stderr
        with filtered_stderr():
            for line in {lines!r}:
                os.write(2, (line + "\\n").encode())  # as C++ writes: straight to the descriptor
            print("python-level", file=sys.stderr)
        print("after", file=sys.stderr)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [*KEPT, "python-level", "after"]


def test_a_crash_inside_the_block_still_shows_its_traceback():
    done = run(
        """
        from protos.quiet import filtered_stderr
        with filtered_stderr():
            raise RuntimeError("boom")
        """
    )
    assert done.returncode == 1
    assert "RuntimeError: boom" in done.stderr
