"""Cost-aware draft lengths: draft long where drafts are accepted, short or not at all where they are not.

Each extra draft token costs the extra forward time of verifying one more
token and pays off only with the probability that it and every token before it
are accepted. Per request, the planner estimates the acceptance of the first
draft position and, given an accepted predecessor, of each later one, and
adds draft tokens across the whole batch, most promising first, while the
expected tokens per unit of forward time still rise. The forward-time curve is
measured on the target at start-up (step_costs), so the same rule drafts long
on a GPU, where verifying 9 tokens costs about as much as 1, and short or not
at all on a busy CPU. A request that is not drafting still asks the drafter
for a "shadow" draft that is never verified: whether its first token equals
the token the target then produced keeps the first-position estimate honest
for free, so drafting resumes as soon as the text becomes predictable.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from verifier_service.model.step_costs import CostCurve

# Weight left to old evidence after each drafting step: recent steps weigh most,
# so a request that moves from copying to free text backs off within a few steps.
DECAY = 0.85
# Priors as (hits, trials): a fresh request is assumed to draft usefully, so it tries.
FIRST_PRIOR = (1.0, 2.0)
LATER_PRIOR = (1.6, 2.0)


@dataclass
class _Rate:
    """A decayed acceptance count: hits / trials."""

    hits: float
    trials: float

    def add(self, hit: bool) -> None:
        self.hits = DECAY * self.hits + hit
        self.trials = DECAY * self.trials + 1

    @property
    def value(self) -> float:
        return self.hits / self.trials


@dataclass
class _Request:
    first: _Rate = field(default_factory=lambda: _Rate(*FIRST_PRIOR))
    later: _Rate = field(default_factory=lambda: _Rate(*LATER_PRIOR))


@dataclass
class DraftPlanner:
    max_draft_len: int
    costs: CostCurve | None = None  # forward cost by tokens; None until measured
    _requests: dict[str, _Request] = field(default_factory=dict)

    def gains(self, request_id: str, cap: int) -> list[float]:
        """Probability that draft position 1..cap is accepted."""
        state = self._requests.get(request_id, _Request())
        p, out = state.first.value, []
        for j in range(cap):
            out.append(p)
            p *= state.later.value
        return out

    def plan(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """Draft lengths (each <= its cap) maximising expected tokens per forward cost."""
        if self.costs is None or not caps:
            return list(caps)
        gains = [self.gains(rid, cap) for rid, cap in zip(request_ids, caps)]
        heap = [(-g[0], i) for i, g in enumerate(gains) if g]
        heapq.heapify(heap)
        lengths = [0] * len(caps)
        tokens = len(caps)
        expected = float(len(caps))
        best_rate, best = expected / self.costs(tokens), list(lengths)
        while heap:
            gain, i = heapq.heappop(heap)
            lengths[i] += 1
            tokens += 1
            expected -= gain
            rate = expected / self.costs(tokens)
            if rate > best_rate:
                best_rate, best = rate, list(lengths)
            if lengths[i] < len(gains[i]):
                heapq.heappush(heap, (-gains[i][lengths[i]], i))
        return best

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        state = self._requests.setdefault(request_id, _Request())
        state.first.add(accepted >= 1)
        for j in range(2, min(drafted, accepted + 1) + 1):  # positions reached after an acceptance
            state.later.add(accepted >= j)

    def observe_shadow(self, request_id: str, first_token_matched: bool) -> None:
        """An unverified draft's first token against the token the target produced."""
        self._requests.setdefault(request_id, _Request()).first.add(first_token_matched)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
