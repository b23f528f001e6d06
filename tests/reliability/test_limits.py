"""Explicit message-size and concurrency limits of the drafter SDK server (`splitspec-drafter
--max-message-bytes / --max-concurrent-rpcs`), and what the verifier makes of a drafter that
refuses its calls for size. (The verifier's own limits: test_bad_input.py.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest
from reliability_support import WAIT_S, SdkFaultyDrafter, make_workload, until
from verifier_harness import run_verifier, spec_config

from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc
from drafter_sdk.proto import verifier_pb2 as pb

pytestmark = pytest.mark.timeout(120)

MAX_MESSAGE_BYTES = 512  # below one context of the long prompts below


def prepare(tokens: int, request_id: str = "r") -> drafter_pb2.PrepareDraftTokensRequest:
    return drafter_pb2.PrepareDraftTokensRequest(verifier_id="v", sequences=[drafter_pb2.DraftSequence(
        request_id=request_id, context_len=0, new_tokens=[300] * tokens, prompt_len=1, draft_len=2)])


@pytest.fixture(scope="module")
def limited_drafter():
    with SdkFaultyDrafter(name="limited-drafter", extra_args=(
            "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-concurrent-rpcs", "1")) as d:
        d.start()
        yield d


def once_the_slot_is_free(stub: drafter_pb2_grpc.DrafterServiceStub,
                          request: drafter_pb2.PrepareDraftTokensRequest) -> drafter_pb2.PrepareDraftTokensResponse:
    """The call, sent again while the server's only slot is taken: a call that has just ended (the readiness
    probe's, the slow one below) may hold it a moment after its client has the answer, on a busy machine."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return stub.PrepareDraftTokens(request, timeout=WAIT_S)
        except grpc.RpcError as exc:
            if "Concurrent RPC limit" not in (exc.details() or "") or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def test_drafter_refuses_oversized_requests_and_excess_concurrent_calls(limited_drafter):
    d = limited_drafter
    with grpc.insecure_channel(d.address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        assert len(once_the_slot_is_free(stub, prepare(100)).results) == 1
        with pytest.raises(grpc.RpcError) as info:
            once_the_slot_is_free(stub, prepare(MAX_MESSAGE_BYTES))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Concurrent RPC limit" not in info.value.details()  # refused for its size
        # A slow call takes the only slot: another call meanwhile is refused, the slow one completes.
        d.set("slow_some", slow_every=1, slow_s=1.0)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                calls0 = d.calls()
                slow = pool.submit(stub.PrepareDraftTokens, prepare(10, "slow"), timeout=WAIT_S)
                asyncio.run(until(lambda: d.calls() > calls0, "the slow call is being served"))
                with pytest.raises(grpc.RpcError) as info:
                    stub.PrepareDraftTokens(prepare(10, "second"), timeout=WAIT_S)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert len(slow.result(WAIT_S).results) == 1
        finally:
            d.set("ok")
        assert len(once_the_slot_is_free(stub, prepare(10)).results) == 1  # serving again


def test_verifier_copes_with_a_drafter_refusing_its_calls_for_size(limited_drafter):
    """Calls over the drafter's limit are drafter failures (RESOURCE_EXHAUSTED), never failed requests."""
    workload = make_workload(6, seed=3, new_tokens=(8, 16))
    workload.prompts = [p * 30 for p in workload.prompts]  # 90-360 tokens: most over 512 bytes alone
    limited_drafter.set("ok", oracle=workload.oracle())

    async def body():
        # A step budget above the six prompts together: unchunked, each sequence's first call carries its
        # whole context, however the six are admitted.
        async with run_verifier(spec_config("USER_PROVIDED", 4, limited_drafter.address, deadline_ms=2000),
                                max_model_len=512, max_num_batched_tokens=4096) as v:
            replies = await asyncio.gather(*(v.stub.Generate(workload.request(i)) for i in range(6)))
            info = await v.stub.GetServerInfo(pb.GetServerInfoRequest())
        return replies, info

    replies, info = asyncio.run(body())
    assert [list(r.output.token_ids) for r in replies] == [workload.expected(i) for i in range(6)]
    assert info.drafter.failures >= 1 and "RESOURCE_EXHAUSTED" in info.drafter.last_error
