"""Continuous batching: who waits, who runs, and what each step runs.

`schedule()` returns a `StepPlan` (who is prefilled, who decodes, how many draft
tokens each may verify); `update()` takes the plan back with the tokens the step
produced and commits them. Admission is bounded by free KV slots and
`max_num_seqs`; the waiting queue by `max_queue_len`.

Chunked prefill: a step carries at most `max_num_batched_tokens` tokens. The running
sequences' decode and verify rows come first; prompts fill what is left, oldest
first, a chunk per step, so a long prompt no longer stalls every stream for its
whole prefill. Only a prompt's last chunk asks for logits (its first token), unless the
request asked for its prompt's log-probabilities: then every position's, its chunks at most
PROMPT_LOGPROBS_CHUNK tokens (a chunk's logits are that many vocabulary-wide rows).
A step in which no sequence decodes may carry up to `max_idle_batched_tokens`
instead: chunks there would protect no stream and only delay the prompt's first
token (each chunk pays the weights' streaming once more).

A prompt token late in a long prompt costs more than one early in it: it attends to
every token before it. Where the budget is the default one (read from forward costs
timed after a short context), a prompt token counts as `prompt_token_cost(context)`
budget tokens, 1 plus a measured share per cached key beyond that short context, so a
late chunk is smaller and a step costs about the same all through a long prompt.

Prefix caching (engine/prefix_cache.py) gives an admitted prompt the slot and the
positions it can reuse; its prefill starts after them.

Priority scheduling (`by_priority`, vLLM's `--scheduling-policy priority`): the waiting
sequence with the smallest (priority, arrival) is admitted first, and where it finds no
room, the running sequence with the largest is preempted for it: its slot is released
with its blocks kept in the prefix cache, it waits again in its old place, and when
readmitted recomputes its committed tokens' KV as a prefill (where nothing took its kept
slot meanwhile, it takes it back by reference and recomputes only what follows its last
full block). A sequence is preempted only for one strictly before it in that order, so
preemptions cannot cycle.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from verifier_service.engine import tree_verify
from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.engine.sampler import TokenLogprob, VerifyRow
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.model.kv_cache import KVCache
from verifier_service.model.runner import ForwardBatch
from verifier_service.spec_decode.planner import FREE_CALLS, StepPrice
from verifier_service.spec_decode.policy import SpeculationPolicy

PROMPT_LOGPROBS_CHUNK = 512


@dataclass(frozen=True)
class PromptTokenCost:
    """Budget tokens one prompt token counts for: 1, plus `per_key` for every cached key it attends to
    beyond the first `free_keys` (the context the budget's forward costs were timed after)."""

    per_key: float = 0.0
    free_keys: int = 0

    def __call__(self, context: int) -> float:
        """For a token of a chunk starting after `context` cached tokens. (Each of a chunk's tokens
        attends to its own position's keys; against a chunk of the same size after `free_keys`, every
        one of them sees context - free_keys more.)"""
        return 1.0 + self.per_key * max(0, context - self.free_keys)


FLAT = PromptTokenCost()


class QueueFullError(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


@dataclass
class StepPlan:
    """One step. The forward packs every prefill's chunk of its prompt, then every decode's last
    committed token (not in its KV slot yet) followed by its draft."""

    prefills: list[Sequence]  # prefilling: a chunk of each prompt this step
    decodes: list[Sequence]  # running since an earlier step
    draft_lens: list[int]  # per decode: draft tokens to verify
    # Per decode: draft tokens to ask the drafter for (>= draft_lens; the rest is a shadow
    # draft, scored against what the target produces but never verified).
    draft_asks: list[int]
    released: list[Sequence]  # cancelled since the last step: their slots are free already
    preempted: list[Sequence] = field(default_factory=list)  # sent back to wait for a higher priority
    call_saved: bool = False  # no drafter call: the planner found it would cost more than drafts gain
    drafts: list[list[int]] = field(default_factory=list)  # per decode, filled in by the engine
    shadows: list[list[int]] = field(default_factory=list)  # per decode, filled in by the engine
    # Per decode, filled in by the engine: its draft's token-tree parents ([] = a chain).
    parents: list[list[int]] = field(default_factory=list)
    # Per decode, filled in by the engine: the draft its request's prediction gave ([] = none; then
    # its draft, if any, is the drafter's).
    predicted: list[list[int]] = field(default_factory=list)
    # Per sequence (prefills first), the emitted tokens' log-probabilities, None where not asked for;
    # filled in by the engine with the step's tokens.
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    # Per prefill, filled in by the engine: its chunk's prompt_logprob_targets' log-probabilities.
    prompt_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # per prefill: prompt tokens computed (default: the rest)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # cached prefixes to copy first
    # Filled in by Scheduler.update: what each sequence receives from this step (the engine hands
    # them to the servers' loop in one go).
    outputs: list[tuple[Sequence, Output]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chunks = self.chunks or [len(s.prefill_ids) - s.num_prefilled for s in self.prefills]
        self.predicted = self.predicted or [[] for _ in self.decodes]

    @property
    def drafter_asks(self) -> list[int]:
        """Per decode: draft tokens to ask the drafter for (draft_asks), none where its request's prediction
        drafts (`predicted`). The planner still counts those asks as answered by the prediction."""
        return [0 if p else a for p, a in zip(self.predicted, self.draft_asks)]

    @property
    def finishing(self) -> list[bool]:
        """Per prefill: does its chunk end the prompt (so it yields the first token)? A recompute's
        last chunk yields none: its next token comes from its next decode row."""
        return [not s.recompute and s.num_prefilled + n == len(s.prompt_ids)
                for s, n in zip(self.prefills, self.chunks)]

    @property
    def sequences(self) -> list[Sequence]:
        return self.prefills + self.decodes

    def prompt_logprob_targets(self) -> list[list[int] | None]:
        """Per prefill: the prompt tokens its chunk's positions predict, where the request asked for their
        log-probabilities (else None). A prompt's last position predicts the first new token instead."""
        return [s.prompt_ids[s.num_prefilled + 1:s.num_prefilled + n + 1]
                if s.prompt_logprobs is not None and not s.recompute else None
                for s, n in zip(self.prefills, self.chunks)]

    def forward_batch(self) -> ForwardBatch:
        """The packed forward. Its logits: the verify rows' (verify_rows), then the prompt positions of
        prompt_logprob_targets."""
        ids: list[int] = []
        logit_index: list[int] = []
        prompt_index: list[int] = []
        for seq, n, last, targets in zip(self.prefills, self.chunks, self.finishing, self.prompt_logprob_targets()):
            first = len(ids)
            ids += seq.prefill_ids[seq.num_prefilled:seq.num_prefilled + n]
            if last:  # a prompt needs logits at its last token only ...
                logit_index.append(len(ids) - 1)
            if targets is not None:  # ... unless its own tokens' log-probabilities were asked for
                prompt_index += range(first, first + len(targets))
        for seq, draft in zip(self.decodes, self.drafts):  # logits at the last token and every draft token
            first = len(ids)
            ids += [seq.last_token, *draft]
            logit_index += range(first, len(ids))
        batch = ForwardBatch(
            input_ids=ids, slots=[s.slot for s in self.sequences],
            starts=[s.num_prefilled for s in self.prefills] + [s.num_cached_tokens for s in self.decodes],
            lengths=self.chunks + [len(d) + 1 for d in self.drafts],
            logit_index=logit_index + prompt_index, copies=self.copies)
        batch.kv_moves = [(s.slot, a, b) for s in self.decodes for a, b in s.kv_moves]
        if any(self.tree_parents):
            batch.parents = [p for n in self.chunks for p in range(-1, n - 1)]
            for draft, parents in zip(self.drafts, self.tree_parents):
                batch.parents += tree_verify.row_parents(parents or range(-1, len(draft) - 1))
        return batch

    @property
    def tree_parents(self) -> list[list[int]]:
        """Per decode, its token tree's parents ([] = a chain)."""
        return self.parents or [[] for _ in self.decodes]

    def verify_rows(self) -> list[VerifyRow]:
        """How to turn each sequence's logits (laid out as in forward_batch) into tokens."""
        return ([VerifyRow([], s.sampling, s.generator, [], s.prompt_ids, s.output_ids, *s.held_stops(), s.grammar,
                           s.logits_state) for s, last in zip(self.prefills, self.finishing) if last]
                + [VerifyRow(d, s.sampling, s.generator, p, s.prompt_ids, s.output_ids, *s.held_stops(), s.grammar,
                             s.logits_state) for s, d, p in zip(self.decodes, self.drafts, self.tree_parents)])

    def spread(self, per_row: list) -> list:
        """Results per verify row (new tokens, log-probabilities) -> per sequence: [] for a prefill whose
        chunk does not end its prompt (it has no row)."""
        rows = iter(per_row)
        return [next(rows) if last else [] for last in self.finishing] + list(rows)


@dataclass
class Scheduler:
    kv_cache: KVCache
    policy: SpeculationPolicy
    max_num_seqs: int
    max_queue_len: int
    max_model_len: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # oldest first
    max_num_batched_tokens: int | None = None  # None: whole prompts in one step
    max_idle_batched_tokens: int | None = None  # a step with no decode rows; None: max_num_batched_tokens
    prefix_cache: PrefixCache | None = None  # None: no reuse (a plain slot allocator)
    # What a prompt token counts against max_num_batched_tokens (FLAT: 1, a budget given in tokens).
    prompt_token_cost: PromptTokenCost = FLAT
    by_priority: bool = False  # priority scheduling with preemption; False: first come, first served
    _arrivals: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.kv_cache, enabled=False)

    def add(self, seq: Sequence) -> None:
        # Waiting sequences that free slots will take at the next step boundary are
        # not queued for capacity: only the rest count against the queue limit.
        free = max(0, min(self.prefix_cache.num_available, self.max_num_seqs - len(self.running)))
        if len(self.waiting) >= self.max_queue_len + free:
            raise QueueFullError(
                f"server busy: {len(self.running)} running and {len(self.waiting)} queued "
                f"(--max-queue-len {self.max_queue_len}); retry later")
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def schedule(self, price: StepPrice = FREE_CALLS,
                 drafter_sees: Callable[[Sequence], bool] = lambda seq: True) -> StepPlan:
        """At a step boundary: drop the cancelled, admit into free slots, size every draft (weighing
        the step's costs beside its forward, `price`, as the engine measured them). A sequence the
        drafter is not sent (`drafter_sees` false: a cache salt it does not keep apart) drafts only
        from its request's prediction."""
        released = [s for s in self.running if s.cancelled]
        for seq in released:
            self._finish(seq)
        for seq in self.waiting:
            if seq.cancelled and seq.num_preemptions:  # it ran: its drafter holds its context
                seq.finish_reason = FinishReason.CANCELLED
                released.append(seq)
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        preempted = self._preempt() if self.by_priority else []
        decodes = [s for s in self.running if not s.prefilling]
        calls = [s.prediction is None or not s.prediction.drafts(s.output_ids) for s in decodes]  # else it drafts
        # No room for a draft no one would give: planned, it would be asked for and never come.
        rooms = [s.draft_room(self.max_model_len) if not c or drafter_sees(s) else 0 for s, c in zip(decodes, calls)]
        sizes = self.policy.plan([s.spec for s in decodes], rooms, price, calls)
        budget: float = self._prefill_budget(sum(sizes.lengths) + len(decodes))
        # Where nothing decodes, no stream waits on the step: prompt tokens count as themselves.
        cost = self.prompt_token_cost if decodes else FLAT
        prefills, chunks, copies = [], [], []
        partial = iter([s for s in self.running if s.prefilling])  # prompts part-way first, then new ones
        while budget > 0 and (seq := next(partial, None) or self._admit(copies)) is not None:
            prefills.append(seq)
            chunks.append(_chunk(seq, budget, cost))
            budget -= chunks[-1] * cost(seq.num_prefilled)
        return StepPlan(prefills, decodes, sizes.lengths, sizes.asks, released, preempted, sizes.call_saved,
                        chunks=chunks, copies=copies)

    def _has_room(self) -> bool:
        return bool(self.prefix_cache.num_available and len(self.running) < self.max_num_seqs)

    def _next_waiting(self) -> Sequence:
        if not self.by_priority:
            return self.waiting[0]
        return min(self.waiting, key=lambda s: s.scheduling_key)

    def _preempt(self) -> list[Sequence]:
        """Free room for waiting sequences that come before running ones: the last running in
        (priority, arrival) order goes back to wait, its slot's blocks kept in the prefix cache."""
        preempted = []
        while self.waiting and self.running and not self._has_room():
            victim = max(self.running, key=lambda s: s.scheduling_key)
            if victim.scheduling_key < self._next_waiting().scheduling_key:
                break
            self.running.remove(victim)
            # Pending tree moves leave the positions from the first one unregistered: only valid blocks are kept.
            self.prefix_cache.release(victim.slot, keep=True)
            victim.preempt()
            self.waiting.append(victim)
            preempted.append(victim)
        return preempted

    def _admit(self, copies: list[tuple[int, int, int]]) -> Sequence | None:
        """The next waiting sequence, in a free slot with its prompt's cached prefix (a copy to make
        goes to `copies`); None while none waits or no slot is free."""
        if not (self.waiting and self._has_room()):
            return None
        seq = self._next_waiting()
        self.waiting.remove(seq)
        # Every prompt position of a request for prompt log-probabilities is computed: nothing reused
        # (a recompute's are computed already). A preempted sequence taking back its own tokens is not
        # a prefix-cache query, nor a hit.
        first = not seq.num_preemptions
        seq.slot, seq.num_prefilled, copy = self.prefix_cache.acquire(
            seq.prefill_ids, seq.cache_root, reuse=seq.prompt_logprobs is None or seq.recompute, counted=first)
        if first:
            seq.cached_prompt_tokens, seq.admitted_at = seq.num_prefilled, time.perf_counter()
        if copy is not None:
            copies.append(copy)
        self.running.append(seq)
        return seq

    def _prefill_budget(self, decode_tokens: int) -> int:
        """Prompt tokens this step may carry beside `decode_tokens` of decode and verify rows (0: no
        sequence decodes, the idle budget applies). Prompts always get some (at least 16, or the whole
        budget if smaller), however many decode."""
        if decode_tokens == 0 and self.max_idle_batched_tokens is not None:
            return self.max_idle_batched_tokens
        if self.max_num_batched_tokens is None:
            return 1 << 62
        return max(self.max_num_batched_tokens - decode_tokens, min(self.max_num_batched_tokens, 16))

    def update(self, plan: StepPlan, new_tokens: list[list[int]]) -> list[Sequence]:
        """Commit each sequence's new tokens (accepted draft tokens, then the target's own), put
        their outputs in `plan.outputs`, and learn from the drafts; return the sequences that
        finished (slots freed).

        The rejected draft positions of a sequence's slot need no rollback: its valid length is
        its committed length, and the next step writes over them."""
        for seq, draft, parents, shadow, ask, tokens, predicted in zip(
                plan.decodes, plan.drafts, plan.tree_parents, plan.shadows, plan.draft_asks,
                new_tokens[len(plan.prefills):], plan.predicted):
            from_prediction = bool(predicted)
            accepted = len(tokens) - 1
            depth = tree_verify.depth(draft, parents)
            seq.stats.record(depth, accepted, len(draft))
            if from_prediction:
                seq.stats.record_prediction(len(draft), accepted)
            self.policy.observe(seq.spec, depth, accepted, by_drafter=not from_prediction)
            self.policy.observe_tree(seq.spec, draft, parents, tokens)
            self.policy.observe_shadow(seq.spec, shadow, tokens[0])
            self.policy.observe_answer(seq.spec, ask, draft or shadow)
            seq.kv_moves = tree_verify.accepted_moves(seq.num_cached_tokens, draft, parents, tokens)
        for seq, n, logprobs in zip(plan.prefills, plan.chunks, plan.prompt_logprobs or [None] * len(plan.prefills)):
            seq.add_prefilled(n)  # its KV is written, cancelled or not
            seq.prompt_token_logprobs += logprobs or []
        finished = []
        logprobs = plan.logprobs or [None] * len(new_tokens)
        for i, (seq, tokens, token_logprobs) in enumerate(zip(plan.sequences, new_tokens, logprobs)):
            # Cancelled mid-step: dropped at the next boundary. A prefill chunk short of the prompt's end
            # emits nothing.
            if not seq.cancelled and tokens:
                num_drafted = len(tokens) - 1 if i >= len(plan.prefills) else 0  # all but the target's own
                kept = seq.append_tokens(tokens, self.max_model_len, num_drafted, token_logprobs or None)
                plan.outputs.append((seq, seq.emit(kept)))
                if seq.finished:
                    finished.append(seq)
            # An accepted tree path's K/V reach their positions at the sequence's next forward: the
            # positions from the first move on are not yet what the tokens say, so not yet shareable.
            valid = min(seq.kv_len, *(to for _, to in seq.kv_moves)) if seq.kv_moves else seq.kv_len
            self.prefix_cache.extend(seq.slot, seq.prompt_ids, seq.output_ids, valid, seq.cache_root)
        for seq in finished:
            self._finish(seq)
        return finished

    def fail_running(self) -> list[Sequence]:
        """The step failed: end every running sequence; return them (slots freed)."""
        failed = list(self.running)
        for seq in failed:
            self._finish(seq, keep=False)
        self.prefix_cache.clear()  # a failed step may have left any slot half-written
        return failed

    def _finish(self, seq: Sequence, keep: bool = True) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.CANCELLED
        self.running.remove(seq)
        self.prefix_cache.release(seq.slot, keep)
        seq.slot = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        """Share of the cache's token capacity holding live entries."""
        return sum(s.kv_len for s in self.running) / self.kv_cache.capacity_tokens

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


def _chunk(seq: Sequence, budget: float, cost: PromptTokenCost) -> int:
    """Prompt tokens `seq` prefills this step, within the step's `budget` (at least one: every
    prompt given a turn moves on)."""
    left = len(seq.prefill_ids) - seq.num_prefilled
    fits = max(1, math.floor(budget / cost(seq.num_prefilled)))
    return min(left, fits, PROMPT_LOGPROBS_CHUNK if seq.prompt_logprobs is not None and not seq.recompute else left)
