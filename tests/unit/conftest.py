"""Fixtures of the unit tests that talk to AWS services: moto's server on loopback (S3, SQS,
SNS), started once per test module, the standard AWS variables pointing at it, and clients,
a queue and a bucket made fresh per test (names of their own, so tests do not see each
other's messages or objects). No Ray."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import botocore.session
import pytest

AWS_REGION = "us-east-1"


@pytest.fixture(scope="module")
def aws_endpoint() -> Iterator[str]:
    """moto's server, with `AWS_ENDPOINT_URL` and test credentials in the environment meanwhile."""
    import s3fs

    from bench.s3server import MotoServer

    patch = pytest.MonkeyPatch()
    with MotoServer() as server:
        for key, value in {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": AWS_REGION,
        }.items():
            patch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # none made for another endpoint is reused
        try:
            yield server.endpoint
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            patch.undo()


@pytest.fixture
def aws_client(aws_endpoint: str) -> Callable[[str], Any]:
    """A botocore client of a service (`"s3"`, `"sqs"`, `"sns"`) on moto's server."""
    session = botocore.session.get_session()
    return lambda service: session.create_client(service, region_name=AWS_REGION)


@pytest.fixture
def sqs(aws_client: Callable[[str], Any]) -> Any:
    return aws_client("sqs")


@pytest.fixture
def s3(aws_client: Callable[[str], Any]) -> Any:
    return aws_client("s3")


@pytest.fixture
def queue(sqs: Any) -> tuple[str, str]:
    """A new SQS queue: (URL, ARN)."""
    url = sqs.create_queue(QueueName=f"arrivals-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn


@pytest.fixture
def bucket(s3: Any) -> str:
    """A new S3 bucket's name."""
    name = f"inbox-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def in_queue(sqs: Any) -> Callable[[str], int]:
    """How many messages are still in a queue (by URL), received or not."""

    def count(url: str) -> int:
        attrs = sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        )["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])

    return count
