"""Token trees in the SDK: a drafter returns a DraftTree; the SDK checks it, trims it to the
verifier's budget, and reduces it to its first branch where a chain was asked for. The n-gram
drafter branches where its history offers different continuations."""

import asyncio
import random
from array import array

import pytest

from drafter_sdk import TREE_CAPABILITY, DraftTree, NgramDrafter
from drafter_sdk.drafter import DraftRequest, SamplingHints
from drafter_sdk.drafters.ngram import reliability
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.tree import accepted_path, depths, first_branch, tree_problem, trim
from sdk_support import RecordingDrafter, seq, serving

KEY = ("v", "r")
#        0   1   2   3   4   5   6
TREE = DraftTree([10, 11, 12, 13, 14, 15, 16], [-1, 0, -1, 1, 2, 0, 3])  # depths 1 2 1 3 2 2 4


def test_tree_helpers():
    assert depths(TREE.parents) == [1, 2, 1, 3, 2, 2, 4]
    assert first_branch(TREE.tokens, TREE.parents) == [10, 11, 13, 16]
    assert accepted_path(TREE.tokens, TREE.parents, [10, 15, 99]) == [0, 5]
    assert accepted_path(TREE.tokens, TREE.parents, [12, 14]) == [2, 4]
    assert trim(TREE.tokens, TREE.parents, max_depth=2, max_nodes=4) == ([10, 11, 12, 14], [-1, 0, -1, 2])
    assert trim(TREE.tokens, TREE.parents, max_depth=9, max_nodes=3) == ([10, 11, 12], [-1, 0, -1])
    assert tree_problem(TREE.tokens, TREE.parents, 4, 7) == ""


def test_a_tree_from_candidate_branches_merges_shared_prefixes_in_their_order():
    tree = DraftTree.from_branches([[5, 9, 1], [5, 9, 2], [4, 1], [5, 7], [], [4, 1, 3]])
    assert (tree.tokens, tree.parents) == ([5, 9, 1, 2, 4, 1, 7, 3], [-1, 0, 1, 1, -1, 4, 0, 5])
    assert tree_problem(tree.tokens, tree.parents, max_depth=3, max_nodes=8) == ""
    assert first_branch(tree.tokens, tree.parents) == [5, 9, 1]
    assert trim(tree.tokens, tree.parents, max_depth=3, max_nodes=4) == ([5, 9, 1, 2], [-1, 0, 1, 1])
    assert DraftTree.from_branches([[3, 4]]) == DraftTree([3, 4], [-1, 0]) and not DraftTree.from_branches([])


@pytest.mark.parametrize(("tokens", "parents", "depth", "nodes", "words"), [
    ([1, 2], [-1, 2], 4, 4, "not -1 or an earlier node"),
    ([1, 2], [1, -1], 4, 4, "not -1 or an earlier node"),
    ([1, 2], [-1, -2], 4, 4, "not -1 or an earlier node"),
    ([1, 2, 3], [-1, 0, 1], 2, 4, "depth 3"),
    ([1, 2, 3], [-1, -1, -1], 4, 2, "above the budget"),
    ([1, 1], [-1, -1], 4, 4, "already has a child with token 1"),
    ([1, 2], [-1], 4, 4, "1 parents for 2"),
])
def test_tree_problems_are_named(tokens, parents, depth, nodes, words):
    assert words in tree_problem(tokens, parents, depth, nodes)


def test_the_sdk_trims_trees_to_the_budget_and_answers_chains_when_asked():
    async def body():
        budgets = []
        drafter = RecordingDrafter(lambda r: budgets.append(r.max_draft_nodes) or TREE)
        async with serving(drafter) as c:
            response = await c.prepare("v", seq("a", 0, [1], draft_len=4, max_draft_nodes=5),
                                       seq("b", 0, [1], draft_len=2, max_draft_nodes=16),
                                       seq("c", 0, [1], draft_len=3, max_draft_nodes=0),
                                       seq("d", 0, [1], draft_len=4, max_draft_nodes=2))
        a, b, chain, tiny = response.results
        assert (list(a.draft_tokens), list(a.draft_parents)) == ([10, 11, 12, 13, 14], [-1, 0, -1, 1, 2])
        assert (list(b.draft_tokens), list(b.draft_parents)) == ([10, 11, 12, 14, 15], [-1, 0, -1, 2, 0])
        assert (list(chain.draft_tokens), list(chain.draft_parents)) == ([10, 11, 13], [])
        assert (list(tiny.draft_tokens), list(tiny.draft_parents)) == ([10, 11], []), "a chain-shaped tree is a chain"
        assert budgets == [5, 16, 0, 2]

    asyncio.run(body())


