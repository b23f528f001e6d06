"""The OpenAI-compatible HTTP API through the official openai client, against a real verifier
(tiny random model, HTTP on port 0) with a remote SDK n-gram drafter over gRPC: the same tokens
as gRPC, streaming equal to the whole answer, usage and speculation stats, stop strings (cut or
kept), special tokens written out, seeds, n, batches of prompts, logprobs with and without
speculation (and naming tokens by id), echo with the prompt's logprobs, structured output."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from tiny_model import tiny_tokenizer
from verifier_support import one_torch_thread, shared_model  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


async def grpc_generate(h, **params) -> verifier_pb2.GenerationOutput:  # noqa: ANN001
    response = await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(**params)),
                                       timeout=WAIT_S)
    return response.output


def test_completions_equal_grpc_and_stream_equals_whole() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            whole = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40)
            choice = whole.choices[0]
            grpc_out = await grpc_generate(h, prompt=PROMPT,
                                           stopping=verifier_pb2.StoppingCriteria(max_new_tokens=40))
            assert choice.text == grpc_out.text
            assert choice.model_extra["splitspec"]["token_ids"] == list(grpc_out.token_ids)
            assert choice.finish_reason == "length"
            prompt_tokens = len(tiny_tokenizer()(PROMPT)["input_ids"])
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
                prompt_tokens, 40, prompt_tokens + 40)
            spec = whole.model_extra["speculation"]
            assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0  # the drafter's tokens were used
            assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
            drafted = choice.model_extra["splitspec"]["drafted"]
            assert sum(drafted) == spec["num_accepted_tokens"] and len(drafted) == 40

            text, ids, flags, chunks = "", [], [], []
            stream = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stream=True,
                                                       stream_options={"include_usage": True})
            async for chunk in stream:
                chunks.append(chunk)
                for c in chunk.choices:
                    text += c.text
                    ids += c.model_extra["splitspec"]["token_ids"]
                    flags += c.model_extra["splitspec"]["drafted"]
                    assert "".join(c.model_extra["splitspec"]["token_text"]) == c.text
            assert text == choice.text and ids == choice.model_extra["splitspec"]["token_ids"]
            assert any(len(c.choices[0].model_extra["splitspec"]["token_ids"]) > 1 for c in chunks[:-1])
            assert flags == drafted  # greedy: the same steps, the same accepted drafts
            last = chunks[-1]
            assert last.choices == [] and last.usage.completion_tokens == 40
            timed = ("drafter_wait_s",)  # a time, which differs from run to run
            assert {k: v for k, v in last.model_extra["speculation"].items() if k not in timed} == \
                {k: v for k, v in spec.items() if k not in timed}
            assert last.model_extra["speculation"]["drafter_wait_s"] > 0 < spec["drafter_wait_s"]
            assert chunks[-2].choices[0].finish_reason == "length"

    asyncio.run(main())


def test_chat_stream_equals_whole_and_grpc_with_stop_string_cut_or_kept() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            plain = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30)
            full = plain.choices[0].message.content
            stop = full[8:11]  # a string the answer contains: it must end it, and never appear
            assert len(stop) == 3 and stop.strip()
            whole = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, stop=[stop])
            text = whole.choices[0].message.content
            assert whole.choices[0].finish_reason == "stop" and stop not in text and full.startswith(text)
            assert text == full[:full.index(stop)]
            grpc_out = await grpc_generate(h, chat=verifier_pb2.ChatMessages(messages=[
                verifier_pb2.ChatMessage(**m) for m in CHAT]), stopping=verifier_pb2.StoppingCriteria(
                max_new_tokens=30, stop=[stop]))
            assert grpc_out.text == text and grpc_out.stop_reason == stop
            assert whole.choices[0].model_extra["stop_reason"] == stop

            deltas, roles = [], []
            stream = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, stop=stop,
                                                            stream=True)
            async for chunk in stream:
                assert chunk.object == "chat.completion.chunk" and chunk.usage is None
                for c in chunk.choices:
                    roles += [c.delta.role] if c.delta.role else []
                    deltas.append(c.delta.content or "")
                    assert stop not in "".join(deltas)  # not even for one chunk
            assert roles == ["assistant"] and "".join(deltas) == text

            # vLLM's include_stop_str_in_output: the same tokens, and the text keeps the stop string, in a
            # stream too, and nothing after it.
            kept = full[:full.index(stop) + len(stop)]
            keep = {"include_stop_str_in_output": True}
            whole_kept = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30,
                                                                stop=[stop], extra_body=keep)
            assert whole_kept.choices[0].message.content == kept and whole_kept.choices[0].finish_reason == "stop"
            assert whole_kept.usage.completion_tokens == whole.usage.completion_tokens
            stream = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, stop=stop,
                                                            stream=True, extra_body=keep)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == kept
            grpc_kept = await grpc_generate(h, chat=verifier_pb2.ChatMessages(messages=[
                verifier_pb2.ChatMessage(**m) for m in CHAT]), stopping=verifier_pb2.StoppingCriteria(
                max_new_tokens=30, stop=[stop], include_stop_str_in_output=True))
            assert grpc_kept.text == kept and list(grpc_kept.token_ids) == list(grpc_out.token_ids)

    asyncio.run(main())


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far() -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk of a choice carries the choice's prompt and
    the tokens it has been sent so far (with include_usage; without it, none)."""
    async def main() -> None:
        async with http_verifier() as h:
            for chat in (True, False):
                options = {"include_usage": True, "continuous_usage_stats": True}
                if chat:
                    stream = await h.client.chat.completions.create(
                        model="tiny", messages=CHAT, max_tokens=24, n=2, seed=1, temperature=0.9, stream=True,
                        stream_options=options)
                else:
                    stream = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                                               stream=True, stream_options=options)
                sent: dict[int, int] = {}
                chunks = [chunk async for chunk in stream]
                prompt_tokens = chunks[-1].usage.prompt_tokens  # the closing chunk's: each prompt once
                for chunk in chunks[:-1]:
                    (choice,) = chunk.choices
                    ids = choice.model_extra["splitspec"]["token_ids"] if "splitspec" in choice.model_extra else []
                    sent[choice.index] = sent.get(choice.index, 0) + len(ids)
                    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
                        prompt_tokens, sent[choice.index], prompt_tokens + sent[choice.index])
                assert sent == ({0: 24, 1: 24} if chat else {0: 24})
                assert chunks[-1].usage.completion_tokens == sum(sent.values())  # the closing chunk: all choices
            stream = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=True,
                                                       stream_options={"continuous_usage_stats": True})
            assert all([chunk.usage is None async for chunk in stream])  # continuous usage goes with include_usage

    asyncio.run(main())


