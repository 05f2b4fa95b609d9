"""Arrivals from S3 event notifications through SQS (`raypipe.plan.events`), against moto's
server on loopback: S3 sends the events itself where it can (puts, multipart uploads, SNS),
and messages S3 would never send (malformed ones) are put on the queue by hand. No Ray."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from raypipe.errors import ConfigError
from raypipe.plan.events import Arrival, SqsArrivals, configure_bucket_notifications


def record(bucket: str, key: str, *, event: str = "ObjectCreated:Put", size: int | None = 7) -> dict[str, Any]:
    obj: dict[str, Any] = {"key": key, "eTag": "abc"}
    if size is not None:
        obj["size"] = size
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventTime": "2026-11-28T00:01:02.500Z",
        "eventName": event,
        "s3": {"bucket": {"name": bucket}, "object": obj},
    }


def send(sqs: Any, url: str, body: Any) -> None:
    sqs.send_message(QueueUrl=url, MessageBody=body if isinstance(body, str) else json.dumps(body))


def test_objects_created_under_the_input_arrive_with_the_event_time_and_their_keys_decoded(
    sqs: Any,
    s3: Any,
    queue: tuple[str, str],
    bucket: str,
    in_queue: Callable[[str], int],
) -> None:
    url, arn = queue
    configure_bucket_notifications(bucket, arn, "")  # every key: the input filter is the reader's
    before = datetime.now(UTC)
    s3.put_object(Bucket=bucket, Key="in/day=1/a b+c%.parquet", Body=b"x" * 10)
    upload = s3.create_multipart_upload(Bucket=bucket, Key="in/big.jsonl")["UploadId"]
    part = s3.upload_part(Bucket=bucket, Key="in/big.jsonl", UploadId=upload, PartNumber=1, Body=b"{}\n" * 5)
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key="in/big.jsonl",
        UploadId=upload,
        MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
    )
    s3.put_object(Bucket=bucket, Key="input2/x.parquet", Body=b"x")  # beside the input, not in it
    s3.put_object(Bucket=bucket, Key="out/y.parquet", Body=b"x")
    s3.delete_object(Bucket=bucket, Key="in/day=1/a b+c%.parquet")  # not sent: only creations are asked for
    after = datetime.now(UTC)

    arrivals = SqsArrivals(url, input_uri=f"s3://{bucket}/in")
    got = arrivals.poll()

    assert sorted((a.uri, a.size) for a in got) == [
        (f"s3://{bucket}/in/big.jsonl", 15),
        (f"s3://{bucket}/in/day=1/a b+c%.parquet", 10),
    ]
    for a in got:
        assert a.arrived_at.tzinfo is not None and a.arrived_at.utcoffset() == timedelta(0)
        # the event's own time (moto's clock is this machine's), not the time of the poll
        assert before - timedelta(seconds=5) <= a.arrived_at <= after + timedelta(seconds=5)
    assert got == sorted(got, key=lambda a: a.arrived_at)
    # the test event and the arrivals outside the input are gone; the input's wait for their ack
    # (moto announces a multipart upload twice, as a Put and a CompleteMultipartUpload: one arrival)
    assert in_queue(url) == arrivals.unacked >= 2
    arrivals.ack(got)
    assert in_queue(url) == 0 and arrivals.unacked == 0


def test_a_message_is_deleted_when_all_its_records_are_acked_and_duplicates_cost_one_ack(
    sqs: Any,
    queue: tuple[str, str],
    in_queue: Callable[[str], int],
) -> None:
    url, _ = queue
    body = {
        "Records": [
            record("inbox", "in/a.parquet"),
            record("inbox", "in/b.parquet", event="ObjectCreated:CompleteMultipartUpload", size=None),
            record("inbox", "in/old.parquet", event="ObjectRemoved:Delete"),
        ]
    }
    send(sqs, url, body)
    send(sqs, url, body)  # S3 and SQS both may deliver twice
    arrivals = SqsArrivals(url, input_uri="s3://inbox/in/")

    got = arrivals.poll()

    a = Arrival("s3://inbox/in/a.parquet", 7, datetime(2026, 11, 28, 0, 1, 2, 500000, tzinfo=UTC))
    b = Arrival("s3://inbox/in/b.parquet", None, a.arrived_at)
    assert got == [a, b], "one arrival per created object, the removal ignored, the duplicate once"
    arrivals.ack([a])
    assert in_queue(url) == 2, "each message still carries an arrival not committed"
    arrivals.ack([b, b])
    assert in_queue(url) == 0
    arrivals.ack([a])  # acked twice: nothing left to delete, no error


def test_events_wrapped_by_sns_arrive(
    sqs: Any,
    s3: Any,
    queue: tuple[str, str],
    bucket: str,
    in_queue: Callable[[str], int],
    aws_client: Callable[[str], Any],
) -> None:
    url, arn = queue
    sns = aws_client("sns")
    topic = sns.create_topic(Name=f"t-{uuid.uuid4().hex[:8]}")["TopicArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
    s3.put_bucket_notification_configuration(
        Bucket=bucket,
        NotificationConfiguration={"TopicConfigurations": [{"TopicArn": topic, "Events": ["s3:ObjectCreated:*"]}]},
    )
    s3.put_object(Bucket=bucket, Key="in/a.parquet", Body=b"abc")
    # SNS's envelope with a malformed S3 event inside is malformed too
    send(sqs, url, {"Type": "Notification", "Message": "{not json"})

    arrivals = SqsArrivals(url, input_uri=f"s3://{bucket}/in")
    got = arrivals.poll()

    assert [(a.uri, a.size) for a in got] == [(f"s3://{bucket}/in/a.parquet", 3)]
    arrivals.ack(got)
    assert in_queue(url) == 0


@pytest.mark.parametrize(
    "body",
    [
        "not json at all",
        "[1, 2]",
        {"Records": "none"},
        {"Records": [{"eventName": "ObjectCreated:Put"}]},
        {
            "Records": [
                {
                    "eventName": "ObjectCreated:Put",
                    **{k: v for k, v in record("inbox", "in/a").items() if k != "eventTime"},
                }
            ]
        },
        {"Records": [record("inbox", "in/a") | {"eventTime": "yesterday"}]},
        {"Records": [42]},
        {"detail-type": "Object Created"},
    ],
    ids=["text", "array", "records-not-a-list", "no-s3", "no-time", "bad-time", "record-not-object", "eventbridge"],
)
def test_a_malformed_message_is_logged_once_and_deleted(
    sqs: Any,
    queue: tuple[str, str],
    body: Any,
    caplog: pytest.LogCaptureFixture,
    in_queue: Callable[[str], int],
) -> None:
    url, _ = queue
    send(sqs, url, body)
    arrivals = SqsArrivals(url, visibility_timeout_s=0)  # a message not deleted would be received again

    with caplog.at_level(logging.WARNING, logger="raypipe.plan.events"):
        assert arrivals.poll() == []
        assert arrivals.poll() == []

    assert in_queue(url) == 0
    assert len(caplog.records) == 1, caplog.text
    assert "deleted, not an S3 event" in caplog.text or "records skipped, not S3 events" in caplog.text


def test_a_good_record_beside_a_bad_one_still_arrives(
    sqs: Any,
    queue: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
    in_queue: Callable[[str], int],
) -> None:
    url, _ = queue
    send(sqs, url, {"Records": [{"eventName": "ObjectCreated:Put"}, record("inbox", "in/a.parquet")]})
    arrivals = SqsArrivals(url)

    with caplog.at_level(logging.WARNING, logger="raypipe.plan.events"):
        got = arrivals.poll()

    assert [a.uri for a in got] == ["s3://inbox/in/a.parquet"]
    assert len(caplog.records) == 1 and "1 of 2 records" in caplog.text
    arrivals.ack(got)
    assert in_queue(url) == 0


def test_test_events_and_arrivals_elsewhere_are_deleted_without_a_word(
    sqs: Any,
    queue: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
    in_queue: Callable[[str], int],
) -> None:
    url, _ = queue
    send(sqs, url, {"Service": "Amazon S3", "Event": "s3:TestEvent", "Time": "2026-11-28T00:00:00Z", "Bucket": "inbox"})
    send(sqs, url, {"Records": [record("inbox", "input2/a.parquet"), record("other", "in/a.parquet")]})
    send(sqs, url, {"Records": [record("inbox", "in/gone.parquet", event="ObjectRemoved:DeleteMarkerCreated")]})

    with caplog.at_level(logging.INFO, logger="raypipe.plan.events"):
        assert SqsArrivals(url, input_uri="s3://inbox/in").poll() == []

    assert in_queue(url) == 0 and caplog.records == []


def test_a_glob_input_keeps_what_its_literal_part_starts_with(sqs: Any, queue: tuple[str, str]) -> None:
    url, _ = queue
    send(sqs, url, {"Records": [record("inbox", k) for k in ("in/2026-11/a.parquet", "in/2025-01/a.parquet", "in/x")]})

    got = SqsArrivals(url, input_uri="s3://inbox/in/2026-*/*.parquet").poll()

    assert [a.uri for a in got] == ["s3://inbox/in/2026-11/a.parquet"]


def test_arrivals_not_acked_come_back_to_a_successor(
    sqs: Any, queue: tuple[str, str], in_queue: Callable[[str], int]
) -> None:
    url, _ = queue
    send(sqs, url, {"Records": [record("inbox", "in/a.parquet")]})
    # visibility 0: a received message is visible again at once, as after a watcher's death
    first = SqsArrivals(url, visibility_timeout_s=0)
    got = first.poll()
    assert [a.uri for a in got] == ["s3://inbox/in/a.parquet"]
    assert first.poll() == [], "received again before its ack: already in hand, not a new arrival"

    # the first watcher is killed before its commit: nothing was deleted
    successor = SqsArrivals(url, visibility_timeout_s=0)
    assert successor.poll() == got
    assert in_queue(url) == 1

    successor.ack(got)
    assert in_queue(url) == 0
    assert SqsArrivals(url).poll() == []


def test_more_messages_than_one_receive_holds_are_all_polled(sqs: Any, queue: tuple[str, str]) -> None:
    url, _ = queue
    for i in range(23):
        send(sqs, url, {"Records": [record("inbox", f"in/{i:02}.parquet")]})
    arrivals = SqsArrivals(url)

    assert len(arrivals.poll(max_messages=15)) == 15
    rest = arrivals.poll()
    assert len(rest) == 8 and arrivals.unacked == 23


def test_credentials_come_from_storage_options_and_are_never_shown(
    sqs: Any,
    queue: tuple[str, str],
    aws_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, _ = queue
    send(sqs, url, "not json")
    send(sqs, url, {"Records": [record("inbox", "in/a.parquet")]})
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    key, secret = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"

    with caplog.at_level(logging.WARNING, logger="raypipe.plan.events"):
        assert SqsArrivals(url).poll() == [], "no credentials anywhere: nothing received, a warning"
        arrivals = SqsArrivals(url, endpoint_url=aws_endpoint, storage_options={"key": key, "secret": secret})
        got = arrivals.poll()

    assert [a.uri for a in got] == ["s3://inbox/in/a.parquet"]
    shown = caplog.text + repr(arrivals) + str(vars(arrivals))
    assert key not in shown and secret not in shown
    assert len(caplog.records) == 2, caplog.text  # the failed poll, the malformed message


def test_a_queue_that_does_not_exist_is_a_config_error(aws_endpoint: str) -> None:
    missing = SqsArrivals(f"{aws_endpoint}/123456789012/no-such-queue")
    with pytest.raises(ConfigError, match="no-such-queue"):
        missing.check()
    with pytest.raises(ConfigError):
        missing.poll()


def test_an_input_not_on_s3_is_refused(aws_endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not on S3"):
        SqsArrivals(f"{aws_endpoint}/123456789012/q", input_uri=str(tmp_path))


def test_configuring_notifications_keeps_the_bucket_s_others_and_replaces_its_own(
    s3: Any, sqs: Any, queue: tuple[str, str], bucket: str
) -> None:
    url, arn = queue
    other = sqs.create_queue(QueueName=f"other-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    other_arn = sqs.get_queue_attributes(QueueUrl=other, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    configure_bucket_notifications(bucket, other_arn, "logs/")
    configure_bucket_notifications(bucket, arn, "in/")
    configure_bucket_notifications(bucket, arn, "in/")

    queues = s3.get_bucket_notification_configuration(Bucket=bucket)["QueueConfigurations"]
    assert sorted((q["QueueArn"], q["Filter"]["Key"]["FilterRules"][0]["Value"]) for q in queues) == sorted(
        [(other_arn, "logs/"), (arn, "in/")]
    )
    s3.put_object(Bucket=bucket, Key="in/a.parquet", Body=b"x")
    s3.put_object(Bucket=bucket, Key="logs/a.parquet", Body=b"x")
    got = SqsArrivals(url).poll()
    assert [a.uri for a in got] == [f"s3://{bucket}/in/a.parquet"]


def test_an_object_announced_twice_in_a_poll_arrives_once_and_a_later_version_is_not_acked_with_it(
    sqs: Any,
    queue: tuple[str, str],
    in_queue: Callable[[str], int],
) -> None:
    url, _ = queue
    early = record("inbox", "in/a.parquet", size=5)
    late = record("inbox", "in/a.parquet", size=9) | {"eventTime": "2026-11-28T00:02:00Z"}
    send(sqs, url, {"Records": [late]})
    send(sqs, url, {"Records": [early]})
    arrivals = SqsArrivals(url)

    got = arrivals.poll()
    assert got == [Arrival("s3://inbox/in/a.parquet", 9, datetime(2026, 11, 28, 0, 1, 2, 500000, tzinfo=UTC))]

    # written again after the watcher read it: the ack of what it read leaves the newer announcement
    newer = record("inbox", "in/a.parquet", size=11) | {"eventTime": "2026-11-28T00:03:00Z"}
    send(sqs, url, {"Records": [newer]})
    again = arrivals.poll()
    assert [(a.size, a.arrived_at.minute) for a in again] == [(11, 3)]
    arrivals.ack(got)
    assert in_queue(url) == 1
    arrivals.ack(again)
    assert in_queue(url) == 0


def test_an_ack_deletes_with_the_newest_receipt_of_a_message_received_twice() -> None:
    # SQS deletes a message received twice only by its newest receipt handle (an older one
    # "succeeds" and deletes nothing); moto accepts any, so SQS's answers are stubbed here.
    from botocore.stub import Stubber

    url = "https://sqs.us-east-1.amazonaws.com/123456789012/arrivals"
    arrivals = SqsArrivals(url, storage_options={"key": "k", "secret": "s"})
    body = json.dumps({"Records": [record("inbox", "in/a.parquet")]})
    with Stubber(arrivals._sqs) as stub:
        for receipt in ("first", "second"):
            stub.add_response(
                "receive_message",
                {"Messages": [{"MessageId": "m1", "ReceiptHandle": receipt, "Body": body}]},
                {"QueueUrl": url, "MaxNumberOfMessages": 10, "WaitTimeSeconds": 0},
            )
        stub.add_response(
            "delete_message_batch",
            {"Successful": [{"Id": "0"}], "Failed": []},
            {"QueueUrl": url, "Entries": [{"Id": "0", "ReceiptHandle": "second"}]},
        )
        got = arrivals.poll(max_messages=10)
        assert arrivals.poll(max_messages=10) == []
        arrivals.ack(got)
        stub.assert_no_pending_responses()


def test_a_queue_that_cannot_be_reached_fails_the_check_and_only_delays_a_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from bench.tcp_proxy import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    arrivals = SqsArrivals(f"{closed}/123456789012/q", endpoint_url=closed, storage_options={"key": "k", "secret": "s"})
    with pytest.raises(ConfigError, match="cannot read it"):
        arrivals.check()
    with caplog.at_level(logging.WARNING, logger="raypipe.plan.events"):
        assert arrivals.poll() == []
    assert "trying again next poll" in caplog.text
