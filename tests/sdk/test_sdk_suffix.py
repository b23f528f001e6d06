"""SuffixDecoding in the SDK: the trees against a brute-force suffix trie, the knobs, eviction and its
memory bound, the per-request tree through the delta stream, learning only what finished, cache scopes."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import tracemalloc
from array import array

import pytest
from sdk_support import seq, serving
from test_sdk_metrics import scrape, value

from drafter_sdk.drafter import DraftRequest, ReleaseReason, SamplingHints
from drafter_sdk.drafters import suffix_index
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.drafters.suffix_index import SuffixIndex
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree, depths, first_branch, tree_problem

# --- a brute-force reference: occurrences counted by scanning every sequence -----------------------


def _occurrences(seqs: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    m = len(pattern)
    return [(i, end) for i, s in enumerate(seqs) for end in range(m - 1, len(s)) if s[end - m + 1:end + 1] == pattern]


def reference(seqs: list[list[int]], context: list[int], depth: int, max_tokens: int, factor: float = 1.0,
              offset: float = 0.0, min_prob: float = 0.1, own: bool = False) -> tuple[list[int], float, int]:
    """Arctic Inference's rule, spelled out: every match length from 1 up while the context's suffix occurs,
    a greedy path of most frequent children (ties: the latest occurrence), the best score (ties: longer).
    `own`: the context is the last sequence, and its own end is no occurrence."""
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for m in range(1, min(len(context), depth) + 1):
        occ = _occurrences(seqs, context[len(context) - m:])
        if own:
            occ.remove((len(seqs) - 1, len(seqs[-1]) - 1))
        if not occ:
            break
        budget = min(max_tokens, int(m * factor + offset + 1e-6), depth - m)
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < budget:
            tally: dict[int, int] = {}
            for i, end in occ:
                if end + 1 < len(seqs[i]):
                    tally[seqs[i][end + 1]] = tally.pop(seqs[i][end + 1], 0) + 1
            if not tally:
                break
            top = max(tally.values())
            child = [t for t, c in tally.items() if c == top][-1]
            prob *= top / len(occ)
            if prob < min_prob:
                break
            occ = [(i, e + 1) for i, e in occ if e + 1 < len(seqs[i]) and seqs[i][e + 1] == child]
            tokens.append(child)
            score += prob
        if score > 0 and score >= best[1]:
            best = (tokens, score, m)
    return best


@pytest.fixture(params=["numpy", "numpy-always", "pure-python"])
def vectorized(request, monkeypatch):  # noqa: ANN001, ANN201
    """Run a test with numpy's path for frequent patterns, with it for every pattern (each match and walk
    on arrays), and without numpy at all."""
    if request.param == "pure-python":
        monkeypatch.setattr(suffix_index, "np", None)
    if request.param == "numpy-always":
        monkeypatch.setattr(suffix_index, "_VECTOR_MIN", 0)
        monkeypatch.setattr(suffix_index, "_WALK_VECTOR_MIN", 0)
        monkeypatch.setattr(suffix_index, "_TRIE_MAX", 0)
    return request.param


def test_the_index_drafts_exactly_what_a_suffix_trie_would(vectorized) -> None:  # noqa: ANN001
    rng = random.Random(7)
    for _ in range(60):
        vocab, depth = rng.choice([2, 3, 6, 30]), rng.choice([2, 4, 8, 24])
        index, seqs = SuffixIndex(depth), []
        for _ in range(rng.randint(1, 4)):
            s = [rng.randrange(vocab) for _ in range(rng.randint(0, 400))]
            index.add(s[:len(s) // 3])  # built in pieces, as the delta stream grows a request's tree
            index.extend(s[len(s) // 3:])
            seqs.append(s)
        for _ in range(rng.randint(0, len(seqs) - 1)):
            index.evict_oldest()
            seqs.pop(0)
        for _ in range(6):
            tail = seqs[-1][:rng.randint(1, len(seqs[-1]))] if seqs[-1] and rng.random() < 0.6 else []
            context = tail or [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            knobs = (rng.randint(1, 12), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0, 2.5]),
                     rng.choice([0.0, 0.1, 0.4]))
            got = index.speculate(context, *knobs)
            tokens, score, match_len = reference(seqs, context, depth, *knobs)
            assert (got.tokens, got.match_len) == (tokens, match_len)
            assert got.score == pytest.approx(score)
            if seqs[-1]:  # the last sequence as the context, without its own end (a request's own tree)
                got = index.speculate(seqs[-1], *knobs, own=True)
                tokens, score, match_len = reference(seqs, seqs[-1], depth, *knobs, own=True)
                assert (got.tokens, got.match_len) == (tokens, match_len)
                assert got.score == pytest.approx(score)


def test_recurring_phrases_draft_exactly_what_a_suffix_trie_would(vectorized) -> None:  # noqa: ANN001
    """Text stitched from a few phrases: long matches that branch, so the best draft often comes from a
    shorter match than the longest (the index then looks again through a more frequent pair)."""
    rng = random.Random(11)
    for _ in range(25):
        phrases = [[rng.randrange(12) for _ in range(rng.randint(2, 9))] for _ in range(rng.randint(2, 6))]
        depth = rng.choice([6, 12, 24])
        index, seqs = SuffixIndex(depth), []
        for _ in range(rng.randint(2, 6)):
            s = [t for _ in range(rng.randint(1, 25)) for t in rng.choice(phrases)]
            index.add(s)
            seqs.append(s)
        for _ in range(8):
            context = [t for _ in range(rng.randint(1, 6)) for t in rng.choice(phrases)]
            if rng.random() < 0.3:  # starting within a phrase
                context = context[rng.randrange(len(context)):]
            knobs = (rng.randint(1, 10), rng.choice([1.0, 2.0]), rng.choice([0.0, 1.0]), rng.choice([0.0, 0.1, 0.3]))
            got = index.speculate(context, *knobs)
            tokens, score, match_len = reference(seqs, context, depth, *knobs)
            assert (got.tokens, got.match_len) == (tokens, match_len)
            assert got.score == pytest.approx(score)


def test_occurs_finds_a_whole_match_other_than_the_contexts_own_end(vectorized) -> None:  # noqa: ANN001
    """What lets the drafter skip its own tree's search (the global draft's match is longer than any there)."""
    rng = random.Random(5)
    seqs = [[rng.randrange(6) for _ in range(rng.randint(1, 120))] for _ in range(12)]
    index = SuffixIndex(24)
    for s in seqs:
        index.add(s)
    context = seqs[-1]  # the newest sequence: its own end is the context's own end
    for length in range(2, min(len(context), 24) + 1):
        tail = context[-length:]
        places = _occurrences(seqs, tail)
        assert index.occurs(context, length) == bool(places)
        assert index.occurs(context, length, own=True) == any(p != (len(seqs) - 1, len(context) - 1) for p in places)
    assert not index.occurs([6, 7], 2)  # a pair never seen


def test_counts_probabilities_and_the_knobs() -> None:
    index = SuffixIndex(24)
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9]):
        index.add(s)
    # [1, 2, 3] occurs 3 times: then 4 twice (p 2/3), then 5 (2/3 * 2/2).
    d = index.speculate([7, 1, 2, 3], 8, max_spec_factor=1.0)
    assert (d.tokens, d.match_len) == ([4, 5], 3)
    assert d.score == pytest.approx(2 / 3 + 2 / 3)
    # The draft length is capped by factor * match length + offset ...
    assert index.speculate([1, 2], 8).tokens == [3, 4]
    assert index.speculate([1, 2], 8, max_spec_factor=0.5).tokens == [3]
    assert index.speculate([1, 2], 8, max_spec_factor=0.5, max_spec_offset=2).tokens == [3, 4, 5]
    # ... by the length asked for ...
    assert index.speculate([1, 2], 1, max_spec_factor=4).tokens == [3]
    # ... and by min_token_prob (4 has 2/3, below 0.7).
    assert index.speculate([1, 2, 3], 8, min_token_prob=0.7).tokens == []
    # No match, no draft.
    assert index.speculate([42], 8).tokens == []


def test_token_buffers_other_than_lists_draft_the_same() -> None:
    """The SDK may hold tokens as array('i') (or numpy): a read-only sequence of ints."""
    history = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2]
    drafter = SuffixDrafter()
    [as_list] = drafter.prepare_draft_tokens([request("a", history)])
    [as_array] = drafter.prepare_draft_tokens([request("b", array("i", history))])  # type: ignore[arg-type]
    assert as_list == as_array == [3, 9, 1, 2]  # a match of 2 in the own tree drafts up to 2 * 2


def test_the_tree_depth_bounds_match_plus_draft() -> None:
    index = SuffixIndex(6)
    index.add(list(range(20)))
    d = index.speculate([2, 3, 4, 5], 8, max_spec_factor=4.0)
    assert len(d.tokens) + d.match_len <= 6
    # A match of 1 may draft min(4 * 1, 6 - 1) = 4 tokens, of 2 min(8, 4) = 4: the same score, and the
    # longer match wins the tie; of 3 only 3.
    assert (d.tokens, d.match_len) == ([6, 7, 8, 9], 2)
    assert SuffixIndex(24).speculate([3], 8).tokens == []  # empty index


def test_the_longer_match_wins_and_the_better_score_between_equal_matches() -> None:
    drafter = SuffixDrafter(own_spec_factor=1.0)
    for i in range(3):  # the global tree sees [1, 2, 3] -> 4, 5, 6, 7 three times
        finish(drafter, f"old{i}", [9], [1, 2, 3, 4, 5, 6, 7])
    # The request's own context says [1, 2, 3] -> 5, 0, 1 or 9, 1, 2 (its own end is no occurrence), the
    # latest on the tie, with probability 1/2 each: score 1.5, against 3 for the global tree's 4, 5, 6.
    own = [1, 2, 3, 5, 0, 1, 2, 3, 9, 1, 2, 3]
    alone = SuffixIndex(24)
    alone.add(own)
    mine = alone.speculate(own, 8, own=True)
    assert (mine.tokens, mine.score) == ([9, 1, 2], pytest.approx(1.5))
    [draft] = drafter.prepare_draft_tokens([request("new", own, prompt_len=12)])
    assert draft == [4, 5, 6]
    # Once the own tree scores as much (one more occurrence, no other continuation), it wins the tie.
    [draft] = drafter.prepare_draft_tokens([request("tie", [1, 2, 3, 8, 7, 6, 1, 2, 3], prompt_len=9)])
    assert draft == [8, 7, 6]
    # By default a match in the own context may draft twice its length (the global tree's factor stays 1).
    drafter = SuffixDrafter()
    for i in range(3):
        finish(drafter, f"old{i}", [9], [1, 2, 3, 4, 5, 6, 7])
    [draft] = drafter.prepare_draft_tokens([request("own", [1, 2, 3, 8, 7, 6, 1, 2, 3], prompt_len=9)])
    assert draft == [8, 7, 6, 1, 2, 3]
    [draft] = drafter.prepare_draft_tokens([request("new", [0, 1, 2, 3], prompt_len=4)])
    assert draft == [4, 5, 6]
    with pytest.raises(ValueError, match="own_spec_factor"):
        SuffixDrafter(own_spec_factor=-1.0)
    # Only its own tree knows [7, 7] -> 8: it drafts, unchallenged.
    [draft] = drafter.prepare_draft_tokens([request("own", [7, 7, 8, 7, 7], prompt_len=5)])
    assert draft[:1] == [8]


@pytest.mark.parametrize("prefer_longer_match", [True, False])
def test_a_longer_match_beats_a_higher_score_unless_told_otherwise(prefer_longer_match: bool) -> None:
    drafter = SuffixDrafter(own_spec_factor=4.0, prefer_longer_match=prefer_longer_match)
    # The global tree: [1, 2, 3] -> 4, 5, 6 two times in three, so a 3-token match drafts them at 2/3 each.
    for i, output in enumerate(([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 0, 0, 0, 0])):
        finish(drafter, f"old{i}", [8], output)
    # The own context matches only its last token, 3, twice followed by 9, 9, 9, 9: score 4 against 2.
    context = [3, 9, 9, 9, 9, 5, 3, 9, 9, 9, 9, 5, 1, 2, 3]
    own, theirs = SuffixIndex(24), drafter._global[""]
    own.add(context)
    mine, shared = own.speculate(context, 8, 4.0, own=True), theirs.speculate(context, 8)
    assert (mine.tokens, mine.match_len, mine.score) == ([9, 9, 9, 9], 1, pytest.approx(4.0))
    assert (shared.tokens, shared.match_len, shared.score) == ([4, 5, 6], 3, pytest.approx(2.0))
    [draft] = drafter.prepare_draft_tokens([request("new", context, prompt_len=len(context))])
    assert draft == ([4, 5, 6] if prefer_longer_match else [9, 9, 9, 9])
    # Trees follow the same choice: their first branch is the chain.
    [tree] = drafter.prepare_draft_tokens([request("new", context, prompt_len=len(context), nodes=6)])
    assert tree.tokens[:3 if prefer_longer_match else 4] == draft


def request(rid: str, tokens: list[int], prompt_len: int = 0, draft_len: int = 8, verifier: str = "v",
            nodes: int = 0, salt: str = "") -> DraftRequest:
    return DraftRequest(verifier, rid, tokens, prompt_len, draft_len, 0, 0, SamplingHints(), max_draft_nodes=nodes,
                        cache_salt_id=salt)


def finish(drafter: SuffixDrafter, rid: str, prompt: list[int], output: list[int], verifier: str = "v",
           reason: ReleaseReason = ReleaseReason.FINISHED, salt: str = "") -> None:
    drafter.prepare_draft_tokens([request(rid, prompt + output, len(prompt), 0, verifier, salt=salt)])
    drafter.on_release((verifier, rid), reason)


def test_only_finished_outputs_are_learned_and_prompts_only_behind_the_knob() -> None:
    drafter = SuffixDrafter()
    for reason in (ReleaseReason.CANCELLED, ReleaseReason.EVICTED, ReleaseReason.UNSPECIFIED):
        finish(drafter, f"r{reason}", [50, 51], [1, 2, 3, 4, 5, 6], reason=reason)
    assert drafter.cached_requests == 0
    assert drafter.prepare_draft_tokens([request("q", [1, 2, 3])]) == [[]]
    finish(drafter, "done", [50, 51, 52], [1, 2, 3, 4, 5, 6])
    assert drafter.cached_requests == 1
    assert drafter.prepare_draft_tokens([request("q2", [1, 2, 3])]) == [[4, 5, 6]]
    assert drafter.prepare_draft_tokens([request("q3", [50, 51])]) == [[]]  # the prompt was not learned
    with_prompts = SuffixDrafter(cache_prompts=True)
    finish(with_prompts, "done", [50, 51, 52], [1, 2, 3, 4, 5, 6])
    assert with_prompts.prepare_draft_tokens([request("q3", [50, 51])]) == [[52, 1]]


def test_the_global_tree_evicts_oldest_first_and_stays_bounded() -> None:
    drafter = SuffixDrafter(max_cached_requests=3)
    rng = random.Random(1)
    outputs = [[rng.randrange(1000) for _ in range(50)] for _ in range(40)]
    sizes = []
    for i, out in enumerate(outputs):
        finish(drafter, f"r{i}", [], out)
        sizes.append(drafter.shared_state_bytes())
    assert drafter.cached_requests == 3
    # What is held is exactly a tree built from the last three outputs alone.
    fresh = SuffixIndex(24)
    for out in outputs[-3:]:
        fresh.add(out)
    [held] = drafter._global.values()
    assert [held.tokens(i) for i in range(3)] == outputs[-3:]
    assert (held._counts, held._next) == (fresh._counts, fresh._next)
    shift = held._spans[0][0] - fresh._spans[0][0]  # positions are absolute: they survive compaction
    assert {k: v.tolist() for k, v in held._pairs.items()} == {
        k: [p + shift for p in v.tolist()] for k, v in fresh._pairs.items()}
    assert drafter.prepare_draft_tokens([request("q", outputs[0][:10])]) == [[]]  # evicted
    assert drafter.prepare_draft_tokens([request("q2", outputs[-1][:10])]) == [outputs[-1][10:18]]
    # Memory: bounded by the cache size, not by how much went through (the buffer compacts).
    assert max(sizes[10:]) <= 1.5 * min(sizes[10:])
    assert len(held._buf) <= 2 * (3 * 51 + 1) + 1


def test_the_global_tree_stays_within_its_memory_cap_oldest_evicted_first() -> None:
    """Long outputs fill the cap before the count: past `max_cached_mib` the oldest outputs go, across scopes,
    and an output larger than the whole cap is not kept."""
    cap_mib = 0.5
    drafter = SuffixDrafter(max_cached_mib=cap_mib, cache_scope="verifier")
    rng = random.Random(2)
    outputs = [[rng.randrange(50_000) for _ in range(300)] for _ in range(30)]  # no chance matches
    held = []
    for i, out in enumerate(outputs):
        finish(drafter, f"r{i}", [], out, verifier="AB"[i % 2])
        assert drafter.shared_state_bytes() <= cap_mib * 2**20
        held.append(drafter.cached_requests)
    assert 2 <= held[-1] < 10 and max(held) < len(outputs)  # the bytes bound it, not the count (10,000)
    kept = outputs[-held[-1]:]
    for i, out in enumerate(outputs):
        draft = drafter.prepare_draft_tokens([request(f"q{i}", out[:10], verifier="AB"[i % 2])])[0]
        assert draft == (out[10:18] if out in kept else []), i
    tiny = SuffixDrafter(max_cached_mib=0.01)
    finish(tiny, "big", [], outputs[0])
    assert tiny.cached_requests == 0 and tiny.shared_state_bytes() == 0
    with pytest.raises(ValueError, match="max_cached_mib"):
        SuffixDrafter(max_cached_mib=0)


def test_a_tree_per_cache_salt_stays_within_the_memory_cap_as_python_measures_it() -> None:
    """Many small trees (a client with a new salt each request) weigh their fixed and per-token overhead too:
    what tracemalloc sees of the global trees stays within the cap, give or take the estimate's 15%."""
    cap_mib, rng = 1.0, random.Random(3)
    drafter = SuffixDrafter(max_cached_mib=cap_mib)
    tracemalloc.start()
    try:
        for i in range(300):
            finish(drafter, f"r{i}", [], [rng.randrange(50_000) for _ in range(60)], salt=f"{i:032x}")
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 10 < len(drafter._global) < 300 and drafter.shared_state_bytes() <= cap_mib * 2**20
    assert traced <= 1.15 * cap_mib * 2**20, traced / 2**20


