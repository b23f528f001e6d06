"""Prefix caching over the slot KV cache: reuse the keys and values of a shared token prefix.

Tokens are grouped in blocks of BLOCK_SIZE; block i of a sequence is named by a hash
chain, hash(block i-1's hash, block i's tokens), so one hash names the whole prefix up
to the end of its block (vLLM's scheme). Every slot that holds valid KV, of a running
sequence or of a finished one kept for reuse ("idle"), registers the hashes of its full
blocks. A new prompt walks its own chain: the longest run of leading hashes some slot
holds is the prefix whose KV it need not compute.

A slot is one contiguous region per sequence (model/kv_cache.py), so reuse is either
by reference (the new sequence takes over an idle slot whose every full block it
matched: nothing is copied, nothing of value is lost) or by copy (the matched positions
are copied into a fresh slot, one tensor copy over all layers, at the start of the
step's forward). A copy is never needed when the source is an idle slot fully matched,
which is the multi-turn case: the next turn extends the last one's tokens.

Idle slots are evicted least-recently-used whenever a slot is needed and none is free,
so they always count as free capacity: caching never makes a request wait or be refused.
The hashes are BLAKE2b digests (not Python's hash(), whose collisions can be forged), so
a crafted prompt cannot read another prompt's cached KV. A request's cache salt (vLLM's
cache_salt) starts its chain from the salt's own digest instead of from nothing, so only
requests with the same salt share blocks: a tenant cannot time its way to another's prompts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from verifier_service.model.kv_cache import KVCache

BLOCK_SIZE = 16


def salt_root(salt: str) -> bytes:
    """Where a salted request's hash chain starts (an unsalted one starts from b"")."""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest() if salt else b""


def chain_hashes(tokens: Seq[int], start_block: int, end_block: int, parent: bytes) -> list[bytes]:
    """Hashes of blocks start_block..end_block-1 of `tokens`, chained on from `parent`."""
    out = []
    for b in range(start_block, end_block):
        parent = hashlib.blake2b(parent + array("q", tokens[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]).tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Hands out KV slots, reusing cached prefixes; owns the idle (finished, kept) slots.

    Disabled, it is a plain allocator: every slot is fresh and freed at release.
    `allow_copy` False (tensor parallelism: the followers do not replay copies) keeps
    reuse by reference only.
    """

    def __init__(self, kv_cache: KVCache, enabled: bool = True, allow_copy: bool = True) -> None:
        self.kv_cache = kv_cache
        self.enabled = enabled
        self.allow_copy = allow_copy
        self._chains: dict[int, list[bytes]] = {}  # slot -> hashes of its full valid blocks, in order
        self._holders: dict[bytes, dict[int, None]] = {}  # block hash -> slots holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept slots, least recently used first
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens whose KV was reused (vLLM's prefix_cache_hits)

    @property
    def num_available(self) -> int:
        """Slots a new sequence can get now: free ones and idle ones (evictable)."""
        return self.kv_cache.num_free_slots + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def acquire(self, prompt: Seq[int], root: bytes = b"", reuse: bool = True,
                counted: bool = True) -> tuple[int, int, tuple[int, int, int] | None]:
        """A slot for `prompt`, whose chain starts from `root` (salt_root): (slot, positions already
        valid in it, copy (src, dst, n) to run before they are) . At least the prompt's last token is
        always left to compute. Without `reuse` (a prompt whose every position must be computed), a
        slot without a match. Not `counted` (a preempted sequence's own tokens), it is left out of
        queries and hits."""
        if not self.enabled or not reuse:
            return self._allocate(), 0, None
        slot, reused, copy = self._acquire(prompt, root)
        if counted:
            self.queries += len(prompt)
            self.hits += reused
        return slot, reused, copy

    def _acquire(self, prompt: Seq[int], root: bytes) -> tuple[int, int, tuple[int, int, int] | None]:
        hashes = chain_hashes(prompt, 0, (len(prompt) - 1) // BLOCK_SIZE, root)
        source, blocks = None, 0
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            # Prefer an idle holder (it may be taken over), else any.
            source = next((s for s in holders if s in self._idle), next(iter(holders)))
            blocks = i + 1
        if source is None:
            return self._allocate(), 0, None
        reused = blocks * BLOCK_SIZE
        if source in self._idle and (len(self._chains[source]) == blocks or not self.allow_copy
                                     or self.num_available == 1):
            del self._idle[source]  # by reference: its blocks past the match are dropped
            self._truncate(source, blocks)
            return source, reused, None
        if not self.allow_copy:
            return self._allocate(), 0, None
        if source in self._idle:
            self._idle.move_to_end(source)  # used now: the last to be evicted
        slot = self._allocate(avoid=source)
        self._chains[slot] = []
        self._register(slot, hashes[:blocks])
        return slot, reused, (source, slot, reused)

    def extend(self, slot: int, prompt: list[int], output: list[int], valid: int, root: bytes = b"") -> None:
        """The slot's first `valid` positions hold the KV of (prompt + output)[:valid], its chain
        starting from `root`: register its new full blocks (the tokens are joined only when a block
        is complete)."""
        if not self.enabled:
            return
        chain = self._chains.setdefault(slot, [])
        if valid // BLOCK_SIZE > len(chain):
            tokens = prompt if valid <= len(prompt) else prompt + output
            self._register(slot, chain_hashes(tokens, len(chain), valid // BLOCK_SIZE,
                                              chain[-1] if chain else root))

    def release(self, slot: int, keep: bool) -> None:
        """The slot's sequence left; `keep` its valid blocks for reuse (they stay until evicted)."""
        if keep and self.enabled and self._chains.get(slot):
            self._idle[slot] = None
            return
        self._truncate(slot, 0)
        self._chains.pop(slot, None)
        self.kv_cache.free(slot)

    def clear(self) -> None:
        """Drop every idle slot (their KV is no longer trusted)."""
        while self._idle:
            self.release(self._idle.popitem(last=False)[0], keep=False)

    def _allocate(self, avoid: int | None = None) -> int:
        if self.kv_cache.num_free_slots:
            return self.kv_cache.allocate()
        victim = next(s for s in self._idle if s != avoid)  # least recently used
        del self._idle[victim]
        self._truncate(victim, 0)
        return victim

    def _register(self, slot: int, hashes: list[bytes]) -> None:
        self._chains[slot].extend(hashes)
        for h in hashes:
            self._holders.setdefault(h, {})[slot] = None

    def _truncate(self, slot: int, blocks: int) -> None:
        chain = self._chains.get(slot, [])
        for h in chain[blocks:]:
            holders = self._holders[h]
            del holders[slot]
            if not holders:
                del self._holders[h]
        del chain[blocks:]
