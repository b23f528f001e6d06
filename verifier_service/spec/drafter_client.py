"""The verifier's side of the drafter protocol: deltas, validation, deadlines, breaker.

`DrafterClient` turns a step's sequences into one PrepareDraftTokens call that
carries, per sequence, an overlapping delta: the tokens committed since its
`overlap_steps`-th most recent successful call. A drafter replica that missed
fewer than that many steps (round_robin over N <= overlap_steps replicas sends
each replica every N-th step) skips what it holds and appends the rest, so it
stays in sync without a resync, and the bytes per call are bounded by the
tokens of the last few steps, not by the context length. Until a request has
had overlap_steps successful calls (and again after a resync) every call
carries its whole context: round_robin cannot aim one full context at the
replica that lacks it, so each of the first overlap_steps calls reaches one
more replica. The client turns the
answer into drafts the verifier can trust: anything late, failing or malformed
becomes "no draft" for that step. The same client drives a remote drafter over
gRPC and an SDK drafter in-process, so the two differ only by the network hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import grpc

from verifier_service.spec.circuit_breaker import CircuitBreaker
from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class DraftQuery:
    """One sequence of a verifier step."""

    request_id: str
    tokens: Sequence[int]  # every committed token, prompt first
    prompt_len: int
    draft_len: int
    last_num_drafted: int = 0
    last_num_accepted: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class DraftReply:
    drafts: list[list[int]]  # one per query; [] = no draft
    failed: list[bool]  # the drafter failed or misbehaved for this query
    latency_s: float = 0.0


class Transport(Protocol):
    target: str

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse: ...

    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> None: ...

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse: ...

    async def close(self) -> None: ...


class GrpcTransport:
    """A DrafterService over gRPC; `dns:///name:port` plus round_robin spreads calls over replicas."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 auth_token: str | None = None, load_balancing_policy: str = "round_robin",
                 max_message_bytes: int = 16 * 1024 * 1024, server_name_override: str = "") -> None:
        self.target = target
        options = [
            ("grpc.lb_policy_name", load_balancing_policy or "round_robin"),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect quickly after a drafter restarts; the breaker paces calls.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if server_name_override:
            options.append(("grpc.ssl_target_name_override", server_name_override))
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self._stub = drafter_pb2_grpc.DrafterServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        return await self._stub.PrepareDraftTokens(request, timeout=timeout_s, metadata=self._metadata)

    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> None:
        await self._stub.ReleaseRequests(request, timeout=timeout_s, metadata=self._metadata)

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse:
        return await self._stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=timeout_s,
                                               metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()


class InProcessTransport:
    """Calls an SDK `DrafterServicer`'s logic directly, without gRPC."""

    target = "in-process"

    def __init__(self, servicer: "SupportsDrafterLogic") -> None:
        self._servicer = servicer

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        return self._servicer.prepare(request)

    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> None:
        self._servicer.release(request)

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse:
        return self._servicer.info()

    async def close(self) -> None:
        return None


class SupportsDrafterLogic(Protocol):
    def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest) -> drafter_pb2.PrepareDraftTokensResponse: ...

    def release(self, request: drafter_pb2.ReleaseRequestsRequest) -> drafter_pb2.ReleaseRequestsResponse: ...

    def info(self) -> drafter_pb2.GetDrafterInfoResponse: ...


@dataclass
class DrafterClientStats:
    calls: int = 0
    failures: int = 0
    skipped: int = 0  # steps with the breaker open
    resyncs: int = 0
    last_error: str = ""
    request_bytes: int = 0
    last_request_bytes: int = 0