def test_max_cached_requests_zero_learns_nothing() -> None:
    drafter = SuffixDrafter(max_cached_requests=0)
    finish(drafter, "done", [], [1, 2, 3, 4])
    assert drafter.cached_requests == 0 and drafter.shared_state_bytes() == 0


def test_cache_scopes() -> None:
    def drafts_for_b(scope: str) -> tuple[list[int], list[int]]:
        drafter = SuffixDrafter(cache_scope=scope)
        finish(drafter, "r", [], [1, 2, 3, 4, 5, 6], verifier="A")
        [draft] = drafter.prepare_draft_tokens([request("r", [1, 2, 3], verifier="B")])
        [same] = drafter.prepare_draft_tokens([request("r2", [1, 2, 3], verifier="A")])
        return draft, same

    assert drafts_for_b("global") == ([4, 5, 6], [4, 5, 6])
    assert drafts_for_b("verifier") == ([], [4, 5, 6])
    assert drafts_for_b("request") == ([], [])
    with pytest.raises(ValueError, match="cache_scope"):
        SuffixDrafter(cache_scope="everyone")


@pytest.mark.parametrize("scope", ["global", "verifier"])
def test_within_a_scope_a_salted_output_drafts_for_its_own_salt_alone(scope: str) -> None:
    """A salted request learns into and drafts from its salt's tree of its scope only (its own context aside);
    the salted trees survive save_learned and restore_learned, and share the caps with every other tree."""
    drafter = SuffixDrafter(cache_scope=scope, max_cached_requests=3)
    finish(drafter, "a", [], [1, 2, 3, 4, 5, 6], verifier="A", salt="s1")
    finish(drafter, "b", [], [1, 2, 3, 7, 8, 9], verifier="A")

    def drafts(drafter: SuffixDrafter, verifier: str = "A") -> list[list[int]]:
        return [drafter.prepare_draft_tokens([request(f"q{salt}", [1, 2, 3], verifier=verifier, salt=salt)])[0]
                for salt in ("s1", "", "s2")]

    assert drafts(drafter) == [[4, 5, 6], [7, 8, 9], []]
    assert drafts(drafter, verifier="B") == ([[4, 5, 6], [7, 8, 9], []] if scope == "global" else [[], [], []])
    assert drafter.prepare_draft_tokens([request("own", [1, 2, 3, 1, 2], salt="s2")]) == [[3, 1, 2]]
    restored = SuffixDrafter(cache_scope=scope, max_cached_requests=3)
    restored.restore_learned(drafter.save_learned())
    assert drafts(restored) == [[4, 5, 6], [7, 8, 9], []]
    for i in range(3):  # the caps count every tree's outputs together: the salted one, the oldest, goes first
        finish(drafter, f"c{i}", [], [20 + i, 21, 22], verifier="A", salt="s2")
    assert drafts(drafter) == [[], [], []] and drafter.cached_requests == 3


