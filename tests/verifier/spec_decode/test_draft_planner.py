"""The adaptive draft-length planner: long drafts where they pay, none where they do not."""

from __future__ import annotations

import asyncio
import time

import pytest
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import OracleDrafter, serve_drafter, shared_model

from drafter_sdk import DraftRequest
from verifier_service.engine.step_clock import StepClock
from verifier_service.model.step_costs import CostCurve
from verifier_service.spec_decode.planner import FREE_CALLS, PROBE_STEPS, AcceptanceEstimate, DraftPlanner, StepPrice
from verifier_service.spec_decode.policy import DraftSizes, SpecState, SpeculationPolicy

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
    sizes = policy.plan(states, [3, 20, 8])
    assert (sizes.lengths, sizes.asks, sizes.call_saved) == ([3, 8, 0], [3, 8, 0], False)


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
    # Where each step also waits two forwards for the drafter's call (made with a chain or a tree alike),
    # 12 more nodes are a smaller share of the step: 0.2 tokens a node pay.
    assert planner(CPU).plan_nodes([tree_curve(0.2)], [4], 16, StepPrice(call=2.0)) == [16]
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


# --- the drafter call, priced ---------------------------------------------------------------------------------


def test_a_call_that_costs_more_than_its_drafts_gain_is_not_made() -> None:
    """Priced in one-token forwards: a draft that pays for its verify tokens but not for the drafter call
    beside them is not drafted; drafts that are nearly always accepted still pay for a costly call."""
    p = planner(SMOLLM2_CPU)
    middling = trained(4, 1, 10)  # its first token accepted, never a second
    assert p.plan([middling], [4]) == [1], "free calls: one token pays for its 14% of a step"
    assert p.plan([middling], [4], StepPrice(call=1.0)) == [0]
    assert p.plan([trained(8, 8, 10)], [8], StepPrice(call=2.0)) == [8]
    assert p.plan([trained(8, 8, 10)], [8], StepPrice(call=10.0)) == [0], "no draft pays 10 forwards"
    # A batch pays one call: two requests that each could not pay for it alone can together.
    assert p.plan([trained(4, 2, 10)], [4], StepPrice(call=1.4)) == [0]
    assert p.plan([trained(4, 2, 10)] * 2, [4] * 2, StepPrice(call=1.4)) == [4, 4]


def test_a_drafter_that_mostly_answers_nothing_is_priced_by_what_it_brings() -> None:
    """Where calls are free, how often the drafter answers with a draft changes nothing for a request alone
    (its tokens are verified only when one comes); where a call costs, the calls that bring nothing count."""
    p = planner(SMOLLM2_CPU)
    good, rarely = trained(8, 8, 10), trained(8, 8, 10)
    for _ in range(6):
        rarely.observe_answer(False)
    assert rarely.answered.value < 0.1
    assert p.plan([good], [8]) == p.plan([rarely], [8]) == [8]
    assert p.plan([good], [8], StepPrice(call=2.0)) == [8]
    assert p.plan([rarely], [8], StepPrice(call=2.0)) == [0]
    policy, state = SpeculationPolicy(8, planner=p), SpecState()
    policy.observe_answer(state, 8, [])
    assert state.shadow_wait == 2 and not state.acceptance.fresh, "no draft: the next shadow waits, as after a miss"
    before = state.acceptance.answered.value
    policy.observe_answer(state, 0, [])
    assert state.shadow_wait == 2 and state.acceptance.answered.value == before, "not asked: nothing learnt"


def test_the_steps_own_work_counts_for_plain_decoding_too() -> None:
    """Where every verified token costs a whole forward, drafting never pays, unless each step also
    costs the same fixed work however many tokens it verifies, which a longer draft shares out."""
    assert planner(LINEAR).plan([trained(8, 8, 10)], [8]) == [0]
    assert planner(LINEAR).plan([trained(8, 8, 10)], [8], StepPrice(fixed=3.0)) == [8]


def test_a_fresh_request_is_planned_as_if_the_call_were_free() -> None:
    """Its first call is made anyway (its first draft or shadow): a slow drafter is tried before it is
    priced out, and the other requests of the batch plan with the call already paid."""
    p = planner(SMOLLM2_CPU)
    assert p.plan([AcceptanceEstimate()], [8], StepPrice(call=3.0)) != [0]
    assert p.plan([trained(8, 8, 10), AcceptanceEstimate()], [8, 8], StepPrice(call=10.0))[0] == 8
    assert p.plan([AcceptanceEstimate()], [0], StepPrice(call=3.0)) == [0]


