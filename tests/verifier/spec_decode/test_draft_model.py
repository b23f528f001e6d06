"""A draft model (the SDK's ModelDrafter) in front of the verifier, on the tiny draft/target pair:
in-process (DRAFT_TARGET) and as a real drafter service (USER_PROVIDED), outputs identical to plain
decoding in mixed batches, across a drafter restart (resyncs) and releases; and a drafter whose
tokenizer is not the model's gets no calls, with the reason in GetServerInfo."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import pytest
from tiny_model import tiny_draft_pair, tiny_tokenizer
from transformers import PreTrainedTokenizerFast
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    EngineSpy,
    engine_of,
    on_loop,
    one_torch_thread,  # noqa: F401 - autouse fixture
    run_together,
    wait_until,
)

from drafter_sdk.drafters.model import ModelDrafter
from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint
from drafter_sdk.proto import verifier_pb2
from drafter_sdk.server.serve import start_server

# Prompts of different lengths and generation lengths: a mixed batch.
PROMPTS = [[5, 17, 230, 41], [99, 3, 3, 12, 7, 150, 61, 8, 8, 20], [300, 4], [44] * 6]
NEW_TOKENS = [40, 24, 56, 32]


@functools.cache
def pair():
    return tiny_draft_pair()


@functools.cache
def references() -> list[list[int]]:
    return [reference_greedy(pair()[1], p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    pair()[0].save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


async def generate_all(v) -> list[verifier_pb2.GenerateResponse]:
    calls = [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
             for p, n in zip(PROMPTS, NEW_TOKENS)]
    return await run_together(v, calls)


def check_exact(responses) -> int:
    """Outputs are plain decoding's; returns the accepted draft tokens."""
    assert [list(r.output.token_ids) for r in responses] == references()
    return sum(r.output.stats.num_accepted_tokens for r in responses)


def test_draft_target_in_process_is_exact_and_drafts(draft_dir, monkeypatch):
    """On the CPU beside a CPU target, the draft model runs on the verifier's model thread: a thread of its
    own made every forward of the target about 1.8x as slow (spec_decode/drafters.py)."""
    spec = spec_config("DRAFT_TARGET", 4)
    spec.draft_model.model = str(draft_dir)
    threads: set[str] = set()
    prepare = ModelDrafter._prepare

    def recorded(self, requests):  # noqa: ANN001, ANN202
        threads.add(threading.current_thread().name)
        return prepare(self, requests)

    monkeypatch.setattr(ModelDrafter, "_prepare", recorded)

    async def body():
        async with run_verifier(spec, model=pair()[1]) as v:
            responses = await generate_all(v)
            info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
            drafter = engine_of(v).drafter.transport._servicer.drafter
            return responses, info, drafter

    responses, info, drafter = asyncio.run(body())
    assert check_exact(responses) > 0
    assert info.drafter.state == verifier_pb2.DRAFTER_STATE_HEALTHY and info.drafter.name == "model"
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(tiny_tokenizer())
    assert info.speculative_config.draft_model.draft_ahead and info.speculative_config.draft_model.device == "auto"
    assert drafter.stats.lookups > 0 and drafter.kv_bytes_used == 0  # every finished request was released
    assert threads == {"model"} and not drafter.draft_ahead  # asked for, but it would hold the model thread


