"""Arrivals from S3 event notifications: what a watcher plans without listing its input.

An operator points the input bucket's notifications at an SQS queue
(`configure_bucket_notifications`, or the console); `SqsArrivals.poll` turns the queue's
messages into `Arrival`s — one per object created under the input, with the event's time as
its arrival — and `SqsArrivals.ack` deletes a message once every arrival it carried is
committed. Until then the message stays in the queue: a watcher killed before its commit leaves
them to come back (after the queue's visibility timeout) to its successor. SQS delivers at least
once and S3 may notify twice, so an arrival can be seen again; the watcher's files seen (size
and ETag) make a second sight cost nothing but the look.

Messages understood: the standard S3 event JSON (`Records`, each an `ObjectCreated:*` — Put,
Post, Copy, CompleteMultipartUpload), directly or wrapped by SNS (`Type: Notification`).
Ignored and deleted: `s3:TestEvent` (sent when notifications are configured), events other than
`ObjectCreated` — an `ObjectRemoved` is ignored because a removed input file does not take back
its committed answers (a daily does not either) — and objects outside the input. A message that
is none of these is logged once (its id and why, never its body) and deleted, so it can neither
stop a watcher nor come back forever.

What counts as a shard (extensions, hidden `_x` and `.x` files) stays planning's to say: an
arrival is only a location and a time.

Credentials come as for every other S3 call of raypipe: `storage_options` (s3fs's `key`,
`secret`, `token`, `profile` or delta-rs's `AWS_*` names), else botocore's own chain (the
`AWS_*` environment, a profile, an instance role). The queue's endpoint is `endpoint_url`, else
botocore's (`AWS_ENDPOINT_URL_SQS`, `AWS_ENDPOINT_URL`): the S3 endpoint of `storage_options` is
not used for SQS, which may live elsewhere. No credential is kept where `repr` or a log shows it.

Over ~400 lines on purpose: one concept, S3 event notifications, from the bucket's set-up
(`configure_bucket_notifications`) through the queue's messages to the arrivals a watcher plans
with; the message parsing and the SQS calls share its credentials and error handling.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

import botocore.config
import botocore.exceptions
import botocore.session

from raypipe.errors import ConfigError

__all__ = ["Arrival", "SqsArrivals", "configure_bucket_notifications", "notification_id"]

log = logging.getLogger(__name__)

_RECEIVE_MAX = 10
"""SQS hands out at most 10 messages per receive, and deletes at most 10 per batch."""
_WAIT_MAX_S = 20
"""SQS's longest long poll."""
_PERMANENT = frozenset(
    {
        "AWS.SimpleQueueService.NonExistentQueue",
        "QueueDoesNotExist",
        "AccessDenied",
        "AccessDeniedException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "InvalidAddress",
    }
)
"""Error codes no later poll can cure: the queue URL or the credentials are wrong."""


@dataclass(frozen=True)
class Arrival:
    """An object created under the input."""

    uri: str
    """`s3://bucket/key`, the key decoded (events carry it URL-encoded)."""
    size: int | None
    """Its size in bytes, as the event tells it."""
    arrived_at: datetime
    """UTC, from the S3 event's `eventTime`."""


class _Malformed(ValueError):
    """A message or record that is not an S3 event as documented."""


class _Unreachable(Exception):
    """SQS did not answer (or answered an error a later call may not get)."""


@dataclass
class _Held:
    """A received message whose arrivals are not all committed yet."""

    receipt: str
    waiting: set[Arrival] = field(default_factory=set)


