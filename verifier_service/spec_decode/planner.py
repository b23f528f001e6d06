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
first-position estimate honest, so drafting resumes as soon as the text
becomes predictable.

A step that drafts also calls the drafter, and a remote call's wait is not
free: the n-gram drafter's round trip took 1.2-1.5 ms on an H200 host against
a 3-ms forward (1.3 ms against 25-35 ms on this project's 2-core CPU), and a
drafter that queries a store or runs a model takes longer. The engine
measures it (and the step's own work around the forward) and hands the
planner a `StepPrice` in the cost curve's unit, so that drafting must beat
plain decoding with both counted: where the call costs more than what the drafts are expected to
gain, no sequence drafts and the drafter is not called (a request whose prediction drafts for it,
spec_decode/prediction.py, needs no call, and its drafts are priced without one). Shadow drafts ride
along free where a step calls anyway; where none drafts, a request asks for
one after waiting a number of steps that doubles with each shadow that
missed or did not come and halves with each that hit (policy.py), so that
text turning predictable is noticed within a few steps, and never longer than
`shadow_interval` steps, so that on text that stays unpredictable scoring
them costs at most SHADOW_SHARE of the time. A request with no evidence yet
is planned as if the call were free: it is made for that request anyway (its
first draft), and without it a slow drafter's prior would never be tested.
Drafts are expected as often as the drafter answered with one (`answered`):
an n-gram drafter on free text often has none, and such a call costs the call
alone.

Token trees are sized on top of the chosen chain lengths (`plan_nodes`). A
tree drafter orders its nodes best first, so the first j nodes of a verified
tree are the tree it would have drafted with a budget of j, and its first
branch (first child after first child) is the chain it would have drafted.
One verified tree thus tells, for every j up to its budget, how many more (or
fewer) tokens a j-node tree had accepted than that chain: a paired comparison,
steady even where acceptance itself swings from step to step. Per request the
planner keeps this curve (decayed like the rates above); the chain estimate
learns from verified chains only. Request by request,
most rewarding first, it replaces a chain by the tree size whose expected
tokens per unit of step time (the forward's, and the `StepPrice` beside it)
beat it, if any; so a node is verified only where the curve says it pays at
the measured cost of one more token: on a GPU
trees grow to the budget, on a busy CPU they stay small or become chains. A
request starts on chains; after PROBE_STEPS chains in a row it verifies one
tree as large as costs little more than its chain (PROBE_COST), so the curve
is measured, and re-measured as the text changes, at a small price. Sizes
larger than any tree measured are priced at BRANCH_PRIOR tokens a node beyond
the largest measured one. That prior is modest on purpose: at 0.15 a node (and
a full tree for every fresh request), one lucky tree on copied text bought
many costly trees that accepted no more than the chain (offline replay,
tree_replay --planner: 0.88x the chain's tokens/s on the recurring workload);
now trees degenerate to the chain where branches do not pay (within 0.2% of
it on all six workloads in that replay, within about 6% in a real bench run on
this CPU), and grow where a node is nearly free.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from verifier_service.model.step_costs import CostCurve

# Weight left to old evidence after each drafting step: recent steps weigh most,
# so a request that moves from copying to free text backs off within a few steps.
DECAY = 0.85
# Priors as (hits, trials): a fresh request is assumed to draft usefully, so it tries.
FIRST_PRIOR = (1.0, 2.0)
LATER_PRIOR = (1.6, 2.0)
ANSWERED_PRIOR = (1.0, 1.0)
# Accepted tokens per tree node beyond the chain's length (or beyond the largest tree measured) before
# the evidence says otherwise, and the weight of this guess against the evidence (in verified trees).
BRANCH_PRIOR = 0.05
PRIOR_WEIGHT = 0.5
# After this many verified chains in a row, one tree as large as costs at most PROBE_COST times the
# chain's forward, so that the tree curve does not go stale (nor cost much where trees do not pay).
PROBE_STEPS = 32
PROBE_COST = 1.1
# A tree must beat the chain's expected tokens per forward cost by this factor: its curve rests on
# fewer, noisier steps than the chain's estimate, and a lucky step must not buy many costly ones.
TREE_MARGIN = 1.1
# Where no sequence drafts, shadow drafts (scored, never verified) that keep missing may cost at most this
# share of the decoding time in drafter calls: they are asked for at least every
# `DraftPlanner.shadow_interval` steps.
SHADOW_SHARE = 0.02


@dataclass(frozen=True)
class StepPrice:
    """What a step costs beside its forward, in the cost curve's unit (one one-token forward), as the
    engine measured it (engine/step_clock.py)."""

    fixed: float = 0.0  # every step: scheduling, sampling, handing outputs over
    call: float = 0.0  # a step that calls the drafter: the wait for its answer


FREE_CALLS = StepPrice()  # nothing measured (tests, a server's first steps): calls cost nothing


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
    # Of the calls that asked for a draft (verified or shadow), the share the drafter answered with one:
    # `first` and `later` are rates of drafts that came; a call that brings none costs the call alone.
    answered: Rate = field(default_factory=lambda: Rate(*ANSWERED_PRIOR))
    # tree[j - 1]: tokens the first j nodes of the verified trees had accepted beyond their first branch.
    tree: list[Rate] = field(default_factory=list)
    chains_in_a_row: int = 0  # verified chains since the last verified tree
    fresh: bool = True  # nothing learnt of this request's drafts yet (none asked for, verified or scored)

    def gains(self, cap: int) -> list[float]:
        """Probability that draft position 1..cap is accepted."""
        p, out = self.first.value, []
        for _ in range(cap):
            out.append(p)
            p *= self.later.value
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified chain: one step's evidence, decayed once (its positions are not independent
        trials: decaying per position let one missed token outweigh a whole accepted copy)."""
        if drafted == 0:
            return
        self.fresh = False
        self.chains_in_a_row += 1
        self.first.add(accepted >= 1)
        trials = min(drafted - 1, accepted)  # positions 2.. reached after an acceptance; all but a miss kept
        if trials:
            self.later.add_many(accepted - 1, trials)

    def observe_answer(self, answered: bool) -> None:
        """A call asked for a draft: did the drafter answer one (a draft, or a shadow draft)?"""
        self.fresh = False
        self.answered.add(answered)

    def observe_shadow(self, first_token_matched: bool) -> None:
        """An unverified draft's first token against the token the target produced."""
        self.fresh = False
        self.first.add(first_token_matched)

    def observe_tree(self, extra_by_nodes: list[int]) -> None:
        """A verified tree: `extra_by_nodes[j - 1]`, the tokens its first j nodes had accepted minus
        those its first branch had, for every j up to the node budget it was drafted under."""
        self.chains_in_a_row = 0
        self.fresh = False
        self.tree.extend(Rate(0.0, 0.0) for _ in range(len(extra_by_nodes) - len(self.tree)))
        for rate, extra in zip(self.tree, extra_by_nodes):
            rate.add_many(extra, 1)

    def tree_gains(self, depth: int, max_nodes: int) -> list[float]:
        """Expected accepted tokens of a tree of 1..max_nodes nodes (at most `depth` deep): the chain's
        expectation plus the extra the evidence shows, weighed against a prior of the chain's own
        first j tokens plus BRANCH_PRIOR per node beyond them. Sizes larger than any tree verified
        extend the largest measured one by the prior's increments."""
        gains = self.gains(depth)
        chain = sum(gains)
        prior, out = 0.0, []
        for j in range(1, max_nodes + 1):
            step = gains[j - 1] if j <= depth else BRANCH_PRIOR
            prior += step
            if j > len(self.tree):
                out.append(out[-1] + step if out else prior)
                continue
            seen = self.tree[j - 1]
            out.append(chain + (seen.hits + PRIOR_WEIGHT * (prior - chain)) / (seen.trials + PRIOR_WEIGHT))
        return out


@dataclass(frozen=True)
class DraftPlanner:
    costs: CostCurve  # forward cost by tokens in one forward, measured at start-up
    one_token_s: float = 0.0  # the curve's unit: a one-token forward's seconds then (0: unknown)

    def plan(self, estimates: list[AcceptanceEstimate], caps: list[int], price: StepPrice = FREE_CALLS,
             calls: list[bool] | None = None) -> list[int]:
        """Draft lengths (each <= its cap) maximising expected tokens per step cost: the forward's, the
        step's own work, and the drafter call where a sequence drafts from it (free where a fresh request
        has the call made anyway). `calls[i]` false: request i's draft comes without a call (its
        prediction's); default: every draft calls. A draft is expected to come as often as the drafter
        answered one, and its tokens are verified only then (where calls are free, that share changes
        nothing for a request alone: gains and verify tokens scale alike)."""
        if not caps:
            return []
        calls = calls if calls is not None else [True] * len(caps)
        call = 0.0 if any(e.fresh and cap and c for e, cap, c in zip(estimates, caps, calls)) else price.call
        gains = [e.gains(cap) for e, cap in zip(estimates, caps)]
        answered = [e.answered.value for e in estimates]
        # The drafts that need no call, then every draft with the call paid: the better of the two.
        best = self._most_tokens([[] if c else g for g, c in zip(gains, calls)], answered, price.fixed)
        if any(calls):
            best = max(best, self._most_tokens(gains, answered, price.fixed, call), key=lambda b: b[0])
        return best[1]

    def _most_tokens(self, gains: list[list[float]], answered: list[float], fixed: float,
                     call: float = 0.0) -> tuple[float, list[int]]:
        """Draft tokens added most promising first (`gains[i]`: request i's acceptance by position) while
        the expected tokens per step cost rise: the forward's, `fixed`, and `call` once any request
        drafts. Returns the best rate and its lengths."""
        heap = [(-g[0], i) for i, g in enumerate(gains) if g]
        heapq.heapify(heap)
        lengths = [0] * len(gains)
        tokens = len(gains)
        expected = float(len(gains))
        best_rate, best = expected / (self.costs(tokens) + fixed), list(lengths)
        while heap:
            gain, i = heapq.heappop(heap)
            lengths[i] += 1
            tokens += answered[i]
            expected -= answered[i] * gain
            rate = expected / (self.costs(tokens) + fixed + call)
            if rate > best_rate:
                best_rate, best = rate, list(lengths)
            if lengths[i] < len(gains[i]):
                heapq.heappush(heap, (-gains[i][lengths[i]], i))
        return best_rate, best

    def shadow_interval(self, batch: int, price: StepPrice) -> int:
        """The longest wait, in steps, between the calls made only to score shadow drafts where no
        sequence of a batch of `batch` drafts: long enough that those calls cost at most SHADOW_SHARE
        of the steps' time (1, every step, where calls cost nothing)."""
        return max(1, math.ceil(price.call / (SHADOW_SHARE * (self.costs(batch) + price.fixed))))

    def plan_nodes(self, estimates: list[AcceptanceEstimate], lengths: list[int], max_nodes: int,
                   price: StepPrice = FREE_CALLS) -> list[int]:
        """Token-tree sizes (nodes, at most max_nodes; 0 = keep the chain) for the chain lengths (tree
        depths) `plan` chose: a request's chain becomes the tree (of as many nodes or more) that most
        raises the batch's expected tokens per step cost, if one does (the step's own work and the call,
        which a drafting step makes either way, count as in `plan`); a request long on chains verifies a
        cheap tree (PROBE_COST)."""
        chains = [sum(e.gains(k)) for e, k in zip(estimates, lengths)]
        tokens = len(lengths) + sum(lengths)
        expected = len(lengths) + sum(chains)
        curves = {i: estimates[i].tree_gains(k, max_nodes) for i, k in enumerate(lengths) if k}
        beside = price.fixed + price.call  # what the step costs beside its forward
        nodes = [0] * len(lengths)
        for i in sorted(curves, key=lambda i: chains[i] - curves[i][-1]):  # most to gain from a tree first
            best_rate, best = TREE_MARGIN * expected / (self.costs(tokens) + beside), 0
            for j, gain in enumerate(curves[i][lengths[i]:], lengths[i] + 1):  # never fewer nodes than the chain
                rate = (expected + gain - chains[i]) / (self.costs(tokens + j - lengths[i]) + beside)
                if rate > best_rate:
                    best_rate, best = rate, j
            if estimates[i].chains_in_a_row >= PROBE_STEPS:  # the largest tree that costs little more
                best = max(j for j in range(lengths[i], max_nodes + 1)
                           if self.costs(tokens + j - lengths[i]) <= PROBE_COST * self.costs(tokens))
            if best:
                nodes[i] = best
                tokens += best - lengths[i]
                expected += curves[i][best - 1] - chains[i]
        return nodes
