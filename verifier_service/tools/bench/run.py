"""Orchestrates `splitspec bench`: start the services, run every system on every prompt, report."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import statistics
import time
from pathlib import Path

import torch

from verifier_service.model import loader as model_loader
from verifier_service.model import step_costs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ModelRunner
from verifier_service.spec.config import DEFAULT_DELTA_OVERLAP_STEPS
from verifier_service.spec.drafter_client import (
    DeltaHistory,
    DrafterClient,
    DraftQuery,
    GrpcTransport,
)
from verifier_service.tools.bench import report as rep
from verifier_service.tools.bench import trees as bench_trees
from verifier_service.tools.bench import workloads
from verifier_service.tools.bench.systems import Run, TransformersSystem, VerifierSystem
from verifier_service.tools.local_services import LocalService, script

log = logging.getLogger(__name__)
PLAIN = "splitspec plain"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="side-by-side speed: plain, n-gram in-process, n-gram remote, transformers")
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default="grounded,code,open", help="comma list of grounded, code, open")
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--ngram-size", type=int, default=3, help="max matching n-gram size (ours and transformers')")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and system (median)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers generate() systems")
    p.add_argument("--concurrency", default="", help="also measure serving throughput, e.g. 1,4,16")
    p.add_argument("--speculative-config", help="verifier speculative config file (policy knobs) for both verifiers")
    p.add_argument("--trees", type=int, default=0, metavar="N",
                   help="instead: n-gram chains vs token trees at N verified tokens per step, and as the planner "
                        "sizes them (writes trees.json)")
    p.add_argument("--out", default="bench-results", help="folder for results.json and chart.png")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = model_loader.resolve_source(args.model)
    print(f"loading {source.name} for transformers and for tokenizing ...", flush=True)
    model, tokenizer = model_loader.load(source, torch.float32, model_loader.pick_device("auto"))
    prompts = workloads.build(args.workloads.split(","), args.prompts, tokenizer)
    if args.trees:
        del model
        rows = bench_trees.run(args, prompts, _run_all)
        bench_trees.print_table(rows, args.trees)
        bench_trees.to_json(rows, out / "trees.json")
        print(f"\nwrote {out / 'trees.json'}")
        return 0
    seconds = _forward_costs(model, args.max_draft_len)
    curve = step_costs.CostCurve.from_seconds(seconds)
    report = rep.Report(model=source.name, max_new_tokens=args.max_new_tokens, max_draft_len=args.max_draft_len,
                        forward_cost_ms={t: s * 1000 for t, s in seconds.items()})
    common = ["--max-draft-len", str(args.max_draft_len), "--log-level", "WARNING"] + (
        ["--model", args.model] if args.model else [])
    if args.speculative_config:
        common += ["--speculative-config", args.speculative_config]
    print("starting the drafter and two verifiers ...", flush=True)
    with LocalService([script("splitspec-drafter"), "ngram", "--max-draft-len", str(args.max_draft_len),
                       "--max-matching-ngram-size", str(args.ngram_size)], name="drafter") as drafter, \
         LocalService([script("splitspec-verifier"), "--speculative-mode", "user_provided",
                       "--drafter-target", drafter.address, *common], name="verifier-remote") as remote, \
         LocalService([script("splitspec-verifier"), "--speculative-mode", "ngram",
                       "--max-matching-ngram-size", str(args.ngram_size), *common],
                      name="verifier-inprocess") as local:
        systems = [VerifierSystem(PLAIN, remote.address, speculate=False),
                   VerifierSystem("splitspec ngram in-process", local.address, speculate=True),
                   VerifierSystem("splitspec ngram remote", remote.address, speculate=True)]
        if not args.no_transformers:
            systems += [TransformersSystem("transformers generate", model),
                        TransformersSystem("transformers prompt lookup", model,
                                           prompt_lookup_num_tokens=args.max_draft_len,
                                           max_matching_ngram_size=args.ngram_size)]
        runs = _run_all(systems, prompts, args)
        for workload in dict.fromkeys(p.workload for p in prompts):
            idx = [i for i, p in enumerate(prompts) if p.workload == workload]
            plain = [runs[PLAIN][i] for i in idx]
            for system in systems:
                report.summaries.append(rep.summarise(system.name, workload, [runs[system.name][i] for i in idx],
                                                      plain, curve))
        report.request_bytes = asyncio.run(_request_bytes(drafter.address, model.config.vocab_size))
        if args.concurrency:
            report.serving = _serving(remote.address, prompts, args)
        for system in systems:
            system.close()
    rep.print_tables(report)
    report.to_json(out / "results.json")
    rep.save_chart(report, out / "chart.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'chart.png'}")
    return 0


def _forward_costs(model: torch.nn.Module, max_draft_len: int) -> dict[int, float]:
    shape = KVCacheShape.for_model(model.config, num_slots=1, capacity=512)
    runner = ModelRunner(model, KVCache(shape, model.dtype, model.device))
    try:  # with the linear layouts the verifiers choose; the transformers systems then get the model back as loaded
        return step_costs.tune_and_measure(runner, step_costs.probe_points(max_draft_len, 0), context_len=256,
                                           repeats=7, statistic=statistics.median)
    finally:
        runner.close()


def _run_all(systems: list, prompts: list[workloads.Prompt], args: argparse.Namespace) -> dict[str, list[Run]]:
    warm = workloads.Prompt("warm-up", "warm-up", prompts[0].token_ids[:32])
    for system in systems:
        system.run(warm, 8)
    runs: dict[str, list[Run]] = {s.name: [] for s in systems}
    for n, prompt in enumerate(prompts):
        per_system: dict[str, list[Run]] = {s.name: [] for s in systems}
        for r in range(args.repeats):
            # Rotate the order so slow drift on a shared machine does not favour one system.
            shift = (n + r) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                per_system[system.name].append(system.run(prompt, args.max_new_tokens))
        for name, rs in per_system.items():
            runs[name].append(sorted(rs, key=lambda x: x.seconds)[len(rs) // 2])
        print(f"  {prompt.workload}/{prompt.name}: " + ", ".join(
            f"{name} {len(r[-1].token_ids) / r[-1].seconds:.1f} tok/s" for name, r in runs.items()), flush=True)
    return runs


async def _request_bytes(address: str, vocab_size: int) -> list[tuple[int, int]]:
    """Bytes of one PrepareDraftTokens as a sequence grows 100 -> 2000 tokens, one token per step."""
    client = DrafterClient(GrpcTransport(address), "bench", vocab_size, deadline_s=1.0,
                           overlap_steps=DEFAULT_DELTA_OVERLAP_STEPS)
    history = DeltaHistory()
    tokens = [int(t) for t in torch.randint(0, vocab_size, (2000,))]
    sizes = []
    try:
        for n in range(100, 2001):
            await client.propose([DraftQuery("grow", tokens[:n], 50, 8, history)])
            if n in (100, 500, 1000, 2000):
                sizes.append((n, client.stats.last_request_bytes))
    finally:
        await client.close()
    return sizes


def _serving(address: str, prompts: list[workloads.Prompt], args: argparse.Namespace) -> list[dict]:
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        batch = [prompts[i % len(prompts)] for i in range(max(concurrency, 4) * 2 if concurrency > 1 else 4)]
        result: dict[str, tuple[float, list[Run]]] = {}
        for speculate in (False, True):
            system = VerifierSystem("serving", address, speculate)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                done = list(pool.map(lambda p: system.run(p, args.max_new_tokens), batch))
            result[str(speculate)] = (time.perf_counter() - started, done)
            system.close()
        (t_plain, plain), (t_spec, spec) = result["False"], result["True"]
        rows.append({"concurrency": concurrency, "requests": len(batch),
                     "plain_tps": sum(len(r.token_ids) for r in plain) / t_plain,
                     "spec_tps": sum(len(r.token_ids) for r in spec) / t_spec,
                     "identical": sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))})
        print(f"  serving concurrency {concurrency}: plain {rows[-1]['plain_tps']:.1f} tok/s, "
              f"speculative {rows[-1]['spec_tps']:.1f} tok/s", flush=True)
    return rows
