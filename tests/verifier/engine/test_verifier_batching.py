"""Continuous batching: one drafter call and one batched verify forward per decode
step over every running sequence (draft lengths differ per sequence, 0 included),
requests joining and leaving at step boundaries, rollback without copies."""

from __future__ import annotations

import asyncio
import functools

import grpc
import torch
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
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
    wait_until,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:6]]


def test_one_drafter_call_and_one_forward_per_decode_step_with_per_sequence_draft_lengths() -> None:
    lengths = [30, 24, 18, 12, 28, 20]
    caps = [None, 0, 2, None, 1, None]  # server max 4: drafts of 4, 0, 2, 4, 1 and a disabled request
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(PROMPTS, lengths)]
    oracle = OracleDrafter({tuple(p): r for p, r in zip(PROMPTS, refs)}, corrupt=0.3, seed=5)

    def request(i: int) -> verifier_pb2.GenerateRequest:
        spec = verifier_pb2.SpeculationOverrides(disable=(i == 5))
        if caps[i] is not None:
            spec.max_draft_len = caps[i]
        return token_request(PROMPTS[i], lengths[i], speculation=spec)

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                engine = engine_of(v)
                spy = EngineSpy(engine)
                responses = await run_together(v, [functools.partial(v.stub.Generate, request(i), timeout=WAIT_S)
                                                   for i in range(len(PROMPTS))], spy)
                calls = engine.drafter.stats.calls
        for r, ref in zip(responses, refs):
            assert list(r.output.token_ids) == ref
        decode_steps = [s for s in spy.steps if s.prefills == 0 and s.forwards]
        assert decode_steps
        for s in spy.steps:
            assert len(s.prepares) <= 1, "more than one PrepareDraftTokens call in a step"
            # A step that admits requests prefills them in the same forward as the decode rows.
            assert len(s.forwards) == 1
        for s in decode_steps:
            assert len(s.forwards) == 1, f"a decode step ran {len(s.forwards)} forward passes"
            rows, _, logits = s.forwards[0]
            if s.prepares:  # the one call covers every running sequence, drafting or not
                assert s.prepares[0] == rows
        # Steps where all 6 decode together: one call with every sequence, lengths 4,0,2,4,1,0.
        full = [c for c in oracle.calls if len(c.request_ids) == 6]
        assert full, "the six requests never drafted in one call"
        assert sorted(full[0].draft_lens) == [0, 0, 1, 2, 4, 4]
        # One forward verified every sequence's own number of tokens (1 + its draft).
        assert calls == len(spy.prepare_requests) == len(oracle.calls)
        assert any(s.forwards[0][0] == 6 and s.prepares == [6] for s in decode_steps)
        assert responses[1].output.stats.num_draft_tokens == 0 and responses[5].output.stats.num_draft_tokens == 0
        assert responses[0].output.stats.num_accepted_tokens > 0

    asyncio.run(main())


def test_forward_verifies_exactly_each_rows_draft() -> None:
    """The logits of a step are 1 + len(draft) per row: nothing is verified twice or skipped."""
    lengths = [20, 20, 20]
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(PROMPTS[:3], lengths)]
    oracle = OracleDrafter({tuple(p): r for p, r in zip(PROMPTS[:3], refs)}, corrupt=0.3, seed=9)

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 3, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                spy = EngineSpy(engine_of(v))
                await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
                                       for p, n in zip(PROMPTS[:3], lengths)], spy)
        drafted = iter([sum(len(d) for d in c.drafts) for c in oracle.calls])
        for s in spy.steps:
            if s.prepares:  # the decode forward is the last of the step
                rows, _, logits = s.forwards[-1]
                assert logits == rows + next(drafted)

    asyncio.run(main())


