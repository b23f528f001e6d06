"""How many tokens each sequence drafts this step.

The knobs TensorRT-LLM and vLLM users know: a global max_draft_len, a
per-request cap, a draft-length schedule by batch size, acceptance-based
auto-disable per request (with periodic probes), and an adaptive length that
weighs each request's acceptance against the measured cost of verifying more
tokens (draft_planner).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drafter_sdk.proto import speculative_pb2
from verifier_service.spec.planner import DraftPlanner
from verifier_service.engine.sequence import Sequence


@dataclass
class _SeqPolicyState:
    window: deque[tuple[int, int]] = field(default_factory=deque)  # (drafted, accepted) per step
    disabled: bool = False
    steps_since_disabled: int = 0


@dataclass
class SpeculationPolicy:
    max_draft_len: int
    schedule: list[tuple[int, int]] = field(default_factory=list)  # (max_batch_size, draft_len), ascending
    window_tokens: int = 0
    min_acceptance_rate: float = 0.0
    probe_interval_steps: int = 0
    planner: DraftPlanner | None = None  # adaptive draft lengths; None = always the cap
    _state: dict[str, _SeqPolicyState] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: speculative_pb2.SpeculativeConfig) -> "SpeculationPolicy":
        """With adaptive_draft_len, the engine measures the planner's cost curve before its first step."""
        p = config.policy
        planner = DraftPlanner(config.max_draft_len) if p.adaptive_draft_len and config.max_draft_len else None
        return cls(
            max_draft_len=config.max_draft_len,
            schedule=sorted((r.max_batch_size, r.draft_len) for r in p.draft_len_schedule),
            window_tokens=p.auto_disable.window_tokens,
            min_acceptance_rate=p.auto_disable.min_acceptance_rate,
            probe_interval_steps=p.auto_disable.probe_interval_steps,
            planner=planner,
        )

    def plan(self, seqs: list[Sequence], max_model_len: int) -> tuple[list[int], list[int]]:
        """(tokens to verify, tokens to ask the drafter for) per sequence of a step.

        With the planner, a sequence it keeps from drafting still asks for a
        shadow draft up to its cap, scored but never verified (observe_shadow).
        """
        caps = [self.draft_len(s, len(seqs), max_model_len) for s in seqs]
        if self.planner is None:
            return caps, caps
        lengths = self.planner.plan([s.request_id for s in seqs], caps)
        return lengths, [k or cap for k, cap in zip(lengths, caps)]

    def observe_shadow(self, seq: Sequence, shadow: list[int], produced: int) -> None:
        if self.planner is not None and shadow:
            self.planner.observe_shadow(seq.request_id, shadow[0] == produced)

    def draft_len(self, seq: Sequence, batch_size: int, max_model_len: int) -> int:
        if seq.speculation.disable:
            return 0
        k = self.max_draft_len
        for bound, length in self.schedule:
            if batch_size <= bound:
                k = min(k, length)
                break
        else:
            if self.schedule:  # beyond the largest bound: the last rule's length
                k = min(k, self.schedule[-1][1])
        if seq.speculation.max_draft_len is not None:
            k = min(k, seq.speculation.max_draft_len)
        state = self._state.setdefault(seq.request_id, _SeqPolicyState())
        if state.disabled:
            state.steps_since_disabled += 1
            if not self.probe_interval_steps or state.steps_since_disabled < self.probe_interval_steps:
                return 0
        # Drafts beyond the tokens still wanted, or past the context, are wasted work.
        room = min(seq.remaining_tokens - 1, max_model_len - seq.num_tokens - 1)
        return max(0, min(k, room))

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if self.planner is not None:
            self.planner.observe(seq.request_id, drafted, accepted)
        state = self._state.get(seq.request_id)
        if state is None or drafted == 0:
            return
        if not self.window_tokens:
            return
        if state.disabled:  # this was a probe: resume only if it paid
            state.steps_since_disabled = 0
            if accepted / drafted >= self.min_acceptance_rate:
                state.disabled = False
                state.window.clear()
            return
        state.window.append((drafted, accepted))
        total = sum(d for d, _ in state.window)
        while state.window and total - state.window[0][0] >= self.window_tokens:
            total -= state.window.popleft()[0]
        if total >= self.window_tokens:
            rate = sum(a for _, a in state.window) / total
            if rate < self.min_acceptance_rate:
                state.disabled = True
                state.steps_since_disabled = 0
                seq.stats.auto_disabled = True

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        if self.planner is not None:
            self.planner.forget(request_id)
