"""The verifier's blocking transport drafts over one PrepareDraftTokensStream (draft_stream.py):
one stream for many steps, unary calls for drafters without it, a per-message deadline that
cancels the stream, a new stream after the drafter restarts, and releases on the stream. Real
SDK servers on port 0; the transport blocks its own thread, as it does on the verifier's model
thread."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from verifier_support import MethodLog

from drafter_sdk import Drafter, DraftRequest, RunningDrafter, start_server
from drafter_sdk.proto import drafter_pb2 as pb
from verifier_service.spec_decode.transport import GrpcTransport

pytestmark = pytest.mark.timeout(60)

STREAM, UNARY = "PrepareDraftTokensStream", "PrepareDraftTokens"


class Reverse(Drafter):
    """Drafts the context's last draft_len tokens reversed; sleeps `slow_s` for request id "slow"."""

    name = "reverse"

    def __init__(self, slow_s: float = 0.0) -> None:
        self.slow_s = slow_s

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        if any(r.key[1] == "slow" for r in requests):
            time.sleep(self.slow_s)  # on the SDK's worker thread: the server keeps answering
        return [list(reversed(r.tokens))[: r.draft_len] for r in requests]


def step(request_id: str, tokens: list[int]) -> pb.PrepareDraftTokensRequest:
    return pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[
        pb.DraftSequence(request_id=request_id, context_len=0, new_tokens=tokens, draft_len=2)])


async def prepare(transport: GrpcTransport, request: pb.PrepareDraftTokensRequest,
                  timeout_s: float = 5.0) -> pb.PrepareDraftTokensResponse:
    """One blocking call, on a thread of its own: the server's loop is this one."""
    return await asyncio.to_thread(asyncio.run, transport.prepare(request, timeout_s))


def drafts(response: pb.PrepareDraftTokensResponse) -> list[tuple[str, list[int]]]:
    return [(r.request_id, list(r.draft_tokens)) for r in response.results]


@contextlib.asynccontextmanager
async def blocking_transport(drafter: Drafter, log: MethodLog) -> AsyncIterator[tuple[RunningDrafter, GrpcTransport]]:
    """An SDK server on port 0 (its calls logged) and the verifier's blocking transport to it."""
    server = await start_server(drafter, host="127.0.0.1", port=0, interceptors=[log])
    await server.wait_loaded()
    transport = GrpcTransport(f"127.0.0.1:{server.port}", block=True)
    try:
        yield server, transport
    finally:
        await transport.close()
        await server.stop(0)


def test_steps_share_one_stream():
    async def body():
        log = MethodLog()
        async with blocking_transport(Reverse(), log) as (_, transport):
            for n in range(1, 6):
                assert drafts(await prepare(transport, step(f"r{n}", list(range(n + 1))))) == [(f"r{n}", [n, n - 1])]
        assert (log.count(STREAM), log.count(UNARY)) == (1, 0)

    asyncio.run(body())


def test_a_drafter_without_the_stream_gets_unary_calls():
    async def body():
        log = MethodLog(refuse_stream=True)
        async with blocking_transport(Reverse(), log) as (_, transport):
            for n in range(3):
                assert drafts(await prepare(transport, step(f"r{n}", [1, 2, 3]))) == [(f"r{n}", [3, 2])]
        assert (log.count(STREAM), log.count(UNARY)) == (1, 3)  # asked once (again after STREAM_RECHECK_S)

    asyncio.run(body())


def test_a_late_answer_fails_its_call_at_the_deadline_and_the_next_call_opens_a_new_stream():
    async def body():
        log = MethodLog()
        async with blocking_transport(Reverse(slow_s=0.6), log) as (_, transport):
            # A longer deadline first (opening the stream may take over 0.1 s on a loaded machine): the
            # watchdog, asleep for it, must still fail the next call at its own, shorter one.
            assert drafts(await prepare(transport, step("a", [1, 2]), 2.0)) == [("a", [2, 1])]
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                await prepare(transport, step("slow", [1, 2]), 0.1)
            waited = time.monotonic() - started
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.1 <= waited < 0.55, waited  # failed at its deadline, before the answer (0.6 s)
            await asyncio.sleep(0.7)  # the worker finishes the slow call, whose answer nobody reads
            # The next answer is the next call's own, not the late one.
            assert drafts(await prepare(transport, step("b", [5, 6, 7]), 2.0)) == [("b", [7, 6])]
        assert log.count(STREAM) == 2 and log.count(UNARY) == 0

    asyncio.run(body())


