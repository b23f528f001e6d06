"""A service's stats lines: every interval in which it did something, a few log lines of what its
Prometheus counters say happened since the last reading, as vLLM's logging stat logger writes them
for its engine. Read from the registry the service exports, so the log and /metrics never disagree
and nothing more is counted per call. The verifier (verifier_service/stats_log.py) and the drafter
server (drafter_sdk/server/stats_log.py) each say what their lines hold."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry

Reading = TypeVar("Reading")


def totals(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample of the registry by name, summed over its labels (a counter's `_total`, a gauge, a
    histogram's `_sum` and `_count`)."""
    summed: defaultdict[str, float] = defaultdict(float)
    for metric in registry.collect():
        for sample in metric.samples:
            summed[sample.name] += sample.value
    return dict(summed)


async def log_every(interval_s: float, read: Callable[[], Reading], lines: Callable[[Reading, Reading], list[str]],
                    log: logging.Logger) -> None:
    """Each `interval_s`, log `lines(last reading, this one)` (none: nothing logged); until cancelled."""
    last = read()
    while True:
        await asyncio.sleep(interval_s)
        now = read()
        for line in lines(last, now):
            log.info("%s", line)
        last = now
