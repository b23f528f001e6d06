"""`splitspec demo`: a drafter and a verifier on the embedded model, side by side with plain decoding."""

from __future__ import annotations

import argparse
import statistics
import time

import grpc

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.tools.local_services import LocalService, script

FUNCTION = '''def running_mean(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        result.append(total / min(i + 1, window))
    return result'''

PARAGRAPH = ("Speculative decoding lets a small, fast drafter propose several tokens that the large "
             "target model then checks in a single forward pass. Every accepted token is one the target "
             "would have produced anyway, so the output does not change; only the time to produce it does.")

PROMPTS = [
    ("rewrite code", f"Add type hints to this Python function. Reply with the full function only.\n\n{FUNCTION}"),
    ("repeat text", f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}"),
    ("open question", "Give three tips for writing readable Python code."),
]


def _generate(stub: verifier_pb2_grpc.VerifierServiceStub, prompt: str, max_new_tokens: int,
              speculate: bool) -> tuple[verifier_pb2.GenerationOutput, float]:
    request = verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
        chat=verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(role="user", content=prompt)]),
        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens),
        speculation=verifier_pb2.SpeculationOverrides(disable=not speculate)))
    started = time.perf_counter()
    reply = stub.Generate(request, timeout=600)
    return reply.output, time.perf_counter() - started


def run_demo(args: argparse.Namespace) -> int:
    print("starting the n-gram drafter service ...", flush=True)
    drafter = LocalService([script("splitspec-drafter"), "ngram", "--max-draft-len", str(args.max_draft_len)],
                           name="drafter").start()
    try:
        print(f"drafter SERVING at {drafter.address}; starting the verifier (loading the model) ...", flush=True)
        # One request at a time: start-up then times forwards of one sequence's draft only (26 s against
        # 35 s for SmolLM2 on a 2-core CPU, the first time; later starts take the timings from the cache).
        verifier_argv = [script("splitspec-verifier"), "--speculative-mode", "user_provided",
                         "--drafter-target", drafter.address, "--max-draft-len", str(args.max_draft_len),
                         "--max-num-seqs", "1", "--log-level", "WARNING", "--http-port", "off"]
        if args.model:
            verifier_argv += ["--model", args.model]
        verifier = LocalService(verifier_argv, name="verifier", show_output=True).start()
        try:
            print(f"verifier SERVING at {verifier.address}\n", flush=True)
            rows = _measure(verifier.address, args)
        finally:
            verifier_code = verifier.stop()
    finally:
        drafter_code = drafter.stop()
    _print_table(rows)
    print(f"\nshut down: verifier exit {verifier_code}, drafter exit {drafter_code}")
    return 0 if all(r["identical"] for r in rows) and verifier_code == 0 and drafter_code == 0 else 1


def _measure(address: str, args: argparse.Namespace) -> list[dict]:
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        _generate(stub, "Hello", 8, True)  # warm-up
        for name, prompt in PROMPTS:
            plain_times, spec_times = [], []
            for _ in range(args.repeats):
                plain, t_plain = _generate(stub, prompt, args.max_new_tokens, speculate=False)
                spec, t_spec = _generate(stub, prompt, args.max_new_tokens, speculate=True)
                plain_times.append(t_plain)
                spec_times.append(t_spec)
            n = len(spec.token_ids)
            rows.append({
                "workload": name, "tokens": n,
                "plain_tps": len(plain.token_ids) / statistics.median(plain_times),
                "spec_tps": n / statistics.median(spec_times),
                "mal": spec.stats.mean_acceptance_length,
                "identical": list(plain.token_ids) == list(spec.token_ids),
                "text": spec.text,
            })
    return rows


def _print_table(rows: list[dict]) -> None:
    header = f"{'workload':<14} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} " \
             f"{'mean acc. len':>13} {'identical':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<14} {r['tokens']:>6} {r['plain_tps']:>11.1f} {r['spec_tps']:>10.1f} "
              f"{r['spec_tps'] / r['plain_tps']:>6.2f}x {r['mal']:>13.2f} {'yes' if r['identical'] else 'NO':>9}")
    print("\nfirst lines of each speculative answer:")
    for r in rows:
        first = r["text"].strip().splitlines()[:2]
        print(f"  [{r['workload']}] " + " / ".join(first))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt (median reported)")
    p.set_defaults(func=run_demo)
