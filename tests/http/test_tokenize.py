"""Tokenize and Detokenize (vLLM's /tokenize and /detokenize) over HTTP and gRPC, on a real verifier:
the ids are those generation starts from, a prompt too long to generate from is counted, not
refused, and every option that would tokenize otherwise than generation does is refused."""

from __future__ import annotations

import argparse
import asyncio
import copy

import grpc
import httpx
import pytest
from http_support import PROMPT, WAIT_S, http_verifier
from tiny_model import CHAT_TEMPLATE, tiny_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2
from verifier_service.tools import cli

CHAT = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def grpc_chat() -> verifier_pb2.ChatMessages:
    # The developer role is the template's system role, on both fronts.
    return verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(role="system", content="Be brief."),
                                               verifier_pb2.ChatMessage(role="user", content=PROMPT)])


def test_tokenize_gives_the_ids_generation_starts_from() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            stub, tokenizer = h.v.stub, h.tokenizer
            # A prompt: the tokenizer's own ids, special tokens added, as completions tokenize it.
            r = (await http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT})).json()
            ids = tokenizer(PROMPT)["input_ids"]
            assert r == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
            r = (await http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})).json()
            assert r["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
            grpc_r = await stub.Tokenize(verifier_pb2.TokenizeRequest(prompt=PROMPT, return_token_strs=True))
            assert list(grpc_r.token_ids) == ids and list(grpc_r.token_strs) == r["token_strs"]
            assert grpc_r.max_model_len == 256

            # Messages: what a chat completion counts as its prompt, and what Generate starts from.
            chat = (await http.post("/tokenize", json={"messages": CHAT})).json()
            completion = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
            assert chat["count"] == completion.usage.prompt_tokens
            grpc_chat_ids = list((await stub.Tokenize(verifier_pb2.TokenizeRequest(chat=grpc_chat()))).token_ids)
            assert grpc_chat_ids == chat["tokens"]
            stopping = verifier_pb2.StoppingCriteria(max_new_tokens=8)
            from_chat = await stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                chat=grpc_chat(), stopping=stopping)), timeout=WAIT_S)
            from_ids = await stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                token_ids=verifier_pb2.TokenIds(ids=grpc_chat_ids), stopping=stopping)), timeout=WAIT_S)
            assert list(from_chat.output.token_ids) == list(from_ids.output.token_ids)
            assert from_chat.output.prompt_tokens == chat["count"]

            # Too long to generate from: counted here, refused by completions.
            long_prompt = PROMPT * 40
            r = (await http.post("/tokenize", json={"prompt": long_prompt})).json()
            assert r["count"] == len(tokenizer(long_prompt)["input_ids"]) > r["max_model_len"]
            refused = await http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})
            assert refused.status_code == 400 and "context" in refused.json()["error"]["message"]

            # Detokenize: ids back to text, special tokens included, on both fronts.
            text = (await http.post("/detokenize", json={"model": "tiny", "tokens": chat["tokens"]})).json()
            assert text == {"prompt": tokenizer.decode(chat["tokens"])}
            grpc_text = await stub.Detokenize(verifier_pb2.DetokenizeRequest(token_ids=chat["tokens"]))
            assert grpc_text.text == text["prompt"]

    asyncio.run(main())


