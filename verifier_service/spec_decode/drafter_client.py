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
more replica. Where every call reaches one drafter (in-process, or over one
PrepareDraftTokensStream, which lives on one replica) the deltas are plain: the
tokens since the last successful call. The client turns the
answer into drafts the verifier can trust: anything late, failing or malformed
becomes "no draft" for that step. The same client drives a remote drafter over
gRPC and an SDK drafter in-process (transport.py), so the two differ only by
the network hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc

from drafter_sdk.drafter import CACHE_SALT, LEARNS_FROM_FINISHED, LOOKAHEAD, STREAM_RELEASES
from drafter_sdk.proto import drafter_pb2
from drafter_sdk.tree import TREE_CAPABILITY, is_chain, tree_problem
from verifier_service.spec_decode.circuit_breaker import CircuitBreaker
from verifier_service.spec_decode.transport import Answer, Transport, status_of

log = logging.getLogger(__name__)
# Ask a drafter again who it is this often while its word is all that keeps it from drafting: its
# tokenizer does not match, or salted sequences wait for it to say it keeps cache salts apart (it
# was not reached yet, or may be replaced by one that does).
INFO_RECHECK_S = 5.0


@dataclass
class DeltaHistory:
    """What a drafter has been sent of one sequence: its committed length after each of the
    sequence's most recent successful calls, oldest first (at most overlap_steps of them).
    Lives on the sequence, so it goes when the sequence does."""

    lengths: deque[int] = field(default_factory=deque)


@dataclass
class DraftQuery:
    """One sequence of a verifier step."""

    request_id: str
    tokens: Sequence[int]  # every committed token, prompt first
    prompt_len: int
    draft_len: int
    history: DeltaHistory
    last_num_drafted: int = 0
    last_num_accepted: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_draft_nodes: int = 0  # token-tree budget (draft_len is then its depth); 0 = chains only
    cache_salt_id: str = ""  # its request's cache salt, as the drafter may see it ("": unsalted)


@dataclass
class ReleasedRequest:
    """A sequence that left the engine, and why (a drafter_pb2.ReleaseReason)."""

    request_id: str
    reason: int
    tokens: Sequence[int]  # every committed token, prompt first
    prompt_len: int
    history: DeltaHistory
    cache_salt_id: str = ""


@dataclass
class DraftCall:
    """A step's PrepareDraftTokens call, from `send` to `receive`."""

    queries: list[DraftQuery]
    request: drafter_pb2.PrepareDraftTokensRequest | None = None  # None: no call made (nothing to ask)
    sent: list[bool] = field(default_factory=list)  # parallel to queries: those the request carries, in order
    answer: Answer | None = None  # where the transport sent it already: reads its answer
    error: BaseException | None = None  # sending it failed
    started: float = field(default_factory=time.perf_counter)

    def no_drafts(self) -> "DraftReply":
        return DraftReply([[] for _ in self.queries], [False] * len(self.queries))


@dataclass
class DraftReply:
    drafts: list[list[int]]  # one per query; [] = no draft
    failed: list[bool]  # the drafter failed or misbehaved for this query
    latency_s: float = 0.0
    # Per query, a token tree's parents (drafter_sdk/tree.py; [] = a chain); empty = all chains.
    parents: list[list[int]] = field(default_factory=list)


@dataclass
class DrafterClientStats:
    calls: int = 0
    failures: int = 0
    skipped: int = 0  # steps with the breaker open
    overlapped: int = 0  # calls sent by `send`: their answers were read after the step's forward
    resyncs: int = 0
    invalid_trees: int = 0  # token trees discarded (malformed, too deep or over the node budget)
    last_error: str = ""
    # Finished requests told to every drafter replica (share_finished): one per request and replica.
    announced: int = 0
    request_bytes: int = 0
    last_request_bytes: int = 0


