"""Anthropic's Messages API under a reasoning parser, through the official anthropic client, against a real
verifier serving a tiny reasoning model (thinking_model.py, `--reasoning-parser deepseek_r1`): a model that thought
answers a thinking block, then its answer's blocks, as Claude's extended thinking does; the same streamed (thinking
deltas as the thinking is generated) and whole, and the same split of the raw text a server without the parser
answers; `thinking` disabled closes the thinking where the template has Qwen3's switch (and leaves the block out
where it has none), `display: "omitted"` keeps the block without its text, enabled holds the thinking to its
budget_tokens (the engine's
thinking budget, as chat's thinking_token_budget) and needs the parser; a tool choice that calls holds the
answer to the tools' schemas after free thinking; an assistant's thinking sent back reaches the chat template."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from http_support import WAIT_S, HttpVerifier, http_verifier
from test_messages_api import client
from test_tool_calls import SCHEMAS, TOOLS
from thinking_model import THINKING_CHAT, thinking_model, thinking_tokenizer
from transformers import PreTrainedTokenizerBase
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

# The thinking template with the tools' names in a system line (the tool-use test's ask closes its thinking 8
# tokens in, greedy).
TOOLS_THINKING_TEMPLATE = (
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['reasoning_content'] is defined and m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}"
    "</think>{% endif %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]


def thinking_server(speculate: bool = True, tokenizer: PreTrainedTokenizerBase | None = None,
                    **settings: object) -> contextlib.AbstractAsyncContextManager[HttpVerifier]:
    return http_verifier(speculate=speculate, model=thinking_model(), tokenizer=tokenizer or thinking_tokenizer(),
                         **settings)


def blocks(content: list[Any]) -> list[dict]:
    """Content blocks as plain dicts, without what differs from answer to answer (tool_use ids)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in content]


async def streamed(c: anthropic.AsyncAnthropic, **request: object) -> tuple[list, list[tuple]]:
    """(the stream helper's final content, the blocks' start, delta and stop events as (event, index, type))."""
    events = []
    async with c.messages.stream(**request) as stream:
        async for event in stream:
            if event.type == "content_block_start":
                events.append((event.type, event.index, event.content_block.type))
            elif event.type in ("content_block_delta", "content_block_stop"):
                events.append((event.type, event.index, getattr(event, "delta", None) and event.delta.type))
        final = await stream.get_final_message()
    return final.content, events


def test_the_thinking_is_a_block_before_the_answer_whole_and_streamed() -> None:
    ask = {"model": "tiny", "max_tokens": 40, "messages": THINKING_CHAT}

    async def main() -> None:
        async with thinking_server(speculate=False) as plain:  # no parser: the raw text, markers and all
            c = client(plain)
            (raw,) = (await c.messages.create(**ask)).content
            with pytest.raises(anthropic.BadRequestError, match="thinking with a budget needs a verifier started "
                                                                "with --reasoning-parser"):
                await c.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
            await c.close()
        async with thinking_server(reasoning_parser="deepseek_r1") as h:
            c = client(h)
            message = await c.messages.create(**ask)
            thought, answer = message.content
            assert (thought.type, thought.signature, answer.type) == ("thinking", "", "text")
            assert thought.thinking and answer.text  # the model thought, then answered
            assert raw.text == thought.thinking + "</think>" + answer.text  # the prompt opened the thinking
            assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 40  # thinking included

            content, events = await streamed(c, **ask)
            assert blocks(content) == blocks(message.content)
            starts = [e for e in events if e[0] == "content_block_start"]
            assert starts == [("content_block_start", 0, "thinking"), ("content_block_start", 1, "text")]
            # The thinking streamed as it was generated, then closed, before the answer began.
            first_text = events.index(starts[1])
            assert events[first_text - 1] == ("content_block_stop", 0, None)
            assert {e for e in events[:first_text - 1] if e[0] == "content_block_delta"} == {
                ("content_block_delta", 0, "thinking_delta")}
            assert sum(e[0] == "content_block_delta" for e in events[:first_text]) > 1

            # Disabled: the template's switch (Qwen3's enable_thinking) closes the thinking, and the model answers
            # at once, as chat does for the chat rendered so; whole and streamed.
            hidden = await c.messages.create(**ask, thinking={"type": "disabled"})
            closed = (await h.client.chat.completions.create(
                model="tiny", messages=THINKING_CHAT, max_tokens=40,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})).choices[0].message
            assert not closed.model_extra.get("reasoning") and closed.content  # no thinking: all answer
            assert blocks(hidden.content) == [{"type": "text", "text": closed.content}] != blocks([answer])
            content, events = await streamed(c, **ask, thinking={"type": "disabled"})
            assert blocks(content) == blocks(hidden.content) and {e[1] for e in events} == {0}
            # display "omitted": the thinking block, its text left out, whole and streamed (no thinking_delta).
            for thinking in ({"type": "adaptive", "display": "omitted"},
                             {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}):
                omitted = await c.messages.create(**ask, thinking=thinking)
                assert blocks(omitted.content) == [{"type": "thinking", "thinking": "", "signature": ""},
                                                   blocks([answer])[0]]
                content, events = await streamed(c, **ask, thinking=thinking)
                assert blocks(content) == blocks(omitted.content)
                assert [e for e in events if e[1] == 0] == [("content_block_start", 0, "thinking"),
                                                            ("content_block_stop", 0, None)]
            await c.close()
        # A template without the switch still opens the thinking: the block is left out, the model thought.
        switchless = copy.deepcopy(thinking_tokenizer())
        switchless.chat_template = TOOLS_THINKING_TEMPLATE
        async with thinking_server(tokenizer=switchless, reasoning_parser="deepseek_r1") as h:
            c = client(h)
            thought, answer = (await c.messages.create(**ask)).content
            hidden = await c.messages.create(**ask, thinking={"type": "disabled"})
            assert blocks(hidden.content) == blocks([answer]) and hidden.usage.output_tokens == 40
            await c.close()

    asyncio.run(main())