def test_new_request_joins_at_the_next_step_and_leaves_before_a_long_one() -> None:
    """A short request arriving while a long one decodes is prefilled at the next
    step boundary, decodes beside it and finishes first: it never waits for it."""
    long_prompt, short_prompt = PROMPTS[0], PROMPTS[1]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_model_len=256) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)
            finished: list[tuple[int, int]] = []  # (prompt length, steps so far)
            update = engine.scheduler.update

            def spy_update(plan, new_tokens):  # noqa: ANN001, ANN202
                done = update(plan, new_tokens)
                finished.extend((len(seq.prompt_ids), len(spy.steps)) for seq in done)
                return done

            engine.scheduler.update = spy_update
            stream = v.stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
                token_ids=verifier_pb2.TokenIds(ids=long_prompt),
                stopping=verifier_pb2.StoppingCriteria(max_new_tokens=200))), timeout=WAIT_S)
            first = await stream.read()
            assert first.output.token_ids
            spy.gate.clear()  # hold the engine while the short request arrives
            short = asyncio.ensure_future(v.stub.Generate(token_request(short_prompt, 5), timeout=WAIT_S))
            # Queued, or already admitted by a step that began before the forward blocked on the gate.
            await wait_until(lambda: engine.scheduler.num_waiting == 1 or engine.scheduler.num_running == 2,
                             "the short request to arrive")
            joined_at = len(spy.steps)
            spy.gate.set()
            response = await short
            long_tokens = list(first.output.token_ids)
            while (msg := await stream.read()) is not grpc.aio.EOF:
                long_tokens.extend(msg.output.token_ids)
        assert list(response.output.token_ids) == list(cached_reference(tuple(short_prompt), 5))
        assert long_tokens == list(cached_reference(tuple(long_prompt), 200))
        assert [p for p, _ in finished] == [len(short_prompt), len(long_prompt)]
        short_done = finished[0][1]
        # Admitted (prefill) in the step after the hold, then at most 4 decode steps.
        assert short_done - joined_at <= 1 + 4 + 1
        admit_step = next(i for i, s in enumerate(spy.steps) if i >= joined_at and s.admitted == 1)
        # The joining step prefilled the newcomer and decoded the long request in ONE forward.
        assert [rows for rows, _, _ in spy.steps[admit_step].forwards] == [2]
        assert any(s.forwards[0][0] == 2 for s in spy.steps[admit_step + 1:short_done + 1])
        assert all(s.forwards[0][0] == 1 for s in spy.steps[short_done + 1:] if s.forwards)

    asyncio.run(main())


def test_freeing_a_slot_copies_nothing() -> None:
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=3, capacity=16)
    kv = KVCache(shape, torch.float32, torch.device("cpu"))
    a, b, c = kv.allocate(), kv.allocate(), kv.allocate()
    assert (a, b, c) == (0, 1, 2) and kv.num_free_slots == 0
    kv.k.normal_()
    kv.v.normal_()
    before_k, before_v, ptr = kv.k.clone(), kv.v.clone(), kv.k.data_ptr()
    kv.free(a)  # the others keep their slots and data; the freed one is reused
    assert kv.num_free_slots == 1 and kv.num_used_slots == 2
    assert kv.k.data_ptr() == ptr and torch.equal(kv.k, before_k) and torch.equal(kv.v, before_v)
    assert kv.allocate() == a


def test_engine_rolls_back_rejected_drafts_in_place() -> None:
    """With rejections at every step, the KV storage is never reallocated or copied: a sequence's
    valid length drops back to its committed length, the next step writes over the rejected
    positions, and the slot ends up holding exactly what a fresh prefill of its tokens writes."""
    prompt, n = PROMPTS[2], 24
    ref = list(cached_reference(tuple(prompt), n))
    oracle = OracleDrafter({tuple(prompt): ref}, corrupt=0.5, seed=1)

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                engine = engine_of(v)
                kv = engine.runner.kv_cache
                ptrs = (kv.k.data_ptr(), kv.v.data_ptr())
                lengths: list[int] = []
                slots: list[tuple[int, list[int]]] = []
                update = engine.scheduler.update

                def spy(plan, new_tokens):  # noqa: ANN001, ANN202
                    done = update(plan, new_tokens)
                    for seq in plan.sequences:
                        lengths.append(seq.num_cached_tokens)
                        if not seq.finished:
                            slots.append((seq.slot, seq.all_ids[:seq.num_cached_tokens]))
                    return done

                engine.scheduler.update = spy
                r = await v.stub.Generate(token_request(prompt, n), timeout=WAIT_S)
                assert (kv.k.data_ptr(), kv.v.data_ptr()) == ptrs
                slot, cached = slots[-1]
                held_k = kv.k[:, slot, :, :len(cached)].clone()
                held_v = kv.v[:, slot, :, :len(cached)].clone()
                fresh = kv.allocate()
                try:
                    batch = ForwardBatch(cached, [fresh], [0], [len(cached)], [len(cached) - 1])
                    await asyncio.get_running_loop().run_in_executor(
                        engine._model_thread, engine.runner.forward, batch)
                    torch.testing.assert_close(held_k, kv.k[:, fresh, :, :len(cached)])
                    torch.testing.assert_close(held_v, kv.v[:, fresh, :, :len(cached)])
                finally:
                    kv.free(fresh)
        assert list(r.output.token_ids) == ref
        assert r.output.stats.num_draft_tokens > r.output.stats.num_accepted_tokens > 0
        # The valid length after each step is exactly prompt + tokens so far - 1.
        assert lengths == sorted(lengths) and lengths[0] == len(prompt)

    asyncio.run(main())
