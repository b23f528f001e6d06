"""`splitspec bench-tp`: one verifier sharded over 1, 2, ... ranks (tensor parallelism), side by side.

For each size N it starts `splitspec-verifier --tensor-parallel-size N` (which starts its ranks
1..N-1) with the in-process n-gram drafter; all of them run side by side. Every prompt goes to
each in turn (the order rotates, so drift on a shared machine favours none), alone, plain and
speculative; then each serves `--concurrency` plain requests at once. It reports median tokens/s,
the ratio to the first size, and whether every output equals the first size's (greedy; EOS
ignored, so every run produces exactly `--max-new-tokens`).

On CPU every size gets the same cores: each of N ranks runs cores / N intra-op threads
(`--threads-per-rank` sets another number). The
embedded SmolLM2-135M has 9 attention heads and 3 KV heads, so it splits three ways but not two;
`--random-like-embedded` measures a random Llama of its size instead (8 heads of 72 dims, 4 KV
heads) with its tokenizer: speed only, the text means nothing.

On a multi-GPU machine (nccl; not run yet):

    splitspec bench-tp --model /models/Qwen2.5-7B-Instruct --device cuda --tensor-parallel-sizes 1,2,4 \\
        --max-model-len 4096 --kv-cache-memory-gb 16 --prompts 4 --max-new-tokens 256 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.model import loader as model_loader
from verifier_service.tools.bench import workloads
from verifier_service.tools.bench.flags import positive_ints
from verifier_service.tools.local_services import LocalService, script


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    source.add_argument("--random-like-embedded", action="store_true",
                        help="a random Llama of SmolLM2-135M's size that splits 2 and 4 ways (speed only)")
    p.add_argument("--tensor-parallel-sizes", default="1,2", help="comma list; the first is the reference")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (rank i uses GPU i)")
    p.add_argument("--workloads", default="grounded,code,open", help="comma list of grounded, code, open")
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="per rank, for every verifier started")
    p.add_argument("--threads-per-rank", type=int,
                   help="CPU: intra-op threads of each rank (default: cores / N, so every size uses the same cores)")
    p.add_argument("--concurrency", type=positive_ints, default=[4],
                   help="plain requests at once for the serving figure, e.g. 1,16 (default: 4)")
    p.add_argument("--out", default="bench-results", help="folder for tp.json")
    p.set_defaults(func=main)


@dataclass
class SizeResult:
    tensor_parallel_size: int
    plain_tps: float  # median over prompts, one request at a time
    spec_tps: float
    identical: int  # prompts (plain and speculative) whose tokens equal the first size's plain tokens
    runs: int
    serving_tps: dict[int, float] = field(default_factory=dict)  # concurrency -> aggregate tokens/s


Run = tuple[list[int], float]  # (tokens, seconds)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.tensor_parallel_sizes.split(",")]
    concurrency = args.concurrency
    with tempfile.TemporaryDirectory(prefix="splitspec-bench-tp-") as scratch, contextlib.ExitStack() as stack:
        model = str(_random_like_embedded(Path(scratch))) if args.random_like_embedded else args.model
        source = model_loader.resolve_source(model)
        print(f"loading the tokenizer of {source.name} ...", flush=True)
        tokenizer = model_loader.load_tokenizer(source)
        prompts = workloads.build(args.workloads.split(","), args.prompts, tokenizer)
        stubs = []
        for size in sizes:
            print(f"starting the verifier with tensor-parallel size {size} ...", flush=True)
            verifier = stack.enter_context(_verifier(size, model, args))
            stubs.append(verifier_pb2_grpc.VerifierServiceStub(
                stack.enter_context(grpc.insecure_channel(verifier.address))))
        results = _measure(sizes, stubs, prompts, args, concurrency)
    _print(results, source.name, args)
    (out / "tp.json").write_text(json.dumps({"model": source.name, "device": args.device,
                                             "max_new_tokens": args.max_new_tokens,
                                             "results": [asdict(r) for r in results]}, indent=2))
    print(f"\nwrote {out / 'tp.json'}")
    return 0


def _random_like_embedded(folder: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads of 72 dims and 4 KV heads (it has 9 x 64 and 3), random weights."""
    embedded = model_loader.embedded_source()
    cfg = model_loader.load_config(embedded).get_text_config()
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         head_dim=cfg.hidden_size // 8, max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=getattr(cfg, "rope_theta", 10000.0),
                         tie_word_embeddings=True, eos_token_id=cfg.eos_token_id, bos_token_id=cfg.bos_token_id)
    torch.manual_seed(0)
    path = folder / "random-like-SmolLM2-135M"
    LlamaForCausalLM(config).save_pretrained(path)
    model_loader.load_tokenizer(embedded).save_pretrained(path)
    return path


