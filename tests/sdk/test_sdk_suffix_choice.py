"""The suffix drafter's choice between its two trees, learned from what the verifier accepted: trials
settle only once the committed tokens decide both drafts, the longer-match rule holds until evidence
outweighs it, and a drafter whose global tree's longer match keeps failing turns to its own tree."""

from __future__ import annotations

import pytest
from test_sdk_suffix import finish, request

from drafter_sdk.drafter import ReleaseReason
from drafter_sdk.drafters import suffix_choice
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.drafters.suffix_choice import ChoiceTable, Trial, accepted, bucket, pending_trials


def test_a_draft_is_settled_only_once_the_committed_tokens_decide_it() -> None:
    tokens = [7, 7, 1, 2]
    assert accepted([1, 2, 3], tokens, 2) is None  # the third token is not committed yet
    assert accepted([1, 2, 3], tokens + [3], 2) == 3
    assert accepted([1, 2, 3], tokens + [9, 3], 2) == 2
    assert accepted([1, 5, 3], tokens, 2) == 1  # decided by a mismatch within what is committed
    assert accepted([], tokens, 4) == 0


def test_match_lengths_are_bucketed_exactly_up_to_four() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 7, 8, 15, 16, 24)] == [1, 2, 3, 4, 5, 5, 8, 8, 16, 16]


def test_the_longer_match_rule_holds_until_the_evidence_outweighs_it() -> None:
    table = ChoiceTable()
    assert not table.own_wins(3, 5, own_scores_as_much=True)  # the longer match
    assert table.own_wins(5, 3, own_scores_as_much=False)
    assert table.own_wins(2, 2, own_scores_as_much=True) and not table.own_wins(2, 2, own_scores_as_much=False)
    # Own drafts after (3, 5) were accepted 2 tokens more, three times: 6 < 4 tokens a length difference * 2.
    pending = pending_trials()
    committed = [0, 1, 2, 9]
    for _ in range(3):
        pending.append(Trial(1, (3, 5), [1, 2, 3], [5]))
    table.learn(pending, committed)
    assert not pending and not table.own_wins(3, 5, True)
    pending.append(Trial(1, (3, 5), [1, 2, 9], [5]))
    table.learn(pending, committed)
    assert table.own_wins(3, 5, True)  # 8.4 tokens of evidence (decayed): more than the rule's 8
    assert not table.own_wins(3, 6, True)  # a pair of the same buckets but a longer difference
    assert not table.own_wins(2, 5, True)  # another pair: nothing learned there


def test_the_shortest_rival_follows_what_the_table_learns() -> None:
    table = ChoiceTable()
    # Rule alone: after a global match of 5, an own match of 5 (a tie, the own tree scoring more) could win.
    assert table.shortest_rival(5, own=False, longest=24) == 5
    assert table.shortest_rival(3, own=True, longest=24) == 3  # and a global match of 3 against an own 3
    assert table.shortest_rival(3, own=True, longest=2) == 3  # none within the longest possible: longest + 1
    pending = pending_trials()
    for _ in range(4):  # own drafts after (3, 5) accepted 3 tokens more each time: evidence past the rule's 8
        pending.append(Trial(1, (3, 5), [1, 2, 3], [5]))
    table.learn(pending, [0, 1, 2, 3])
    assert table.shortest_rival(5, own=False, longest=24) == 3  # asked before, answered anew
    assert table.shortest_rival(3, own=True, longest=24) == 3


def test_unsettled_trials_wait_and_at_most_max_pending_are_kept() -> None:
    table, pending = ChoiceTable(), pending_trials()
    for at in range(suffix_choice.MAX_PENDING + 5):
        pending.append(Trial(at, (1, 2), [1], [2]))
    assert len(pending) == suffix_choice.MAX_PENDING and pending[0].at == 5  # the oldest dropped
    table.learn(pending, [0] * 20)  # trials at 20 and later have no committed token yet
    assert [t.at for t in pending] == list(range(20, suffix_choice.MAX_PENDING + 5))
    assert table.gains == {(1, 2): pytest.approx(0.0)}  # each settled with both drafts rejected


TEMPLATE = [1, 2, 3, 4]  # boilerplate every earlier answer continued with 5, 6, 7, 8


