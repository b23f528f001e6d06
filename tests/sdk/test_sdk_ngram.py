"""NgramDrafter: hand-worked examples of every knob, and incremental == from-scratch == TensorRT-LLM's rules."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_sdk import CACHE_SALT, DraftRequest, NgramDrafter, SamplingHints
from drafter_sdk.proto import drafter_pb2 as pb
from sdk_support import seq, serving

KEY = ("v", "r")


def draft(tokens, draft_len=8, key=KEY, **knobs):
    return NgramDrafter(**knobs).draft(key, tokens, draft_len)


def reference_draft(tokens, max_draft_len, max_matching_ngram_size, is_keep_all, is_use_oldest):
    """TensorRT-LLM's NGramPoolManager rules applied to the whole history in one pass (slow, obvious)."""
    n, pool = len(tokens), {}
    sizes = range(min(max_matching_ngram_size, n - 1), 0, -1)
    for size in sizes:
        for l in range(n - size):
            pattern = tuple(tokens[l:l + size])
            match = tuple(tokens[l + size:min(l + size + max_draft_len, n)])
            matches = pool.get(pattern)
            if is_keep_all:
                if matches is None:
                    pool[pattern] = [match]
                elif match not in matches:  # a new match evicts the shorter ones
                    pool[pattern] = [m for m in matches if len(m) >= len(match)] + [match]
            elif matches is None or len(match) >= len(matches[0]):  # only the latest of the longest
                pool[pattern] = [match]
    for size in sizes:
        matches = pool.get(tuple(tokens[n - size:]))
        if matches:
            return list(matches[0] if is_use_oldest or not is_keep_all else matches[-1])
    return []


def test_longest_matching_suffix_wins():
    history = [2, 7, 7, 7, 1, 2, 4, 4, 4, 9, 1, 2]
    # (1, 2) was followed by 4 4 4; the bare (2,) first by 7 7 7.
    assert draft(history, max_draft_len=3, max_matching_ngram_size=2) == [4, 4, 4]
    assert draft(history, max_draft_len=3, max_matching_ngram_size=1) == [7, 7, 7]


def test_no_match_is_an_empty_draft():
    assert draft([1, 2, 3, 4]) == []
    assert draft([5]) == []
    assert draft([]) == []


def test_continuations_are_capped_by_max_draft_len_and_draft_len():
    history = [1, 2, 3, 4, 5, 6, 1]
    assert draft(history, max_draft_len=3) == [2, 3, 4]
    assert draft(history, draft_len=2, max_draft_len=8) == [2, 3]
    assert draft(history, max_draft_len=8) == [2, 3, 4, 5, 6, 1]  # still growing at the tail


# (2,) is followed by A = 7 7 7, then B = 4 4 4, then A again.
A_B = [2, 7, 7, 7, 2, 4, 4, 4, 9, 2]
A_B_A = [2, 7, 7, 7, 2, 4, 4, 4, 2, 7, 7, 7, 2]


@pytest.mark.parametrize("history, is_keep_all, is_use_oldest, expected", [
    (A_B, True, True, [7, 7, 7]),     # oldest continuation
    (A_B, True, False, [4, 4, 4]),    # newest continuation
    (A_B_A, True, False, [4, 4, 4]),  # newest = most recently seen *for the first time* (an ordered set)
    (A_B, False, True, [4, 4, 4]),    # one continuation kept: the latest; is_use_oldest has nothing to pick
    (A_B_A, False, True, [7, 7, 7]),
])
def test_keep_all_and_use_oldest(history, is_keep_all, is_use_oldest, expected):
    assert draft(history, max_draft_len=3, max_matching_ngram_size=1,
                 is_keep_all=is_keep_all, is_use_oldest=is_use_oldest) == expected


@pytest.mark.parametrize("is_keep_all, is_use_oldest, expected", [
    (True, True, [1, 1, 1]),   # the complete continuation was seen first
    (True, False, [6, 5]),     # the newest one is still growing at the tail
    (False, True, [1, 1, 1]),  # the longest one is kept
])
def test_continuations_still_growing_at_the_tail(is_keep_all, is_use_oldest, expected):
    history = [5, 1, 1, 1, 5, 6, 5]
    assert draft(history, max_draft_len=3, max_matching_ngram_size=1,
                 is_keep_all=is_keep_all, is_use_oldest=is_use_oldest) == expected


def test_public_pool_shares_continuations_across_requests():
    for public, expected in ((True, [1, 4, 1]), (False, [])):
        drafter = NgramDrafter(max_draft_len=3, max_matching_ngram_size=1, is_public_pool=public)
        drafter.draft(("v", "teacher"), [3, 1, 4, 1, 5], 3)
        assert drafter.draft(("w", "student"), [9, 3], 3) == expected


