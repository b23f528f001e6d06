"""Chunked prefill: with any step token budget, long prompts prefilled over several steps beside
running decode and verify rows give exactly plain decoding's tokens; a stream cancelled
mid-prefill frees its slot and leaves its neighbours exact."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    EngineSpy,
    OracleDrafter,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
    stream_request,
    wait_until,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.builder import batched_tokens
from verifier_service.model.step_costs import CostCurve


def long_prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 400) for _ in range(n)]


# Short prompts decode (and verify drafts) while the long ones are prefilled in chunks.
PROMPTS = [repetitive_prompt(4), long_prompt(1, 70), repetitive_prompt(65), long_prompt(2, 41), [7]]
LENGTHS = [20, 8, 16, 6, 12]


def refs() -> list[list[int]]:
    return [list(cached_reference(tuple(p), n)) for p, n in zip(PROMPTS, LENGTHS)]


async def generate_all(v, prompts, lengths, spy=None) -> list[verifier_pb2.GenerateResponse]:  # noqa: ANN001
    return await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
                                  for p, n in zip(prompts, lengths)], spy)


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13, 16, 17, 31, 64])
def test_every_chunk_size_is_exact_beside_decode_and_verify_rows(budget: int) -> None:
    """An oracle drafter with corruptions: every step mixes prompt chunks with verify rows that
    accept and reject; the first request runs alone first so later prompts join running streams."""
    expected = refs()

    async def main() -> None:
        oracle = OracleDrafter({tuple(p): r for p, r in zip(PROMPTS, expected)}, seed=budget)
        async with serve_drafter(oracle) as d:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{d.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model(), max_num_batched_tokens=budget,
                                    enable_prefix_caching=False) as v:
                spy = EngineSpy(engine_of(v))
                responses = await generate_all(v, PROMPTS, LENGTHS, spy)
                for i, (r, ref) in enumerate(zip(responses, expected)):
                    assert list(r.output.token_ids) == ref, f"budget {budget}, prompt {i}"
                    assert r.output.cached_prompt_tokens == 0
                assert sum(r.output.stats.num_accepted_tokens for r in responses) > 0
                assert oracle.rejected_at and not oracle.feedback_errors
                # The budget held: no step carried more prompt tokens than it allows (decode rows aside).
                most = max(longest for s in spy.steps for _, longest, _ in s.forwards)
                assert most <= max(budget, 5), most
                if budget < 41:  # some prompt was split over steps
                    assert any(s.prefills > s.admitted for s in spy.steps)

    asyncio.run(main())


def test_cancelled_mid_prefill_frees_its_slot_and_neighbours_stay_exact() -> None:
    victim = long_prompt(9, 200)
    expected = refs()

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model(), max_num_batched_tokens=4,
                                enable_prefix_caching=False) as v:
            engine = engine_of(v)
            others = [asyncio.ensure_future(v.stub.Generate(token_request(p, n), timeout=WAIT_S))
                      for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
            call = v.stub.GenerateStream(stream_request(victim, 10), timeout=WAIT_S)
            await wait_until(lambda: any(s.prompt_ids == victim and 0 < s.num_prefilled < len(victim)
                                         for s in engine.scheduler.running), "the long prompt to be mid-prefill")
            call.cancel()
            responses = await asyncio.gather(*others)
            for r, ref in zip(responses, expected):
                assert list(r.output.token_ids) == ref
            await wait_until(lambda: not engine.scheduler.has_work(), "the engine to be idle")
            assert engine.runner.kv_cache.num_used_slots == 0

    asyncio.run(main())


def test_default_budget_is_the_most_tokens_within_the_step_cost_target() -> None:
    # One-token step = 1.0; a step of 64 tokens costs 2x, of 128 tokens 3x (linear in between).
    curve = CostCurve(((1, 1.0), (64, 2.0), (128, 3.0)))
    assert batched_tokens(curve, 2048) == 96  # 2.5x
    assert batched_tokens(curve, 50) == 50  # never past the limit
    assert batched_tokens(CostCurve(((1, 1.0), (16, 4.0))), 2048) == 16  # at least 16
