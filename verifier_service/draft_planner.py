"""Cost-aware draft lengths: draft long where drafts are accepted, short or not at all where they are not.

Each extra draft token costs the extra forward time of verifying one more
token and pays off only with the probability that it and every token before it
are accepted. The planner estimates that probability per position (the first
position per request, later positions from every request's history, since
once a drafter starts matching it tends to keep matching) and adds draft tokens
across the whole batch, most promising first, while the expected tokens per
unit of forward time still rise. The forward-time curve is measured on the
target at start-up (step_costs), so the same rule drafts long on a GPU, where
verifying 9 tokens costs about as much as 1, and short on a busy CPU.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

# Weight left to old evidence after each step: recent steps weigh most, so a
# request that moves from copying to free text backs off within a few steps,
# and one that stopped drafting drifts back toward the prior and probes again.
DECAY = 0.7
# Later positions pool every request's history, so they can afford a longer memory.
LATER_DECAY = 0.95
# Pseudo-counts of the priors (acceptance 0.5 for a request's first position,
# 0.8 for later positions given the previous one was accepted).
FIRST_PRIOR = (1.0, 2.0)
LATER_PRIOR = (1.6, 2.0)


@dataclass
class _Rate:
    """A decayed acceptance count: hits / trials, pulled toward its prior."""

    hits: float
    trials: float

    def add(self, hit: bool, decay: float = DECAY) -> None:
        self.hits = decay * self.hits + hit
        self.trials = decay * self.trials + 1

    def drift(self, prior: tuple[float, float]) -> None:
        """A step without evidence: move toward the prior."""
        self.hits = DECAY * self.hits + (1 - DECAY) * prior[0]
        self.trials = DECAY * self.trials + (1 - DECAY) * prior[1]

    @property
    def value(self) -> float:
        return self.hits / self.trials


@dataclass
class DraftPlanner:
    max_draft_len: int
    # [0, 1, c(2)/c(1), ...]: forward cost by tokens, one-token step = 1; empty until measured.
    relative_costs: list[float] = field(default_factory=list)
    _first: dict[str, _Rate] = field(default_factory=dict)
    _later: list[_Rate] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._later = [_Rate(*LATER_PRIOR) for _ in range(self.max_draft_len + 1)]

    def cost(self, tokens: int) -> float:
        c = self.relative_costs
        if tokens < len(c):
            return c[tokens]
        slope = c[-1] - c[-2] if len(c) > 2 else c[-1]
        return c[-1] + slope * (tokens - len(c) + 1)

    def gains(self, request_id: str, cap: int) -> list[float]:
        """Probability that draft position 1..cap is accepted."""
        p = self._first.get(request_id, _Rate(*FIRST_PRIOR)).value
        out = []
        for j in range(1, cap + 1):
            if j > 1:
                p *= self._later[j].value
            out.append(p)
        return out

    def plan(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """Draft lengths (each <= its cap) maximising expected tokens per forward cost."""
        if not self.relative_costs or not caps:
            return list(caps)
        gains = [self.gains(rid, cap) for rid, cap in zip(request_ids, caps)]
        heap = [(-g[0], i) for i, g in enumerate(gains) if g]
        heapq.heapify(heap)
        lengths = [0] * len(caps)
        tokens = len(caps)
        expected = float(len(caps))
        best_rate, best = expected / self.cost(tokens), list(lengths)
        while heap:
            gain, i = heapq.heappop(heap)
            lengths[i] += 1
            tokens += 1
            expected -= gain
            rate = expected / self.cost(tokens)
            if rate > best_rate:
                best_rate, best = rate, list(lengths)
            if lengths[i] < len(gains[i]):
                heapq.heappush(heap, (-gains[i][lengths[i]], i))
        return best

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        first = self._first.setdefault(request_id, _Rate(*FIRST_PRIOR))
        if drafted == 0:
            first.drift(FIRST_PRIOR)
            return
        first.add(accepted >= 1)
        for j in range(2, min(drafted, accepted + 1) + 1):  # positions reached after an acceptance
            self._later[j].add(accepted >= j, LATER_DECAY)

    def forget(self, request_id: str) -> None:
        self._first.pop(request_id, None)
