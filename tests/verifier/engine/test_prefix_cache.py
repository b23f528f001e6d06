"""Prefix caching: hits (full, partial, at a block boundary, from a running sequence, a
multi-turn conversation) give exactly plain decoding's tokens with speculation on; the KV a
hit leaves in a slot equals a fresh prefill's; cached slots are evicted before any request
waits or is refused, and none is leaked."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    EngineSpy,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    run_at_graph_shapes,
    serve_drafter,
    shared_model,
    stream_request,
    wait_until,
)

from drafter_sdk.drafters.ngram import NgramDrafter
from verifier_service.api.cli import parser, settings_from_args
from verifier_service.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch, ModelRunner


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 400) for _ in range(n)]


def ref(prompt: list[int], n: int) -> list[int]:
    return list(cached_reference(tuple(prompt), n))


def no_leak(engine) -> None:  # noqa: ANN001
    """Every used slot is running or kept idle, and every cached block belongs to one of them."""
    cache, scheduler = engine.scheduler.prefix_cache, engine.scheduler
    assert engine.runner.kv_cache.num_used_slots == scheduler.num_running + cache.num_idle
    holders = {slot for slots in cache._holders.values() for slot in slots}
    assert holders <= set(cache._idle) | {s.slot for s in scheduler.running}


async def generate(v, prompt: list[int], n: int):  # noqa: ANN001, ANN201
    return (await v.stub.Generate(token_request(prompt, n), timeout=WAIT_S)).output


GRAPH_SHAPES = pytest.mark.parametrize("graph_shapes", [False, True], ids=["eager", "graph-shaped"])


@GRAPH_SHAPES
def test_full_partial_and_block_boundary_hits_are_exact_with_a_remote_drafter(graph_shapes: bool) -> None:
    """With graph shapes (model/cuda_graphs.py), padding has written past each slot's committed tokens
    before another request takes the slot over or its prefix is matched."""
    doc = tokens(1, 70)

    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=4)) as d:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{d.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                graphs = run_at_graph_shapes(engine_of(v)) if graph_shapes else None
                first = await generate(v, doc, 12)
                assert list(first.token_ids) == ref(doc, 12) and first.cached_prompt_tokens == 0
                # Multi-turn: the next turn extends the whole last one (its idle slot is taken over).
                turn = doc + list(first.token_ids) + tokens(2, 9)
                out = await generate(v, turn, 10)
                assert list(out.token_ids) == ref(turn, 10)
                assert out.cached_prompt_tokens == (len(doc) + 11) // BLOCK_SIZE * BLOCK_SIZE
                # Partial: the first 40 tokens shared, then a different tail -> 2 blocks reused.
                partial = doc[:40] + tokens(3, 20)
                out = await generate(v, partial, 10)
                assert list(out.token_ids) == ref(partial, 10) and out.cached_prompt_tokens == 32
                # Block boundary: a cached prompt of exactly 3 blocks keeps its last token to compute.
                boundary = doc[:48]
                out = await generate(v, boundary, 10)
                assert list(out.token_ids) == ref(boundary, 10) and out.cached_prompt_tokens == 32
                # The same prompt again: a full hit (all blocks but the one holding the last token).
                out = await generate(v, doc, 12)
                assert list(out.token_ids) == ref(doc, 12) and out.cached_prompt_tokens == 64
                # No drafter error: the drafter saw every context whole, once per request.
                assert engine_of(v).drafter.stats.failures == 0
                cache = engine_of(v).scheduler.prefix_cache
                assert cache.hits == sum([(len(doc) + 11) // 16 * 16, 32, 32, 64])
                no_leak(engine_of(v))
                assert graphs is None or graphs.replays > 10

    asyncio.run(main())


@GRAPH_SHAPES
def test_a_running_sequence_shares_its_prefix_by_copy(graph_shapes: bool) -> None:
    """With graph shapes, the copy's source slot holds padding past its committed tokens."""
    doc = tokens(4, 50)
    a, b = doc + tokens(5, 3), doc + tokens(6, 7)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model()) as v:
            engine = engine_of(v)
            graphs = run_at_graph_shapes(engine) if graph_shapes else None
            first = asyncio.ensure_future(generate(v, a, 60))
            await wait_until(lambda: any(len(s.output_ids) > 2 for s in engine.scheduler.running), "a to decode")
            second = await generate(v, b, 10)
            assert second.cached_prompt_tokens == 48 and list(second.token_ids) == ref(b, 10)
            assert list((await first).token_ids) == ref(a, 60)
            no_leak(engine)
            assert graphs is None or graphs.replays > 10

    asyncio.run(main())


