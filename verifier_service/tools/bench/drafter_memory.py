"""`splitspec bench-drafter-memory`: a drafter's state per held token, and floods against its bounds.

Four measurements, all without a model (drafters need no torch):

1. accounting: the bytes the SDK accounts per held token (history + the drafter's
   `state_bytes` + `shared_state_bytes`) for each built-in drafter setting, in-process;
2. unbounded: a real `splitspec-drafter ngram --max-state-mib 0` receives `--unbounded-calls`
   calls of `--sequences` new random sequences of `--tokens` tokens; its RSS growth divided by
   the tokens it holds is the real cost of a held token;
3. flood: the same flood, `--calls` calls, against `--max-state-mib` beside a well-behaved
   verifier (its own namespace, a few repetitive sequences advancing a few tokens per call).
   Reported: whether every call was answered OK, the peak RSS (VmHWM) against the budget, the
   evictions, and the well-behaved verifier's resyncs and accepted draft tokens per step, flood
   vs alone;
4. learned: a real `splitspec-drafter suffix` receives `--learned-calls` calls, each syncing
   `--learned-outputs` new random outputs of `--tokens` tokens and releasing them as finished, so
   that all of them enter its global tree; once under `--max-cached-mib` and once with a cap no flood
   reaches (a count alone bounds vLLM's cache). Reported: the peak RSS against the cap, and the
   global tree's bytes by the drafter's own metric.

The issue's flood at full scale (64 x 4,000 tokens, 60 calls, the default 1 GiB budget):

    splitspec bench-drafter-memory --calls 60 --max-state-mib 1024

Linux only (RSS from /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.tools.local_services import LocalService, free_port, script

MIB = 1 << 20
# Built-in drafter settings whose accounting is reported (CLI flags of `splitspec-drafter ngram`).
SETTINGS = {
    "ngram (defaults)": {},
    "ngram --no-is-use-oldest": {"is_use_oldest": False},
    "ngram --no-is-keep-all": {"is_keep_all": False},
    "ngram --is-public-pool": {"is_public_pool": True},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=int, default=64, help="new sequences per flood call")
    p.add_argument("--tokens", type=int, default=4000, help="tokens per flood sequence")
    p.add_argument("--vocab", type=int, default=32000, help="flood token ids are uniform below this")
    p.add_argument("--unbounded-calls", type=int, default=6, help="flood calls without a budget (0: skip)")
    p.add_argument("--calls", type=int, default=20, help="flood calls against the budget (0: skip)")
    p.add_argument("--max-state-mib", type=float, default=64.0, help="the drafter's budget in the flood")
    p.add_argument("--good-sequences", type=int, default=4, help="sequences of the well-behaved verifier")
    p.add_argument("--learned-calls", type=int, default=16,
                   help="calls finishing outputs into a suffix drafter's global tree (0: skip)")
    p.add_argument("--learned-outputs", type=int, default=16, help="outputs finished per learned call")
    p.add_argument("--max-cached-mib", type=float, default=32.0, help="the suffix drafter's cap in the learned flood")
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=main)


@dataclass
class Accounting:
    setting: str
    bytes_per_token: float


@dataclass
class FloodResult:
    max_state_mib: float
    calls: int
    calls_ok: int
    sent_tokens: int
    seconds: float
    baseline_rss_mib: float
    peak_rss_mib: float
    final_rss_mib: float
    held_tokens: int
    state_mib: float
    rss_bytes_per_held_token: float
    evictions: dict[str, float]
    good_resyncs: int
    good_accepted_per_step: float
    good_alone_accepted_per_step: float


@dataclass
class LearnedFlood:
    max_cached_mib: float  # the suffix drafter's --max-cached-mib
    calls: int
    calls_ok: int
    learned_tokens: int  # output tokens finished into the global tree
    seconds: float
    baseline_rss_mib: float
    peak_rss_mib: float
    final_rss_mib: float
    cached_mib: float  # splitspec_drafter_shared_state_bytes at the end


# A cap no flood here reaches: the global tree bounded by its count of outputs alone, as vLLM's.
NO_CAP_MIB = 1 << 20


def accounting(settings: dict[str, dict], sequences: int, tokens: int, vocab: int) -> list[Accounting]:
    """Bytes the SDK accounts per held token, for each drafter setting, after `sequences` random histories."""
    rng, out = random.Random(0), []
    histories = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(sequences)]
    for name, knobs in settings.items():
        servicer = DrafterServicer(NgramDrafter(**knobs), SequenceStore(max_state_bytes=None))
        servicer.load()
        servicer.prepare(flood_request("acct", 0, histories))
        total = servicer.store.total_bytes + servicer.drafter.shared_state_bytes()
        out.append(Accounting(name, total / servicer.store.held_tokens))
    return out


def flood_request(verifier_id: str, call: int, histories: list[list[int]]) -> drafter_pb2.PrepareDraftTokensRequest:
    return drafter_pb2.PrepareDraftTokensRequest(verifier_id=verifier_id, sequences=[
        drafter_pb2.DraftSequence(request_id=f"{call}-{i}", context_len=0, new_tokens=h, prompt_len=len(h),
                                  draft_len=8) for i, h in enumerate(histories)])


class GoodVerifier:
    """A few sequences of a repeating text, advancing 4 tokens per step, as a verifier's would."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterServiceStub, name: str, sequences: int) -> None:
        rng = random.Random(1)
        self.stub, self.name = stub, name
        self.patterns = [[rng.randrange(1000) for _ in range(40)] for _ in range(sequences)]
        self.lengths = [200] * sequences
        self.sent = [0] * sequences  # committed tokens the drafter holds (after a resync: 0)
        self.resyncs = self.steps = self.accepted = 0

    def token(self, i: int, pos: int) -> int:
        return self.patterns[i][pos % len(self.patterns[i])]

    def step(self) -> None:
        seqs = [drafter_pb2.DraftSequence(
            request_id=str(i), context_len=self.sent[i], prompt_len=200, draft_len=8,
            new_tokens=[self.token(i, p) for p in range(self.sent[i], self.lengths[i])])
            for i in range(len(self.lengths))]
        reply = self.stub.PrepareDraftTokens(
            drafter_pb2.PrepareDraftTokensRequest(verifier_id=self.name, sequences=seqs), timeout=60)
        for i, result in enumerate(reply.results):
            if result.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED:
                self.resyncs += 1
                self.sent[i] = 0
                continue
            self.sent[i] = self.lengths[i]
            truth = [self.token(i, self.lengths[i] + j) for j in range(len(result.draft_tokens))]
            accepted = next((j for j, (d, t) in enumerate(zip(result.draft_tokens, truth)) if d != t),
                            len(truth))
            self.accepted += accepted
            self.steps += 1
            self.lengths[i] += 4

    @property
    def accepted_per_step(self) -> float:
        return self.accepted / max(1, self.steps)


