"""A replica on a CPU with no record measures itself in the background, and keeps reuse correct.

With ``precision: auto`` and no record for its CPU (`serve_app.runtimes.Serving.unmeasured`), a
replica serves the default at once (the fastest setting with the reference's answers, OpenVINO
fp32), then measures the *equal-answer* settings (`serve_app.runtimes.EQUAL_ANSWER_SETTINGS`:
fp32 on TensorFlow and on OpenVINO) as ``raypipe model export`` does (`serve_app.optimize.
measure`: interleaved rounds on the export's check texts), writes that record for the next start
when the model directory is writable, and switches to the setting `serve_app.runtimes.choose`
picks from it, if that is another: only a win beyond the spread switches (`serve_app.timing`).
``ServerSettings.measure_unrecorded: false`` turns it off.

Why only equal-answer settings: the model version (`serve_app.runtimes.served_version`) names
what changes answers, and answer reuse (`raypipe.call.reuse`) keys on it. A replica that moved
to bf16 by itself would answer under another version in the middle of a run, beside replicas
that did not; fp32 on either runtime answers alike, so a switch between them changes neither
the version nor a reuse key. Settings that change answers are measured through the gate by
``raypipe model export`` or ``raypipe model optimize``, whose record every replica reads at start.

Why a child process (``python -m serve_app.self_measure DIR``): the measurement runs TensorFlow,
the reference, which costs seconds to import, memory for the life of the process, and fixes
process-wide thread pools; a runtime that crashes while measuring takes only the child down.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from serve_app.runtimes import (
    EQUAL_ANSWER_SETTINGS,
    RuntimeRecord,
    Serving,
    choose,
    supported_settings,
    write_record,
)
from serve_app.settings import ServerSettings

__all__ = ["SelfMeasure", "SelfMeasureError", "measure_in_child"]

logger = logging.getLogger(__name__)

#: How long a child's measurement may take before the replica gives up on it.
CHILD_TIMEOUT_S = 1800.0


class SelfMeasureError(RuntimeError):
    """The child process that measures failed; ``exit_code`` is its exit status."""

    def __init__(self, exit_code: int, stderr: str) -> None:
        self.exit_code = exit_code
        super().__init__(f"measuring the runtimes in a child process failed (exit {exit_code}): {stderr[-2000:]}")


def measure_in_child(model_dir: Path, *, threads: int, timeout_s: float = CHILD_TIMEOUT_S) -> RuntimeRecord:
    """This CPU's record of the equal-answer settings, measured by ``python -m serve_app.self_measure``."""
    # The child imports serve_app as this process does, wherever it was found (a Ray working_dir).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(  # noqa: S603  our own module, with this interpreter
        [sys.executable, "-m", "serve_app.self_measure", str(model_dir), "--threads", str(threads)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SelfMeasureError(done.returncode, done.stderr)
    return RuntimeRecord.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


class SelfMeasure:
    """One replica's background measurement: measure, record, and switch on a clear win.

    ``switch`` loads the given setting beside the one serving and answers with it from then on;
    ``measure`` returns this CPU's record of the equal-answer settings (default: `measure_in_child`).
    """

    def __init__(
        self,
        model_dir: Path | str,
        serving: Serving,
        settings: ServerSettings,
        *,
        switch: Callable[[Serving], None],
        flags: frozenset[str],
        threads: int = 1,
        measure: Callable[[Path], RuntimeRecord] | None = None,
    ) -> None:
        self._model_dir = Path(model_dir)
        self._serving = serving
        self._settings = settings
        self._switch = switch
        self._flags = flags
        self._measure = measure or (lambda d: measure_in_child(d, threads=threads))

    @staticmethod
    def wanted(serving: Serving, settings: ServerSettings, *, flags: frozenset[str], openvino: bool) -> bool:
        """Whether a replica serving ``serving`` measures itself: ``precision: auto`` found no
        record, the settings allow it, and there is another equal-answer setting to switch to."""
        if not (serving.unmeasured and settings.measure_unrecorded):
            return False
        allowed = [
            s
            for s in supported_settings(flags, openvino=openvino)
            if s in EQUAL_ANSWER_SETTINGS and settings.runtime in ("auto", s[0])
        ]
        return len(allowed) > 1

    def run(self) -> Serving:
        """Measure, then switch when the record's choice among equal-answer settings is another
        setting than the one served; returns the setting served afterwards."""
        record = self._measure(self._model_dir)
        equal = replace(
            record, measurements=tuple(m for m in record.measurements if m.setting in EQUAL_ANSWER_SETTINGS)
        )
        chosen = choose(
            runtime=self._settings.runtime,
            precision="auto",
            flags=self._flags,
            record=equal,
            saved_model=None,  # measured just now, on the files this replica serves
            min_agreement=self._settings.min_agreement,
        )
        if chosen.setting == self._serving.setting:
            logger.info("measured this CPU's runtimes: %s stays (%s)", chosen.setting, chosen.reason)
            return self._serving
        if chosen.version_suffix != self._serving.version_suffix:  # equal-answer settings add none
            logger.warning("not switching to %s: it would change the model version", chosen.setting)
            return self._serving
        logger.info(
            "measured this CPU's runtimes: switching %s -> %s (%s)",
            self._serving.setting,
            chosen.setting,
            chosen.reason,
        )
        self._switch(chosen)
        self._serving = chosen
        return chosen

    def start(self) -> threading.Thread:
        """`run` on a daemon thread; a failure is logged and the replica keeps serving what it serves."""
        thread = threading.Thread(target=self._run_logged, name="self-measure", daemon=True)
        thread.start()
        return thread

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception:  # a measurement that fails must not take a serving replica down
            logger.warning("measuring this CPU's runtimes failed; %s stays", self._serving.setting, exc_info=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: measure the equal-answer settings, write the record if the directory allows,
    print it as one line of JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from serve_app.export._common import MEASURE_TEXTS
    from serve_app.optimize import Sample, default_sample, measure

    sample = Sample(
        "check texts (a replica with no record: equal-answer settings only)",
        calibration=(),
        held_out=tuple(default_sample(MEASURE_TEXTS)),
    )
    record = measure(args.model_dir, sample, threads=args.threads, only=EQUAL_ANSWER_SETTINGS)
    try:
        write_record(args.model_dir, record)
    except OSError as e:
        logger.warning("could not write %s (%s); the next start measures again", args.model_dir / "runtimes.json", e)
    print(json.dumps(record.to_json()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
