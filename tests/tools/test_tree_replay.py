"""The offline tree replay: exact tokens per step from recorded greedy outputs, no model."""

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from verifier_service.model.step_costs import CostCurve
from verifier_service.tools.bench.tree_replay import _selected, replay


def test_replay_counts_accepted_paths_against_the_recorded_output():
    # The output repeats its prompt: a chain copies 4 tokens a step, plus the target's own.
    records = [{"workload": "copy", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "output": [1, 2, 3, 4, 5, 6, 7, 8, 9]}]
    (chain,) = replay(records, lambda: NgramDrafter(max_draft_len=4), 4, 0)
    assert chain.workload == "copy" and chain.tokens_per_step == 8 / 2 and chain.verified_per_step == 4
    # Two steps of 1 + 4 tokens, at 20 ms each when one token costs 10 ms: 8 tokens in 40 ms.
    (timed,) = replay(records, lambda: NgramDrafter(max_draft_len=4), 4, 0, CostCurve.from_seconds({1: 10, 5: 20}), 10)
    assert timed.modelled_tok_s == 8 / 0.040
    # [1, 2] was followed by 3 and, later, by 7; the output takes the older branch, which the newest-first
    # chain misses (3 tokens in 2 steps) and the tree holds (3, 9 accepted, then the target's 4: 1 step).
    records = [{"workload": "branch", "prompt": [1, 2, 3, 9, 1, 2, 7, 9, 1], "output": [2, 3, 9, 4]}]
    (chain,) = replay(records, lambda: NgramDrafter(max_draft_len=2, is_use_oldest=False), 2, 0)
    (tree,) = replay(records, lambda: NgramDrafter(max_draft_len=2), 2, 8)
    assert (chain.tokens_per_step, tree.tokens_per_step) == (1.5, 3.0) and tree.verified_per_step <= 8


def test_planner_replay_sizes_drafts_from_the_cost_curve():
    """With --planner the verifier's policy sizes every draft: long where verifying is nearly free, none
    where a verified token costs a whole step (only unverified shadow drafts then)."""
    text = list(range(100, 140))
    records = [{"workload": "copy", "prompt": text + list(range(200, 220)), "output": text}]
    flat = CostCurve.from_seconds({1: 10, 17: 10.5})
    linear = CostCurve.from_seconds({1: 10, 17: 170})
    for nodes in (0, 8):
        (cheap,) = replay(records, lambda: NgramDrafter(max_draft_len=8), 8, nodes, flat, 10, planner=True)
        (costly,) = replay(records, lambda: NgramDrafter(max_draft_len=8), 8, nodes, linear, 10, planner=True)
        assert cheap.tokens_per_step > 4 and cheap.verified_per_step > 4
        assert (costly.tokens_per_step, costly.verified_per_step) == (1.0, 0.0)


def test_select_keeps_the_chosen_prompts_of_every_workload():
    records = [{"workload": w, "name": f"{w}{i}"} for w in ("a", "b") for i in range(4)]
    assert [r["name"] for r in _selected(records, "1,3")] == ["a1", "a3", "b1", "b3"]
    assert _selected(records, None) == records


def test_a_learning_drafter_replays_every_record_in_order_and_learns_each_output():
    """learn=True: one suffix drafter for all records, each released FINISHED, so an answer given once is
    drafted whole the next time (the first time it has nothing to copy: one token a step)."""
    answer = list(range(300, 340))
    records = [{"workload": "recurring", "prompt": [7, 8, 9], "output": answer} for _ in range(2)]
    (apart,) = replay(records, SuffixDrafter, 8, 0)
    (learned,) = replay(records, SuffixDrafter, 8, 0, learn=True)
    assert apart.tokens_per_step == 1.0
    # The second record: 39 tokens after the first, drafted from the first answer; the first: 1 a step.
    assert learned.tokens_per_step > 1.5


def test_lookahead_counts_the_steps_the_rest_of_the_last_answer_covers():
    # A copy: asked for 2k + 1 = 5, each answer's last 2 tokens are the next step's draft once its first 2
    # are accepted and the target's token is its third; every step but the first is covered.
    records = [{"workload": "copy", "prompt": list(range(1, 13)), "output": list(range(1, 13))}]
    (plain,) = replay(records, lambda: NgramDrafter(max_draft_len=8), 2, 0)
    (ahead,) = replay(records, lambda: NgramDrafter(max_draft_len=8), 2, 0, lookahead=True)
    assert ahead.lookahead == 3 / 4 and plain.lookahead == 0
    assert ahead.tokens_per_step == plain.tokens_per_step  # on a copy, what is left is the fresh draft
