"""The suffix tree of SuffixDecoding, kept as occurrence lists instead of nodes.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; Arctic Inference, vLLM's
`method="suffix"`) keeps a suffix trie of its sequences truncated at
`max_depth`: the node of a token path P (|P| <= max_depth) counts the places
where P occurs, and its children are the tokens that follow those occurrences.
Drafting walks from the node of the context's suffix to the most frequent child,
multiplying the estimated probability by child count / parent count.

A trie with a node per (position, depth) costs about max_depth nodes per token,
far too many Python objects for a global tree over thousands of outputs, and
the C++ original compresses paths to avoid it. Here the same counts come from
occurrence lists: for every pair of adjacent tokens, the ascending positions of
its second token. The node of P is the set of places P ends at; its count is
that set's size and its children are the tokens after each place. Single
tokens use running counts. Memory is a few words per token whatever
`max_depth` is.

A lookup reads the list of the rarest pair among the context's last tokens:
every match through that pair is in it, and one comparison of each listed
place against the context (a slice compare, or numpy for long lists) says how
many tokens match there. Drafting then merges the places by the tokens that
follow them, longest match first, and walks those weighted paths once per
distinct match length (numpy walks for many places, skipping lengths whose first
step already cannot win). Shorter matches, which only a more frequent pair
lists, are looked up only while their draft could still beat the best one found.
A context that grows step by step keeps its matches in a Cursor and extends them
by the tokens it gained instead of looking them up again.

Sequences sit in one int32 buffer, each after a separator (-1, never a token),
so no match or continuation crosses from one sequence into another.
Positions are absolute (they survive compaction of evicted sequences), and
evicting the oldest sequence removes the heads of its pairs' lists: the global
tree evicts first in, first out, so that is all eviction ever needs.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from heapq import heappop, heappush
from itertools import accumulate, count
from operator import itemgetter
from typing import Any

try:
    import numpy as np
except ImportError:  # optional: the SDK runs without it; it only speeds up frequent patterns
    np = None

SEP = -1
_SEP_BYTES = array("i", [SEP]).tobytes()
_SHIFT = 31  # token ids are non-negative int32: (a << 31) | b is a unique pair key
# Above this many occurrences a step runs on numpy arrays (when installed); below, plain Python is faster.
_VECTOR_MIN = 48
# A walk groups occurrences by what follows them, in plain Python up to this many; numpy above.
_WALK_VECTOR_MIN = 256
# Up to this many matches are drafted from the paths of what follows them; more, by numpy walks.
_TRIE_MAX = 256
# A cursor keeps at most this many matches (the longest), so that carrying them costs little.
_CURSOR_MAX = 256
# Estimated bytes per distinct pair: its list object and its entries in two dicts (CPython 3.11).
_PAIR_OVERHEAD_BYTES = 260
# Estimated bytes per distinct token (its count's entry and its dict of followers), and per index (the
# object and its empty containers): tracemalloc on CPython 3.11 measured about 210 and 1,200, rounded up
# here to cover a global tree's choice table and scope name. They weigh little in one large tree, but a
# drafter holding many small ones (a tree per cache salt, one per request) is mostly them.
_TOKEN_OVERHEAD_BYTES = 240
_INDEX_OVERHEAD_BYTES = 1500
# A speculation tree grows from at most this many of its match's latest occurrences (for a one-token
# match: of each first node's), so that a frequent pattern costs no more than a rare one.
_TREE_OCCURRENCES = 256


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    score: float = 0.0  # the sum of the tokens' estimated probabilities: expected accepted tokens
    match_len: int = 0  # context tokens matched before the draft


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class TreeDraft:
    """A speculation tree: node i follows node parents[i] (-1: the context's last token)."""
    tokens: list[int]
    parents: list[int]
    score: float = 0.0  # the sum of the nodes' estimated path probabilities: expected accepted tokens


NO_TREE = TreeDraft([], [])


@dataclass(eq=False)
class Cursor:
    """Where one growing context matched in one index, kept between calls.

    The context only grows, by a few tokens a step. A match of m tokens that ended at position e
    and is followed there by the k tokens the context gained is a match of m + k tokens ending at
    e + k, and every match of m + k tokens either comes from one of m tokens so (its end k places
    back was already in the index) or lies in a sequence added since. So a cursor that held every
    match of `least` or more tokens needs no lookup for matches of least + k or more: only
    shorter ones, when they could still win, and sequences added since are looked up again.
    """
    index: object | None = None  # the identity of the index it describes; None: nothing known
    seen: int = 0  # the context's length then
    pattern: list[int] = field(default_factory=list)  # its last max_depth tokens then
    ends: list[int] = field(default_factory=list)  # where each match ends (absolute)
    lengths: list[int] = field(default_factory=list)  # and how many tokens it matches
    least: int = 0  # ends holds every match of this many tokens or more
    end: int = 0  # the index's end then (absolute): tokens after it were added since

    def nbytes(self) -> int:
        """Estimated memory held: two list slots and an int object per match and per pattern token."""
        return 72 * len(self.ends) + 36 * len(self.pattern)


class SuffixIndex:
    """Sequences and the counts of their suffix trie truncated at `max_depth`."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2")
        self.max_depth = max_depth
        self._buf = array("i", [SEP])  # [SEP] + (sequence + [SEP]) * n
        self._base = 0  # absolute position of _buf[0]
        self._counts: dict[int, int] = {}  # token -> occurrences
        self._next: dict[int, dict[int, int]] = {}  # token -> following token -> occurrences of the pair
        self._pairs: dict[int, array] = {}  # pair key -> absolute positions of its second token, ascending
        self._spans: deque[tuple[int, int]] = deque()  # (start, end) absolute of each sequence, oldest first
        self._identity = object()  # what a Cursor of this index holds (not the index: it may be dropped)
        self.num_tokens = 0

    # --- contents ---

    def __len__(self) -> int:
        """Sequences held."""
        return len(self._spans)

    def add(self, tokens: Sequence[int]) -> None:
        """Add a new sequence."""
        start = self._base + len(self._buf)
        self._spans.append((start, start))
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the newest sequence."""
        if not self._spans:
            raise ValueError("no sequence to extend")
        tokens = _ints(tokens)
        if not tokens:
            return
        buf = self._buf
        start, pos = self._spans[-1]
        if pos > start:
            buf.pop()  # the separator after the sequence: it goes on
            prev = buf[-1]
        else:
            prev = SEP
        buf.extend(tokens)
        buf.append(SEP)
        counts, nexts, pairs = self._counts, self._next, self._pairs
        for tok in tokens:
            counts[tok] = counts.get(tok, 0) + 1
            if prev != SEP:
                following = nexts.get(prev)
                if following is None:
                    following = nexts[prev] = {}
                following[tok] = following.get(tok, 0) + 1
                key = (prev << _SHIFT) | tok
                positions = pairs.get(key)
                if positions is None:
                    positions = pairs[key] = array("q")
                positions.append(pos)
            prev = tok
            pos += 1
        self._spans[-1] = (start, pos)
        self.num_tokens += len(tokens)

    def tokens(self, index: int = -1) -> list[int]:
        """The tokens of one sequence (default: the newest)."""
        start, end = self._spans[index]
        return self._buf[start - self._base:end - self._base].tolist()

    def packed(self) -> tuple[array, array]:
        """(every sequence's tokens, oldest first, a separator between each two; their lengths): a copy
        of the live part of the buffer, taken whole."""
        if not self._spans:
            return array("i"), array("i")
        base = self._base
        return (self._buf[self._spans[0][0] - base:self._spans[-1][1] - base],
                array("i", [end - start for start, end in self._spans]))

    def evict_oldest(self) -> None:
        """Forget the oldest sequence."""
        start, end = self._spans.popleft()
        buf, base = self._buf, self._base
        seq = buf[start - base:end - base]
        counts, nexts, pairs = self._counts, self._next, self._pairs
        seen: set[int] = set()
        prev = SEP
        for tok in seq:
            left = counts[tok] - 1
            if left:
                counts[tok] = left
            else:
                del counts[tok]
            if prev != SEP:
                following = nexts[prev]
                left = following[tok] - 1
                if left:
                    following[tok] = left
                else:
                    del following[tok]
                    if not following:
                        del nexts[prev]
                key = (prev << _SHIFT) | tok
                if key not in seen:
                    seen.add(key)
                    positions = pairs[key]
                    # This sequence is the oldest: its positions head every list it is in.
                    del positions[:bisect_right(positions, end)]
                    if not positions:
                        del pairs[key]
            prev = tok
        self.num_tokens -= len(seq)
        # Drop the dead head of the buffer once it outweighs the live part (amortized O(1)).
        dead = (self._spans[0][0] if self._spans else base + len(buf)) - 1 - base
        if dead > len(buf) // 2:
            del buf[:dead]
            self._base += dead

    def nbytes(self) -> int:
        """Estimated memory held: the token buffer, one position per pair, and per-pair, per-token and
        per-index overhead."""
        return (_INDEX_OVERHEAD_BYTES + 4 * len(self._buf) + 8 * (self.num_tokens - len(self._spans))
                + _PAIR_OVERHEAD_BYTES * len(self._pairs) + _TOKEN_OVERHEAD_BYTES * len(self._counts))

    # --- drafting ---

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, beat: float = 0.0,
                  cursor: Cursor | None = None, own: bool = False) -> Draft:
        """The best-scoring draft over every match length of the context's last max_depth tokens.

        A match of m tokens drafts at most min(max_tokens, int(m * max_spec_factor +
        max_spec_offset), max_depth - m) tokens, each the most frequent child (ties: the
        most recent), stopping before the estimated probability falls below
        min_token_prob. The draft with the highest score wins, the longer match on a
        tie; it must score above `beat` (another tree's best), or there is no draft.

        With a `cursor`, `context` is the caller's whole context, which only grows from call to
        call: the matches found last time are extended by the tokens added since (see Cursor).
        `own`: the context is this index's newest sequence, whose own end is then no occurrence (it
        has no continuation yet, so counting it would only lower every estimate).
        """
        seen = len(context)
        n = min(seen, self.max_depth)
        if n == 0 or max_tokens <= 0:
            return NO_DRAFT
        pattern = _ints(context[seen - n:])
        last = pattern[-1]
        skip = self._spans[-1][1] - 1 if own and self._spans else None  # the context's own end
        if self._counts.get(last, 0) <= (skip is not None):
            if cursor is not None:
                self._remember(cursor, seen, pattern, [], [], 2)  # no match at all
            return NO_DRAFT
        budget = _budgets(n, max_tokens, max_spec_factor, max_spec_offset, self.max_depth)
        if max(budget[1:]) <= beat:  # a draft of n tokens scores at most n
            return NO_DRAFT
        best: tuple[list[int], int] | None = None  # tokens, match length
        best_score = beat
        top = n
        while top >= 2 and budget[top] <= best_score:
            top -= 1
        known = self._advance(cursor, seen, pattern) if cursor is not None else None
        if known is not None:
            ends, lengths, least = known
            best, best_score = self._best_of(ends, lengths, least, top, budget, min_token_prob, best, best_score,
                                             skip)
            top = min(top, least - 1)
        # pairs[j]: where the context's pair ending j tokens before its end occurs; a missing pair bounds the match.
        pairs: list[array] = []
        sizes: list[int] = []
        get = self._pairs.get
        while True:
            while top >= 2 and budget[top] <= best_score:  # a draft of n tokens scores at most n
                top -= 1
            if top < 2:
                break
            if len(pairs) < top - 1:
                positions = get((pattern[-len(pairs) - 2] << _SHIFT) | pattern[-len(pairs) - 1])
                if positions is None:
                    top = len(pairs) + 1  # no match is longer
                else:
                    pairs.append(positions)
                    sizes.append(len(positions))
                continue
            # A match of m tokens holds every pair of the context's last m: the rarest pair among the last
            # `top` tokens, j before the end, lists every match of j + 2 tokens or more. Shorter ones,
            # needed only while they could still beat the best, come from the next rarest.
            j = sizes.index(min(sizes[:top - 1]))
            # Lengths are counted up to what is known already (all of them, the first time).
            limit = n if known is None else known[2] - 1
            ends, lengths = self._match_lengths(pairs[j], j, pattern, limit)
            best, best_score = self._best_of(ends, lengths, j + 2, top, budget, min_token_prob, best, best_score,
                                             skip)
            known = _merge_known(ends, lengths, j + 2, limit, known)
            top = j + 1
        if known is not None and cursor is not None:
            self._remember(cursor, seen, pattern, *known)
        if budget[1] > best_score:
            tokens, probs = self._walk_from_token(last, budget[1], min_token_prob, skip is not None)
            if sum(probs) > best_score:
                best, best_score = (tokens, 1), sum(probs)
        return NO_DRAFT if best is None else Draft(best[0], best_score, best[1])

    def occurs(self, context: Sequence[int], length: int, own: bool = False) -> bool:
        """Whether the context's last `length` tokens (2 or more) occur in this index; with `own` (as in
        `speculate`), other than at the context's own end."""
        pattern = _ints(context[len(context) - min(len(context), self.max_depth):])
        skip = self._spans[-1][1] - 1 if own and self._spans else None
        return any(e != skip for e in self._matches_after(pattern, length, self._base)[0])

    def speculate_tree(self, context: Sequence[int], match_len: int, max_depth: int, max_nodes: int,
                       min_token_prob: float = 0.1, own: bool = False, cursor: Cursor | None = None) -> TreeDraft:
        """SuffixDecoding's speculation tree after the context's last `match_len` tokens: grown best-first
        by estimated path probability (each node's share of its parent's occurrences, times the parent's;
        ties: the more recent), at most `max_nodes` nodes and `max_depth` deep, no node below
        `min_token_prob`. Parents come before children and nodes go in the order they were chosen, so
        the first m nodes are the tree a budget of m grows, and each node's first child is the greedy
        choice (`speculate`'s walk, from the latest _TREE_OCCURRENCES occurrences). `own` as in
        `speculate`; a `cursor` that `speculate` left at this context saves looking the match up again."""
        n = match_len
        if n < 1 or n > len(context) or max_depth < 1 or max_nodes < 1:
            return NO_TREE
        pattern = _ints(context[len(context) - n:])
        last = pattern[-1]
        skip = self._spans[-1][1] - 1 if own and self._spans else None
        order = count()  # the last tie-break: first offered first
        heap: list[tuple[float, int, int, int, int, list[int], int]] = []

        def offer(parent: int, depth: int, children: list[tuple[float, int, list[int]]]) -> None:
            for prob, token, occ in children:
                if prob >= min_token_prob:
                    heappush(heap, (-prob, -occ[-1], next(order), parent, token, occ, depth))

        if n == 1:  # one token has no list of its places: the first step from the running counts
            total = self._counts.get(last, 0) - (skip is not None)
            following = self._next.get(last, {})
            offer(-1, 1, [(c / total, t, self._pairs[(last << _SHIFT) | t][-_TREE_OCCURRENCES:].tolist())
                          for t, c in following.items()] if total > 0 else [])
        else:
            offer(-1, 1, self._children(self._latest_matches(pattern, skip, len(context), cursor), 1.0))
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        while heap and len(tokens) < max_nodes:
            negative, _, _, parent, token, occ, depth = heappop(heap)
            tokens.append(token)
            parents.append(parent)
            score -= negative
            if depth < max_depth:
                offer(len(tokens) - 1, depth + 1, self._children(occ, -negative))
        return TreeDraft(tokens, parents, score)

    def _latest_matches(self, pattern: list[int], skip: int | None, seen: int, cursor: Cursor | None) -> list[int]:
        """Where the last _TREE_OCCURRENCES occurrences of `pattern` (two tokens or more), the end of a
        context of `seen` tokens, end, ascending, without `skip`."""
        n = len(pattern)
        if cursor is not None and cursor.index is self._identity and cursor.seen == seen and cursor.least <= n:
            # It holds every match of cursor.least tokens or more: those of n or more are the occurrences.
            return [e for e, m in zip(cursor.ends, cursor.lengths) if m >= n and e != skip][-_TREE_OCCURRENCES:]
        positions = self._pairs.get((pattern[-2] << _SHIFT) | pattern[-1])
        if positions is None:
            return []
        ends, lengths = self._match_lengths(positions, 0, pattern, n)
        if isinstance(ends, list):
            whole = [e for e, m in zip(ends, lengths) if m == n and e != skip]
        else:
            whole = ends[(lengths == n) & (ends != (-1 if skip is None else skip))].tolist()
        return whole[-_TREE_OCCURRENCES:]

    def _children(self, occ: list[int], prob: float) -> list[tuple[float, int, list[int]]]:
        """(path probability, token, where the child's path ends) of the children of the node whose
        occurrences end at `occ`; an occurrence at a sequence's end has no child but still counts."""
        buf, base = self._buf, self._base
        groups: dict[int, list[int]] = {}
        for p in occ:
            t = buf[p + 1 - base]
            if t != SEP:
                groups.setdefault(t, []).append(p + 1)
        return [(prob * len(g) / len(occ), t, g) for t, g in groups.items()]

    def _advance(self, cursor: Cursor, seen: int, pattern: list[int]) -> tuple[list[int], list[int], int] | None:
        """The cursor's matches carried to the context grown to `seen` tokens ending in `pattern`: every
        match of `least` or more tokens, as (ends, lengths, least); None when the cursor cannot tell."""
        k = seen - cursor.seen
        n = len(pattern)
        least = cursor.least + k
        if cursor.index is not self._identity or not cursor.least or k < 0 or least > n:
            return None
        old = cursor.pattern
        if old[len(old) - (n - k):] != pattern[:n - k]:  # not the same context grown
            return None
        buf, base = self._buf, self._base
        live = self._spans[0][0] if self._spans else base + len(buf)
        ends: list[int] = []
        lengths: list[int] = []
        # A match of m >= least tokens whose end was a token k places back extends a match of m - k there.
        if np is not None and len(cursor.ends) > _VECTOR_MIN:
            was = np.asarray(cursor.ends, np.int64)
            # The k tokens after each end (clipped: the buffer ends with a separator, which matches nothing;
            # ends evicted since may lie before the buffer's start, and are dropped).
            rows = np.clip(was[:, None] + (1 - base) + np.arange(k), 0, len(buf) - 1)
            same = (was >= live) & (np.frombuffer(buf, np.int32)[rows] == np.array(pattern[n - k:], np.int32)).all(1)
            ends = (was[same] + k).tolist()
            lengths = np.minimum(np.asarray(cursor.lengths)[same] + k, n).tolist()
        elif k == 1:
            t = pattern[-1]
            for e, m in zip(cursor.ends, cursor.lengths):
                if e >= live and buf[e + 1 - base] == t:
                    ends.append(e + 1)
                    lengths.append(m + 1 if m < n else n)
        elif k:
            added = array("i", pattern[n - k:])
            for e, m in zip(cursor.ends, cursor.lengths):
                if e >= live and buf[e + 1 - base:e + 1 - base + k] == added:
                    ends.append(e + k)
                    lengths.append(min(m + k, n))
        else:
            for e, m in zip(cursor.ends, cursor.lengths):
                if e >= live:
                    ends.append(e)
                    lengths.append(m)
        # The others end k places or more after the index's end then: in sequences added since.
        first = cursor.end - 1 + k
        if base + len(buf) - 1 > first:
            more, more_lengths = self._matches_after(pattern, least, first)
            ends += more
            lengths += more_lengths
        return ends, lengths, least

    def _matches_after(self, pattern: list[int], least: int, first: int) -> tuple[list[int], list[int]]:
        """The matches of `least` or more tokens (least >= 2) that end at `first` or later."""
        get = self._pairs.get
        rarest, j = None, 0
        for i in range(least - 1):
            positions = get((pattern[-i - 2] << _SHIFT) | pattern[-i - 1])
            if positions is None:
                return [], []
            if rarest is None or len(positions) < len(rarest):
                rarest, j = positions, i
        assert rarest is not None
        tail = rarest[bisect_left(rarest, first - j):]
        ends, lengths = self._match_lengths(tail, j, pattern, len(pattern))
        if not isinstance(ends, list):
            ends, lengths = ends.tolist(), lengths.tolist()
        if j + 2 < least:
            keep = [i for i, m in enumerate(lengths) if m >= least]
            ends, lengths = [ends[i] for i in keep], [lengths[i] for i in keep]
        return ends, lengths

    def _remember(self, cursor: Cursor, seen: int, pattern: list[int], ends: Any, lengths: Any, least: int) -> None:
        """Keep every match of `least` or more tokens in the cursor, fewer when there are too many."""
        ends, lengths, least = _longest(ends, lengths, least)
        cursor.index, cursor.seen, cursor.pattern = self._identity, seen, pattern
        cursor.ends, cursor.lengths, cursor.least = ends, lengths, least
        cursor.end = self._base + len(self._buf)

    def _best_of(self, ends: Any, lengths: Any, shortest: int, cap: int, budget: list[int], min_prob: float,
                 best: tuple[list[int], int] | None, best_score: float,
                 skip: int | None = None) -> tuple[tuple[list[int], int] | None, float]:
        """The best draft over the matches (their ends and lengths) of `shortest` or more tokens, each counted
        as at most `cap` long (a longer one can do no better), but the one ending at `skip`."""
        if shortest > cap:
            return best, best_score
        if skip is not None:
            if isinstance(ends, list):
                if skip in ends:
                    i = ends.index(skip)
                    ends, lengths = ends[:i] + ends[i + 1:], lengths[:i] + lengths[i + 1:]
            else:
                keep = ends != skip
                ends, lengths = ends[keep], lengths[keep]
        if isinstance(lengths, list) or len(lengths) <= _TRIE_MAX:
            return self._best_by_paths(ends, lengths, shortest, cap, budget, min_prob, best, best_score)
        lengths = np.minimum(lengths, cap)
        found = np.unique(lengths)[::-1]
        # Every step's probability is at most the first one's, the most frequent next token's share: a
        # walk of `most` tokens scores at most most * that, so most groups of many ends need no walk.
        group = np.searchsorted(-found, -lengths)  # the group of each end: those of found[group] tokens
        following, ids = np.unique(np.frombuffer(self._buf, np.int32)[ends - (self._base - 1)], return_inverse=True)
        counts = np.bincount(ids.ravel() * len(found) + group, minlength=len(following) * len(found))
        # By next token: the ends of each group or a longer one.
        counts = counts.reshape(len(following), len(found)).cumsum(axis=1)
        totals = counts.sum(axis=0)
        if following[0] == SEP:  # the end of a sequence: no next token
            counts[0] = 0
        shares = (counts.max(axis=0) / totals).tolist()
        found = found.tolist()
        for i, length in enumerate(found):
            # Matches of `low` to `length` tokens end at the same places: one walk serves them all.
            low = found[i + 1] + 1 if i + 1 < len(found) else shortest
            most = max(budget[low:length + 1])
            if most <= best_score or most * shares[i] < best_score - 1e-9:  # (rounding: a tie is walked)
                continue
            tokens, probs = self._walk(ends[lengths >= length], most, 1.0, min_prob)
            best, best_score = _keep_best(tokens, probs, length, low, budget, best, best_score)
        return best, best_score

    def _best_by_paths(self, ends: Any, lengths: Any, shortest: int, cap: int, budget: list[int], min_prob: float,
                       best: tuple[list[int], int] | None, best_score: float
                       ) -> tuple[tuple[list[int], int] | None, float]:
        """The best draft over matches of `shortest` or more tokens, given where they end and how long each is.

        Longest first, each distinct length adds its ends to the paths of what follows them (ends with the
        same next tokens merged into one: how many, the latest of them), and a greedy walk reads the paths:
        the occurrences are read once, not once for each length."""
        if not isinstance(ends, list):
            ends, lengths = ends.tolist(), lengths.tolist()
        by_length: dict[int, list[int]] = {}
        for e, length in zip(ends, lengths):
            by_length.setdefault(length if length < cap else cap, []).append(e)
        if not by_length:
            return best, best_score
        found = sorted(by_length, reverse=True)
        depth = max(budget[shortest:found[0] + 1])
        buf, base = self._buf, self._base
        paths: dict[bytes, list[int]] = {}  # the next `depth` tokens -> [ends with them, the latest]
        # While every end goes on the same way, each step has probability 1 and every length drafts the same
        # path (cut to its budget): one walk, whose lengths are judged together once the paths branch.
        pending: list[Any] | None = None  # tokens, probs, the longest and the shortest length they serve
        added = 0  # ends in the paths
        for i, length in enumerate(found):
            if pending is None and max(budget[shortest:length + 1]) <= best_score:
                break  # no match this short or shorter can win
            added += len(by_length[length])
            for p in by_length[length]:
                key = buf[p + 1 - base:p + 1 - base + depth].tobytes()
                seen = paths.get(key)
                if seen is None:
                    paths[key] = [1, p]
                elif p > seen[1]:
                    seen[0] += 1
                    seen[1] = p
                else:
                    seen[0] += 1
            # Matches of `low` to `length` tokens end at the same places: one walk serves them all.
            low = found[i + 1] + 1 if i + 1 < len(found) else shortest
            if pending is not None:
                if len(paths) == 1:  # still the one path
                    pending[3] = low
                    continue
                best, best_score = _keep_best(*pending, budget, best, best_score)
                pending = None
            most = max(budget[low:length + 1])
            if most <= best_score:
                continue
            if len(paths) == 1:
                path = array("i", next(iter(paths))).tolist()
                if SEP in path:
                    del path[path.index(SEP):]
                pending = [path, [1.0] * len(path), length, low]
                continue
            tokens, probs = _walk_paths(paths, added, most, min_prob)
            best, best_score = _keep_best(tokens, probs, length, low, budget, best, best_score)
        if pending is not None:
            best, best_score = _keep_best(*pending, budget, best, best_score)
        return best, best_score

    def _match_lengths(self, positions: array, j: int, pattern: list[int], top: int) -> tuple[Any, Any]:
        """The ends of the matches through a pair j tokens before the pattern's end (its second token at
        each of `positions`) that match at least j + 2 tokens, and how many each matches, up to `top`."""
        buf, base, need = self._buf, self._base, j + 2
        if np is not None and len(positions) > _VECTOR_MIN:
            view = np.frombuffer(buf, np.int32)
            backwards = pattern[::-1]
            # In the buffer; clipped to its last place, a separator, which matches nothing.
            ends = np.minimum(np.frombuffer(positions, np.int64) + (j - base), len(buf) - 1)
            for back in range(j):  # the j tokens after the pair (it matches everywhere)
                ends = ends[view[ends - back] == backwards[back]]
            # Then back from the pair while the places still match, a column at a time over fewer and fewer of
            # them (the buffer starts with a separator, so no match reaches before it).
            lengths = np.full(len(ends), need)
            alive = np.arange(len(ends))
            for back in range(need, top):
                alive = alive[view[ends[alive] - back] == backwards[back]]
                if not len(alive):
                    break
                lengths[alive] += 1
            ends = ends + base
            if len(ends) <= _VECTOR_MIN:
                return ends.tolist(), lengths.tolist()
            return ends, lengths
        whole = array("i", pattern[len(pattern) - top:])
        backwards = pattern[::-1]
        least = whole[top - need:]
        ends, lengths = [], []
        for q in positions:
            e = q + j - base + 1  # one past the end, in the buffer
            # A window reaching before the buffer's start slices short (a negative start wraps past the end)
            # and so never equals the pattern.
            if buf[e - top:e] == whole:
                length = top
            elif buf[e - need:e] != least:
                continue
            else:
                length = need
                while buf[e - 1 - length] == backwards[length]:  # stops within top: the whole window differs
                    length += 1
            ends.append(e - 1 + base)
            lengths.append(length)
        return ends, lengths

    def _walk_from_token(self, token: int, budget: int, min_prob: float,
                         skip_one: bool = False) -> tuple[list[int], list[float]]:
        """A draft after a single-token match: the first step from the running counts (less one occurrence,
        the context's own end, with `skip_one`)."""
        following = self._next.get(token)
        if not following:
            return [], []
        top = max(following.values())
        tied = [t for t, c in following.items() if c == top]
        # Ties go to the token seen most recently after `token`.
        child = tied[0] if len(tied) == 1 else max(tied, key=lambda t: self._pairs[(token << _SHIFT) | t][-1])
        prob = top / (self._counts[token] - skip_one)
        if prob < min_prob:
            return [], []
        if budget == 1:
            return [child], [prob]
        tokens, probs = self._walk(_occurrences(self._pairs[(token << _SHIFT) | child]), budget - 1, prob, min_prob)
        return [child] + tokens, [prob] + probs

    def _walk(self, occ: Any, budget: int, prob: float,
              min_prob: float) -> tuple[list[int], list[float]]:
        """Greedy path down from the node whose occurrences end at `occ` (ascending): its tokens and their
        estimated probabilities (each the product of child count / parent count down to it)."""
        if budget <= 0:
            return [], []
        if not isinstance(occ, list) and len(occ) > _WALK_VECTOR_MIN:
            return self._walk_vectorized(occ, budget, prob, min_prob)
        buf, base = self._buf, self._base
        # The next `budget` tokens after each occurrence (they may run past its sequence's separator, which
        # ends the path): occurrences with the same ones walk together, as one weight and its latest place.
        paths: dict[bytes, list[int]] = {}
        if not isinstance(occ, list):
            occ = occ.tolist()
        for p in occ:
            i = p + 1 - base
            key = buf[i:i + budget].tobytes()
            seen = paths.get(key)
            if seen is None:
                paths[key] = [1, p]
            else:
                seen[0] += 1
                seen[1] = p
        return _walk_paths(paths, len(occ), budget, min_prob, prob)

    def _walk_vectorized(self, occ: Any, budget: int, prob: float,
                         min_prob: float) -> tuple[list[int], list[float]]:
        """_walk on a numpy array of many occurrences, a step at a time."""
        view = np.frombuffer(self._buf, np.int32)
        shift = self._base - 1
        tokens: list[int] = []
        probs: list[float] = []
        while len(tokens) < budget:
            if len(occ) <= _WALK_VECTOR_MIN:
                more, more_probs = self._walk(occ.tolist(), budget - len(tokens), prob, min_prob)
                return tokens + more, probs + more_probs
            following = view[occ - shift]
            values, counts = np.unique(following[following != SEP], return_counts=True)
            if len(values) == 0:
                break
            top = int(counts.max())
            tied = values[counts == top]
            # Ties go to the most recent occurrence (occ is ascending).
            child = int(tied[0]) if len(tied) == 1 else int(following[np.flatnonzero(np.isin(following, tied))[-1]])
            prob *= top / len(occ)
            if prob < min_prob:
                break
            occ = occ[following == child] + 1
            tokens.append(child)
            probs.append(prob)
        return tokens, probs