def test_a_salted_request_keeps_a_pool_of_its_own_beside_a_public_one():
    """With a cache salt it neither drafts from the public pool nor feeds it, and drafts from its own history."""
    def ask(drafter, key, tokens, salt=""):  # noqa: ANN001, ANN202
        [out] = drafter.prepare_draft_tokens([DraftRequest(*key, tokens, 1, 3, 0, 0, SamplingHints(),
                                                           cache_salt_id=salt)])
        return out

    drafter = NgramDrafter(max_draft_len=3, max_matching_ngram_size=1, is_public_pool=True)
    assert CACHE_SALT in drafter.capabilities
    ask(drafter, ("v", "salted"), [3, 7, 7, 7, 8], salt="ab")  # first: the pool proposes the oldest it holds
    ask(drafter, ("v", "teacher"), [3, 1, 4, 1, 5])
    assert ask(drafter, ("v", "salted-student"), [9, 3], salt="ab") == []
    assert ask(drafter, ("v", "student"), [9, 3]) == [1, 4, 1]  # not 7 7 7: the salted one taught nothing
    assert ask(drafter, ("v", "salted-copy"), [2, 6, 2], salt="ab") == [6, 2]


def test_on_release_forgets_the_request():
    drafter = NgramDrafter(max_draft_len=3, max_matching_ngram_size=1)
    assert drafter.draft(KEY, [1, 2, 3, 4, 1], 3) == [2, 3, 4]
    drafter.on_release(KEY)
    # A stale pool would still propose 2 3 4 for this unrelated history of the same key.
    assert drafter.draft(KEY, [1, 9, 1], 3) == [9, 1]


def test_invalid_knobs_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(max_draft_len=0)
    with pytest.raises(ValueError):
        NgramDrafter(max_matching_ngram_size=0)


def test_incremental_updates_equal_a_rebuild_on_a_long_stream():
    stream = [(i * 7 + i // 5) % 11 for i in range(400)]
    incremental = NgramDrafter(max_draft_len=5, max_matching_ngram_size=3)
    for end in range(1, len(stream) + 1):
        assert incremental.draft(KEY, stream[:end], 5) == draft(stream[:end], 5, max_draft_len=5,
                                                                max_matching_ngram_size=3)


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(st.integers(0, 3), max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=12),
    max_draft_len=st.integers(1, 4),
    max_matching_ngram_size=st.integers(1, 3),
    is_keep_all=st.booleans(),
    is_use_oldest=st.booleans(),
    is_public_pool=st.booleans(),
)
def test_incremental_pool_matches_rebuild_and_tensorrt_rules(stream, cuts, max_draft_len, max_matching_ngram_size,
                                                            is_keep_all, is_use_oldest, is_public_pool):
    knobs = dict(max_draft_len=max_draft_len, max_matching_ngram_size=max_matching_ngram_size,
                 is_keep_all=is_keep_all, is_use_oldest=is_use_oldest)
    incremental = NgramDrafter(is_public_pool=is_public_pool, **knobs)
    history: list[int] = []  # one growing buffer, as the SDK hands it over
    for end in sorted({c for c in cuts if c <= len(stream)} | {len(stream)}):
        history.extend(stream[len(history):end])
        got = incremental.draft(KEY, history, max_draft_len)
        assert got == NgramDrafter(is_public_pool=is_public_pool, **knobs).draft(KEY, list(history), max_draft_len)
        assert got == reference_draft(history, **knobs)


def test_served_ngram_drafter_drafts_from_deltas():
    async def body():
        async with serving(NgramDrafter(max_draft_len=4, max_matching_ngram_size=2)) as c:
            first = await c.prepare("v", seq("r", 0, [5, 6, 7, 8, 9, 5], prompt_len=6, draft_len=4))
            second = await c.prepare("v", seq("r", 6, [6], draft_len=2))
            skipped = await c.prepare("v", seq("r", 7, [7], draft_len=0))
            third = await c.prepare("v", seq("r", 8, [8], draft_len=4))
        assert list(first.results[0].draft_tokens) == [6, 7, 8, 9]
        assert list(second.results[0].draft_tokens) == [7, 8]
        assert list(skipped.results[0].draft_tokens) == []
        assert list(third.results[0].draft_tokens) == [9, 5, 6, 7]
        assert first.results[0].status == pb.DRAFT_STATUS_OK

    asyncio.run(body())
