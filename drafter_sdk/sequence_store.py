"""Per-request committed history, rebuilt from the deltas a verifier sends each step."""

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
        """Apply one delta: context_len 0 replaces the history, otherwise it must equal the held length."""
        # Popping and re-inserting keeps the dict ordered by last use.
        entry = self._entries.pop(key, None)
        if context_len == 0:
            fresh = _Entry(list(new_tokens), self._clock())
            self._entries[key] = fresh
            return SyncResult(fresh.tokens, discarded=entry is not None)
        if entry is None or len(entry.tokens) != context_len:
            # Appending to a history of the wrong length would silently corrupt it.
            return SyncResult(None, discarded=entry is not None)
        entry.tokens.extend(new_tokens)
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
