"""A model's recommended sampling (its generation_config.json, as vLLM's --generation-config auto
applies it): what a request leaves out takes it, on every front, and what a request sets wins. The
file read at start-up, the flags and their refusals: tests/verifier/model/test_generation_config.py;
`auto` from a real process's --model folder: tests/http/test_http_process.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import pytest
from http_support import WAIT_S, http_verifier, wait_until
from tiny_model import tiny_tokenizer
from verifier_harness import reference_greedy
from verifier_support import shared_model

from drafter_sdk.proto import verifier_pb2

RECOMMENDED = {"temperature": 0.9, "top_k": 8, "max_new_tokens": 6, "do_sample": True}
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return tmp_path


def _grpc_params(seed: int, speculate: bool, **sampling: float) -> verifier_pb2.GenerationParams:
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    return verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=ids),
                                         sampling=verifier_pb2.SamplingParams(seed=seed, **sampling),
                                         speculation=verifier_pb2.SpeculationOverrides(disable=not speculate))


def test_left_out_fields_take_the_models_recommendation_on_every_front(config_dir: Path) -> None:
    async def main() -> None:
        async with http_verifier(generation_config=str(config_dir)) as h:
            stub = h.v.stub
            info = await stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.default_max_new_tokens == 6
            assert info.default_sampling.top_k == 8 and abs(info.default_sampling.temperature - 0.9) < 1e-6
            assert not info.default_sampling.HasField("top_p")

            # gRPC: unset, speculating, against the same sampling set explicitly, not speculating. Seeded
            # sampling draws once per emitted token, so drafts change nothing.
            sampled = []
            for seed in range(4):
                left_out = (await stub.Generate(verifier_pb2.GenerateRequest(params=_grpc_params(seed, True)),
                                                timeout=WAIT_S)).output
                explicit = (await stub.Generate(verifier_pb2.GenerateRequest(
                    params=_grpc_params(seed, False, temperature=0.9, top_k=8)), timeout=WAIT_S)).output
                assert list(left_out.token_ids) == list(explicit.token_ids) and len(left_out.token_ids) == 6
                sampled.append(list(left_out.token_ids))
            # It samples: greedy (asked for, 0 set explicitly) is what transformers' greedy generate gives.
            greedy = (await stub.Generate(verifier_pb2.GenerateRequest(params=_grpc_params(0, True, temperature=0.0)),
                                          timeout=WAIT_S)).output
            ids = tiny_tokenizer()(PROMPT)["input_ids"]
            assert list(greedy.token_ids) == reference_greedy(shared_model(), ids, 6)
            assert any(s != list(greedy.token_ids) for s in sampled)

            # The HTTP fronts: left out, then set as the model recommends, with one seed.
            c = h.client
            a = await c.chat.completions.create(model="tiny", messages=CHAT, seed=5)
            b = await c.chat.completions.create(model="tiny", messages=CHAT, seed=5, temperature=0.9, max_tokens=6,
                                                extra_body={"top_k": 8})
            assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens == 6
            a = await c.completions.create(model="tiny", prompt=PROMPT, seed=5)
            b = await c.completions.create(model="tiny", prompt=PROMPT, seed=5, temperature=0.9, max_tokens=6,
                                           extra_body={"top_k": 8})
            assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 6
            a = await c.responses.create(model="tiny", input=PROMPT, extra_body={"seed": 5})
            b = await c.responses.create(model="tiny", input=PROMPT, temperature=0.9, max_output_tokens=6,
                                         extra_body={"seed": 5, "top_k": 8})
            assert a.output_text == b.output_text and a.usage.output_tokens == 6
            assert (a.temperature, a.top_p) == (b.temperature, b.top_p) == (0.9, 1.0)  # what was applied
            claude = anthropic.AsyncAnthropic(base_url=h.base_url, api_key="unused", max_retries=0, timeout=WAIT_S)
            try:
                a = await claude.messages.create(model="tiny", messages=CHAT, max_tokens=6, extra_body={"seed": 5})
                b = await claude.messages.create(model="tiny", messages=CHAT, max_tokens=6,
                                                 extra_body={"seed": 5, "temperature": 0.9, "top_k": 8})
            finally:
                await claude.close()
            assert a.content == b.content
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())


def test_vllm_reads_none_and_overrides_set_keys_on_top(config_dir: Path) -> None:
    async def main() -> None:
        ids = tiny_tokenizer()(PROMPT)["input_ids"]
        async with http_verifier(generation_config="vllm", speculate=False) as h:  # the file is not read
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.default_sampling == verifier_pb2.SamplingParams()
            out = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
            assert out.choices[0].text == tiny_tokenizer().decode(reference_greedy(shared_model(), ids, 6))
        # The flag's max_new_tokens wins over the file's; an override's temperature over the file's.
        async with http_verifier(generation_config=str(config_dir), default_max_new_tokens=3,
                                 override_generation_config={"temperature": 0}, speculate=False) as h:
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.default_max_new_tokens == 3 and info.default_sampling.HasField("temperature")
            assert info.default_sampling.temperature == 0 and info.default_sampling.top_k == 8
            out = await h.client.completions.create(model="tiny", prompt=PROMPT)
            assert out.choices[0].text == tiny_tokenizer().decode(reference_greedy(shared_model(), ids, 3))

    asyncio.run(main())


def test_a_length_left_out_is_the_rest_of_the_context_and_a_completions_at_most_16_tokens() -> None:
    """As vLLM: with no length set anywhere, an answer may run to the end of the context (OpenAI's chat and
    Responses APIs answer until the model stops); a completion whose max_tokens is left out takes OpenAI's
    16, within what the context leaves, and an explicit null the server's length."""
    max_model_len = 64

    async def main() -> None:
        ids = tiny_tokenizer()(PROMPT)["input_ids"]
        room = max_model_len - len(ids)
        async with http_verifier(generation_config="vllm", max_model_len=max_model_len) as h:
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.default_max_new_tokens == max_model_len  # "within what the context leaves": all of it
            c, forever = h.client, {"ignore_eos": True}
            chat = await c.chat.completions.create(model="tiny", messages=CHAT, extra_body=forever)
            assert chat.choices[0].finish_reason == "length"
            assert chat.usage.prompt_tokens + chat.usage.completion_tokens == max_model_len
            answer = await c.responses.create(model="tiny", input=PROMPT, extra_body=forever)
            assert answer.usage.input_tokens + answer.usage.output_tokens == max_model_len
            grpc_out = (await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                token_ids=verifier_pb2.TokenIds(ids=ids), stopping=verifier_pb2.StoppingCriteria(ignore_eos=True))),
                timeout=WAIT_S)).output
            assert len(grpc_out.token_ids) == room
            # Completions: 16 left out, what fits where 16 does not, and the rest of the context with null.
            short = await c.completions.create(model="tiny", prompt=ids, extra_body=forever)
            assert short.usage.completion_tokens == 16 and short.choices[0].finish_reason == "length"
            assert short.choices[0].text == tiny_tokenizer().decode(
                reference_greedy(shared_model(), ids, 16), skip_special_tokens=True)
            tight = [*ids] * ((max_model_len - 5) // len(ids)) + ids[:(max_model_len - 5) % len(ids)]
            assert len(tight) == max_model_len - 5
            five = await c.completions.create(model="tiny", prompt=tight, extra_body=forever)
            assert five.usage.completion_tokens == 5  # 16 did not fit: what does, not a 400
            rest = await c.completions.create(model="tiny", prompt=ids, max_tokens=None, extra_body=forever)
            assert rest.usage.completion_tokens == room
            # Truncated to fit (-1) with no length anywhere: the prompt keeps all but one token of the context.
            long = await c.completions.create(model="tiny", prompt=ids * 20, max_tokens=None,
                                              extra_body={"truncate_prompt_tokens": -1, **forever})
            assert (long.usage.prompt_tokens, long.usage.completion_tokens) == (max_model_len - 1, 1)
            await wait_until(h.idle, "the engine idle")
        # The server's own length, where shorter, caps a completion's 16.
        async with http_verifier(default_max_new_tokens=3, speculate=False, max_model_len=max_model_len) as h:
            out = await h.client.completions.create(model="tiny", prompt=ids, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 3

    asyncio.run(main())
