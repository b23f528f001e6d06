"""How many tokens each sequence drafts this step.

The knobs TensorRT-LLM and vLLM users know: a global max_draft_len, a
per-request cap, a draft-length schedule by batch size, acceptance-based
auto-disable per request (with periodic probes), and optionally an adaptive
length that grows on full acceptance and shrinks on rejection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drafter_sdk.proto import speculative_pb2
from verifier_service.sequence import Sequence


@dataclass
class _SeqPolicyState:
    window: deque[tuple[int, int]] = field(default_factory=deque)  # (drafted, accepted) per step
    disabled: bool = False
    steps_since_disabled: int = 0
    adaptive_len: int = 0


@dataclass
class SpeculationPolicy:
    max_draft_len: int
    schedule: list[tuple[int, int]] = field(default_factory=list)  # (max_batch_size, draft_len), ascending
    window_tokens: int = 0
    min_acceptance_rate: float = 0.0
    probe_interval_steps: int = 0
    adaptive: bool = False
    _state: dict[str, _SeqPolicyState] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: speculative_pb2.SpeculativeConfig) -> "SpeculationPolicy":
        p = config.policy
        return cls(
            max_draft_len=config.max_draft_len,
            schedule=sorted((r.max_batch_size, r.draft_len) for r in p.draft_len_schedule),
            window_tokens=p.auto_disable.window_tokens,
            min_acceptance_rate=p.auto_disable.min_acceptance_rate,
            probe_interval_steps=p.auto_disable.probe_interval_steps,
            adaptive=p.adaptive_draft_len,
        )

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
        state = self._state.setdefault(seq.request_id, _SeqPolicyState(adaptive_len=k))
        if state.disabled:
            state.steps_since_disabled += 1
            if not self.probe_interval_steps or state.steps_since_disabled < self.probe_interval_steps:
                return 0
        if self.adaptive:
            k = min(k, max(1, state.adaptive_len))
        # Drafts beyond the tokens still wanted, or past the context, are wasted work.
        room = min(seq.remaining_tokens - 1, max_model_len - seq.num_tokens - 1)
        return max(0, min(k, room))

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        state = self._state.get(seq.request_id)
        if state is None or drafted == 0:
            return
        if self.adaptive:
            state.adaptive_len = (min(self.max_draft_len, state.adaptive_len + 2) if accepted == drafted
                                  else max(1, accepted + 1))
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