def _verifier(size: int, model: str | None, args: argparse.Namespace) -> LocalService:
    # On CPU every size gets the same cores by default: N ranks of cores / N threads each.
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // size)
    env = {"OMP_NUM_THREADS": str(threads)} if args.device in ("auto", "cpu") else {}
    return LocalService([script("splitspec-verifier"), "--tensor-parallel-size", str(size), "--device", args.device,
                         "--speculative-mode", "ngram", "--max-draft-len", str(args.max_draft_len),
                         "--max-model-len", str(args.max_model_len),
                         "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
                         "--log-level", "WARNING", "--http-port", "off", *(["--model", model] if model else [])],
                        name=f"verifier-tp{size}", env=env, startup_timeout_s=1800)


def _measure(sizes: list[int], stubs: list[verifier_pb2_grpc.VerifierServiceStub], prompts: list[workloads.Prompt],
             args: argparse.Namespace, concurrency: list[int]) -> list[SizeResult]:
    for stub in stubs:
        _generate(stub, prompts[0].token_ids[:32], 8, speculate=False)  # warm-up
    plain: list[list[Run]] = [[] for _ in sizes]
    spec: list[list[Run]] = [[] for _ in sizes]
    for n, prompt in enumerate(prompts):
        order = [(i + n) % len(sizes) for i in range(len(sizes))]
        for i in order:
            plain[i].append(_generate(stubs[i], prompt.token_ids, args.max_new_tokens, speculate=False))
            spec[i].append(_generate(stubs[i], prompt.token_ids, args.max_new_tokens, speculate=True))
        print(f"  {prompt.workload}/{prompt.name}: " + ", ".join(
            f"TP {size} plain {_tps(p[-1]):.1f} / n-gram {_tps(s[-1]):.1f} tok/s"
            for size, p, s in zip(sizes, plain, spec)), flush=True)
    reference = [tokens for tokens, _ in plain[0]] * 2
    results = []
    for size, stub, p, s in zip(sizes, stubs, plain, spec):
        result = SizeResult(size, statistics.median(map(_tps, p)), statistics.median(map(_tps, s)),
                            identical=sum(t == r for (t, _), r in zip(p + s, reference)), runs=len(p + s))
        for c in concurrency:
            batch = [prompts[i % len(prompts)].token_ids for i in range(2 * c)]
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                done = list(pool.map(lambda ids: _generate(stub, ids, args.max_new_tokens, speculate=False), batch))
            result.serving_tps[c] = sum(len(t) for t, _ in done) / (time.perf_counter() - started)
        results.append(result)
    return results


def _generate(stub: verifier_pb2_grpc.VerifierServiceStub, ids: list[int], max_new_tokens: int,
              speculate: bool) -> Run:
    params = verifier_pb2.GenerationParams(
        token_ids=verifier_pb2.TokenIds(ids=ids), sampling=verifier_pb2.SamplingParams(temperature=0.0),
        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        speculation=verifier_pb2.SpeculationOverrides(disable=not speculate))
    started = time.perf_counter()
    reply = stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=1800)
    return list(reply.output.token_ids), time.perf_counter() - started


def _tps(run: Run) -> float:
    return len(run[0]) / run[1]


def _print(results: list[SizeResult], model: str, args: argparse.Namespace) -> None:
    base = results[0]
    print(f"\nmodel {model}, device {args.device}, greedy, {args.max_new_tokens} new tokens, medians of "
          f"{base.runs // 2} prompts one at a time")
    header = (f"{'TP size':>7} {'plain tok/s':>11} {'vs first':>8} {'n-gram tok/s':>12} {'vs first':>8} "
              f"{'identical':>9}  serving tok/s (concurrency: tok/s, vs first)")
    print(header)
    print("-" * len(header))
    for r in results:
        serving = ", ".join(f"{c}: {tps:.1f} {tps / base.serving_tps[c]:.2f}x" for c, tps in r.serving_tps.items())
        print(f"{r.tensor_parallel_size:>7} {r.plain_tps:>11.1f} {r.plain_tps / base.plain_tps:>7.2f}x "
              f"{r.spec_tps:>12.1f} {r.spec_tps / base.spec_tps:>7.2f}x {r.identical:>4}/{r.runs:<4}  {serving}")
