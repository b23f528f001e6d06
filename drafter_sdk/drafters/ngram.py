"""TensorRT-LLM's NGram pool drafter (prompt lookup), updated incrementally, in compact arrays.

The pool maps every n-gram `pattern` (1..max_matching_ngram_size tokens) seen
in a history to the `continuation`s that followed it (up to max_draft_len
tokens). The draft for a history is a continuation of its longest suffix found
in the pool. The knobs keep TensorRT-LLM's names and meaning:

- is_keep_all: keep every distinct continuation of a pattern; otherwise only
  the latest of the longest ones.
- is_use_oldest: with is_keep_all, propose the continuation first seen;
  otherwise the one most recently seen for the first time.
- is_public_pool: one pool shared by all requests instead of one per request.
  A request with a cache salt (`cache_salt_id`) keeps a pool of its own even
  so: what it holds is kept from everyone else, and it drafts from nothing
  anyone else wrote.

The drafts are those TensorRT-LLM's `NGramPoolManager` computes when it scans a
whole history in one pass; only the cost differs. A continuation is complete
once max_draft_len tokens followed its pattern and never changes after, so
complete ones are recorded once, as the history grows (cost per step does not
depend on context length). The few still-growing continuations at the tail
(fewer than max_draft_len tokens after them) are looked up in the history at
draft time instead of being stored and rewritten every step. Two deliberate
differences: no match gives an empty draft (not an end_id), and a public pool
only shares complete continuations.

Memory: a drafter service holds many long histories, so the pool holds no
Python object per n-gram. A request's pool is one open-addressing hash table
per pattern size whose slots are 4-byte offsets into the request's own history
(the SDK's token buffer, passed in at every call): the pattern and its
continuation are the tokens at that offset, so nothing is copied. About 3
entries per held token at 2/3 load or less come to roughly 12-36 bytes per
token at the default sizes. A public pool outlives requests, so it copies each
recorded pattern + continuation once into its own token arena instead; it grows
with the distinct n-grams of all requests, so past `max_public_pool_mib` it
starts afresh (drafts only cost speed; forgetting old n-grams costs a few).

Token trees (when the verifier allows some, `max_draft_nodes` > 0) are grown
best-first by estimated path probability, as EAGLE-2's dynamic trees are: the
next node is always the candidate most likely to lie on the target's path, so
nodes go where the drafter is unsure (siblings) or sure (deep chains) as the
history says, and any first m nodes are the best m-node tree (the verifier's
planner relies on this to size trees). A node's candidate children come from
the newest earlier occurrences of its context's last 1..max_matching_ngram_size
tokens (the history plus the node's path, so a branch that leaves the copied
text re-matches elsewhere): each occurrence votes for the token that followed
it with weight MATCH_WEIGHT^(tokens matched) x RECENCY^(newer occurrences). A
candidate's probability is its share of the votes times the reliability of its
longest match: how often, on the target's real outputs, a continuation backed
by a match that long was the next token (one matched token: about half the
time; three: nine times in ten; a long copy: nearly always). So a copy that has
matched for many tokens keeps a high probability per token, and its path stays
likely deep, as its real acceptance does. The probabilities were fitted on
recorded greedy outputs of SmolLM2 (tree_replay.py) and hold on held-out
prompts within about 0.15 per node. What the candidates leave is partly backed
off to the most frequent tokens of the recent history: on open text the next
token often follows no earlier pattern, and these fill the nodes the
occurrences do not need. `tree_min_prob` stops the growth at the first node
whose estimated path probability is below it: where verifying one more token
costs a noticeable share of a step (a CPU), a node that is rarely on the
target's path does not pay.
Trees draw on the request's own history only (the knobs above shape chains).
Their index is built on a request's first tree, compactly as well: per pattern
size, a table of each pattern's latest occurrence and an array linking every
occurrence to the previous one (4 bytes per token and size).
"""

from __future__ import annotations

import heapq
import logging
import sys
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from drafter_sdk.drafter import CACHE_SALT, LOOKAHEAD, TOKEN_TYPECODE, Drafter, DraftRequest, Key
from drafter_sdk.drafters import ngram_snapshot
from drafter_sdk.tree import ROOT, TREE_CAPABILITY, DraftTree

