"""The step loop runs on the model thread (engine/model_thread.py): the servers' event loop stays free
during a forward, and a step's work never leaves the model thread."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    EngineSpy,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    serve_drafter,
    shared_model,
    stream_request,
    wait_until,
)

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:3]]


def test_health_new_requests_and_cancellations_are_served_while_a_forward_runs() -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)
            spy.gate.clear()  # the next forward blocks until the gate opens
            held = asyncio.ensure_future(v.stub.Generate(token_request(PROMPTS[0], 12), timeout=WAIT_S))
            await wait_until(lambda: engine.scheduler.num_running == 1, "the first request to be admitted")
            # The engine is inside that request's first forward now; the servers answer meanwhile.
            health = health_pb2_grpc.HealthStub(v.channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert (await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)).model
            queued = asyncio.ensure_future(v.stub.Generate(token_request(PROMPTS[1], 6), timeout=WAIT_S))
            cancelled = v.stub.GenerateStream(stream_request(PROMPTS[2], 40), timeout=WAIT_S)
            await wait_until(lambda: engine.scheduler.num_waiting == 2, "both requests to be queued")
            cancelled.cancel()
            await wait_until(lambda: any(s.cancelled for s in engine.scheduler.waiting), "the cancellation")
            spy.gate.set()
            first, second = await held, await queued
            try:
                await cancelled.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            await wait_until(lambda: not engine.scheduler.has_work(), "the engine to go idle")
        assert list(first.output.token_ids) == list(cached_reference(tuple(PROMPTS[0]), 12))
        assert list(second.output.token_ids) == list(cached_reference(tuple(PROMPTS[1]), 6))

    asyncio.run(main())


def test_a_step_runs_on_the_model_thread_with_a_remote_drafter() -> None:
    """Schedule, the drafter call, the forward and commit all run on one thread, not the servers'."""
    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=4)) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}")
            async with run_verifier(spec, model=shared_model()) as v:
                engine = engine_of(v)
                threads: list[str] = []
                schedule, update = engine.scheduler.schedule, engine.scheduler.update
                transport = engine.drafter.transport
                prepare = transport.prepare

                def on_schedule(*price):  # noqa: ANN002, ANN202
                    threads.append(threading.current_thread().name)
                    return schedule(*price)

                def on_update(plan, tokens):  # noqa: ANN001, ANN202
                    threads.append(threading.current_thread().name)
                    return update(plan, tokens)

                async def on_prepare(request, timeout_s):  # noqa: ANN001, ANN202
                    threads.append(threading.current_thread().name)
                    return await prepare(request, timeout_s)

                engine.scheduler.schedule, engine.scheduler.update = on_schedule, on_update
                transport.prepare = on_prepare
                reply = await v.stub.Generate(token_request(PROMPTS[0], 24), timeout=WAIT_S)
                assert reply.output.stats.num_draft_tokens > 0  # the drafter was called and drafted
        assert list(reply.output.token_ids) == list(cached_reference(tuple(PROMPTS[0]), 24))
        assert threads and set(threads) == {"model"}

    asyncio.run(main())


def test_a_stream_read_late_gets_what_queued_as_one_message_and_loses_nothing() -> None:
    """The model thread steps on while the servers' loop is held (a front that fell behind); the stream
    then sends what queued as one message (api/generation.py): every token in order with its text,
    log-probabilities and flags, as the unary call returns them, and the finish in the last message."""
    prompt, n = PROMPTS[0], 40

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model(), metrics_port=0) as v:
            engine = engine_of(v)
            stream = v.stub.GenerateStream(stream_request(prompt, n, logprobs=2), timeout=WAIT_S)
            messages = [await stream.read()]
            (seq,) = engine.scheduler.running
            # Counted from here: what the server sent before the loop was held (a slow machine lets it
            # send several) is not part of what must queue. One step more than the 8 asserted below: a
            # step's tokens are on the sequence a moment before its outputs are handed over.
            held_from = len(seq.output_ids)
            assert held_from + 9 <= n, "the engine ran ahead before the servers' loop could be held"
            deadline = time.monotonic() + WAIT_S
            while len(seq.output_ids) < held_from + 9 and time.monotonic() < deadline:
                time.sleep(0.005)  # blocks the servers' loop, not the model thread
            assert len(seq.output_ids) >= held_from + 9, "the engine stopped stepping while the loop was held"
            while (message := await stream.read()) != grpc.aio.EOF:
                messages.append(message)
            unary = await v.stub.Generate(token_request(prompt, n, logprobs=2), timeout=WAIT_S)
            joined = v.running.metrics.registry.get_sample_value("splitspec:outputs_joined_total")
        outs = [m.output for m in messages]
        assert max(len(o.token_ids) for o in outs) >= 8, "the steps taken while the loop was held were not joined"
        assert joined >= max(len(o.token_ids) for o in outs) - 1  # counted: each output that went out with another
        assert [t for o in outs for t in o.token_ids] == list(unary.output.token_ids) == list(
            cached_reference(tuple(prompt), n))
        assert "".join(o.text for o in outs) == unary.output.text
        assert [lp for o in outs for lp in o.logprobs] == list(unary.output.logprobs)
        assert all(len(o.logprobs) == len(o.drafted) == len(o.token_ids) for o in outs)
        assert all(not o.finish_reason for o in outs[:-1])
        assert outs[-1].finish_reason == verifier_pb2.FINISH_REASON_LENGTH
        assert outs[-1].stats.num_steps == unary.output.stats.num_steps

    asyncio.run(main())
