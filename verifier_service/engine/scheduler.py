"""Continuous batching: who waits, who runs, admission bounded by KV slots and a queue limit."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from verifier_service.model.kv_cache import KVCache
from verifier_service.engine.sequence import Sequence


class QueueFullError(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


@dataclass
class Scheduler:
    kv_cache: KVCache
    max_num_seqs: int
    max_queue_len: int
    waiting: deque[Sequence] = field(default_factory=deque)
    _running: dict[str, Sequence] = field(default_factory=dict)

    def add(self, seq: Sequence) -> None:
        # Waiting sequences that free slots will take at the next step boundary are
        # not queued for capacity: only the rest count against the queue limit.
        free = max(0, min(self.kv_cache.num_free_slots, self.max_num_seqs - len(self._running)))
        if len(self.waiting) >= self.max_queue_len + free:
            raise QueueFullError(
                f"server busy: {len(self._running)} running and {len(self.waiting)} queued "
                f"(--max-queue-len {self.max_queue_len}); retry later")
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free KV slots (at a step boundary)."""
        admitted: list[Sequence] = []
        while self.waiting and self.kv_cache.num_free_slots and len(self._running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.cancelled:
                continue
            self.kv_cache.allocate(seq.request_id)
            self._running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def running(self) -> list[Sequence]:
        """Running sequences, oldest first."""
        return list(self._running.values())

    def finish(self, seq: Sequence) -> None:
        if self._running.pop(seq.request_id, None) is not None:
            self.kv_cache.release(seq.request_id)

    def drop_cancelled(self) -> list[Sequence]:
        """Free the KV of cancelled sequences and drop them from the queue."""
        gone = [s for s in self._running.values() if s.cancelled]
        for seq in gone:
            self.finish(seq)
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        return gone

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self._running or self.waiting)
