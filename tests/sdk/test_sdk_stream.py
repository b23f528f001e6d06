"""PrepareDraftTokensStream on the SDK's server: PrepareDraftTokens (and ReleaseRequests), one call
per message of one stream, answered in order; a failing message ends the stream with the unary
call's status."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from drafter_sdk.proto import drafter_pb2 as pb
from sdk_support import RecordingDrafter, seq, serving, still_serving

STREAM = "/splitspec.v1.DrafterService/PrepareDraftTokensStream"


def message(verifier_id: str, *sequences: pb.DraftSequence) -> pb.PrepareDraftTokensStreamRequest:
    return pb.PrepareDraftTokensStreamRequest(
        request=pb.PrepareDraftTokensRequest(verifier_id=verifier_id, sequences=sequences))


STEPS = [  # one sequence, then a second joins, then a sync-only call
    [seq("a", 0, [1, 2, 3, 4, 5])],
    [seq("a", 5, [6, 7]), seq("b", 0, [9, 8, 7])],
    [seq("a", 7, [8], draft_len=0), seq("b", 3, [6])],
]


def test_stream_answers_each_message_in_order_as_the_unary_calls_do():
    async def body():
        async with serving(RecordingDrafter()) as c:
            unary = [await c.prepare("unary", *step) for step in STEPS]
            call = c.stub.PrepareDraftTokensStream()
            streamed = []
            for step in STEPS:  # one at a time, as a verifier steps
                await call.write(message("stream", *step))
                streamed.append((await call.read()).response)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            assert streamed == unary
            assert [r.draft_tokens for r in streamed[1].results] == [[7, 6, 5, 4], [7, 8, 9]]

    asyncio.run(body())


def test_a_release_on_the_stream_drops_the_state_and_answers_in_order():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            call = c.stub.PrepareDraftTokensStream()
            await call.write(message("v", *STEPS[1][1:], seq("a", 0, [1, 2, 3])))
            assert [r.status for r in (await call.read()).response.results] == [pb.DRAFT_STATUS_OK] * 2
            await call.write(pb.PrepareDraftTokensStreamRequest(release=pb.ReleaseRequestsRequest(
                verifier_id="v", request_ids=["a", "unknown"], reasons=[pb.RELEASE_REASON_FINISHED])))
            answer = await call.read()
            assert answer.WhichOneof("message") == "released" and answer.released.released == 1
            assert drafter.released == [("v", "a")]
            await call.write(message("v", seq("a", 3, [4]), seq("b", 3, [6])))  # "a" is gone, "b" is not
            assert [r.status for r in (await call.read()).response.results] == [
                pb.DRAFT_STATUS_RESYNC_REQUIRED, pb.DRAFT_STATUS_OK]
            await call.write(pb.PrepareDraftTokensStreamRequest(release=pb.ReleaseRequestsRequest(
                request_ids=["b"])))  # no verifier_id: ends the stream as the unary call fails
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "verifier_id must not be empty" in info.value.details()
            assert drafter.released == [("v", "a")]

    asyncio.run(body())


def test_a_bad_message_ends_the_stream_with_invalid_argument_and_keeps_what_came_before():
    async def body():
        async with serving(RecordingDrafter()) as c:
            call = c.stub.PrepareDraftTokensStream()
            await call.write(message("v", *STEPS[0]))
            assert (await call.read()).response.results[0].status == pb.DRAFT_STATUS_OK
            await call.write(message("v", seq("a", 5, [6, -1])))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "negative token id -1" in info.value.details()
            # The first message's delta was applied; the bad one touched nothing.
            response = await c.prepare("v", seq("a", 5, [6]))
            assert response.results[0].status == pb.DRAFT_STATUS_OK
            await still_serving(c)

    asyncio.run(body())


def test_undecodable_bytes_on_the_stream_are_invalid_argument():
    async def body():
        async with serving(RecordingDrafter()) as c:
            raw = c.channel.stream_stream(STREAM, request_serializer=lambda b: b,
                                          response_deserializer=pb.PrepareDraftTokensStreamResponse.FromString)
            call = raw()
            await call.write(b"\x0a\x05\xff\xff")  # field 1, length 5, two bytes: truncated
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf message" in info.value.details()
            await still_serving(c)

    asyncio.run(body())


def test_the_stream_needs_the_bearer_token():
    async def body():
        async with serving(RecordingDrafter(), auth_token="s3cret") as c:
            call = c.stub.PrepareDraftTokensStream()
            with pytest.raises(grpc.aio.AioRpcError) as info:  # refused at once: the write may see it first
                await call.write(message("v", *STEPS[0]))
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = c.stub.PrepareDraftTokensStream(metadata=(("authorization", "Bearer s3cret"),))
            await call.write(message("v", *STEPS[0]))
            assert (await call.read()).response.results[0].status == pb.DRAFT_STATUS_OK
            await call.done_writing()

    asyncio.run(body())


def test_stopping_ends_idle_streams_at_once_and_busy_ones_after_their_answer():
    """Streams last as long as their verifier: stop() must not wait its grace period for them."""
    async def body():
        drafter = RecordingDrafter(propose=lambda r: time.sleep(0.3) or [] if r.key[1] == "slow" else [])
        async with serving(drafter) as c:
            idle, busy = c.stub.PrepareDraftTokensStream(), c.stub.PrepareDraftTokensStream()
            await idle.write(message("v", *STEPS[0]))
            await idle.read()
            await busy.write(message("v", seq("slow", 0, [1, 2])))
            await asyncio.sleep(0.1)  # the drafter is busy with it
            started = time.monotonic()
            await c.running.stop(5.0)
            assert time.monotonic() - started < 2.0
            answer = await busy.read()
            assert [r.request_id for r in answer.response.results] == ["slow"]
            for call in (idle, busy):
                assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK

    asyncio.run(body())
