"""Circuit breaker for calls to a drafter: fail fast while it is down, probe with backoff."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures; while open, calls are
    skipped until the backoff elapses, then one trial call decides (half-open).
    Each failed trial doubles the backoff up to `max_backoff_s`."""

    failure_threshold: int = 3
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    _backoff_s: float = field(default=0.0, init=False)
    _open_until: float | None = field(default=None, init=False)

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """True when a call may go out now (closed, or open with the backoff elapsed)."""
        return self._open_until is None or self.clock() >= self._open_until

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self._backoff_s = 0.0
        self._open_until = None

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self._open_until is not None:  # a failed trial: back off further
            self._backoff_s = min(self.max_backoff_s, self._backoff_s * 2)
        elif self.consecutive_failures >= self.failure_threshold:
            self._backoff_s = self.initial_backoff_s
        else:
            return
        self._open_until = self.clock() + self._backoff_s