def test_sagemakers_invocations_route_answers_a_chat_or_a_completion_as_its_own_route_does() -> None:
    """vLLM's /invocations (what SageMaker's invoke_endpoint posts to): a body with `messages` is a chat
    completion, one with `prompt` a completion, whole or streamed."""
    cases = [("/v1/chat/completions", {"messages": CHAT}, "chat.completion", "chat.completion.chunk"),
             ("/v1/completions", {"prompt": PROMPT}, "text_completion", "text_completion")]

    def text(choice: dict) -> str:  # a whole answer's or a chunk's
        return choice.get("text") or choice.get("message", choice.get("delta", {})).get("content") or ""

    async def main() -> None:
        async with http_verifier() as h:
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                for route, question, kind, chunk_kind in cases:
                    body = {"model": "tiny", "max_tokens": 12, **question}
                    direct, invoked = [(await http.post(path, json=body)).json() for path in (route, "/invocations")]
                    assert invoked["object"] == direct["object"] == kind
                    assert ([(text(c), c["finish_reason"], c["splitspec"]["token_ids"]) for c in invoked["choices"]]
                            == [(text(c), c["finish_reason"], c["splitspec"]["token_ids"]) for c in direct["choices"]])
                    counts = ("prompt_tokens", "completion_tokens")  # the second one's prompt comes from the cache
                    assert [invoked["usage"][k] for k in counts] == [direct["usage"][k] for k in counts]
                    async with http.stream("POST", "/invocations", json={**body, "stream": True}) as s:
                        events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
                    chunks = [json.loads(e) for e in events[:-1]]
                    assert events[-1] == "[DONE]" and {c["object"] for c in chunks} == {chunk_kind}
                    assert "".join(text(c["choices"][0]) for c in chunks) == text(direct["choices"][0])

    asyncio.run(main())