@dataclass
class DrafterClient:
    transport: Transport
    verifier_id: str
    vocab_size: int
    deadline_s: float = 0.05
    # Every call re-sends the tokens committed since the request's overlap_steps-th most
    # recent successful call (the whole context until it had that many), so drafter
    # replicas that missed up to overlap_steps - 1 steps catch up without a resync.
    # 1 = plain deltas (one drafter, e.g. in-process).
    overlap_steps: int = 8
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    stats: DrafterClientStats = field(default_factory=DrafterClientStats)
    # request id -> committed length after each of its last overlap_steps successful calls
    _sent: dict[str, deque[int]] = field(default_factory=dict)
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.overlap_steps < 1:
            raise ValueError(f"overlap_steps must be at least 1, not {self.overlap_steps}")

    def context_len(self, request_id: str) -> int:
        """Offset of the first token the next call sends for the request (0: the whole context)."""
        history = self._sent.get(request_id)
        # Fewer successful calls than overlap_steps: some replica may hold nothing yet.
        return history[0] if history is not None and len(history) == self.overlap_steps else 0

    async def propose(self, queries: list[DraftQuery]) -> DraftReply:
        none = DraftReply([[] for _ in queries], [False] * len(queries))
        if not queries:
            return none
        if not self.breaker.allow():
            self.stats.skipped += 1
            return none
        request = self._build_request(queries)
        self.stats.calls += 1
        size = request.ByteSize()
        self.stats.request_bytes += size
        self.stats.last_request_bytes = size
        started = time.perf_counter()
        try:
            response = await self.transport.prepare(request, self.deadline_s)
        except Exception as exc:  # noqa: BLE001 - any drafter fault costs the draft, nothing more
            # The drafter may or may not have applied the deltas: keep the history
            # unchanged; the next call's overlap covers this call's tokens anyway.
            return self._fail(queries, _describe(exc), time.perf_counter() - started)
        latency = time.perf_counter() - started
        problem = _check_shape(response, request)
        if problem:
            return self._fail(queries, problem, latency)
        drafts, failed = [], []
        for query, result in zip(queries, response.results):
            draft, bad = self._accept(query, result)
            drafts.append(draft)
            failed.append(bad)
        if any(failed):
            self.stats.failures += 1
            self.stats.last_error = "drafter returned invalid draft tokens"
            self.breaker.record_failure()
        else:
            self.breaker.record_success()
        return DraftReply(drafts, failed, latency)

    def _build_request(self, queries: list[DraftQuery]) -> drafter_pb2.PrepareDraftTokensRequest:
        request = drafter_pb2.PrepareDraftTokensRequest(verifier_id=self.verifier_id)
        for q in queries:
            start = self.context_len(q.request_id)
            if start > len(q.tokens):  # cannot happen for committed context; be safe
                self._sent.pop(q.request_id, None)
                start = 0
            request.sequences.append(drafter_pb2.DraftSequence(
                request_id=q.request_id, context_len=start, new_tokens=q.tokens[start:],
                prompt_len=q.prompt_len, draft_len=q.draft_len,
                sampling=drafter_pb2.SamplingHints(temperature=q.temperature, top_p=q.top_p, top_k=q.top_k),
                last_num_drafted=q.last_num_drafted, last_num_accepted=q.last_num_accepted))
        return request

    def _accept(self, query: DraftQuery, result: drafter_pb2.DraftResult) -> tuple[list[int], bool]:
        if result.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED:
            self._sent.pop(query.request_id, None)
            self.stats.resyncs += 1
            return [], False
        if result.status != drafter_pb2.DRAFT_STATUS_OK:
            self._sent.pop(query.request_id, None)
            return [], True
        history = self._sent.get(query.request_id)
        if history is None:
            history = self._sent[query.request_id] = deque(maxlen=self.overlap_steps)
        history.append(len(query.tokens))
        tokens = list(result.draft_tokens)
        if len(tokens) > query.draft_len or any(t < 0 or t >= self.vocab_size for t in tokens):
            return [], True
        return tokens, False

    def _fail(self, queries: list[DraftQuery], error: str, latency: float) -> DraftReply:
        self.stats.failures += 1
        self.stats.last_error = error
        self.breaker.record_failure()
        log.debug("drafter call failed: %s", error)
        return DraftReply([[] for _ in queries], [True] * len(queries), latency)

    def release(self, request_ids: list[str]) -> None:
        """Forget the ids here and tell the drafter in the background (best effort:
        a lost release is cleaned up by the drafter's idle eviction)."""
        for rid in request_ids:
            self._sent.pop(rid, None)
        if not request_ids or not self.breaker.allow():
            return
        request = drafter_pb2.ReleaseRequestsRequest(verifier_id=self.verifier_id, request_ids=request_ids)
        task = asyncio.get_running_loop().create_task(self._release(request))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, request: drafter_pb2.ReleaseRequestsRequest) -> None:
        try:
            await self.transport.release(request, max(self.deadline_s, 1.0))
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("release failed: %s", _describe(exc))

    async def info(self, timeout_s: float = 2.0) -> drafter_pb2.GetDrafterInfoResponse:
        return await self.transport.info(timeout_s)

    @property
    def healthy(self) -> bool:
        return not self.breaker.is_open

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.transport.close()


def _check_shape(response: drafter_pb2.PrepareDraftTokensResponse,
                 request: drafter_pb2.PrepareDraftTokensRequest) -> str:
    if len(response.results) != len(request.sequences):
        return f"drafter returned {len(response.results)} results for {len(request.sequences)} sequences"
    for result, seq in zip(response.results, request.sequences):
        if result.request_id != seq.request_id:
            return f"drafter answered for request {result.request_id!r} where {seq.request_id!r} was asked"
    return ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
