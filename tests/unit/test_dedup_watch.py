"""The reuse index of a watcher (no Ray; the actor in this process, a fake model client): built
once at start, then kept current by the answers its actor commits, so a text that arrives again
at a later tick costs no call, and no tick builds the index again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.api import build_config
from raypipe.call import reuse
from raypipe.call.reuse import TextIndex, hash_texts
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.output import Output
from raypipe.commit.schema import label_column, text_hashes
from raypipe.config import ClientConfig, run_input
from raypipe.run import steps
from raypipe.run.watch.mode import watch
from raypipe.run.watch.warm import InProcessUnits
from tests.fakes import LABELS, CountingClient, fake_probs


def write(folder: Path, name: str, rows: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    pq.write_table(pa.table({"id": list(rows), "text": list(rows.values())}), tmp)
    os.replace(tmp, folder / f"{name}.parquet")  # arrives whole


def test_a_text_committed_at_one_tick_is_reused_at_the_next_and_the_index_is_built_once(tmp_path, monkeypatch):
    client = CountingClient()
    texts_sent: list[str] = []
    original = client.classify

    async def classify(ids: Any, texts: Any) -> Any:
        if not texts_sent:
            # The same text arrives again, after this one's unit: the watcher sees it at a later tick.
            write(tmp_path / "in", "b", {"b1": "the same paragraph", "b2": "a new paragraph"})
        texts_sent.extend(texts)
        return await original(ids, texts)

    client.classify = classify  # type: ignore[method-assign]
    monkeypatch.setattr(steps.ModelService, "ask", classmethod(lambda cls, s, c: cls(LABELS, "fake-1", ClientConfig())))
    builds: list[int] = []
    build = reuse.build_index

    def counting(*args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(reuse, "build_index", counting)
    cfg = build_config(output=str(tmp_path / "out"), settings={"watch": {"every_s": 0.01, "max_wait_s": 0}})
    write(tmp_path / "in", "a", {"a1": "the same paragraph"})
    report = watch(
        cfg,
        run_input(cfg, str(tmp_path / "in"), "watch"),
        Output.at(cfg.output),
        runner=lambda settings: InProcessUnits(settings, client_factory=lambda: client),
        ticks=4,
    )
    assert report.units == 2 and report.rows == 3
    assert sorted(texts_sent) == ["a new paragraph", "the same paragraph"]  # b1 cost no call
    assert builds == [1]  # at start, not per tick
    rows = read_outcomes(str(tmp_path / "out")).to_pylist()
    assert {r["id"]: r["outcome"] for r in rows} == {"a1": "result", "b1": "result", "b2": "result"}
    (b1,) = [r for r in rows if r["id"] == "b1"]
    (a1,) = [r for r in rows if r["id"] == "a1"]
    assert [b1[label_column(x)] for x in LABELS] == [a1[label_column(x)] for x in LABELS]


def outcome_rows(
    texts: list[str], *, version: str = "m1", outcome: str = "result", status: str | None = "ok"
) -> pa.Table:
    n = len(texts)
    probs = np.array([fake_probs(t) for t in texts], dtype=np.float32)
    return pa.table(
        {
            "outcome": [outcome] * n,
            "status": [status] * n,
            "model_version": [version] * n,
            "text_hash": text_hashes(texts),
            "truncated": [False] * n,
            **{label_column(x): probs[:, k] for k, x in enumerate(LABELS)},
        }
    )


def test_answers_added_after_the_build_are_served_only_for_their_version_and_only_results():
    """Added answers sit past the shards' positions; a dead letter, an empty text's result or
    another version's answer is never added; a text held already is not added twice."""
    base = TextIndex("m1", LABELS, hash_texts(["held"]), np.array([fake_probs("held")], np.float32), np.array([True]))
    assert base.add_committed(outcome_rows(["held", "new", "new"])) == 1
    assert base.add_committed(outcome_rows(["other"], version="m2")) == 0
    assert base.add_committed(outcome_rows(["dead"], outcome="dead_letter", status=None)) == 0
    assert base.add_committed(outcome_rows([""], status="empty_text")) == 0
    assert len(base) == 2
    found = base.lookup(hash_texts(["new", "held", "other", "dead"]))
    assert found[0] == 1 and found[1] == 0 and (found[2:] == -1).all()
    np.testing.assert_allclose(base.probabilities[found[:2]], [fake_probs("new"), fake_probs("held")])
    assert base.truncated[found[:2]].tolist() == [False, True]
    empty = TextIndex.empty("m1", LABELS)
    assert empty.add_committed(outcome_rows(["x"])) == 1 and empty.lookup(hash_texts(["x"]))[0] == 0
