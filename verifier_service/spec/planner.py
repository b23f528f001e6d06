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

Token trees are sized on top of the chosen chain lengths (`plan_nodes`): a
node beyond a sequence's chain is worth the extra accepted tokens per extra
node that its earlier trees earned over their first branch (the chain the tree
would have been), and nodes are added, most rewarding request first, while the
expected tokens per unit of forward time still rise. Where verifying more
tokens is dear (a large batch on a CPU) or side branches have not been paying,
no node is added and the sequence drafts a chain.
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
# Extra accepted tokens per tree node beyond the first branch, before any tree was verified: enough
# to try a tree where a node costs little (a GPU, a small batch), not where it costs a step's 5%.
BRANCH_PRIOR = (0.15, 1.0)


@dataclass
class Rate:
    """A decayed acceptance count: hits / trials."""

    hits: float
    trials: float

    def add(self, hit: bool) -> None:
        self.add_many(hit, 1)

    def add_many(self, hits: float, trials: float) -> None:
        """One step's evidence of `trials` trials at once (decayed once)."""
        self.hits = DECAY * self.hits + hits
        self.trials = DECAY * self.trials + trials

    @property
    def value(self) -> float:
        return self.hits / self.trials


@dataclass
class AcceptanceEstimate:
    """One request's acceptance so far: of the first draft position, and of each later one given
    that its predecessor was accepted. Lives on the request's Sequence."""

    first: Rate = field(default_factory=lambda: Rate(*FIRST_PRIOR))
    later: Rate = field(default_factory=lambda: Rate(*LATER_PRIOR))
    branch: Rate = field(default_factory=lambda: Rate(*BRANCH_PRIOR))  # per tree node off the first branch

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

    def observe_branches(self, extra_nodes: int, extra_accepted: int) -> None:
        """A verified tree: `extra_nodes` nodes off its first branch bought `extra_accepted` tokens
        beyond what the first branch alone would have had accepted."""
        if extra_nodes > 0:
            self.branch.add_many(extra_accepted, extra_nodes)


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

    def plan_nodes(self, estimates: list[AcceptanceEstimate], lengths: list[int], max_nodes: int) -> list[int]:
        """Token-tree sizes (nodes, at most max_nodes; 0 = a chain) for the chain lengths `plan` chose."""
        tokens = len(lengths) + sum(lengths)
        expected = len(lengths) + sum(sum(e.gains(k)) for e, k in zip(estimates, lengths))
        best_rate = expected / self.costs(tokens)
        extra, best = [0] * len(lengths), [0] * len(lengths)
        for i in sorted((i for i, k in enumerate(lengths) if 0 < k < max_nodes),
                        key=lambda i: -estimates[i].branch.value):
            for _ in range(max_nodes - lengths[i]):
                extra[i] += 1
                tokens += 1
                expected += estimates[i].branch.value
                rate = expected / self.costs(tokens)
                if rate > best_rate:
                    best_rate, best = rate, list(extra)
        return [k + e if e else 0 for k, e in zip(lengths, best)]
