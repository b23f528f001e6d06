"""A real verifier (tiny model) behind gRPC round_robin over two stateful SDK drafter replicas.

The Kubernetes setup of deploy/ (headless Service + dns:/// + round_robin) resolves
every replica. A verifier drafts over one PrepareDraftTokensStream, which the
channel places on one replica: that replica sees every step. Against drafters
without the stream, each step's unary PrepareDraftTokens goes to the next replica,
and overlapping deltas keep every replica in sync. Either way: drafts on every
decode step, no resyncs in steady state, output exactly plain decoding. Over the
stream, releases reach the replica that drafted too.
"""

from __future__ import annotations

import asyncio

import pytest
from tiny_model import tiny_model, tiny_tokenizer
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import MethodLog, wait_until

from drafter_sdk import DraftRequest, start_server
from drafter_sdk.drafter import Key, ReleaseReason
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2
from verifier_service.spec_decode.config import ConfigError, validate
from verifier_service.spec_decode.drafter_client import DrafterClientStats
from verifier_service.spec_decode.drafters import build_drafter_client

pytestmark = pytest.mark.timeout(120)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps. The quick brown fox",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass. Speculative",
]
MAX_NEW_TOKENS = 40


class CountingNgram(NgramDrafter):
    """The SDK's n-gram drafter; proposes the last token when the pool has nothing, so that every
    in-sync step carries a draft, and counts the sequences it drafted for (those in sync)."""

    def __init__(self) -> None:
        super().__init__(max_draft_len=4)
        self.in_sync = 0
        self.finished: list[str] = []  # request ids released as FINISHED while held here

    def on_release(self, key: Key, reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        super().on_release(key)
        if reason == ReleaseReason.FINISHED:
            self.finished.append(key[1])

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.in_sync += len(requests)
        drafts = super().prepare_draft_tokens(requests)
        return [d or list(r.tokens[-1:]) for r, d in zip(requests, drafts)]


async def generate_over_two_replicas(stream: bool) -> tuple[list[CountingNgram], DrafterClientStats]:
    """Three requests through a verifier over two replicas; every output checked against plain
    decoding, drafts on (about) every decode step, and the verifier says whether it streams. The
    drafters and the client's stats."""
    drafters = [CountingNgram(), CountingNgram()]
    interceptors = () if stream else (MethodLog(refuse_stream=True),)
    servers = [await start_server(d, host="127.0.0.1", port=0, interceptors=interceptors) for d in drafters]
    try:
        for server in servers:
            await server.wait_loaded()
        target = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        tokenizer, model = tiny_tokenizer(), tiny_model()
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
        config = spec_config("USER_PROVIDED", 4, drafter_target=f"ipv4:{target}", deadline_ms=5000)
        async with run_verifier(config, model=model, tokenizer=tokenizer) as verifier:
            client = verifier.running.runtime.drafter
            assert client.overlap_steps == 8  # the default with round_robin
            replies = await asyncio.gather(*(verifier.stub.Generate(token_request(ids, MAX_NEW_TOKENS))
                                              for ids in prompts))
            info = await verifier.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
            assert info.drafter.draft_stream is stream
            await wait_until(lambda: not client._background, "the releases")
            stats = client.stats
    finally:
        for server in servers:
            await server.stop(0)
    for ids, reply in zip(prompts, replies):
        assert list(reply.output.token_ids) == reference_greedy(model, ids, MAX_NEW_TOKENS)
    for reply in replies:
        decode_steps = reply.output.stats.num_steps - 1  # the first step is the prefill
        assert reply.output.stats.num_drafts >= decode_steps - len(drafters), reply.output.stats
    assert stats.failures == 0, stats.last_error
    return drafters, stats


def test_verifier_streams_to_one_replica_which_sees_every_step_and_every_release():
    drafters, stats = asyncio.run(generate_over_two_replicas(stream=True))
    assert sorted(d.in_sync > 0 for d in drafters) == [False, True], [d.in_sync for d in drafters]
    assert stats.resyncs == 0
    # Releases go on the stream too (capability stream-releases): the replica that holds the
    # sequences forgets each of them as FINISHED, which a learning drafter needs.
    drafting = next(d for d in drafters if d.in_sync)
    assert len(drafting.finished) == len(PROMPTS) and not drafting._requests, drafting.finished


def test_unary_calls_spread_over_round_robin_replicas_and_overlapping_deltas_keep_both_in_sync():
    drafters, stats = asyncio.run(generate_over_two_replicas(stream=False))
    assert all(d.in_sync > 0 for d in drafters), [d.in_sync for d in drafters]
    # At most one resync per replica per request (a replica whose connection came up late);
    # in practice none.
    assert stats.resyncs <= len(drafters) * len(PROMPTS)


def test_delta_overlap_steps_defaults_and_limits():
    def overlap(**user_provided: object) -> int:
        config = spec_config("USER_PROVIDED", 4, drafter_target="127.0.0.1:1")
        for name, value in user_provided.items():
            setattr(config.user_provided, name, value)
        return validate(config).user_provided.delta_overlap_steps

    assert overlap() == 8  # round_robin by default
    assert overlap(load_balancing_policy="pick_first") == 1  # one replica gets every call
    assert overlap(delta_overlap_steps=3, load_balancing_policy="pick_first") == 3
    with pytest.raises(ConfigError, match="delta_overlap_steps"):
        overlap(delta_overlap_steps=5000)
    # In-process n-gram drafting: one drafter sees every call, plain deltas.
    ngram = build_drafter_client(validate(spec_config("NGRAM", 4)), "v", vocab_size=100)
    assert ngram is not None and ngram.overlap_steps == 1
