"""The decoding loop. Each step: schedule, run (draft and verify in one batched forward), commit.

The loop runs on the model thread's own event loop (engine/model_thread.py), so a step makes
no thread hand-off: the scheduler plans, the drafter is called (in-process: inline; remote:
the gRPC call is sent and awaited from the model thread, or, where the drafter looks ahead and
the rest of its last chain covers the step's drafts, read after the forward: spec_decode/lookahead.py),
the forward and verification run inline, and the scheduler commits. What crosses to the
servers' event loop is the step's outputs, handed over once per step (`call_soon_threadsafe`),
and what comes back is new requests and cancellations (`submit`, `cancel`, under one lock with
the scheduler's own boundaries). The servers keep answering (health, new requests,
cancellations) during a forward.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from drafter_sdk.proto import drafter_pb2
from verifier_service.engine import tree_verify
from verifier_service.engine.logits_processors import cut_banned, process_logits
from verifier_service.engine.model_thread import ModelThread
from verifier_service.engine.sampler import TokenLogprob, prompt_token_logprobs, token_logprobs, verify_batch
from verifier_service.engine.scheduler import Scheduler, StepPlan
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.engine.step_clock import StepClock
from verifier_service.metrics import VerifierMetrics
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.spec_decode import lookahead
from verifier_service.spec_decode.drafter_client import (
    DraftCall,
    DrafterClient,
    DraftQuery,
    DraftReply,
    ReleasedRequest,
)
from verifier_service.spec_decode.planner import FREE_CALLS, StepPrice

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, drafter: DrafterClient | None,
                 model_thread: ModelThread, metrics: VerifierMetrics | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.drafter = drafter
        self.metrics = metrics
        self._model_thread = model_thread  # every torch op of the verifier, and this loop, run here
        self.decode_steps = 0  # steps that decoded running sequences (not only prefills)
        # The scheduler's queues change on two threads: submit() on the servers' loop, the step's
        # boundaries (schedule, commit) on the model thread.
        self._lock = threading.Lock()
        self._wake = asyncio.Event()  # set on the model thread's loop only
        self._front: asyncio.AbstractEventLoop | None = None  # the servers' loop: outputs go there
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._forward_s = 0.0  # the last step's runner.forward
        self._drafter_s = 0.0  # the last step's time on drafter calls (reading one, sending or waiting for one)
        self._called = False  # whether the last step called the drafter (or read a call's answer)
        # What a step costs beside its forward, for the planner to price drafter calls against drafts.
        planner = scheduler.policy.planner
        self._clock = (StepClock(planner.costs, planner.one_token_s) if planner is not None and drafter is not None
                       else None)
        self._in_flight: InFlight | None = None  # the last step's drafter call, answered during its forward

    @property
    def step_price(self) -> StepPrice:
        """What a step costs beside its forward, as the planner prices it (FREE_CALLS without one)."""
        return self._clock.price() if self._clock is not None else FREE_CALLS

    def start(self) -> None:
        """Run the decoding loop on the model thread; outputs are delivered to the calling loop."""
        self._front = asyncio.get_running_loop()
        self._model_thread.run_coroutine(self._run()).add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Stop the loop and give the model back; later calls do nothing."""
        if self._stopped:
            return
        self._stopped = True
        await asyncio.wrap_future(self._model_thread.run_coroutine(self._shutdown()))
        self._model_thread.shutdown(wait=True)

    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.runner.close()
        if self.drafter is not None:
            await self.drafter.close()

    def submit(self, seq: Sequence) -> None:
        """Queue a request (raises QueueFullError past the queue limit). Any thread."""
        with self._lock:
            self.scheduler.add(seq)
        self._wake_up()

    def in_flight(self) -> list[Sequence]:
        """The running and the waiting sequences, as one step boundary left them. Any thread."""
        with self._lock:
            return [*self.scheduler.running, *self.scheduler.waiting]

    def cancel(self, seq: Sequence) -> None:
        """The client went away: its KV is freed at the next step boundary. Any thread."""
        if not seq.finished:
            seq.cancelled = True
            self._wake_up()

    def _wake_up(self) -> None:
        if self._front is None:  # not started (tests drive step() themselves)
            self._wake.set()
        else:
            self._model_thread.loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        previous: float | None = None  # start of the last step, while the loop keeps stepping
        while True:
            if not self.scheduler.has_work():
                previous = None
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            if previous is not None:
                # Per-step overhead: everything of a step period but the forward itself.
                outside = started - previous - self._forward_s
                if self.metrics is not None:
                    self.metrics.step_overhead.observe(outside)
                if self._clock is not None:
                    self._clock.step(outside, self._drafter_s, self._called)
            previous = started
            self._forward_s, self._drafter_s, self._called = 0.0, 0.0, False
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or OOM fails the running requests, not the server
                log.exception("engine step failed; failing the running requests")
                with self._lock:
                    failed = self.scheduler.fail_running()
                self._release(failed, failed=True)
                self._post([(s, Output([], "", error="internal error in the decoding step")) for s in failed])
            # Let calls queued on the model thread (tensor-parallel heartbeats, shutdown) run between steps.
            await asyncio.sleep(0)

    async def step(self) -> None:
        """Plan, draft and verify in ONE forward (new prompts, and every running sequence's last
        token plus its draft), commit."""
        price = self.step_price  # as the steps before this one measured it: the same for its plan and its trees
        with self._lock:
            plan = self.scheduler.schedule(price, self._drafter_sees)
        self._release(plan.released)
        if plan.preempted:
            log.debug("preempted for higher priority: %s", ", ".join(s.request_id for s in plan.preempted))
        if self.metrics is not None:
            cache = self.scheduler.prefix_cache
            self.metrics.observe_prefix_cache(cache.queries, cache.hits)
            self.metrics.num_preemptions.inc(len(plan.preempted))
        if not plan.sequences:  # only cancelled requests were waiting: nothing to run
            return
        started = time.perf_counter()
        _predict(plan)
        self._called = self._in_flight is not None or (self.drafter is not None and any(plan.drafter_asks))
        self._receive_in_flight()
        reply = await self._draft(plan, price)
        self._drafter_s = time.perf_counter() - started
        if self._called:
            for seq in plan.decodes:
                seq.stats.drafter_wait_s += self._drafter_s
        new_tokens, plan.logprobs = self._verify(plan)
        self._commit(plan, new_tokens, reply)

    def _drafter_sees(self, seq: Sequence) -> bool:
        """Whether the drafter is sent the sequence (DrafterClient.sees), where there is one."""
        return self.drafter is None or self.drafter.sees(seq.cache_salt_id)

    async def _draft(self, plan: StepPlan, price: StepPrice) -> DraftReply | None:
        """The plan's drafts to verify and its shadow drafts (asked for, not verified): a request's
        prediction's where it gave one (_predict), else the drafter's. Draft tokens a request's
        structured-output constraint refuses could never be accepted: they are cut, not verified.
        Returns the drafter's reply waited for, None if none was."""
        plan.drafts, plan.shadows, plan.parents = ([[] for _ in plan.decodes] for _ in range(3))
        reply = await self._call(plan, price) if self.drafter is not None and any(plan.drafter_asks) else None
        if any(plan.predicted):
            plan.drafts = [p[:k] if p else d for p, k, d in zip(plan.predicted, plan.draft_lens, plan.drafts)]
            plan.shadows = [(p if k == 0 else []) if p else s
                            for p, k, s in zip(plan.predicted, plan.draft_lens, plan.shadows)]
            plan.parents = [[] if p else q for p, q in zip(plan.predicted, plan.parents)]
        if any(s.grammar is not None or s.sampling.bans_tokens for s in plan.decodes):
            plan.drafts, plan.parents = map(list, zip(*[
                _cut_refused(s, d, p) for s, d, p in zip(plan.decodes, plan.drafts, plan.parents)]))
        return reply

    async def _call(self, plan: StepPlan, price: StepPrice) -> DraftReply | None:
        """One PrepareDraftTokens call covering every decoding sequence (draft length 0 included).

        Where the drafter looks ahead (spec_decode/lookahead.py) and what is left of every drafting
        sequence's last chain covers its draft, the step verifies those and does not wait for its
        call: the answer arrives during the forward and is read at the next step. Returns the
        reply waited for, None if none was."""
        assert self.drafter is not None
        none: list[list[int]] = [[] for _ in plan.decodes]
        # Token trees where the drafter drafts them: a tree's depth is its draft length (none for a
        # sequence its prediction drafts for).
        lens = [0 if p else k for p, k in zip(plan.predicted, plan.draft_lens)]
        nodes = (self.scheduler.policy.plan_nodes([s.spec for s in plan.decodes], lens, price)
                 if self.drafter.supports_trees else [0] * len(plan.decodes))
        ahead = self.drafter.looks_ahead and not any(nodes)
        asks = plan.drafter_asks
        if ahead:
            rooms = [s.draft_room(self.scheduler.max_model_len) for s in plan.decodes]
            asks = [max(a, lookahead.ask(k, room)) if a else 0 for a, k, room in zip(asks, plan.draft_lens, rooms)]
        queries = [DraftQuery(s.request_id, s.all_ids, len(s.prompt_ids), a, s.drafter_sync,
                              s.spec.last_num_drafted, s.spec.last_num_accepted, s.sampling.temperature,
                              s.sampling.top_p, s.sampling.top_k, m, s.cache_salt_id)
                   for s, a, m in zip(plan.decodes, asks, nodes)]
        bases = [len(s.output_ids) for s in plan.decodes]
        left = [s.lookahead.remaining(s.output_ids) if ahead and s.lookahead is not None else []
                for s in plan.decodes]
        reply: DraftReply | None = None
        if ahead and lookahead.covers(left, plan.draft_lens, asks):
            self._in_flight = InFlight(self.drafter.send(queries), plan.decodes, bases)
            drafts, parents = left, none
        else:
            reply = await self.drafter.propose(queries)
            _keep(plan.decodes, bases, reply, chains=ahead)
            drafts, parents = reply.drafts, reply.parents or none
        plan.parents = parents
        plan.drafts = [d if p else d[:k] for d, p, k in zip(drafts, parents, plan.draft_lens)]
        plan.shadows = [d if k == 0 else [] for d, k in zip(drafts, plan.draft_lens)]
        return reply

    def _receive_in_flight(self) -> None:
        """Read the answer to the last step's call, sent before its forward, and keep its chains."""
        if self._in_flight is not None:
            assert self.drafter is not None
            _keep(self._in_flight.sequences, self._in_flight.bases, self.drafter.receive(self._in_flight.call),
                  chains=True)
            self._in_flight = None

    def _verify(self, plan: StepPlan) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """The packed forward, the verification of every draft and the log-probabilities asked for
        (the prompts' go to the plan)."""
        rows = plan.verify_rows()
        logits = self._timed_forward(plan.forward_batch())
        verified = sum(len(row.draft) + 1 for row in rows)  # the prompt positions' logits come after
        plan.prompt_logprobs = prompt_token_logprobs(logits[verified:], plan.prompt_logprob_targets(),
                                                     [s.prompt_logprobs for s in plan.prefills])
        logits = logits[:verified]
        tokens = verify_batch(process_logits(logits, rows), rows)
        return plan.spread(tokens), plan.spread(token_logprobs(logits, rows, tokens))

    def _timed_forward(self, batch: ForwardBatch) -> torch.Tensor:
        started = time.perf_counter()
        logits = self.runner.forward(batch)
        self._forward_s = time.perf_counter() - started
        if self._clock is not None:
            self._clock.forward(self._forward_s, len(batch.input_ids))
        return logits

    def _commit(self, plan: StepPlan, new_tokens: list[list[int]], reply: DraftReply | None) -> None:
        with self._lock:
            finished = self.scheduler.update(plan, new_tokens)
        self.decode_steps += bool(plan.decodes)
        if self.metrics is not None and plan.decodes:
            stats = self.drafter.stats if self.drafter is not None else None
            self.metrics.observe_decode(
                [tree_verify.depth(d, p) for d, p in zip(plan.drafts, plan.tree_parents)],
                [len(t) - 1 for t in new_tokens[len(plan.prefills):]],
                {s.request_id for s in plan.decodes if s.spec.auto_disabled},
                (stats.calls, stats.failures, stats.skipped, stats.resyncs, stats.overlapped, stats.announced)
                if stats is not None
                else None,
                reply.latency_s if reply is not None else None, [len(d) for d in plan.drafts])
            if plan.call_saved:
                self.metrics.drafter_calls_saved.inc()
        self._release(finished)
        self._post(plan.outputs)  # last: a request sees its end once the engine is done with it

    def _post(self, outputs: list[tuple[Sequence, Output]]) -> None:
        """Hand a step's outputs to their requests' queues, on the servers' loop, in one hop."""
        if not outputs:
            return
        if self._front is None:  # not started: the caller's loop is the one stepping
            _deliver(outputs)
        else:
            self._front.call_soon_threadsafe(_deliver, outputs)

    def _release(self, seqs: list[Sequence], failed: bool = False) -> None:
        """The sequences left the engine (their slots are free): the drafter may drop their state,
        and learn from those that finished."""
        if self.drafter is not None and seqs:
            self.drafter.release([ReleasedRequest(s.request_id, _release_reason(s, failed), s.all_ids,
                                                  len(s.prompt_ids), s.drafter_sync, s.cache_salt_id) for s in seqs])


