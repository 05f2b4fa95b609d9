"""Answer reuse never crosses a setting that changes answers: a redeploy at a shorter max length.

The first backfill is answered by the shared app (the demo model's own max length, 512); the second,
over the same texts under new ids into the same output, by an app whose server cuts texts at 16
tokens. Its version says so (``+len16``), so none of the first run's answers is reused: every
text is sent again, and long texts come back truncated.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from serve_app.model import read_model_card
from serve_app.settings import ServerSettings

pytestmark = pytest.mark.timeout(420)


def _served(app: str) -> int:
    return int(serve.get_app_handle(app).stats.remote().result()["paragraphs"].get("OK", 0))


def _shard(path, prefix: str, texts: list[str]) -> None:
    path.mkdir(parents=True)
    ids = [f"{prefix}{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, "text": texts}), path / "part.parquet")


def test_answers_made_at_another_max_length_are_not_reused(tmp_path, serve_address, deploy_app, demo_model_dir):
    texts = [f"paragraph {i}: " + "we laughed and danced all night long at the wedding " * 4 for i in range(60)]
    out = str(tmp_path / "out")
    _shard(tmp_path / "a", "a", texts)
    first = raypipe.backfill(str(tmp_path / "a"), out, service=serve_address, run_id="full")
    assert first.status == "completed" and first.rows_ok == 60
    base = read_model_card(demo_model_dir).version
    assert first.model_version == base

    app = deploy_app("short", ServerSettings(max_sequence_length=16))
    before = _served(app)
    _shard(tmp_path / "b", "b", texts)  # the same texts under new ids
    second = raypipe.backfill(
        str(tmp_path / "b"), out, service=serve_address, run_id="short", settings={"service": {"application": app}}
    )
    assert second.status == "completed" and second.rows_ok == 60
    assert second.model_version == f"{base}+len16"
    assert second.rows_copied == 0  # nothing reused from the 512-token answers
    assert _served(app) - before == 60
    rows = raypipe.read_outcomes(out, run_id="short").to_pylist()
    assert {r["model_version"] for r in rows} == {f"{base}+len16"}
    assert all(r["truncated"] for r in rows)

    # The same app again: its own answers are reused, so the key is the version and nothing else.
    _shard(tmp_path / "c", "c", texts)
    third = raypipe.backfill(
        str(tmp_path / "c"), out, service=serve_address, run_id="again", settings={"service": {"application": app}}
    )
    assert third.status == "completed" and third.rows_copied == 60
