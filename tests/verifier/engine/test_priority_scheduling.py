"""Priority scheduling (--scheduling-policy priority): who is admitted first, who is preempted,
and that a preempted request resumes exactly where it stopped.

The first tests drive Engine.step with the counting runner (test_engine_step.py), so each step's
plan is known; the last ones run the real engine on the tiny model behind gRPC, requests preempted
mid-answer with speculation on, and compare every output with the same request served alone (the
HTTP fronts: tests/http/test_priority.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading

import pytest
from test_engine_step import CountingRunner, FakeDrafter, counting, make_engine, run_steps, sequence
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    EngineSpy,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    serve_drafter,
    shared_model,
    wait_until,
)

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import drafter_pb2, verifier_pb2
from verifier_service.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from verifier_service.engine.sequence import FinishReason, Sequence
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import ConfigError


def request(request_id: str, prompt: list[int], max_new_tokens: int, priority: int) -> Sequence:
    seq = sequence(request_id, prompt, max_new_tokens)
    seq.priority = priority
    return seq


def counted(first: int, n: int) -> list[int]:
    """The counting model's n tokens after `first - 1`."""
    return list(range(first, first + n))


def test_a_request_that_comes_first_preempts_the_last_running_one_which_resumes_where_it_stopped() -> None:
    async def main() -> None:
        runner, drafter = CountingRunner(num_slots=2), FakeDrafter(counting)
        engine = make_engine(runner, drafter, max_draft_len=2, by_priority=True)
        a, b = request("a", [1, 2, 3], 12, priority=1), request("b", [20, 21], 12, priority=2)
        engine.submit(a)
        engine.submit(b)
        await run_steps(engine, 2)  # both prefilled, then one verify step each
        before = list(b.output_ids)
        assert len(before) == 4 and runner.kv_cache.num_free_slots == 0
        c = request("c", [40], 3, priority=0)
        engine.submit(c)
        await engine.step()
        # b (priority 2) made room for c (0); a (1) kept running.
        admitted = runner.batches[-1]
        assert admitted.input_ids[:1] == [40] and b.slot is None and admitted.slots == [c.slot, a.slot]
        assert (b.num_preemptions, b.recompute, b.output_ids) == (1, True, before)
        assert engine.scheduler.waiting[0] is b
        while b.slot is None:
            await engine.step()
        # Readmitted once c finished: every committed token but the last is recomputed, no logits read.
        resumed = runner.batches[-1]
        row = resumed.slots.index(b.slot)
        assert resumed.starts[row] == 0 and resumed.lengths[row] == len(b.all_ids) - 1
        first = sum(resumed.lengths[:row])
        assert resumed.input_ids[first:first + resumed.lengths[row]] == [20, 21] + before[:-1]
        assert not set(resumed.logit_index) & set(range(first, first + resumed.lengths[row]))
        held, last = len(b.all_ids) - 1, b.last_token
        await engine.step()
        # Then it decodes from its last token at the position after what it holds, with a draft.
        decode = runner.batches[-1]
        row = decode.slots.index(b.slot)
        first = sum(decode.lengths[:row])
        assert (decode.starts[row], decode.input_ids[first], decode.lengths[row]) == (held, last, 3)
        await run_steps(engine, 8)
        assert a.output_ids == counted(4, 12) and b.output_ids == counted(22, 12) and c.output_ids == counted(41, 3)
        assert not b.recompute and b.finish_reason is FinishReason.LENGTH
        # The drafter kept b's state through the preemption: it was released once, when b finished.
        assert sorted(drafter.released) == ["a", "b", "c"]
        assert set(drafter.reasons) == {drafter_pb2.RELEASE_REASON_FINISHED}
        assert runner.kv_cache.num_free_slots == 2

    asyncio.run(main())


@pytest.mark.parametrize("by_priority", [False, True], ids=["fcfs", "priority"])
def test_no_preemption_first_come_first_served_nor_between_equal_priorities(by_priority: bool) -> None:
    async def main() -> None:
        runner = CountingRunner(num_slots=1)
        engine = make_engine(runner, drafter=None, by_priority=by_priority)
        a = request("a", [1], 4, priority=1)
        engine.submit(a)
        await engine.step()
        # Under fcfs priorities are not served (the API refuses them); equal ones never preempt.
        later = request("later", [30], 2, priority=0 if not by_priority else 1)
        engine.submit(later)
        await engine.step()
        assert later.slot is None and a.num_preemptions == 0
        await run_steps(engine, 6)
        assert a.output_ids == counted(2, 4) and later.output_ids == counted(31, 2)

    asyncio.run(main())


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    async def main() -> None:
        runner = CountingRunner(num_slots=1)
        engine = make_engine(runner, drafter=None, by_priority=True)
        first = request("first", [1], 2, priority=-5)  # before every later one: never preempted
        engine.submit(first)
        await engine.step()
        queued = [request(name, [10 * i], 2, priority=p) for i, (name, p) in
                  enumerate([("x", 5), ("y", 1), ("z", 1), ("w", -3)], 1)]
        for seq in queued:
            engine.submit(seq)
        order = []
        for _ in range(12):
            await engine.step()
            order += [s.request_id for s in queued if s.slot is not None and s.request_id not in order]
        assert order == ["w", "y", "z", "x"]
        assert all(s.finished for s in queued) and first.num_preemptions == 0

    asyncio.run(main())


