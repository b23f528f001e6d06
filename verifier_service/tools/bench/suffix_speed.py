"""How fast the suffix drafter itself is: ingesting finished outputs, and one PrepareDraftTokens call.

Measured on the SDK's servicer logic in this process (what a `splitspec-drafter suffix` runs for each
call, minus the network): a global tree filled with `cached` finished outputs of `output_len` tokens,
then 16 sequences with 2,000 tokens of context each, growing by 1-4 tokens a step, drafting chains and
then (other sequences of the same kind) trees of up to 16 nodes. The text is the standard library's own
source, tokenized by the target's tokenizer; outputs are windows of it, so they overlap the way
recurring answers do. A third set of sequences copies its own context, as an agent editing a file does:
text the outputs never held, then a copy of it with a token changed every 100 (the global tree has only
short matches there, the own tree long ones). Last, what `--learned-state-file` and `--peers` cost: taking a
snapshot of what was learned (on the drafter's event loop), restoring it in a fresh drafter (before it
serves), and a fresh drafter taking it from a real server of the drafter over gRPC on loopback.
Drafters with other flags (`--suffix-variant`) are built
beside the default one and timed call by call in turn with it: timed one after another, the first
measured in a process read 3.07 ms where the next read 2.51, and the other way round in another run.
"""

from __future__ import annotations

import glob
import random
import statistics
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import drafter_pb2
from drafter_sdk.server.peers import Peers
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.serve import start_server
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.engine.model_thread import ModelThread

CORPUS_TOKENS = 300_000


@dataclass
class SuffixSpeed:
    flags: str  # the `splitspec-drafter suffix` flags of the drafter timed ("": its defaults)
    cached_outputs: int
    output_len: int
    ingest_ms_p50: float  # one finished output into the global tree (its release)
    sequences: int
    context_len: int
    prepare_ms_p50: float  # one PrepareDraftTokens for all the sequences
    prepare_ms_p90: float
    global_tree_mb: float  # the drafter's own estimate (shared_state_bytes)
    tree_nodes: int  # the same calls where the verifier verifies token trees of up to this many nodes
    tree_prepare_ms_p50: float
    tree_prepare_ms_p90: float
    copy_prepare_ms_p50: float  # chains again, for sequences copying their own context
    copy_prepare_ms_p90: float
    snapshot_mb: float  # what the learned-state file holds (save_learned)
    save_ms_p50: float  # taking it, median of three
    restore_s: float  # a fresh drafter with the same flags taking it back
    from_peer_s: float  # the same, asked of a server of the drafter (--peers): sent in pieces, then restored


def corpus(tokenizer: PreTrainedTokenizerBase, size: int = CORPUS_TOKENS) -> list[int]:
    ids: list[int] = []
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += tokenizer(f.read())["input_ids"]
        if len(ids) >= size:
            break
    return ids[:size]