REFUSALS = [  # body, status, words of the message
    ({"prompt": PROMPT, "messages": CHAT}, 400, "either prompt or messages"),
    ({}, 400, "either prompt or messages"),
    ({"prompt": PROMPT, "add_special_tokens": False}, 400, "add_special_tokens"),
    ({"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ({"prompt": PROMPT, "add_generation_prompt": True}, 400, "only messages take add_generation_prompt"),
    ({"prompt": PROMPT, "continue_final_message": True}, 400, "only messages take continue_final_message"),
    ({"messages": CHAT, "continue_final_message": True}, 400, "set add_generation_prompt false too"),
    ({"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ({"prompt": PROMPT, "chat_template_kwargs": {"enable_thinking": False}}, 400, "only messages take"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role 'robot'"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "not served here"),
    # What generation does, said out loud, is accepted.
    ({"prompt": PROMPT, "add_special_tokens": True}, 200, ""),
    ({"messages": CHAT, "add_special_tokens": False, "add_generation_prompt": True, "tools": []}, 200, ""),
    ({"messages": CHAT, "add_generation_prompt": False}, 200, ""),
]


def test_an_answer_begun_for_the_model_is_continued() -> None:
    """vLLM's continue_final_message, with add_generation_prompt false: the last message is left open, the
    prompt is the template's rendering of that, on both fronts and in /tokenize, and the answer continues
    it as a token-id prompt of those ids would; with vLLM's chat echo, the answer's content starts with the
    begun message, whole or streamed. add_generation_prompt false alone leaves the assistant's turn
    unopened."""
    begun = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Sure, here"}]
    left_open = {"add_generation_prompt": False, "continue_final_message": True}

    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            def rendered(messages: list[dict[str, str]], **flags: bool) -> list[int]:
                text = h.tokenizer.apply_chat_template(messages, tokenize=False, **flags)
                return h.tokenizer(text, add_special_tokens=False)["input_ids"]

            want = rendered(begun, **left_open)
            assert h.tokenizer.decode(want).endswith("Sure, here") and want != rendered(begun,
                                                                                       add_generation_prompt=True)
            assert (await http.post("/tokenize", json={"messages": begun, **left_open})).json()["tokens"] == want
            answer = await h.client.chat.completions.create(model="tiny", messages=begun, max_tokens=8,
                                                            extra_body=left_open)
            assert answer.usage.prompt_tokens == len(want)
            from_ids = await h.client.completions.create(model="tiny", prompt=want, max_tokens=8)
            assert answer.choices[0].model_extra["splitspec"]["token_ids"] == from_ids.choices[0].model_extra[
                "splitspec"]["token_ids"]
            echo = {**left_open, "echo": True}
            echoed = await h.client.chat.completions.create(model="tiny", messages=begun, max_tokens=8, extra_body=echo)
            assert echoed.choices[0].message.content == "Sure, here" + answer.choices[0].message.content
            stream = await h.client.chat.completions.create(model="tiny", messages=begun, max_tokens=8, stream=True,
                                                            extra_body=echo)
            deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(deltas) == echoed.choices[0].message.content
            # Echo repeats only an assistant's message: after the user's, the answer is as without it.
            asked = [await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                                            extra_body={"echo": e}) for e in (True, False)]
            assert asked[0].choices[0].message.content == asked[1].choices[0].message.content
            unopened = (await http.post("/tokenize", json={"messages": CHAT[1:], "add_generation_prompt": False}))
            assert unopened.json()["tokens"] == rendered(CHAT[1:], add_generation_prompt=False) != rendered(
                CHAT[1:], add_generation_prompt=True)
            chat = verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(**m) for m in begun],
                                             continue_final_message=True)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat), timeout=WAIT_S)
            assert "set add_generation_prompt false too" in refused.value.details()
            chat.add_generation_prompt = False
            assert list((await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat))).token_ids) == want

    asyncio.run(main())


def test_tokenize_refuses_what_generation_would_not_do() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            for body, status, words in REFUSALS:
                r = await http.post("/tokenize", json=body)
                assert r.status_code == status, (body, r.text)
                if status != 200:
                    assert words in r.json()["error"]["message"], (body, r.text)

    asyncio.run(main())


def test_detokenize_and_grpc_refusals() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            vocab = len(h.tokenizer)
            r = await http.post("/detokenize", json={"tokens": [1, vocab]})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and f"token id {vocab} is outside the vocabulary" in message
            r = await http.post("/detokenize", json={"tokens": [-1]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0"
            assert (await http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
            for call, request, words in [
                    (h.v.stub.Detokenize, verifier_pb2.DetokenizeRequest(token_ids=[vocab]), "outside the vocabulary"),
                    (h.v.stub.Tokenize, verifier_pb2.TokenizeRequest(), "set one of prompt or chat"),
                    (h.v.stub.Tokenize, verifier_pb2.TokenizeRequest(chat=verifier_pb2.ChatMessages()), "no messages")]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request, timeout=WAIT_S)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()

    asyncio.run(main())


# A template that reads a variable of its own (as Qwen3's reads enable_thinking) and refuses a chat that
# opens with the assistant (as many templates refuse roles out of order).
THINKING_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with the user') }}"
                     "{% endif %}" + CHAT_TEMPLATE
                     + "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                       "<think></think>{% endif %}")


def test_chat_template_kwargs_reach_the_template_on_every_front(capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = THINKING_TEMPLATE
    no_thinking = {"enable_thinking": False}
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": PROMPT}],
                                             add_generation_prompt=True, tokenize=False, **no_thinking)
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def main() -> None:
        async with http_verifier(speculate=False, tokenizer=tokenizer) as h, \
                httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            plain = (await http.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
            held = (await http.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": no_thinking})).json()
            assert held["tokens"] == expected != plain
            completion = await h.client.chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=1, extra_body={"chat_template_kwargs": no_thinking})
            assert completion.usage.prompt_tokens == len(expected)
            chat = grpc_chat()
            chat.template_kwargs = '{"enable_thinking": false}'
            assert list((await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat))).token_ids) == expected
            for kwargs, words in [("[1]", "must be a JSON object"), ("{nope", "not valid JSON"),
                                  ('{"add_generation_prompt": false}', "cannot set add_generation_prompt"),
                                  ('{"messages": []}', "cannot set messages")]:
                chat.template_kwargs = kwargs
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat), timeout=WAIT_S)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
            # `splitspec generate --chat-template-kwargs` sends them too: its answer is gRPC's with them.
            parser = argparse.ArgumentParser()
            cli.add_generate(parser.add_subparsers())
            args = parser.parse_args(["generate", PROMPT, "--max-new-tokens", "8", "--target", h.v.address,
                                      "--chat-template-kwargs", '{"enable_thinking": false}'])
            assert await asyncio.to_thread(args.func, args) == 0  # the client blocks: off the server's loop
            alone = verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(role="user", content=PROMPT)],
                                              template_kwargs='{"enable_thinking": false}')
            asked = await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                chat=alone, stopping=verifier_pb2.StoppingCriteria(max_new_tokens=8))), timeout=WAIT_S)
            assert capsys.readouterr().out == asked.output.text + "\n"
            # The template's own refusal is the request's mistake, not the server's.
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}],
                                                              "max_tokens": 1})
            assert r.status_code == 400 and "chat template refused these messages: start with the user" in r.text

    asyncio.run(main())


