"""The SDK's servicer held to the delta protocol's model under any interleaving of calls (tests/delta_protocol.py),
with the n-gram drafter (chains and trees), without a state budget and with one that evicts."""

from __future__ import annotations

import pytest
from delta_protocol import BUDGET_BYTES, Key, run

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer

pytestmark = pytest.mark.timeout(240)


def ngram_servicer(max_state_bytes: int | None) -> DrafterServicer:
    servicer = DrafterServicer(NgramDrafter(max_draft_len=6, max_matching_ngram_size=3),
                               SequenceStore(max_state_bytes=max_state_bytes))
    servicer.load()
    return servicer


class ServicerTarget:
    """An in-process servicer of its own per run: its store can be looked into."""

    def __init__(self, max_state_bytes: int | None) -> None:
        self.servicer = ngram_servicer(max_state_bytes)
        self.evicts = max_state_bytes is not None

    def prepare(self, verifier: str, sequences: list[pb.DraftSequence]) -> list[pb.DraftResult]:
        return list(self.servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id=verifier,
                                                                       sequences=sequences)).results)

    def release(self, verifier: str, request_ids: list[str]) -> int:
        return self.servicer.release(pb.ReleaseRequestsRequest(verifier_id=verifier, request_ids=request_ids)).released

    def fresh(self, seq: pb.DraftSequence) -> pb.DraftResult:
        fresh = ngram_servicer(None)
        try:
            return fresh.prepare(pb.PrepareDraftTokensRequest(verifier_id="fresh", sequences=[seq])).results[0]
        finally:
            fresh.close()

    def holds(self, key: Key) -> bool:
        return key in self.servicer.store

    def close(self) -> None:
        assert len(self.servicer.store) == 0  # every sequence released: the drafter was told of each
        self.servicer.close()


@pytest.mark.parametrize("max_state_bytes", [None, BUDGET_BYTES])
def test_the_servicer_follows_the_delta_protocol(max_state_bytes: int | None) -> None:
    run(lambda: ServicerTarget(max_state_bytes), examples=150)