def test_remote_model_drafter_restarted_mid_generation_stays_exact(draft_dir):
    """A real drafter service on port 0; halfway it is replaced by a fresh one on the same port."""
    def new_drafter() -> ModelDrafter:
        return ModelDrafter(str(draft_dir), device="cpu", dtype="float32", max_draft_len=4)

    async def body():
        first = await start_server(new_drafter(), host="127.0.0.1", port=0, grace_period_s=0.0)
        await first.wait_loaded()
        port, second = first.port, None
        spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{port}", deadline_ms=30000)
        spec.user_provided.delta_overlap_steps = 1
        try:
            async with run_verifier(spec, model=pair()[1]) as v:
                client = engine_of(v).drafter
                transport = client.transport
                prepare, calls = transport.prepare, []
                test_loop = asyncio.get_running_loop()

                async def restart() -> None:  # on the test's loop, where the drafter servers run
                    nonlocal second
                    await first.stop(0)
                    second = await start_server(new_drafter(), host="127.0.0.1", port=port, grace_period_s=0.0)
                    await second.wait_loaded()

                async def restarting_prepare(request, timeout_s):  # noqa: ANN001, ANN202
                    calls.append(request)  # on the engine's loop (the model thread), where the channel lives
                    if len(calls) == 8:
                        await on_loop(test_loop, restart())
                        await transport.ready(WAIT_S)
                    return await prepare(request, timeout_s)

                transport.prepare = restarting_prepare
                responses = await generate_all(v)
                accepted_after = sum(len(c.sequences) for c in calls[8:])
                held = second.servicer.drafter
                await asyncio.sleep(0.2)  # releases are sent in the background
                return responses, client.stats, held, accepted_after
        finally:
            await first.stop(0)
            if second is not None:
                await second.stop(0)

    responses, stats, second_drafter, calls_after = asyncio.run(body())
    assert check_exact(responses) > 0
    assert stats.resyncs > 0 and calls_after > 0  # the fresh drafter asked for whole contexts, then drafted
    assert second_drafter.stats.lookups > 0
    assert second_drafter.kv_bytes_used == 0 and not second_drafter._sequences  # released as requests finished


def other_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().backend_tokenizer, eos_token="<eos>")
    tokenizer.add_tokens(["<extra>"])
    return tokenizer


def test_a_drafter_with_another_tokenizer_gets_no_calls_and_the_server_says_why(caplog):
    assert tokenizer_fingerprint(other_tokenizer()) != tokenizer_fingerprint(tiny_tokenizer())
    drafter = ModelDrafter(loaded=(pair()[0], other_tokenizer()), max_draft_len=4)

    async def body():
        running = await start_server(drafter, host="127.0.0.1", port=0, grace_period_s=0.0)
        await running.wait_loaded()
        try:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{running.port}", deadline_ms=30000)
            async with run_verifier(spec, model=pair()[1]) as v:
                responses = await generate_all(v)
                info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
            return responses, info
        finally:
            await running.stop(0)

    with caplog.at_level(logging.ERROR, logger="verifier_service.spec_decode.drafter_client"):
        responses, info = asyncio.run(body())
    assert check_exact(responses) == 0
    assert info.drafter.state == verifier_pb2.DRAFTER_STATE_INCOMPATIBLE
    assert "tokenizer mismatch" in info.drafter.disabled_reason
    assert tokenizer_fingerprint(other_tokenizer()) in info.drafter.disabled_reason
    assert info.tokenizer_fingerprint in info.drafter.disabled_reason
    assert drafter.stats.lookups == 0 and info.drafter.calls == 0
    lines = [r for r in caplog.records if "speculation off" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_draft_target_through_preemptions_is_exact_and_releases_the_draft_kv(draft_dir):
    """Priority scheduling on two slots: the two long requests are preempted mid-answer by two that come
    first; the draft model's own KV for them stays in step, and every answer is plain decoding's."""
    spec = spec_config("DRAFT_TARGET", 4)
    spec.draft_model.model = str(draft_dir)
    order = [2, 0, 3, 1]  # PROMPTS[2] and [0], the longest, first, at priority 1; then the others at 0

    async def body():
        async with run_verifier(spec, model=pair()[1], scheduling_policy="priority", max_num_seqs=2,
                                metrics_port=0) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)

            def send(i: int, priority: int) -> asyncio.Future:
                request = token_request(PROMPTS[i], NEW_TOKENS[i], priority=priority)
                return asyncio.ensure_future(v.stub.Generate(request, timeout=WAIT_S))
            calls = {i: send(i, 1) for i in order[:2]}
            await wait_until(lambda: len(engine.scheduler.running) == 2 and all(
                len(s.output_ids) >= 3 for s in engine.scheduler.running), "both to decode", *calls.values())
            spy.gate.clear()
            calls |= {i: send(i, 0) for i in order[2:]}
            await wait_until(lambda: engine.scheduler.num_waiting == 2, "the others to queue", *calls.values())
            spy.gate.set()
            responses = [await calls[i] for i in range(len(PROMPTS))]
            preemptions = v.running.metrics.registry.get_sample_value("splitspec:num_preemptions_total")
            return responses, preemptions, engine.drafter.transport._servicer.drafter

    responses, preemptions, drafter = asyncio.run(body())
    assert preemptions == 2
    assert check_exact(responses) > 0
    assert drafter.kv_bytes_used == 0  # every finished request released, preempted ones included
