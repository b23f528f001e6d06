"""ReleaseRequests carries why each request went; the SDK hands the reason to drafters that take one,
says EVICTED for what it drops itself, and keeps calling `on_release(key)` drafters as before."""

import asyncio

import grpc
import pytest

from drafter_sdk import Drafter, DraftRequest, ReleaseReason
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from sdk_support import RecordingDrafter, seq, serving


class ReasonDrafter(Drafter):
    def __init__(self) -> None:
        self.released: list[tuple[tuple[str, str], ReleaseReason]] = []

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[] for _ in requests]

    def on_release(self, key: tuple[str, str], reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        self.released.append((key, reason))


def test_reasons_reach_on_release_one_per_id():
    async def body():
        drafter = ReasonDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", *(seq(r, 0, [1, 2]) for r in "abcdef"))
            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(
                verifier_id="v", request_ids=["a", "b", "c", "d"],
                reasons=[pb.RELEASE_REASON_FINISHED, pb.RELEASE_REASON_CANCELLED, pb.RELEASE_REASON_EVICTED, 9]))
            # An older verifier sends no reasons: unspecified (not finished).
            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["e", "f"]))
        assert drafter.released == [
            (("v", "a"), ReleaseReason.FINISHED), (("v", "b"), ReleaseReason.CANCELLED),
            (("v", "c"), ReleaseReason.EVICTED), (("v", "d"), ReleaseReason.UNSPECIFIED),  # 9: unknown here
            (("v", "e"), ReleaseReason.UNSPECIFIED), (("v", "f"), ReleaseReason.UNSPECIFIED)]

    asyncio.run(body())


def test_a_request_released_finished_twice_is_learned_once(monkeypatch):
    """Announced to every replica (PROTOCOL.md section 7), a finished request may reach the replica that served
    it again, whole: its second FINISHED release is EVICTED for the drafter. The memory of keys is bounded."""
    from drafter_sdk.server import servicer as servicer_module

    monkeypatch.setattr(servicer_module, "RECENT_FINISHED_KEYS", 2)
    finished = [pb.RELEASE_REASON_FINISHED]

    async def body():
        drafter = ReasonDrafter()
        async with serving(drafter) as c:
            for rid in ("a", "a", "b", "c", "a"):  # "a" again after two others: forgotten, learned again
                await c.prepare("v", seq(rid, 0, [1, 2]))
                await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=[rid],
                                                                       reasons=finished))
            await c.prepare("w", seq("b", 0, [1, 2]))  # another verifier's "b" is another request
            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="w", request_ids=["b"],
                                                                   reasons=finished))
        return drafter.released

    assert asyncio.run(body()) == [
        (("v", "a"), ReleaseReason.FINISHED), (("v", "a"), ReleaseReason.EVICTED),
        (("v", "b"), ReleaseReason.FINISHED), (("v", "c"), ReleaseReason.FINISHED),
        (("v", "a"), ReleaseReason.FINISHED), (("w", "b"), ReleaseReason.FINISHED)]


def test_more_reasons_than_ids_is_invalid_and_changes_nothing():
    async def body():
        drafter = ReasonDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", seq("a", 0, [1]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(
                    verifier_id="v", request_ids=["a"],
                    reasons=[pb.RELEASE_REASON_FINISHED, pb.RELEASE_REASON_FINISHED]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "2 reasons for 1 request ids" in err.value.details()
            assert (await c.prepare("v", seq("a", 1, [2]))).results[0].status == pb.DRAFT_STATUS_OK
        assert drafter.released == []

    asyncio.run(body())


def test_what_the_sdk_drops_itself_is_evicted():
    drafter = ReasonDrafter()
    now = [0.0]
    servicer = DrafterServicer(drafter, SequenceStore(idle_timeout_s=10, clock=lambda: now[0]))
    servicer.load()
    servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[seq("a", 0, [1, 2]), seq("b", 0, [3])]))
    servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[seq("a", 0, [7])]))  # replaced
    now[0] = 60.0
    servicer.evict_idle()  # idle
    assert drafter.released == [(("v", "a"), ReleaseReason.EVICTED), (("v", "b"), ReleaseReason.EVICTED),
                                (("v", "a"), ReleaseReason.EVICTED)]


def test_drafters_whose_on_release_takes_only_the_key_still_work():
    async def body():
        drafter = RecordingDrafter()  # def on_release(self, key)
        async with serving(drafter) as c:
            await c.prepare("v", seq("a", 0, [1]))
            response = await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(
                verifier_id="v", request_ids=["a"], reasons=[pb.RELEASE_REASON_FINISHED]))
        assert response.released == 1
        assert drafter.released == [("v", "a")]

    asyncio.run(body())
