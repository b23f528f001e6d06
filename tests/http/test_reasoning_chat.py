"""Chat completions from a reasoning model (--reasoning-parser), through the official openai client on a real
verifier (the tiny thinking model, a remote n-gram drafter): the thinking comes apart in `reasoning`, the
answer in `content`, whole and streamed alike, and together they are the raw output; structured output and
tool calls hold the answer after free thinking; thinking sent back reaches the template."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from http_support import WAIT_S, http_verifier
from thinking_model import THINKING_CHAT, THINKING_TEMPLATE, thinking_model, thinking_tokenizer
from tiny_model import tiny_model, tiny_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2
from verifier_service.tools.local_services import LocalService, script

REGEX = r"(fox|dog)+ [0-9]{3}"
ARGS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "count", "parameters": ARGS}}]
COUNT = [{"role": "user", "content": "Count to three."}]  # with TOOLS rendered, thought for 31 tokens


def tools_tokenizer():  # noqa: ANN201
    tokenizer = copy.deepcopy(thinking_tokenizer())
    tokenizer.chat_template = "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}" + THINKING_TEMPLATE
    return tokenizer


def serving(**settings: object):  # noqa: ANN201
    return http_verifier(model=thinking_model(), tokenizer=tools_tokenizer(), reasoning_parser="deepseek_r1",
                         max_model_len=512, **settings)


async def streamed(client, messages: list[dict] = THINKING_CHAT, **request: object  # noqa: ANN001
                   ) -> tuple[str, str, list[dict], dict]:
    """(reasoning, content, calls, usage) of a streamed chat, put together as a client does."""
    thought, content, calls, usage = "", "", [], None
    async for chunk in await client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                            stream_options={"include_usage": True}, **request):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                calls.append({"name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
    return thought, content, calls, usage.model_dump()


def test_the_thinking_comes_apart_from_the_answer_whole_and_streamed() -> None:
    async def main() -> None:
        async with serving() as h:
            r = await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40)
            message = r.choices[0].message
            thought, answer = message.reasoning, message.content
            assert thought and answer and "think>" not in thought + answer
            # Together they are the raw output: the same prompt's completion, which nothing splits.
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                ids = (await http.post("/tokenize", json={"messages": THINKING_CHAT})).json()["tokens"]
                raw = (await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 40})).json()
            assert raw["choices"][0]["text"] == f"{thought}</think>{answer}"
            raw_ids = raw["choices"][0]["splitspec"]["token_ids"]
            thought_tokens = raw_ids.index(thinking_tokenizer().convert_tokens_to_ids("</think>")) + 1
            assert r.usage.completion_tokens_details.reasoning_tokens == thought_tokens
            flags = r.choices[0].model_extra["splitspec"]["thinking"]  # per token: thinking or a marker
            assert flags == [True] * thought_tokens + [False] * (40 - thought_tokens)
            got = await streamed(h.client, max_tokens=40)
            assert got[:3] == (thought, answer, [])
            assert got[3]["completion_tokens_details"]["reasoning_tokens"] == thought_tokens
            # vLLM's include_reasoning false: the same answer, without its thinking.
            hidden = await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40,
                                                            extra_body={"include_reasoning": False})
            assert hidden.choices[0].message.content == answer
            assert getattr(hidden.choices[0].message, "reasoning", None) is None
            hidden_stream = await streamed(h.client, max_tokens=40, extra_body={"include_reasoning": False})
            assert hidden_stream[:2] == ("", answer)
            # vLLM's thinking_token_budget: three tokens of thinking, then </think> (counted too), then the answer.
            short = await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40,
                                                           extra_body={"thinking_token_budget": 3})
            assert short.usage.completion_tokens_details.reasoning_tokens == 4 < thought_tokens
            assert short.choices[0].message.reasoning and short.choices[0].message.content
            # A template that closed the thinking (Qwen3's enable_thinking false): all answer.
            closed = await h.client.chat.completions.create(
                model="tiny", messages=THINKING_CHAT, max_tokens=12,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert closed.choices[0].message.reasoning is None and closed.choices[0].message.content
            # n choices, sampled: each choice split on its own, streamed as whole.
            sampled = {"messages": THINKING_CHAT, "max_tokens": 30, "n": 2, "temperature": 1.0, "seed": 4}
            whole = await h.client.chat.completions.create(model="tiny", **sampled)
            parts: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
            async for chunk in await h.client.chat.completions.create(model="tiny", stream=True, **sampled):
                for choice in chunk.choices:
                    parts[choice.index][0] += getattr(choice.delta, "reasoning", None) or ""
                    parts[choice.index][1] += choice.delta.content or ""
            assert [[c.message.reasoning or "", c.message.content or ""] for c in whole.choices] == \
                [parts[0], parts[1]] and parts[0] != parts[1]
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.reasoning_parser == "deepseek_r1"
            # gRPC: the raw output, or with separate_reasoning the same split, whole and streamed.
            params = verifier_pb2.GenerationParams(
                chat=verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(**m) for m in THINKING_CHAT]),
                stopping=verifier_pb2.StoppingCriteria(max_new_tokens=40))
            raw = (await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=WAIT_S)).output
            assert raw.text == f"{thought}</think>{answer}" and not raw.reasoning_text
            assert raw.stats.drafter_wait_s > 0  # a remote drafter's calls, waited for
            params.separate_reasoning = True
            split = (await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=WAIT_S)).output
            assert (split.reasoning_text, split.text) == (thought, answer)
            assert list(split.token_ids) == list(raw.token_ids)  # every token still, markers included
            pieces = [(m.output.reasoning_text, m.output.text) async for m in
                      h.v.stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=params), timeout=WAIT_S)]
            assert ("".join(t for t, _ in pieces), "".join(a for _, a in pieces)) == (thought, answer)
        async with http_verifier(speculate=False) as h:  # no reasoning parser: a budget, a split are refused
            with pytest.raises(grpc.aio.AioRpcError, match="separate_reasoning needs a verifier started with"):
                await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                    prompt="hi", separate_reasoning=True)), timeout=WAIT_S)
            with pytest.raises(openai.BadRequestError, match="thinking_token_budget needs a verifier started with "
                                                             "--reasoning-parser"):
                await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=4,
                                                       extra_body={"thinking_token_budget": 3})

    asyncio.run(main())


def test_structured_output_and_tool_calls_hold_the_answer_after_free_thinking() -> None:
    """A regular expression, tool_choice "required" and a named one hold the answer; "auto" reads the calls the
    answer writes (the random model writes a Hermes block when a regular expression holds it to one)."""
    block = r'<tool_call>\{"name": "count", "arguments": \{"n": [1-9]\}\}</tool_call>'

    async def main() -> None:
        async with serving(enable_auto_tool_choice=True, tool_call_parser="hermes") as h:
            free = (await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT,
                                                           max_tokens=40)).choices[0].message
            r = await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40,
                                                       extra_body={"structured_outputs": {"regex": REGEX}})
            held = r.choices[0].message
            assert held.reasoning == free.reasoning and re.fullmatch(REGEX, held.content)
            assert r.choices[0].finish_reason == "stop"
            assert (await streamed(h.client, max_tokens=40, extra_body={"structured_outputs": {"regex": REGEX}})
                    )[:2] == (held.reasoning, held.content)
            free = (await h.client.chat.completions.create(model="tiny", messages=COUNT, max_tokens=120,
                                                           tools=TOOLS, tool_choice="none")).choices[0].message
            for choice in ("required", {"type": "function", "function": {"name": "count"}}):
                r = await h.client.chat.completions.create(model="tiny", messages=COUNT, max_tokens=120,
                                                           tools=TOOLS, tool_choice=choice)
                message = r.choices[0].message
                assert message.reasoning == free.reasoning, choice
                (call,) = message.tool_calls
                assert call.function.name == "count" and 0 <= json.loads(call.function.arguments)["n"] <= 99
                thought, content, calls, _ = await streamed(h.client, COUNT, max_tokens=120, tools=TOOLS,
                                                            tool_choice=choice)
                assert (thought, calls) == (free.reasoning, [{"name": "count", "arguments": call.function.arguments}])
            r = await h.client.chat.completions.create(model="tiny", messages=COUNT, max_tokens=120, tools=TOOLS,
                                                       extra_body={"structured_outputs": {"regex": block}})
            message = r.choices[0].message
            (call,) = message.tool_calls
            assert message.reasoning == free.reasoning and message.content is None
            assert call.function.name == "count" and r.choices[0].finish_reason == "tool_calls"
            thought, content, calls, _ = await streamed(h.client, COUNT, max_tokens=120, tools=TOOLS,
                                                        extra_body={"structured_outputs": {"regex": block}})
            assert (thought, content, calls) == (free.reasoning, "", [{"name": "count",
                                                                       "arguments": call.function.arguments}])

    asyncio.run(main())


def test_thinking_sent_back_reaches_the_template() -> None:
    """An assistant message's `reasoning` (or its older name, `reasoning_content`) is rendered by the template."""
    async def main() -> None:
        async with serving(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            turn = {"role": "assistant", "content": "5 and 7"}
            chat = [*THINKING_CHAT, turn, {"role": "user", "content": "More?"}]
            counts = []
            for extra in ({}, {"reasoning": "small ones"}, {"reasoning_content": "small ones"}):
                chat[1] = turn | extra
                r = await http.post("/tokenize", json={"messages": chat})
                counts.append(r.json()["count"])
            tokenizer = thinking_tokenizer()
            assert counts[1] == counts[2] == counts[0] + len(tokenizer("<think>small ones</think>",
                                                                      add_special_tokens=False)["input_ids"])

    asyncio.run(main())


def test_a_verifier_process_serves_a_reasoning_model_and_refuses_one_without_markers(tmp_path: Path) -> None:
    """`splitspec-verifier --reasoning-parser`, a real process: the official client reads the thinking apart; a
    model whose tokenizer has no <think> token stops start-up, in one line, before its weights load."""
    thinking, plain, port_file = tmp_path / "thinking", tmp_path / "plain", tmp_path / "http.port"
    thinking_model().save_pretrained(thinking)
    thinking_tokenizer().save_pretrained(thinking)
    tiny_model().save_pretrained(plain)
    tiny_tokenizer().save_pretrained(plain)
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = [script("splitspec-verifier"), "--reasoning-parser", "qwen3", "--max-model-len", "256",
              "--kv-cache-memory-gb", "0.1", "--host", "127.0.0.1", "--port", "0"]
    verifier = LocalService(common + ["--model", str(thinking), "--served-model-name", "tiny", "--http-port", "0",
                                      "--http-port-file", str(port_file)],
                            name="verifier", env=env, startup_timeout_s=WAIT_S)
    with verifier:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{int(port_file.read_text())}/v1", api_key="-",
                               timeout=WAIT_S)
        message = client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40).choices[0].message
        assert message.reasoning and message.content and "think>" not in message.reasoning + message.content
    refused = subprocess.run(common + ["--model", str(plain), "--http-port", "off"], capture_output=True, text=True,
                             timeout=WAIT_S, env={**os.environ, **env})
    assert refused.returncode == 2
    assert "--reasoning-parser qwen3: this model's tokenizer has no single token for '<think>'" in refused.stderr
    assert "loading tokenizer" in refused.stderr and "loading model" not in refused.stderr  # before the weights