def _client(
    service: str,
    *,
    endpoint_url: str | None,
    region: str | None,
    storage_options: Mapping[str, Any] | None,
    s3_endpoint: bool = False,
) -> Any:
    """A botocore client with raypipe's credentials and botocore's standard retries."""
    opts = dict(storage_options or {})
    client_kwargs = dict(opts.get("client_kwargs") or {})
    session = botocore.session.get_session()
    if opts.get("profile"):
        session.set_config_variable("profile", opts["profile"])
    if s3_endpoint and endpoint_url is None:
        endpoint_url = opts.get("endpoint_url") or client_kwargs.get("endpoint_url") or opts.get("AWS_ENDPOINT_URL")
    region = (
        region
        or client_kwargs.get("region_name")
        or opts.get("AWS_REGION")
        or opts.get("AWS_DEFAULT_REGION")
        or session.get_config_variable("region")
        or "us-east-1"
    )
    return session.create_client(
        service,
        region_name=region,
        endpoint_url=endpoint_url,
        aws_access_key_id=opts.get("key") or opts.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=opts.get("secret") or opts.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=opts.get("token") or opts.get("AWS_SESSION_TOKEN"),
        config=botocore.config.Config(retries={"mode": "standard"}, connect_timeout=10, read_timeout=_WAIT_MAX_S + 40),
    )


def _region_of(queue_url: str) -> str | None:
    """The region an AWS queue URL names (`https://sqs.eu-west-1.amazonaws.com/...`)."""
    m = re.match(r"https://sqs[.-]([a-z0-9-]+)\.amazonaws\.com", queue_url)
    return m.group(1) if m else None


def _under_input(input_uri: str) -> Callable[[str], bool]:
    """Whether a URI lies under the input: a folder or a file, or what a glob starts with."""
    if not input_uri.startswith("s3://"):
        raise ConfigError(f"events queue: the input {input_uri} is not on S3 (events come from an S3 bucket)")
    cut = min((i for i, ch in enumerate(input_uri) if ch in "*?["), default=None)
    if cut is not None:
        return lambda uri: uri.startswith(input_uri[:cut])
    base = input_uri.rstrip("/")
    return lambda uri: uri == base or uri.startswith(base + "/")


def _event_time(text: Any) -> datetime:
    if not isinstance(text, str):
        raise _Malformed("eventTime missing")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise _Malformed(f"eventTime {text[:40]!r} is not a time") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _arrival(record: Any) -> Arrival | None:
    """The arrival one S3 event record announces, or None for an event that is not a creation."""
    if not isinstance(record, dict) or not isinstance(record.get("eventName"), str):
        raise _Malformed("a record without eventName")
    name = record["eventName"].removeprefix("s3:")
    if not name.startswith("ObjectCreated:"):
        return None
    s3: Any = record.get("s3")
    try:
        bucket = s3["bucket"]["name"]
        key = s3["object"]["key"]
    except (KeyError, TypeError):
        raise _Malformed("a record without s3.bucket.name and s3.object.key") from None
    if not (isinstance(bucket, str) and isinstance(key, str) and bucket and key):
        raise _Malformed("a record whose bucket or key is not a name")
    size = s3["object"].get("size")
    return Arrival(
        uri=f"s3://{bucket}/{unquote_plus(key)}",
        size=size if isinstance(size, int) and not isinstance(size, bool) else None,
        arrived_at=_event_time(record.get("eventTime")),
    )


