"""A drafter transport for DrafterClient tests: SDK servicers in-process, taken in turn as gRPC's round_robin
takes ready replicas, each call's fate chosen by the test (answered; lost on its way, so no replica saw it; or
its answer lost on the way back, after the replica applied it, as when a deadline passes)."""

from __future__ import annotations

from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.servicer import DrafterServicer

ANSWERED, LOST_ON_THE_WAY, ANSWER_LOST = "answered", "lost on the way", "answer lost"


class RoundRobin:
    """Call i goes to replica i mod N; `fate` decides what happens to the next call only."""

    target = "round-robin"
    splits_calls = False

    def __init__(self, *servicers: DrafterServicer, one_replica: bool = False) -> None:
        self.replicas = list(servicers)
        self.one_replica = one_replica  # True: the client sends plain deltas, as to a single drafter
        self.sent: list[pb.PrepareDraftTokensRequest] = []
        self.answered: list[pb.PrepareDraftTokensResponse | None] = []  # per sent call; None: no answer came
        self.fate = ANSWERED
        self._next = 0

    async def prepare(self, request: pb.PrepareDraftTokensRequest, timeout_s: float) -> pb.PrepareDraftTokensResponse:
        self.sent.append(request)
        self.answered.append(None)
        fate, self.fate = self.fate, ANSWERED
        servicer = self.replicas[self._next % len(self.replicas)]
        self._next += 1
        if fate == LOST_ON_THE_WAY:
            raise ConnectionError("the call was lost on its way")
        response = servicer.prepare(request)  # applied, even when the caller then sees a failure
        if fate == ANSWER_LOST:
            raise TimeoutError("deadline exceeded")
        self.answered[-1] = response
        return response

    def start(self, request: pb.PrepareDraftTokensRequest, timeout_s: float) -> None:
        return None  # prepare makes every call

    async def sync(self, request: pb.PrepareDraftTokensRequest, timeout_s: float) -> None:
        await self.prepare(request, timeout_s)

    async def release(self, request: pb.ReleaseRequestsRequest, timeout_s: float, on_stream: bool) -> None:
        for servicer in self.replicas:
            servicer.release(request)

    async def info(self, timeout_s: float) -> pb.GetDrafterInfoResponse:
        return self.replicas[0].info()

    async def close(self) -> None:
        return None
