"""Cost-aware draft lengths: draft long where drafts are accepted, short or not at all where they are not.

Each extra draft token costs the extra forward time of verifying one more
token and pays off only with the probability that it and every token before it
are accepted. Per request, the planner estimates the acceptance of the first
draft position and, given an accepted predecessor, of each later one, and
adds draft tokens across the whole batch, most promising first, while the
expected tokens per unit of forward time still rise. The forward-time curve is
measured on the target at start-up (model/step_costs, run by the builder), so
the same rule drafts long on a GPU, where verifying 9 tokens costs about as
much as 1, and short or not at all on a busy CPU. A request that is not
drafting still asks the drafter for a "shadow" draft that is never verified:
whether its first token equals the token the target then produced keeps the
first-position estimate honest for free, so drafting resumes as soon as the
text becomes predictable.
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
class Rate:
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
class AcceptanceEstimate:
    """One request's acceptance so far: of the first draft position, and of each later one given
    that its predecessor was accepted. Lives on the request's Sequence."""

    first: Rate = field(default_factory=lambda: Rate(*FIRST_PRIOR))
    later: Rate = field(default_factory=lambda: Rate(*LATER_PRIOR))

    def gains(self, cap: int) -> list[float]:
        """Probability that draft position 1..cap is accepted."""
        p, out = self.first.value, []
        for _ in range(cap):
            out.append(p)
            p *= self.later.value
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.first.add(accepted >= 1)
        for j in range(2, min(drafted, accepted + 1) + 1):  # positions reached after an acceptance
            self.later.add(accepted >= j)

    def observe_shadow(self, first_token_matched: bool) -> None:
        """An unverified draft's first token against the token the target produced."""
        self.first.add(first_token_matched)


@dataclass(frozen=True)
class DraftPlanner:
    costs: CostCurve  # forward cost by tokens in one forward, measured at start-up

    def plan(self, estimates: list[AcceptanceEstimate], caps: list[int]) -> list[int]:
        """Draft lengths (each <= its cap) maximising expected tokens per forward cost."""
        if not caps:
            return []
        gains = [e.gains(cap) for e, cap in zip(estimates, caps)]
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