def test_a_draft_that_needs_no_call_is_not_charged_one() -> None:
    """A request's prediction drafts for it without a drafter call: its drafts pay for their verify tokens
    alone, whatever a call costs, and a batch whose other requests cannot pay for the call still drafts
    for it (and only for it)."""
    p = planner(SMOLLM2_CPU)
    middling = trained(4, 1, 10)
    assert p.plan([middling], [4], StepPrice(call=1.0)) == [0]
    assert p.plan([middling], [4], StepPrice(call=1.0), calls=[False]) == [1]
    assert p.plan([middling, trained(4, 1, 10)], [4, 4], StepPrice(call=1.0), calls=[True, False]) == [0, 1]
    # Where a call pays for itself, the drafts from it and from the prediction go together.
    assert p.plan([trained(8, 8, 10), middling], [8, 4], StepPrice(call=2.0), calls=[True, False]) == [8, 1]


def shadow_steps(policy: SpeculationPolicy, states: list[SpecState], price: StepPrice, steps: int,
                 hits: set[int] = frozenset()) -> list[DraftSizes]:
    """`steps` steps of non-drafting requests: each shadow draft asked for misses, except at the steps in `hits`."""
    sizes = []
    for i in range(steps):
        sizes.append(policy.plan(states, [8] * len(states), price))
        for state, ask in zip(states, sizes[-1].asks):
            policy.observe(state, 0, 0)
            policy.observe_shadow(state, [7] * ask, 7 if i in hits else 8)
    return sizes


def test_where_none_drafts_shadows_back_off_to_the_interval() -> None:
    policy = SpeculationPolicy(8, planner=planner(SMOLLM2_CPU))

    def missing() -> list[SpecState]:
        states = [SpecState(), SpecState()]
        for state in states:
            state.acceptance = trained(8, 0, 10)
        return states

    # Free calls: a shadow every step, as before calls were priced.
    assert all(step == DraftSizes([0, 0], [8, 8], False) for step in shadow_steps(policy, missing(), FREE_CALLS, 5))
    price = StepPrice(fixed=0.06, call=0.6)
    interval = policy.planner.shadow_interval(2, price)
    assert interval == 25, "0.6 forwards a call; shadows may cost 2% of 1.2 forwards a step"
    # Each miss doubles the wait, up to the interval; both requests score theirs in the same call.
    states = missing()
    sizes = shadow_steps(policy, states, price, 140)
    asked = [i for i, step in enumerate(sizes) if any(step.asks)]
    assert asked == [0, 2, 6, 14, 30, 55, 80, 105, 130]
    assert all(sizes[i].asks == [8, 8] for i in asked)
    assert all(step.lengths == [0, 0] and step.call_saved != (i in asked) for i, step in enumerate(sizes))
    # A hit halves the wait: predictable text is noticed sooner.
    sizes = shadow_steps(policy, missing(), price, 40, hits={14})
    assert [i for i, step in enumerate(sizes) if any(step.asks)] == [0, 2, 6, 14, 18, 26]
    # Its feedback to the drafter describes the answer to the last call asked for it, not a step without one.
    states[0].steps_unasked = 0  # asked for a draft: 8 tokens verified, 3 accepted
    policy.observe(states[0], 8, 3)
    states[0].shadow_wait = 4  # its next shadow in 4 steps
    shadow_steps(policy, states[:1], price, 1)
    assert states[0].steps_unasked == 1 and (states[0].last_num_drafted, states[0].last_num_accepted) == (8, 3)
    # A request that drafts has the call made: every other request's shadow rides along.
    states[0].acceptance = trained(8, 8, 10)
    step = policy.plan(states, [8, 8], price)
    assert step.lengths == [8, 0] and step.asks == [8, 8] and not step.call_saved
    assert states[1].steps_unasked == 0
    # A fresh request is asked for a draft at once, however costly the call; the other's shadow rides along.
    first = policy.plan([states[1], SpecState()], [8, 8], StepPrice(fixed=0.06, call=30.0))
    assert first.lengths[0] == 0 and first.asks[0] == 8 and first.asks[1] > 0 and not first.call_saved


def test_a_predictions_drafts_alone_do_not_have_the_call_made_for_shadows() -> None:
    """A step whose only verified drafts are a prediction's makes no call unless a shadow is due: the shadows
    ride along free only where the call is made anyway."""
    policy = SpeculationPolicy(8, planner=planner(SMOLLM2_CPU))
    predicted, unpredictable = SpecState(), SpecState()
    predicted.acceptance, unpredictable.acceptance = trained(8, 8, 10), trained(8, 0, 10)
    unpredictable.shadow_wait = 8  # its last shadows missed
    price = StepPrice(fixed=0.06, call=30.0)
    step = policy.plan([predicted, unpredictable], [8, 8], price, calls=[False, True])
    assert step.lengths == [8, 0] and step.asks == [8, 0] and step.call_saved
    assert unpredictable.steps_unasked == 1
    # Once its shadow is due, it is asked for one.
    unpredictable.steps_unasked = 7
    step = policy.plan([predicted, unpredictable], [8, 8], price, calls=[False, True])
    assert step.asks == [8, 8] and not step.call_saved


