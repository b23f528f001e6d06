"""TensorRT-LLM's NGram pool drafter (prompt lookup), updated incrementally.

The pool maps every n-gram `pattern` (1..max_matching_ngram_size tokens) seen
in a history to the `continuation`s that followed it (up to max_draft_len
tokens). The draft for a history is a continuation of its longest suffix found
in the pool. The knobs keep TensorRT-LLM's names and meaning:

- is_keep_all: keep every distinct continuation of a pattern; otherwise only
  the latest of the longest ones.
- is_use_oldest: with is_keep_all, propose the continuation first seen;
  otherwise the one most recently seen for the first time.
- is_public_pool: one pool shared by all requests instead of one per request.

The drafts are those TensorRT-LLM's `NGramPoolManager` computes when it scans a
whole history in one pass; only the cost differs. A continuation is complete
once max_draft_len tokens followed its pattern and never changes after, so
complete ones are recorded once, as the history grows (cost per step does not
depend on context length). The few still-growing continuations at the tail
(fewer than max_draft_len tokens after them) are looked up in the history at
draft time instead of being stored and rewritten every step. Two deliberate
differences: no match gives an empty draft (not an end_id), and a public pool
only shares complete continuations.

Token trees (when the verifier allows some, `max_draft_nodes` > 0): every
earlier occurrence of the history's last 1..max_matching_ngram_size tokens
offers its continuation, weighted by how long the match is (x4 per token), how
recent the occurrence is (x0.8 per newer one before it) and, by summing, how
often a continuation recurs. The continuations are merged as a trie and the
tree keeps the nodes most likely to lie on the true path (their share of the
weight, discounted by depth): where the occurrences agree the tree is one deep
chain, where they disagree it branches. Trees draw on the request's own history
only (the knobs above shape chains).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Union

from drafter_sdk.drafter import Drafter, DraftRequest, Key
from drafter_sdk.tree import ROOT, TREE_CAPABILITY, DraftTree

Ngram = tuple[int, ...]
# is_keep_all with newest-first needs every continuation seen (a dict used as an
# ordered set); the other modes only ever need one per pattern.
Pool = dict[Ngram, Union[Ngram, dict[Ngram, None]]]

# Tree weights (see the module docstring): per extra matched token, per newer occurrence, per depth.
MATCH_WEIGHT = 4.0
RECENCY = 0.8
DEPTH_DISCOUNT = 0.9
MAX_OCCURRENCES = 16  # newest occurrences of each suffix length that offer a continuation


class _Trie:
    """Continuations merged: per node, the summed weight of the continuations through it."""

    __slots__ = ("weight", "children")

    def __init__(self) -> None:
        self.weight = 0.0
        self.children: dict[int, _Trie] = {}

    def add(self, tokens: list[int], weight: float) -> None:
        node = self
        node.weight += weight
        for t in tokens:
            node = node.children.setdefault(t, _Trie())
            node.weight += weight


@dataclass
class _RequestState:
    pool: Pool
    # Length of the history whose complete continuations are recorded in `pool`.
    recorded_len: int = 0
    # For trees: where each n-gram's continuations start, oldest first; built up to indexed_len.
    starts: dict[Ngram, list[int]] = field(default_factory=dict)
    indexed_len: int = 0


class NgramDrafter(Drafter):
    name = "ngram"
    version = "1.0"
    capabilities = ("ngram", TREE_CAPABILITY)

    def __init__(self, max_draft_len: int = 8, max_matching_ngram_size: int = 3, is_keep_all: bool = True,
                 is_use_oldest: bool = True, is_public_pool: bool = False) -> None:
        if max_draft_len < 1 or max_matching_ngram_size < 1:
            raise ValueError("max_draft_len and max_matching_ngram_size must be at least 1")
        self.max_draft_len = max_draft_len
        self.max_matching_ngram_size = max_matching_ngram_size
        self.is_keep_all = is_keep_all
        self.is_use_oldest = is_use_oldest
        self.is_public_pool = is_public_pool
        self._public_pool: Pool = {}
        self._requests: dict[Key, _RequestState] = {}

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        # Requests wanting no draft are skipped: the next draft catches up on their history.
        return [([] if not r.draft_len else self.draft(r.key, r.tokens, r.draft_len) if not r.max_draft_nodes
                 else self.draft_tree(r.key, r.tokens, r.draft_len, r.max_draft_nodes)) for r in requests]

    def on_release(self, key: Key) -> None:
        self._requests.pop(key, None)

    def draft(self, key: Key, tokens: list[int], draft_len: int) -> list[int]:
        """Draft for `tokens`, the key's whole history; it must only grow between releases of the key."""
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = _RequestState(self._public_pool if self.is_public_pool else {})
        self._record(state.pool, tokens, state.recorded_len)
        state.recorded_len = len(tokens)
        return self._lookup(state.pool, tokens)[:draft_len]

    def draft_tree(self, key: Key, tokens: list[int], max_depth: int, max_nodes: int) -> DraftTree:
        """A token tree of at most `max_nodes` nodes and `max_depth` depth for `tokens`, the key's
        whole history (it must only grow between releases of the key)."""
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = _RequestState(self._public_pool if self.is_public_pool else {})
        n, sizes = len(tokens), range(1, self.max_matching_ngram_size + 1)
        for end in range(max(state.indexed_len, 1), n + 1):  # n-grams ending before `end`
            for size in sizes:
                if size <= end:
                    state.starts.setdefault(tuple(tokens[end - size:end]), []).append(end)
        state.indexed_len = n + 1
        depth = min(max_depth, self.max_draft_len)
        trie = _Trie()
        for size in range(min(self.max_matching_ngram_size, n - 1), 0, -1):
            starts = state.starts.get(tuple(tokens[n - size:]), [])
            newest = list(itertools.islice((p for p in reversed(starts) if p < n), MAX_OCCURRENCES))
            for rank, p in enumerate(newest):
                trie.add(tokens[p:p + depth], MATCH_WEIGHT ** (size - 1) * RECENCY ** rank)
        return _best_nodes(trie, max_nodes)

    def _record(self, pool: Pool, tokens: list[int], start: int) -> None:
        """Record the continuations that became complete since the history had `start` tokens."""
        n, k = len(tokens), self.max_draft_len
        for size in range(1, self.max_matching_ngram_size + 1):
            # The pattern at l has a complete continuation once l + size + k <= len(history).
            for l in range(max(0, start - size - k + 1), n - size - k + 1):
                pattern, continuation = tuple(tokens[l:l + size]), tuple(tokens[l + size:l + size + k])
                if not self.is_keep_all:
                    pool[pattern] = continuation
                elif self.is_use_oldest:
                    pool.setdefault(pattern, continuation)
                else:
                    pool.setdefault(pattern, {}).setdefault(continuation)

    def _lookup(self, pool: Pool, tokens: list[int]) -> list[int]:
        n, k = len(tokens), self.max_draft_len
        for size in range(min(self.max_matching_ngram_size, n - 1), 0, -1):
            suffix = tokens[n - size:]
            # Occurrences of the suffix whose continuation is still incomplete, oldest (longest) first.
            tail = [l for l in range(max(0, n - size - k + 1), n - size) if tokens[l:l + size] == suffix]
            recorded = pool.get(tuple(suffix))
            if self.is_keep_all and not self.is_use_oldest:
                if tail:
                    return tokens[tail[-1] + size:]
                if recorded is not None:
                    return list(next(reversed(recorded)))
            else:
                # A complete continuation is longer than any incomplete one, so it wins.
                if recorded is not None:
                    return list(recorded)
                if tail:
                    return tokens[tail[0] + size:]
        return []


def _best_nodes(trie: _Trie, budget: int) -> DraftTree:
    """The `budget` nodes most likely on the true path (weight share x DEPTH_DISCOUNT^depth), best
    first, so that parents come before children."""
    tokens: list[int] = []
    parents: list[int] = []
    if trie.weight <= 0:
        return DraftTree(tokens, parents)
    order = itertools.count()  # ties: first offered first
    heap = [(-child.weight / trie.weight, next(order), ROOT, token, child, 1)
            for token, child in trie.children.items()]
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        _, _, parent, token, node, depth = heapq.heappop(heap)
        parents.append(parent)
        tokens.append(token)
        index = len(tokens) - 1
        for t, child in node.children.items():
            score = child.weight / trie.weight * DEPTH_DISCOUNT ** depth
            heapq.heappush(heap, (-score, next(order), index, t, child, depth + 1))
    return DraftTree(tokens, parents)