def test_a_preempted_request_cancelled_while_it_waits_releases_its_drafter_state() -> None:
    async def main() -> None:
        runner, drafter = CountingRunner(num_slots=1), FakeDrafter(counting)
        engine = make_engine(runner, drafter, max_draft_len=2, by_priority=True)
        low, never = request("low", [1, 2], 20, priority=1), request("never", [50], 20, priority=3)
        engine.submit(low)
        await run_steps(engine, 2)
        engine.submit(never)  # waits behind low, never runs
        high = request("high", [30], 2, priority=0)
        engine.submit(high)
        await engine.step()
        assert low.num_preemptions == 1 and low.slot is None
        engine.cancel(low)
        engine.cancel(never)
        await run_steps(engine, 3)
        # Only the request that ran (and so was drafted for) is released; the one that never ran is dropped.
        assert drafter.released == ["low", "high"]
        assert drafter.reasons == [drafter_pb2.RELEASE_REASON_CANCELLED, drafter_pb2.RELEASE_REASON_FINISHED]
        assert not engine.scheduler.has_work() and runner.kv_cache.num_free_slots == 1

    asyncio.run(main())


def test_a_preempted_request_takes_its_kept_blocks_back_from_the_prefix_cache() -> None:
    async def main() -> None:
        runner = CountingRunner(num_slots=3)
        cache = PrefixCache(runner.kv_cache)
        engine = make_engine(runner, drafter=None, max_num_seqs=2, by_priority=True, prefix_cache=cache)
        a, b = request("a", [1], 30, priority=1), request("b", list(range(5, 25)), 20, priority=2)
        engine.submit(a)
        engine.submit(b)
        await run_steps(engine, 3)
        old_slot, queries, hits = b.slot, cache.queries, cache.hits
        c = request("c", [60], 2, priority=0)
        engine.submit(c)
        await engine.step()  # b leaves (max_num_seqs), c takes the free slot: b's stays kept
        assert b.slot is None and c.slot != old_slot
        while b.slot is None:
            await engine.step()
        # By reference: its own slot, every full block of what it had committed.
        row = runner.batches[-1].slots.index(b.slot)
        assert b.slot == old_slot and runner.batches[-1].starts[row] == (len(b.all_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        # Its own tokens are not counted as prefix cache queries or hits (c's are).
        assert (cache.queries, cache.hits) == (queries + 1, hits)
        await run_steps(engine, 40)
        assert a.output_ids == counted(2, 30) and b.output_ids == counted(25, 20) and c.output_ids == counted(61, 2)

    asyncio.run(main())


def test_the_scheduling_policy_is_one_of_vllms() -> None:
    with pytest.raises(ConfigError, match="scheduling_policy must be one of fcfs, priority"):
        ServerSettings(scheduling_policy="lifo")


def params(prompt_seed: int, n: int, priority: int, seed: int | None = None, **fields: object
           ) -> verifier_pb2.GenerationParams:
    """A request on a prompt the tiny model loops on (drafts get accepted); seeded sampling with `seed`."""
    p = token_request(repetitive_prompt(prompt_seed), n, priority=priority, **fields).params
    if seed is not None:
        p.sampling.temperature, p.sampling.seed = 0.8, seed
    return p


# Two long requests of low priority, then three that come before them: the first two preempt both.
LOW = {"low-greedy": params(4, 90, 5, logprobs=2), "low-sampled": params(65, 90, 5, seed=7)}
HIGH = {"high-greedy": params(57, 20, 0), "high-sampled": params(48, 20, 0, seed=3), "middle": params(205, 20, 3)}
SCENARIOS = {
    "n-gram, prefix caching": ({}, False),
    "remote drafter, no prefix caching, chunked": ({"enable_prefix_caching": False, "max_num_batched_tokens": 24},
                                                   True),
    "n-gram trees, chunked": ({"max_draft_nodes": 8, "max_num_batched_tokens": 24}, False),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_preempted_requests_resume_exactly_with_speculation(scenario: str) -> None:
    """Every request, preempted or not, gets what it gets served alone: greedy and seeded sampling, with
    log-probabilities, whether its KV comes back from the prefix cache or is recomputed in chunks. The
    sampled one is streamed: a preemption is a pause in its stream, no token sent twice."""
    settings, remote = SCENARIOS[scenario]

    async def generate(v, p: verifier_pb2.GenerationParams) -> verifier_pb2.GenerationOutput:  # noqa: ANN001
        if not p.sampling.seed:
            return (await v.stub.Generate(verifier_pb2.GenerateRequest(params=p), timeout=WAIT_S)).output
        chunks = [m.output async for m in v.stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=p),
                                                                 timeout=WAIT_S)]
        return verifier_pb2.GenerationOutput(token_ids=[t for c in chunks for t in c.token_ids],
                                             text="".join(c.text for c in chunks),
                                             finish_reason=chunks[-1].finish_reason)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            spec = spec_config("NGRAM", 4)
            if remote:
                d = await stack.enter_async_context(serve_drafter(NgramDrafter(max_draft_len=4)))
                spec = spec_config("USER_PROVIDED", 4, f"127.0.0.1:{d.port}", deadline_ms=30000)
            v = await stack.enter_async_context(run_verifier(
                spec, model=shared_model(), scheduling_policy="priority", max_num_seqs=2, metrics_port=0, **settings))
            engine = engine_of(v)
            alone = {name: await generate(v, p) for name, p in {**LOW, **HIGH}.items()}
            spy = EngineSpy(engine)
            low = {name: asyncio.ensure_future(generate(v, p)) for name, p in LOW.items()}
            await wait_until(lambda: len(engine.scheduler.running) == 2 and all(
                len(s.output_ids) >= 3 for s in engine.scheduler.running), "both to decode", *low.values())
            spy.gate.clear()  # hold the engine at its next forward while the others arrive
            high = {name: asyncio.ensure_future(generate(v, p)) for name, p in HIGH.items()}
            await wait_until(lambda: len(engine.scheduler.waiting) == 3, "the others to queue", *high.values())
            spy.gate.set()
            together = {name: await call for name, call in {**low, **high}.items()}
            preemptions = v.running.metrics.registry.get_sample_value("splitspec:num_preemptions_total")
        assert preemptions >= 2
        for name, out in together.items():
            assert list(out.token_ids) == list(alone[name].token_ids), name
            assert out.text == alone[name].text and out.finish_reason == alone[name].finish_reason
        assert [t.token_id for t in together["low-greedy"].logprobs] == list(alone["low-greedy"].token_ids)
        for got, want in zip(together["low-greedy"].logprobs, alone["low-greedy"].logprobs):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-3)

    asyncio.run(main())