def test_a_drafter_restarted_between_steps_gets_a_new_stream():
    async def body():
        server = await start_server(Reverse(), host="127.0.0.1", port=0)
        await server.wait_loaded()
        port = server.port
        transport = GrpcTransport(f"127.0.0.1:{port}", block=True)
        try:
            assert drafts(await prepare(transport, step("a", [1, 2]))) == [("a", [2, 1])]
            await server.stop(0)
            log = MethodLog()
            server = await start_server(Reverse(), host="127.0.0.1", port=port, interceptors=[log])
            await server.wait_loaded()
            await asyncio.sleep(0.2)  # the client has seen its stream end by now
            assert drafts(await prepare(transport, step("b", [3, 4]))) == [("b", [4, 3])]
        finally:
            await transport.close()
            await server.stop(0)
        assert log.count(STREAM) == 1

    asyncio.run(body())


def test_a_stream_ended_before_its_answer_is_retried_once_on_a_new_stream():
    """A stopping SDK drafter ends its streams (OK) after the message in flight; a message sent
    just then gets no answer on that stream. Here the drafter's first stream ends unanswered."""
    async def body():
        streams = 0

        async def stream(requests, context):  # noqa: ANN001, ANN202
            nonlocal streams
            streams += 1
            if streams == 1:
                return  # ends OK, the message unanswered
            async for message in requests:
                yield pb.PrepareDraftTokensStreamResponse(response=pb.PrepareDraftTokensResponse(results=[
                    pb.DraftResult(request_id=s.request_id, status=pb.DRAFT_STATUS_OK, draft_tokens=[7])
                    for s in message.request.sequences]))

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("splitspec.v1.DrafterService", {
            STREAM: grpc.stream_stream_rpc_method_handler(
                stream, pb.PrepareDraftTokensStreamRequest.FromString,
                pb.PrepareDraftTokensStreamResponse.SerializeToString)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcTransport(f"127.0.0.1:{port}", block=True)
        try:
            assert drafts(await prepare(transport, step("a", [1, 2]))) == [("a", [7])]
        finally:
            await transport.close()
            await server.stop(0)
        assert streams == 2

    asyncio.run(body())


async def release(transport: GrpcTransport, request_id: str, on_stream: bool) -> float:
    """The seconds the calling thread spent on it."""
    request = pb.ReleaseRequestsRequest(verifier_id="v", request_ids=[request_id],
                                        reasons=[pb.RELEASE_REASON_FINISHED])

    def timed() -> float:
        started = time.monotonic()
        asyncio.run(transport.release(request, 5.0, on_stream))
        return time.monotonic() - started

    return await asyncio.to_thread(timed)


def test_releases_go_on_the_stream_where_the_drafter_takes_them_there():
    async def body():
        log = MethodLog()
        async with blocking_transport(Reverse(), log) as (server, transport):
            store = server.servicer.store
            for request_id in ("a", "b"):
                await prepare(transport, step(request_id, [1, 2]))
            await release(transport, "a", on_stream=True)
            # Its answer is read before the next call's, which finds the release applied.
            assert drafts(await prepare(transport, step("c", [3, 4]))) == [("c", [4, 3])]
            assert ("v", "a") not in store and ("v", "b") in store
            await release(transport, "b", on_stream=False)  # a drafter without "stream-releases"
            assert ("v", "b") not in store
        assert (log.count(STREAM), log.count("ReleaseRequests")) == (1, 1)

    asyncio.run(body())


def raw_server(answer):  # noqa: ANN001, ANN201
    """A PrepareDraftTokensStream server answering each message with `answer(message)` (None: never);
    its `streams` counts the streams opened."""
    async def stream(requests, context):  # noqa: ANN001, ANN202
        server.streams += 1
        async for message in requests:
            response = answer(message)
            if response is None:
                await asyncio.sleep(3600)
            yield response

    server = grpc.aio.server()
    server.streams = 0
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("splitspec.v1.DrafterService", {
        STREAM: grpc.stream_stream_rpc_method_handler(
            stream, pb.PrepareDraftTokensStreamRequest.FromString,
            pb.PrepareDraftTokensStreamResponse.SerializeToString)})])
    return server


def sevens(message: pb.PrepareDraftTokensStreamRequest) -> pb.PrepareDraftTokensStreamResponse:
    return pb.PrepareDraftTokensStreamResponse(response=pb.PrepareDraftTokensResponse(results=[
        pb.DraftResult(request_id=s.request_id, status=pb.DRAFT_STATUS_OK, draft_tokens=[7])
        for s in message.request.sequences]))