def test_state_bytes_per_request_and_shared() -> None:
    drafter = SuffixDrafter()
    assert drafter.state_bytes(("v", "r")) == 0 and drafter.shared_state_bytes() == 0
    drafter.prepare_draft_tokens([request("r", list(range(100)), draft_len=0)])
    small = drafter.state_bytes(("v", "r"))
    drafter.prepare_draft_tokens([request("r", list(range(1000)), draft_len=0)])
    assert 0 < small < drafter.state_bytes(("v", "r"))
    drafter.on_release(("v", "r"), ReleaseReason.FINISHED)
    assert drafter.state_bytes(("v", "r")) == 0 and drafter.shared_state_bytes() > 0


def test_the_request_tree_follows_the_delta_stream() -> None:
    """Overlapping deltas, sync-only calls, resyncs after a loss and a replaced context: the request's
    tree always equals one built from scratch on its whole context."""
    drafter = SuffixDrafter()
    servicer = DrafterServicer(drafter, SequenceStore())
    servicer.load()
    rng = random.Random(3)
    truth = [rng.randrange(50) for _ in range(20)]
    lengths: list[int] = []  # committed length after each successful call (the verifier's history)

    def call(context_len: int) -> int:
        response = servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[pb.DraftSequence(
            request_id="r", context_len=context_len, new_tokens=truth[context_len:], prompt_len=5,
            draft_len=rng.choice([0, 4]))]))
        return response.results[0].status

    for step in range(150):
        truth += [rng.randrange(50) for _ in range(rng.randint(1, 5))]
        if step == 60:  # the drafter loses its state (as after a restart)
            servicer.store = SequenceStore()
            drafter._requests.clear()
        if step == 100:  # a new sequence under the same id: a full context replaces the old one
            truth = [rng.randrange(50) for _ in range(30)]
            lengths.clear()
        start = lengths[-rng.randint(1, min(4, len(lengths)))] if lengths and rng.random() < 0.8 else 0
        if call(start) == pb.DRAFT_STATUS_OK:
            lengths.append(len(truth))
        else:
            lengths.clear()
            continue
        tree = drafter._requests[("v", "r")].tree
        fresh = SuffixIndex(24)
        fresh.add(truth)
        assert tree.tokens() == truth
        assert (tree._counts, tree._next) == (fresh._counts, fresh._next)
        assert {k: v.tolist() for k, v in tree._pairs.items()} == {k: v.tolist() for k, v in fresh._pairs.items()}


