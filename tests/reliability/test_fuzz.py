"""Property-based fuzzing of the verifier's request messages (hypothesis).

Whatever a client sends, the server never crashes and never answers UNKNOWN or
INTERNAL (those mean "server bug"): a request is served, or refused with
INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED. Afterwards the
server still serves, holds no KV, and decodes exactly.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import FIGURES, VerifierThread, idle, reference
from tiny_model import tiny_tokenizer
from verifier_harness import spec_config, token_request

from drafter_sdk.proto import verifier_pb2 as pb
from drafter_sdk.proto import verifier_pb2_grpc

pytestmark = pytest.mark.timeout(240)

VOCAB = len(tiny_tokenizer())
CLIENT_MISTAKES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED}
MESSAGE_EXAMPLES = 1000
BYTES_EXAMPLES = 300

int32 = st.integers(-2**31, 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB - 2, VOCAB + 2), int32)
text = st.text(max_size=64)

chat = st.builds(pb.ChatMessages, messages=st.lists(st.builds(
    pb.ChatMessage, role=st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), text),
    content=text), max_size=4))
sampling = st.builds(
    pb.SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0, 2, width=32), floats),
    top_p=st.one_of(st.just(0.0), st.floats(0, 1, width=32), floats),
    top_k=st.one_of(st.integers(0, 5), int32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
stopping = st.builds(
    pb.StoppingCriteria,
    max_new_tokens=st.one_of(st.none(), st.integers(0, 12), uint32),
    stop=st.lists(st.one_of(text, st.text(min_size=500, max_size=600)), max_size=3),
    stop_token_ids=st.lists(token_id, max_size=4),
    ignore_eos=st.booleans())
speculation = st.builds(pb.SpeculationOverrides, max_draft_len=st.one_of(st.none(), uint32), disable=st.booleans())


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    params = request.params
    params.request_id = draw(st.one_of(st.just(""), st.text(max_size=300)))
    which = draw(st.sampled_from(["none", "prompt", "chat", "token_ids"]))
    if which == "prompt":
        params.prompt = draw(st.text(max_size=200))
    elif which == "chat":
        params.chat.CopyFrom(draw(chat))
    elif which == "token_ids":
        params.token_ids.ids.extend(draw(st.lists(token_id, max_size=300)))
    for name, strategy in (("sampling", sampling), ("stopping", stopping), ("speculation", speculation)):
        if draw(st.booleans()):
            getattr(params, name).CopyFrom(draw(strategy))
    return request


@pytest.fixture(scope="module")
def verifier():
    # Speculation on (in-process n-gram drafter), a small default so unset max_new_tokens stays cheap.
    with VerifierThread(spec_config("NGRAM", 4), max_model_len=256, default_max_new_tokens=8) as v:
        with grpc.insecure_channel(v.address) as channel:
            v.stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            v.channel = channel
            yield v
        assert set(v.on_loop(idle).values()) == {0}


def still_serving(v) -> None:
    health = health_pb2_grpc.HealthStub(v.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reply = v.stub.Generate(token_request([5, 6, 7], 12), timeout=60)
    assert list(reply.output.token_ids) == list(reference((5, 6, 7), 12))


def outcome(exc: grpc.RpcError) -> str:
    assert exc.code() in CLIENT_MISTAKES, f"{exc.code().name}: {exc.details()}"
    assert exc.details(), "a refusal says why"
    return exc.code().name


def test_fuzz_generate_requests(verifier):
    seen: Counter[str] = Counter()

    @settings(max_examples=MESSAGE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=generate_requests(), stream=st.booleans())
    def check(request: pb.GenerateRequest, stream: bool) -> None:
        seen["cases"] += 1
        try:
            if stream:
                messages = list(verifier.stub.GenerateStream(pb.GenerateStreamRequest(params=request.params),
                                                             timeout=60))
                last = messages[-1]
                token_ids = [t for m in messages for t in m.output.token_ids]
            else:
                last = verifier.stub.Generate(request, timeout=60)
                token_ids = list(last.output.token_ids)
        except grpc.RpcError as exc:
            seen[outcome(exc)] += 1
            return
        seen["OK"] += 1
        assert last.output.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert 1 <= len(token_ids) and all(0 <= t < VOCAB for t in token_ids)
        if request.params.stopping.HasField("max_new_tokens"):
            assert len(token_ids) <= request.params.stopping.max_new_tokens

    try:
        check()
    finally:
        FIGURES.append({"fuzz": "GenerateRequest/GenerateStreamRequest messages", **seen,
                        "failures": seen["cases"] - sum(v for k, v in seen.items() if k != "cases")})
    assert seen["OK"] > 0 and seen["INVALID_ARGUMENT"] > 0  # both sides were exercised
    still_serving(verifier)


def test_fuzz_raw_request_bytes(verifier):
    """Arbitrary bytes on the wire: undecodable ones are INVALID_ARGUMENT, never UNKNOWN."""
    seen: Counter[str] = Counter()
    rpcs = {"Generate": verifier.channel.unary_unary("/splitspec.v1.VerifierService/Generate"),
            "GenerateStream": verifier.channel.unary_stream("/splitspec.v1.VerifierService/GenerateStream")}

    @settings(max_examples=BYTES_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.one_of(st.binary(max_size=64), generate_requests().map(lambda r: r.SerializeToString())
                          .flatmap(lambda b: st.integers(0, max(len(b) - 1, 0)).map(lambda i: b[:i] + b"\xff" + b[i:]))),
           method=st.sampled_from(sorted(rpcs)))
    def check(data: bytes, method: str) -> None:
        seen["cases"] += 1
        try:
            result = rpcs[method](data, timeout=60)
            if method == "GenerateStream":
                list(result)
        except grpc.RpcError as exc:
            seen[outcome(exc)] += 1
            return
        seen["OK"] += 1

    try:
        check()
    finally:
        FIGURES.append({"fuzz": "raw request bytes", **seen,
                        "failures": seen["cases"] - sum(v for k, v in seen.items() if k != "cases")})
    still_serving(verifier)
