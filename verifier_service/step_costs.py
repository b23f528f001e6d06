"""Measure the target's forward cost for 1..k+1 tokens on this machine.

Speculation pays only when verifying k+1 tokens costs less than producing the
accepted ones one by one; this curve is what the draft-length policy and the
benchmark's "ideal speedup" weigh acceptance against.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from verifier_service.model_runner import ForwardBatch, ModelRunner

SCRATCH = "__step-cost-probe__"


def measure(runner: ModelRunner, max_tokens: int, context_len: int = 256, repeats: int = 5,
            statistic: Callable[[list[float]], float] = statistics.median) -> list[float]:
    """costs[t] = seconds of one forward of t new tokens after `context_len` cached ones (costs[0] = 0),
    the `statistic` of `repeats` runs (min resists a noisy machine; median is the honest typical cost).

    Borrows one free KV slot and gives it back.
    """
    cache = runner.kv_cache
    context_len = min(context_len, cache.shape.capacity - max_tokens)
    slot = cache.allocate(SCRATCH)
    try:
        device = runner.device
        ids = torch.randint(0, runner.vocab_size, (context_len + max_tokens,)).tolist()
        runner.forward(ForwardBatch(ids[:context_len], [slot], [0], [context_len], [context_len - 1]))
        costs = [0.0]
        for t in range(1, max_tokens + 1):
            batch = ForwardBatch(ids[context_len:context_len + t], [slot], [context_len], [t], list(range(t)))
            runner.forward(batch)  # warm-up for this shape
            samples = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                runner.forward(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - started)
            costs.append(statistic(samples))
        return costs
    finally:
        cache.release(SCRATCH)


def relative(costs: list[float]) -> list[float]:
    """Costs as multiples of a one-token step, made non-decreasing (noise must not make longer drafts look free)."""
    out = [0.0]
    for c in costs[1:]:
        out.append(max(c / costs[1], out[-1]))
    return out


def cost_at(rel: list[float], tokens: float) -> float:
    """Interpolated relative cost of a forward over `tokens` tokens."""
    if tokens <= 1:
        return rel[1]
    if tokens >= len(rel) - 1:
        return rel[-1]
    low = int(tokens)
    frac = tokens - low
    return rel[low] * (1 - frac) + rel[low + 1] * frac
