"""Prompt log-probabilities (vLLM's prompt_logprobs, what an evaluation harness scores a text
with): equal to one transformers forward over the whole prompt, whatever the chunking, beside
other streams' decode and verify rows; never taken from the prefix cache; the generated tokens
stay plain decoding's."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    shared_model,
    stream_request,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.engine import scheduler as scheduler_module

PROMPT = repetitive_prompt(3)[:40] + [17, 250, 3, 99, 5]
TOP = 3


def reference(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(log-probability of each token after the first, top-TOP values, top-TOP ids, each token's rank: 1 +
    the tokens more likely) from one forward."""
    with torch.no_grad():
        logits = shared_model()(torch.tensor([prompt])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    top_v, top_i = logp.topk(TOP, dim=-1)
    chosen = logp.gather(-1, torch.tensor(prompt[1:])[:, None])
    return chosen[:, 0], top_v, top_i, (logp > chosen).sum(-1).add(1).tolist()


def assert_matches(got: list[verifier_pb2.TokenLogprob], prompt: list[int]) -> None:
    chosen, top_v, top_i, ranks = reference(prompt)
    assert [lp.token_id for lp in got] == prompt[1:]
    assert [lp.rank for lp in got] == ranks
    assert torch.tensor([lp.logprob for lp in got]) == pytest.approx(chosen, abs=1e-4)
    assert [[t.token_id for t in lp.top] for lp in got] == top_i.tolist()
    assert torch.tensor([[t.logprob for t in lp.top] for lp in got]) == pytest.approx(top_v, abs=1e-4)


@pytest.mark.parametrize("budget,chunk_cap", [(3, 512), (512, 7), (512, 512)])
def test_prompt_logprobs_equal_one_forward_beside_speculating_streams(monkeypatch, budget: int,
                                                                      chunk_cap: int) -> None:  # noqa: ANN001
    """Chunks of `budget` tokens (or PROMPT_LOGPROBS_CHUNK = `chunk_cap`) while another stream
    verifies n-gram drafts; the prompt's prefix is in the prefix cache and must not be used."""
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", chunk_cap)
    other = repetitive_prompt(4)  # loops: its n-gram drafts are accepted

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_num_batched_tokens=budget) as v:
            warm = await v.stub.Generate(token_request(PROMPT, 4), timeout=WAIT_S)  # leaves PROMPT cached
            chunks: list[int] = []
            schedule = engine_of(v).scheduler.schedule

            def spy(*price):  # noqa: ANN002, ANN202
                plan = schedule(*price)
                chunks.extend(n for s, n in zip(plan.prefills, plan.chunks) if s.prompt_logprobs is not None)
                return plan

            engine_of(v).scheduler.schedule = spy
            running = asyncio.ensure_future(v.stub.Generate(token_request(other, 40), timeout=WAIT_S))
            asked = await v.stub.Generate(token_request(PROMPT, 12, prompt_logprobs=TOP), timeout=WAIT_S)
            beside = await running
        assert_matches(list(asked.output.prompt_logprobs), PROMPT)
        assert asked.output.cached_prompt_tokens == 0 and warm.output.cached_prompt_tokens == 0
        assert list(asked.output.token_ids) == list(cached_reference(tuple(PROMPT), 12))
        assert list(beside.output.token_ids) == list(cached_reference(tuple(other), 40))
        assert beside.output.stats.num_accepted_tokens > 0  # verify rows ran beside the prompt's chunks
        assert sum(chunks) == len(PROMPT) and max(chunks) <= min(budget, chunk_cap)
        assert not warm.output.prompt_logprobs and not beside.output.prompt_logprobs  # only where asked

    asyncio.run(main())


def test_prompt_logprobs_come_in_the_first_stream_message_and_are_range_checked() -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            request = stream_request(PROMPT, 12)
            request.params.prompt_logprobs = TOP
            messages = [m.output async for m in v.stub.GenerateStream(request, timeout=WAIT_S)]
            assert len(messages) > 1
            assert_matches(list(messages[0].prompt_logprobs), PROMPT)
            assert not any(m.prompt_logprobs for m in messages[1:])
            # 0: each prompt token's own log-probability, no alternatives.
            own = await v.stub.Generate(token_request(PROMPT, 2, prompt_logprobs=0), timeout=WAIT_S)
            assert [lp.logprob for lp in own.output.prompt_logprobs] == pytest.approx(
                reference(PROMPT)[0].tolist(), abs=1e-4)
            assert not any(lp.top for lp in own.output.prompt_logprobs)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await v.stub.Generate(token_request(PROMPT, 2, prompt_logprobs=21), timeout=WAIT_S)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_logprobs must be within [0, 20]" in bad.value.details()

    asyncio.run(main())
