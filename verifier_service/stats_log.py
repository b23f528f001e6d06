"""The verifier's periodic stats in its log, in the words of vLLM's: every `--log-stats-interval-s` in
which it did something, throughput and load (prompt and generation tokens/s, requests running and
waiting, KV cache usage, prefix cache hit rate), speculation (mean acceptance length, accepted and
drafted tokens/s, acceptance by draft position) and what the drafter service cost (calls, failures,
their mean round trip).

The figures are read from the counters /metrics exports (metrics.py), as differences between two
readings (drafter_sdk/service/stats_lines.py, which the drafter server's line uses too), so the log and
Prometheus never disagree and the engine pays nothing more per step. An interval in which nothing ran
and nothing waited is not logged, so an idle server stays quiet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from drafter_sdk.service.stats_lines import log_every, totals
from verifier_service.metrics import PREFIX, VerifierMetrics

log = logging.getLogger(__name__)

COUNTERS = ("prompt_tokens", "generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "drafter_call_failures", "drafter_calls_skipped")


@dataclass(frozen=True)
class Reading:
    """The metrics' values at one instant (counters are running totals)."""

    at: float  # time.monotonic()
    totals: dict[str, float]  # COUNTERS by name
    accepted_per_pos: tuple[float, ...]  # accepted draft tokens by position, running totals
    calls: float = 0.0  # drafter calls a step waited for (the latency histogram's count) ...
    call_seconds: float = 0.0  # ... and their summed round trips
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0 to 1


def read(metrics: VerifierMetrics) -> Reading:
    summed = totals(metrics.registry)
    (family,) = metrics.num_accepted_tokens_per_pos.collect()  # one metric read, not the registry per position
    by_pos = {int(s.labels["position"]): s.value for s in family.samples if s.name.endswith("_total")}
    per_pos = [by_pos.get(pos, 0.0) for pos in range(max(by_pos, default=-1) + 1)]

    def value(name: str) -> float:
        return summed.get(PREFIX + name, 0.0)

    latency = "drafter_call_latency_seconds"
    return Reading(time.monotonic(), {name: value(f"{name}_total") for name in COUNTERS}, tuple(per_pos),
                   value(f"{latency}_count"), value(f"{latency}_sum"), value("num_requests_running"),
                   value("num_requests_waiting"), value("kv_cache_usage_perc"))


def lines(before: Reading, now: Reading) -> list[str]:
    """What happened between two readings, as log lines; none if nothing ran or waited."""
    seconds = max(now.at - before.at, 1e-9)
    done = {name: now.totals[name] - before.totals[name] for name in COUNTERS}
    if not (done["prompt_tokens"] or done["generation_tokens"] or now.running or now.waiting):
        return []
    queries = done["prefix_cache_queries"]
    out = [f"Avg prompt throughput: {done['prompt_tokens'] / seconds:.1f} tokens/s, Avg generation throughput: "
           f"{done['generation_tokens'] / seconds:.1f} tokens/s, Running: {now.running:.0f} reqs, Waiting: "
           f"{now.waiting:.0f} reqs, KV cache usage: {now.kv_usage:.1%}, Prefix cache hit rate: "
           f"{done['prefix_cache_hits'] / queries if queries else 0.0:.1%}"]
    drafts, drafted = done["spec_decode_num_drafts"], done["spec_decode_num_draft_tokens"]
    if drafts:
        accepted = done["spec_decode_num_accepted_tokens"]
        earlier = before.accepted_per_pos + (0.0,) * (len(now.accepted_per_pos) - len(before.accepted_per_pos))
        per_pos = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(now.accepted_per_pos, earlier))
        out.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: "
                   f"{accepted / seconds:.2f} tokens/s, Drafted throughput: {drafted / seconds:.2f} tokens/s, "
                   f"Accepted: {accepted:.0f} tokens, Drafted: {drafted:.0f} tokens, Per-position acceptance rate: "
                   f"{per_pos}, Avg Draft acceptance rate: {accepted / drafted:.1%}")
    calls = now.calls - before.calls
    failed, skipped = done["drafter_call_failures"], done["drafter_calls_skipped"]
    if calls or failed or skipped:
        mean_ms = 1000 * (now.call_seconds - before.call_seconds) / calls if calls else 0.0
        out.append(f"Drafter calls waited for: {calls:.0f}, mean round trip: {mean_ms:.2f} ms, failed: {failed:.0f}, "
                   f"skipped while the drafter was down: {skipped:.0f}")
    return out


async def log_stats(metrics: VerifierMetrics, interval_s: float) -> None:
    """Log `lines` every `interval_s` seconds (a task of the servers' loop, until cancelled)."""
    await log_every(interval_s, lambda: read(metrics), lines, log)