def test_the_step_clock_prices_a_step_in_one_token_forwards() -> None:
    clock = StepClock(planner(SMOLLM2_CPU).costs, one_token_s=0.020)
    assert clock.price() == FREE_CALLS, "nothing measured yet"
    clock.step(outside_forward_s=0.012, drafter_s=0.010, called=True)  # 2 ms of the step's own work
    assert clock.price().fixed == pytest.approx(0.1) and clock.price().call == pytest.approx(0.5)
    clock.step(outside_forward_s=0.002, drafter_s=0.0, called=False)  # no call: the call's price stays
    assert clock.price().fixed == pytest.approx(0.1) and clock.price().call == pytest.approx(0.5)
    for _ in range(60):  # the drafter got faster: its price follows within a few dozen steps
        clock.step(outside_forward_s=0.003, drafter_s=0.001, called=True)
    assert clock.price().call == pytest.approx(0.05, rel=0.05)
    # Forwards slower than at start-up (a busier machine) price the same seconds as fewer forwards; faster
    # ones (a GPU's, returning before the device is done) do not make them more.
    clock.forward(0.040 * SMOLLM2_CPU[4], 4)
    assert clock.price().call == pytest.approx(0.05 / 2, rel=0.05)
    fast = StepClock(planner(SMOLLM2_CPU).costs, one_token_s=0.020, call_s=0.010)
    fast.forward(0.001, 1)
    assert fast.price().call == pytest.approx(0.5)
    assert StepClock(planner(SMOLLM2_CPU).costs, one_token_s=0.0).price() == FREE_CALLS


class SlowOracle(OracleDrafter):
    """An OracleDrafter (drafts right, or wrong with probability `corrupt`) whose every call takes
    `delay_s` more: a drafter far away, or doing costly work."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], corrupt: float, delay_s: float) -> None:
        super().__init__(references, corrupt=corrupt)
        self.delay_s = delay_s

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        time.sleep(self.delay_s)
        return super().prepare_draft_tokens(requests)


PRICING_PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]


async def _generate_through(drafter: SlowOracle, new_tokens: int) -> tuple[list[list[int]], int, float, int]:
    """The prompts' outputs through a verifier with the adaptive planner calling `drafter` remotely, its
    decode steps, the steps it counted as calls saved, and the draft tokens it accepted."""
    async with serve_drafter(drafter) as running:
        config = spec_config("USER_PROVIDED", 8, f"127.0.0.1:{running.port}", 2000, adaptiveDraftLen=True)
        async with run_verifier(config, model=shared_model(), metrics_port=0) as v:
            replies = await asyncio.gather(*(v.stub.Generate(token_request(p, new_tokens)) for p in PRICING_PROMPTS))
            engine = v.running.runtime.engine
            registry = v.running.metrics.registry
            saved = registry.get_sample_value("splitspec:drafter_calls_saved_total")
            # The call's price the planner used, in one-token forwards: exported as measured.
            assert registry.get_sample_value("splitspec:drafter_call_cost_forwards") == engine.step_price.call > 0
            accepted = sum(r.output.stats.num_accepted_tokens for r in replies)
            return [list(r.output.token_ids) for r in replies], engine.decode_steps, saved, accepted


def test_a_slow_drafter_that_is_never_right_is_priced_out() -> None:
    """Each call takes 50 ms, many one-token forwards of the test model, and no draft is ever accepted: after
    each request's first draft the verifier decodes plainly, with the same output, and calls only to score
    a shadow draft, ever more rarely (after 1, 2, 4, 8, 16 and 32 steps: 7 calls in 48 tokens)."""
    references = {tuple(p): reference_greedy(shared_model(), p, 48) for p in PRICING_PROMPTS}
    drafter = SlowOracle(references, corrupt=1.0, delay_s=0.05)
    outputs, steps, saved, _ = asyncio.run(_generate_through(drafter, 48))
    assert outputs == [references[tuple(p)] for p in PRICING_PROMPTS]
    assert steps >= 47 and len(drafter.calls) <= 12, f"{len(drafter.calls)} calls in {steps} steps"
    assert saved >= steps - len(drafter.calls) - len(PRICING_PROMPTS)  # the last step of each wants no draft


def test_a_slow_drafter_whose_drafts_are_accepted_is_still_called() -> None:
    """A call of 2 ms, a few of the test model's forwards, with drafts always right: they pay for it, so the
    verifier drafts on, most of the output accepted from drafts. (Not the drafter's feedback check: where a
    busy machine makes a step score a shadow, the verifier rightly reports (0, 0) for it, which the drafter
    cannot tell from a verified draft.)"""
    references = {tuple(p): reference_greedy(shared_model(), p, 48) for p in PRICING_PROMPTS}
    drafter = SlowOracle(references, corrupt=0.0, delay_s=0.002)
    outputs, steps, saved, accepted = asyncio.run(_generate_through(drafter, 48))
    assert outputs == [references[tuple(p)] for p in PRICING_PROMPTS]
    assert accepted >= 48 and steps <= 40 and saved < steps, f"{accepted} accepted in {steps} steps, {saved} saved"
