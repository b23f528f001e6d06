"""DrafterService: deltas in, drafts out.

The protocol logic lives in synchronous methods (`load`, `info`, `prepare`,
`release`, `evict_idle`) so a verifier can run an SDK drafter in-process through
exactly the code a remote one runs. Those methods are not thread-safe: call
them from one thread at a time. `run` does so: on a single dedicated worker
thread, which keeps slow user code off the event loop that answers health
checks, or, for a loaded drafter that `runs_inline`, on the event loop itself,
which saves the thread hop each way. `load` runs on the worker, and no
drafter code runs on the worker once an inline drafter has loaded.

An async drafter (`async def prepare_draft_tokens`) is served by `prepare_async`
and `load_async` on the event loop, where its other hooks run too, each call
in its turn (an asyncio lock held from a call's deltas to its answer, and by
`run`), so that its calls still run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import operator
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from drafter_sdk.drafter import (
    CACHE_SALT,
    LEARNS_FROM_FINISHED,
    STREAM_RELEASES,
    Drafter,
    DraftRequest,
    Key,
    ReleaseReason,
    SamplingHints,
)
from drafter_sdk.errors import DrafterError
from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc
from drafter_sdk.server.metrics import DrafterMetrics, StateStats
from drafter_sdk.server.peers import PEERS_TOKEN_NAME, pieces
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.service.security import carries_token
from drafter_sdk.tree import DraftTree, first_branch, is_chain, tree_problem, trim

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name
_INT32_LIMIT = 2**31  # draft ids travel as int32
_OK = drafter_pb2.DRAFT_STATUS_OK
_RESYNC = drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED
# A verifier may tell every replica of a drafter that a request finished (PROTOCOL.md section 7), the
# replica that served it too: keys released FINISHED lately are remembered, and a second FINISHED
# release of one reaches the drafter as EVICTED, so no output is learned twice. Those announcements
# follow the request's end within seconds; this many keys cover thousands of requests a second.
RECENT_FINISHED_KEYS = 4096

T = TypeVar("T")


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter, store: SequenceStore | None = None,
                 metrics: DrafterMetrics | None = None,
                 identify: Callable[[grpc.aio.ServicerContext], str] | None = None,
                 shares_learned: bool = False) -> None:
        self.drafter = drafter
        # Whether GetLearnedState answers: replicas with peers (peers.py) give what they learned.
        self.shares_learned = shares_learned
        # Who a gRPC call comes from ("" when nothing says): part of its namespace, see `namespace`.
        self._identify = identify
        self.store = store if store is not None else SequenceStore()
        # Recorded by the gRPC methods only: in-process callers measure for themselves.
        self.metrics = metrics
        if metrics is not None:
            metrics.track_held(lambda: len(self.store))
            metrics.track_state(self.state_stats)
        self.loaded = False
        self._shared_bytes = 0  # the drafter's shared_state_bytes() after the last call
        self._release_takes_reason = _takes_reason(drafter)
        self._finished: OrderedDict[Key, None] = OrderedDict()  # RECENT_FINISHED_KEYS, oldest first
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")
        self._jobs: set[Future[Any]] = set()  # the worker's, until each is done (or cancelled before it ran)
        # An async drafter's code runs on the event loop, one call at a time from its deltas to its answer
        # (`run`): a call awaiting the drafter holds the turn.
        self._async = drafter.is_async
        self._turn = asyncio.Lock()
        self._draining = asyncio.Event()  # the server stops: draft streams end (`drain`)

    # --- synchronous core (also the in-process API) ---

    def load(self, then: Callable[[], None] | None = None) -> None:
        """Run the drafter's `load()`, then `then` (a learned state's restore, learned_state.py); calls
        are refused with UNAVAILABLE until both returned. An `async def load()` is the server's to await
        (`load_async`)."""
        if inspect.iscoroutinefunction(self.drafter.load):
            raise TypeError(f"{self.drafter.name}.load is async: only the SDK's server (load_async) awaits it")
        self.drafter.load()
        if then is not None:
            then()
        self.loaded = True

    def restore_learned(self, data: bytes, source: str) -> bool:
        """Give the drafter back what it learned before (`Drafter.restore_learned`), then count it in the
        state budget; False where the drafter refused it (ValueError) or failed (a bug in its restore,
        logged whole), both logged with `source` ("at <file>", "of peer <address>")."""
        try:
            self.drafter.restore_learned(data)
        except Exception as exc:
            log.log(logging.WARNING if isinstance(exc, ValueError) else logging.ERROR,
                    "%s cannot restore the learned state %s: %s", self.drafter.name, source, exc,
                    exc_info=not isinstance(exc, ValueError))
            return False
        self._shared_bytes = self._hook(self.drafter.shared_state_bytes)
        return True

    def learned_state(self, request: drafter_pb2.GetLearnedStateRequest, caller: str = "") -> bytes:
        """What the drafter learned across requests (`Drafter.save_learned`), for a replica of it that starts.

        Raises DrafterError: FAILED_PRECONDITION where this replica does not share it, PERMISSION_DENIED
        for a caller other than its replicas where callers are told apart, INTERNAL when the drafter's
        code fails, UNAVAILABLE before `load()` finished.
        """
        self._require_loaded()  # a replica still loading, or asking its peers, the asker itself among them
        name = self.drafter.name
        if not self.shares_learned:
            raise DrafterError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"drafter {name} does not share what it learned (start it with --peers)")
        # It is every caller's outputs: where callers are told apart (named tokens, client certificates),
        # only the replicas' own token reads them, not a verifier's.
        if caller and not carries_token(caller, PEERS_TOKEN_NAME):
            raise DrafterError(grpc.StatusCode.PERMISSION_DENIED, f"what drafter {name} learned is for its "
                                                                  f"replicas: call with the token named "
                                                                  f"{PEERS_TOKEN_NAME!r}")
        try:
            return self.drafter.save_learned() or b""
        except Exception as exc:
            log.exception("%s.save_learned() failed", name)
            raise DrafterError(grpc.StatusCode.INTERNAL, f"drafter {name} failed to take what it learned") from exc

    def info(self) -> drafter_pb2.GetDrafterInfoResponse:
        d = self.drafter
        return drafter_pb2.GetDrafterInfoResponse(
            name=d.name, version=d.version, max_draft_len=d.max_draft_len,
            vocab_size=d.vocab_size, tokenizer=d.tokenizer, capabilities=self.capabilities,
            tokenizer_fingerprint=d.tokenizer_fingerprint)

    @property
    def capabilities(self) -> list[str]:
        """The drafter's own, STREAM_RELEASES, and CACHE_SALT where it learns nothing across requests (a
        salted request has nothing to be kept apart from): it keeps nothing to save and does not ask for
        finished outputs."""
        d = self.drafter
        learns = d.learns_across_requests or LEARNS_FROM_FINISHED in d.capabilities
        isolated = [CACHE_SALT] if CACHE_SALT not in d.capabilities and not learns else []
        return [*d.capabilities, *isolated, STREAM_RELEASES]

    def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                caller: str = "") -> drafter_pb2.PrepareDraftTokensResponse:
        """Apply every sequence's delta and draft for those whose context is in sync, in the
        namespace of the request's verifier_id as sent by `caller` (see `namespace`).

        Raises DrafterError: INVALID_ARGUMENT for a malformed request (no state
        is touched then), INTERNAL when the drafter's code fails or answers
        nonsense (an async drafter too: only `prepare_async` awaits it),
        UNAVAILABLE before `load()` finished.
        """
        call = self._synced(request, caller)
        try:
            drafts: Any = []
            if call.batch:
                if self._async:
                    raise DrafterError(grpc.StatusCode.INTERNAL, f"{self.drafter.name} is an async drafter: only "
                                                                 "the SDK's server (prepare_async) awaits it")
                with self._drafter_code("prepare_draft_tokens"):
                    drafts = self.drafter.prepare_draft_tokens(call.batch)
            return call.answer(self._checked_drafts(call.batch, drafts))
        finally:  # the deltas are applied even when the drafter fails: the budget holds either way
            self._enforce_budget([req.key for req in call.batch])

    async def prepare_async(self, request: drafter_pb2.PrepareDraftTokensRequest,
                            caller: str = "") -> drafter_pb2.PrepareDraftTokensResponse:
        """`prepare` for an async drafter, on the event loop: its `prepare_draft_tokens` awaited. The
        caller holds the drafter's turn (`run`) from the deltas to the answer."""
        call = self._synced(request, caller)
        try:
            drafts: Any = []
            if call.batch:
                with self._drafter_code("prepare_draft_tokens"):
                    drafts = self.drafter.prepare_draft_tokens(call.batch)
                    if isinstance(drafts, Awaitable):
                        drafts = await drafts
            return call.answer(self._checked_drafts(call.batch, drafts))
        finally:
            self._enforce_budget([req.key for req in call.batch])

    def _synced(self, request: drafter_pb2.PrepareDraftTokensRequest, caller: str) -> _Call:
        """The call's deltas applied: its answers so far, and the requests to draft for."""
        self._require_loaded()
        self._validate(request)
        verifier_id = namespace(request.verifier_id, caller)
        results: list[drafter_pb2.DraftResult | None] = []
        batch: list[DraftRequest] = []
        slots: list[int] = []
        for seq in request.sequences:
            key = (verifier_id, seq.request_id)
            synced = self.store.sync(key, seq.context_len, seq.new_tokens)
            if synced.discarded:
                self._forget(key, ReleaseReason.EVICTED)
            if synced.oversize:  # larger than the whole budget: no draft, and no resync either
                results.append(drafter_pb2.DraftResult(request_id=seq.request_id, status=_OK))
                continue
            if synced.tokens is None:
                results.append(drafter_pb2.DraftResult(request_id=seq.request_id, status=_RESYNC))
                continue
            slots.append(len(results))
            results.append(None)
            hints = seq.sampling
            batch.append(DraftRequest(
                verifier_id=verifier_id, request_id=seq.request_id, tokens=synced.tokens,
                prompt_len=seq.prompt_len, draft_len=seq.draft_len,
                last_num_drafted=seq.last_num_drafted, last_num_accepted=seq.last_num_accepted,
                # Proto3 cannot tell top_p 0 from unset; both mean "no nucleus filtering".
                sampling=SamplingHints(hints.temperature, hints.top_p or 1.0, hints.top_k),
                max_draft_nodes=seq.max_draft_nodes, cache_salt_id=seq.cache_salt_id))
        return _Call(results, batch, slots)

    def release(self, request: drafter_pb2.ReleaseRequestsRequest,
                caller: str = "") -> drafter_pb2.ReleaseRequestsResponse:
        self._require_loaded()
        if not request.verifier_id:
            raise DrafterError(grpc.StatusCode.INVALID_ARGUMENT, "verifier_id must not be empty")
        if len(request.reasons) > len(request.request_ids):
            raise DrafterError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.reasons)} reasons for "
                               f"{len(request.request_ids)} request ids")
        released = 0
        for i, request_id in enumerate(request.request_ids):
            key = (namespace(request.verifier_id, caller), request_id)
            if self.store.release(key):
                released += 1
                reason = _reason(request.reasons[i]) if i < len(request.reasons) else ReleaseReason.UNSPECIFIED
                self._forget(key, self._once(key, reason))
        if released:  # a drafter that learns from finished outputs grew its shared state
            self._enforce_budget([])
        return drafter_pb2.ReleaseRequestsResponse(released=released)

    def _once(self, key: Key, reason: ReleaseReason) -> ReleaseReason:
        """`reason`, except EVICTED for a key released FINISHED lately (RECENT_FINISHED_KEYS)."""
        if reason != ReleaseReason.FINISHED:
            return reason
        if key in self._finished:
            return ReleaseReason.EVICTED
        self._finished[key] = None
        if len(self._finished) > RECENT_FINISHED_KEYS:
            self._finished.popitem(last=False)
        return reason

    def evict_idle(self) -> int:
        """Forget the sequences idle for the store's timeout; how many there were."""
        evicted = self.store.evict_idle()
        for key in evicted:
            self._forget(key, ReleaseReason.EVICTED)
        if evicted:
            log.info("evicted %d idle sequence(s)", len(evicted))
        return len(evicted)

    def state_stats(self) -> StateStats:
        """The budget's figures, safe to read from another thread (no drafter code runs)."""
        store = self.store
        return StateStats(budget_bytes=store.max_state_bytes, bytes_by_namespace=store.bytes_by_namespace(),
                          shared_bytes=self._shared_bytes, held_tokens=store.held_tokens,
                          evictions=dict(store.evictions), eviction_resyncs=store.eviction_resyncs)

    # --- gRPC ---

    async def GetDrafterInfo(self, request: drafter_pb2.GetDrafterInfoRequest,
                             context: grpc.aio.ServicerContext) -> drafter_pb2.GetDrafterInfoResponse:
        if not self.loaded:  # what a drafter is (vocabulary, tokenizer) may only be known once it loaded
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"drafter {self.drafter.name} is still loading")
        return self.info()

    async def PrepareDraftTokens(self, request: drafter_pb2.PrepareDraftTokensRequest,
                                 context: grpc.aio.ServicerContext) -> drafter_pb2.PrepareDraftTokensResponse:
        response = await self._handle("PrepareDraftTokens", self._prepare, request, context)
        if self.metrics is not None:
            self.metrics.record_drafts(response)
        return response

    async def PrepareDraftTokensStream(
            self, requests: AsyncIterator[drafter_pb2.PrepareDraftTokensStreamRequest],
            context: grpc.aio.ServicerContext) -> AsyncIterator[drafter_pb2.PrepareDraftTokensStreamResponse]:
        """PrepareDraftTokens (and ReleaseRequests: STREAM_RELEASES), one call per message of one
        long-lived stream, answered in order. A call that fails ends the stream with its status, as
        the unary call would have. Once the server stops (`drain`), the stream ends (OK) after the
        message in flight, if any: a verifier opens its next stream elsewhere instead of holding
        the shutdown for its grace."""
        draining = asyncio.ensure_future(self._draining.wait())
        try:
            async for message in _until(draining, requests):
                if message.WhichOneof("message") == "release":
                    released = await self.ReleaseRequests(message.release, context)
                    yield drafter_pb2.PrepareDraftTokensStreamResponse(released=released)
                else:
                    response = await self.PrepareDraftTokens(message.request, context)
                    yield drafter_pb2.PrepareDraftTokensStreamResponse(response=response)
        finally:
            draining.cancel()

    def drain(self) -> None:
        """The server stops: end every draft stream once it has answered the message in flight."""
        self._draining.set()

    async def ReleaseRequests(self, request: drafter_pb2.ReleaseRequestsRequest,
                              context: grpc.aio.ServicerContext) -> drafter_pb2.ReleaseRequestsResponse:
        return await self._handle("ReleaseRequests", functools.partial(self.run, self.release), request, context)

    async def GetLearnedState(self, request: drafter_pb2.GetLearnedStateRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[drafter_pb2.GetLearnedStateResponse]:
        """What the drafter learned (`learned_state`), in pieces, for a peer replica that starts."""
        data = await self._handle("GetLearnedState", functools.partial(self.run, self.learned_state), request,
                                  context)
        for piece in pieces(data):
            yield drafter_pb2.GetLearnedStateResponse(chunk=piece)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run drafter code `fn` (not `load`): inline for a loaded drafter that `runs_inline`, and for a
        loaded async drafter in its turn (no call of it awaiting meanwhile); else on the worker thread."""
        if self.loaded and self._async:
            async with self._turn:
                return fn(*args)
        if self.loaded and self.drafter.runs_inline:
            return fn(*args)
        return await self.run_in_worker(fn, *args)

    async def load_async(self, then: Callable[[], None] | None = None) -> None:
        """`load` as the server runs it: an `async def load()` awaited on the event loop, any other on the
        worker thread; `then` (a learned state's restore) on the worker thread after it."""
        if not inspect.iscoroutinefunction(self.drafter.load):
            await self.run_in_worker(self.load, then)
            return
        await self.drafter.load()
        if then is not None:
            await self.run_in_worker(then)
        self.loaded = True

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the drafter's worker thread, after whatever is queued there."""
        job = self._worker.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return await asyncio.wrap_future(job)

    async def worker_done(self, within_s: float) -> bool:
        """Whether the drafter code on (or queued for) the worker thread has returned, waiting up to
        `within_s` for it, whoever else stopped waiting for it."""
        if self._jobs:
            await asyncio.wait([asyncio.wrap_future(job) for job in list(self._jobs)], timeout=within_s)
        return not self._jobs

    def close(self) -> None:
        """Stop the worker thread once its current job ends; queued jobs are dropped."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    # --- helpers ---

    async def _prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                       caller: str) -> drafter_pb2.PrepareDraftTokensResponse:
        if not self._async:
            return await self.run(self.prepare, request, caller)
        async with self._turn:
            return await self.prepare_async(request, caller)

    async def _handle(self, name: str, method: Callable[[Any, str], Awaitable[T]], request: Any,
                      context: grpc.aio.ServicerContext) -> T:
        start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
        try:
            # Checked here too so calls during a long load() fail fast instead of queueing behind it.
            self._require_loaded()
            caller = self._identify(context) if self._identify is not None else ""
            response = await method(request, caller)
            code = grpc.StatusCode.OK
            return response
        except DrafterError as err:
            code, refused = err.code, err
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client gave up (deadline) or the server stops
            raise
        finally:
            if self.metrics is not None:
                self.metrics.record_call(name, code, time.perf_counter() - start)
        # Counted first: abort() hands the client its status at once, and a scrape right after must see it.
        await context.abort(refused.code, refused.details)

    def _require_loaded(self) -> None:
        if not self.loaded:
            raise DrafterError(grpc.StatusCode.UNAVAILABLE, f"drafter {self.drafter.name} is still loading")

    def _validate(self, request: drafter_pb2.PrepareDraftTokensRequest) -> None:
        def invalid(details: str) -> DrafterError:
            log.warning("refused PrepareDraftTokens from %r: %s", request.verifier_id, details)
            return DrafterError(grpc.StatusCode.INVALID_ARGUMENT, details)

        if not request.verifier_id:
            raise invalid("verifier_id must not be empty")
        if "\0" in request.verifier_id:  # drafters name a salt's state after it: "<verifier id>\0<salt id>"
            raise invalid("verifier_id must not hold a NUL character")
        vocab_size = self.drafter.vocab_size
        seen: set[str] = set()
        for seq in request.sequences:
            rid = seq.request_id
            if not rid:
                raise invalid("request_id must not be empty")
            if rid in seen:
                raise invalid(f"duplicate request_id {rid!r} in one call")
            seen.add(rid)
            if seq.new_tokens:
                if min(seq.new_tokens) < 0:
                    raise invalid(f"request {rid!r}: negative token id {min(seq.new_tokens)}")
                if vocab_size and max(seq.new_tokens) >= vocab_size:
                    raise invalid(f"request {rid!r}: token id {max(seq.new_tokens)} is outside "
                                  f"the drafter's vocabulary (vocab_size {vocab_size})")
            if seq.prompt_len > seq.context_len + len(seq.new_tokens):
                raise invalid(f"request {rid!r}: prompt_len {seq.prompt_len} exceeds the context length "
                              f"{seq.context_len + len(seq.new_tokens)}")

    @contextlib.contextmanager
    def _drafter_code(self, hook: str) -> Iterator[None]:
        """The drafter's `hook` failing (a bug in it) is INTERNAL, logged whole."""
        try:
            yield
        except Exception as exc:
            log.exception("%s.%s failed", type(self.drafter).__name__, hook)
            raise DrafterError(grpc.StatusCode.INTERNAL, f"{hook} raised {type(exc).__name__}: {exc}") from exc

    def _checked_drafts(self, batch: list[DraftRequest], drafts: Any) -> list[tuple[list[int], list[int]]]:
        """The drafter's answer to `batch`, trimmed and checked, as (tokens, parents) per request; parents
        are empty for a chain."""
        count = len(drafts) if hasattr(drafts, "__len__") else f"a {type(drafts).__name__}, not a list of"
        if count != len(batch):
            details = f"prepare_draft_tokens returned {count} drafts for {len(batch)} requests"
            log.error(details)
            raise DrafterError(grpc.StatusCode.INTERNAL, details)
        cap = self.drafter.max_draft_len
        return [self._checked(req, draft, min(req.draft_len, cap) if cap else req.draft_len)
                for req, draft in zip(batch, drafts)]

    def _checked(self, req: DraftRequest, draft: Any, limit: int) -> tuple[list[int], list[int]]:
        if isinstance(draft, DraftTree):
            return self._checked_tree(req, draft, limit)
        return self._checked_ids(req, draft, limit), []

    def _checked_tree(self, req: DraftRequest, tree: DraftTree, limit: int) -> tuple[list[int], list[int]]:
        """A tree: refused if malformed; trimmed to the budget; its first branch if a chain was asked."""
        tokens = self._checked_ids(req, tree.tokens, _INT32_LIMIT)
        try:
            parents = [operator.index(p) for p in tree.parents]
        except TypeError as exc:
            details = f"tree for request {req.request_id!r}: parents are not ints ({exc})"
            log.error(details)
            raise DrafterError(grpc.StatusCode.INTERNAL, details) from exc
        problem = tree_problem(tokens, parents, max_depth=len(tokens), max_nodes=len(tokens))
        if problem:
            details = f"tree for request {req.request_id!r} is malformed: {problem}"
            log.error(details)
            raise DrafterError(grpc.StatusCode.INTERNAL, details)
        if not req.max_draft_nodes:
            return first_branch(tokens, parents)[:limit], []
        tokens, parents = trim(tokens, parents, limit, req.max_draft_nodes)
        return (tokens, []) if is_chain(parents) else (tokens, parents)

    def _checked_ids(self, req: DraftRequest, draft: Any, limit: int) -> list[int]:
        bound = self.drafter.vocab_size or _INT32_LIMIT
        try:
            tokens = [operator.index(t) for t in itertools.islice(draft, limit)]
        except TypeError as exc:
            details = f"draft for request {req.request_id!r} is not a sequence of int token ids ({exc})"
            log.error(details)
            raise DrafterError(grpc.StatusCode.INTERNAL, details) from exc
        bad = [t for t in tokens if not 0 <= t < bound]
        if bad:
            details = f"draft for request {req.request_id!r} holds token id {bad[0]} outside [0, {bound})"
            log.error(details)
            raise DrafterError(grpc.StatusCode.INTERNAL, details)
        return tokens

    def _enforce_budget(self, drafted: list[Key]) -> None:
        """Account what the drafter now holds for the sequences just drafted, then evict past the budget."""
        for key in drafted:
            if self.store.account(key, self._hook(self.drafter.state_bytes, key)):
                log.warning("sequence %r outgrew the whole state budget: no drafts for it", key)
                self._forget(key, ReleaseReason.EVICTED)
        self._shared_bytes = self._hook(self.drafter.shared_state_bytes)
        evicted = self.store.evict_over_budget(self._shared_bytes)
        for key in evicted:
            self._forget(key, ReleaseReason.EVICTED)
        if evicted:
            log.debug("evicted %d sequence(s) over the state budget", len(evicted))

    def _hook(self, method: Callable[..., int], *args: Any) -> int:
        try:
            return int(method(*args))
        except Exception:
            # Accounting must not fail a call; such a drafter's state just counts as nothing.
            log.exception("%s.%s failed", type(self.drafter).__name__, method.__name__)
            return 0

    def _forget(self, key: Key, reason: ReleaseReason) -> None:
        try:
            if self._release_takes_reason:
                self.drafter.on_release(key, reason)
            else:
                self.drafter.on_release(key)
        except Exception:
            # The SDK's state is gone either way; a failing cleanup must not fail the call.
            log.exception("%s.on_release(%r) failed", type(self.drafter).__name__, key)


@dataclass
class _Call:
    """A PrepareDraftTokens call with its deltas applied, waiting for its drafts."""

    results: list[drafter_pb2.DraftResult | None]  # one a sequence; None where a draft is to come
    batch: list[DraftRequest]  # the sequences in sync, to draft for
    slots: list[int]  # where each of batch's drafts goes in results

    def answer(self, drafts: list[tuple[list[int], list[int]]]) -> drafter_pb2.PrepareDraftTokensResponse:
        for slot, req, (draft, parents) in zip(self.slots, self.batch, drafts):
            self.results[slot] = drafter_pb2.DraftResult(request_id=req.request_id, status=_OK, draft_tokens=draft,
                                                         draft_parents=parents)
        return drafter_pb2.PrepareDraftTokensResponse(results=self.results)


async def _until(stop: asyncio.Future[Any], items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items` until they end or `stop` is done, also while waiting for the next one (a stream
    that is idle between a verifier's steps)."""
    iterator = aiter(items)
    while not stop.done():
        step = asyncio.ensure_future(anext(iterator))
        try:
            await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():
                step.cancel()  # stopped, or the call itself was cancelled
            elif not step.cancelled():
                step.exception()  # read, also when the call was cancelled meanwhile
        if not step.done() or step.cancelled() or isinstance(step.exception(), StopAsyncIteration):
            return
        yield step.result()


def namespace(verifier_id: str, caller: str) -> str:
    """The namespace of a call: its verifier_id, qualified by the caller's identity when the call
    carries one (a named token, a client certificate), so that an authenticated client cannot
    reach another's sequences by sending the same verifier_id."""
    return f"{verifier_id}@{caller}" if caller else verifier_id


def _takes_reason(drafter: Drafter) -> bool:
    """Whether the drafter's on_release takes a reason (drafters written before reasons take only the key)."""
    try:
        inspect.signature(drafter.on_release).bind(("", ""), ReleaseReason.UNSPECIFIED)
    except TypeError:
        return False
    return True


def _reason(value: int) -> ReleaseReason:
    """A wire ReleaseReason; a value this SDK does not know (a newer verifier's) is UNSPECIFIED."""
    try:
        return ReleaseReason(value)
    except ValueError:
        return ReleaseReason.UNSPECIFIED