log = logging.getLogger(__name__)

_EMPTY = -1
# Python objects of one request's state besides its tables' arrays (the state object, its dict entry).
_REQUEST_OVERHEAD_BYTES = 200
# Tree scoring (see the module docstring), tuned by replaying SmolLM2's greedy outputs offline.
MATCH_WEIGHT = 2.0  # an occurrence's vote, per token it matches
MAX_MATCH = 12  # matched tokens counted, at most
RECENCY = 0.8  # an occurrence's vote, per newer occurrence
# How often a candidate backed by a match of m tokens is the target's next token, had it all the votes:
# 1 - MISS * MISS_DECAY^(m - 1), at most RELIABLE. Measured on SmolLM2's greedy outputs (a copy that has
# matched 3 tokens goes on about 9 times in 10, one of 12 tokens nearly always).
MISS, MISS_DECAY, RELIABLE = 0.55, 0.45, 0.98
MAX_OCCURRENCES = 4  # newest occurrences of each pattern size that offer a child
# The back-off below every pattern: the most frequent tokens of the history's recent window, sharing
# UNIGRAM_SHARE of the chance the occurrences leave (open text often says what no pattern predicted).
UNIGRAM_WINDOW = 512
UNIGRAM_TOP = 16
UNIGRAM_SHARE = 0.3


class OffsetTable:
    """A hash table whose entries are offsets into a token array (`source`); an entry's key is the
    `width` tokens at its offset. Linear probing over a power-of-two array('i'), at most 2/3 full.

    The table does not keep `source`: every call that may look at keys takes it, and the caller
    passes the same growing array each time (offsets stay valid because tokens are only appended).
    """

    __slots__ = ("width", "_slots", "_count")

    def __init__(self, width: int) -> None:
        self.width = width
        self._slots = array(TOKEN_TYPECODE, [_EMPTY]) * 8
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._slots)

    def find(self, source: array, key: array) -> tuple[int, int]:
        """(slot, offset) of `key`; offset is -1 when absent, and slot then where it would go."""
        slots, width = self._slots, self.width
        mask = len(slots) - 1
        i = hash(key.tobytes()) & mask
        while True:
            offset = slots[i]
            if offset == _EMPTY or source[offset:offset + width] == key:
                return i, offset
            i = (i + 1) & mask

    def store(self, source: array, slot: int, offset: int) -> None:
        """Point `slot` (from `find`, with no store since) at `offset`."""
        if self._slots[slot] == _EMPTY:
            self._count += 1
        self._slots[slot] = offset
        if self._count * 3 > len(self._slots) * 2:
            self._grow(source)

    def offsets(self) -> array:
        """Every entry's offset, in slot order."""
        return array(TOKEN_TYPECODE, (offset for offset in self._slots if offset != _EMPTY))

    def insert(self, source: array, offsets: array) -> None:
        """Add the entries at `offsets` (distinct keys: a later one with a key already held replaces it)."""
        for offset in offsets:
            slot, _ = self.find(source, source[offset:offset + self.width])
            self.store(source, slot, offset)

    def _grow(self, source: array) -> None:
        old, width = self._slots, self.width
        self._slots = array(TOKEN_TYPECODE, [_EMPTY]) * (2 * len(old))
        slots, mask = self._slots, len(self._slots) - 1
        for offset in old:
            if offset != _EMPTY:
                i = hash(source[offset:offset + width].tobytes()) & mask
                while slots[i] != _EMPTY:
                    i = (i + 1) & mask
                slots[i] = offset


@dataclass
class _Pool:
    """Continuations by pattern, per pattern size. `patterns[s - 1]` maps an s-token pattern to the
    offset of its recorded occurrence; with is_keep_all and not is_use_oldest, `windows[s - 1]` is the
    set of (pattern + continuation)s seen, to tell a continuation seen for the first time."""

    patterns: list[OffsetTable]
    windows: list[OffsetTable] | None
    # Where offsets point: None for a request's own pool (its history), else the public pool's arena.
    arena: array | None = None

    @classmethod
    def empty(cls, max_size: int, max_draft_len: int, with_windows: bool, public: bool) -> "_Pool":
        sizes = range(1, max_size + 1)
        return cls([OffsetTable(s) for s in sizes],
                   [OffsetTable(s + max_draft_len) for s in sizes] if with_windows else None,
                   array(TOKEN_TYPECODE) if public else None)

    @property
    def nbytes(self) -> int:
        tables = self.patterns + (self.windows or [])
        return sum(t.nbytes for t in tables) + (sys.getsizeof(self.arena) if self.arena is not None else 0)


