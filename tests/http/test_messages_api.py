"""Anthropic's Messages API through the official anthropic client, against a real verifier (tiny random model,
HTTP on port 0) with a remote SDK n-gram drafter: a message is the chat it describes (the same text and usage
as chat completions, which are exact against plain decoding); streamed, its events build the same message in
the client's own stream helper; stop sequences, max_tokens and tool use map to Anthropic's stop reasons; tool
results come back; count_tokens counts the prompt; mistakes are Anthropic's error objects; the token is read
from x-api-key; the model list reads in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from test_tool_calls import TOOLS, serving
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

SYSTEM = "Be brief."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]


def prompt_tokens(usage) -> int:  # noqa: ANN001
    """The whole prompt, as Anthropic's usage splits it (cache writes are never counted here)."""
    return usage.input_tokens + usage.cache_read_input_tokens


def client(h) -> anthropic.AsyncAnthropic:  # noqa: ANN001
    return anthropic.AsyncAnthropic(base_url=h.base_url, api_key="unused", max_retries=0, timeout=WAIT_S)


def test_a_message_is_the_chat_it_describes_whole_and_streamed() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            chat = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30)
            c = client(h)
            message = await c.messages.create(model="tiny", system=SYSTEM, max_tokens=30,
                                              messages=[{"role": "user", "content": PROMPT}])
            assert [b.type for b in message.content] == ["text"]
            assert message.content[0].text == chat.choices[0].message.content
            assert message.stop_reason == "max_tokens" and message.id.startswith("msg_")
            assert message.usage.output_tokens == 30
            # Anthropic's split: the prompt's tokens read from the prefix cache (the chat's, just before) apart.
            assert prompt_tokens(message.usage) == chat.usage.prompt_tokens
            assert 0 < message.usage.cache_read_input_tokens and 0 < message.usage.input_tokens
            assert message.model_extra["speculation"]["num_drafts"] > 0  # the remote drafter drafted

            async with c.messages.stream(model="tiny", system=SYSTEM, max_tokens=30,
                                         messages=[{"role": "user", "content": PROMPT}]) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            assert final.content[0].text == message.content[0].text and final.stop_reason == "max_tokens"
            assert final.usage.output_tokens == 30 and prompt_tokens(final.usage) == chat.usage.prompt_tokens
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds

            # A stop sequence ends it, and is named.
            text = message.content[0].text
            stop = text[8:11]
            stopped = await c.messages.create(model="tiny", system=SYSTEM, max_tokens=30, stop_sequences=[stop],
                                              messages=[{"role": "user", "content": PROMPT}])
            assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
            assert stopped.content[0].text == text[:text.index(stop)]
            # Ended by the model (here a stop token id, vLLM's field): end_turn.
            first = chat.choices[0].message.content[:2]
            token = h.tokenizer(first, add_special_tokens=False)["input_ids"][0]
            ended = await c.messages.create(model="tiny", system=SYSTEM, max_tokens=30, extra_body={
                "stop_token_ids": [token]}, messages=[{"role": "user", "content": PROMPT}])
            assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None) and ended.usage.output_tokens < 30
            counted = await c.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                    system=[{"type": "text", "text": SYSTEM,
                                                             "cache_control": {"type": "ephemeral"}}])
            assert counted.input_tokens == chat.usage.prompt_tokens

            # A last message from the assistant is the answer's start (a prefill): the answer continues it.
            begun = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "d10 add"}]
            prefilled = await c.messages.create(model="tiny", system=SYSTEM, max_tokens=12, messages=begun)
            continued = await h.client.chat.completions.create(
                model="tiny", max_tokens=12, messages=[{"role": "system", "content": SYSTEM}, *begun],
                extra_body={"add_generation_prompt": False, "continue_final_message": True})
            assert prefilled.content[0].text == continued.choices[0].message.content
            assert prompt_tokens(prefilled.usage) == continued.usage.prompt_tokens

            # A client leaving mid-stream frees its sequence.
            async with c.messages.stream(model="tiny", max_tokens=200,
                                         messages=[{"role": "user", "content": PROMPT}]) as stream:
                async for event in stream:
                    if event.type == "content_block_delta":
                        break
            await wait_until(h.idle, "the sequence and the drafter's state freed")
            await c.close()

    asyncio.run(main())


