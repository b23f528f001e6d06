"""Per-request committed history, rebuilt from the overlapping deltas a verifier sends each step,
held under a memory budget shared fairly by the verifiers (namespaces) that send them.

A delta is `(context_len, new_tokens)`: `new_tokens[0]` sits at offset
`context_len` of the sequence's committed context, which never changes once
committed. So a store holding H tokens can apply any delta that starts at or
before H and does not end before it, `context_len <= H <= context_len +
len(new_tokens)`: the overlapping part repeats what it holds and is skipped,
the rest is appended. That lets a verifier re-send the last few steps' tokens
in every call, and lets replicas behind a round-robin balancer that missed a
few steps catch up without a resync (protos/PROTOCOL.md, section 4).

Memory: one drafter serves many verifiers, so no caller may grow it without
bound. Histories are int32 arrays (4 bytes a token, not a Python list's 36),
and every sequence is accounted: its tokens, a fixed overhead, and what the
drafter reports holding for it (`Drafter.state_bytes`). Past `max_state_bytes`
the store evicts least-recently-synced sequences, taking them from the
namespace (verifier_id) holding the most bytes: that one is necessarily over its
fair share (budget / namespaces), so a flooding client evicts its own sequences
before anyone else's. An evicted sequence is simply unknown: its next delta gets
a resync, never a wrong draft. A sequence larger than the whole budget is
followed by its length only (`SyncResult.oversize`): it gets no draft, costs
almost nothing, and needs no resync every step.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drafter_sdk.drafter import TOKEN_TYPECODE, Key

DEFAULT_MAX_STATE_MIB = 1024
# One held sequence besides its tokens: the entry, its key and dict slots, the array's header and spare room.
ENTRY_OVERHEAD_BYTES = 400
# Evicted keys remembered to tell an eviction's resync from any other; bounded so a flood cannot grow it.
_EVICTED_MEMORY = 16384


@dataclass(frozen=True)
class SyncResult:
    # The whole history after the delta, or None when it gets no draft: the sender must resync
    # (send the full context next step), or, with `oversize`, the sequence is too large to hold.
    tokens: array | None
    # Whether state previously held for the key was thrown away (replaced, dropped as stale,
    # or reduced to its length as oversize): whatever a drafter derived from it is stale too.
    discarded: bool
    # The sequence exceeds the whole budget: it is followed by length only and answered without a draft.
    oversize: bool = False


@dataclass
class _Entry:
    tokens: array | None  # None: oversize, only its length is followed
    length: int
    last_used: float
    drafter_bytes: int = 0
    accounted: int = 0  # bytes counted for it in its namespace's total
    accounted_tokens: int = 0  # tokens counted for it in the store's held_tokens

    def size(self) -> int:
        held = self.tokens.itemsize * len(self.tokens) if self.tokens is not None else 0
        return ENTRY_OVERHEAD_BYTES + held + self.drafter_bytes


class SequenceStore:
    """Token histories keyed by (verifier_id, request_id). Not thread-safe: one caller at a time,
    except for the read-only statistics (`bytes_by_namespace`, `evictions`, ...), safe to read
    from another thread (a metrics scrape).

    `max_state_bytes` None means no budget.
    """

    def __init__(self, idle_timeout_s: float = 600.0, max_state_bytes: int | None = DEFAULT_MAX_STATE_MIB << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_state_bytes = max_state_bytes
        self._clock = clock
        # Per namespace, ordered by last use, least recent first.
        self._spaces: dict[str, OrderedDict[str, _Entry]] = {}
        self._space_bytes: dict[str, int] = {}
        self._count = 0
        self._evicted: OrderedDict[Key, None] = OrderedDict()
        self.total_bytes = 0
        self.held_tokens = 0  # tokens of the histories held (oversize ones are not)
        self.evictions: Counter[str] = Counter()  # by cause: budget, idle, release, oversize
        self.eviction_resyncs = 0  # resyncs answered to sequences evicted for budget or idling

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: Key) -> bool:
        return key[1] in self._spaces.get(key[0], ())

    def bytes_by_namespace(self) -> dict[str, int]:
        return dict(self._space_bytes)

    def sync(self, key: Key, context_len: int, new_tokens: Sequence[int]) -> SyncResult:
        """Apply one overlapping delta.

        - context_len 0: new_tokens is the whole context and replaces what is held
          (when what is held is a prefix of it, that is an append: nothing is discarded);
        - held H tokens with context_len <= H <= context_len + len(new_tokens): the first
          H - context_len new tokens repeat held ones and are skipped, the rest appended;
        - nothing held, or a gap (H < context_len): resync (what is held is kept: it is still
          a true prefix, so the full context that follows extends it);
        - H > context_len + len(new_tokens), or overlapping tokens that differ from the
          held ones: inconsistent, so the held state is dropped and the sender must resync.

        A history whose token array alone exceeds the budget is reduced to its length (oversize).
        """
        entry = self._take(key)
        if context_len == 0:
            if entry is not None and entry.tokens is not None and _starts_with(new_tokens, entry.tokens, 0):
                # The same context again, possibly longer: keep what was derived from it.
                return self._append(key, entry, new_tokens[len(entry.tokens):])
            fresh = _Entry(array(TOKEN_TYPECODE), 0, self._clock())
            result = self._append(key, fresh, new_tokens)
            return SyncResult(result.tokens, discarded=entry is not None, oversize=result.oversize)
        if entry is None:
            if key in self._evicted:
                del self._evicted[key]
                self.eviction_resyncs += 1
            return SyncResult(None, discarded=False)
        held = entry.length
        if held < context_len:  # a gap: the tokens between held and context_len are missing
            entry.last_used = self._clock()
            self._put(key, entry)
            return SyncResult(None, discarded=False)
        if held > context_len + len(new_tokens) or (
                entry.tokens is not None and not _starts_with(new_tokens, entry.tokens, context_len)):
            # Committed context never changes: this cannot be the same sequence's history.
            return SyncResult(None, discarded=True)
        return self._append(key, entry, new_tokens[held - context_len:])

    def account(self, key: Key, drafter_bytes: int) -> bool:
        """Record what the drafter holds for `key`. True when that makes the sequence larger than the
        whole budget: it is then followed by length only (oversize) and the drafter must drop its state."""
        entry = self._spaces.get(key[0], {}).get(key[1])
        if entry is None:
            return False
        entry.drafter_bytes = max(0, drafter_bytes)
        if entry.tokens is not None and self._too_large(entry):
            self._shrink(entry)
            self._reaccount(key[0], entry)
            self.evictions["oversize"] += 1
            return True
        self._reaccount(key[0], entry)
        return False

    def release(self, key: Key) -> bool:
        """Drop the key's history; whether it was held."""
        if self._take(key) is None:
            return False
        self.evictions["release"] += 1
        return True

    def evict_idle(self) -> list[Key]:
        """Drop and return the keys not synced for idle_timeout_s."""
        deadline = self._clock() - self.idle_timeout_s
        evicted = []
        for namespace, entries in list(self._spaces.items()):
            while entries:
                request_id, entry = next(iter(entries.items()))
                if entry.last_used > deadline:
                    break
                self._evict((namespace, request_id), "idle")
                evicted.append((namespace, request_id))
        return evicted

    def evict_over_budget(self, shared_bytes: int = 0) -> list[Key]:
        """Evict until the held sequences plus `shared_bytes` (drafter state tied to no sequence) fit the
        budget: each time the least recently synced sequence of the namespace holding the most bytes."""
        evicted: list[Key] = []
        if self.max_state_bytes is None:
            return evicted
        while self._count and self.total_bytes + shared_bytes > self.max_state_bytes:
            namespace = max(self._space_bytes, key=self._space_bytes.__getitem__)
            key = (namespace, next(iter(self._spaces[namespace])))
            self._evict(key, "budget")
            evicted.append(key)
        return evicted

    # --- helpers ---

    def _append(self, key: Key, entry: _Entry, tokens: Sequence[int]) -> SyncResult:
        entry.last_used = self._clock()
        entry.length += len(tokens)
        if entry.tokens is not None:
            entry.tokens.extend(tokens)
        shrunk = entry.tokens is not None and self._too_large(entry)
        if shrunk:
            self._shrink(entry)
            self.evictions["oversize"] += 1
        self._put(key, entry)
        if entry.tokens is None:
            return SyncResult(None, discarded=shrunk, oversize=True)
        return SyncResult(entry.tokens, discarded=False)

    def _too_large(self, entry: _Entry) -> bool:
        return self.max_state_bytes is not None and entry.size() > self.max_state_bytes

    @staticmethod
    def _shrink(entry: _Entry) -> None:
        entry.tokens, entry.drafter_bytes = None, 0

    def _take(self, key: Key) -> _Entry | None:
        """Remove the key's entry from the store and its accounting; the entry or None."""
        entries = self._spaces.get(key[0])
        entry = entries.pop(key[1], None) if entries is not None else None
        if entry is None:
            return None
        self._count -= 1
        self._space_bytes[key[0]] -= entry.accounted
        self.total_bytes -= entry.accounted
        self.held_tokens -= entry.accounted_tokens
        entry.accounted = entry.accounted_tokens = 0
        if not entries:
            del self._spaces[key[0]], self._space_bytes[key[0]]
        return entry

    def _put(self, key: Key, entry: _Entry) -> None:
        """(Re)insert as the namespace's most recently used, accounted at its current size."""
        entries = self._spaces.setdefault(key[0], OrderedDict())
        self._space_bytes.setdefault(key[0], 0)
        entries[key[1]] = entry
        self._count += 1
        self._reaccount(key[0], entry)

    def _reaccount(self, namespace: str, entry: _Entry) -> None:
        size = entry.size()
        self._space_bytes[namespace] += size - entry.accounted
        self.total_bytes += size - entry.accounted
        entry.accounted = size
        tokens = len(entry.tokens) if entry.tokens is not None else 0
        self.held_tokens += tokens - entry.accounted_tokens
        entry.accounted_tokens = tokens

    def _evict(self, key: Key, cause: str) -> None:
        self._take(key)
        self.evictions[cause] += 1
        self._evicted[key] = None
        if len(self._evicted) > _EVICTED_MEMORY:
            self._evicted.popitem(last=False)


def _starts_with(tokens: Sequence[int], held: array, offset: int) -> bool:
    """Whether `tokens` begins with held[offset:] (the part of `held` it overlaps)."""
    overlap = len(held) - offset
    if overlap > len(tokens):
        return False
    head = tokens[:overlap]
    return held[offset:] == (head if isinstance(head, array) else array(TOKEN_TYPECODE, head))
