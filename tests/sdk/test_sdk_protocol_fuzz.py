"""The SDK's servicer held to the delta protocol's model under any interleaving of calls (tests/delta_protocol.py),
with the n-gram and the suffix drafters (chains and trees), without a state budget and with one that evicts.

Both keep state per sequence that each call extends (the n-gram tables, the suffix drafter's own tree and
its match cursors into the global tree of finished outputs, extended as outputs are added), so a draft
equal to a fresh drafter's, given the same finished outputs, says that state followed the context and the
cache exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from delta_protocol import Key, run

from drafter_sdk.drafter import Drafter
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer

pytestmark = pytest.mark.timeout(240)


DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "ngram": lambda: NgramDrafter(max_draft_len=6, max_matching_ngram_size=3),
    "suffix": SuffixDrafter,
}
# About 1.5x what one sequence of MAX_CONTEXT tokens comes to at most (4.0 KB with the n-gram drafter's
# tables, 10.9 KB with the suffix drafter's trees, trees drafted), so that only several together outgrow it.
BUDGET_BYTES = {"ngram": 6000, "suffix": 16000}


def serving(drafter: str, max_state_bytes: int | None) -> DrafterServicer:
    servicer = DrafterServicer(DRAFTERS[drafter](), SequenceStore(max_state_bytes=max_state_bytes))
    servicer.load()
    return servicer


class ServicerTarget:
    """An in-process servicer of its own per run: its store can be looked into."""

    def __init__(self, drafter: str, max_state_bytes: int | None) -> None:
        self.drafter = drafter
        self.servicer = serving(drafter, max_state_bytes)
        self.evicts = max_state_bytes is not None

    def prepare(self, verifier: str, sequences: list[pb.DraftSequence]) -> list[pb.DraftResult]:
        return list(self.servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id=verifier,
                                                                       sequences=sequences)).results)

    def release(self, verifier: str, request_ids: list[str], finished: bool = False) -> int:
        reasons = [pb.RELEASE_REASON_FINISHED] * len(request_ids) if finished else []
        return self.servicer.release(pb.ReleaseRequestsRequest(verifier_id=verifier, request_ids=request_ids,
                                                               reasons=reasons)).released

    def fresh_target(self) -> ServicerTarget:
        return ServicerTarget(self.drafter, None)

    def holds(self, key: Key) -> bool:
        return key in self.servicer.store

    def close(self) -> None:
        assert len(self.servicer.store) == 0  # every sequence released: the drafter was told of each
        self.servicer.close()


@pytest.mark.parametrize("budget", [False, True])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_the_servicer_follows_the_delta_protocol(drafter: str, budget: bool) -> None:
    run(lambda: ServicerTarget(drafter, BUDGET_BYTES[drafter] if budget else None), examples=150)
