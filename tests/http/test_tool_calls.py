"""Tool calling through the official openai client, on a real verifier (tiny random model, a remote n-gram
drafter) whose tokenizer has a tools-aware chat template: the tools and the chat's earlier calls reach the
template; a named or required tool_choice answers calls held to the tools' schemas, the same streamed (as they are
generated) and whole, and the same as gRPC's constrained answer; "auto" reads the model's Hermes <tool_call>
blocks."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import subprocess
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from http_support import WAIT_S, http_verifier
from tiny_model import tiny_model, tiny_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import cli, tool_calls
from verifier_service.tools.local_services import LocalService, script

# A Hermes-style template: the tools in a system line, an assistant's calls as <tool_call> blocks.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }} "
    "{{ t['function']['parameters'] | tojson }}; {% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}<|assistant|>"
    "{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] }}: {{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tools_tokenizer():  # noqa: ANN201
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def serving(auto: bool = True):  # noqa: ANN201
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"} if auto else {}
    return http_verifier(tokenizer=tools_tokenizer(), max_model_len=1024, **settings)


async def streamed(client: openai.AsyncOpenAI, **request: object) -> tuple[str, list[dict], str, int]:
    """(content, calls, finish_reason, tool-call deltas) of a streamed chat, put together as a client does."""
    content, calls, finish, deltas = "", [], None, 0
    async for chunk in await client.chat.completions.create(model="tiny", stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            deltas += 1
            if call.id is not None:  # a call's first delta names it
                assert call.index == len(calls) and call.id.startswith("chatcmpl-tool-")
                calls.append({"name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish, deltas


def test_a_named_tool_choice_answers_its_call_held_to_the_schema_as_grpc_does() -> None:
    async def main() -> None:
        async with serving() as h:
            r = await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                       max_tokens=60)
            message = r.choices[0].message
            (call,) = message.tool_calls
            assert message.content is None and call.type == "function" and call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            assert r.choices[0].finish_reason == "stop"  # as OpenAI answers a forced call
            # gRPC, with the same tools and the function's schema (compact JSON) as the constraint: the same text.
            asked = verifier_pb2.ChatMessage(role="user", content=ASK[0]["content"])
            chat = verifier_pb2.ChatMessages(messages=[asked], tools=json.dumps(TOOLS))
            grpc_reply = await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                chat=chat, stopping=verifier_pb2.StoppingCriteria(max_new_tokens=60),
                structured_output=tool_calls.compact_json_schema(WEATHER))), timeout=WAIT_S)
            assert grpc_reply.output.text == call.function.arguments
            *whole, deltas = await streamed(h.client, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60)
            assert whole == ["", [{"name": "get_weather", "arguments": call.function.arguments}], "stop"]
            assert deltas > 1  # the arguments streamed as they were generated

    asyncio.run(main())


def test_required_answers_calls_of_the_tools_one_unless_parallel() -> None:
    async def main() -> None:
        async with serving() as h:
            for parallel in (False, True):
                r = await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                           tool_choice="required", parallel_tool_calls=parallel,
                                                           max_tokens=130)
                calls = r.choices[0].message.tool_calls
                assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
                assert len(calls) >= 1 and (parallel or len(calls) == 1)
                for call in calls:
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                assert len({c.id for c in calls}) == len(calls)
                content, streamed_calls, finish, deltas = await streamed(
                    h.client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                    max_tokens=130)
                assert (content, finish) == ("", "tool_calls")
                assert streamed_calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
                assert deltas > 2 * len(calls)  # each call's first delta, then its arguments as they came

    asyncio.run(main())


def test_auto_reads_hermes_calls_and_otherwise_answers_text() -> None:
    """The random model never calls a tool by itself; a regular expression (structured output) makes it
    write one Hermes block, which "auto" then reads as a call."""
    block = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'

    async def main() -> None:
        async with serving() as h:
            r = await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80,
                                                       extra_body={"structured_outputs": {"regex": block}})
            message = r.choices[0].message
            (call,) = message.tool_calls
            assert message.content == "Sure." and call.function.name == "get_time"
            assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
            assert r.choices[0].finish_reason == "tool_calls"
            *whole, deltas = await streamed(h.client, messages=ASK, tools=TOOLS, max_tokens=80,
                                            extra_body={"structured_outputs": {"regex": block}})
            assert whole == ["Sure. ", [{"name": "get_time", "arguments": call.function.arguments}], "tool_calls"]
            assert deltas >= 2  # the call's first delta, then its arguments as they came
            # Text without a block stays text, whole and streamed alike.
            plain = await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=30)
            assert plain.choices[0].message.tool_calls is None
            assert (await streamed(h.client, messages=ASK, tools=TOOLS, max_tokens=30))[0] == \
                plain.choices[0].message.content
        async with serving(auto=False) as h:  # vLLM's rule: "auto" needs a parser
            with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice --tool-call-parser"):
                await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
            none = await h.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                          tool_choice="none", max_tokens=8)
            assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"

    asyncio.run(main())


def test_tools_and_earlier_calls_reach_the_template() -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    arguments_as_an_object = {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}
    as_template_reads_them = [*ASK, {**history[1], "tool_calls": [
        {**history[1]["tool_calls"][0], "function": arguments_as_an_object}]}, history[2]]

    async def main() -> None:
        tokenizer = tools_tokenizer()
        rendered = tokenizer.apply_chat_template(as_template_reads_them, tools=TOOLS, add_generation_prompt=True,
                                                 tokenize=False)
        assert 'get_weather {"type": "object"' in rendered and '<tool_call>{"name": "get_weather"' in rendered
        expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        async with serving() as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            tokenized = (await http.post("/tokenize", json={"messages": history, "tools": TOOLS})).json()
            assert tokenized["tokens"] == expected
            answer = await h.client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                            tool_choice="none", max_tokens=2)
            assert answer.usage.prompt_tokens == len(expected)
            chat = verifier_pb2.ChatMessages(tools=json.dumps(TOOLS), messages=[
                verifier_pb2.ChatMessage(role="user", content=ASK[0]["content"]),
                verifier_pb2.ChatMessage(role="assistant", tool_calls=[verifier_pb2.ToolCall(
                    id="call_1", name="get_weather", arguments='{"city": "Paris", "days": 1}')]),
                verifier_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny")])
            assert list((await h.v.stub.Tokenize(verifier_pb2.TokenizeRequest(chat=chat))).token_ids) == expected

    asyncio.run(main())


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,words", [
    ({"prompt": "x", "tools": TOOLS}, "tools: not supported"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice needs tools"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names 'nope', which is not among the tools"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "send no other structured output with it"),
    ({"messages": MSG, "tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}, "two tools have the same name"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "[1]"}}]}], "tools": TOOLS, "tool_choice": "none"},
     "chat message 0 tool call 0 arguments must be a JSON object"),
])
def test_tool_mistakes_are_400s_naming_them(body: dict, words: str) -> None:
    async def main() -> None:
        async with serving() as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = await http.post(path, json={"max_tokens": 4, **body})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text

    asyncio.run(main())


def test_a_template_without_tools_refuses_them() -> None:
    async def main() -> None:
        async with http_verifier() as h:  # the tiny tokenizer's template writes no tools
            with pytest.raises(openai.BadRequestError, match="chat template does not render tools"):
                await h.client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="none")

    asyncio.run(main())


def test_a_chat_template_given_at_start_up_renders_every_chat(tmp_path: Path) -> None:
    """`splitspec-verifier --chat-template FILE`, a real process: the file's template renders the chat, tools
    included, for the official client (the tiny model's own template has no tools: refused without it); the
    value may also be the template itself; one that does not compile stops start-up before the weights load."""
    model_dir, template, port_file = tmp_path / "tiny", tmp_path / "hermes.jinja", tmp_path / "http.port"
    tiny_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    template.write_text(TOOLS_TEMPLATE)
    def given(value: str) -> str | None:
        return cli.settings_from_args(cli.parser().parse_args(["--chat-template", value])).chat_template

    assert given(str(template)) == TOOLS_TEMPLATE == given(TOOLS_TEMPLATE)
    with pytest.raises(cli.config.ConfigError, match="neither a Jinja template nor a file"):
        given(str(tmp_path / "missing.jinja"))
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = [script("splitspec-verifier"), "--model", str(model_dir), "--max-model-len", "512",
              "--kv-cache-memory-gb", "0.1", "--host", "127.0.0.1", "--port", "0"]
    verifier = LocalService(common + ["--chat-template", str(template), "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes", "--served-model-name", "tiny",
                                      "--http-port", "0", "--http-port-file", str(port_file)],
                            name="verifier", env=env, startup_timeout_s=WAIT_S)
    with verifier:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{int(port_file.read_text())}/v1", api_key="-",
                               timeout=WAIT_S)
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
        rendered = tools_tokenizer().apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert answer.usage.prompt_tokens == len(tools_tokenizer()(rendered, add_special_tokens=False)["input_ids"])
    broken = subprocess.run(common + ["--http-port", "off", "--chat-template", "{% if %}"], capture_output=True,
                            text=True, timeout=WAIT_S, env={**os.environ, **env})
    assert broken.returncode == 2 and "--chat-template does not compile" in broken.stderr
    assert "loading tokenizer" in broken.stderr and "loading model" not in broken.stderr  # before the weights


def test_hermes_reads_blocks_and_leaves_anything_else_as_text() -> None:
    text = 'Let me check. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "b"}'
    assert tool_calls.hermes(text) == ("Let me check.", [tool_calls.Call("a", '{"x": 1}'), tool_calls.Call("b", "{}")])
    for broken in ('<tool_call>{"name": "a", "arguments": ', "<tool_call>[1]</tool_call>",
                   '<tool_call>{"arguments": {}}</tool_call>'):
        assert tool_calls.hermes("so " + broken) == ("so " + broken, [])
    # The arguments as written; json.dumps of them where the text does not hold them after the name.
    assert tool_calls.hermes('<tool_call>{"name": "a", "arguments": {"x":1}}')[1] == [tool_calls.Call("a", '{"x":1}')]
    assert tool_calls.hermes('<tool_call>{"arguments": {"x":1}, "name": "a"}')[1] == [tool_calls.Call("a", '{"x": 1}')]
    auto = tool_calls.ToolPlan("auto", parser="hermes")
    stream = tool_calls.CallStream(auto)
    pieces = ["Let me", " check. <tool", "_call>", '{"name": "a", "arguments": {', '}}', "</tool_call>"]
    fed = [stream.feed(p) for p in pieces]
    assert [content for content, _ in fed] == ["Let me", " check. ", "", "", "", ""]
    (), (first, opening), (closing,), () = [deltas for _, deltas in fed[2:]]
    assert (first["index"], first["function"]) == (0, {"name": "a", "arguments": ""})
    assert first["id"].startswith("chatcmpl-tool-")
    assert [opening, closing] == [{"index": 0, "function": {"arguments": a}} for a in ("{", "}")]
    assert stream.finish("stop") == ("", [], "tool_calls")
    stream = tool_calls.CallStream(auto)
    assert [stream.feed(p) for p in ["a <to", "ast"]] == [("a ", []), ("<toast", [])]  # not a tag after all
    assert stream.finish("length") == ("", [], "length")
    named = tool_calls.CallStream(tool_calls.ToolPlan("named", name="f"))
    _, (first,) = named.feed('{"x"')
    assert first["function"] == {"name": "f", "arguments": '{"x"'} and first["id"].startswith("chatcmpl-tool-")
    assert named.feed(": 1}") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert named.finish("stop") == ("", [], "stop")


def _streamed_offline(plan: tool_calls.ToolPlan, pieces: list[str], finish: str) -> tuple[str, list[tuple], str, int]:
    """(content, calls, finish_reason, deltas) of `pieces` streamed through a CallStream, put together as a
    client does."""
    stream = tool_calls.CallStream(plan)
    fed = [stream.feed(p) for p in pieces]
    content, deltas, reason = stream.finish(finish)
    content = "".join(c for c, _ in fed) + content
    deltas = [d for _, ds in fed for d in ds] + deltas
    calls: list[list[str]] = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls)
            calls.append([d["function"]["name"], ""])
        calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls], reason, len(deltas)


@pytest.mark.parametrize(("mode", "text", "content"), [
    ("required", '[{"name":"get_weather","parameters":{"city":"Pa\\"ris}]","days":3}},'
                 '{"name":"get_time","parameters":{"zone":"UTC"}}]', ""),
    ("auto", 'Sure. <tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n'
             '<tool_call>{"name": "b"}</tool_call>', "Sure. ")])
def test_streamed_calls_equal_the_whole_answers_however_the_text_is_cut(mode: str, text: str, content: str) -> None:
    """Calls go out as they are written (a call's first delta, then its arguments piece by piece), and put
    together they are the whole answer's, wherever the pieces end: in a string, an escape, a brace."""
    plan = tool_calls.ToolPlan(mode, parser="hermes" if mode == "auto" else None)
    _, calls, reason = plan.answer(text, "stop")
    whole = (content, [(c.name, c.arguments) for c in calls], reason)
    assert len(calls) == 2 and reason == "tool_calls"
    rng = random.Random(0)
    for cuts in [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
                                               for _ in range(200)]:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed_offline(plan, pieces, "stop")[:3] == whole
    # One character at a time, every character of the first call's arguments is a delta of its own.
    assert _streamed_offline(plan, list(text), "stop")[3] > len(calls[0].arguments)


def test_calls_already_streamed_stand_where_the_whole_answer_is_text() -> None:
    """Cut short by max_tokens, or a later Hermes block that is not a call: the whole answer is text, but a
    stream has sent the calls it read by then (as vLLM's streaming parsers do) and sends no more of the text."""
    required = tool_calls.ToolPlan("required")
    cut = '[{"name":"get_weather","parameters":{"ci'
    assert required.answer(cut, "length") == (cut, [], "length")
    opened = cut.index('{"ci') + 1
    assert _streamed_offline(required, [cut[:5], cut[5:opened], cut[opened:]], "length") == (
        "", [("get_weather", '{"ci')], "length", 3)
    auto = tool_calls.ToolPlan("auto", parser="hermes")
    text = 'x <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>[1]</tool_call>'
    assert auto.answer(text, "stop") == (text, [], "stop")
    assert _streamed_offline(auto, [text[:20], text[20:50], text[50:]], "stop") == (
        "x ", [("a", '{"x": 1}')], "tool_calls", 2)
    bad = 'x <tool_call>{"name": "\\q", "arguments": {}}</tool_call>'  # a name that is no JSON string
    assert auto.answer(bad, "stop") == (bad, [], "stop")
    assert _streamed_offline(auto, [bad[:30], bad[30:]], "stop") == (bad, [], "stop", 0)
    # Half a surrogate pair, in a name or in arguments: not a call, as a bad escape is not (json_text.py).
    bad = 'x <tool_call>{"name": "a\\ud800", "arguments": {}}</tool_call>'
    assert auto.answer(bad, "stop") == (bad, [], "stop")
    assert _streamed_offline(auto, [bad[:30], bad[30:]], "stop") == (bad, [], "stop", 0)  # never read as a name
    bad = 'x <tool_call>{"name": "a", "arguments": {"x": "\\udc00"}}</tool_call>'
    assert auto.answer(bad, "stop") == (bad, [], "stop")
    # Streamed, the arguments went out as written (escapes, which JSON carries) before the end was read.
    assert _streamed_offline(auto, [bad[:30], bad[30:]], "stop")[:3] == (
        "x ", [("a", '{"x": "\\udc00"}')], "tool_calls")
    lone = '[{"name":"a","parameters":{"x":"\\udfff"}}]'
    assert required.answer(lone, "stop") == (lone, [], "stop")
