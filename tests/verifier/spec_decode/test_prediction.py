"""A predicted output as a draft source: it drafts its next tokens while the output follows it, stops where
the output leaves it, and finds its way back after an insertion, a deletion or a replacement, preferring the
place at or after where the output left to an earlier repeat of the same tokens."""

from __future__ import annotations

import random

from verifier_service.spec_decode.prediction import Prediction

PREDICTED = list(range(100, 130))  # 30 distinct tokens


def test_it_drafts_what_follows_the_output_in_the_prediction() -> None:
    p = Prediction(PREDICTED)
    assert p.draft([], 4) == PREDICTED[:4]
    assert p.draft(PREDICTED[:10], 4) == PREDICTED[10:14]
    assert p.draft(PREDICTED[:28], 4) == PREDICTED[28:]  # what is left
    assert p.draft(PREDICTED, 4) == []  # used up


def test_it_tells_whether_it_has_a_draft_before_one_is_asked_for() -> None:
    """The planner prices a draft the prediction gives without a drafter call."""
    p = Prediction(PREDICTED)
    assert p.drafts(PREDICTED[:10]) and p.draft(PREDICTED[:10], 2) == PREDICTED[10:12]
    assert not p.drafts(PREDICTED[:10] + [1])  # left it
    assert not Prediction(PREDICTED).drafts(PREDICTED)  # used up


def test_it_comes_back_after_an_edit() -> None:
    cases = {  # the output after its edit, and where in the prediction it stands then
        "insertion": (PREDICTED[:5] + [1, 2] + PREDICTED[5:7], 7),
        "deletion": (PREDICTED[:5] + PREDICTED[9:11], 11),
        "replacement": (PREDICTED[:5] + [1] + PREDICTED[6:8], 8),
    }
    for name, (output, at) in cases.items():
        p = Prediction(PREDICTED)
        assert p.draft(output[:6], 3) == [], name  # left the prediction: nothing to draft
        assert p.draft(output, 3) == PREDICTED[at:at + 3], name


def test_it_waits_until_two_tokens_match_again() -> None:
    p = Prediction(PREDICTED)
    assert p.draft(PREDICTED[:3] + [1, PREDICTED[3]], 2) == []  # one token is not enough to go on from
    assert p.draft(PREDICTED[:3] + [1, PREDICTED[3], PREDICTED[4]], 2) == PREDICTED[5:7]
    assert Prediction(PREDICTED).draft([1, 2, 3, 4], 2) == []  # never in it


def test_it_prefers_the_way_forward_to_an_earlier_repeat() -> None:
    repeated = [1, 2, 3, 7, 8, 4, 5, 6, 7, 8, 9, 10]  # "7 8" at 3-4 and at 8-9
    p = Prediction(repeated)
    assert p.draft([1, 2, 3, 7, 8, 4, 5, 50, 7, 8], 2) == [9, 10]  # left at 7: back in after it, not at 5
    p = Prediction(repeated)
    assert p.draft([1, 2, 3, 7, 8, 4, 5, 6, 7, 8, 9, 50, 7, 8], 2) == [9, 10]  # none after 11: the last before


def test_reading_step_by_step_equals_reading_at_once() -> None:
    rng = random.Random(0)
    for _ in range(200):
        predicted = [rng.randrange(12) for _ in range(rng.randrange(1, 40))]
        output = [rng.choice([rng.randrange(12), *predicted[:3]]) for _ in range(rng.randrange(40))]
        stepped, whole = Prediction(predicted), Prediction(predicted)
        cut = 0
        while cut < len(output):
            cut += rng.randrange(1, 6)
            stepped.draft(output[:cut], 5)
        assert stepped.draft(output, 5) == whole.draft(output, 5)