def measure(tokenizer: PreTrainedTokenizerBase, variants: dict[str, dict] | None = None, cached: int = 10_000,
            output_len: int = 500, sequences: int = 16, context_len: int = 2000, steps: int = 100, draft_len: int = 8,
            tree_nodes: int = 16, corpus_tokens: int = CORPUS_TOKENS) -> list[SuffixSpeed]:
    """The figures of one SuffixDrafter per variant (its `splitspec-drafter suffix` flags -> its keyword
    arguments; default: the defaults alone), in that order. The variants are fed the same calls, one after
    another in an order that reverses every call, so that a busy machine's drift falls on each alike."""
    variants = {"": {}} if variants is None else variants
    copied_len = (context_len + 4 * steps + 1) // 2  # the passage each copying sequence holds, then copies
    text = corpus(tokenizer, corpus_tokens + 4 * copied_len)
    text, novel = text[:corpus_tokens], text[corpus_tokens:]
    rng = random.Random(0)
    drafters = [SuffixDrafter(**kwargs) for kwargs in variants.values()]
    servicers = [DrafterServicer(drafter, SequenceStore()) for drafter in drafters]
    for servicer in servicers:
        servicer.load()

    def window(n: int) -> list[int]:
        start = rng.randrange(len(text) - n)
        return text[start:start + n]

    def in_turn(call: Callable[[DrafterServicer], object], turn: int, seconds: list[list[float]]) -> None:
        """Make the call on every servicer, forwards on even turns and backwards on odd ones, adding the
        seconds each took to its list."""
        order = range(len(servicers)) if turn % 2 == 0 else range(len(servicers) - 1, -1, -1)
        for k in order:
            started = time.perf_counter()
            call(servicers[k])
            seconds[k].append(time.perf_counter() - started)

    ingest: list[list[float]] = [[] for _ in servicers]
    for i in range(cached):
        prompt, output = window(20), window(output_len)
        sync = drafter_pb2.PrepareDraftTokensRequest(verifier_id="bench", sequences=[
            drafter_pb2.DraftSequence(request_id=f"done-{i}", new_tokens=prompt + output, prompt_len=len(prompt))])
        release = drafter_pb2.ReleaseRequestsRequest(verifier_id="bench", request_ids=[f"done-{i}"],
                                                     reasons=[drafter_pb2.RELEASE_REASON_FINISHED])
        for servicer in servicers:
            servicer.prepare(sync)
        in_turn(lambda servicer: servicer.release(release), i, ingest)
    contexts = [window(context_len + 4 * steps) for _ in range(sequences)]

    def copying() -> list[int]:
        start = rng.randrange(len(novel) - copied_len)
        passage = novel[start:start + copied_len]
        edited = [rng.choice(novel) if i % 100 == 50 else t for i, t in enumerate(passage)]
        return passage + edited

    def prepare_times(name: str, nodes: int, contexts: list[list[int]]) -> list[list[float]]:
        """Each servicer's seconds for each call after the first (which builds every sequence's tree from its whole
        context), for sequences growing by 1-4 tokens a step, ascending."""
        lengths = [context_len] * sequences
        held = [0] * sequences
        times: list[list[float]] = [[] for _ in servicers]
        for step in range(steps + 1):
            request = drafter_pb2.PrepareDraftTokensRequest(verifier_id="bench", sequences=[
                drafter_pb2.DraftSequence(request_id=f"{name}-{j}", context_len=held[j],
                                          new_tokens=contexts[j][held[j]:lengths[j]], prompt_len=100,
                                          draft_len=draft_len, max_draft_nodes=nodes)
                for j in range(sequences)])
            if step:
                in_turn(lambda servicer: servicer.prepare(request), step, times)
            else:
                for servicer in servicers:
                    servicer.prepare(request)
            held = list(lengths)
            lengths = [n + rng.randint(1, 4) for n in lengths]
        return [sorted(t) for t in times]

    chains, trees = prepare_times("chain", 0, contexts), prepare_times("tree", tree_nodes, contexts)
    copies = prepare_times("copy", 0, [copying() for _ in range(sequences)])
    snapshots = [(*_snapshot(drafter, kwargs), _from_a_peer(drafter, kwargs))
                 for drafter, kwargs in zip(drafters, variants.values())]
    return [SuffixSpeed(flags, cached, output_len, statistics.median(ingested) * 1000, sequences, context_len,
                        *_p50_p90_ms(chain), drafter.shared_state_bytes() / 2**20, tree_nodes, *_p50_p90_ms(tree),
                        *_p50_p90_ms(copy), *snapshot)
            for flags, drafter, ingested, chain, tree, copy, snapshot in zip(variants, drafters, ingest, chains, trees,
                                                                             copies, snapshots)]


def _snapshot(drafter: SuffixDrafter, kwargs: dict) -> tuple[float, float, float]:
    """(MiB of `drafter`'s learned state, ms to take it (median of three), s for a fresh drafter to restore it)."""
    saves = []
    for _ in range(3):
        started = time.perf_counter()
        data = drafter.save_learned()
        saves.append(time.perf_counter() - started)
    fresh = SuffixDrafter(**kwargs)
    started = time.perf_counter()
    fresh.restore_learned(data)
    return len(data) / 2**20, statistics.median(saves) * 1000, time.perf_counter() - started


def _from_a_peer(drafter: SuffixDrafter, kwargs: dict) -> float:
    """Seconds for a fresh drafter to take `drafter`'s state from a server of it on loopback, as a starting
    replica does (drafter_sdk/server/peers.py): the server answers on an event loop of its own thread."""
    serving = ModelThread("peer")  # an event loop on a thread of its own; no model runs here
    # Its own peer is nobody (port 1): it keeps what it holds and shares it.
    running = serving.run_coroutine(start_server(drafter, host="127.0.0.1", port=0,
                                                 peers=Peers("ipv4:127.0.0.1:1"))).result()
    try:
        serving.run_coroutine(running.wait_loaded()).result()
        fresh = DrafterServicer(SuffixDrafter(**kwargs))
        started = time.perf_counter()
        if not Peers(f"ipv4:127.0.0.1:{running.port}").restore(fresh.restore_learned, fresh.drafter.name):
            raise RuntimeError("the fresh drafter took nothing from its peer")
        return time.perf_counter() - started
    finally:
        serving.run_coroutine(running.stop(0)).result()
        serving.shutdown()


def _p50_p90_ms(ascending: list[float]) -> tuple[float, float]:
    """The median and the 90th percentile of seconds sorted ascending, in milliseconds."""
    return statistics.median(ascending) * 1000, ascending[int(0.9 * len(ascending))] * 1000
