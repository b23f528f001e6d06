"""Continuous batching: who waits, who runs, and what each step runs.

`schedule()` returns a `StepPlan` (who is prefilled, who decodes, how many draft
tokens each may verify); `update()` takes the plan back with the tokens the step
produced and commits them. Admission is bounded by free KV slots and
`max_num_seqs`; the waiting queue by `max_queue_len`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from verifier_service.engine import tree_verify
from verifier_service.engine.sampler import VerifyRow
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.model.kv_cache import KVCache
from verifier_service.model.runner import ForwardBatch
from verifier_service.spec.policy import SpeculationPolicy


class QueueFullError(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


@dataclass
class StepPlan:
    """One step. The forward packs every prefill's whole prompt, then every decode's last
    committed token (not in its KV slot yet) followed by its draft."""

    prefills: list[Sequence]  # admitted this step
    decodes: list[Sequence]  # running since an earlier step
    draft_lens: list[int]  # per decode: draft tokens to verify
    # Per decode: draft tokens to ask the drafter for (>= draft_lens; the rest is a shadow
    # draft, scored against what the target produces but never verified).
    draft_asks: list[int]
    released: list[Sequence]  # cancelled since the last step: their slots are free already
    drafts: list[list[int]] = field(default_factory=list)  # per decode, filled in by the engine
    shadows: list[list[int]] = field(default_factory=list)  # per decode, filled in by the engine
    # Per decode, filled in by the engine: its draft's token-tree parents ([] = a chain).
    parents: list[list[int]] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return self.prefills + self.decodes

    def forward_batch(self) -> ForwardBatch:
        ids: list[int] = []
        logit_index: list[int] = []
        for seq in self.prefills:  # a prompt needs logits at its last token only
            ids += seq.prompt_ids
            logit_index.append(len(ids) - 1)
        for seq, draft in zip(self.decodes, self.drafts):  # logits at the last token and every draft token
            first = len(ids)
            ids += [seq.last_token, *draft]
            logit_index += range(first, len(ids))
        batch = ForwardBatch(
            input_ids=ids, slots=[s.slot for s in self.sequences],
            starts=[0] * len(self.prefills) + [s.num_cached_tokens for s in self.decodes],
            lengths=[len(s.prompt_ids) for s in self.prefills] + [len(d) + 1 for d in self.drafts],
            logit_index=logit_index)
        batch.kv_moves = [(s.slot, a, b) for s in self.decodes for a, b in s.kv_moves]
        if any(self.tree_parents):
            batch.parents = [p for s in self.prefills for p in range(-1, len(s.prompt_ids) - 1)]
            for draft, parents in zip(self.drafts, self.tree_parents):
                batch.parents += tree_verify.row_parents(parents or range(-1, len(draft) - 1))
        return batch

    @property
    def tree_parents(self) -> list[list[int]]:
        """Per decode, its token tree's parents ([] = a chain)."""
        return self.parents or [[] for _ in self.decodes]

    def verify_rows(self) -> list[VerifyRow]:
        """How to turn each sequence's logits (laid out as in forward_batch) into tokens."""
        return ([VerifyRow([], s.sampling, s.generator) for s in self.prefills]
                + [VerifyRow(d, s.sampling, s.generator, p)
                   for s, d, p in zip(self.decodes, self.drafts, self.tree_parents)])


@dataclass
class Scheduler:
    kv_cache: KVCache
    policy: SpeculationPolicy
    max_num_seqs: int
    max_queue_len: int
    max_model_len: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # oldest first

    def add(self, seq: Sequence) -> None:
        # Waiting sequences that free slots will take at the next step boundary are
        # not queued for capacity: only the rest count against the queue limit.
        free = max(0, min(self.kv_cache.num_free_slots, self.max_num_seqs - len(self.running)))
        if len(self.waiting) >= self.max_queue_len + free:
            raise QueueFullError(
                f"server busy: {len(self.running)} running and {len(self.waiting)} queued "
                f"(--max-queue-len {self.max_queue_len}); retry later")
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """At a step boundary: drop the cancelled, admit into free slots, size every draft."""
        released = [s for s in self.running if s.cancelled]
        for seq in released:
            self._finish(seq)
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        decodes = list(self.running)
        prefills: list[Sequence] = []
        while self.waiting and self.kv_cache.num_free_slots and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            self.running.append(seq)
            prefills.append(seq)
        lengths, asks = self.policy.plan([s.spec for s in decodes],
                                         [s.draft_room(self.max_model_len) for s in decodes])
        return StepPlan(prefills, decodes, lengths, asks, released)

    def update(self, plan: StepPlan, new_tokens: list[list[int]]) -> list[Sequence]:
        """Commit each sequence's new tokens (accepted draft tokens, then the target's own),
        emit them, and learn from the drafts; return the sequences that finished (slots freed).

        The rejected draft positions of a sequence's slot need no rollback: its valid length is
        its committed length, and the next step writes over them."""
        for seq, draft, parents, shadow, tokens in zip(plan.decodes, plan.drafts, plan.tree_parents, plan.shadows,
                                                       new_tokens[len(plan.prefills):]):
            accepted = len(tokens) - 1
            depth = tree_verify.depth(draft, parents)
            seq.stats.record(depth, accepted, len(draft))
            self.policy.observe(seq.spec, depth, accepted)
            self.policy.observe_tree(seq.spec, draft, parents, tokens)
            self.policy.observe_shadow(seq.spec, shadow, tokens[0])
            seq.kv_moves = tree_verify.accepted_moves(seq.num_cached_tokens, draft, parents, tokens)
        finished = []
        for seq, tokens in zip(plan.sequences, new_tokens):
            if seq.cancelled:  # cancelled mid-step: dropped at the next boundary
                continue
            seq.emit(seq.append_tokens(tokens, self.max_model_len))
            if seq.finished:
                finished.append(seq)
        for seq in finished:
            self._finish(seq)
        return finished

    def fail_running(self, error: str) -> list[Sequence]:
        """The step failed: end every running sequence with `error`; return them (slots freed)."""
        failed = list(self.running)
        for seq in failed:
            seq.outputs.put_nowait(Output([], "", error=error))
            self._finish(seq)
        return failed

    def _finish(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.CANCELLED
        self.running.remove(seq)
        self.kv_cache.free(seq.slot)
        seq.slot = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        """Share of the cache's token capacity holding live entries."""
        return sum(s.num_cached_tokens for s in self.running) / self.kv_cache.capacity_tokens

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
