"""`raypipe watch` on real parts (local Ray, the session's Serve gRPC app, local files): files
added while it runs are committed once each, a daily on its output refuses naming it, and a
watcher SIGKILLed mid-batch is succeeded by one that loses nothing and doubles nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from raypipe.errors import OutputLockedError
from raypipe.run.watch.watcher import default_watch_id
from raypipe.samples import write_sample_corpus
from raypipe.store import OutputStore
from tests.integration.conftest import wait_for
from tests.integration.helpers import assert_nothing_lost, committed_units, ids, results

REPO = Path(__file__).resolve().parents[2]
APP = "raypipe"  # the session's shared app: the tests run one at a time, so counts since a test began are its own
SETTINGS = {"service": {"application": APP}, "actors": {"min_actors": 1}}

pytestmark = pytest.mark.timeout(240)


def _answered() -> int:
    return int(serve.get_app_handle(APP).stats.remote().result()["paragraphs"].get("OK", 0))


def _arrive(folder: Path, name: str, n: int) -> list[str]:
    """A file of `n` paragraphs, arriving whole (written aside, then renamed in)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [f"{name}-{i}" for i in range(n)]
    tmp = folder / f".{name}.tmp"
    pq.write_table(pa.table({"id": rows, "text": [f"{r}: what a joyful, lovely surprise" for r in rows]}), tmp)
    os.replace(tmp, folder / f"{name}.parquet")
    return rows


class Watching:
    """`raypipe.watch` in a thread of this process (its driver joins the session's cluster)."""

    def __init__(self, in_dir: Path, out: Path, serve_address: str, **settings: Any) -> None:
        self.stop = threading.Event()
        self.report: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.report = raypipe.watch(
                    str(in_dir), str(out), every_s=0.3, max_wait_s=0, stop=self.stop, service=serve_address,
                    settings={**SETTINGS, **settings},
                )  # fmt: skip
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finish(self) -> Any:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.report


def _committed(out: Path) -> int:
    return len(ids(results(out))) if (out / "outcomes").exists() else 0


def test_a_watcher_commits_files_added_while_it_runs_once_each_and_a_daily_refuses_its_output(tmp_path, serve_address):
    start = _answered()
    in_dir, out = tmp_path / "in", tmp_path / "out"
    expected = _arrive(in_dir, "first", 30)
    watcher = Watching(in_dir, out, serve_address)
    try:
        wait_for(lambda: _committed(out) >= 30, 90, "the first file committed")
        expected += _arrive(in_dir, "second", 20)
        expected += _arrive(in_dir, "third", 10)
        wait_for(lambda: _committed(out) >= 60, 60, "the files added while it runs committed")

        with pytest.raises(OutputLockedError) as refused:
            raypipe.daily(str(in_dir), str(out), service=serve_address, settings=SETTINGS)
        assert default_watch_id(str(in_dir)) in str(refused.value)
    finally:
        report = watcher.finish()
    assert report.status == "stopped" and report.rows == 60 and report.files == 3
    assert_nothing_lost(out, expected)
    assert _answered() - start == 60, "each paragraph inferred once"
    store = OutputStore(str(out))
    assert not store.exists(store.state("lease.json")), "the lease is released"
    stored = store.read_json(store.state("watch", f"{report.watch_id}.json"))
    assert stored["units"] == report.units and stored["freshness_units"] > 0


def test_a_watcher_killed_mid_batch_is_succeeded_without_a_row_lost_or_doubled(tmp_path, ray_cluster, serve_address):
    in_dir, out = tmp_path / "in", tmp_path / "out"
    corpus = write_sample_corpus(str(in_dir), rows=1200, parquet_shards=2, jsonl_shards=0,
                                 bad_fraction=0.0, row_group_size=50, seed=48)  # fmt: skip
    watch_id = default_watch_id(str(in_dir))
    args = ["watch", "--input", str(in_dir), "--output", str(out), "--service", serve_address, "--every", "1s",
            "--max-wait", "0", "--set", f"service.application={APP}", "--set", "input.unit_rows=50",
            "--set", "actors.units_per_actor=1", "--set", "output.lease_s=15"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    driver = subprocess.Popen([sys.executable, "-m", "raypipe", *args], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: committed_units(out, watch_id) >= 3, 120, "3 units committed")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    at_kill = committed_units(out, watch_id)
    assert at_kill < 24, "the batch finished before it could be killed"
    time.sleep(2)  # let Ray reap the dead driver's actors

    # The same host: the dead holder's lease is taken over at once, its stored batch finished.
    watcher = Watching(in_dir, out, serve_address, input={"unit_rows": 50})
    try:
        wait_for(lambda: _committed(out) >= len(corpus.ids), 120, "every row committed")
    finally:
        report = watcher.finish()
    assert 1 <= report.resumed_units <= 24 - at_kill, "the successor finished the stored batch"
    assert committed_units(out, watch_id) == 24
    got, dead = assert_nothing_lost(out, corpus.ids)
    assert len(got) == len(corpus.ids) and dead == []
