"""The decoding loop: schedule, draft, one batched verify forward, accept, roll back, emit.

Runs as an asyncio task beside the gRPC server; the drafter call is awaited on
the event loop and the model work runs in one worker thread so the server keeps
answering (health, new requests, cancellations) during a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor


from verifier_service.spec.drafter_client import DrafterClient, DraftQuery, DraftReply
from verifier_service.model import step_costs
from verifier_service.model.kv_cache import KVCache
from verifier_service.metrics import VerifierMetrics
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.engine.sampler import VerifyRow, verify_batch
from verifier_service.engine.scheduler import Scheduler
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.spec.policy import SpeculationPolicy

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, policy: SpeculationPolicy,
                 drafter: DrafterClient | None, max_model_len: int, model_thread: ThreadPoolExecutor,
                 metrics: VerifierMetrics | None = None) -> None:
        self.runner = runner
        self.metrics = metrics
        self.scheduler = scheduler
        self.policy = policy
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.decode_steps = 0
        self._wake = asyncio.Event()
        self._executor = model_thread  # all torch work: see build_runtime
        self._task: asyncio.Task[None] | None = None

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    async def start(self) -> None:
        """Measure what the runner and the policy need, then run the decoding loop in the background."""
        if self.policy.planner is not None or self.runner.layouts is not None:
            # In the model thread, before serving: each token count's linear layout and the
            # forward-cost curve the planner weighs draft lengths against.
            points = step_costs.probe_points(self.policy.max_draft_len,
                                             self.scheduler.max_num_seqs * (self.policy.max_draft_len + 1))
            seconds = await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: step_costs.tune_and_measure(self.runner, points))
            if self.policy.planner is not None:
                self.policy.planner.costs = step_costs.CostCurve.from_seconds(seconds)
                log.info("forward cost by tokens (x one token, %.1f ms): %s", 1000 * seconds[min(seconds)],
                         self.policy.planner.costs.describe())
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        self.runner.close()
        if self.drafter is not None:
            await self.drafter.close()

    def submit(self, seq: Sequence) -> None:
        """Queue a request (raises QueueFullError past the queue limit)."""
        self.scheduler.add(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: its KV is freed at the next step boundary."""
        if not seq.finished:
            seq.cancelled = True
            self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or OOM fails the running requests, not the server
                log.exception("engine step failed; failing the running requests")
                for seq in self.scheduler.running():
                    seq.outputs.put_nowait(Output([], "", error="internal error in the decoding step"))
                    self._finish(seq)

    async def step(self) -> None:
        """Admit, draft for the running sequences, then ONE forward over the new
        prompts (prefill) and every running sequence's last token plus its draft."""
        for seq in self.scheduler.drop_cancelled():
            self._forget(seq)
        admitted = self.scheduler.admit()
        running = [s for s in self.scheduler.running() if s not in admitted]
        if not admitted and not running:  # only cancelled requests were waiting: nothing to run
            return
        drafts, shadows, reply = await self._draft(running)
        ids: list[int] = []
        logit_index: list[int] = []
        for seq in admitted:  # a prompt needs logits at its last token only
            ids += seq.prompt_ids
            logit_index.append(len(ids) - 1)
        for seq, draft in zip(running, drafts):  # the last committed token is not in the KV cache yet
            first = len(ids)
            ids += [seq.last_token, *draft]
            logit_index += range(first, len(ids))
        seqs = admitted + running
        batch = ForwardBatch(
            ids, [self.kv_cache.slot_of(s.request_id) for s in seqs],
            [0] * len(admitted) + [s.num_tokens - 1 for s in running],
            [len(s.prompt_ids) for s in admitted] + [len(d) + 1 for d in drafts], logit_index)
        rows = ([VerifyRow([], s.sampling, s.generator) for s in admitted]
                + [VerifyRow(d, s.sampling, s.generator) for s, d in zip(running, drafts)])
        new_tokens = await self._forward(batch, rows)
        if running:
            self._record_decode(running, drafts, shadows, new_tokens[len(admitted):], reply)
        self._commit_all(seqs, new_tokens)

    async def _draft(self, seqs: list[Sequence]
                     ) -> tuple[list[list[int]], list[list[int]], DraftReply | None]:
        """One PrepareDraftTokens call covering every running sequence (draft length 0 included).

        Returns the drafts to verify, the shadow drafts (asked for but not verified), and the reply.
        """
        lengths, asks = self.policy.plan(seqs, self.max_model_len)
        none: list[list[int]] = [[] for _ in seqs]
        if self.drafter is None or not any(asks):
            return none, none, None
        reply = await self.drafter.propose([
            DraftQuery(s.request_id, s.all_ids, len(s.prompt_ids), k, s.last_num_drafted,
                       s.last_num_accepted, s.sampling.temperature, s.sampling.top_p, s.sampling.top_k)
            for s, k in zip(seqs, asks)])
        for seq, failed in zip(seqs, reply.failed):
            seq.stats.num_drafter_failures += failed
        drafts = [d[:k] for d, k in zip(reply.drafts, lengths)]
        shadows = [d if k == 0 else [] for d, k in zip(reply.drafts, lengths)]
        return drafts, shadows, reply

    def _record_decode(self, seqs: list[Sequence], drafts: list[list[int]], shadows: list[list[int]],
                       new_tokens: list[list[int]], reply: DraftReply | None) -> None:
        self.decode_steps += 1
        for seq, draft, shadow, tokens in zip(seqs, drafts, shadows, new_tokens):
            accepted = len(tokens) - 1
            seq.stats.record(len(draft), accepted)
            self.policy.observe(seq, len(draft), accepted)
            self.policy.observe_shadow(seq, shadow, tokens[0])
            seq.last_num_drafted, seq.last_num_accepted = len(draft), accepted
        if self.metrics is not None:
            self.metrics.observe_decode(seqs, [len(d) for d in drafts], [len(t) - 1 for t in new_tokens],
                                        reply, self.drafter)

    async def _forward(self, batch: ForwardBatch, rows: list[VerifyRow]) -> list[list[int]]:
        def work() -> list[list[int]]:
            return verify_batch(self.runner.forward(batch), rows)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def _commit_all(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> None:
        # Commit every row before freeing any finished sequence's slot.
        finished = [seq for seq, tokens in zip(seqs, new_tokens) if self._commit(seq, tokens)]
        for seq in finished:
            self._finish(seq)

    def _commit(self, seq: Sequence, tokens: list[int]) -> bool:
        """Append and emit the tokens; True when the sequence finished (its slot is not freed yet)."""
        if seq.cancelled:  # cancelled mid-step: drop at the next boundary
            return False
        kept = seq.append_tokens(tokens, self.max_model_len)
        seq.emit(kept)
        if seq.finished:
            return True
        # Positions past the accepted tokens hold rejected drafts: roll back.
        self.kv_cache.set_length(self.kv_cache.slot_of(seq.request_id), seq.num_tokens - 1)
        return False

    def _finish(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.CANCELLED
        self.scheduler.finish(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.policy.forget(seq.request_id)
        if self.drafter is not None:
            self.drafter.release([seq.request_id])
