"""The Serve app against malformed and random requests: answers or INVALID_ARGUMENT, never down."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc

META = (("application", "raypipe"),)


@pytest.fixture(scope="module")
def stub(serve_address):
    with grpc.insecure_channel(serve_address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield emotion_pb2_grpc.EmotionClassifierStub(channel)


def classify(stub, pairs, timeout=30):
    request = emotion_pb2.ClassifyRequest(paragraphs=[emotion_pb2.Paragraph(id=i, text=t) for i, t in pairs])
    return stub.Classify(request, timeout=timeout, metadata=META)


def code_of(stub, pairs):
    try:
        classify(stub, pairs)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([], "empty batch"),
        ([(f"i{n}", "text") for n in range(257)], "over the server's maximum of 256"),
        ([("", "text")], "empty id"),
        ([("a", "x"), ("a", "y")], "more than once"),
    ],
)
def test_malformed_requests_get_invalid_argument(stub, pairs, message):
    code, details = code_of(stub, pairs)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details


def test_oversize_text_is_truncated_not_rejected(stub):
    long_text = "I am so happy today! " * 20_000  # ~420 KB, far over the model's token limit
    response = classify(stub, [("long", long_text), ("short", "what a lovely day")])
    assert [p.truncated for p in response.predictions] == [True, False]
    assert abs(sum(response.predictions[0].probabilities) - 1) < 1e-4


paragraph_ids = st.text(min_size=0, max_size=8)
texts = st.one_of(st.text(max_size=300), st.just(""), st.text(alphabet="\x00\n\t \u200b\U0001f600", max_size=50))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(paragraph_ids, texts), min_size=0, max_size=300))
def test_random_requests_never_take_the_server_down(stub, pairs):
    code, _ = code_of(stub, pairs)
    ids = [i for i, _ in pairs]
    valid = 0 < len(pairs) <= 256 and all(ids) and len(set(ids)) == len(ids)
    assert code == (grpc.StatusCode.OK if valid else grpc.StatusCode.INVALID_ARGUMENT)


def test_server_still_answers_after_the_burst(stub):
    info = stub.ModelInfo(emotion_pb2.ModelInfoRequest(), timeout=10, metadata=META)
    assert len(info.labels) == 6
    response = classify(stub, [("ok", "I love you with all my heart")])
    assert len(response.predictions) == 1