def test_usage_counts_the_prompt_tokens_the_prefix_cache_supplied() -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens, on chat and completions, streamed or not."""
    async def main() -> None:
        async with http_verifier() as h:
            first = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
            again = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
            prompt = first.usage.prompt_tokens
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
            stream = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, seed=3,
                                                       temperature=1.0, stream=True,
                                                       stream_options={"include_usage": True})
            last = [chunk async for chunk in stream][-1]
            cold = (await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)).usage
            assert last.usage.prompt_tokens == cold.prompt_tokens  # one prompt, counted once for its n choices
            assert last.usage.prompt_tokens_details.cached_tokens == 0  # the first sight of that prompt
            assert cold.prompt_tokens_details.cached_tokens == (cold.prompt_tokens - 1) // 16 * 16

    asyncio.run(main())


def test_a_cache_salt_keeps_the_prefix_cache_to_requests_of_the_same_salt() -> None:
    """vLLM's cache_salt (the openai client's extra_body), on chat, completions and responses: a salted
    prompt is cached for its own salt alone; an empty salt is a 400 naming the field."""
    async def main() -> None:
        async with http_verifier() as h:
            answers = [await h.client.chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=4, extra_body={"cache_salt": salt} if salt else None)
                for salt in ("a" * 43, None, "b" * 43, "a" * 43, None)]
            assert len({a.choices[0].message.content for a in answers}) == 1
            full = (answers[0].usage.prompt_tokens - 1) // 16 * 16
            assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, 0, 0, full, full] and full
            completion = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                                           extra_body={"cache_salt": "c"})
            assert completion.usage.prompt_tokens_details.cached_tokens == 0
            response = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2,
                                                       extra_body={"cache_salt": "d"})
            assert response.usage.input_tokens_details.cached_tokens == 0
            response = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2,
                                                       extra_body={"cache_salt": "d"})
            assert response.usage.input_tokens_details.cached_tokens > 0
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                                  extra_body={"cache_salt": ""})

    asyncio.run(main())


def test_skip_special_tokens_false_writes_special_tokens_into_the_text() -> None:
    """vLLM's skip_special_tokens: the same tokens either way; false spells the special ones out."""
    eos = tiny_tokenizer().eos_token_id  # pushed to the top by logit_bias; ignore_eos generates past it
    body = {"logit_bias": {str(eos): 100}, "ignore_eos": True}

    async def main() -> None:
        async with http_verifier() as h:
            skipped = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body=body)
            written = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                                        extra_body={**body, "skip_special_tokens": False})
            assert skipped.choices[0].text == "" and written.choices[0].text == "<eos>" * 3
            assert skipped.choices[0].model_extra["splitspec"]["token_ids"] == [eos] * 3
            assert written.choices[0].model_extra["splitspec"]["token_ids"] == [eos] * 3
            over_grpc = await grpc_generate(h, prompt=PROMPT, skip_special_tokens=False, sampling=verifier_pb2.
                                            SamplingParams(logit_bias={eos: 100}), stopping=verifier_pb2.
                                            StoppingCriteria(max_new_tokens=3, ignore_eos=True))
            assert over_grpc.text == "<eos>" * 3

    asyncio.run(main())


def test_seeded_sampling_reproduces_and_n_choices_are_separate_sequences() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            ask = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
                       extra_body={"top_k": 50})
            a = await h.client.completions.create(seed=7, **ask)
            b = await h.client.completions.create(seed=7, **ask)
            assert a.choices[0].text == b.choices[0].text
            many = await h.client.completions.create(seed=7, n=3, **ask)
            assert [c.index for c in many.choices] == [0, 1, 2]
            # Choice i is its own sequence, seeded seed + i, speculating in the same batch.
            for i, c in enumerate(many.choices):
                alone = await h.client.completions.create(seed=7 + i, **ask)
                assert c.text == alone.choices[0].text
            assert many.usage.completion_tokens == 48
            stream = await h.client.completions.create(seed=7, n=3, stream=True, **ask)
            texts = ["", "", ""]
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.text
            assert texts == [c.text for c in many.choices]
            plain = await h.client.completions.create(
                seed=7, extra_body={"top_k": 50, "speculation": {"disable": True}},
                **{k: v for k, v in ask.items() if k != "extra_body"})
            assert plain.choices[0].text == a.choices[0].text  # seeded output does not depend on speculation
            assert plain.model_extra["speculation"]["num_drafts"] == 0

    asyncio.run(main())


