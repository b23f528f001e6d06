"""The adaptive draft-length planner: long drafts where they pay, none where they do not."""

from __future__ import annotations

import asyncio

import pytest
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import shared_model

from verifier_service.model.step_costs import CostCurve
from verifier_service.spec_decode.planner import PROBE_STEPS, AcceptanceEstimate, DraftPlanner
from verifier_service.spec_decode.policy import SpecState, SpeculationPolicy

FLAT = [0.0] + [1.0 + 0.01 * t for t in range(16)]  # GPU-like: verifying more tokens is almost free
LINEAR = [float(t) for t in range(17)]  # every verified token costs a full step


def planner(costs: list[float]) -> DraftPlanner:
    """costs[t]: cost of a forward over t tokens (costs[0] unused)."""
    return DraftPlanner(CostCurve(tuple((t, c) for t, c in enumerate(costs) if t)))


def trained(drafted: int, accepted: int, steps: int) -> AcceptanceEstimate:
    """A request's estimate after `steps` drafts of `drafted` tokens, `accepted` of them kept each time."""
    estimate = AcceptanceEstimate()
    for _ in range(steps):
        estimate.observe(drafted, accepted)
    return estimate


def test_cheap_verification_and_good_drafts_draft_to_the_cap() -> None:
    assert planner(FLAT).plan([trained(8, 8, 10)], [8]) == [8]


def test_verification_as_costly_as_decoding_never_drafts() -> None:
    assert planner(LINEAR).plan([trained(8, 6, 10)], [8]) == [0]


def test_requests_that_reject_draft_less_than_requests_that_accept() -> None:
    costs = [0.0] + [1.0 + 0.15 * (t - 1) for t in range(1, 17)]  # a CPU-like curve
    good, bad = planner(costs).plan([trained(8, 8, 10), trained(8, 0, 10)], [8, 8])
    assert good >= 4 and bad == 0


def test_caps_are_respected_and_batch_cost_shortens_drafts() -> None:
    costs = [0.0] + [1.0 + 0.15 * (t - 1) for t in range(1, 17)]
    p, a = planner(costs), trained(8, 5, 10)
    alone = p.plan([a], [8])[0]
    assert p.plan([a], [2]) == [min(2, alone)]
    # Sixteen such requests share one forward: the same acceptance buys fewer draft tokens each.
    batch = p.plan([trained(8, 5, 10) for _ in range(16)], [8] * 16)
    assert all(k <= 8 for k in batch) and sum(batch) / 16 <= alone


def test_shadow_drafts_bring_a_request_back_to_drafting() -> None:
    costs = [0.0] + [1.0 + 0.15 * (t - 1) for t in range(1, 17)]
    p, a = planner(costs), trained(8, 0, 10)
    assert p.plan([a], [8]) == [0]
    for _ in range(5):  # its unverified drafts now start with the token the target produced
        a.observe_shadow(True)
    assert p.plan([a], [8])[0] > 0


def test_without_the_planner_every_sequence_drafts_its_cap() -> None:
    policy = SpeculationPolicy(max_draft_len=8)
    states = [SpecState(), SpecState(), SpecState()]
    states[2].params = type(states[2].params)(disable=True)
    assert policy.plan(states, [3, 20, 8]) == ([3, 8, 0], [3, 8, 0])


def test_cost_curve_interpolates_and_extends() -> None:
    curve = CostCurve.from_seconds({1: 0.05, 2: 0.08, 3: 0.07, 16: 0.16})  # 3 is noise below 2
    # Each inner point is the median of it and its neighbours: 2 -> 0.07, 3 -> 0.08.
    assert curve(1) == 1.0 and curve(2) == pytest.approx(1.4) and curve(3) == pytest.approx(1.6)
    assert curve(9.5) == pytest.approx(2.4)  # halfway between 3 and 16
    assert curve(29) == pytest.approx(4.8)  # beyond the last point, along the last segment


def test_one_slow_sample_does_not_flatten_the_curve_after_it() -> None:
    """A running maximum would hold 13..17 at the slow 13's cost: four tokens for free."""
    seconds = {1: 1.0, 12: 1.8, 13: 2.4, 14: 2.0, 15: 2.05, 16: 2.1, 17: 2.2}
    curve = CostCurve.from_seconds(seconds)
    costs = [curve(t) for t in sorted(seconds)]
    assert costs == sorted(costs)
    assert curve(13) == pytest.approx(2.0) and curve(17) == pytest.approx(2.2)
    assert curve(16) - curve(13) == pytest.approx(0.1)


