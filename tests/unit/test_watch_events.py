"""`raypipe watch` with its arrivals from S3 event notifications: the watcher in this process
(the actor in process, the fake model client of `tests.unit.test_watch`), its input on moto's S3
server on loopback, the bucket's notifications sent by moto to a moto SQS queue read by a real
`SqsArrivals`. What is promised: every file committed once, and the queue drained — a message
goes once its file is committed, also when a killed watcher committed it and never got to
delete it. No Ray."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.output import Output
from raypipe.config import run_input
from raypipe.plan.events import SqsArrivals, configure_bucket_notifications
from raypipe.run.watch.mode import watch
from tests.unit.test_watch import Service, config


class Setup:
    """A bucket whose `in/` notifications go to a new queue (the conftest's moto server)."""

    def __init__(self, s3: Any, bucket: str, queue: tuple[str, str]) -> None:
        self.s3, self.bucket = s3, bucket
        self.queue, arn = queue
        configure_bucket_notifications(self.bucket, arn, "in/")
        self.input = f"s3://{self.bucket}/in"

    def write(self, name: str, ids: list[str]) -> None:
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": ids, "text": [f"text of {i}" for i in ids]}), buf)
        self.s3.put_object(Bucket=self.bucket, Key=f"in/{name}.parquet", Body=buf.getvalue())


@pytest.fixture
def inbox(s3: Any, bucket: str, queue: tuple[str, str]) -> Setup:
    return Setup(s3, bucket, queue)


class KilledBeforeItsAcks(SqsArrivals):
    """A watcher's queue that dies between a commit and its acks: nothing is ever deleted."""

    def ack(self, arrivals: Any) -> None:
        return None


def run(tmp_path: Path, service: Service, inbox: Setup, events: SqsArrivals, ticks: int) -> Any:
    cfg = config(tmp_path)
    return watch(
        cfg,
        run_input(cfg, inbox.input, "watch"),
        Output.at(cfg.output),
        runner=service.runner,
        events=events,
        ticks=ticks,
    )


def committed_ids(tmp_path: Path) -> list[str]:
    return sorted(read_outcomes(str(tmp_path / "out"), columns=["id"]).column("id").to_pylist())


def test_files_announced_by_events_are_committed_once_and_their_messages_deleted(
    inbox: Setup, in_queue: Callable[[str], int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = Service(monkeypatch)
    inbox.write("a", ["a1", "a2"])
    run(tmp_path, service, inbox, SqsArrivals(inbox.queue), ticks=1)  # the first look also lists
    assert committed_ids(tmp_path) == ["a1", "a2"]
    assert in_queue(inbox.queue) == 0

    inbox.write("b", ["b1"])
    inbox.write("_SUCCESS", [])  # announced, not a shard: its message goes too
    report = run(tmp_path, service, inbox, SqsArrivals(inbox.queue), ticks=2)
    assert committed_ids(tmp_path) == ["a1", "a2", "b1"]
    assert report.units == 1 and in_queue(inbox.queue) == 0


def test_a_file_a_killed_watcher_committed_and_never_acked_is_not_read_again_and_its_message_goes(
    inbox: Setup, in_queue: Callable[[str], int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = Service(monkeypatch)
    inbox.write("a", ["a1"])
    run(tmp_path, service, inbox, KilledBeforeItsAcks(inbox.queue, visibility_timeout_s=0), ticks=1)
    assert committed_ids(tmp_path) == ["a1"] and in_queue(inbox.queue) == 1
    calls = service.classify_calls

    successor = SqsArrivals(inbox.queue, visibility_timeout_s=0)
    run(tmp_path, service, inbox, successor, ticks=2)

    assert committed_ids(tmp_path) == ["a1"] and service.classify_calls == calls
    assert in_queue(inbox.queue) == 0, "the message of a file committed already is deleted, not kept for ever"
    assert successor.unacked == 0


def test_an_arrival_announced_twice_is_committed_once(
    inbox: Setup, sqs: Any, in_queue: Callable[[str], int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = Service(monkeypatch)
    run(tmp_path, service, inbox, SqsArrivals(inbox.queue), ticks=1)  # nothing yet: the listing is empty
    inbox.write("a", ["a1"])
    body = sqs.receive_message(QueueUrl=inbox.queue, VisibilityTimeout=0)["Messages"][0]["Body"]
    sqs.send_message(QueueUrl=inbox.queue, MessageBody=body)  # S3 may notify twice

    events = SqsArrivals(inbox.queue)
    run(tmp_path, service, inbox, events, ticks=2)

    assert committed_ids(tmp_path) == ["a1"]
    assert in_queue(inbox.queue) == 0 and events.unacked == 0


def test_a_watcher_with_a_queue_it_cannot_read_or_an_input_not_on_s3_is_refused_before_it_starts(
    aws_endpoint: str, inbox: Setup, tmp_path: Path
) -> None:
    from raypipe.errors import ConfigError
    from raypipe.run.preflight import check_watch

    cfg = config(tmp_path, events_queue=f"{aws_endpoint}/123456789012/no-such-queue")
    with pytest.raises(ConfigError, match="no-such-queue"):
        check_watch(cfg, run_input(cfg, inbox.input, "watch"), Output.at(cfg.output))
    cfg = config(tmp_path, events_queue=inbox.queue)
    with pytest.raises(ConfigError, match="not on S3"):
        check_watch(cfg, run_input(cfg, str(tmp_path / "in"), "watch"), Output.at(cfg.output))
    check_watch(cfg, run_input(cfg, inbox.input, "watch"), Output.at(cfg.output))  # a queue it can read, an input on S3


def test_a_file_announced_after_the_first_look_listed_its_folder_is_found(inbox: Setup) -> None:
    from raypipe.api import build_config
    from raypipe.run.watch.arrivals import EventArrivals

    inbox.write("a", ["a1"])
    cfg = build_config(output="unused")
    source = EventArrivals(run_input(cfg, inbox.input, "watch"), SqsArrivals(inbox.queue))
    assert [p.rsplit("/", 1)[-1] for p in (item.uri for item in source.look())] == ["a.parquet", "a.parquet"]

    inbox.write("b", ["b1"])  # the folder's listing is cached by now: the event's file must be found all the same
    assert [item.uri.rsplit("/", 1)[-1] for item in source.look()] == ["b.parquet"]


def test_a_look_that_waits_is_one_receive_that_waits_on_the_queue(tmp_path: Path) -> None:
    """SQS's long poll, stubbed: a look given a wait makes one receive with `WaitTimeSeconds`
    (capped at SQS's 20 s), and an error of that receive reaches the watcher, as a short poll's does."""
    import threading

    from botocore.stub import Stubber

    from raypipe.config import InputConfig
    from raypipe.errors import ConfigError
    from raypipe.run.watch.arrivals import EventArrivals

    url = "https://sqs.us-east-1.amazonaws.com/123456789012/arrivals"
    events = SqsArrivals(url, storage_options={"key": "k", "secret": "s"})
    (tmp_path / "in").mkdir()
    source = EventArrivals(InputConfig(uri=str(tmp_path / "in")), events)
    stop = threading.Event()
    with Stubber(events._sqs) as stub:
        for wait in (0, 5, 20):
            stub.add_response(
                "receive_message", {}, {"QueueUrl": url, "MaxNumberOfMessages": 10, "WaitTimeSeconds": wait}
            )
        stub.add_client_error("receive_message", "AWS.SimpleQueueService.NonExistentQueue")
        assert source.look() == []  # the first: a listing, and a poll that does not wait
        assert source.look(5, stop) == []
        assert source.look(60, stop) == []
        with pytest.raises(ConfigError, match="NonExistentQueue"):
            source.look(5, stop)
        stub.assert_no_pending_responses()


def test_a_watch_closes_the_queue_client_it_opened(
    inbox: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch given `watch.events_queue` opens its own queue client and closes it when it stops
    (a notebook that watches again does not keep the last one's connections); a client the
    caller passed is the caller's."""
    closed: list[str] = []
    monkeypatch.setattr(SqsArrivals, "close", lambda self: closed.append(self.queue_url))
    service = Service(monkeypatch)
    inbox.write("a", ["a1"])
    cfg = config(tmp_path, events_queue=inbox.queue)
    watch(cfg, run_input(cfg, inbox.input, "watch"), Output.at(cfg.output), runner=service.runner, ticks=1)
    assert committed_ids(tmp_path) == ["a1"] and closed == [inbox.queue]
    run(tmp_path, service, inbox, SqsArrivals(inbox.queue), ticks=1)
    assert closed == [inbox.queue]