@dataclass
class InFlight:
    """A step's drafter call whose answer the step did not wait for."""

    call: DraftCall
    sequences: list[Sequence]
    bases: list[int]  # per sequence: its generated tokens when the call was sent


def _predict(plan: StepPlan) -> None:
    """Drafts from the requests' predictions (spec_decode/prediction.py), as long as the plan asks of
    their sequences (a shadow's where it verifies none): those sequences ask the drafter for nothing
    (StepPlan.drafter_asks)."""
    plan.predicted = [s.prediction.draft(s.output_ids, a) if s.prediction is not None and a else []
                      for s, a in zip(plan.decodes, plan.draft_asks)]


def _cut_refused(seq: Sequence, draft: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """The draft without the tokens the request's constraint or logits processors refuse where they
    stand: they could never be accepted, so they cost no verify row."""
    if seq.grammar is not None:
        draft, parents = seq.grammar.cut(draft, parents)
    return cut_banned(draft, parents, seq.sampling, seq.output_ids, seq.logits_state)


def _keep(seqs: list[Sequence], bases: list[int], reply: DraftReply, chains: bool) -> None:
    """Count each sequence's drafter failures; with `chains` (the drafter looks ahead), keep its chain
    (not a tree) for the next step."""
    parents = reply.parents or [[] for _ in seqs]
    for seq, base, draft, tree, failed in zip(seqs, bases, reply.drafts, parents, reply.failed):
        seq.lookahead = lookahead.Lookahead(base, draft) if chains and draft and not tree else None
        seq.stats.num_drafter_failures += failed


def _log_crash(loop: Future[None]) -> None:
    if not loop.cancelled() and loop.exception() is not None:
        log.critical("the engine's loop stopped", exc_info=loop.exception())


def _deliver(outputs: list[tuple[Sequence, Output]]) -> None:
    for seq, out in outputs:
        seq.outputs.put_nowait(out)


def _release_reason(seq: Sequence, failed: bool) -> int:
    if failed:
        return drafter_pb2.RELEASE_REASON_EVICTED
    if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return drafter_pb2.RELEASE_REASON_FINISHED
    return drafter_pb2.RELEASE_REASON_CANCELLED
