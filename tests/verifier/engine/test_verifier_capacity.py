"""Capacity: the KV memory budget decides how many sequences run, admission is
bounded by a queue (RESOURCE_EXHAUSTED past it), and requests that cannot fit the
context are INVALID_ARGUMENT, all with clear messages."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest
import torch
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    EngineSpy,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    shared_model,
    wait_until,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.model.kv_cache import KVCacheShape

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:6]]


def budget_gb(slots: float, max_model_len: int, max_draft_len: int) -> float:
    cfg = shared_model().config
    shape = KVCacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                         1, max_model_len + max_draft_len + 1)
    return slots * shape.bytes_per_slot(torch.float32) / 2**30


def test_kv_budget_bounds_running_sequences() -> None:
    lengths = [20, 14, 26, 9, 17, 22]
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(PROMPTS, lengths)]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_model_len=128,
                                max_num_seqs=16, kv_cache_memory_gb=budget_gb(3.5, 128, 4)) as v:
            info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.max_num_seqs == 3 and info.max_model_len == 128
            engine = engine_of(v)
            spy = EngineSpy(engine)
            responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
                                               for p, n in zip(PROMPTS, lengths)], spy)
        for r, ref in zip(responses, refs):
            assert list(r.output.token_ids) == ref
        rows = [rows for s in spy.steps for rows, _, _ in s.forwards]
        assert max(rows) == 3, "the budget's 3 slots were not all used, or exceeded"

    asyncio.run(main())


def test_kv_budget_too_small_for_one_sequence_is_refused_at_start() -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model(), max_model_len=128,
                                kv_cache_memory_gb=budget_gb(0.5, 128, 0)):
            pass

    with pytest.raises(ValueError, match=r"--kv-cache-memory-gb .* too small: one sequence of 128 tokens"):
        asyncio.run(main())


def test_queue_limit_refuses_with_resource_exhausted_and_recovers() -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_num_seqs=2,
                                max_queue_len=1) as v:
            engine = engine_of(v)
            long = [asyncio.ensure_future(v.stub.Generate(token_request(p, 200), timeout=WAIT_S))
                    for p in PROMPTS[:2]]
            await wait_until(lambda: engine.scheduler.num_running == 2, "two running requests", *long)
            spy = EngineSpy(engine)
            spy.gate.clear()  # nothing finishes while we fill the queue
            queued = asyncio.ensure_future(v.stub.Generate(token_request(PROMPTS[2], 5), timeout=WAIT_S))
            await wait_until(lambda: engine.scheduler.num_waiting == 1, "the third request to queue", queued)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await v.stub.Generate(token_request(PROMPTS[3], 5), timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 running and 1 queued" in err.value.details() and "retry" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:  # streams too
                await v.stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
                    token_ids=verifier_pb2.TokenIds(ids=PROMPTS[3]),
                    stopping=verifier_pb2.StoppingCriteria(max_new_tokens=5))), timeout=WAIT_S).read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            spy.gate.set()
            results = await asyncio.gather(*long, queued)
            assert list(results[2].output.token_ids) == list(cached_reference(tuple(PROMPTS[2]), 5))
            r = await v.stub.Generate(token_request(PROMPTS[3], 5), timeout=WAIT_S)  # room again
            assert list(r.output.token_ids) == list(cached_reference(tuple(PROMPTS[3]), 5))

    asyncio.run(main())


def test_requests_with_a_free_slot_are_never_refused() -> None:
    """The queue limit bounds requests waiting for capacity; a burst that free
    slots can take is accepted whole, even with a queue limit of 0."""

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_num_seqs=3,
                                max_queue_len=0) as v:
            r = await v.stub.Generate(token_request(PROMPTS[0], 4), timeout=WAIT_S)
            assert len(r.output.token_ids) == 4
            burst = await asyncio.gather(*[v.stub.Generate(token_request(p, 6), timeout=WAIT_S)
                                           for p in PROMPTS[:3]])
            assert [list(b.output.token_ids) for b in burst] == [list(cached_reference(tuple(p), 6)) for p in PROMPTS[:3]]
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_num_seqs=2,
                                max_queue_len=2) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)
            spy.gate.clear()
            calls = [asyncio.ensure_future(v.stub.Generate(token_request(p, 6), timeout=WAIT_S)) for p in PROMPTS[:4]]
            await wait_until(lambda: engine.scheduler.num_waiting + engine.scheduler.num_running == 4,
                             "four requests in the engine", *calls)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await v.stub.Generate(token_request(PROMPTS[4], 6), timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            spy.gate.set()
            assert all(len(r.output.token_ids) == 6 for r in await asyncio.gather(*calls))

    asyncio.run(main())


def test_context_limits_are_invalid_argument_with_clear_messages() -> None:
    prompt = (PROMPTS[5] * 3)[:24]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_model_len=40) as v:
            gen = v.stub.Generate
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gen(token_request(prompt, 17), timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == ("prompt (24 tokens) plus max_new_tokens (17) exceeds the context of "
                                           "40 tokens; at most 16 new tokens fit")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gen(token_request(prompt * 2, 1), timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "48 tokens; the context is 40 tokens" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gen(token_request(prompt, 0), timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in err.value.details()
            # Exactly filling the context works, speculation included, and stays exact.
            r = await gen(token_request(prompt, 16), timeout=WAIT_S)
            assert list(r.output.token_ids) == list(cached_reference(tuple(prompt), 16))
            assert r.output.finish_reason == verifier_pb2.FINISH_REASON_LENGTH
            # Unset max_new_tokens: whatever room is left.
            r = await gen(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=prompt))), timeout=WAIT_S)
            assert len(r.output.token_ids) == 16

    asyncio.run(main())