def draft_budget(match_len: int, max_tokens: int, factor: float, offset: float, max_depth: int) -> int:
    """The most a match of `match_len` tokens may draft (`speculate`'s rule)."""
    return _budgets(match_len, max_tokens, factor, offset, max_depth)[match_len]


@lru_cache(maxsize=256)
def _budgets(n: int, max_tokens: int, factor: float, offset: float, max_depth: int) -> list[int]:
    """budget[m]: the most a match of m <= n tokens may draft (read only: it is shared)."""
    return [min(max_tokens, int(m * factor + offset + 1e-6), max_depth - m) for m in range(n + 1)]


def _walk_paths(paths: dict[bytes, list[int]], total: int, most: int, min_prob: float,
                prob: float = 1.0) -> tuple[list[int], list[float]]:
    """The greedy walk over weighted paths (each the next tokens of its ends, as int32 bytes; a separator
    ends it; `total` ends in all): at most `most` tokens, each the most frequent next token (ties: the latest
    end), stopping before the estimated probability (`prob` times each step's share) falls below `min_prob`.
    The paths stay bytes: a step reads 4 of them, and no path is converted that the walk leaves."""
    alive = list(paths.items())
    chosen: list[bytes] = []  # each step's token, as the paths hold it
    probs: list[float] = []
    for at in range(0, 4 * most, 4):
        if len(alive) == 1:  # one way on: every further step has probability 1, as far as the path goes
            if prob >= min_prob:
                rest = alive[0][0][at:4 * most]
                # A token's last byte is below 0x80 (ids are non-negative), so the first 4 bytes of 0xff are
                # a whole separator, not the tail of one token and the head of the next.
                chosen.append(rest[:rest.find(_SEP_BYTES)] if _SEP_BYTES in rest else rest)
            break
        tally: dict[bytes, list[int]] = {}
        for key, (weight, latest) in alive:
            t = key[at:at + 4]
            if len(t) < 4 or t == _SEP_BYTES:
                continue
            counted = tally.get(t)
            if counted is None:
                tally[t] = [weight, latest]
            else:
                counted[0] += weight
                if latest > counted[1]:
                    counted[1] = latest
        if not tally:
            break
        child, (count, _) = max(tally.items(), key=itemgetter(1))  # ties: the most recent
        prob *= count / total
        if prob < min_prob:
            break
        chosen.append(child)
        probs.append(prob)
        if count != total:  # some went another way or ended here
            alive = [a for a in alive if a[0].startswith(child, at)]
        total = count
    tokens = array("i", b"".join(chosen)).tolist()
    return tokens, probs + [prob] * (len(tokens) - len(probs))


