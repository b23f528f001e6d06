"""One request inside the engine, with everything kept for it: tokens, stopping, its KV slot,
its speculation state, what its drafter holds, its stats and its output queue. Forgetting a
request is dropping this object (and freeing its slot)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import torch

from verifier_service.engine.detokenizer import Detokenizer
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.sampler import SamplingParams, TokenLogprob
from verifier_service.engine.structured_output import Constrained
from verifier_service.spec_decode.drafter_client import DeltaHistory
from verifier_service.spec_decode.lookahead import Lookahead
from verifier_service.spec_decode.policy import SpecState
from verifier_service.spec_decode.prediction import Prediction


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StoppingParams:
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()  # empty when the request ignores EOS
    min_new_tokens: int = 0  # until then, no EOS or stop token id, and no stop string, ends it
    include_stop_str: bool = False  # the text keeps the stop string or stop token's text that ended it


@dataclass
class SpecStats:
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafter_failures: int = 0
    num_draft_nodes: int = 0  # draft tokens verified, every node of a tree counted
    drafter_wait_s: float = 0.0  # the time its steps spent on drafter calls (building one, waiting for it)
    # Of draft tokens drafted from its prediction: verified and kept, verified and discarded.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def record(self, drafted: int, accepted: int, nodes: int | None = None) -> None:
        """`drafted`: a chain's length or a tree's depth; `nodes`: a tree's size (None: a chain)."""
        self.num_steps += 1
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_draft_nodes += drafted if nodes is None else nodes
        self.num_accepted_tokens += accepted
        if len(self.num_accepted_tokens_per_pos) < drafted:
            self.num_accepted_tokens_per_pos.extend([0] * (drafted - len(self.num_accepted_tokens_per_pos)))
        for pos in range(accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def record_prediction(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens from the request's prediction, `accepted` of them kept."""
        self.accepted_prediction_tokens += accepted
        self.rejected_prediction_tokens += drafted - accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class Output:
    """What a request receives after a step: new tokens and text, and the end when finished.
    The per-token lists are parallel to token_ids."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    error: str = ""  # the engine failed this request
    drafted: list[bool] = field(default_factory=list)  # an accepted draft token, or the target's own
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked for them
    # The text each token released ("".join(pieces) == text): a token may release nothing (half a
    # character, or a possible stop string held back) and a later one release it.
    pieces: list[str] = field(default_factory=list)
    # In a request's first output, when it asked for them: of each prompt token after the first.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


def joined(outputs: list[Output]) -> Output:
    """A request's consecutive outputs as one: its whole answer, or what queued for a front that fell
    behind the steps (vLLM's RequestOutputCollector merges deltas the same way)."""
    last = outputs[-1]
    return Output([t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs), last.finish_reason,
                  last.stop_reason, last.error, drafted=[d for o in outputs for d in o.drafted],
                  logprobs=[lp for o in outputs for lp in o.logprobs], pieces=[p for o in outputs for p in o.pieces],
                  prompt_logprobs=outputs[0].prompt_logprobs)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    detokenizer: Detokenizer
    spec: SpecState = field(default_factory=SpecState)  # its speculation overrides and learnt acceptance
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_drafted: list[bool] = field(default_factory=list)  # parallel to output_ids
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel when sampling.logprobs is set
    slot: int | None = None  # its KV cache slot while it runs
    drafter_sync: DeltaHistory = field(default_factory=DeltaHistory)  # what the drafter was sent of it
    lookahead: Lookahead | None = None  # the drafter's last chain for it, kept for the next step
    prediction: Prediction | None = None  # its request's predicted output, a draft source of its own
    stats: SpecStats = field(default_factory=SpecStats)
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)  # on the servers' loop
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    cancelled: bool = False
    _pieces: list[str] = field(default_factory=list)  # text released per token since the last emit
    num_prefilled: int = 0  # positions of prefill_ids whose KV its slot holds (chunked prefill, cached prefix)
    cached_prompt_tokens: int = 0  # of the prompt's, reused from the prefix cache when it was first admitted
    priority: int = 0  # with priority scheduling, lower runs first (vLLM's); ties go to the earlier arrival
    cache_root: bytes = b""  # where its prefix-cache hash chain starts: its cache salt's digest (prefix_cache.py)
    arrival: int = 0  # its place in the order of arrival, given by the scheduler
    admitted_at: float | None = None  # time.perf_counter() when it first got a KV slot: its queue time's end
    num_preemptions: int = 0
    # Preempted after its first token: until its slot holds the KV of every committed token but the
    # last again (recomputed as a prefill, mostly taken back from the prefix cache), it decodes nothing.
    recompute: bool = False
    # (from, to) K/V positions of its slot to copy at the next forward: its last accepted tree path.
    kv_moves: list[tuple[int, int]] = field(default_factory=list)
    # Alternatives asked for at each prompt position (None: no prompt log-probabilities); those
    # computed so far, of prompt_ids[1:], chunk by chunk.
    prompt_logprobs: int | None = None
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: Constrained | None = None  # its structured-output constraint, at its committed tokens
    logits_state: LogitsState = field(default_factory=LogitsState)  # its logits processors' device tensors

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_salt_id(self) -> str:
        """Its cache salt as drafters see it (DraftSequence.cache_salt_id): cache_root in hex ("": unsalted)."""
        return self.cache_root.hex()

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_tokens(self) -> int:
        return self.stopping.max_new_tokens - len(self.output_ids)

    def held_stops(self) -> tuple[int, tuple[int, ...]]:
        """(how many more tokens until min_new_tokens, the token ids that cannot come before then):
        (0, ()) once none are held."""
        until = self.stopping.min_new_tokens - len(self.output_ids)
        if until <= 0:
            return 0, ()
        return until, tuple(sorted(self.stopping.eos_token_ids | self.stopping.stop_token_ids))

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose keys and values its KV slot holds: all but the last committed one."""
        return self.num_tokens - 1

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill computes: the prompt, or after a preemption every committed token but the
        last (which its next decode row carries, as it would have)."""
        return self.all_ids[:-1] if self.recompute else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prefill_ids)

    @property
    def scheduling_key(self) -> tuple[int, int]:
        """Smaller runs first under priority scheduling."""
        return self.priority, self.arrival

    @property
    def kv_len(self) -> int:
        """Valid positions of its KV slot, in prefill or after."""
        return self.num_cached_tokens if self.output_ids and not self.prefilling else self.num_prefilled

    def add_prefilled(self, n: int) -> None:
        """`n` more positions of prefill_ids are in its slot; a recompute ends once they all are."""
        self.num_prefilled += n
        if self.recompute and not self.prefilling:
            self.recompute, self.num_prefilled = False, len(self.prompt_ids)

    def preempt(self) -> None:
        """Its slot was taken for a sequence of higher priority (scheduler): it waits again, and its
        committed tokens' KV is recomputed when it is readmitted. Everything else it keeps (its
        generator, constraint, stop state, speculation state and what its drafter holds), so it goes on
        exactly where it stopped."""
        self.slot = None
        self.num_prefilled = 0
        self.kv_moves = []  # of the slot it left
        self.num_preemptions += 1
        self.recompute = bool(self.output_ids)
        if not self.output_ids:
            self.prompt_token_logprobs = []  # computed anew with its prompt

    def draft_room(self, max_model_len: int) -> int:
        """Draft tokens it can still use: more than it still wants, or past the context, are waste."""
        return min(self.remaining_tokens - 1, max_model_len - self.num_tokens - 1)

    def append_tokens(self, tokens: list[int], max_model_len: int, num_drafted: int = 0,
                      logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Commit tokens one by one until a stop condition; return those kept. The first
        `num_drafted` are accepted draft tokens; `logprobs` are parallel to `tokens`."""
        kept: list[int] = []
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            self.output_drafted.append(i < num_drafted)
            if logprobs is not None:
                self.output_logprobs.append(logprobs[i])
            kept.append(token)
            # A stop token id, or the end of sequence, ends it: as in vLLM, its text is left out unless stop
            # strings are kept; the token itself is in token_ids either way.
            ended_by = (str(token) if token in self.stopping.stop_token_ids
                        else "" if token in self.stopping.eos_token_ids else None)
            if ended_by is None or self.stopping.include_stop_str:
                self.detokenizer.add(token)
            if self.detokenizer.stopped_by is not None:
                self._finish(FinishReason.STOP, self.detokenizer.stopped_by)
            elif ended_by is not None:
                self._finish(FinishReason.STOP, ended_by)
            elif self.remaining_tokens <= 0 or self.num_tokens >= max_model_len:
                self._finish(FinishReason.LENGTH, "")
            if self.finished:
                break
            self._pieces.append(self.detokenizer.take())
        if self.grammar is not None:
            self.grammar.commit(kept)
        if self.finished:
            self.detokenizer.flush()
            self._pieces.append(self.detokenizer.take(final=True))
        return kept

    def _finish(self, reason: FinishReason, stop_reason: str) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def emit(self, tokens: list[int]) -> Output:
        """The output for the tokens just appended (and their text), for the request's queue."""
        n = len(tokens)
        pieces, self._pieces = self._pieces, []
        return Output(
            tokens, "".join(pieces), self.finish_reason, self.stop_reason,
            drafted=self.output_drafted[len(self.output_drafted) - n:],
            logprobs=self.output_logprobs[len(self.output_logprobs) - n:] if self.output_logprobs else [],
            pieces=pieces, prompt_logprobs=self.prompt_token_logprobs if len(self.output_ids) == n else [])