def _serve(drafter: SuffixDrafter, rid: str) -> list[int]:
    """A request whose own context wrote [3, 4, 20, 21, 22, 23, 9] and which, after the template,
    goes on as its own context did: the global tree's 4-token match drafts 5, 6, 7, 8, wrongly, and its
    own tree's 2-token match ([3, 4]) drafts 20, 21, 22, 23, 9, which the target then commits."""
    prompt = [40, 3, 4, 20, 21, 22, 23, 9]
    context = prompt + TEMPLATE
    [draft] = drafter.prepare_draft_tokens([request(rid, context, prompt_len=len(prompt))])
    drafter.prepare_draft_tokens([request(rid, context + [20, 21, 22, 23, 9, 60], len(prompt), draft_len=0)])
    drafter.on_release(("v", rid), ReleaseReason.CANCELLED)  # not learned: the global tree stays as it was
    return draft[:4]


@pytest.mark.parametrize("learn_choice", [True, False])
def test_a_global_match_that_keeps_failing_loses_to_the_own_tree(learn_choice: bool) -> None:
    drafter = SuffixDrafter(learn_choice=learn_choice)
    for i in range(3):
        finish(drafter, f"old{i}", [9], TEMPLATE + [5, 6, 7, 8])
    drafts = [_serve(drafter, f"r{i}") for i in range(3)]
    # Each trial: own 5 accepted, global 0. Two outweigh the rule's 4 tokens * (4 - 2) = 8.
    own, shared = [20, 21, 22, 23], [5, 6, 7, 8]
    assert drafts == ([shared, shared, own] if learn_choice else [shared] * 3)
    # What it learned is shared by every request in the scope; another verifier's scope starts afresh.
    assert drafter.prepare_draft_tokens([request("other", [40, 3, 4, 20, 21, 22, 23, 9] + TEMPLATE, 8,
                                                 verifier="w")])[0][:4] == (own if learn_choice else shared)
    scoped = SuffixDrafter(cache_scope="verifier")
    for i in range(3):
        finish(scoped, f"old{i}", [9], TEMPLATE + [5, 6, 7, 8])
        finish(scoped, f"old{i}", [9], TEMPLATE + [5, 6, 7, 8], verifier="w")
    assert [_serve(scoped, f"r{i}") for i in range(3)][-1] == own
    assert scoped.prepare_draft_tokens([request("x", [40, 3, 4, 20, 21, 22, 23, 9] + TEMPLATE, 8,
                                                verifier="w")])[0][:4] == shared


def test_a_context_asked_again_is_one_trial_and_trials_count_in_its_state() -> None:
    drafter = SuffixDrafter()
    finish(drafter, "old", [9], TEMPLATE + [5, 6, 7, 8])
    prompt = [40, 3, 4, 20, 21, 22, 23, 9]
    before = None
    for _ in range(3):
        drafter.prepare_draft_tokens([request("r", prompt + TEMPLATE, prompt_len=len(prompt))])
        before = before or drafter.state_bytes(("v", "r"))
    assert len(drafter._requests[("v", "r")].trials) == 1
    no_trials = SuffixDrafter(learn_choice=False)
    finish(no_trials, "old", [9], TEMPLATE + [5, 6, 7, 8])
    no_trials.prepare_draft_tokens([request("r", prompt + TEMPLATE, prompt_len=len(prompt))])
    assert before > no_trials.state_bytes(("v", "r"))


def test_trials_are_dropped_once_their_global_tree_is_evicted() -> None:
    drafter = SuffixDrafter(max_cached_requests=1, cache_scope="verifier")
    finish(drafter, "old", [9], TEMPLATE + [5, 6, 7, 8])
    prompt = [40, 3, 4, 20, 21, 22, 23, 9]
    drafter.prepare_draft_tokens([request("r", prompt + TEMPLATE, prompt_len=len(prompt))])
    finish(drafter, "w-old", [9], [1, 1, 1], verifier="w")  # evicts verifier v's only output, and its table
    assert "v" not in drafter._choices
    drafter.prepare_draft_tokens([request("r", prompt + TEMPLATE + [20], prompt_len=len(prompt))])
    assert not drafter._requests[("v", "r")].trials


def test_a_request_copying_its_own_context_searches_the_global_tree_only_to_recheck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = SuffixDrafter()
    finish(drafter, "old", [9], [70, 71, 72, 73, 74, 75])
    searched = []
    theirs = drafter._theirs
    monkeypatch.setattr(drafter, "_theirs", lambda *a: searched.append(1) or theirs(*a))
    text = list(range(100, 140))
    context = text + text[:4]
    steps = 2 * suffix_choice.RECHECK_EVERY
    for i in range(steps):  # it goes on copying: its own tree's long match wins every step
        [draft] = drafter.prepare_draft_tokens([request("copy", context + text[4:4 + i], prompt_len=len(text))])
        assert draft[:1] == [text[4 + i]]
    assert len(searched) == 1 + steps // suffix_choice.RECHECK_EVERY  # the first step, then each recheck