def test_a_preempted_request_keeps_its_constraint_penalty_and_generator() -> None:
    """One slot: a sampled, penalised request held to a regex is preempted mid-answer and resumed; its
    answer is the one it gets alone, and still matches the regex."""
    regex = r"(fox|dog)+ [0-9]{3}"
    low = token_request(tiny_tokenizer()("The quick brown fox regex")["input_ids"], 48, priority=1,
                        structured_output=verifier_pb2.StructuredOutput(regex=regex),
                        sampling=verifier_pb2.SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.2))
    high = token_request(repetitive_prompt(57), 6)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), scheduling_policy="priority",
                                max_num_seqs=1, metrics_port=0) as v:
            engine = engine_of(v)
            alone = (await v.stub.Generate(low, timeout=WAIT_S)).output
            spy = EngineSpy(engine)
            # Held on the model thread at the first forward after its third token, so it is mid-answer (its 11
            # tokens take 5 at most a step) however late this loop looks: the gate closes there, once.
            held, gated = threading.Event(), engine.runner.forward

            def forward(batch):  # noqa: ANN001, ANN202
                if not held.is_set() and any(len(s.output_ids) >= 3 for s in engine.scheduler.running):
                    held.set()
                    spy.gate.clear()
                return gated(batch)

            engine.runner.forward = forward
            call = asyncio.ensure_future(v.stub.Generate(low, timeout=WAIT_S))
            await wait_until(held.is_set, "it to decode", call)
            first = asyncio.ensure_future(v.stub.Generate(high, timeout=WAIT_S))
            await wait_until(lambda: engine.scheduler.num_waiting == 1, "the other to queue", first)
            spy.gate.set()
            resumed, _ = (await call).output, await first
            assert v.running.metrics.registry.get_sample_value("splitspec:num_preemptions_total") == 1
        assert list(resumed.token_ids) == list(alone.token_ids) and resumed.text == alone.text
        assert re.fullmatch(regex, alone.text) or alone.finish_reason == verifier_pb2.FINISH_REASON_LENGTH

    asyncio.run(main())
