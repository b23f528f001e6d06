"""Chunked prefill: with any step token budget, long prompts prefilled over several steps beside
running decode and verify rows give exactly plain decoding's tokens; a stream cancelled
mid-prefill frees its slot and leaves its neighbours exact. The default budget prices a late
prompt token's attention, so a long prompt's late chunks are smaller."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch
from test_engine_step import CharTokenizer
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
from verifier_service.builder import (
    LONG_CONTEXT,
    MAX_DEFAULT_BATCHED_TOKENS,
    StepBudget,
    batched_tokens,
    calibrate,
    make_runner,
    token_seconds,
)
from verifier_service.engine.detokenizer import Detokenizer
from verifier_service.engine.sampler import SamplingParams
from verifier_service.engine.scheduler import FLAT, PromptTokenCost, Scheduler
from verifier_service.engine.sequence import Sequence, StoppingParams
from verifier_service.model.cuda_graphs import StepGraphs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.step_costs import CONTEXT_LEN, CostCurve
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.policy import SpecState, SpeculationParams, SpeculationPolicy


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


def prefill_beside_a_stream(cost: PromptTokenCost, prompt_len: int, budget: int = 41) -> list[tuple[int, int]]:
    """(context, chunk) of each step that prefills a `prompt_len`-token prompt while one sequence
    decodes, at the scheduler alone."""
    kv = KVCache(KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=2, num_slots=2, capacity=prompt_len + 64),
                 torch.float32, torch.device("cpu"))
    scheduler = Scheduler(kv, SpeculationPolicy(max_draft_len=0), max_num_seqs=2, max_queue_len=2,
                          max_model_len=prompt_len + 32, max_num_batched_tokens=budget,
                          max_idle_batched_tokens=prompt_len + 32, prompt_token_cost=cost)

    def sequence(name: str, prompt: list[int], max_new_tokens: int) -> Sequence:
        return Sequence(request_id=name, prompt_ids=prompt, sampling=SamplingParams(),
                        stopping=StoppingParams(max_new_tokens=max_new_tokens),
                        detokenizer=Detokenizer(CharTokenizer()), spec=SpecState(SpeculationParams()))

    scheduler.add(sequence("stream", [1, 2, 3], 10_000))
    plan = scheduler.schedule()  # nothing decodes yet: the idle budget, and FLAT
    scheduler.update(plan, [[4]])
    long = sequence("long", [5] * prompt_len, 1)
    scheduler.add(long)
    steps = []
    while long.prefilling:
        plan = scheduler.schedule()
        assert plan.prefills == [long] and len(plan.decodes) == 1
        steps.append((long.num_prefilled, plan.chunks[0]))
        scheduler.update(plan, [[6] if plan.finishing[0] else [], [7]])
    assert sum(n for _, n in steps) == prompt_len
    return steps


def test_late_chunks_of_a_long_prompt_are_smaller_by_the_priced_attention() -> None:
    cost = PromptTokenCost(per_key=0.001, free_keys=256)
    assert cost(0) == cost(256) == 1.0 and cost(1256) == pytest.approx(2.0)
    steps = prefill_beside_a_stream(cost, 2000)
    for context, chunk in steps[:-1]:  # every step but the last is full: within the 40 tokens the stream leaves
        assert chunk * cost(context) <= 40 < (chunk + 1) * cost(context)
    assert steps[0] == (0, 40) and steps[-2][1] < 16  # 40 / 2.6 tokens at about 1,850 cached ones
    # Priced flat (a budget given in tokens, as vLLM's), every chunk is the 40 tokens left.
    assert {n for _, n in prefill_beside_a_stream(FLAT, 2000)[:-1]} == {40}


def test_a_prompt_priced_above_the_budget_still_moves_a_token_a_step() -> None:
    steps = prefill_beside_a_stream(PromptTokenCost(per_key=1.0, free_keys=0), 50, budget=17)
    assert steps[0] == (0, 16) and {n for _, n in steps[1:]} == {1}


def test_token_seconds_is_the_curves_slope_at_the_budget_never_flatter_than_its_average() -> None:
    curve = CostCurve(((1, 1.0), (32, 1.5), (64, 3.0)))
    assert token_seconds(curve, 64, 0.01) == pytest.approx(0.01 * 1.5 / 32)  # the upper half's slope
    flat_top = CostCurve(((1, 1.0), (32, 2.5), (64, 2.5)))
    assert token_seconds(flat_top, 64, 0.01) == pytest.approx(0.01 * 1.5 / 63)  # the whole budget's


def test_the_default_budget_prices_prompt_tokens_from_a_long_context_forward() -> None:
    """On the tiny model, whose attention is too cheap to time reliably: the default budget is priced
    from a chunk timed after a long context; a budget given in tokens stays flat."""
    settings = ServerSettings(max_model_len=LONG_CONTEXT + 64, max_num_seqs=2, timing_cache="off")
    runner = make_runner(shared_model(), settings, settings.max_model_len)
    try:
        _, budget = calibrate(runner, settings, settings.max_model_len)
        assert budget.prompt_token_cost.free_keys == CONTEXT_LEN  # priced (FLAT frees none)
        assert budget.prompt_token_cost.per_key >= 0.0
        given = ServerSettings(max_model_len=LONG_CONTEXT + 64, max_num_seqs=2, timing_cache="off",
                               max_num_batched_tokens=64)
        assert calibrate(runner, given, given.max_model_len)[1].prompt_token_cost == FLAT
    finally:
        runner.close()


def test_with_cuda_graphs_the_default_budget_is_the_graphs_tokens_in_every_step() -> None:
    """A step of up to --cuda-graph-max-tokens replays as graphs, a chunk beside decode rows included,
    where a larger one would run eagerly at the host's pace: so that is every step's budget, idle or not
    (the graphs without capture here)."""
    settings = ServerSettings(max_model_len=LONG_CONTEXT + 64, max_num_seqs=2, timing_cache="off",
                              cuda_graph_max_tokens=256)
    runner = make_runner(shared_model(), settings, settings.max_model_len)
    try:
        eager = calibrate(runner, settings, settings.max_model_len)[1]
        runner.graphs = StepGraphs(runner._run_body, runner.kv_cache, settings.cuda_graph_max_tokens, capture=False)
        graphed = calibrate(runner, settings, settings.max_model_len)[1]
        # Eagerly, a step where no sequence decodes prefills up to MAX_DEFAULT_BATCHED_TOKENS (its budget while
        # sequences decode comes from the timings, which a busy machine can flatten to that too).
        assert eager.idle == MAX_DEFAULT_BATCHED_TOKENS
        assert graphed == StepBudget(256)
    finally:
        runner.close()
