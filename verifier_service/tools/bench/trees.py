"""`splitspec bench --trees N`: token trees against chains, same prompts, same model, one run.

Five in-process n-gram verifiers side by side (`--tree-drafter suffix`: four suffix ones), and
one for plain decoding (prompts rotate between them): an N-token chain and an N-node tree at a
fixed size (the same budget of verified tokens per step), for n-gram the same tree without the
nodes the drafter thinks less likely than `--tree-min-prob` (the suffix drafter's own floor,
min_token_prob, shapes its chains and trees alike), and the chain and the tree as the planner
sizes them (adaptive draft lengths up to N, trees up to N nodes).
Each prints mean tokens per step (emitted tokens / forward passes after the prefill, the
figure trees exist to raise), median tokens/s, and whether every output equals plain decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from verifier_service.tools.bench import workloads
from verifier_service.tools.bench.systems import Run, VerifierSystem
from verifier_service.tools.local_services import LocalService, script, start_together

PLAIN = "plain"


@dataclass
class TreeRow:
    system: str
    workload: str
    tokens_per_step: float  # emitted tokens after the first / decode steps, over all prompts
    tokens_per_s: float  # median over prompts
    verified_per_step: float  # draft nodes verified per drafting step
    identical: int
    prompts: int


def _verifier(name: str, args: argparse.Namespace, draft_len: int, nodes: int, adaptive: bool, min_prob: float,
              folder: Path, timing_cache: str = "on") -> LocalService:
    config = folder / f"{name}.json"
    # The suffix drafter's own floor (min_token_prob, its default) shapes its chains and trees alike.
    knobs = ({"ngram": {"maxMatchingNgramSize": args.ngram_size, "treeMinProb": min_prob}}
             if args.tree_drafter == "ngram" else {})
    config.write_text(json.dumps({"mode": args.tree_drafter.upper(), "maxDraftLen": draft_len, **knobs,
                                  "policy": {"adaptiveDraftLen": adaptive}}))
    extra = ["--model", args.model] if args.model else []
    # One request at a time: one KV slot, so start-up measures forwards of up to one draft only.
    return LocalService([script("splitspec-verifier"), "--speculative-config", str(config),
                         "--max-draft-nodes", str(nodes), "--max-num-seqs", "1", "--device", args.device,
                         "--dtype", args.dtype, "--http-port", "off", "--log-level", "WARNING", "--timing-cache",
                         timing_cache, *extra],
                        name=name, startup_timeout_s=1200)


def run(args: argparse.Namespace, prompts: list[workloads.Prompt], run_all) -> list[TreeRow]:  # noqa: ANN001
    """`run_all(systems, prompts, args)`: bench/run.py's rotating runner."""
    n = args.trees
    # The planner's chains and trees may reach as deep as the fixed ones: it only ever shortens them.
    p = args.tree_min_prob
    floored = [(f"tree {n}, p >= {p:g}", n, n, False, p)] if args.tree_drafter == "ngram" else []
    setups = [(f"chain {n}", n, 0, False, 0.0), (f"tree {n}", n, n, False, 0.0), *floored,
              ("chain planner", n, 0, True, 0.0), (f"tree planner (<= {n} nodes)", n, n, True, 0.0)]
    print(f"starting {len(setups) + 1} verifiers (chains, trees and plain decoding) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        # Plain decoding on a verifier of its own: on a shared one, the second system to run a prompt
        # would find it in the prefix cache and skip its prefill. It starts first, alone, and times its
        # forwards afresh (up to n + 1 tokens, a tree's too); the others start together on those timings.
        plain = stack.enter_context(_verifier("plain", args, n, 0, False, 0.0, Path(tmp), "refresh"))
        services = start_together(stack, [_verifier(f"v{i}", args, k, m, adaptive, floor, Path(tmp))
                                           for i, (name, k, m, adaptive, floor) in enumerate(setups)])
        systems = [VerifierSystem(PLAIN, plain.address, speculate=False)] + [
            VerifierSystem(name, service.address, speculate=True) for (name, *_), service in zip(setups, services)]
        runs = run_all(systems, prompts, args)
        for system in systems:
            system.close()
    rows = []
    for workload in dict.fromkeys(p.workload for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.workload == workload]
        plain = [runs[PLAIN][i] for i in idx]
        for name, *_ in setups:
            rows.append(_row(name, workload, [runs[name][i] for i in idx], plain))
    return rows


def _row(name: str, workload: str, runs: list[Run], plain: list[Run]) -> TreeRow:
    steps = sum(r.stats.num_steps for r in runs)
    drafts = sum(r.stats.num_drafts for r in runs)
    return TreeRow(
        system=name, workload=workload,
        tokens_per_step=sum(len(r.token_ids) - 1 for r in runs) / steps if steps else 0.0,
        tokens_per_s=statistics.median(len(r.token_ids) / r.seconds for r in runs),
        verified_per_step=sum(r.stats.num_draft_nodes for r in runs) / drafts if drafts else 0.0,
        identical=sum(r.token_ids == p.token_ids for r, p in zip(runs, plain)), prompts=len(runs))


def print_table(rows: list[TreeRow], n: int, drafter: str) -> None:
    print(f"\nchains vs token trees ({drafter} in-process; fixed: {n} verified tokens per step)")
    print(f"{'workload':<10} {'system':<28} {'tokens/step':>11} {'vs chain':>8} {'tok/s':>7} {'vs chain':>8} "
          f"{'nodes/draft':>11} {'identical':>9}")
    for row in rows:
        base = next(r for r in rows if r.workload == row.workload and
                    r.system == (f"chain {n}" if row.system.startswith(("chain", f"tree {n}")) else "chain planner"))
        print(f"{row.workload:<10} {row.system:<28} {row.tokens_per_step:>11.2f} "
              f"{row.tokens_per_step / base.tokens_per_step:>7.2f}x {row.tokens_per_s:>7.1f} "
              f"{row.tokens_per_s / base.tokens_per_s:>7.2f}x {row.verified_per_step:>11.1f} "
              f"{row.identical:>4}/{row.prompts:<4}")


def to_json(rows: list[TreeRow], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
