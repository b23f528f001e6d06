"""Async drafters (`async def prepare_draft_tokens`, `async def load`): awaited on the server's event loop,
one call at a time from its deltas to its answer, with health answered while a call awaits; a failing or
cancelled call costs that call only; behind a real verifier, every output is plain decoding's."""

from __future__ import annotations

import asyncio
import functools
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sdk_support import seq, serving, still_serving, until
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    OracleDrafter,
    cached_reference,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
)

from drafter_sdk import Drafter, DrafterError, DrafterServicer, DraftRequest
from drafter_sdk.proto import drafter_pb2 as pb


class GatedDrafter(Drafter):
    """Drafts each request's last tokens reversed; a call for request "slow" awaits `gate`. Records how
    many calls (and releases) were inside the drafter at once, and on which thread they ran."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.inside = 0
        self.most_inside = 0
        self.threads: set[str] = set()
        self.released: list[tuple[tuple[str, str], int]] = []  # (key, calls inside meanwhile)
        self.loaded_on_loop = False

    async def load(self) -> None:
        await asyncio.sleep(0)
        self.loaded_on_loop = True

    async def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        self.threads.add(threading.current_thread().name)
        try:
            if any(r.request_id == "slow" for r in requests):
                await self.gate.wait()
            if any(r.request_id == "bad" for r in requests):
                raise ValueError("the index is down")
            return [list(reversed(r.tokens))[: r.draft_len] for r in requests]
        finally:
            self.inside -= 1

    def on_release(self, key: tuple[str, str]) -> None:
        self.released.append((key, self.inside))


def test_an_async_drafter_is_awaited_one_call_at_a_time_while_health_answers():
    async def main() -> None:
        drafter = GatedDrafter()
        async with serving(drafter) as c:
            assert drafter.loaded_on_loop
            await c.prepare("v2", seq("old", 0, [7, 8]))  # state to release later
            slow = asyncio.ensure_future(c.prepare("v1", seq("slow", 0, [1, 2, 3])))
            await until(lambda: drafter.inside == 1)
            health = health_pb2_grpc.HealthStub(c.channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING  # the loop is free while a call awaits
            # Another verifier's call and a release wait for the slow call's turn.
            fast = asyncio.ensure_future(c.prepare("v3", seq("fast", 0, [4, 5, 6])))
            release = asyncio.ensure_future(c.stub.ReleaseRequests(
                pb.ReleaseRequestsRequest(verifier_id="v2", request_ids=["old"]), timeout=10))
            await asyncio.sleep(0.3)
            assert not fast.done() and not release.done() and drafter.released == []
            drafter.gate.set()
            answers = await asyncio.gather(slow, fast, release)
        assert [list(a.results[0].draft_tokens) for a in answers[:2]] == [[3, 2, 1], [6, 5, 4]]
        assert answers[2].released == 1 and drafter.released == [(("v2", "old"), 0)]
        assert drafter.most_inside == 1
        assert drafter.threads == {threading.current_thread().name}  # the event loop's, not a worker's

    asyncio.run(main())


def test_a_failing_or_cancelled_async_call_costs_that_call_only():
    async def main() -> None:
        drafter = GatedDrafter()
        async with serving(drafter) as c:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await c.prepare("v", seq("bad", 0, [1, 2]))
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert failed.value.details() == "prepare_draft_tokens raised ValueError: the index is down"
            # A call whose deadline passes while the drafter awaits is cancelled, and gives the turn back.
            held = asyncio.ensure_future(c.stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(
                verifier_id="v", sequences=[seq("slow", 0, [1, 2])]), timeout=2.0))
            await until(lambda: drafter.inside == 1)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await held
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: drafter.inside == 0)
            await still_serving(c)
            # Its deltas were applied: the next call sends only what is new.
            drafter.gate.set()
            answer = await c.prepare("v", seq("slow", 2, [3], draft_len=2))
            assert answer.results[0].status == pb.DRAFT_STATUS_OK

    asyncio.run(main())


def test_the_synchronous_in_process_api_refuses_an_async_drafter_in_one_line():
    with pytest.raises(TypeError, match="GatedDrafter.load is async: only the SDK's server"):
        DrafterServicer(GatedDrafter()).load()

    class SyncLoad(GatedDrafter):
        def load(self) -> None:
            pass

    servicer = DrafterServicer(SyncLoad())
    servicer.load()
    request = pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[seq("a", 0, [1, 2])])
    with pytest.raises(DrafterError, match="SyncLoad is an async drafter: only the SDK's server"):
        servicer.prepare(request)


class AsyncOracle(OracleDrafter):
    """The oracle (verifier_support), its answer awaited as if from another service."""

    async def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:  # type: ignore[override]
        await asyncio.sleep(0.001)
        return super().prepare_draft_tokens(requests)


def test_behind_a_verifier_an_async_drafter_drafts_and_every_output_is_plain_decodings():
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:4]]
    refs = [list(cached_reference(tuple(p), 32)) for p in prompts]
    oracle = AsyncOracle({tuple(p): r for p, r in zip(prompts, refs)}, corrupt=0.3)

    async def main() -> list[list[int]]:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                together = await run_together(v, [functools.partial(
                    v.stub.Generate, token_request(p, 32), timeout=WAIT_S) for p in prompts])
        return [list(r.output.token_ids) for r in together]

    assert asyncio.run(main()) == refs
    assert oracle.feedback_errors == [] and oracle.accepted_at and oracle.rejected_at