@pytest.mark.parametrize("bad", [DraftTree([1, 2], [-1, 5]), DraftTree([1, 1], [-1, -1]), DraftTree([1, 2], [-1]),
                                 DraftTree([1, -3], [-1, 0]), DraftTree([1, 2], [-1, "x"])])
def test_a_malformed_tree_fails_the_call_with_internal(bad):
    async def body():
        async with serving(RecordingDrafter(lambda r: bad)) as c:
            with pytest.raises(Exception) as err:
                await c.prepare("v", seq("a", 0, [1], draft_len=4, max_draft_nodes=8))
        assert "INTERNAL" in str(err.value)

    asyncio.run(body())


def test_ngram_drafter_advertises_trees_and_branches_where_its_history_disagrees():
    assert TREE_CAPABILITY in NgramDrafter.capabilities
    history = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    tree = NgramDrafter(max_draft_len=8).draft_tree(KEY, history, 4, 8)
    assert tree_problem(tree.tokens, tree.parents, 4, 8) == ""
    roots = [t for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert roots[:2] == [7, 4], "both continuations of [1, 2, 3], the newest first"
    assert first_branch(tree.tokens, tree.parents) == [7, 8, 9, 1]
    assert accepted_path(tree.tokens, tree.parents, [4, 5, 6, 9]) != []
    # Where every occurrence agrees the tree is one chain, as deep as allowed.
    same = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    tree = NgramDrafter(max_draft_len=8).draft_tree(KEY, same, 3, 3)
    assert (tree.tokens, tree.parents) == ([4, 5, 6], [-1, 0, 1])
    # Budget 0: the chain drafter, unchanged.
    drafter = NgramDrafter(max_draft_len=8)
    assert drafter.draft(KEY, history, 4) == NgramDrafter(max_draft_len=8).draft(("v", "other"), history, 4)


def test_ngram_drafter_grows_its_tree_index_incrementally():
    history = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    incremental = NgramDrafter(max_draft_len=4)
    for n in range(2, len(history) + 1):
        step = incremental.draft_tree(KEY, history[:n], 3, 6)
    fresh = NgramDrafter(max_draft_len=4).draft_tree(KEY, history, 3, 6)
    assert step == fresh and fresh.tokens


def test_ngram_trees_over_the_wire():
    async def body():
        async with serving(NgramDrafter(max_draft_len=4)) as c:
            info = await c.stub.GetDrafterInfo(pb.GetDrafterInfoRequest())
            history = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3]
            response = await c.prepare("v", seq("t", 0, history, draft_len=3, max_draft_nodes=6),
                                       seq("c", 0, history, draft_len=3))
        assert TREE_CAPABILITY in info.capabilities
        tree, chain = response.results
        assert len(tree.draft_parents) == len(tree.draft_tokens) > 3
        assert list(chain.draft_parents) == [] and len(chain.draft_tokens) == 3

    asyncio.run(body())


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        out.append((*(out[parent] if parent >= 0 else ()), token))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_ngram_trees_keep_the_budget_and_the_depth_and_grow_best_first(seed):
    """Any budget's tree is valid and the first nodes of a larger budget's tree: nodes are ordered
    best first, which the verifier's planner relies on to size trees."""
    rng = random.Random(seed)
    history = [rng.choice([1, 2, 3, 4, 5, 6]) if rng.random() < 0.8 else rng.randrange(100) for _ in range(300)]
    for depth in (1, 3, 8):
        full = NgramDrafter(max_draft_len=8).draft_tree(KEY, history, depth, 32)
        assert tree_problem(full.tokens, full.parents, depth, 32) == ""
        assert len(full) == 32 or depth == 1, "the back-off to frequent tokens fills the budget"
        for budget in (1, 2, 5, 16):
            tree = NgramDrafter(max_draft_len=8).draft_tree(KEY, history, depth, budget)
            assert (list(tree.tokens), list(tree.parents)) == (list(full.tokens[:budget]), list(full.parents[:budget]))
        assert len(set(_paths(full))) == len(full), "no path twice"