def test_a_batch_of_prompts_answers_each_as_if_sent_alone() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            texts = [PROMPT, "d10 add"]
            ask = dict(model="tiny", max_tokens=12, temperature=0.9, seed=3, n=2)
            batch = await h.client.completions.create(prompt=texts, **ask)
            # Prompt by prompt, n choices each, every one what its prompt gets alone (choice j seeded seed + j).
            alone = [await h.client.completions.create(prompt=t, **ask) for t in texts]
            assert [c.index for c in batch.choices] == [0, 1, 2, 3]
            assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
            assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
            assert batch.usage.completion_tokens == 48
            stream = await h.client.completions.create(prompt=texts, stream=True, **ask)
            streamed = [""] * 4
            async for chunk in stream:
                for c in chunk.choices:
                    streamed[c.index] += c.text
            assert streamed == [c.text for c in batch.choices]
            # Token-id prompts, greedy, with speculation: each as alone, drafts accepted.
            ids = [h.tokenizer(t)["input_ids"] for t in texts]
            greedy = await h.client.completions.create(model="tiny", prompt=ids, max_tokens=20)
            for c, one in zip(greedy.choices, ids, strict=True):
                single = (await h.client.completions.create(model="tiny", prompt=one, max_tokens=20)).choices[0]
                assert c.model_extra["splitspec"]["token_ids"] == single.model_extra["splitspec"]["token_ids"]
            assert greedy.model_extra["speculation"]["num_accepted_tokens"] > 0
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())


def model_prompt_logprobs(prompt: list[int], n: int) -> list[tuple[int, float, int, dict[int, float]] | None]:
    """From the model itself: per prompt token after the first, (token, log-probability, rank, the n most
    likely tokens' log-probabilities)."""
    with torch.no_grad():
        logp = torch.log_softmax(shared_model()(torch.tensor([prompt])).logits[0].float(), dim=-1)
    rows: list[tuple[int, float, int, dict[int, float]] | None] = [None]
    for row, token in zip(logp, prompt[1:]):
        top = row.topk(n)
        rows.append((token, row[token].item(), int((row >= row[token]).sum()),
                     dict(zip(top.indices.tolist(), top.values.tolist()))))
    return rows


def assert_vllm_prompt_logprobs(got: list, prompt: list[int], n: int) -> None:
    """vLLM's shape: null first, then {token id: {logprob, rank, decoded_token}}, the prompt token first."""
    expected = model_prompt_logprobs(prompt, n)
    assert len(got) == len(prompt) and got[0] is None
    for entry, (token, logprob, rank, top) in zip(got[1:], expected[1:]):
        assert next(iter(entry)) == str(token)
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == rank
        assert entry.keys() == {str(token), *map(str, top)}
        for i, (alt, alt_logprob) in enumerate(top.items(), 1):
            assert entry[str(alt)]["logprob"] == pytest.approx(alt_logprob, abs=1e-4)
            assert entry[str(alt)]["rank"] == (rank if alt == token else i)
        assert all(e["decoded_token"] == tiny_tokenizer().decode([int(t)]) for t, e in entry.items())


def test_vllms_prompt_logprobs_score_the_prompt_on_completions_and_chat() -> None:
    """vLLM's `prompt_logprobs` (the official client sends it in extra_body): each completion choice carries its
    prompt's, a chat response its one prompt's; with speculation on, and equal to gRPC's (rank included)."""
    async def main() -> None:
        async with http_verifier() as h:
            ids = h.tokenizer(PROMPT)["input_ids"]
            prompts = [ids, ids[3:9]]
            r = await h.client.completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2,
                                                  extra_body={"prompt_logprobs": 2})
            for c in r.choices:
                assert_vllm_prompt_logprobs(c.model_extra["prompt_logprobs"], prompts[c.index // 2], 2)
            grpc_out = await grpc_generate(h, token_ids=verifier_pb2.TokenIds(ids=ids), prompt_logprobs=2,
                                           stopping=verifier_pb2.StoppingCriteria(max_new_tokens=6))
            first = r.choices[0].model_extra["prompt_logprobs"]
            assert [(lp.token_id, lp.rank) for lp in grpc_out.prompt_logprobs] == [
                (int(t), e["rank"]) for entry in first[1:] for t, e in list(entry.items())[:1]]
            assert r.choices[0].text == grpc_out.text  # the answer itself is unchanged
            chat = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2,
                                                          extra_body={"prompt_logprobs": 0})
            rendered = h.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
            chat_ids = h.tokenizer(rendered, add_special_tokens=False)["input_ids"]
            assert chat.usage.prompt_tokens == len(chat_ids)
            assert_vllm_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_ids, 0)
            assert all("prompt_logprobs" not in c.model_extra for c in chat.choices)
            # Without the field, none: echo's log-probabilities stay where OpenAI puts them.
            plain = await h.client.completions.create(model="tiny", prompt=ids, max_tokens=2, echo=True, logprobs=1)
            assert "prompt_logprobs" not in plain.choices[0].model_extra
            assert plain.choices[0].logprobs.token_logprobs[0] is None

    asyncio.run(main())


