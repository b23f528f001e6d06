"""Predicted outputs over gRPC (GenerationParams.prediction): the verifier drafts from a request's prediction
itself, ahead of its drafter. The output stays token for token what it is without one, greedy and
seeded-sampled, whatever the prediction: the output's own text (which the random model's bytes do not always
tokenize back to), that text edited, or unrelated text; alone or beside requests without one; with an
in-process or a remote drafter. A prediction the output follows (a scripted model writes a text that tokenizes
back to itself) drafts whole steps, nearly all of it accepted, and finds its way back after edits; the drafter
is asked for nothing while it drafts, and it drafts while the drafter is down. With speculation off nothing is
drafted. Its counts are in the stats."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest
from tiny_model import tiny_tokenizer
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
    scripted_model,
    serve_drafter,
    shared_model,
    text_chain,
)

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2
from verifier_service.spec_decode.planner import StepPrice
from verifier_service.tools.local_services import free_port

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:2]] + [
    tiny_tokenizer()(text)["input_ids"] for text in ("def add(a, b):\n    return a + b\n", "The quick brown fox.")]
N = 40  # tokens generated per request


def text(tokens) -> str:  # noqa: ANN001
    return tiny_tokenizer().decode(list(tokens))


def ids(response: verifier_pb2.GenerateResponse) -> list[int]:
    return list(response.output.token_ids)


async def generate(v, prompt: list[int], prediction: str = "", **fields: object) -> verifier_pb2.GenerateResponse:  # noqa: ANN001
    return await v.stub.Generate(token_request(prompt, N, prediction=prediction, **fields), timeout=WAIT_S)


def test_outputs_stay_exact_whatever_the_prediction() -> None:
    refs = [list(cached_reference(tuple(p), N)) for p in PROMPTS]

    def predictions(ref: list[int]) -> list[str]:
        return [text(ref), text(ref[:6] + [5, 6, 7] + ref[6:15] + ref[19:30] + [9] + ref[31:]),
                "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 3]

    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=8)) as drafter:
            remote = spec_config("USER_PROVIDED", 8, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            for spec in (spec_config("NGRAM", 8), remote):
                async with run_verifier(spec, model=shared_model()) as v:
                    for prompt, ref in zip(PROMPTS, refs):
                        for prediction in predictions(ref):
                            got = await generate(v, prompt, prediction)
                            assert ids(got) == ref, (prediction, prompt)
                            s = got.output.stats
                            assert s.accepted_prediction_tokens + s.rejected_prediction_tokens <= s.num_draft_tokens
                    # Beside requests without one, in one batch: every output exact.
                    calls = [functools.partial(v.stub.Generate, token_request(
                        p, N, prediction=predictions(r)[1] if i % 2 else ""), timeout=WAIT_S)
                        for i, (p, r) in enumerate(zip(PROMPTS, refs))]
                    assert [ids(r) for r in await run_together(v, calls)] == refs

    asyncio.run(main())


def test_a_prediction_the_output_follows_drafts_whole_steps_and_comes_back_after_edits() -> None:
    prompt, expected = [text_chain()[0]], list(text_chain()[1:N + 1])
    exact = text(expected)
    edits = exact.replace(" fox", " cat").replace(" forward", "").replace(" lazy", " very lazy")
    assert edits.count(" ") == exact.count(" ")  # a word replaced, one deleted, one inserted
    sampling = verifier_pb2.SamplingParams(temperature=0.9, top_p=0.9, seed=11)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 8), model=scripted_model(list(text_chain()))) as v:
            without = await generate(v, prompt)
            got = await generate(v, prompt, exact)
            assert ids(without) == ids(got) == expected
            s = got.output.stats
            assert s.accepted_prediction_tokens >= N - 8 and s.rejected_prediction_tokens <= 8
            assert s.num_steps <= N // 4 < without.output.stats.num_steps
            edited = await generate(v, prompt, edits)
            assert ids(edited) == expected and edited.output.stats.accepted_prediction_tokens >= N // 2
            # Sampled with a seed: the same output with it as without it.
            plain = await generate(v, prompt, sampling=sampling)
            predicted = await generate(v, prompt, text(plain.output.token_ids), sampling=sampling)
            assert ids(predicted) == ids(plain) and predicted.output.stats.accepted_prediction_tokens >= N // 2

    asyncio.run(main())


def test_the_drafter_is_asked_nothing_while_the_prediction_drafts() -> None:
    expected = list(text_chain()[1:N + 1])

    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=8)) as drafter:
            spec = spec_config("USER_PROVIDED", 8, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=scripted_model(list(text_chain()))) as v:
                spy = EngineSpy(engine_of(v))
                got, beside = await run_together(v, [  # beside it, a request without one: the drafter drafts for it
                    functools.partial(generate, v, [text_chain()[0]], text(expected)),
                    functools.partial(generate, v, [text_chain()[1]])], spy)
                assert ids(got) == expected and ids(beside) == list(text_chain()[2:N + 2])
                asked: dict[str, int] = {}
                fed_back: dict[str, int] = {}  # the feedback on the drafter's drafts: it drafted none for it
                for request in spy.prepare_requests:
                    for s in request.sequences:
                        asked[s.request_id] = asked.get(s.request_id, 0) + s.draft_len
                        fed_back[s.request_id] = fed_back.get(s.request_id, 0) + s.last_num_drafted
                assert sorted(asked.values())[0] == 0 < sorted(asked.values())[1] and len(asked) == 2
                predicted = min(asked, key=asked.get)
                assert fed_back[predicted] == 0

    asyncio.run(main())


def test_a_prediction_drafts_while_the_drafter_is_down() -> None:
    port = free_port()  # nothing listens on it
    expected = list(text_chain()[1:N + 1])

    async def main() -> None:
        spec = spec_config("USER_PROVIDED", 8, drafter_target=f"127.0.0.1:{port}", deadline_ms=500)
        async with run_verifier(spec, model=scripted_model(list(text_chain()))) as v:
            without = await generate(v, [text_chain()[0]])
            got = await generate(v, [text_chain()[0]], text(expected))
            assert ids(without) == ids(got) == expected and without.output.stats.num_accepted_tokens == 0
            assert got.output.stats.accepted_prediction_tokens >= N - 8

    asyncio.run(main())


def test_the_planner_counts_the_predictions_drafts_as_answers_while_the_drafter_is_down() -> None:
    """The adaptive planner learns, per request, how often its drafts come: a step whose draft the prediction
    gave counts as answered, though the drafter (down here, so asked in vain after each edit) was asked for
    none."""
    port = free_port()
    expected = list(text_chain()[1:N + 1])
    edits = text(expected).replace(" fox", " cat").replace(" forward", "").replace(" lazy", " very lazy")

    async def main() -> None:
        spec = spec_config("USER_PROVIDED", 8, drafter_target=f"127.0.0.1:{port}", deadline_ms=500,
                           adaptiveDraftLen=True)
        async with run_verifier(spec, model=scripted_model(list(text_chain()))) as v:
            scheduler, rates = engine_of(v).scheduler, []  # (predicted, answered rate before, after) per step
            update = scheduler.update

            def spy(plan, new_tokens):  # noqa: ANN001, ANN202
                before = [s.spec.acceptance.answered.value for s in plan.decodes]
                finished = update(plan, new_tokens)
                rates.extend((bool(p), b, s.spec.acceptance.answered.value)
                             for p, b, s in zip(plan.predicted, before, plan.decodes))
                return finished
            scheduler.update = spy
            got = await generate(v, [text_chain()[0]], edits)
            assert ids(got) == expected
            # How long the drafts are is the planner's, priced by this machine's timings; the rule is not.
            predicted = [(b, a) for p, b, a in rates if p]
            assert predicted and any(not p for p, _, _ in rates)  # after an edit, the prediction had none
            assert all(a > b or a == b == 1.0 for b, a in predicted)  # each predicted step: answered

    asyncio.run(main())


def test_a_prediction_drafts_however_dear_the_drafter_call() -> None:
    """The planner prices a drafter call against the drafts it brings; the prediction's drafts need none, so
    a drafter priced out of every step does not stop them."""
    expected = list(text_chain()[1:N + 1])

    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=8)) as drafter:
            spec = spec_config("USER_PROVIDED", 8, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000,
                               adaptiveDraftLen=True)
            async with run_verifier(spec, model=scripted_model(list(text_chain()))) as v:
                engine = engine_of(v)
                engine._clock.price = lambda: StepPrice(call=1000.0)  # a call costs a thousand forwards
                without = await generate(v, [text_chain()[0]])
                got = await generate(v, [text_chain()[0]], text(expected))
                assert ids(without) == ids(got) == expected
                assert without.output.stats.num_draft_tokens <= 8, "only its first call, made anyway, drafts"
                assert got.output.stats.accepted_prediction_tokens >= N - 8

    asyncio.run(main())


def test_without_speculation_nothing_is_drafted_and_a_long_prediction_is_refused() -> None:
    prompt, ref = PROMPTS[0], list(cached_reference(tuple(PROMPTS[0]), N))

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            got = await generate(v, prompt, text(ref))
            s = got.output.stats
            assert ids(got) == ref and (s.num_drafts, s.accepted_prediction_tokens, s.rejected_prediction_tokens) == (
                0, 0, 0)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(v, prompt, "word " * 400)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prediction is longer than the model's context of 256 tokens" in refused.value.details()

    asyncio.run(main())