def test_an_earlier_turns_thinking_says_nothing_of_this_ones() -> None:
    """A template whose turns end with a special token (as Qwen3's <|im_end|>) and whose generation prompt opens
    no thinking: an earlier assistant turn's thinking, sent back, ends with </think> in the prompt, yet this
    turn's output is thinking first (deepseek_r1's default), not all answer."""
    tokenizer = copy.deepcopy(thinking_tokenizer())
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['reasoning_content'] is defined and "
        "m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<eos>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat = [*THINKING_CHAT, {"role": "assistant", "content": "2, 3, 5.", "reasoning": "small ones"},
            {"role": "user", "content": "And the next?"}]

    async def main() -> None:
        async with http_verifier(speculate=False, model=thinking_model(), tokenizer=tokenizer,
                                 reasoning_parser="deepseek_r1") as h:
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                ids = (await http.post("/tokenize", json={"messages": chat})).json()["tokens"]
                raw = (await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 40})).json()
            assert tokenizer.convert_tokens_to_ids("</think>") in ids  # the earlier turn's
            message = (await h.client.chat.completions.create(model="tiny", messages=chat, max_tokens=40)
                       ).choices[0].message
            text = raw["choices"][0]["text"]
            thought = text.split("</think>", 1)[0]
            assert message.reasoning == thought and thought
            assert (message.content or "") == text[len(thought) + len("</think>"):]

    asyncio.run(main())