def test_prefix_hit_leaves_the_kv_of_a_fresh_prefill() -> None:
    """By copy and by reference, the reused slot's keys and values equal those a fresh prefill writes."""
    model = shared_model()
    shape = KVCacheShape.for_model(model.config, num_slots=4, capacity=128)
    runner = ModelRunner(model, KVCache(shape, model.dtype, model.device), prepack_weights=False)
    kv = runner.kv_cache
    cache = PrefixCache(kv)
    doc, tail = tokens(7, 40), tokens(8, 13)
    try:
        def prefill(prompt: list[int]) -> int:
            slot, start, copy = cache.acquire(prompt)
            runner.forward(ForwardBatch(prompt[start:], [slot], [start], [len(prompt) - start],
                                        [len(prompt) - start - 1], copies=[copy] if copy else []))
            cache.extend(slot, prompt, [], len(prompt))
            return slot

        source = prefill(doc)  # holds 2 full blocks
        copied = prefill(doc + tail)  # the source is running: a copy
        assert copied != source
        cache.release(source, keep=True)
        taken = prefill(doc[:32] + tail)  # the idle source, all its blocks matched: taken over
        assert taken == source
        fresh_cache = PrefixCache(kv, enabled=False)
        for prompt, slot in ((doc + tail, copied), (doc[:32] + tail, taken)):
            fresh, _, _ = fresh_cache.acquire(prompt)
            runner.forward(ForwardBatch(prompt, [fresh], [0], [len(prompt)], [len(prompt) - 1]))
            n = len(prompt)
            torch.testing.assert_close(kv.k[:, slot, :, :n], kv.k[:, fresh, :, :n], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(kv.v[:, slot, :, :n], kv.v[:, fresh, :, :n], rtol=1e-4, atol=1e-5)
            fresh_cache.release(fresh, keep=False)
        assert cache.hits == 32 + 32
    finally:
        runner.close()


def test_cached_slots_are_evicted_before_a_request_is_refused() -> None:
    """Two slots, no queue: with every slot idle holding a cached prompt, new requests are admitted
    (evicting), never RESOURCE_EXHAUSTED."""
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model(), max_num_seqs=2,
                                max_queue_len=0) as v:
            engine = engine_of(v)
            assert engine.runner.kv_cache.num_slots == 2
            for seed in (11, 12):
                await generate(v, tokens(seed, 40), 4)
            assert engine.scheduler.prefix_cache.num_idle == 2
            prompts = [tokens(13, 40), tokens(14, 33)]
            outs = await asyncio.gather(*(generate(v, p, 6) for p in prompts))
            assert [list(o.token_ids) for o in outs] == [ref(p, 6) for p in prompts]
            assert all(o.cached_prompt_tokens == 0 for o in outs)
            no_leak(engine)

    asyncio.run(main())


def test_a_cached_prefix_evicted_while_its_request_waits() -> None:
    """doc's slot is cached; two long runs take both slots (evicting it) while doc + more waits:
    admitted later, it finds nothing cached and is still exact."""
    doc = tokens(10, 40)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model(), max_num_seqs=2) as v:
            engine = engine_of(v)
            await generate(v, doc, 6)
            await generate(v, tokens(17, 20), 4)
            assert engine.scheduler.prefix_cache.num_idle == 2
            spy = EngineSpy(engine)
            long_runs = [asyncio.ensure_future(generate(v, tokens(s, 30), 60)) for s in (14, 15)]
            await wait_until(lambda: engine.scheduler.num_running == 2, "both slots to run", *long_runs)
            spy.gate.clear()  # hold the engine inside a step while the next request arrives
            waiter = doc + tokens(16, 5)
            queued = asyncio.ensure_future(generate(v, waiter, 6))
            await wait_until(lambda: engine.scheduler.num_waiting == 1, "the request to wait", queued)
            assert engine.scheduler.prefix_cache.num_idle == 0  # doc's blocks were evicted
            spy.gate.set()
            out = await queued
            assert list(out.token_ids) == ref(waiter, 6) and out.cached_prompt_tokens == 0
            await asyncio.gather(*long_runs)
            no_leak(engine)

    asyncio.run(main())