def test_the_global_tree_size_is_a_metric():
    async def body():
        async with serving(SuffixDrafter(), metrics_port=0) as c:
            await c.prepare("v", seq("a", 0, [5, 1, 2, 3, 4], prompt_len=1, draft_len=0))
            assert value(await scrape(c.running.metrics_port), "shared_state_bytes") == 0
            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["a"],
                                                                   reasons=[pb.RELEASE_REASON_FINISHED]))
            drafter = c.running.servicer.drafter
            assert drafter.cached_requests == 1
            assert value(await scrape(c.running.metrics_port), "shared_state_bytes") == drafter.shared_state_bytes() > 0

    asyncio.run(body())


def test_which_tree_drafts_and_what_the_global_trees_hold_are_metrics():
    """The drafter's own metrics (Drafter.register_metrics): drafts and draft tokens by the tree they came from,
    the outputs cached, and those evicted."""
    finished = pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["a", "b"],
                                         reasons=[pb.RELEASE_REASON_FINISHED, pb.RELEASE_REASON_FINISHED])

    async def body():
        async with serving(SuffixDrafter(max_cached_requests=1), metrics_port=0) as c:
            nothing = await c.prepare("v", seq("n", 0, [7, 8, 9], prompt_len=3))
            await c.prepare("v", seq("a", 0, [5, 1, 2, 3, 4, 5, 6], prompt_len=1, draft_len=0),
                            seq("b", 0, [5, 11, 12, 13, 14, 15, 16], prompt_len=1, draft_len=0))
            await c.stub.ReleaseRequests(finished)  # b's output evicts a's
            theirs = await c.prepare("v", seq("g", 0, [11, 12, 13], prompt_len=3))
            mine = await c.prepare("v", seq("o", 0, [20, 21, 22, 23, 20, 21], prompt_len=6))
            assert [list(r.results[0].draft_tokens) for r in (nothing, theirs, mine)] == [
                [], [14, 15, 16], [22, 23, 20, 21]]
            m = await scrape(c.running.metrics_port)
            assert [value(m, "suffix_drafts_total", tree=t) for t in ("none", "global", "own")] == [1, 1, 1]
            assert [value(m, "suffix_draft_tokens_total", tree=t) for t in ("global", "own")] == [3, 4]
            assert (value(m, "suffix_cached_outputs"), value(m, "suffix_evicted_outputs_total")) == (1, 1)

    asyncio.run(body())


