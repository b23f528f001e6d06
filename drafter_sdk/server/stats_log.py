"""The drafter server's stats line: every `--log-stats-interval-s` in which it answered calls, what they
were (calls and sequences a second, failed calls, mean handling time, resyncs, draft tokens a second) and
what it holds (sequences, the state's bytes against its budget, sequences evicted meanwhile), from the
metrics it exports (metrics.py), as the verifier logs its own (service/stats_lines.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from drafter_sdk.server.metrics import DrafterMetrics
from drafter_sdk.service.stats_lines import totals

log = logging.getLogger(__name__)

P = "splitspec_drafter_"
MIB = 1 << 20


EVICTED = ("budget", "idle", "oversize")  # the causes of dropped state that are evictions (not releases)


@dataclass(frozen=True)
class Reading:
    at: float  # time.monotonic()
    totals: dict[str, float]  # the metrics' samples, summed over their labels
    evicted: float  # sequences evicted so far


def read(metrics: DrafterMetrics) -> Reading:
    value = metrics.registry.get_sample_value
    evicted = sum(value(P + "state_evictions_total", {"cause": cause}) or 0.0 for cause in EVICTED)
    return Reading(time.monotonic(), totals(metrics.registry), evicted)


def lines(before: Reading, now: Reading) -> list[str]:
    """What happened between two readings; nothing if no call came."""
    def done(name: str) -> float:
        return now.totals.get(P + name, 0.0) - before.totals.get(P + name, 0.0)

    calls = done("calls_total")
    if not calls:
        return []
    seconds = max(now.at - before.at, 1e-9)
    sequences, handled = done("sequences_total"), done("call_latency_seconds_count")
    mean_ms = 1000 * done("call_latency_seconds_sum") / handled if handled else 0.0
    held_bytes, budget = now.totals.get(P + "state_bytes", 0.0), now.totals.get(P + "state_budget_bytes", 0.0)
    of_budget = f" of the {budget / MIB:.0f} MiB budget" if budget else ""
    resynced = done("resyncs_total") / sequences if sequences else 0.0
    return [f"Calls: {calls / seconds:.1f}/s ({done('errors_total'):.0f} failed), mean handling {mean_ms:.2f} ms; "
            f"sequences: {sequences / seconds:.1f}/s, resynced {resynced:.1%}; draft tokens: "
            f"{done('draft_tokens_total') / seconds:.1f}/s; held: {now.totals.get(P + 'held_sequences', 0.0):.0f} "
            f"sequences, {held_bytes / MIB:.1f} MiB{of_budget}; evicted: {now.evicted - before.evicted:.0f}"]
