"""`splitspec demo`: a drafter and a verifier on the embedded model, side by side with plain decoding.

Each prompt is asked twice with speculation: the first time, and again as a new request once the first has
finished. The suffix drafter (the default) learns from every request it sees finish, so the second time it
drafts from the first answer, as a drafter service shared by a fleet does for questions that recur; the
n-gram drafter (`--drafter ngram`) drafts from each request's own text alone, and gains nothing the second
time.
"""

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
        sampling=verifier_pb2.SamplingParams(temperature=0.0),  # greedy, whatever the model's defaults
        speculation=verifier_pb2.SpeculationOverrides(disable=not speculate)))
    started = time.perf_counter()
    reply = stub.Generate(request, timeout=600)
    return reply.output, time.perf_counter() - started


DRAFTERS = {
    "suffix": "the suffix drafter service (it drafts from each request's own text and from every request it has "
              "seen finish)",
    "ngram": "the n-gram drafter service (it drafts from each request's own text)",
}


def run_demo(args: argparse.Namespace) -> int:
    print(f"starting {DRAFTERS[args.drafter]} ...", flush=True)
    # The suffix drafter's drafts are as long as the verifier asks; the n-gram drafter's have a cap of their own.
    cap = ["--max-draft-len", str(args.max_draft_len)] if args.drafter == "ngram" else []
    drafter = LocalService([script("splitspec-drafter"), args.drafter, *cap], name="drafter").start()
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
            plain_runs = [_generate(stub, prompt, args.max_new_tokens, speculate=False) for _ in range(args.repeats)]
            # The first time is one run: once it has finished, a drafter that learns holds its answer.
            first, t_first = _generate(stub, prompt, args.max_new_tokens, speculate=True)
            again_runs = [_generate(stub, prompt, args.max_new_tokens, speculate=True) for _ in range(args.repeats)]
            plain = plain_runs[0][0]
            again = again_runs[-1][0]
            n = len(first.token_ids)
            rows.append({
                "workload": name, "tokens": n,
                "plain_tps": len(plain.token_ids) / statistics.median(t for _, t in plain_runs),
                "first_tps": n / t_first,
                "first_mal": first.stats.mean_acceptance_length,
                "again_tps": len(again.token_ids) / statistics.median(t for _, t in again_runs),
                "again_mal": again.stats.mean_acceptance_length,
                "identical": all(list(out.token_ids) == list(plain.token_ids)
                                 for out, _ in [*plain_runs, (first, t_first), *again_runs]),
                "text": first.text,
            })
    return rows


def _print_table(rows: list[dict]) -> None:
    spec = f"{'spec tok/s':>10} {'speedup':>7} {'MAL':>5}"
    header = f"{'workload':<14} {'tokens':>6} {'plain tok/s':>11} | {spec} | {spec} | {'identical':>9}"
    first_at = header.index("|") + 2
    print(" " * first_at + f"{'first time':<{len(spec)}}   asked again")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<14} {r['tokens']:>6} {r['plain_tps']:>11.1f} | "
              f"{r['first_tps']:>10.1f} {r['first_tps'] / r['plain_tps']:>6.2f}x {r['first_mal']:>5.2f} | "
              f"{r['again_tps']:>10.1f} {r['again_tps'] / r['plain_tps']:>6.2f}x {r['again_mal']:>5.2f} | "
              f"{'yes' if r['identical'] else 'NO':>9}")
    print("MAL: mean acceptance length, the tokens each verify step kept. 'asked again': the same prompt as a new "
          "request,\nonce the first has finished.")
    print("\nfirst lines of each speculative answer:")
    for r in rows:
        first = r["text"].strip().splitlines()[:2]
        print(f"  [{r['workload']}] " + " / ".join(first))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--drafter", choices=sorted(DRAFTERS), default="suffix",
                   help="the built-in drafter the demo serves (suffix: learns from finished requests)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed plain and asked-again runs per prompt (medians); the first time is one run")
    p.set_defaults(func=run_demo)