@pytest.mark.parametrize("cursor_max", [256, 2])
def test_a_cursor_drafts_what_a_fresh_lookup_does(vectorized, cursor_max, monkeypatch) -> None:  # noqa: ANN001
    """A context growing by a few tokens a step, its matches carried by cursors in its own tree and in a
    global one that gains and evicts sequences meanwhile; steps skipped, drafts cut short by `beat`. With
    cursor_max 2 a cursor keeps only the longest matches, so lookups add the others to what it knows."""
    monkeypatch.setattr(suffix_index, "_CURSOR_MAX", cursor_max)
    rng = random.Random(5)
    for _ in range(12):
        vocab, depth = rng.choice([2, 3, 8]), rng.choice([4, 8, 24])
        shared, own = SuffixIndex(depth), SuffixIndex(depth)
        phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 12))] for _ in range(4)]
        for _ in range(rng.randint(0, 5)):
            shared.add([t for _ in range(rng.randint(1, 8)) for t in rng.choice(phrases)])
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        own.add(context)
        mine, theirs = suffix_index.Cursor(), suffix_index.Cursor()
        for _ in range(60):
            grow = rng.choice(phrases)[:rng.randint(0, 5)] if rng.random() < 0.7 else [
                rng.randrange(vocab) for _ in range(rng.randint(0, 30))]  # now and then a long jump
            context += grow
            own.extend(grow)
            if rng.random() < 0.3:
                shared.add(context[rng.randrange(len(context)):] if rng.random() < 0.5 else rng.choice(phrases))
            if rng.random() < 0.2 and len(shared) > 1:
                shared.evict_oldest()
            if rng.random() < 0.2:
                continue  # no draft asked this step: the cursors fall behind
            knobs = (rng.randint(1, 10), rng.choice([1.0, 2.0]), rng.choice([0.0, 1.0]), rng.choice([0.0, 0.1, 0.3]),
                     rng.choice([0.0, 0.0, 1.0, 2.5]))
            for index, cursor in ((own, mine), (shared, theirs)):
                got = index.speculate(context, *knobs, cursor=cursor, own=index is own)
                want = index.speculate(context[-depth:], *knobs, own=index is own)
                assert (got.tokens, got.match_len) == (want.tokens, want.match_len)
                assert got.score == pytest.approx(want.score)


