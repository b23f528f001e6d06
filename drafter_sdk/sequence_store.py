"""Per-request committed history, rebuilt from the overlapping deltas a verifier sends each step.

A delta is `(context_len, new_tokens)`: `new_tokens[0]` sits at offset
`context_len` of the sequence's committed context, which never changes once
committed. So a store holding H tokens can apply any delta that starts at or
before H and does not end before it, `context_len <= H <= context_len +
len(new_tokens)`: the overlapping part repeats what it holds and is skipped,
the rest is appended. That lets a verifier re-send the last few steps' tokens
in every call, and lets replicas behind a round-robin balancer that missed a
few steps catch up without a resync (protos/PROTOCOL.md, section 4).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from drafter_sdk.drafter import Key


@dataclass(frozen=True)
class SyncResult:
    # The whole history after the delta, or None when the sender must resync
    # (send the full context next step).
    tokens: list[int] | None
    # Whether state previously held for the key was thrown away (replaced or
    # dropped as stale): whatever a drafter derived from it is stale too.
    discarded: bool


@dataclass
class _Entry:
    tokens: list[int]
    last_used: float


class SequenceStore:
    """Token histories keyed by (verifier_id, request_id). Not thread-safe: one caller at a time."""

    def __init__(self, idle_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        # Ordered by last use, least recent first, so eviction stops at the first fresh entry.
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def sync(self, key: Key, context_len: int, new_tokens: Iterable[int]) -> SyncResult:
        """Apply one overlapping delta.

        - context_len 0: new_tokens is the whole context and replaces what is held
          (when what is held is a prefix of it, that is an append: nothing is discarded);
        - held H tokens with context_len <= H <= context_len + len(new_tokens): the first
          H - context_len new tokens repeat held ones and are skipped, the rest appended;
        - nothing held, or a gap (H < context_len): resync (what is held is kept: it is still
          a true prefix, so the full context that follows extends it);
        - H > context_len + len(new_tokens), or overlapping tokens that differ from the
          held ones: inconsistent, so the held state is dropped and the sender must resync.
        """
        tokens = new_tokens if isinstance(new_tokens, list) else list(new_tokens)
        # Popping and re-inserting keeps the dict ordered by last use.
        entry = self._entries.pop(key, None)
        if context_len == 0:
            if entry is not None and _starts_with(tokens, entry.tokens, 0):
                # The same context again, possibly longer: keep what was derived from it.
                return self._append(key, entry, tokens[len(entry.tokens):])
            fresh = _Entry(list(tokens), self._clock())
            self._entries[key] = fresh
            return SyncResult(fresh.tokens, discarded=entry is not None)
        if entry is None:
            return SyncResult(None, discarded=False)
        held = len(entry.tokens)
        if held < context_len:  # a gap: the tokens between held and context_len are missing
            entry.last_used = self._clock()
            self._entries[key] = entry
            return SyncResult(None, discarded=False)
        if held > context_len + len(tokens) or not _starts_with(tokens, entry.tokens, context_len):
            # Committed context never changes: this cannot be the same sequence's history.
            return SyncResult(None, discarded=True)
        return self._append(key, entry, tokens[held - context_len:])

    def _append(self, key: Key, entry: _Entry, tokens: list[int]) -> SyncResult:
        entry.tokens.extend(tokens)
        entry.last_used = self._clock()
        self._entries[key] = entry
        return SyncResult(entry.tokens, discarded=False)

    def release(self, key: Key) -> bool:
        """Drop the key's history; whether it was held."""
        return self._entries.pop(key, None) is not None

    def evict_idle(self) -> list[Key]:
        """Drop and return the keys not synced for idle_timeout_s."""
        deadline = self._clock() - self.idle_timeout_s
        evicted = []
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.last_used > deadline:
                break
            del self._entries[key]
            evicted.append(key)
        return evicted


def _starts_with(tokens: list[int], held: list[int], offset: int) -> bool:
    """Whether `tokens` begins with held[offset:] (the part of `held` it overlaps)."""
    overlap = len(held) - offset
    return overlap <= len(tokens) and tokens[:overlap] == held[offset:]
