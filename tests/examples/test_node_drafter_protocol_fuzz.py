"""The Node.js example drafter, over gRPC, held to the same model of the delta protocol as the SDK
(tests/delta_protocol.py): any interleaving of full, overlapping, gapped and contradicting deltas,
context replacements and releases, over two verifiers; each run in namespaces of its own."""

from __future__ import annotations

import grpc
import pytest
from delta_protocol import Key, fresh_ids, run
from node_drafter import NodeDrafter, node_available

from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.skipif(not node_available(), reason="node is not on PATH"), pytest.mark.timeout(240)]


class NodeTarget:
    """One run's namespaces on the shared Node drafter; no state budget (it keeps up to 100,000 sequences)."""

    evicts = False

    def __init__(self, stub: pb_grpc.DrafterServiceStub, run_id: str) -> None:
        self.stub = stub
        self.run_id = run_id
        self.fresh_ids = fresh_ids(f"{run_id}-fresh-")

    def prepare(self, verifier: str, sequences: list[pb.DraftSequence]) -> list[pb.DraftResult]:
        return list(self.stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(
            verifier_id=f"{self.run_id}-{verifier}", sequences=sequences), timeout=10).results)

    def release(self, verifier: str, request_ids: list[str], finished: bool = False) -> int:
        reasons = [pb.RELEASE_REASON_FINISHED] * len(request_ids) if finished else []
        return self.stub.ReleaseRequests(pb.ReleaseRequestsRequest(
            verifier_id=f"{self.run_id}-{verifier}", request_ids=request_ids, reasons=reasons), timeout=10).released

    def fresh_target(self) -> NodeTarget:
        return NodeTarget(self.stub, self.fresh_ids())  # namespaces nothing was held in (it learns nothing)

    def holds(self, key: Key) -> None:
        return None  # its store is not visible; releases count what it holds

    def close(self) -> None:
        pass


def test_the_node_drafter_follows_the_delta_protocol() -> None:
    with NodeDrafter(max_ngram=3, max_draft_len=6) as drafter, grpc.insecure_channel(drafter.address) as channel:
        stub = pb_grpc.DrafterServiceStub(channel)
        run_ids = fresh_ids("run")
        run(lambda: NodeTarget(stub, run_ids()), examples=100)