def test_a_cursor_forgets_matches_in_evicted_sequences(vectorized) -> None:  # noqa: ANN001
    rng = random.Random(2)
    copied = [rng.randrange(1000) for _ in range(60)]
    for grown in (1, 2):
        shared = SuffixIndex(24)
        shared.add(copied)
        shared.add([rng.randrange(1000) for _ in range(60)])
        cursor = suffix_index.Cursor()
        context = [7] + copied[:20]
        assert shared.speculate(context, 8, cursor=cursor).tokens == copied[20:28]
        shared.evict_oldest()
        shared.add(copied[15:20 + grown + 1])  # a short copy: the long match is gone, a short one is new
        context += copied[20:20 + grown]
        assert shared.speculate(context, 8, cursor=cursor).tokens == [copied[20 + grown]]


def fresh_draft(drafter: SuffixDrafter, key: tuple[str, str], tokens: list[int]) -> list[int]:
    """The draft without cursors, both trees searched in full: the own tree's, unless the global tree's follows
    a longer match, or an equal one and scores more."""
    state = drafter._requests[key]
    own = state.tree.speculate(tokens[-24:], 8, drafter.own_spec_factor, own=True)
    shared = drafter._global.get("")
    if shared is None:
        return own.tokens
    theirs = shared.speculate(tokens[-24:], 8, drafter.max_spec_factor)
    if not own.tokens or (theirs.tokens and (theirs.match_len, theirs.score) > (own.match_len, own.score)):
        return theirs.tokens
    return own.tokens