@dataclass
class _Occurrences:
    """Every occurrence of every pattern of sizes 1..k in a history, newest first on demand:
    `latest[s - 1]` maps an s-token pattern to its latest start, `previous[s - 1][i]` is the start of
    the occurrence before the one at i (-1: none). Covers the patterns ending at or before `indexed_len`."""

    latest: list[OffsetTable]
    previous: list[array]
    indexed_len: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.latest) + sum(sys.getsizeof(a) for a in self.previous)

    def extend(self, tokens: array) -> None:
        for size, (table, previous) in enumerate(zip(self.latest, self.previous), 1):
            for i in range(max(0, self.indexed_len - size + 1), len(tokens) - size + 1):
                slot, offset = table.find(tokens, tokens[i:i + size])
                previous.append(offset)  # previous[i]: patterns are indexed in order of start
                table.store(tokens, slot, i)
        self.indexed_len = len(tokens)

    def newest_ends(self, tokens: array, context: array) -> list[int]:
        """Where the token after an earlier occurrence of `context`'s last 1..k tokens lies in `tokens`
        (before its end): each size's newest MAX_OCCURRENCES, together, newest first, each once."""
        found: set[int] = set()
        n, last = len(context), len(tokens)
        for size in range(min(len(self.latest), n), 0, -1):
            _, at = self.latest[size - 1].find(tokens, context[n - size:])
            previous, count = self.previous[size - 1], 0
            while at != _EMPTY and count < MAX_OCCURRENCES:
                if at < last - size:
                    found.add(at + size)
                    count += 1
                at = previous[at]
        return sorted(found, reverse=True)


@dataclass
class _RequestState:
    pool: _Pool | None  # None: the public pool (a salted request keeps its own)
    # Length of the history whose complete continuations are recorded in the pool.
    recorded_len: int = field(default=0)
    occurrences: _Occurrences | None = None  # built on the first tree asked for


