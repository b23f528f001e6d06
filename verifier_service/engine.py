"""The decoding loop: schedule, draft, one batched verify forward, accept, roll back, emit.

Runs as an asyncio task beside the gRPC server; the drafter call is awaited on
the event loop and the model work runs in one worker thread so the server keeps
answering (health, new requests, cancellations) during a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from drafter_sdk.client import DrafterClient, DraftQuery
from verifier_service.kv_cache import KVCache
from verifier_service.model_runner import ForwardBatch, ModelRunner
from verifier_service.sampler import VerifyRow, verify_batch
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import FinishReason, Output, Sequence
from verifier_service.spec_policy import SpeculationPolicy

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Figures of the last steps, for metrics and the benchmark."""

    steps: int = 0
    prefills: int = 0
    forward_s: float = 0.0
    draft_s: float = 0.0


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, policy: SpeculationPolicy,
                 drafter: DrafterClient | None, max_model_len: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.policy = policy
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.stats = StepStats()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
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
        for seq in self.scheduler.drop_cancelled():
            self._forget(seq)
        admitted = self.scheduler.admit()
        if admitted:
            await self._prefill(admitted)
        running = [s for s in self.scheduler.running() if s not in admitted]
        if running:
            await self._decode(running)

    async def _prefill(self, seqs: list[Sequence]) -> None:
        first = self.kv_cache.slot_of(seqs[0].request_id)
        length = max(len(s.prompt_ids) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, :len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids)
        last = torch.tensor([row * length + len(s.prompt_ids) - 1 for row, s in enumerate(seqs)])
        batch = self._batch(first, ids, torch.zeros(len(seqs), dtype=torch.long), last)
        rows = [VerifyRow([], s.sampling, s.generator) for s in seqs]
        new_tokens, _ = await self._forward(batch, rows)
        self.stats.prefills += 1
        self._commit_all(seqs, new_tokens)

    async def _decode(self, seqs: list[Sequence]) -> None:
        started = time.perf_counter()
        lengths = [self.policy.draft_len(s, len(seqs), self.max_model_len) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        if self.drafter is not None and any(lengths):
            reply = await self.drafter.propose([
                DraftQuery(s.request_id, s.all_ids, len(s.prompt_ids), k, s.last_num_drafted,
                           s.last_num_accepted, s.sampling.temperature, s.sampling.top_p, s.sampling.top_k)
                for s, k in zip(seqs, lengths)])
            drafts = reply.drafts
            for seq, failed in zip(seqs, reply.failed):
                seq.stats.num_drafter_failures += failed
        draft_s = time.perf_counter() - started
        width = 1 + max(len(d) for d in drafts)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        index: list[int] = []
        for row, (seq, draft) in enumerate(zip(seqs, drafts)):
            ids[row, :1 + len(draft)] = torch.tensor([seq.all_ids[-1], *draft])
            index.extend(range(row * width, row * width + len(draft) + 1))
        starts = torch.tensor([s.num_tokens - 1 for s in seqs])
        first = self.kv_cache.slot_of(seqs[0].request_id)
        batch = self._batch(first, ids, starts, torch.tensor(index))
        rows = [VerifyRow(d, s.sampling, s.generator) for s, d in zip(seqs, drafts)]
        new_tokens, forward_s = await self._forward(batch, rows)
        self.stats.steps += 1
        self.stats.forward_s += forward_s
        self.stats.draft_s += draft_s
        for seq, draft, tokens in zip(seqs, drafts, new_tokens):
            accepted = len(tokens) - 1
            seq.stats.record(len(draft), accepted)
            self.policy.observe(seq, len(draft), accepted)
            seq.last_num_drafted, seq.last_num_accepted = len(draft), accepted
        self._commit_all(seqs, new_tokens)

    def _batch(self, first: int, ids: torch.Tensor, starts: torch.Tensor, index: torch.Tensor) -> ForwardBatch:
        device = self.runner.device
        return ForwardBatch(first, ids.to(device), starts.to(device), index.to(device))

    async def _forward(self, batch: ForwardBatch, rows: list[VerifyRow]) -> tuple[list[list[int]], float]:
        def work() -> tuple[list[list[int]], float]:
            started = time.perf_counter()
            logits = self.runner.forward(batch)
            return verify_batch(logits, rows), time.perf_counter() - started
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def _commit_all(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> None:
        # Every row's KV length is committed before any finished sequence frees its
        # slot: freeing moves the last slot into the hole and copies only its
        # committed positions, so a row still at its old length would lose the
        # positions this step wrote (and decode on garbage afterwards).
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