def test_the_drafter_with_cursors_drafts_what_fresh_lookups_do() -> None:
    """Through the servicer: resyncs, replaced contexts, releases that feed (and evict from) the global tree."""
    drafter = SuffixDrafter(max_cached_requests=4)
    servicer = DrafterServicer(drafter, SequenceStore())
    servicer.load()
    rng = random.Random(9)
    phrases = [[rng.randrange(20) for _ in range(rng.randint(3, 10))] for _ in range(6)]
    for n in range(30):
        rid = f"r{n % 5}"  # ids come back: a full context then replaces the old one
        truth = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(phrases)]
        sent = 0
        for _ in range(rng.randint(1, 12)):
            truth += rng.choice(phrases)[:rng.randint(1, 5)]
            if rng.random() < 0.1:
                sent = len(truth) + 1  # a gap: the drafter asks for a resync
            response = servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[pb.DraftSequence(
                request_id=rid, context_len=sent, new_tokens=truth[sent:] if sent <= len(truth) else [],
                prompt_len=1, draft_len=8)]))
            result = response.results[0]
            if result.status != pb.DRAFT_STATUS_OK:
                sent = 0
                continue
            sent = len(truth)
            assert list(result.draft_tokens) == fresh_draft(drafter, ("v", rid), truth)
        if rng.random() < 0.7:
            servicer.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=[rid], reasons=[
                rng.choice([pb.RELEASE_REASON_FINISHED, pb.RELEASE_REASON_CANCELLED])]))


def test_a_copying_request_searches_its_own_tree_first_and_drafts_what_fresh_lookups_do() -> None:
    """An agent loop copying its own context, against a global tree of other text: once the own tree drafts,
    it is searched first, and the global tree only where it holds a match as long; the drafts stay those of
    both trees searched in full."""
    drafter = SuffixDrafter()
    rng = random.Random(4)
    for i in range(20):  # other text, and a little of the requests' own
        finish(drafter, f"old{i}", [1], [rng.randrange(30) for _ in range(60)] + [rng.randrange(30, 90)
                                                                                    for _ in range(3)])
    own_first = 0
    for n in range(6):
        passage = [rng.randrange(30, 90) for _ in range(80)]
        copy = [rng.randrange(90) if rng.random() < 0.05 else t for t in passage]  # edited here and there
        prompt = [rng.randrange(30) for _ in range(5)] + passage
        context, rid = list(prompt), f"copy{n}"
        for t in copy:
            [draft] = drafter.prepare_draft_tokens([request(rid, context, prompt_len=len(prompt))])
            assert draft == fresh_draft(drafter, ("v", rid), context)
            own_first += drafter._requests[("v", rid)].own_won  # its own tree goes first next step
            context = context + [t]
    assert own_first > 200  # of 480 steps


# --- speculation trees --------------------------------------------------------------------------------


def reference_tree(seqs: list[list[int]], context: list[int], m: int, max_depth: int, max_nodes: int,
                   min_prob: float, own: bool = False, cap: int = 256) -> tuple[list[int], list[int], float]:
    """SuffixDecoding's tree spelled out on scanned occurrences: best-first by path probability (each node's
    share of its parent's occurrences, those at a sequence's end counted), ties to the latest occurrence,
    from the match's latest `cap` occurrences (after one token: each first node's latest `cap`)."""
    occ = _occurrences(seqs, context[len(context) - m:])
    if own:
        occ.remove((len(seqs) - 1, len(seqs[-1]) - 1))
    order = itertools.count()
    heap: list = []

    def children(places: list[tuple[int, int]], prob: float, limit: int | None) -> list:
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, e in places:
            if e + 1 < len(seqs[i]):
                groups.setdefault(seqs[i][e + 1], []).append((i, e + 1))
        return [(prob * len(g) / len(places), t, g[-limit:] if limit else g) for t, g in groups.items()]

    def offer(parent: int, depth: int, found: list) -> None:
        for prob, t, g in found:
            if prob >= min_prob:
                latest = g[-1]
                heapq.heappush(heap, (-prob, (-latest[0], -latest[1]), next(order), parent, t, g, depth))

    if occ:
        offer(-1, 1, children(occ, 1.0, cap) if m == 1 else children(occ[-cap:], 1.0, None))
    tokens, parents, score = [], [], 0.0
    while heap and len(tokens) < max_nodes:
        negative, _, _, parent, t, g, depth = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        score -= negative
        if depth < max_depth:
            offer(len(tokens) - 1, depth + 1, children(g, -negative, None))
    return tokens, parents, score