def test_tool_use_blocks_and_their_results_come_back() -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    ask = "What is the weather in Paris?"

    async def main() -> None:
        async with serving() as h:
            c = client(h)
            chat = await h.client.chat.completions.create(
                model="tiny", max_tokens=40, tools=TOOLS, messages=[{"role": "user", "content": ask}],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            arguments = chat.choices[0].message.tool_calls[0].function.arguments
            ask_tool = {"model": "tiny", "max_tokens": 40, "tools": tools,
                        "messages": [{"role": "user", "content": ask}],
                        "tool_choice": {"type": "tool", "name": "get_weather"}}
            message = await c.messages.create(**ask_tool)
            (use,) = message.content
            assert use.type == "tool_use" and use.name == "get_weather" and message.stop_reason == "tool_use"
            assert use.input == json.loads(arguments)
            async with c.messages.stream(**ask_tool) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", use.input)]
            assert "input_json" in kinds  # the arguments streamed as they were written

            # Its result sent back: the same answer as the chat with the call and its tool message.
            result = "sunny, 21 C"
            back = await c.messages.create(model="tiny", max_tokens=12, tools=tools[:1], tool_choice={"type": "none"},
                                           messages=[{"role": "user", "content": ask},
                                                     {"role": "assistant", "content": [use.model_dump()]},
                                                     {"role": "user", "content": [{"type": "tool_result",
                                                                                   "tool_use_id": use.id,
                                                                                   "content": result}]}])
            chat_back = await h.client.chat.completions.create(
                model="tiny", max_tokens=12, tools=TOOLS[:1], tool_choice="none", messages=[
                    {"role": "user", "content": ask},
                    {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function", "function": {
                        "name": use.name, "arguments": json.dumps(use.input)}}]},
                    {"role": "tool", "tool_call_id": use.id, "content": result}])
            assert back.content[0].text == chat_back.choices[0].message.content
            assert prompt_tokens(back.usage) == chat_back.usage.prompt_tokens

            # "auto": the text before the model's Hermes block is a text block, its call a tool_use block
            # after it, whole and streamed (a regular expression holds the random model to one block).
            block = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
            auto = {"model": "tiny", "max_tokens": 80, "tools": tools, "messages": [{"role": "user", "content": ask}],
                    "extra_body": {"structured_outputs": {"regex": block}}}
            whole = await c.messages.create(**auto)
            assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.stop_reason == "tool_use"
            assert whole.content[0].text == "Sure." and whole.content[1].input["zone"] in ("UTC", "CET")
            async with c.messages.stream(**auto) as stream:
                final = await stream.get_final_message()
            assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
            assert final.content[1].input == whole.content[1].input
            await c.close()

    asyncio.run(main())


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0: a content block is text, tool_use, tool_result, thinking or "
     "redacted_thinking (only text is served here)"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "system": 5}, 400, "invalid_request_error",
     "system: neither a text nor a list"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}}, 400,
     "invalid_request_error", 'thinking: budget_tokens goes with "type": "enabled", and only with it'),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error", 'type "tool"'),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "exceeds the context"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "invalid_request_error",
     "top_p must be within (0, 1]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "context_management": {"edits": []}}, 400,
     "invalid_request_error", "context_management: not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "none"}}, 400,
     "invalid_request_error", "output_config.effort"),  # Anthropic's efforts start at "low"
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_format": {
        "type": "json_schema", "schema": {}}, "output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400,
     "invalid_request_error", "send one of output_config.format, output_format and response_format"),
    ({"model": "claude", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error",
     "'claude' is not served here"),
])
def test_mistakes_are_anthropic_error_objects(body: dict, status: int, kind: str, words: str) -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            answer = await c.post("/v1/messages", json={"model": "tiny", **body})
            assert answer.status_code == status, answer.text
            assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == kind
            assert words in answer.json()["error"]["message"], answer.json()
            assert "more problems" not in answer.json()["error"]["message"]  # one mistake, one problem

    asyncio.run(main())


def test_the_token_is_read_from_x_api_key() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False, auth_token="s3cret", api_key="s3cret") as h:
            good = anthropic.AsyncAnthropic(base_url=h.base_url, api_key="s3cret", max_retries=0, timeout=WAIT_S)
            hi = [{"role": "user", "content": "hi"}]
            message = await good.messages.create(model="tiny", max_tokens=2, messages=hi)
            assert message.usage.output_tokens == 2
            bad = anthropic.AsyncAnthropic(base_url=h.base_url, api_key="wrong", max_retries=0, timeout=WAIT_S)
            with pytest.raises(anthropic.AuthenticationError, match="missing or wrong API key"):
                await bad.messages.create(model="tiny", max_tokens=2, messages=hi)
            # The models, listed to Anthropic's SDK in its shape, its token read the same way.
            (card,) = (await good.models.list()).data
            assert (card.id, card.type, card.display_name, card.max_input_tokens) == ("tiny", "model", "tiny", 255)
            assert card.created_at.tzinfo is not None and await good.models.retrieve("tiny") == card
            with pytest.raises(anthropic.AuthenticationError, match="missing or wrong API key"):
                await bad.models.list()
            assert (await h.client.models.retrieve("tiny")).id == "tiny"  # the OpenAI client's bearer token too
            await good.close()
            await bad.close()

    asyncio.run(main())