def test_adaptive_engine_output_is_exact() -> None:
    """The planner only chooses lengths; outputs stay those of plain decoding."""
    model = shared_model()
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [1, 2, 3, 4, 5, 6]]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 6, adaptiveDraftLen=True), model=model) as v:
            engine = v.running.runtime.engine
            replies = await asyncio.gather(*(v.stub.Generate(token_request(p, 32)) for p in prompts))
            assert engine.scheduler.policy.planner is not None and engine.scheduler.policy.planner.costs
        for p, r in zip(prompts, replies):
            assert list(r.output.token_ids) == reference_greedy(model, p, 32)

    asyncio.run(main())


def test_one_requests_history_does_not_stop_a_new_request_from_drafting() -> None:
    """Estimates are per request: a request whose drafts die after the first token
    does not teach a fresh one (which starts from an optimistic prior) to stop drafting."""
    costs = [0.0, 1.0, 1.73, 2.0, 2.0, 2.0, 2.0, 2.2, 2.2, 2.2]  # measured on a 2-core CPU
    p = planner(costs)
    p.plan([trained(8, 1, 20)], [8])
    assert p.plan([AcceptanceEstimate()], [8]) == [8]


# The verifier's curve for SmolLM2 on the idle 2-core CI VM (x one token, 1..17 tokens in a forward).
SMOLLM2_CPU = [0.0, 1.00, 1.14, 1.21, 1.45, 1.49, 1.53, 1.58, 1.64, 1.68, 1.74, 1.80, 1.83, 1.94, 2.01, 2.01, 2.01,
               2.06]


def test_one_miss_in_a_long_copy_does_not_make_drafts_short() -> None:
    """A step is one piece of evidence: its positions are not independent trials. Copying text, drafts of
    16 are accepted whole, then one dies at its third token; the next draft stays long."""
    estimate = trained(16, 16, 6)
    estimate.observe(16, 2)
    assert planner(SMOLLM2_CPU).plan([estimate], [16]) == [16]


def tree_curve(per_node: float, nodes: int = 16, steps: int = 10) -> AcceptanceEstimate:
    """An estimate whose 4-token chains had 3 tokens accepted, and whose verified trees had
    `per_node` tokens accepted beyond their first branch for every node after the fourth."""
    estimate = trained(4, 3, 10)
    for _ in range(steps):
        estimate.observe_tree([per_node * max(0, j - 4) for j in range(1, nodes + 1)])
    return estimate


# A CPU-like curve: flat to 6 tokens, then each token costs 5% of a step.
CPU = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] + [1.0 + 0.05 * t for t in range(1, 60)]


def test_trees_where_their_nodes_pay_at_the_measured_cost() -> None:
    assert planner(FLAT).plan_nodes([tree_curve(0.2)], [4], 12) == [12]
    assert planner(LINEAR).plan_nodes([tree_curve(0.2)], [4], 12) == [0], "a node costs a whole step"
    assert planner(FLAT).plan_nodes([tree_curve(0.0)], [4], 12) == [0], "side branches never accepted"
    assert planner(FLAT).plan_nodes([tree_curve(0.2)], [0], 12) == [0], "no chain, no tree"
    assert planner(FLAT).plan_nodes([tree_curve(0.01)], [4], 12) == [0], "0.01 tokens a node do not pay 1% of a step"
    # Each token beyond 6 costs 5% of a step: 0.25 tokens a node pay for 16 nodes; 0.2 would pay without
    # TREE_MARGIN, not with it.
    assert planner(CPU).plan_nodes([tree_curve(0.25)], [4], 16) == [16]
    assert planner(CPU).plan_nodes([tree_curve(0.2)], [4], 16) == [0]
    # A batch: the request whose trees pay gets the nodes, as many as still pay where a batch's
    # tokens beyond 16 cost 20% of a step each.
    mid = [0.0] + [1.0 + 0.05 * t for t in range(16)] + [1.8 + 0.2 * t for t in range(48)]
    assert planner(mid).plan_nodes([tree_curve(0.0), tree_curve(0.5)], [4, 4], 16) == [0, 11]


