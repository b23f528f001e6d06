"""`splitspec bench-replicas`: what telling every drafter replica of each finished request is worth.

Two `splitspec-drafter suffix` replicas behind one target (an `ipv4:` list of their addresses, as a
headless Service's name resolves to its pods), in two setups side by side, each with replicas of its
own: the verifier tells every replica of each finished request (the default), or only the replica
that served it (`--no-share-finished-with-replicas`). A verifier behind both replicas answers the
recurring workload's first round (its draft stream stays on one replica); the same questions asked
again then go to verifiers that reach one replica each, alternately, as requests whose streams land
on another replica would. Then a third replica joins the first setup, as a scale-out's would, twice:
one taking what its peers learned as it starts (`--peers`), one starting cold; the questions are asked
again through each. Prints, per setup and replica, the later rounds' mean acceptance length and median
tokens/s, and whether every later answer equals the first (the same question, greedy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from verifier_service.model import loader as model_loader
from verifier_service.tools.bench import workloads
from verifier_service.tools.bench.systems import Run, VerifierSystem
from verifier_service.tools.local_services import LocalService, free_port, script, start_together

SETUPS = ("shared", "not shared")
ADDED = ("added, --peers", "added, cold")  # a third replica of the first setup, started after its rounds
# The announcements go in the background once a request has finished: time for them before round 2.
SETTLE_S = 1.0


@dataclass
class ReplicaRow:
    setup: str
    replica: int  # the replica the later round's requests reached (1 or 2; 3: the one added)
    requests: int
    mean_acceptance_length: float
    tokens_per_s: float  # median over the requests
    identical: int  # second answers equal to the first


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="recurring questions, each asked twice")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--out", default="bench-results", help="folder for replicas.json")
    p.set_defaults(func=main)


def _verifier(name: str, target: str, args: argparse.Namespace, *flags: str) -> LocalService:
    return LocalService([script("splitspec-verifier"), "--speculative-mode", "user_provided", "--drafter-target",
                         target, "--max-draft-len", str(args.max_draft_len), "--max-num-seqs", "1",
                         "--http-port", "off", "--log-level", "WARNING", *flags,
                         *(["--model", args.model] if args.model else [])], name=name, startup_timeout_s=1200)


def main(args: argparse.Namespace) -> int:
    tokenizer = model_loader.load_tokenizer(model_loader.resolve_source(args.model))
    prompts = workloads.build(["recurring"], args.prompts, tokenizer)
    first = [p for p in prompts if p.name.startswith("round 1/")]
    again = [p for p in prompts if p.name.startswith("round 2/")]
    print(f"starting 4 suffix drafter replicas and 6 verifiers ({len(first)} questions, asked twice; then 2 "
          f"replicas added, asked again) ...", flush=True)
    with contextlib.ExitStack() as stack:
        # The first setup's replicas share what they learned with a replica that joins them later.
        ports = [free_port() for _ in range(3)]
        peers = ["--peers", "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)]
        drafters = [_drafter(f"drafter-{i + 1}", *(peers if i < 2 else ())) for i in range(4)]
        for drafter, port in zip(drafters[:2], ports):  # ports[2]: the replica added later
            drafter.port = port
        start_together(stack, drafters)
        # The first verifier times its forwards alone; the others start together on those timings.
        pairs = [drafters[0:2], drafters[2:4]]
        fronts = [_verifier(f"front-{i + 1}", "ipv4:" + ",".join(d.address for d in pair), args,
                            "--share-finished-with-replicas" if setup == SETUPS[0] else
                            "--no-share-finished-with-replicas", "--timing-cache", "refresh" if i == 0 else "on")
                  for i, (setup, pair) in enumerate(zip(SETUPS, pairs))]
        start_together(stack, fronts[:1])
        pinned = start_together(stack, [fronts[1], *(_verifier(f"pinned-{d.name}", d.address, args)
                                                     for d in drafters)])[1:]
        systems = [VerifierSystem(service.name, service.address, speculate=True) for service in [*fronts, *pinned]]
        for system in systems:
            stack.callback(system.close)
        rows = []
        for s, setup in enumerate(SETUPS):
            answers = {p.name.partition("/")[2]: systems[s].run(p, args.max_new_tokens) for p in first}
            time.sleep(SETTLE_S)
            runs: dict[int, list[tuple[Run, Run]]] = {1: [], 2: []}
            for j, p in enumerate(again):  # alternately through the setup's replica 1 and replica 2
                replica = j % 2 + 1
                run = systems[2 + 2 * s + replica - 1].run(p, args.max_new_tokens)
                runs[replica].append((run, answers[p.name.partition("/")[2]]))
            rows += [_row(setup, replica, replica_runs) for replica, replica_runs in runs.items() if replica_runs]
            if setup == SETUPS[0]:
                rows += _added(stack, args, peers, ports[2], again, answers)
    _print(rows, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(f"\nwrote {out / 'replicas.json'}")
    return 0


def _drafter(name: str, *flags: str) -> LocalService:
    return LocalService([script("splitspec-drafter"), "suffix", "--log-level", "WARNING", *flags], name=name)


def _added(stack: contextlib.ExitStack, args: argparse.Namespace, peers: list[str], port: int,
           again: list[workloads.Prompt], answers: dict[str, Run]) -> list[ReplicaRow]:
    """A replica started after the first setup's rounds, taking its peers' state, and one starting cold;
    the questions asked again through each (a verifier reaching it alone)."""
    warm, cold = _drafter("drafter-added-peers", *peers), _drafter("drafter-added-cold")
    warm.port = port
    start_together(stack, [warm, cold])
    pinned = start_together(stack, [_verifier(f"pinned-{d.name}", d.address, args) for d in (warm, cold)])
    rows = []
    for setup, service in zip(ADDED, pinned):
        system = VerifierSystem(service.name, service.address, speculate=True)
        stack.callback(system.close)
        runs = [(system.run(p, args.max_new_tokens), answers[p.name.partition("/")[2]]) for p in again]
        rows.append(_row(setup, 3, runs))
    return rows


def _row(setup: str, replica: int, runs: list[tuple[Run, Run]]) -> ReplicaRow:
    return ReplicaRow(setup, replica, len(runs),
                      statistics.mean(r.stats.mean_acceptance_length for r, _ in runs),
                      statistics.median(len(r.token_ids) / r.seconds for r, _ in runs),
                      sum(r.token_ids == first.token_ids for r, first in runs))


def _print(rows: list[ReplicaRow], args: argparse.Namespace) -> None:
    print(f"\nthe same questions asked again, each through one suffix drafter replica: one of two told of "
          f"every finished request or not, or a third added later, from its peers or cold "
          f"({args.max_new_tokens} new tokens at most)")
    print(f"{'finished requests':<20} {'replica':>7} {'requests':>8} {'MAL':>6} {'tok/s':>7} {'identical':>9}")
    for r in rows:
        print(f"{r.setup:<20} {r.replica:>7} {r.requests:>8} {r.mean_acceptance_length:>6.2f} "
              f"{r.tokens_per_s:>7.1f} {r.identical:>4}/{r.requests:<4}")