def _records(body: str) -> list[Any]:
    """The S3 event records a message body holds ([] for a test event)."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and doc.get("Type") == "Notification" and isinstance(doc.get("Message"), str):
            doc = json.loads(doc["Message"])  # SNS delivery without raw message delivery
    except ValueError:
        raise _Malformed("not JSON") from None
    if not isinstance(doc, dict):
        raise _Malformed("not a JSON object")
    if doc.get("Event") == "s3:TestEvent":
        return []
    records = doc.get("Records")
    if not isinstance(records, list):
        raise _Malformed("neither S3 event Records nor an s3:TestEvent")
    return records


class SqsArrivals:
    """The arrivals an SQS queue of S3 event notifications announces (see the module docstring).

    `input_uri` keeps only arrivals under the input (by location; planning decides the rest);
    `visibility_timeout_s` overrides the queue's own for the messages this receives: a
    message received and not acked within it is received again (a duplicate, harmless), so it
    should exceed the longest time from arrival to commit.
    """

    def __init__(
        self,
        queue_url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        storage_options: dict[str, Any] | None = None,
        input_uri: str | None = None,
        visibility_timeout_s: int | None = None,
    ) -> None:
        if not queue_url:
            raise ConfigError("events queue: give the queue's URL")
        self.queue_url = queue_url
        self._wanted = None if input_uri is None else _under_input(input_uri)
        self._visibility = visibility_timeout_s
        self._sqs = _client(
            "sqs",
            endpoint_url=endpoint_url,
            region=region or _region_of(queue_url),
            storage_options=storage_options,
        )
        self._held: dict[str, _Held] = {}
        """Message id -> its newest receipt handle and the arrivals it carried not yet acked."""
        self._lock = threading.Lock()
        """Guards `_held`: a watcher stopped during a long poll may ack while the poll answers."""

    def __repr__(self) -> str:
        return f"SqsArrivals({self.queue_url!r})"

    def close(self) -> None:
        self._sqs.close()

    def check(self) -> None:
        """Raises `ConfigError` when the queue cannot be read (a preflight: no message is taken)."""
        try:
            self._call("get_queue_attributes", QueueUrl=self.queue_url, AttributeNames=["QueueArn"])
        except _Unreachable as e:
            raise ConfigError(f"events queue {self.queue_url}: cannot read it ({e})") from e

    @property
    def unacked(self) -> int:
        """Messages received whose arrivals are not all acked yet."""
        return len(self._held)

    def poll(self, max_messages: int = 100, wait_s: float = 0) -> list[Arrival]:
        """New arrivals, oldest first, from up to `max_messages` messages; waits up to `wait_s`
        (at most 20 s, SQS's long poll) when the queue is empty. A queue that cannot be reached
        (after botocore's retries) is logged and gives no arrival: its messages wait there.

        One arrival per object per poll: an object announced twice (written twice, or one
        event delivered twice) arrives at its first announcement, with its newest size; its
        ack deletes every message of the poll that announced it. An object announced again in
        a later poll, before the first arrival's ack, is a new arrival (a newer version may
        have been written after the first was read)."""
        taken: list[str] = []
        settled: list[str] = []
        wait = max(0, min(_WAIT_MAX_S, round(wait_s)))
        while max_messages > 0:
            batch = min(_RECEIVE_MAX, max_messages)
            extra = {} if self._visibility is None else {"VisibilityTimeout": self._visibility}
            try:
                answer = self._call(
                    "receive_message",
                    QueueUrl=self.queue_url,
                    MaxNumberOfMessages=batch,
                    WaitTimeSeconds=wait,
                    **extra,
                )
            except _Unreachable as e:
                log.warning("events queue %s: no messages received (%s); trying again next poll", self.queue_url, e)
                break
            messages = answer.get("Messages") or []
            with self._lock:
                for message in messages:
                    held = self._take(message)
                    if held is None:
                        settled.append(message["ReceiptHandle"])
                    elif held:
                        taken.append(held)
            max_messages -= len(messages)
            wait = 0
            if len(messages) < batch:
                break
        self._delete(settled)
        with self._lock:
            taken = [m for m in taken if m in self._held]  # an ack meanwhile may have taken some
            # announcements in time order: the first gives the time, the last the size
            announced = sorted((a for m in taken for a in self._held[m].waiting), key=lambda a: (a.arrived_at, a.uri))
            first: dict[str, Arrival] = {}
            for a in announced:
                first.setdefault(a.uri, a)
                first[a.uri] = Arrival(a.uri, a.size, first[a.uri].arrived_at)
            for m in taken:
                self._held[m].waiting = {first[a.uri] for a in self._held[m].waiting}
        return sorted(first.values(), key=lambda a: (a.arrived_at, a.uri))

    def ack(self, arrivals: Iterable[Arrival]) -> None:
        """These arrivals are committed (or found committed already): every message whose
        arrivals are now all acked is deleted. Unknown arrivals are ignored."""
        gone = set(arrivals)
        settled = []
        with self._lock:
            for message_id, held in list(self._held.items()):
                held.waiting -= gone
                if not held.waiting:
                    settled.append(held.receipt)
                    del self._held[message_id]
        self._delete(settled)

    # -- the queue's messages -------------------------------------------------------------------
    def _take(self, message: dict[str, Any]) -> str | None:
        """Holds a message's arrivals under the input and returns its id; "" when it is held
        already; None when it can be deleted at once (nothing under the input, or malformed)."""
        message_id = message.get("MessageId", "?")
        if message_id in self._held:  # received again before its ack: it is already in hand
            self._held[message_id].receipt = message["ReceiptHandle"]
            return ""
        arrivals: set[Arrival] = set()
        try:
            records = _records(message.get("Body") or "")
        except _Malformed as e:
            log.warning("events queue %s: message %s deleted, not an S3 event (%s)", self.queue_url, message_id, e)
            return None
        bad = []
        for record in records:
            try:
                arrival = _arrival(record)
            except _Malformed as e:
                bad.append(str(e))
                continue
            if arrival is not None and (self._wanted is None or self._wanted(arrival.uri)):
                arrivals.add(arrival)
        if bad:
            log.warning(
                "events queue %s: message %s: %d of %d records skipped, not S3 events (%s)",
                self.queue_url,
                message_id,
                len(bad),
                len(records),
                bad[0],
            )
        if not arrivals:
            return None
        self._held[message_id] = _Held(message["ReceiptHandle"], arrivals)
        return str(message_id)

    def _delete(self, receipts: list[str]) -> None:
        for start in range(0, len(receipts), _RECEIVE_MAX):
            entries = [{"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(receipts[start : start + _RECEIVE_MAX])]
            try:
                answer = self._call("delete_message_batch", QueueUrl=self.queue_url, Entries=entries)
            except _Unreachable as e:
                answer = {"Failed": [{"Message": str(e)}] * len(entries)}
            if answer.get("Failed"):
                # the messages come back after their visibility timeout: a duplicate, harmless
                log.warning(
                    "events queue %s: %d messages not deleted (%s); they will be seen again",
                    self.queue_url,
                    len(answer["Failed"]),
                    answer["Failed"][0].get("Message") or answer["Failed"][0].get("Code"),
                )

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        """One SQS call; foreign errors mapped here: a wrong queue or credentials is a
        `ConfigError`, anything else `_Unreachable` (the next poll tries again)."""
        try:
            answer: dict[str, Any] = getattr(self._sqs, operation)(**kwargs)
            return answer
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in _PERMANENT:
                raise ConfigError(f"events queue {self.queue_url}: {code} (check the queue URL and credentials)") from e
            raise _Unreachable(code or str(e)) from e
        except botocore.exceptions.BotoCoreError as e:
            raise _Unreachable(str(e)) from e


def notification_id(queue_arn: str, prefix: str) -> str:
    """The id raypipe gives its queue notification for `prefix` (so a second set-up replaces it)."""
    return f"raypipe-{queue_arn.rsplit(':', 1)[-1]}-{prefix}"[:255]


def configure_bucket_notifications(
    bucket: str,
    queue_arn: str,
    prefix: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Sends `s3:ObjectCreated:*` events of keys under `prefix` in `bucket` to the SQS queue
    `queue_arn`: what an operator sets up once for `raypipe watch --events-queue`.

    The bucket's other notifications are kept; one set up earlier by this function for the same
    queue and prefix is replaced. The queue's policy must let S3 send to it (docs/operations.md).
    """
    s3 = _client("s3", endpoint_url=endpoint_url, region=region, storage_options=storage_options, s3_endpoint=True)
    try:
        current = s3.get_bucket_notification_configuration(Bucket=bucket)
        current.pop("ResponseMetadata", None)
        ours = notification_id(queue_arn, prefix)
        queues = [q for q in current.get("QueueConfigurations", []) if q.get("Id") != ours]
        config: dict[str, Any] = {"Id": ours, "QueueArn": queue_arn, "Events": ["s3:ObjectCreated:*"]}
        if prefix:
            config["Filter"] = {"Key": {"FilterRules": [{"Name": "prefix", "Value": prefix}]}}
        queues.append(config)
        s3.put_bucket_notification_configuration(
            Bucket=bucket, NotificationConfiguration={**current, "QueueConfigurations": queues}
        )
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        raise ConfigError(f"bucket {bucket}: cannot set its notifications ({code})") from e
    finally:
        s3.close()