def test_any_tool_choice_answers_a_tool_use_held_to_its_schema_after_free_thinking() -> None:
    tokenizer = copy.deepcopy(thinking_tokenizer())
    tokenizer.chat_template = TOOLS_THINKING_TEMPLATE
    ask = {"model": "tiny", "max_tokens": 60, "tools": ANTHROPIC_TOOLS,
           "messages": [{"role": "user", "content": "The time in UTC?"}]}
    any_one = {"type": "any", "disable_parallel_tool_use": True}

    async def main() -> None:
        async with thinking_server(tokenizer=tokenizer, reasoning_parser="deepseek_r1") as h:
            c = client(h)
            free = await c.messages.create(**ask, tool_choice={"type": "none"})
            message = await c.messages.create(**ask, tool_choice=any_one)
            thought, use = message.content
            assert thought.type == "thinking" and thought.thinking == free.content[0].thinking  # thought freely
            assert use.type == "tool_use" and message.stop_reason == "tool_use"
            jsonschema.validate(use.input, SCHEMAS[use.name])  # the answer, after the thinking, held to it
            content, events = await streamed(c, **ask, tool_choice=any_one)
            assert blocks(content) == blocks(message.content)
            assert ("content_block_delta", 1, "input_json_delta") in events
            await c.close()

    asyncio.run(main())


def test_thinking_sent_back_reaches_the_template_and_a_budget_holds_the_thinking() -> None:
    thought = "Two, three and five are prime."
    earlier = [THINKING_CHAT[0], {"role": "assistant", "content": "2, 3, 5."},
               {"role": "user", "content": "And the next?"}]

    def sent_back(*assistant_blocks: dict) -> list[dict]:
        return [earlier[0], {"role": "assistant", "content": [*assistant_blocks, {"type": "text", "text": "2, 3, 5."}]},
                earlier[2]]

    def template_tokens(reasoning: str) -> int:
        chat = [earlier[0], {**earlier[1], "reasoning_content": reasoning}, earlier[2]]
        return len(thinking_tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])

    async def main() -> None:
        async with thinking_server(speculate=False, reasoning_parser="deepseek_r1") as h:
            c = client(h)
            thinking = {"type": "thinking", "thinking": thought, "signature": "sig"}
            redacted = {"type": "redacted_thinking", "data": "opaque"}
            counts = [(await c.messages.count_tokens(model="tiny", messages=m)).input_tokens
                      for m in (earlier, sent_back(thinking), sent_back(redacted, thinking), sent_back(redacted))]
            assert counts == [template_tokens(""), template_tokens(thought), template_tokens(thought),
                              template_tokens("")]
            assert counts[1] > counts[0]  # the thinking is in the prompt, as the template renders it
            answered = await c.messages.create(model="tiny", max_tokens=8, messages=sent_back(thinking))
            assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens == counts[1]

            # Enabled: the thinking held to budget_tokens, then the answer; chat's thinking_token_budget alike.
            short = await c.messages.create(model="tiny", max_tokens=40, messages=THINKING_CHAT,
                                            thinking={"type": "enabled", "budget_tokens": 3})
            chat = (await h.client.chat.completions.create(model="tiny", max_tokens=40, messages=THINKING_CHAT,
                                                           extra_body={"thinking_token_budget": 3})).choices[0]
            assert blocks(short.content) == [{"type": "thinking", "thinking": chat.message.reasoning, "signature": ""},
                                             {"type": "text", "text": chat.message.content}]
            free = await c.messages.create(model="tiny", max_tokens=40, messages=THINKING_CHAT)
            assert len(short.content[0].thinking) < len(free.content[0].thinking)
            adaptive = await c.messages.create(model="tiny", max_tokens=40, messages=THINKING_CHAT,
                                               thinking={"type": "adaptive"})
            assert blocks(adaptive.content) == blocks(free.content)  # the model thinks as it would
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                for body, words in [
                    ({"thinking": {"type": "enabled"}, "messages": THINKING_CHAT},
                     'budget_tokens goes with "type": "enabled"'),
                    ({"messages": [{"role": "user", "content": [thinking]}]}, "the assistant's, not the user's")]:
                    refused = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 8, **body})
                    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
                    assert words in refused.json()["error"]["message"], refused.json()
            await c.close()

    asyncio.run(main())