def test_trees_are_probed_after_chains_and_grow_only_where_their_nodes_pay() -> None:
    flat = planner(FLAT)
    estimate = trained(4, 2, 10)
    # No tree measured yet: a node is priced at BRANCH_PRIOR tokens, which does not beat the chain by
    # TREE_MARGIN; so a request starts on chains, as it would without trees.
    assert flat.plan_nodes([estimate], [4], 16) == [0] and planner(CPU).plan_nodes([estimate], [4], 16) == [0]
    for _ in range(PROBE_STEPS - 10):
        estimate.observe(4, 2)
    # After PROBE_STEPS chains, a probe: as large a tree as costs at most PROBE_COST times the chain, so
    # the curve gets measured (on a busy CPU a small one).
    assert flat.plan_nodes([estimate], [4], 16) == [14] and planner(CPU).plan_nodes([estimate], [4], 16) == [7]
    # Its side nodes paid 0.2 tokens each; sizes beyond those measured extend the curve at BRANCH_PRIOR a
    # node: worth it where a node costs 1% of a step, not where it costs 5%.
    estimate.observe_tree([0, 0, 0, 0, 0.2, 0.4, 0.6, 0.8])
    assert flat.plan_nodes([estimate], [4], 16) == [16] and planner(CPU).plan_nodes([estimate], [4], 16) == [0]
    for _ in range(5):  # trees whose side nodes earned nothing
        estimate.observe_tree([0] * 16)
    assert flat.plan_nodes([estimate], [4], 16) == [0], "back to the chain"
    for _ in range(PROBE_STEPS - 1):
        estimate.observe(4, 2)
    assert flat.plan_nodes([estimate], [4], 16) == [0]
    estimate.observe(4, 2)
    # A probe, to measure the curve again: as large a tree as costs at most 10% more than the chain.
    assert flat.plan_nodes([estimate], [4], 16) == [14]
    assert planner(CPU).plan_nodes([estimate], [4], 16) == [7]
    estimate.observe_tree([0] * 14)
    assert flat.plan_nodes([estimate], [4], 16) == [0]


def test_policy_tree_budgets_and_what_it_learns_from_a_tree() -> None:
    fixed = SpeculationPolicy(max_draft_len=4, max_draft_nodes=10)
    assert fixed.plan_nodes([SpecState(), SpecState()], [4, 0]) == [10, 0]
    assert SpeculationPolicy(max_draft_len=4).plan_nodes([SpecState()], [4]) == [0], "trees off: chains"
    adaptive = SpeculationPolicy(max_draft_len=4, planner=planner(FLAT), max_draft_nodes=6)
    state = SpecState()
    assert adaptive.plan_nodes([state], [4]) == [0] and state.node_budget == 0, "no tree measured: a chain"
    state.acceptance.chains_in_a_row = PROBE_STEPS
    assert adaptive.plan_nodes([state], [4]) == [6] and state.node_budget == 6, "a probe"
    # Nodes best first: 1, 2 | 5 (sibling of 2), 7 (child of 5); first branch 1, 2. The target went
    # 1, 5, 7, 8: the first branch had 1 accepted, the first node alone 1, the first three 2, all four
    # 3; a budget of 6 got 4 nodes.
    adaptive.observe(state, 3, 3)  # the scheduler reports the tree's depth and path ...
    adaptive.observe_tree(state, [1, 2, 5, 7], [-1, 0, 0, 2], [1, 5, 7, 8])
    # ... which the chain estimate does not take; it takes what the first branch (the chain) would have
    # had: 1 of 2 accepted.
    expected = AcceptanceEstimate()
    expected.observe(2, 1)
    assert (state.acceptance.first, state.acceptance.later) == (expected.first, expected.later)
    first = state.acceptance.first.value
    assert [r.hits for r in state.acceptance.tree] == [0, 0, 1, 2, 2, 2]
    assert state.node_budget == 0 and state.acceptance.chains_in_a_row == 0
    # A chain-shaped tree arrives as a chain; it still counts as the tree it was asked for.
    adaptive.plan_nodes([state], [4])
    adaptive.observe_tree(state, [1, 2], [], [1, 2, 9])
    assert [round(r.hits, 2) for r in state.acceptance.tree][:4] == [-1, 0, 0.85, 1.7]
    # A chain asked for (budget 0) feeds the chain estimate, not the tree curve.
    adaptive.observe(state, 2, 2)
    adaptive.observe_tree(state, [1, 2], [], [1, 2, 9])
    assert state.acceptance.first.value > first and state.acceptance.chains_in_a_row == 1
    assert [round(r.hits, 2) for r in state.acceptance.tree][:4] == [-1, 0, 0.85, 1.7]