class NgramDrafter(Drafter):
    name = "ngram"
    version = "1.1"
    capabilities = ("ngram", TREE_CAPABILITY, LOOKAHEAD, CACHE_SALT)
    runs_inline = True  # well under a millisecond a sequence

    def __init__(self, max_draft_len: int = 8, max_matching_ngram_size: int = 3, is_keep_all: bool = True,
                 is_use_oldest: bool = True, is_public_pool: bool = False, max_public_pool_mib: float = 256.0,
                 tree_min_prob: float = 0.0) -> None:
        if max_draft_len < 1 or max_matching_ngram_size < 1:
            raise ValueError("max_draft_len and max_matching_ngram_size must be at least 1")
        if max_public_pool_mib <= 0:
            raise ValueError("max_public_pool_mib must be positive")
        if not 0.0 <= tree_min_prob <= 1.0:
            raise ValueError(f"tree_min_prob must be within [0, 1], not {tree_min_prob}")
        # A tree node whose estimated path probability is below this is not drafted (0: fill the budget).
        self.tree_min_prob = tree_min_prob
        self.max_public_pool_bytes = round(max_public_pool_mib * (1 << 20))
        self.max_draft_len = max_draft_len
        self.max_matching_ngram_size = max_matching_ngram_size
        self.is_keep_all = is_keep_all
        self.is_use_oldest = is_use_oldest
        self.is_public_pool = is_public_pool
        self._public_pool = self._new_pool(public=True) if is_public_pool else None
        self._requests: dict[Key, _RequestState] = {}

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        for r in requests:
            if r.cache_salt_id:
                self._state(r.key, private=True)
        # Requests wanting no draft are skipped: the next draft catches up on their history.
        return [([] if not r.draft_len else self.draft(r.key, r.tokens, r.draft_len) if not r.max_draft_nodes
                 else self.draft_tree(r.key, r.tokens, r.draft_len, r.max_draft_nodes)) for r in requests]

    def on_release(self, key: Key) -> None:
        self._requests.pop(key, None)

    def state_bytes(self, key: Key) -> int:
        state = self._requests.get(key)
        if state is None:
            return 0
        return (_REQUEST_OVERHEAD_BYTES + (state.pool.nbytes if state.pool is not None else 0)
                + (state.occurrences.nbytes if state.occurrences is not None else 0))

    def shared_state_bytes(self) -> int:
        return self._public_pool.nbytes if self._public_pool is not None else 0

    @property
    def learns_across_requests(self) -> bool:
        return self.is_public_pool

    def save_learned(self) -> bytes | None:
        """The public pool (ngram_snapshot.py); None without one."""
        pool = self._public_pool
        if pool is None:
            return None
        assert pool.arena is not None
        return ngram_snapshot.encode(ngram_snapshot.PoolSnapshot(
            self._shape(), pool.arena, [t.offsets() for t in pool.patterns],
            None if pool.windows is None else [t.offsets() for t in pool.windows]))

    def restore_learned(self, data: bytes) -> None:
        """A public pool `save_learned` gave, in place of this one; ValueError without a public pool, or for
        one of another shape (pattern sizes, draft length, keep-all knobs), whose entries mean something else.
        A pool past this drafter's `max_public_pool_mib` starts afresh at its next step, as it would have."""
        if not self.is_public_pool:
            raise ValueError("this n-gram drafter has no public pool (--is-public-pool) to restore")
        snapshot = ngram_snapshot.decode(data)
        if snapshot.shape != self._shape():
            raise ValueError(f"the pool was learned as {snapshot.shape}, this drafter is {self._shape()}")
        pool = self._new_pool(public=True)
        pool.arena = snapshot.arena
        for table, offsets in zip(pool.patterns, snapshot.patterns):
            table.insert(pool.arena, offsets)
        for table, offsets in zip(pool.windows or [], snapshot.windows or []):
            table.insert(pool.arena, offsets)
        self._public_pool = pool

    def draft(self, key: Key, tokens: Sequence[int], draft_len: int) -> list[int]:
        """Draft for `tokens`, the key's whole history; it must only grow between releases of the key.

        The SDK passes its int32 array; any other sequence is copied into one first.
        """
        if not (isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE):
            tokens = array(TOKEN_TYPECODE, tokens)
        state = self._state(key)
        if state.pool is None:
            pool = self._public_pool
            assert pool is not None
            if pool.nbytes > self.max_public_pool_bytes:
                log.info("public n-gram pool reached %d bytes: starting afresh", pool.nbytes)
                pool = self._public_pool = self._new_pool(public=True)
        else:
            pool = state.pool
        self._record(pool, tokens, state.recorded_len)
        state.recorded_len = len(tokens)
        return self._lookup(pool, tokens)[:draft_len]

    def draft_tree(self, key: Key, tokens: Sequence[int], max_depth: int, max_nodes: int) -> DraftTree:
        """A token tree of at most `max_nodes` nodes and `max_depth` depth for `tokens`, the key's
        whole history (it must only grow between releases of the key)."""
        if not (isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE):
            tokens = array(TOKEN_TYPECODE, tokens)
        state = self._state(key)
        if state.occurrences is None:
            sizes = range(1, self.max_matching_ngram_size + 1)
            state.occurrences = _Occurrences([OffsetTable(s) for s in sizes], [array(TOKEN_TYPECODE) for _ in sizes])
        state.occurrences.extend(tokens)
        return _TreeGrower(tokens, state.occurrences, self.max_matching_ngram_size).grow(
            min(max_depth, self.max_draft_len), max_nodes, self.tree_min_prob)

    def _state(self, key: Key, private: bool = False) -> _RequestState:
        """The key's state, made at its first call: with a pool of its own, or the public pool's share where
        there is one and the request is not `private` (a salted one)."""
        state = self._requests.get(key)
        if state is None:
            shared = self.is_public_pool and not private
            state = self._requests[key] = _RequestState(None if shared else self._new_pool(public=False))
        return state

    def _shape(self) -> ngram_snapshot.Shape:
        return ngram_snapshot.Shape(self.max_matching_ngram_size, self.max_draft_len, self.is_keep_all,
                                    self.is_use_oldest)

    def _new_pool(self, public: bool) -> _Pool:
        return _Pool.empty(self.max_matching_ngram_size, self.max_draft_len,
                           with_windows=self.is_keep_all and not self.is_use_oldest, public=public)

    def _record(self, pool: _Pool, tokens: array, start: int) -> None:
        """Record the continuations that became complete since the history had `start` tokens."""
        n, k = len(tokens), self.max_draft_len
        arena = pool.arena
        source = tokens if arena is None else arena
        for size in range(1, self.max_matching_ngram_size + 1):
            patterns = pool.patterns[size - 1]
            windows = pool.windows[size - 1] if pool.windows is not None else None
            # The pattern at i has a complete continuation once i + size + k <= len(history).
            for i in range(max(0, start - size - k + 1), n - size - k + 1):
                slot, offset = patterns.find(source, tokens[i:i + size])
                if windows is not None:  # keep all, newest first: only a first-seen continuation counts
                    window = tokens[i:i + size + k]
                    wslot, woffset = windows.find(source, window)
                    if woffset != _EMPTY:
                        continue
                    at = i if arena is None else _append(arena, window)
                    windows.store(source, wslot, at)
                    patterns.store(source, slot, at)
                elif offset == _EMPTY:
                    patterns.store(source, slot, i if arena is None else _append(arena, tokens[i:i + size + k]))
                elif not self.is_keep_all:  # only the latest continuation
                    if arena is None:
                        patterns.store(source, slot, i)
                    else:
                        arena[offset + size:offset + size + k] = tokens[i + size:i + size + k]

    def _lookup(self, pool: _Pool, tokens: array) -> list[int]:
        n, k = len(tokens), self.max_draft_len
        source = tokens if pool.arena is None else pool.arena
        for size in range(min(self.max_matching_ngram_size, n - 1), 0, -1):
            suffix = tokens[n - size:]
            # Occurrences of the suffix whose continuation is still incomplete, oldest (longest) first.
            tail = [i for i in range(max(0, n - size - k + 1), n - size) if tokens[i:i + size] == suffix]
            _, offset = pool.patterns[size - 1].find(source, suffix)
            recorded = None if offset == _EMPTY else source[offset + size:offset + size + k]
            if self.is_keep_all and not self.is_use_oldest:
                if tail:
                    return tokens[tail[-1] + size:].tolist()
                if recorded is not None:
                    return recorded.tolist()
            else:
                # A complete continuation is longer than any incomplete one, so it wins.
                if recorded is not None:
                    return recorded.tolist()
                if tail:
                    return tokens[tail[0] + size:].tolist()
        return []