def test_echo_with_logprobs_scores_each_prompt_as_an_evaluation_harness_asks() -> None:
    """lm-evaluation-harness scores a text with a batch of token-id prompts, echo, logprobs and max_tokens 1:
    each choice is its prompt then its token, the prompt's tokens' log-probabilities first (the first null)."""
    async def main() -> None:
        async with http_verifier() as h:
            ids = [h.tokenizer(t)["input_ids"] for t in (PROMPT, "d10 add d10")]
            scored = await h.client.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=2, echo=True,
                                                       temperature=0)
            for c, prompt in zip(scored.choices, ids, strict=True):
                alone = await grpc_generate(h, token_ids=verifier_pb2.TokenIds(ids=prompt), prompt_logprobs=2,
                                            logprobs=2, stopping=verifier_pb2.StoppingCriteria(max_new_tokens=1))
                lp = c.logprobs
                assert c.text == h.tokenizer.decode(prompt) + alone.text
                assert lp.tokens == [h.tokenizer.decode([t]) for t in [*prompt, *alone.token_ids]]
                expected = [*alone.prompt_logprobs, *alone.logprobs]
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                # Within the README's 1e-4: batched with another prompt, a forward may take other CPU kernels.
                assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in expected], abs=1e-4)
                # The most likely tokens, then the token there (OpenAI's up to logprobs + 1; two tokens may
                # spell the same text), whose entry is its own log-probability.
                there = [*prompt[1:], *alone.token_ids]
                assert [list(top) for top in lp.top_logprobs[1:]] == [
                    list(dict.fromkeys(h.tokenizer.decode([t]) for t in (*(x.token_id for x in e.top), token)))
                    for e, token in zip(expected, there, strict=True)]
                assert any(len(top) == 3 for top in lp.top_logprobs[1:])  # a prompt token outside the top 2
                assert all(top[name] == value for top, name, value in
                           zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:], strict=True))
                assert lp.text_offset[0] == 0 and lp.text_offset[len(prompt)] == len(h.tokenizer.decode(prompt))
                assert lp.text_offset == sorted(lp.text_offset)
            # Streamed: the prompt comes first in each choice's first chunk; the same text and log-probabilities.
            whole = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=0,
                                                      echo=True)
            text, tokens, offsets = "", [], []
            stream = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=0,
                                                       echo=True, stream=True)
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.text
                    tokens += c.logprobs.tokens
                    offsets += c.logprobs.text_offset
            assert (text, tokens, offsets) == (whole.choices[0].text, whole.choices[0].logprobs.tokens,
                                               whole.choices[0].logprobs.text_offset)
            # Without logprobs: the text only.
            plain = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, echo=True)
            assert plain.choices[0].text == whole.choices[0].text and plain.choices[0].logprobs is None
            # max_tokens 0 (vLLM's prompt-only echo): the prompt and its log-probabilities, nothing generated.
            alone = await h.client.completions.create(model="tiny", prompt=ids[0], max_tokens=0, logprobs=2, echo=True)
            c = alone.choices[0]
            assert c.text == h.tokenizer.decode(ids[0]) and c.finish_reason == "length"
            assert c.logprobs.token_logprobs == scored.choices[0].logprobs.token_logprobs[:-1]
            assert c.model_extra["splitspec"]["token_ids"] == [] and alone.usage.completion_tokens == 0
            stream = await h.client.completions.create(model="tiny", prompt=ids[0], max_tokens=0, logprobs=2,
                                                       echo=True, stream=True)
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == c.text
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())