@pytest.mark.parametrize("cap", [256, 3])
def test_speculation_trees_are_what_a_suffix_trie_grows(cap, vectorized, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(suffix_index, "_TREE_OCCURRENCES", cap)
    rng = random.Random(5)
    grown = 0
    for _ in range(60):
        vocab, depth = rng.choice([2, 3, 6, 30]), rng.choice([4, 8, 24])
        index, seqs = SuffixIndex(depth), []
        for _ in range(rng.randint(1, 4)):
            s = [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
            index.add(s)
            seqs.append(s)
        for _ in range(6):
            own = rng.random() < 0.4
            context = seqs[-1] if own else [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            m = index.speculate(context, 8, 2.0, own=own).match_len
            if not m:
                continue
            knobs = (rng.randint(1, 8), rng.choice([1, 4, 16, 64]), rng.choice([0.0, 0.05, 0.3]))
            got = index.speculate_tree(context, m, *knobs, own=own)
            tokens, parents, score = reference_tree(seqs, context, m, *knobs, own=own, cap=cap)
            assert (got.tokens, got.parents) == (tokens, parents)
            assert got.score == pytest.approx(score)
            assert tree_problem(got.tokens, got.parents, knobs[0], knobs[1]) == ""
            grown += len(got.tokens) > max(depths(got.parents), default=0)  # it branched
    assert grown > 20


def test_a_tree_budget_takes_the_first_nodes_and_its_first_branch_is_the_chain() -> None:
    rng = random.Random(3)
    phrases = [[rng.randrange(10) for _ in range(rng.randint(2, 6))] for _ in range(5)]
    drafter = SuffixDrafter()
    for i in range(6):
        finish(drafter, f"old{i}", [99], [t for _ in range(12) for t in rng.choice(phrases)])
    checked = 0
    for i in range(30):
        history = [t for _ in range(rng.randint(1, 8)) for t in rng.choice(phrases)]
        [chain] = drafter.prepare_draft_tokens([request(f"c{i}", history)])
        [full] = drafter.prepare_draft_tokens([request(f"t{i}", history, draft_len=8, nodes=64)])
        [small] = drafter.prepare_draft_tokens([request(f"s{i}", history, draft_len=8, nodes=5)])
        assert isinstance(full, DraftTree) and tree_problem(full.tokens, full.parents, 8, 64) == ""
        assert (list(small.tokens), list(small.parents)) == (list(full.tokens[:5]), list(full.parents[:5]))
        assert first_branch(full.tokens, full.parents) == chain
        checked += len(full) > len(chain) > 0
    assert checked > 10
    assert TREE_CAPABILITY in drafter.capabilities
    [chain] = drafter.prepare_draft_tokens([request("c", history, draft_len=8, nodes=0)])
    assert isinstance(chain, list)


def test_counts_and_probabilities_of_a_speculation_tree() -> None:
    index = SuffixIndex(24)
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9, 9], [1, 2, 3]):
        index.add(s)
    # [2, 3] occurs 4 times: then 4 twice (1/2), 9 once (1/4), and once the sequence ends. After [2, 3, 4]:
    # 5 and 6 once each (1/2 * 1/2); after [2, 3, 9]: 9 (1/4). Ties go to the latest occurrence.
    tree = index.speculate_tree([2, 3], 2, max_depth=2, max_nodes=8, min_token_prob=0.0)
    assert (tree.tokens, tree.parents) == ([4, 9, 9, 6, 5], [-1, -1, 1, 0, 0])
    assert tree.score == pytest.approx(1 / 2 + 1 / 4 + 1 / 4 + 1 / 4 + 1 / 4)
    # min_token_prob prunes below it; the depth and the node budget cut too.
    assert index.speculate_tree([2, 3], 2, 2, 8, min_token_prob=0.3).tokens == [4]
    assert index.speculate_tree([2, 3], 2, 1, 8, min_token_prob=0.0).tokens == [4, 9]
    assert index.speculate_tree([2, 3], 2, 2, 2, min_token_prob=0.0).tokens == [4, 9]
    # A one-token match starts from the running counts: 3 is followed by 4 twice and 9 once, of 4.
    tree = index.speculate_tree([3], 1, 1, 8, min_token_prob=0.0)
    assert (tree.tokens, tree.score) == ([4, 9], pytest.approx(3 / 4))
    assert index.speculate_tree([42], 1, 4, 8).tokens == []


@pytest.mark.parametrize("cursor_max", [256, 4])
def test_a_cursor_grows_the_trees_a_fresh_lookup_does(vectorized, cursor_max, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(suffix_index, "_CURSOR_MAX", cursor_max)
    rng = random.Random(13)
    used = 0
    for _ in range(20):
        phrases = [[rng.randrange(12) for _ in range(rng.randint(2, 8))] for _ in range(rng.randint(2, 5))]
        index = SuffixIndex(rng.choice([6, 12, 24]))
        for _ in range(rng.randint(1, 5)):
            index.add([t for _ in range(rng.randint(2, 30)) for t in rng.choice(phrases)])
        cursor, context = suffix_index.Cursor(), list(rng.choice(phrases))
        for _ in range(15):
            context += rng.choice(phrases)[:rng.randint(1, 4)]
            m = index.speculate(context, 8, 2.0, cursor=cursor).match_len
            if m:
                used += cursor.seen == len(context) and cursor.least <= m
                assert index.speculate_tree(context, m, 8, 16, 0.05, cursor=cursor) == \
                    index.speculate_tree(context, m, 8, 16, 0.05)
    assert used > 50