@dataclass
class DrafterClient:
    transport: Transport
    verifier_id: str
    vocab_size: int
    deadline_s: float
    # Every call re-sends the tokens committed since the request's overlap_steps-th most
    # recent successful call (the whole context until it had that many), so drafter
    # replicas that missed up to overlap_steps - 1 steps catch up without a resync.
    # 1 = plain deltas (one drafter, e.g. in-process).
    overlap_steps: int
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    stats: DrafterClientStats = field(default_factory=DrafterClientStats)
    # Who the drafter says it is: asked when the client connects, when the drafter answers
    # again after failing, after it lost a sequence's state (a restart), and while salted
    # sequences wait for its word (`sees`). None until known.
    info: drafter_pb2.GetDrafterInfoResponse | None = None
    # The model tokenizer's fingerprint (drafter_sdk.loading.tokenizer_fingerprint); "" = do not check.
    tokenizer_fingerprint: str = ""
    tokenizer_name: str = ""  # for the log line when they differ
    # Send a step's call before its forward and read the answer after, where the drafter looks ahead
    # (`looks_ahead`); off: every call is waited for before the forward.
    overlap_calls: bool = True
    # Where the drafter learns from finished requests, tell every replica behind its target of each one
    # (`release`; replicas.py), not only the replica that served it.
    share_finished: bool = True
    # Why speculation is off for this drafter: its tokenizer is not the model's. "" = it is on.
    disabled_reason: str = ""
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _asking_info: bool = False
    _said_unreachable: bool = False  # since it last answered GetDrafterInfo: asked again, it is not said again
    # It answered again after failing, or lost state (a restart): until it says who it is now, `info` may
    # be another drafter's, and salted sequences are not sent on its word.
    _info_stale: bool = False
    _told_unsalted: str = ""  # the drafter whose salted requests were said to run without its drafts
    _last_info_ask: float = 0.0

    def __post_init__(self) -> None:
        if self.overlap_steps < 1:
            raise ValueError(f"overlap_steps must be at least 1, not {self.overlap_steps}")

    def context_len(self, history: DeltaHistory) -> int:
        """Offset of the first token the next call sends for a sequence (0: the whole context)."""
        # One drafter sees every call: plain deltas. Calls spread over replicas re-send the last
        # overlap_steps calls' tokens; until a sequence had that many, some replica may hold nothing.
        overlap = 1 if self.transport.one_replica else self.overlap_steps
        return history.lengths[-overlap] if len(history.lengths) >= overlap else 0

    async def connect(self, timeout_s: float = 2.0) -> None:
        """Learn who the drafter is; an absent drafter is not fatal (the breaker retries, and the
        first call it answers asks again). An in-process drafter is loaded first."""
        load = getattr(self.transport, "load", None)
        if load is not None:
            await load()
        await self._ask_info(timeout_s)

    @property
    def looks_ahead(self) -> bool:
        """Whether a step's call can be sent before its forward and its answer read after it: the
        transport splits calls, the drafter drafts past what is verified at no cost (capability
        "lookahead"), and `overlap_calls` is on."""
        return (self.overlap_calls and self.transport.splits_calls and self.info is not None
                and LOOKAHEAD in self.info.capabilities)

    async def propose(self, queries: list[DraftQuery]) -> DraftReply:
        """The step's drafts, waited for."""
        call = self._new_call(queries)
        if call.request is None:
            return call.no_drafts()
        try:
            response = await self.transport.prepare(call.request, self.deadline_s)
        except Exception as exc:  # noqa: BLE001 - any drafter fault costs the draft, nothing more
            return self._fail(call, _describe(exc), time.perf_counter() - call.started)
        return self._reply(call, response)

    def send(self, queries: list[DraftQuery]) -> DraftCall:
        """Send the step's call now (where `looks_ahead`); `receive` reads its answer later, which
        gRPC's threads receive meanwhile."""
        call = self._new_call(queries)
        if call.request is not None:
            self.stats.overlapped += 1
            try:
                call.answer = self.transport.start(call.request, self.deadline_s)
            except Exception as exc:  # noqa: BLE001 - receive fails it
                call.error = exc
        return call

    def receive(self, call: DraftCall) -> DraftReply:
        """The drafts of a call `send` sent ("no draft" for whatever failed or misbehaved)."""
        if call.request is None:
            return call.no_drafts()
        try:
            if call.answer is None:
                raise call.error or RuntimeError(f"{self.transport.target} cannot send a call ahead of its answer")
            response = call.answer()
        except Exception as exc:  # noqa: BLE001 - any drafter fault costs the draft, nothing more
            return self._fail(call, _describe(exc), time.perf_counter() - call.started)
        return self._reply(call, response)

    def _new_call(self, queries: list[DraftQuery]) -> DraftCall:
        """The call for a step's sequences (no request while the breaker is open or speculation is off)."""
        if not queries:
            return DraftCall(queries)
        if self.disabled_reason:
            self._ask_again()
            self.stats.skipped += 1
            return DraftCall(queries)
        if not self.breaker.allow():
            self.stats.skipped += 1
            return DraftCall(queries)
        sent = [self.sees(q.cache_salt_id) for q in queries]
        if not any(sent):
            return DraftCall(queries)
        request = self._build_request([q for q, s in zip(queries, sent) if s])
        self.stats.calls += 1
        size = request.ByteSize()
        self.stats.request_bytes += size
        self.stats.last_request_bytes = size
        return DraftCall(queries, request, sent)

    def sees(self, cache_salt_id: str) -> bool:
        """Whether the drafter is sent a request: an unsalted one always; a salted one only where the
        drafter keeps salts apart (capability "cache-salt"), so that what it learns never crosses them,
        and only on its current word (after a restart, once it has said again who it is). The scheduler
        plans no drafter draft for a request not sent (engine.py). While one waits, the drafter is asked
        again who it is now and then (salted traffic alone makes no call that would ask: it may have come
        up, or been replaced by one that keeps salts apart); one that does not has it said once."""
        if not cache_salt_id:
            return True
        if self.info is not None and not self._info_stale:
            if CACHE_SALT in self.info.capabilities:
                return True
            self._tell_unsalted(self.info.name)
        self._ask_again()
        return False

    def _ask_again(self) -> None:
        """Ask who the drafter is in the background, at most every INFO_RECHECK_S."""
        if time.monotonic() - self._last_info_ask > INFO_RECHECK_S:
            self._last_info_ask = time.monotonic()  # one ask, however many sequences wait for it
            self._in_background(self._ask_info(self._background_timeout_s))

    def _tell_unsalted(self, drafter: str) -> None:
        """Say once per drafter that salted requests run without its drafts: an operator who salts every
        request would otherwise find speculation off with no word of why."""
        if self._told_unsalted == drafter:
            return
        self._told_unsalted = drafter
        log.warning("drafter %s does not say it keeps cache salts apart (no %r capability): requests with a "
                    "cache_salt run without its drafts (PROTOCOL.md section 7)", drafter, CACHE_SALT)

    def _reply(self, call: DraftCall, response: drafter_pb2.PrepareDraftTokensResponse) -> DraftReply:
        latency = time.perf_counter() - call.started
        queries, request = call.queries, call.request
        assert request is not None
        problem = _check_shape(response, request)
        if problem:
            return self._fail(call, problem, latency)
        drafts: list[list[int]] = []
        parents: list[list[int]] = []
        failed: list[bool] = []
        lost_state, tree_error = False, ""
        results = iter(response.results)
        for query, sent in zip(queries, call.sent):
            if not sent:
                drafts.append([])
                parents.append([])
                failed.append(False)
                continue
            result = next(results)
            lost_state |= result.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED and bool(query.history.lengths)
            draft, bad = self._accept(query, result)
            tree, problem = self._accept_tree(query, result, draft)
            drafts.append([] if problem else draft)
            parents.append(tree)
            failed.append(bad or bool(problem))
            tree_error = tree_error or problem
        recovered = self.breaker.is_open  # it answered again after the breaker had opened
        if any(failed):
            self.stats.failures += 1
            self.stats.last_error = (f"drafter returned an invalid token tree: {tree_error}" if tree_error
                                     else "drafter returned invalid draft tokens")
            self.breaker.record_failure()
        else:
            self.breaker.record_success()
        if recovered or lost_state:  # possibly another drafter now (a downgrade would mix salts)
            self._info_stale = True
        if self.info is None or self._info_stale:  # ask who it is
            self._in_background(self._ask_info(self._background_timeout_s))
        return DraftReply(drafts, failed, latency, parents)

    def _build_request(self, queries: list[DraftQuery]) -> drafter_pb2.PrepareDraftTokensRequest:
        request = drafter_pb2.PrepareDraftTokensRequest(verifier_id=self.verifier_id)
        for q in queries:
            start = self.context_len(q.history)
            if start > len(q.tokens):  # cannot happen for committed context; be safe
                q.history.lengths.clear()
                start = 0
            request.sequences.append(drafter_pb2.DraftSequence(
                request_id=q.request_id, context_len=start, new_tokens=q.tokens[start:],
                prompt_len=q.prompt_len, draft_len=q.draft_len,
                sampling=drafter_pb2.SamplingHints(temperature=q.temperature, top_p=q.top_p, top_k=q.top_k),
                last_num_drafted=q.last_num_drafted, last_num_accepted=q.last_num_accepted,
                max_draft_nodes=q.max_draft_nodes, cache_salt_id=q.cache_salt_id))
        return request

    def _accept(self, query: DraftQuery, result: drafter_pb2.DraftResult) -> tuple[list[int], bool]:
        history = query.history.lengths
        if result.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED:
            history.clear()
            self.stats.resyncs += 1
            return [], False
        if result.status != drafter_pb2.DRAFT_STATUS_OK:
            history.clear()
            return [], True
        history.append(len(query.tokens))
        if len(history) > self.overlap_steps:
            history.popleft()
        tokens = list(result.draft_tokens)
        too_long = len(tokens) > query.draft_len and not result.draft_parents  # a tree's size: _accept_tree
        if too_long or any(t < 0 or t >= self.vocab_size for t in tokens):
            return [], True
        return tokens, False

    def _accept_tree(self, query: DraftQuery, result: drafter_pb2.DraftResult,
                     draft: list[int]) -> tuple[list[int], str]:
        """A draft's tree parents ([] for a chain), or why the tree is discarded: malformed, deeper
        than draft_len, over the node budget, or sent where a chain was asked for."""
        parents = list(result.draft_parents)
        if not parents or not draft or (is_chain(parents) and len(parents) == len(draft)
                                        and len(draft) <= query.draft_len):
            return [], ""  # a chain, possibly spelt as a tree
        problem = ("a token tree where the verifier asked for a chain" if not query.max_draft_nodes else
                   tree_problem(draft, parents, query.draft_len, query.max_draft_nodes))
        if not problem:
            return parents, ""
        self.stats.invalid_trees += 1
        log.debug("discarded the token tree for %s: %s", query.request_id, problem)
        return [], problem

    @property
    def supports_trees(self) -> bool:
        """The drafter said it may answer token trees (GetDrafterInfo capabilities)."""
        return self.info is not None and TREE_CAPABILITY in self.info.capabilities

    def _fail(self, call: DraftCall, error: str, latency: float) -> DraftReply:
        # The drafter may or may not have applied the deltas: the history stays unchanged, and the
        # next call's overlap covers this call's tokens anyway.
        self.stats.failures += 1
        self.stats.last_error = error
        self.breaker.record_failure()
        log.debug("drafter call failed: %s", error)
        return DraftReply([[] for _ in call.queries], list(call.sent), latency)

    def release(self, released: list[ReleasedRequest]) -> None:
        """Tell the drafter in the background (best effort: a lost release is cleaned up by
        the drafter's idle eviction). The verifier's own record went with the sequences.

        A drafter that learns from finished outputs (it advertises LEARNS_FROM_FINISHED) first
        gets the tokens of finished requests it has not seen yet, in a sync-only call (draft
        length 0): the tokens of a request's last step are otherwise never sent. With
        `share_finished`, every replica behind its target is then told of the finished ones, each
        whole (PROTOCOL.md section 7): the replica that served one takes it once (the SDK turns a
        second FINISHED release of a key into EVICTED), and the others learn it too. Requests the
        drafter is not sent (`sees`) are left out."""
        released = [r for r in released if self.sees(r.cache_salt_id)]
        if not released or not self.breaker.allow():
            return
        request = drafter_pb2.ReleaseRequestsRequest(
            verifier_id=self.verifier_id, request_ids=[r.request_id for r in released],
            reasons=[r.reason for r in released])
        self._in_background(self._release(request, self._final_sync(released), self._announcement(released)))

    def _announcement(self, released: list[ReleasedRequest]) -> tuple[drafter_pb2.PrepareDraftTokensRequest,
                                                                      drafter_pb2.ReleaseRequestsRequest] | None:
        """The finished requests, whole, and their release, for every replica; None where none learns them."""
        if not self.share_finished or self.info is None or LEARNS_FROM_FINISHED not in self.info.capabilities:
            return None
        finished = [r for r in released if r.reason == drafter_pb2.RELEASE_REASON_FINISHED]
        if not finished:
            return None
        # A fresh history: the whole context, to replicas that have never seen the request.
        sync = self._build_request([DraftQuery(r.request_id, r.tokens, r.prompt_len, 0, DeltaHistory(),
                                               cache_salt_id=r.cache_salt_id) for r in finished])
        return sync, drafter_pb2.ReleaseRequestsRequest(
            verifier_id=self.verifier_id, request_ids=[r.request_id for r in finished],
            reasons=[drafter_pb2.RELEASE_REASON_FINISHED] * len(finished))

    def _final_sync(self, released: list[ReleasedRequest]) -> drafter_pb2.PrepareDraftTokensRequest | None:
        if self.info is None or LEARNS_FROM_FINISHED not in self.info.capabilities:
            return None
        unsent = [r for r in released if r.reason == drafter_pb2.RELEASE_REASON_FINISHED
                  and r.history.lengths and r.history.lengths[-1] < len(r.tokens)]
        if not unsent:
            return None
        return self._build_request([DraftQuery(r.request_id, r.tokens, r.prompt_len, 0, r.history,
                                               cache_salt_id=r.cache_salt_id) for r in unsent])

    async def _release(self, request: drafter_pb2.ReleaseRequestsRequest,
                       sync: drafter_pb2.PrepareDraftTokensRequest | None,
                       announcement: tuple[drafter_pb2.PrepareDraftTokensRequest,
                                           drafter_pb2.ReleaseRequestsRequest] | None = None) -> None:
        timeout_s = self._background_timeout_s
        try:
            if sync is not None:
                await self.transport.sync(sync, timeout_s)
            await self.transport.release(request, timeout_s, self.info is not None and
                                         STREAM_RELEASES in self.info.capabilities)
            if announcement is not None:  # after the release, which the serving replica then has first
                told = await self.transport.tell_every_replica(*announcement, timeout_s)
                self.stats.announced += told * len(announcement[1].request_ids)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("release failed: %s", _describe(exc))

    @property
    def _background_timeout_s(self) -> float:
        """The timeout of the calls no step waits for (who the drafter is, releases, resyncs): the drafting
        deadline, but at least a second, which a tight deadline would otherwise make them miss."""
        return max(self.deadline_s, 1.0)

    async def _ask_info(self, timeout_s: float) -> None:
        if self._asking_info:
            return
        self._asking_info = True
        self._last_info_ask = time.monotonic()
        try:
            info = await self.transport.info(timeout_s)
        except Exception as exc:  # noqa: BLE001 - absent drafter: decode without drafts until it answers
            if status_of(exc) != grpc.StatusCode.UNIMPLEMENTED:
                if not self._said_unreachable:
                    log.warning("drafter %s not reachable yet (%s); decoding without drafts until it is",
                                self.transport.target, _describe(exc))
                self._said_unreachable = True
                return
            info = drafter_pb2.GetDrafterInfoResponse()  # it drafts but says nothing of itself: ask no more
        finally:
            self._asking_info = False
        self._said_unreachable = self._info_stale = False
        if info != self.info:
            log.info("drafter %s %s at %s", info.name, info.version, self.transport.target)
            if info.vocab_size and info.vocab_size != self.vocab_size and not self._incompatibility(info):
                log.warning("drafter %s expects vocab size %d, the model has %d; its drafts will mostly be "
                            "rejected", info.name, info.vocab_size, self.vocab_size)
        self.info = info
        reason = self._incompatibility(info)
        if reason and reason != self.disabled_reason:
            log.error("speculation off for drafter %s: %s", self.transport.target, reason)
        elif self.disabled_reason and not reason:
            log.info("speculation back on for drafter %s: its tokenizer now matches the model's",
                     self.transport.target)
        self.disabled_reason = reason

    def _incompatibility(self, info: drafter_pb2.GetDrafterInfoResponse) -> str:
        """Why the drafter's token ids cannot be the model's; "" when they can or it does not say."""
        theirs, ours = info.tokenizer_fingerprint, self.tokenizer_fingerprint
        if not theirs or not ours or theirs == ours:
            return ""
        return (f"tokenizer mismatch: drafter {info.name or '?'} uses {info.tokenizer or 'an unnamed tokenizer'} "
                f"({theirs}, vocab {info.vocab_size}), the model's is {self.tokenizer_name or 'unnamed'} "
                f"({ours}, vocab {self.vocab_size})")

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def healthy(self) -> bool:
        return not self.breaker.is_open and not self.disabled_reason

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
    code = status_of(exc)
    if code is not None:
        return f"{code.name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"