def test_logprobs_equal_with_and_without_speculation_and_over_grpc_and_name_tokens_by_id() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            # The chat template's text is the prompt itself: the model loops on it, drafts are accepted.
            ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=30, logprobs=True,
                       top_logprobs=3, extra_body={"stop_token_ids": [], "ignore_eos": True})
            spec = await h.client.chat.completions.create(**ask)
            plain = await h.client.chat.completions.create(**(ask | {"extra_body": ask["extra_body"] | {
                "speculation": {"disable": True}}}))
            assert plain.model_extra["speculation"]["num_drafts"] == 0
            a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
            assert [t.token for t in a] == [t.token for t in b] and len(a) == 30
            for x, y in zip(a, b):
                assert abs(x.logprob - y.logprob) < 1e-3
                assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
                assert all(abs(p.logprob - q.logprob) < 1e-3 for p, q in zip(x.top_logprobs, y.top_logprobs))
                assert len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob >= x.logprob - 1e-6
            # Greedy: each token is its position's most likely one.
            assert all(t.token == t.top_logprobs[0].token for t in a)

            grpc_out = await grpc_generate(h, chat=verifier_pb2.ChatMessages(messages=[
                verifier_pb2.ChatMessage(role="user", content=PROMPT)]), stopping=verifier_pb2.StoppingCriteria(
                max_new_tokens=30, ignore_eos=True), logprobs=3)
            assert len(grpc_out.logprobs) == 30 and list(grpc_out.drafted) == spec.choices[0].model_extra[
                "splitspec"]["drafted"]
            ids = spec.choices[0].model_extra["splitspec"]["token_ids"]
            assert [lp.token_id for lp in grpc_out.logprobs] == ids == list(grpc_out.token_ids)
            for lp, x in zip(grpc_out.logprobs, a):
                assert abs(lp.logprob - x.logprob) < 1e-3 and len(lp.top) == 3

            # Completions on a prompt the model loops on: most tokens are accepted drafts.
            comp = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, logprobs=2)
            comp_plain = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, logprobs=2,
                                                           extra_body={"speculation": {"disable": True}})
            assert comp.model_extra["speculation"]["num_accepted_tokens"] > 10
            lps, plain_lps = comp.choices[0].logprobs, comp_plain.choices[0].logprobs
            assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == 30
            assert lps.tokens == plain_lps.tokens
            assert all(abs(x - y) < 1e-3 for x, y in zip(lps.token_logprobs, plain_lps.token_logprobs))
            assert lps.text_offset[0] == 0 and all(len(t) <= 2 for t in lps.top_logprobs)
            assert lps.text_offset == plain_lps.text_offset
            no = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
            assert no.choices[0].logprobs is None

            # vLLM's return_tokens_as_token_ids: every token named "token_id:N", the numbers the same.
            named = {"return_tokens_as_token_ids": True}
            by_id = await h.client.chat.completions.create(**(ask | {"extra_body": ask["extra_body"] | named}))
            assert [t.token for t in by_id.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
            first = by_id.choices[0].logprobs.content[0]
            assert first.bytes == list(first.token.encode()) and first.top_logprobs[0].token == first.token
            comp_ids = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, logprobs=2,
                                                         extra_body=named)
            assert comp_ids.choices[0].logprobs.tokens == [
                f"token_id:{t}" for t in comp_ids.choices[0].model_extra["splitspec"]["token_ids"]]
            assert all(k.startswith("token_id:") for top in comp_ids.choices[0].logprobs.top_logprobs for k in top)

    asyncio.run(main())