def test_cancelled_and_disconnected_streams_leak_no_cached_slot() -> None:
    doc = tokens(20, 60)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model(), max_num_seqs=3,
                                max_num_batched_tokens=8) as v:
            engine = engine_of(v)
            for i in range(6):
                channel = grpc.aio.insecure_channel(v.address)
                stub = type(v.stub)(channel)
                call = stub.GenerateStream(stream_request(doc + tokens(30 + i, 20), 40), timeout=WAIT_S)
                if i % 2:
                    await call.read()  # decoding, then cancelled
                    call.cancel()
                else:
                    await wait_until(lambda: engine.scheduler.num_running > 0, "it to run")
                    await channel.close()  # went away, possibly mid-prefill
                await channel.close()
            await wait_until(lambda: not engine.scheduler.has_work(), "the engine to be idle")
            no_leak(engine)
            assert engine.scheduler.num_running == 0 and engine.scheduler.prefix_cache.num_idle <= 3
            out = await generate(v, doc + [5], 8)
            assert list(out.token_ids) == ref(doc + [5], 8)
            no_leak(engine)

    asyncio.run(main())


def test_every_turn_of_a_speculative_chat_reuses_the_whole_previous_turn() -> None:
    """Turn k+1's prompt is turn k's prompt, its answer and a question: all of turn k's full blocks
    are reused (not only the document's), with token trees from a remote drafter, outputs exact."""
    r = random.Random(3)
    document = [r.randrange(5, 400) for _ in range(200)]

    async def main() -> list[tuple[int, int, int]]:
        async with serve_drafter(NgramDrafter(max_draft_len=4)) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}")
            async with run_verifier(spec, model=shared_model(), max_model_len=512, max_num_batched_tokens=48) as v:
                context, turns = list(document), []
                for _ in range(4):
                    previous = len(context)
                    context += [r.randrange(5, 400) for _ in range(11)]
                    out = (await v.stub.Generate(token_request(context, 20), timeout=WAIT_S)).output
                    assert list(out.token_ids) == list(cached_reference(tuple(context), 20))
                    turns.append((previous, out.cached_prompt_tokens, out.stats.num_draft_tokens))
                    context += out.token_ids
        return turns

    turns = asyncio.run(main())
    assert turns[0][1] == 0
    for previous, cached, _ in turns[1:]:
        # All of the last turn's full blocks but one at most (an accepted tree path's K/V, moved into
        # place only at a next forward, is not shared).
        assert cached >= (previous - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, turns
    assert sum(drafted for _, _, drafted in turns) > 0


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_the_same_salt() -> None:
    """vLLM's cache_salt: a salted prompt hits neither the unsalted cache nor another salt's, and is
    hit by its own salt's requests, a whole later turn included; the tokens are plain decoding's."""
    doc = tokens(7, 70)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model()) as v:
            async def cached(prompt: list[int], salt: str, n: int = 8) -> int:
                out = (await v.stub.Generate(token_request(prompt, n, cache_salt=salt), timeout=WAIT_S)).output
                assert list(out.token_ids) == ref(prompt, n)
                return out.cached_prompt_tokens

            assert await cached(doc, "tenant-a", 30) == 0  # its slot keeps 6 blocks: 4 of prompt, 2 reaching the output
            assert [await cached(doc, salt) for salt in ("", "tenant-b", "tenant-a ")] == [0, 0, 0]
            assert [await cached(doc, salt) for salt in ("tenant-a", "", "tenant-b")] == [64, 64, 64]
            # A later turn extends tenant-a's first request, its output's blocks salted as its prompt's.
            turn = doc + ref(doc, 30) + tokens(8, 5)
            assert [await cached(turn, salt) for salt in ("tenant-c", "tenant-b", "tenant-a")] == [0, 64, 96]
            no_leak(engine_of(v))

    asyncio.run(main())


def test_prefix_caching_flags_ours_and_vllms() -> None:
    for argv, on in (([], True), (["--no-prefix-caching"], False), (["--no-enable-prefix-caching"], False),
                     (["--enable-prefix-caching"], True)):
        assert settings_from_args(parser().parse_args(argv)).enable_prefix_caching is on, argv