def test_a_hung_release_costs_the_caller_nothing_and_the_next_call_its_deadline():
    async def body():
        server = raw_server(lambda m: None if m.WhichOneof("message") == "release" else sevens(m))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcTransport(f"127.0.0.1:{port}", block=True)
        try:
            # One deadline throughout, as the verifier's (the watchdog sleeps a deadline while idle).
            assert drafts(await prepare(transport, step("a", [1, 2]), 0.5)) == [("a", [7])]
            assert await release(transport, "a", on_stream=True) < 0.05  # sent, not waited for
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                await prepare(transport, step("b", [3]), 0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.5 <= time.monotonic() - started < 1.0
            assert drafts(await prepare(transport, step("c", [4]), 0.5)) == [("c", [7])]  # on a new stream
        finally:
            await transport.close()
            await server.stop(0)
        assert server.streams == 2

    asyncio.run(body())


def test_an_answer_of_the_wrong_kind_fails_the_next_call_which_opens_a_new_stream():
    """A drafter that ignores `release` answers it as an (empty) PrepareDraftTokens call."""
    async def body():
        server = raw_server(sevens)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcTransport(f"127.0.0.1:{port}", block=True)
        try:
            assert drafts(await prepare(transport, step("a", [1, 2]))) == [("a", [7])]
            await release(transport, "a", on_stream=True)
            with pytest.raises(grpc.RpcError) as info:
                await prepare(transport, step("b", [3]))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "answered response where released was due" in info.value.details()
            assert drafts(await prepare(transport, step("c", [3]))) == [("c", [7])]
        finally:
            await transport.close()
            await server.stop(0)
        assert server.streams == 2

    asyncio.run(body())


def test_a_call_sent_ahead_is_answered_while_its_thread_works_and_read_in_order_with_a_release_sent_after():
    """`start` sends at once; the drafter answers while the thread does other work (the engine's
    forward); a release sent meanwhile is answered after it, and read before the next call's answer."""
    async def body():
        log = MethodLog()
        async with blocking_transport(Reverse(), log) as (server, transport):
            await prepare(transport, step("a", [1, 2]))  # the stream is open

            def ahead() -> tuple[list, float, float]:
                answer = transport.start(step("b", [3, 4, 5]), 0.05)
                asyncio.run(transport.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["a"]),
                                              5.0, True))
                time.sleep(0.2)  # past the call's deadline, as a long forward would be
                started = time.monotonic()
                response = answer()
                return drafts(response), time.monotonic() - started, transport.streaming

            got, read_s, streaming = await asyncio.to_thread(ahead)
            assert got == [("b", [5, 4])] and streaming
            assert read_s < 0.05, read_s  # it was there already: taken however late it is read
            assert ("v", "a") not in server.servicer.store  # the release went out after it, and was applied
            assert drafts(await prepare(transport, step("c", [6, 7]))) == [("c", [7, 6])]
        assert (log.count(STREAM), log.count(UNARY)) == (1, 0)

    asyncio.run(body())


def test_a_call_sent_ahead_and_not_answered_fails_when_read_and_the_next_call_opens_a_new_stream():
    async def body():
        log = MethodLog()
        async with blocking_transport(Reverse(slow_s=0.8), log) as (_, transport):
            await prepare(transport, step("a", [1, 2]), 2.0)

            def ahead() -> float:
                answer = transport.start(step("slow", [1, 2]), 0.1)
                time.sleep(0.2)
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    answer()
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                return time.monotonic() - started

            assert await asyncio.to_thread(ahead) < 0.5  # the watchdog cancels it within about a deadline
            await asyncio.sleep(0.8)
            assert drafts(await prepare(transport, step("b", [5, 6, 7]), 2.0)) == [("b", [7, 6])]
        assert log.count(STREAM) == 2

    asyncio.run(body())


def test_a_drafter_without_the_stream_answers_a_call_sent_ahead_as_a_unary_call():
    async def body():
        log = MethodLog(refuse_stream=True)
        async with blocking_transport(Reverse(), log) as (_, transport):
            await prepare(transport, step("a", [1, 2, 3]))  # refused: unary from now on
            answer = await asyncio.to_thread(transport.start, step("b", [4, 5]), 5.0)
            assert drafts(await asyncio.to_thread(answer)) == [("b", [5, 4])]
        assert (log.count(STREAM), log.count(UNARY)) == (1, 2)

    asyncio.run(body())