def _longest(ends: Any, lengths: Any, least: int) -> tuple[list[int], list[int], int]:
    """Every match of `least` or more tokens (their ends and lengths), or when there are more than _CURSOR_MAX,
    every match of a length with at most _CURSOR_MAX as long or longer (a higher least): what a cursor keeps."""
    if len(ends) > _CURSOR_MAX:
        if isinstance(lengths, list):
            least = sorted(lengths, reverse=True)[_CURSOR_MAX] + 1
            keep = [i for i, m in enumerate(lengths) if m >= least]
            ends, lengths = [ends[i] for i in keep], [lengths[i] for i in keep]
        else:
            cut = len(lengths) - _CURSOR_MAX - 1  # the place of the (_CURSOR_MAX + 1)th longest, ascending
            least = int(np.partition(lengths, cut)[cut]) + 1
            keep = lengths >= least
            ends, lengths = ends[keep], lengths[keep]
    if not isinstance(ends, list):
        ends, lengths = ends.tolist(), lengths.tolist()
    return ends, lengths, least


def _merge_known(ends: Any, lengths: Any, least: int, limit: int,
                 known: tuple[list[int], list[int], int] | None) -> tuple[list[int], list[int], int]:
    """What a cursor keeps (_longest) of every match of `least` or more tokens, from a lookup of them whose
    lengths were counted up to `limit`, and the `known` matches: every one of more than `limit` tokens, with
    its true length (None: the lookup counted every length)."""
    # A counted length is the true one below `limit`, and the longest matches are kept by their counted
    # lengths before the true ones are read from `known`: only for the few that are kept.
    ends, lengths, least = _longest(ends, lengths, least)
    if known is None:
        return ends, lengths, least
    if least > limit:  # more than _CURSOR_MAX matches reach `limit`: the longest are known ones
        return known
    longer = dict(zip(known[0], known[1]))
    return ends, [longer.get(e, m) if m == limit else m for e, m in zip(ends, lengths)], least


def _keep_best(tokens: list[int], probs: list[float], longest: int, shortest: int, budget: list[int],
               best: tuple[list[int], int] | None, best_score: float) -> tuple[tuple[list[int], int] | None, float]:
    """The better of `best` and a greedy path drafted after matches of `shortest` to `longest` tokens
    (each cut to its own budget); a tie keeps the earlier (longer) match."""
    total = list(accumulate(probs, initial=0.0))  # total[c]: the score of the first c tokens
    drafted = len(probs)
    score = total[min(max(budget[shortest:longest + 1]), drafted)]  # the best any of these lengths scores
    if score <= best_score:
        return best, best_score
    k = next(k for k in range(longest, shortest - 1, -1) if total[min(budget[k], drafted)] == score)
    return (tokens[:budget[k]], k), score


def _occurrences(positions: array) -> Any:
    """A pair's positions to filter: a list, or a numpy array when long and numpy is installed."""
    if np is None or len(positions) <= _VECTOR_MIN:
        return positions.tolist()
    return np.frombuffer(positions, np.int64).copy()


def _ints(tokens: Sequence[int]) -> list[int]:
    """Plain Python ints (a numpy or array('i') buffer would make numpy scalars or overflow the pair keys)."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]