@contextlib.contextmanager
def drafter_process(*flags: str) -> Iterator[tuple[drafter_pb2_grpc.DrafterServiceStub, int, int]]:
    """A real `splitspec-drafter` started with these flags, serving metrics: (its stub, its pid, its metrics port)."""
    metrics_port = free_port()
    drafter = LocalService([script("splitspec-drafter"), *flags, "--metrics-port", str(metrics_port),
                            "--log-level", "WARNING"], name="drafter")
    with drafter, grpc.insecure_channel(drafter.address, options=[
            ("grpc.max_send_message_length", 64 * MIB)]) as channel:
        yield drafter_pb2_grpc.DrafterServiceStub(channel), drafter.process.pid, metrics_port


def flood(args: argparse.Namespace, max_state_mib: float, calls: int, with_good: bool) -> FloodResult:
    rng = random.Random(2)
    with drafter_process("ngram", "--max-state-mib", str(max_state_mib)) as (stub, pid, metrics_port):
        good_alone = good = None
        if with_good:
            good_alone = GoodVerifier(stub, "good-alone", args.good_sequences)
            for _ in range(calls):
                good_alone.step()
            stub.ReleaseRequests(drafter_pb2.ReleaseRequestsRequest(
                verifier_id="good-alone", request_ids=[str(i) for i in range(args.good_sequences)]))
            good = GoodVerifier(stub, "good", args.good_sequences)
        baseline = rss(pid)["VmRSS"]
        ok, start = 0, time.perf_counter()
        for call in range(calls):
            histories = [[rng.randrange(args.vocab) for _ in range(args.tokens)] for _ in range(args.sequences)]
            try:
                reply = stub.PrepareDraftTokens(flood_request("flood", call, histories), timeout=120)
                ok += all(r.status == drafter_pb2.DRAFT_STATUS_OK for r in reply.results)
            except grpc.RpcError as err:
                print(f"flood call {call}: {err.code().name} {err.details()}")
            if good is not None:
                good.step()
        seconds = time.perf_counter() - start
        memory, samples = rss(pid), scrape(metrics_port)
    held = int(samples.get(("splitspec_drafter_held_tokens", ()), 0))
    state = sum(v for (name, _), v in samples.items() if name == "splitspec_drafter_state_bytes")
    return FloodResult(
        max_state_mib=max_state_mib, calls=calls, calls_ok=ok, sent_tokens=calls * args.sequences * args.tokens,
        seconds=seconds, baseline_rss_mib=baseline / MIB, peak_rss_mib=memory["VmHWM"] / MIB,
        final_rss_mib=memory["VmRSS"] / MIB, held_tokens=held, state_mib=state / MIB,
        rss_bytes_per_held_token=(memory["VmRSS"] - baseline) / max(1, held),
        evictions={labels[0][1]: v for (name, labels), v in samples.items()
                   if name == "splitspec_drafter_state_evictions_total"},
        good_resyncs=good.resyncs if good else 0, good_accepted_per_step=good.accepted_per_step if good else 0.0,
        good_alone_accepted_per_step=good_alone.accepted_per_step if good_alone else 0.0)