def test_a_message_sent_in_parts_is_its_parts_joined_by_newlines_as_vllm_joins_them() -> None:
    """vLLM (and TensorRT-LLM) join a message's text parts with a newline, an assistant's refusal among them;
    so do chat completions, Responses and Anthropic's Messages API here: a chat sent in parts renders the
    prompt it renders there."""
    joined = [{"role": "user", "content": "Name three primes.\nBe brief."},
              {"role": "assistant", "content": "No.\nI will not."}, {"role": "user", "content": "Why?"}]
    asked = [{"type": "text", "text": "Name three primes."}, {"type": "input_text", "text": "Be brief."}]
    refused = [{"type": "output_text", "text": "No."}, {"type": "refusal", "refusal": "I will not."}]

    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            want = (await http.post("/tokenize", json={"messages": joined})).json()["tokens"]
            parts = [{"role": "user", "content": asked}, {"role": "assistant", "content": refused}, joined[2]]
            assert (await http.post("/tokenize", json={"messages": parts})).json()["tokens"] == want
            items = [{"role": "user", "content": [{**asked[0], "type": "input_text"}, asked[1]]},
                     {"role": "assistant", "content": refused}, {"role": "user", "content": "Why?"}]
            counted = await http.post("/v1/responses/input_tokens", json={"model": "tiny", "input": items})
            assert counted.json()["input_tokens"] == len(want), counted.text
            # Anthropic's blocks: the empty ones left out, as vLLM's Messages API leaves them.
            blocks = [{"role": "user", "content": [{"type": "text", "text": "Name three primes."},
                                                   {"type": "text", "text": ""},
                                                   {"type": "text", "text": "Be brief."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "No."},
                                                        {"type": "text", "text": "I will not."}]},
                      {"role": "user", "content": "Why?"}]
            counted = await http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": blocks})
            assert counted.json()["input_tokens"] == len(want), counted.text
            # One text, or the same text in one part: the same ids.
            one = [{"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
            assert ((await http.post("/tokenize", json={"messages": one})).json()["tokens"]
                    == (await http.post("/tokenize", json={"messages": joined[2:]})).json()["tokens"])

    asyncio.run(main())


def test_a_speakers_name_reaches_the_template_as_vllm_passes_it() -> None:
    """OpenAI's `name` on a message (a multi-agent chat's speakers) is the template's `name`, over HTTP and gRPC;
    a template that does not write it renders the same prompt as without it."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE.replace("|>{{", "|>{% if m['name'] is defined %}[{{ m['name'] }}] "
                                                    "{% endif %}{{", 1)
    assert tokenizer.chat_template != CHAT_TEMPLATE
    named = [{"role": "user", "content": "Name three primes.", "name": "alice"},
             {"role": "assistant", "content": "2, 3, 5.", "name": "solver"}, {"role": "user", "content": PROMPT}]
    rendered = tokenizer.apply_chat_template(named, add_generation_prompt=True, tokenize=False)
    assert "[alice] Name three primes." in rendered and "[solver] 2, 3, 5." in rendered
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in named]

    async def main() -> None:
        async with http_verifier(speculate=False, tokenizer=tokenizer) as h, \
                httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            assert (await http.post("/tokenize", json={"messages": named})).json()["tokens"] == expected
            assert (await http.post("/tokenize", json={"messages": unnamed})).json()["tokens"] != expected
            completion = await h.client.chat.completions.create(model="tiny", messages=named, max_tokens=1)
            assert completion.usage.prompt_tokens == len(expected)
            chat = verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(**m) for m in named])
            assert list((await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat))).token_ids) == expected
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            plain = [(await http.post("/tokenize", json={"messages": m})).json()["tokens"] for m in (named, unnamed)]
            assert plain[0] == plain[1]

    asyncio.run(main())