def test_structured_output_through_the_openai_client_equals_grpc_with_and_without_speculation() -> None:
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and guided_choice:
    the answer obeys, streamed equals whole, and speculation and gRPC give the same tokens."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # compact: a random model would wander in whitespace

    async def main() -> None:
        async with http_verifier() as h:
            fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
            ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=40, response_format=fmt)
            spec = await h.client.chat.completions.create(**ask)
            plain = await h.client.chat.completions.create(**ask, extra_body={"speculation": {"disable": True}})
            answer = json.loads(spec.choices[0].message.content)
            assert set(answer) == {"city", "ok"} and isinstance(answer["ok"], bool)
            assert spec.choices[0].finish_reason == "stop" and plain.choices[0].message.content == \
                spec.choices[0].message.content
            assert spec.model_extra["speculation"]["num_drafts"] > 0  # the drafter was asked, its drafts checked
            stream = await h.client.chat.completions.create(**ask, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == \
                spec.choices[0].message.content
            grpc_out = await grpc_generate(
                h, chat=verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(role="user", content=PROMPT)]),
                stopping=verifier_pb2.StoppingCriteria(max_new_tokens=40),
                structured_output=verifier_pb2.StructuredOutput(json_schema=json.dumps(schema)))
            assert list(grpc_out.token_ids) == spec.choices[0].model_extra["splitspec"]["token_ids"]

            for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "any"}}):
                whole = await h.client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40, response_format=fmt)
                if whole.choices[0].finish_reason == "stop":
                    assert isinstance(json.loads(whole.choices[0].message.content), dict)
                else:  # out of tokens mid-object: still the start of one
                    assert whole.choices[0].message.content.startswith("{")
            loose = {k: v for k, v in schema.items() if k != "x-guidance"}  # vLLM's option makes it compact
            compact = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, extra_body={
                "structured_outputs": {"json": loose, "disable_any_whitespace": True}})
            assert json.loads(compact.choices[0].text) and compact.choices[0].text.startswith('{"city":"')
            for extra in ({"structured_outputs": {"choice": ["red", "green"]}}, {"guided_choice": ["red", "green"]}):
                comp = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=extra)
                assert comp.choices[0].text in ("red", "green") and comp.choices[0].finish_reason == "stop"
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())


def test_truncate_prompt_tokens_answers_as_the_prompts_last_tokens_alone() -> None:
    """vLLM's truncate_prompt_tokens through the openai client's extra_body: the answer, the usage and the
    echo are those of the prompt's last N tokens sent alone (gRPC token ids), on chat after the template; -1
    keeps as many as leave room for max_tokens, so a prompt longer than the context is answered."""
    async def main() -> None:
        async with http_verifier() as h:
            tok = h.tokenizer
            ids = tok(PROMPT)["input_ids"]
            keep = len(ids) // 2
            got = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, echo=True,
                                                    extra_body={"truncate_prompt_tokens": keep})
            alone = await grpc_generate(h, token_ids=verifier_pb2.TokenIds(ids=ids[-keep:]),
                                        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=16))
            assert got.choices[0].model_extra["splitspec"]["token_ids"] == list(alone.token_ids)
            assert got.choices[0].text == tok.decode(ids[-keep:]) + alone.text
            assert got.usage.prompt_tokens == keep

            rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
            chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
            got = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16,
                                                         extra_body={"truncate_prompt_tokens": 12})
            alone = await grpc_generate(h, token_ids=verifier_pb2.TokenIds(ids=chat_ids[-12:]),
                                        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=16))
            assert got.choices[0].message.content == alone.text and got.usage.prompt_tokens == 12

            context = h.v.running.runtime.max_model_len
            long = " ".join(["d10 add"] * context)  # more tokens than the context holds
            assert len(tok(long)["input_ids"]) > context
            got = await h.client.completions.create(model="tiny", prompt=long, max_tokens=8,
                                                    extra_body={"truncate_prompt_tokens": -1})
            assert got.usage.prompt_tokens == context - 8 and got.usage.completion_tokens == 8

    asyncio.run(main())


def test_models_health_metrics() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h:  # no --metrics-port: /metrics on the API's port all the same
            models = await h.client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            assert models.data[0].model_extra["max_model_len"] == 256
            assert await h.client.models.retrieve("tiny") == models.data[0]
            with pytest.raises(openai.NotFoundError, match="'gpt-9' is not served here; served: tiny"):
                await h.client.models.retrieve("gpt-9")
            async with __import__("httpx").AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                assert (await http.get("/health")).status_code == 200
                await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
                metrics = (await http.get("/metrics")).text
                assert 'splitspec:generation_tokens_total 3.0' in metrics  # the same registry as --metrics-port
                page = await http.get("/")
                assert page.status_code == 200 and "splitspec playground" in page.text
                assert "http://" not in page.text.replace("http://www.w3.org", "")  # nothing fetched from outside
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())