@pytest.mark.parametrize("seed", range(3))
def test_ngram_tree_min_prob_keeps_the_likeliest_nodes_only(seed):
    """A probability floor cuts the best-first tree short: a prefix of the full tree, shorter as the
    floor rises; text that repeats itself keeps its deep copy, a guess among many does not."""
    rng = random.Random(seed)
    history = [rng.choice([1, 2, 3, 4, 5, 6]) if rng.random() < 0.8 else rng.randrange(100) for _ in range(300)]
    full = NgramDrafter(max_draft_len=8).draft_tree(KEY, history, 8, 16)
    sizes = []
    for floor in (0.0, 0.02, 0.05, 0.2, 1.0):
        tree = NgramDrafter(max_draft_len=8, tree_min_prob=floor).draft_tree(KEY, history, 8, 16)
        assert (list(tree.tokens), list(tree.parents)) == (list(full.tokens[:len(tree)]), list(full.parents[:len(tree)]))
        sizes.append(len(tree))
    assert sizes[0] == 16 and sizes == sorted(sizes, reverse=True) and sizes[2] < 16 and sizes[-1] == 0
    copy = list(range(10, 30)) * 6 + list(range(10, 15))
    tree = NgramDrafter(max_draft_len=8, tree_min_prob=0.2).draft_tree(KEY, copy, 8, 16)
    assert first_branch(tree.tokens, tree.parents)[:6] == list(range(15, 21)), "a sure copy stays deep"
    with pytest.raises(ValueError, match="tree_min_prob"):
        NgramDrafter(tree_min_prob=1.5)


def test_ngram_tree_puts_the_likelier_branch_and_its_continuation_first():
    # [1, 2, 3] was followed by 7, 8 once, then by 4, 5 twice (newer): 4 then 5 come before 7.
    history = [1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    tree = NgramDrafter(max_draft_len=8).draft_tree(KEY, history, 4, 8)
    paths = _paths(tree)
    assert paths[:3] == [(4,), (4, 5), (4, 5, 9)]
    assert (7,) in paths, "the older continuation is a branch"


def test_ngram_tree_backs_off_to_the_most_frequent_tokens_where_nothing_matches():
    history = [5, 9, 5, 9, 5, 6, 5, 8]  # 8 was never seen before: no pattern, frequent tokens only
    tree = NgramDrafter(max_draft_len=4).draft_tree(KEY, history, 2, 3)
    assert list(tree.tokens[:2]) == [5, 9] and list(tree.parents[:2]) == [-1, -1]


def test_ngram_budget_zero_drafts_the_unchanged_chain():
    """max_draft_nodes 0: the chain drafter's answer, the same whether or not trees were drafted for
    the key before."""
    rng = random.Random(7)
    history = [rng.randrange(8) for _ in range(200)]
    mixed, chains = NgramDrafter(max_draft_len=6), NgramDrafter(max_draft_len=6)
    for n in range(10, len(history), 7):
        mixed.draft_tree(KEY, history[:n], 6, 16)
        ask = DraftRequest(*KEY, array("i", history[:n]), prompt_len=1, draft_len=6, last_num_drafted=0,
                           last_num_accepted=0, sampling=SamplingHints(), max_draft_nodes=0)
        assert mixed.prepare_draft_tokens([ask]) == [chains.draft(KEY, history[:n], 6)]


def test_ngram_tree_keeps_a_long_copy_likely_to_its_depth():
    """A copy that has matched many tokens goes on nearly always (measured on the target's outputs), so
    its path probability stays high: a floor of 0.5 keeps a 12-deep copy of a passage seen once, and
    with one other continuation of the same words seen once, keeps the copy that matches longer first."""
    rng = random.Random(3)
    passage = rng.sample(range(100, 400), 40)
    history = passage + rng.sample(range(400, 700), 30) + passage[:6]
    tree = NgramDrafter(max_draft_len=12, tree_min_prob=0.5).draft_tree(KEY, history, 12, 16)
    assert first_branch(tree.tokens, tree.parents) == passage[6:18] and len(tree) == 12
    assert all(reliability(m) <= reliability(m + 1) < 1.0 for m in range(16)) and reliability(0) == 0.0
    # The last two words of the passage's start also appear, once, before something else: a branch that
    # is likely only where the long match is not.
    other = history[:-6] + [777, 778] + passage[4:6] + [999] + passage[:6]
    tree = NgramDrafter(max_draft_len=12).draft_tree(KEY, other, 12, 16)
    assert first_branch(tree.tokens, tree.parents)[:6] == passage[6:12]
