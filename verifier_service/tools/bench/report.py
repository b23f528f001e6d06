"""Summaries, tables, JSON and a PNG chart of a benchmark run."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from verifier_service.model.step_costs import CostCurve

if TYPE_CHECKING:  # for annotations only: the report takes any object with those fields
    from verifier_service.tools.bench.systems import Run


@dataclass
class SystemSummary:
    system: str
    workload: str
    tokens_per_s: float  # median over prompts
    ratio_to_plain: float  # median over prompts of (plain time per token / this time per token)
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    acceptance_per_position: list[float]
    identical: int  # prompts whose tokens equal plain decoding's
    prompts: int
    ideal_speedup: float | None = None
    efficiency: float | None = None  # measured decode speedup / ideal decode speedup


@dataclass
class Report:
    model: str
    max_new_tokens: int
    max_draft_len: int
    forward_cost_ms: dict[int, float]  # tokens in one forward -> ms
    summaries: list[SystemSummary] = field(default_factory=list)
    request_bytes: list[tuple[int, int]] = field(default_factory=list)  # (context tokens, bytes per call)
    serving: list[dict] = field(default_factory=list)
    # Per workload: a system's speed relative to a baseline's (median over prompts of time-per-token ratios).
    comparisons: list[dict] = field(default_factory=list)
    suffix_speed: dict | None = None  # suffix_speed.SuffixSpeed as a dict
    suffix_speed_variants: list[dict] = field(default_factory=list)  # the same, for each --suffix-variant
    draft_model: list[dict] = field(default_factory=list)  # bench.draft_model.DraftModelFigures, ahead on / off

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))


# Resamples of a bootstrap interval: for 40 prompts as spread as the templated workload's, its ends move by
# under 0.01x between seeds (with a handful of prompts they fall on the prompts' own ratios and jump between).
BOOTSTRAP_RESAMPLES = 2000


def speed_ratios(runs: list, baseline_runs: list) -> list[float]:
    """Per prompt, baseline time per token / this time per token: above 1 is faster."""
    return [(b.seconds / max(1, len(b.token_ids))) / (r.seconds / max(1, len(r.token_ids)))
            for r, b in zip(runs, baseline_runs)]


def median_interval(values: list[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[float, float]:
    """A bootstrap percentile interval of the median over prompts (the prompts drawn again with replacement):
    how far the median would move with other prompts of the same kind. Not how far another run would move it
    (the machine's speed, the cost curve its verifiers measured at start-up): that takes another run."""
    if not values:
        return math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = int((1 - confidence) / 2 * resamples)
    return medians[tail], medians[resamples - 1 - tail]


def decode_speed(run: Run, baseline: Run) -> float | None:
    """Baseline decode time per token / this one's, after each request's first token (the prefill, the
    same work whatever drafts, left out); None where either decoded nothing past its first token."""
    if min(len(run.token_ids), len(baseline.token_ids)) < 2 or min(run.decode_seconds, baseline.decode_seconds) <= 0:
        return None
    return (baseline.decode_seconds / (len(baseline.token_ids) - 1)) / (run.decode_seconds / (len(run.token_ids) - 1))


def relative_decode_speed(runs: list, baseline_runs: list) -> float:
    """Median over prompts of decode_speed (nan when none decoded)."""
    ratios = [x for x in map(decode_speed, runs, baseline_runs) if x is not None]
    return statistics.median(ratios) if ratios else float("nan")


def summarise(system: str, workload: str, runs: list, plain_runs: list, costs: CostCurve) -> SystemSummary:
    """runs / plain_runs: bench.systems.Run per prompt, same order."""
    tps = [len(r.token_ids) / r.seconds for r in runs if r.seconds > 0]
    ratios = speed_ratios(runs, plain_runs)
    drafts = sum(r.stats.num_drafts for r in runs)
    drafted = sum(r.stats.num_draft_tokens for r in runs)
    accepted = sum(r.stats.num_accepted_tokens for r in runs)
    per_pos: list[int] = []
    for r in runs:
        for i, n in enumerate(r.stats.num_accepted_tokens_per_pos):
            per_pos.extend([0] * (i + 1 - len(per_pos)))
            per_pos[i] += n
    summary = SystemSummary(
        system=system, workload=workload, tokens_per_s=statistics.median(tps), ratio_to_plain=statistics.median(ratios),
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        acceptance_rate=accepted / drafted if drafted else None,
        acceptance_per_position=[n / drafts for n in per_pos] if drafts else [],
        identical=sum(r.token_ids == p.token_ids for r, p in zip(runs, plain_runs)), prompts=len(runs))
    if drafts:
        ideal, measured = [], []
        for r, p in zip(runs, plain_runs):
            s, speed = r.stats, decode_speed(r, p)
            if not s.num_steps or speed is None:
                continue
            mean_k = s.num_draft_tokens / s.num_drafts if s.num_drafts else 0.0
            spec_cost = (s.num_steps - s.num_drafts) + s.num_drafts * costs(mean_k + 1)
            ideal.append((s.num_steps + s.num_accepted_tokens) / spec_cost)
            measured.append(speed)
        if ideal:
            summary.ideal_speedup = statistics.median(ideal)
            summary.efficiency = statistics.median(m / i for m, i in zip(measured, ideal))
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(report: Report) -> None:
    costs = ", ".join(f"{t}:{c:.1f}" for t, c in report.forward_cost_ms.items())
    print(f"\nmodel {report.model}, greedy, max_new_tokens {report.max_new_tokens}, "
          f"max_draft_len {report.max_draft_len}")
    print(f"target forward cost (ms) by tokens in one forward: {costs}")
    for workload in dict.fromkeys(s.workload for s in report.summaries):
        rows = [s for s in report.summaries if s.workload == workload]
        print(f"\n== {workload} ({rows[0].prompts} prompts) ==")
        width = max(28, *(len(s.system) for s in rows))  # a drafter's spec (--drafter) can be long
        header = (f"{'system':<{width}} {'tok/s':>7} {'vs plain':>8} {'mean acc len':>12} {'acc rate':>8} "
                  f"{'ideal':>6} {'effic.':>6} {'identical':>9}  acceptance by position")
        print(header)
        print("-" * len(header))
        for s in rows:
            per_pos = " ".join(f"{a:.2f}" for a in s.acceptance_per_position[:10])
            print(f"{s.system:<{width}} {s.tokens_per_s:>7.1f} {s.ratio_to_plain:>7.2f}x "
                  f"{_fmt(s.mean_acceptance_length, '.2f'):>12} {_fmt(s.acceptance_rate, '.2f'):>8} "
                  f"{_fmt(s.ideal_speedup, '.2f'):>6} {_fmt(s.efficiency, '.2f'):>6} "
                  f"{s.identical:>4}/{s.prompts:<4}  {per_pos}")
    if report.comparisons:
        print("\n== against the remote n-gram drafter (time per token, median over prompts "
              "[95% bootstrap interval over prompts]; decode: after the first token) ==")
        header_baseline = report.comparisons[0]["baseline"]
        for workload in dict.fromkeys(c["workload"] for c in report.comparisons):
            print(f"  {workload:<16} " + ", ".join(f"{_against(c, header_baseline)} {c['ratio']:.3f}x "
                                                    f"[{c['ratio_interval'][0]:.3f}-{c['ratio_interval'][1]:.3f}] "
                                                    f"(decode {c['decode_ratio']:.2f}x)"
                                                    for c in report.comparisons if c["workload"] == workload))
    if report.suffix_speed:
        print_suffix_speed(report.suffix_speed)
    for speed in report.suffix_speed_variants:
        print_suffix_speed(speed)
    if report.request_bytes:
        print("\nPrepareDraftTokens request size as one sequence's context grows:")
        print("  " + ", ".join(f"{n} tokens: {b} B" for n, b in report.request_bytes))
    if report.serving:
        print("\n== serving: aggregate output tokens/s (remote n-gram drafter) ==")
        print(f"{'concurrency':>11} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'identical':>9}")
        for row in report.serving:
            print(f"{row['concurrency']:>11} {row['plain_tps']:>11.1f} {row['spec_tps']:>10.1f} "
                  f"{row['spec_tps'] / row['plain_tps']:>5.2f}x {row['identical']:>4}/{row['requests']:<4}")


def _against(comparison: dict, header_baseline: str) -> str:
    """A comparison's system, and its baseline where that is not the one the header names (a suffix variant
    against the default suffix drafter)."""
    system = comparison["system"].removeprefix("splitspec ")
    if comparison["baseline"] == header_baseline:
        return system
    return f"{system} ÷ {comparison['baseline'].removeprefix('splitspec ')}"


def print_suffix_speed(s: dict) -> None:
    flags = f" ({s['flags']})" if s["flags"] else ""
    print(f"\nsuffix drafter itself{flags}, {s['cached_outputs']} cached outputs of {s['output_len']} tokens "
          f"({s['global_tree_mb']:.0f} MiB estimated): ingesting one finished output {s['ingest_ms_p50']:.2f} ms "
          f"p50; one PrepareDraftTokens for {s['sequences']} sequences of {s['context_len']} tokens "
          f"{s['prepare_ms_p50']:.2f} ms p50, {s['prepare_ms_p90']:.2f} ms p90; with token trees of up to "
          f"{s['tree_nodes']} nodes {s['tree_prepare_ms_p50']:.2f} ms p50, {s['tree_prepare_ms_p90']:.2f} ms p90; "
          f"sequences copying their own context {s['copy_prepare_ms_p50']:.2f} ms p50, "
          f"{s['copy_prepare_ms_p90']:.2f} ms p90; what it learned saves in {s['snapshot_mb']:.1f} MiB "
          f"({s['save_ms_p50']:.0f} ms p50 to take) and restores in {s['restore_s']:.2f} s "
          f"({s['from_peer_s']:.2f} s asked of a peer over gRPC)")


def save_chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s.workload for s in report.summaries))
    systems = list(dict.fromkeys(s.system for s in report.summaries))
    fig, ax = plt.subplots(figsize=(2.5 + 2.2 * len(workloads), 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [next((s.ratio_to_plain for s in report.summaries if s.system == system and s.workload == w), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("speed vs our plain decoding (x)")
    ax.set_title(f"{report.model}: output tokens/s relative to plain decoding (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