def reliability(matched: int) -> float:
    """The chance that a candidate whose longest match is `matched` tokens is the next token (alone)."""
    return min(RELIABLE, 1.0 - MISS * MISS_DECAY ** (matched - 1)) if matched else 0.0


# By tokens matched (at most MAX_MATCH): an occurrence's vote before recency, and `reliability`.
_WEIGHTS = [MATCH_WEIGHT ** m for m in range(MAX_MATCH + 1)]
_RELIABILITY = [reliability(m) for m in range(MAX_MATCH + 1)]


def _append(arena: array, window: array) -> int:
    """Copy `window` to the end of `arena`; its offset there."""
    offset = len(arena)
    arena.extend(window)
    return offset


class _TreeGrower:
    """Grows one token tree for a history, best-first (module docstring)."""

    def __init__(self, tokens: array, occurrences: _Occurrences, max_size: int) -> None:
        self.tokens, self.occurrences, self.max_size = tokens, occurrences, max_size
        frequent = Counter(tokens[-UNIGRAM_WINDOW:]).most_common(UNIGRAM_TOP)
        total = sum(count for _, count in frequent)
        self.unigram = [(token, count / total) for token, count in frequent]  # likeliest first
        self.share = dict(self.unigram)
        self.reach = max(MAX_MATCH, max_size)  # the last tokens of a node's context its children depend on
        self.recency = [RECENCY ** rank for rank in range(max_size * MAX_OCCURRENCES)]  # by occurrence, newest first

    def grow(self, max_depth: int, max_nodes: int, min_prob: float = 0.0) -> DraftTree:
        """Parents come before children, and nodes in order of path probability: the first m nodes
        are the tree this would grow with a budget of m. Growth stops before the first node whose
        path probability is below `min_prob`."""
        tokens: list[int] = []
        parents: list[int] = []
        # Per offered node: its index, depth, path probability, context (the history + its path) newest
        # first, `reach` tokens of it, and its children, likeliest first.
        offered: list[tuple[int, int, float, list[int], Iterator[tuple[int, float]]]] = []
        # The frontier holds each offered node's likeliest child not yet taken, so taking a node pushes
        # at most two (its next sibling, its first child) and a child nobody reaches is never scored.
        # Ties go to the earlier offered node, then the earlier sibling: the order of offering them all.
        heap: list[tuple[float, int, int, int]] = []  # (-path probability, offered index, sibling rank, token)

        def push(index: int, rank: int) -> None:
            probability, children = offered[index][2], offered[index][4]
            child = next(children, None)
            if child is not None:
                heapq.heappush(heap, (-probability * child[1], index, rank, child[0]))

        def offer(node: int, depth: int, probability: float, backwards: list[int]) -> None:
            offered.append((node, depth, probability, backwards, self.children(backwards)))
            push(len(offered) - 1, 0)

        offer(ROOT, 0, 1.0, self.tokens[-self.reach:].tolist()[::-1])
        while heap and len(tokens) < max_nodes:
            negative, index, rank, token = heapq.heappop(heap)
            if -negative < min_prob:  # best first: every node left is less likely still
                break
            parent, depth, _, backwards, _ = offered[index]
            tokens.append(token)
            parents.append(parent)
            push(index, rank + 1)
            if depth + 1 < max_depth and len(tokens) < max_nodes:  # the last node's children could not fit
                offer(len(tokens) - 1, depth + 1, -negative, [token, *backwards[:self.reach - 1]])
        return DraftTree(tokens, parents)

    def children(self, backwards: list[int]) -> Iterator[tuple[int, float]]:
        """(token, probability) of the candidate children of the node whose context, newest first, is
        `backwards`; likeliest first (ties in the order the occurrences, then the back-off, name them)."""
        history = self.tokens
        votes: dict[int, float] = {}
        matches: dict[int, int] = {}  # per candidate: the longest match among its occurrences
        context = array(TOKEN_TYPECODE, backwards[self.max_size - 1::-1])
        longest = array(TOKEN_TYPECODE, backwards[MAX_MATCH - 1::-1])  # the longest match counted, in order
        span, recency = len(longest), self.recency
        for rank, end in enumerate(self.occurrences.newest_ends(history, context)):
            limit = min(span, end)
            if history[end - limit:end] == longest[span - limit:]:  # a long copy: one comparison
                matched = limit
            else:
                matched = 0
                while history[end - 1 - matched] == backwards[matched]:
                    matched += 1
            token = history[end]
            matches[token] = max(matches.get(token, 0), matched)
            votes[token] = votes.get(token, 0.0) + _WEIGHTS[matched] * recency[rank]
        total = sum(votes.values())
        found = {token: vote / total * _RELIABILITY[matches[token]] for token, vote in votes.items()}
        left = UNIGRAM_SHARE * (1.0 - sum(found.values()))
        share = self.share
        backed = sorted([(token, q + left * share.get(token, 0.0)) for token, q in found.items()],
                        key=itemgetter(1), reverse=True)
        return _merged(backed, left, self.unigram)


def _merged(backed: list[tuple[int, float]], left: float,
            unigram: list[tuple[int, float]]) -> Iterator[tuple[int, float]]:
    """`backed` (sorted) and the back-off's other tokens at `left` x their share, likeliest first; on a tie
    `backed` first, as one stable sort of both would give."""
    i, named = 0, {token for token, _ in backed}
    for token, share in unigram:
        if token in named:
            continue
        q = left * share
        while i < len(backed) and backed[i][1] >= q:
            yield backed[i]
            i += 1
        yield token, q
    yield from backed[i:]