def learned_flood(args: argparse.Namespace, max_cached_mib: float) -> LearnedFlood:
    """Finish `--learned-outputs` random outputs per call into a real suffix drafter's global tree."""
    rng, prompt_len = random.Random(3), 16
    with drafter_process("suffix", "--max-cached-mib", str(max_cached_mib), "--max-cached-requests",
                         str(args.learned_calls * args.learned_outputs), "--max-state-mib", "0"
                         ) as (stub, pid, metrics_port):
        baseline = rss(pid)["VmRSS"]
        ok, start = 0, time.perf_counter()
        for call in range(args.learned_calls):
            ids = [f"{call}-{i}" for i in range(args.learned_outputs)]
            sync = drafter_pb2.PrepareDraftTokensRequest(verifier_id="learned", sequences=[
                drafter_pb2.DraftSequence(request_id=rid, new_tokens=[rng.randrange(args.vocab) for _ in range(
                    prompt_len + args.tokens)], prompt_len=prompt_len) for rid in ids])
            release = drafter_pb2.ReleaseRequestsRequest(verifier_id="learned", request_ids=ids,
                                                         reasons=[drafter_pb2.RELEASE_REASON_FINISHED] * len(ids))
            try:
                stub.PrepareDraftTokens(sync, timeout=120)
                stub.ReleaseRequests(release, timeout=120)
                ok += 1
            except grpc.RpcError as err:
                print(f"learned call {call}: {err.code().name} {err.details()}")
        seconds = time.perf_counter() - start
        memory, samples = rss(pid), scrape(metrics_port)
    return LearnedFlood(
        max_cached_mib=max_cached_mib, calls=args.learned_calls, calls_ok=ok,
        learned_tokens=args.learned_calls * args.learned_outputs * args.tokens, seconds=seconds,
        baseline_rss_mib=baseline / MIB, peak_rss_mib=memory["VmHWM"] / MIB, final_rss_mib=memory["VmRSS"] / MIB,
        cached_mib=samples.get(("splitspec_drafter_shared_state_bytes", ()), 0.0) / MIB)


def rss(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def main(args: argparse.Namespace) -> int:
    print(f"# accounted state per held token ({args.sequences // 8 or 1} sequences x {args.tokens} random tokens)")
    acct = accounting(SETTINGS, max(1, args.sequences // 8), args.tokens, args.vocab)
    for a in acct:
        print(f"{a.setting:28s} {a.bytes_per_token:6.1f} bytes/token")
    runs = []
    if args.unbounded_calls:
        runs.append(flood(args, 0, args.unbounded_calls, with_good=False))
    if args.calls:
        runs.append(flood(args, args.max_state_mib, args.calls, with_good=True))
    for r in runs:
        budget = f"{r.max_state_mib:g} MiB" if r.max_state_mib else "none"
        print(f"\n# flood: {r.calls} calls x {args.sequences} x {args.tokens} tokens, budget {budget}")
        print(f"answered OK {r.calls_ok}/{r.calls} in {r.seconds:.1f} s; {r.sent_tokens:,} tokens sent, "
              f"{r.held_tokens:,} held, state {r.state_mib:.1f} MiB")
        print(f"RSS {r.baseline_rss_mib:.0f} MiB before, peak {r.peak_rss_mib:.0f} MiB, "
              f"{r.final_rss_mib:.0f} MiB after: {r.rss_bytes_per_held_token:.1f} bytes per held token")
        print(f"evictions {r.evictions}")
        if r.max_state_mib:
            print(f"well-behaved verifier: {r.good_resyncs} resyncs, accepted {r.good_accepted_per_step:.2f} "
                  f"draft tokens/step beside the flood vs {r.good_alone_accepted_per_step:.2f} alone")
    learned = [learned_flood(args, cap) for cap in (args.max_cached_mib, NO_CAP_MIB)] if args.learned_calls else []
    for r in learned:
        cap = f"--max-cached-mib {r.max_cached_mib:g}" if r.max_cached_mib < NO_CAP_MIB else "no byte cap"
        print(f"\n# learned: {r.calls} calls x {args.learned_outputs} finished outputs x {args.tokens} tokens "
              f"into the suffix drafter's global tree, {cap}")
        print(f"answered OK {r.calls_ok}/{r.calls} in {r.seconds:.1f} s; {r.learned_tokens:,} tokens learned, "
              f"global tree {r.cached_mib:.1f} MiB")
        print(f"RSS {r.baseline_rss_mib:.0f} MiB before, peak {r.peak_rss_mib:.0f} MiB, "
              f"{r.final_rss_mib:.0f} MiB after")
    if args.json:
        Path(args.json).write_text(json.dumps({"accounting": [asdict(a) for a in acct],
                                               "floods": [asdict(r) for r in runs],
                                               "learned": [asdict(r) for r in learned]}, indent=2))
    return 0 if all(r.calls_ok == r.calls for r in [*runs, *learned]) else 1
