"""Greedy exactness: with speculation (in-process NGRAM, remote SDK n-gram drafter over
gRPC, an oracle drafter with random corruptions), alone or in a mixed batch, the
output is token for token plain decoding's and transformers' generate()'s."""

from __future__ import annotations

import asyncio
import functools
import random

from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    OracleDrafter,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
)

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:12]] + [repetitive_prompt(s) for s in range(300, 316)] + [
    tiny_tokenizer()(text)["input_ids"] for text in (
        "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
        "for i in range(10):\n    print(i * i)\n")] + [[7], [3, 3, 3, 3, 3, 3, 3, 3]]
LENGTHS = [40] * 12 + [random.Random(i).randint(6, 28) for i in range(len(PROMPTS) - 12)]
assert len(PROMPTS) == 33


def references(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [list(cached_reference(tuple(p), n)) for p, n in zip(prompts, lengths)]


async def generate_all(v, prompts, lengths, **fields) -> list[verifier_pb2.GenerateResponse]:  # noqa: ANN001
    """All requests decoded in one batch (see run_together)."""
    return await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n, **fields), timeout=WAIT_S)
                                  for p, n in zip(prompts, lengths)])


def check_exact(responses, refs) -> None:  # noqa: ANN001
    for i, (r, ref) in enumerate(zip(responses, refs)):
        assert list(r.output.token_ids) == ref, f"prompt {i}: {list(r.output.token_ids)} != generate() {ref}"
        assert r.output.finish_reason == verifier_pb2.FINISH_REASON_LENGTH


def test_plain_and_ngram_decoding_equal_generate_on_many_prompts() -> None:
    refs = references(PROMPTS, LENGTHS)

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            check_exact(await generate_all(v, PROMPTS, LENGTHS), refs)
        # In-process NGRAM, all prompts in one batch.
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            responses = await generate_all(v, PROMPTS, LENGTHS)
            check_exact(responses, refs)
            assert sum(r.output.stats.num_accepted_tokens for r in responses) > 10, "n-gram drafts were never accepted"
            assert sum(r.output.stats.num_draft_tokens - r.output.stats.num_accepted_tokens for r in responses) > 0
        # The SDK's n-gram drafter as a remote service over real gRPC.
        async with serve_drafter(NgramDrafter(max_draft_len=4)) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                responses = await generate_all(v, PROMPTS, LENGTHS)
                check_exact(responses, refs)
                assert sum(r.output.stats.num_accepted_tokens for r in responses) > 10
                assert sum(r.output.stats.num_drafter_failures for r in responses) == 0
                assert engine_of(v).drafter.stats.failures == 0

    asyncio.run(main())


def test_oracle_drafter_accepts_and_rejects_at_every_position() -> None:
    """Drafts are the true continuation with random corruptions, so every draft
    position sees acceptances and first rejections; the verifier must keep exactly
    the matching prefix (checked through the feedback of the next call) and stay exact."""
    k = 5
    prompts, lengths = PROMPTS[:12], [24] * 12
    refs = references(prompts, lengths)
    oracle = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, corrupt=0.2, seed=3)

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", k, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                responses = await generate_all(v, prompts, lengths)
        check_exact(responses, refs)
        assert not oracle.feedback_errors, oracle.feedback_errors[:5]
        assert set(oracle.accepted_at) == set(range(k)), "some draft position never accepted"
        assert set(oracle.rejected_at) == set(range(k)), "some draft position never rejected"
        per_pos = [sum(r.output.stats.num_accepted_tokens_per_pos[j] for r in responses if
                       len(r.output.stats.num_accepted_tokens_per_pos) > j) for j in range(k)]
        assert per_pos == [oracle.accepted_at.count(j) for j in range(k)]
        assert sum(r.output.stats.num_accepted_tokens for r in responses) == len(oracle.accepted_at)
        for r in responses:  # mean acceptance length as the field reports it
            s = r.output.stats
            assert s.num_drafts and abs(s.mean_acceptance_length - (1 + s.num_accepted_tokens / s.num_drafts)) < 1e-9

    asyncio.run(main())


def test_mixed_batch_with_speculation_equals_each_request_alone_without() -> None:
    """Mixed prompt lengths, output lengths and per-request draft caps (0 and
    disable included), decoded together with an oracle drafter, equal each request
    decoded alone on a plain server (and generate())."""
    prompts = [PROMPTS[i] for i in (0, 3, 28, 29, 30, 31, 32, 5, 9)]
    lengths = [30, 3, 17, 1, 25, 9, 22, 12, 2]
    caps = [None, 1, 0, 5, 2, None, 3, None, 4]
    refs = references(prompts, lengths)
    oracle = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, corrupt=0.25, seed=11)

    def request(i: int) -> verifier_pb2.GenerateRequest:
        spec = verifier_pb2.SpeculationOverrides(disable=(i == 7))
        if caps[i] is not None:
            spec.max_draft_len = caps[i]
        return token_request(prompts[i], lengths[i], speculation=spec)

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            alone = [await v.stub.Generate(token_request(p, n), timeout=WAIT_S) for p, n in zip(prompts, lengths)]
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 5, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                together = await run_together(v, [functools.partial(v.stub.Generate, request(i), timeout=WAIT_S)
                                                  for i in range(len(prompts))])
        for i, (a, b, ref) in enumerate(zip(alone, together, refs)):
            assert list(a.output.token_ids) == ref, f"plain decoding of prompt {i} differs from generate()"
            assert list(b.output.token_ids) == list(a.output.token_ids), f"request {i} differs inside the batch"
            assert b.output.text == a.output.text
        assert together[2].output.stats.num_draft_tokens == 0 and together[7].output.stats.num_draft_tokens == 0
        for cap, r in zip(caps, together):
            if cap:
                assert r.output.stats.num_draft_tokens <= cap * r.output.stats.num_drafts
        assert sum(r.output.stats.num_accepted_tokens for r in together) > 0
        assert not oracle.feedback_errors, oracle.feedback_errors[:5]

    asyncio.run(main())
