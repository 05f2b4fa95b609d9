"""`raypipe watch` with its arrivals from S3 event notifications, on real parts: local Ray, the
session's Serve gRPC app, moto's S3 server whose bucket notifications go to a moto SQS queue.
Files put while the watcher runs are committed once each, and every message is deleted once its
file is committed."""

from __future__ import annotations

import io
import threading
import uuid
from pathlib import Path
from typing import Any

import botocore.session
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from raypipe.plan.events import configure_bucket_notifications
from tests.integration.conftest import S3, wait_for
from tests.integration.helpers import assert_nothing_lost, ids, results

APP = "raypipe"  # the session's shared app: the tests run one at a time, so counts since a test began are its own
SETTINGS = {"service": {"application": APP}, "actors": {"min_actors": 1}}

pytestmark = pytest.mark.timeout(240)


def _answered() -> int:
    return int(serve.get_app_handle(APP).stats.remote().result()["paragraphs"].get("OK", 0))


def _in_queue(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


def test_a_watcher_reading_s3_events_commits_each_file_put_once_and_empties_the_queue(
    tmp_path: Path, s3: S3, serve_address: str
) -> None:
    session = botocore.session.get_session()
    s3c, sqs = (
        session.create_client("s3", region_name="us-east-1"),
        session.create_client("sqs", region_name="us-east-1"),
    )
    name = f"events-{uuid.uuid4().hex[:8]}"
    s3c.create_bucket(Bucket=name)
    queue = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    configure_bucket_notifications(name, arn, "in/")

    def put(file: str, n: int) -> list[str]:
        rows = [f"{file}-{i}" for i in range(n)]
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": rows, "text": [f"{r}: what a joyful, lovely surprise" for r in rows]}), buf)
        s3c.put_object(Bucket=name, Key=f"in/{file}.parquet", Body=buf.getvalue())
        return rows

    out = tmp_path / "out"
    start = _answered()
    stop, report, errors = threading.Event(), [], []

    def run() -> None:
        try:
            report.append(
                raypipe.watch(
                    f"s3://{name}/in/",
                    str(out),
                    every_s=0.3,
                    max_wait_s=0,
                    events_queue=queue,
                    stop=stop,
                    service=serve_address,
                    settings=SETTINGS,
                )
            )
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    expected: list[str] = []
    try:
        expected += put("first", 30)
        wait_for(lambda: (out / "outcomes").exists() and len(ids(results(out))) >= 30, 90, "the first file committed")
        expected += put("second", 20)
        expected += put("third", 10)
        wait_for(lambda: len(ids(results(out))) >= 60, 60, "the files put while it runs committed")
        wait_for(lambda: _in_queue(sqs, queue) == 0, 30, "every message deleted")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and errors == []
    assert report[0].status == "stopped" and report[0].rows == 60 and report[0].files == 3
    assert report[0].freshness_p95_s > 0
    assert_nothing_lost(out, expected)
    assert _answered() - start == 60, "each paragraph inferred once"
