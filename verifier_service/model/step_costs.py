"""Measure the target's forward cost by the number of tokens in one forward, on this machine.

Speculation pays only when verifying a draft costs less than producing the
accepted tokens one by one; this curve is what the draft-length planner and the
benchmark's "ideal speedup" weigh acceptance against. Points beyond one
sequence's draft (16, 32, ... tokens) let the planner see what a whole batch's
drafts cost once the forward turns compute-bound.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from verifier_service.model.linear_layout import Layout
from verifier_service.model.runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)

MAX_PROBE_TOKENS = 256
CONTEXT_LEN = 256  # cached tokens before each timed forward
REPEATS = 3  # timed forwards per token count and layout, after one warm-up


def probe_points(max_draft_len: int, max_batch_tokens: int) -> list[int]:
    """Every size up to one full draft (1..k+1), then powers of two up to a full batch of drafts."""
    points = list(range(1, max_draft_len + 2))
    size = 16
    while size <= min(max_batch_tokens, MAX_PROBE_TOKENS):
        if size > points[-1]:
            points.append(size)
        size *= 2
    return points


def fitting(runner: ModelRunner, token_counts: list[int], context_len: int = CONTEXT_LEN) -> tuple[list[int], int]:
    """The counts a forward is timed for in the runner's KV slots (those under half a slot, so that a
    context goes before them; one token where none is), and the cached tokens before each: `context_len`,
    or what fits beside the longest where the slots are shorter (a verifier serving short contexts).
    Timings compare across starts only after the same context."""
    capacity = runner.kv_cache.shape.capacity
    counts = [t for t in token_counts if t < capacity // 2] or [1]
    return counts, min(context_len, capacity - max(counts))


def measure(runner: ModelRunner, token_counts: list[int], context_len: int = CONTEXT_LEN, repeats: int = 5,
            statistic: Callable[[list[float]], float] = statistics.median,
            prefill_context: bool = True) -> dict[int, float]:
    """Seconds of one forward of t new tokens after `context_len` cached ones, for each t, in the
    layouts the runner has chosen: the `statistic` of `repeats` runs (min resists a noisy machine;
    median is the typical cost). Without `prefill_context` the context is not computed: the slot's
    keys stay what they were (zeros, or an earlier measurement's), which changes what the forward
    computes but not its time, and a long context costs no prefill (2,000 tokens of a large model on
    a CPU take minutes)."""
    timed = measure_shapes(runner, [(None, t) for t in token_counts], context_len, repeats, statistic, prefill_context)
    return {t: s for (_, t), s in timed.items()}


def measure_shapes(runner: ModelRunner, shapes: list[tuple[Layout | None, int]], context_len: int, repeats: int,
                   statistic: Callable[[list[float]], float],
                   prefill_context: bool = True) -> dict[tuple[Layout | None, int], float]:
    """`measure`'s seconds of each (linear layout, token count): None, the layout already chosen for
    that count. Each shape is warmed up once, then every round times each shape once, so that each
    shape's runs spread over the whole measurement and a machine whose speed drifts over seconds (a
    shared VM) slows every shape alike. Timed one shape after the other instead, drift bent the curve
    the planner drafts by: in ten back-to-back measurements of SmolLM2 on a 2-core VM (7 runs a
    shape), 6 tokens cost 1.00x-1.50x one token (standard deviation 0.16), and 1.05x-1.29x (0.07)
    interleaved; 9 tokens 1.08x-1.68x (0.18) against 1.14x-1.47x (0.10).

    Borrows one free KV slot and gives it back."""
    cache = runner.kv_cache
    counts, context_len = fitting(runner, [t for _, t in shapes], context_len)
    timed = ([(layout, t) for layout, t in shapes if t in counts]
             or list(dict.fromkeys((layout, 1) for layout, _ in shapes)))
    longest = max(t for _, t in timed)
    slot = cache.allocate()
    try:
        device = runner.device
        ids = torch.randint(0, runner.vocab_size, (context_len + longest,)).tolist()
        if prefill_context:
            runner.forward(ForwardBatch(ids[:context_len], [slot], [0], [context_len], [context_len - 1]))
        batches = {t: ForwardBatch(ids[context_len:context_len + t], [slot], [context_len], [t], list(range(t)))
                   for _, t in timed}

        def run(layout: Layout | None, t: int) -> None:
            if layout is not None:
                assert runner.layouts is not None
                runner.layouts.choose({t: layout})
            runner.forward(batches[t])

        for shape in timed:  # warm-up of each shape
            run(*shape)
        samples: dict[tuple[Layout | None, int], list[float]] = {shape: [] for shape in timed}
        for _ in range(repeats):
            for shape in timed:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                run(*shape)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[shape].append(time.perf_counter() - started)
        return {shape: statistic(runs) for shape, runs in samples.items()}
    finally:
        cache.free(slot)


# Seconds by linear layout (Layout.value; "" where the runner has no choice: CUDA) and token count.
Measurements = dict[str, dict[int, float]]

# Timings that contradict each other this much were taken on a busy machine: a forward of fewer tokens
# that took DISTURBED_RATIO times as long as one of more tokens, and DISTURBED_S longer (so that a fast
# device's jitter of a few milliseconds is not mistaken for it).
DISTURBED_RATIO = 2.0
DISTURBED_S = 0.010


def disturbance(measured: Measurements) -> str | None:
    """Why these timings cannot be the machine's own, or None. A longer forward costs at least as
    much as a shorter one; other work on the machine only ever adds time, and adds it at random, so
    a shorter forward far slower than a longer one (each under its fastest layout) means it was
    disturbed. Verifiers timing their forwards together on two cores once gave 0.14-1.55 s for 2-9
    tokens against 58 ms for 16, and a planner that believed them never drafted."""
    best: dict[int, float] = {}
    for seconds in measured.values():
        for t, s in seconds.items():
            best[t] = min(s, best.get(t, s))
    longer: tuple[int, float] | None = None  # the fastest forward of more tokens than the one looked at
    for t in sorted(best, reverse=True):
        s = best[t]
        if longer is not None and s > DISTURBED_RATIO * longer[1] and s - longer[1] > DISTURBED_S:
            return f"{t} tokens took {s * 1e3:.1f} ms, {longer[0]} tokens {longer[1] * 1e3:.1f} ms"
        if longer is None or s < longer[1]:
            longer = (t, s)
    return None


def tune_and_measure(runner: ModelRunner, token_counts: list[int], context_len: int = CONTEXT_LEN,
                     repeats: int = REPEATS,
                     statistic: Callable[[list[float]], float] = statistics.median) -> dict[int, float]:
    """Choose the runner's fastest linear layout per token count (where it has a choice: CPU), then
    return `measure`'s seconds with the chosen layouts. The median, not the min: a layout whose
    best run is fast but whose typical run is not (seen with oneDNN at one token) must lose."""
    return choose_layouts(runner, measure_layouts(runner, token_counts, context_len, repeats, statistic))


def measure_layouts(runner: ModelRunner, token_counts: list[int], context_len: int = CONTEXT_LEN,
                    repeats: int = REPEATS, statistic: Callable[[list[float]], float] = statistics.median,
                    known: Measurements | None = None) -> Measurements:
    """`measure`'s seconds under each of the runner's linear layouts, for the token counts that
    `known` (earlier measurements: model/timing_cache.py) lacks; the rest are taken from it."""
    layouts = runner.layouts.available if runner.layouts is not None else [None]
    names = {layout: layout.value if layout is not None else "" for layout in layouts}
    measured: Measurements = {name: {t: s for t, s in (known or {}).get(name, {}).items() if t in token_counts}
                              for name in names.values()}
    # All layouts in the same rounds: drift bends neither the curve nor the choice between them.
    missing = [(layout, t) for t in token_counts for layout in layouts if t not in measured[names[layout]]]
    if missing:
        for (layout, t), seconds in measure_shapes(runner, missing, context_len, repeats, statistic).items():
            measured[names[layout]][t] = seconds
    return measured


def choose_layouts(runner: ModelRunner, measured: Measurements) -> dict[int, float]:
    """Give each measured token count its fastest layout; the seconds with the layouts chosen."""
    layouts = runner.layouts
    if layouts is None:
        return measured[""]
    by_layout = {layout: measured[layout.value] for layout in layouts.available}
    best = {t: min(by_layout, key=lambda layout: by_layout[layout].get(t, float("inf")))
            for t in by_layout[Layout.PLAIN]}
    layouts.choose(best)
    layouts.drop_unused_packing()
    log.info("linear layout by tokens in a forward: %s", layouts.describe())
    return {t: by_layout[layout][t] for t, layout in best.items()}


@dataclass(frozen=True)
class CostCurve:
    """Forward cost by token count as a multiple of a one-token step, interpolated between
    measured points and extended along the last segment beyond them."""

    points: tuple[tuple[int, float], ...]  # ascending tokens, starting at (1, 1.0)

    @classmethod
    def from_seconds(cls, seconds: dict[int, float]) -> "CostCurve":
        """Smoothed, then scaled so one token costs 1. A lone slow or fast sample is replaced by
        the median of it and its neighbours (a monotone run is left as it is), then the
        least-squares non-decreasing fit (pool adjacent violators) removes what dips remain:
        a longer forward must not look cheaper, nor (as a running maximum would make it) one
        slow sample lift every later point into a plateau that makes their tokens look free
        to the planner."""
        tokens = sorted(seconds)
        raw = [seconds[t] for t in tokens]
        despiked = list(raw)  # the two ends have one neighbour only: kept
        for i in range(1, len(raw) - 1):
            despiked[i] = statistics.median(raw[i - 1:i + 2])
        fitted = _monotone_fit(despiked)
        return cls(tuple((t, c / fitted[0]) for t, c in zip(tokens, fitted)))

    def __call__(self, tokens: float) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        if len(pts) == 1:
            return pts[0][1] * tokens
        (t0, c0), (t1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) / (t1 - t0) * (tokens - t1)

    def describe(self) -> str:
        return " ".join(f"{t}:{c:.2f}" for t, c in self.points)


def _monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares: each run that decreases is
    replaced by its mean, merging runs until none does."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]
