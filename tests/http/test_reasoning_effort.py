"""A request's reasoning effort reaches the chat template, through the official openai and anthropic clients on
a real verifier serving the tiny thinking model (`--reasoning-parser deepseek_r1`) with a template that reads
both variables hybrid reasoning models read, Qwen3's `enable_thinking` and gpt-oss's `reasoning_effort`:
chat's `reasoning_effort` and Responses' `reasoning.effort` set both, as vLLM does ("none" switches the thinking
off), Anthropic's `output_config.effort` the effort alone; each answer is the chat completion whose
`chat_template_kwargs` spell the same variables, and variables a request spells out win. Anthropic's
`output_config.format` (and the beta's `output_format`) holds the answer to its schema, after the thinking, with
no whitespace between items."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pydantic
from http_support import WAIT_S, http_verifier
from test_messages_api import client
from thinking_model import THINKING_CHAT, THINKING_TEMPLATE, thinking_model, thinking_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

# The thinking template, with the effort (where one is set) in a system line before the chat.
EFFORT_TEMPLATE = "{% if reasoning_effort is defined %}<|system|>effort: {{ reasoning_effort }}\n{% endif %}" + \
    THINKING_TEMPLATE
ASK = {"model": "tiny", "messages": THINKING_CHAT, "max_tokens": 40}


class Count(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    n: int


def serving():  # noqa: ANN201
    tokenizer = copy.deepcopy(thinking_tokenizer())
    tokenizer.chat_template = EFFORT_TEMPLATE
    return http_verifier(model=thinking_model(), tokenizer=tokenizer, reasoning_parser="deepseek_r1",
                         max_model_len=512)


def test_an_effort_sets_the_templates_variables_on_every_front() -> None:
    async def main() -> None:
        async with serving() as h:
            async def chat(**request: object) -> tuple[str | None, str, int]:
                """(reasoning, content, prompt tokens) of the chat completion of ASK."""
                r = await h.client.chat.completions.create(**ASK, **request)
                return r.choices[0].message.reasoning, r.choices[0].message.content, r.usage.prompt_tokens

            def spelled(**variables: object) -> dict:
                return {"extra_body": {"chat_template_kwargs": variables}}

            default = await chat()
            assert default[0] and default[1]  # the template opened the thinking: the model thought, then answered
            # "none": the effort line, and the thinking switched off (all answer); any other: switched on.
            off = await chat(reasoning_effort="none")
            assert off == await chat(**spelled(reasoning_effort="none", enable_thinking=False))
            assert off[0] is None and off[1] and off[2] > default[2]
            medium = await chat(reasoning_effort="medium")
            assert medium == await chat(**spelled(reasoning_effort="medium", enable_thinking=True))
            assert medium[0] and medium[1] and medium[2] > default[2] and medium != default
            # A variable the request spells out wins over the effort's.
            assert await chat(reasoning_effort="high", **spelled(enable_thinking=False)) == \
                await chat(**spelled(reasoning_effort="high", enable_thinking=False))

            # Responses: reasoning.effort, as chat's; the response says what it was asked.
            ask = {"model": "tiny", "input": THINKING_CHAT[0]["content"], "max_output_tokens": 40}
            plain = await h.client.responses.create(**ask)
            assert plain.reasoning is None and plain.usage.input_tokens == default[2]
            quiet = await h.client.responses.create(**ask, reasoning={"effort": "none"})
            assert [i.type for i in quiet.output] == ["message"] and quiet.output_text == off[1]
            assert (quiet.reasoning.effort, quiet.reasoning.summary) == ("none", None)
            thorough = await h.client.responses.create(**ask, reasoning={"effort": "medium", "summary": "auto"})
            thought, message = thorough.output
            assert (thought.content[0].text, thought.summary, message.content[0].text) == (medium[0], [], medium[1])
            assert (thorough.reasoning.effort, thorough.reasoning.summary) == ("medium", "auto")

            # Anthropic: output_config.effort is the effort alone; thinking is the switch.
            c = client(h)
            message = await c.messages.create(**ASK, output_config={"effort": "high"}, thinking={"type": "disabled"})
            closed = await chat(**spelled(reasoning_effort="high", enable_thinking=False))
            assert [b.type for b in message.content] == ["text"] and message.content[0].text == closed[1]
            counted = await c.messages.count_tokens(model="tiny", messages=THINKING_CHAT,
                                                    output_config={"effort": "high"}, thinking={"type": "disabled"})
            usage = message.usage  # Anthropic's: the prompt's tokens read from the prefix cache apart
            assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens == closed[2]
            message = await c.messages.create(**ASK, output_config={"effort": "max"})
            thought, answer = message.content
            assert (thought.thinking, answer.text) == (await chat(**spelled(reasoning_effort="max")))[:2]
            await c.close()

    asyncio.run(main())


def test_an_anthropic_output_format_holds_the_answer_to_its_schema() -> None:
    schema = Count.model_json_schema()

    async def main() -> None:
        async with serving() as h:
            # As vLLM's structured_outputs json with disable_any_whitespace: no whitespace between items.
            chat = await h.client.chat.completions.create(**ASK, extra_body={
                "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
            c = client(h)
            # The client's parse: the schema in output_config.format, the answer parsed back into its model.
            parsed = await c.messages.parse(**ASK, output_format=Count)
            thought, answer = parsed.content
            assert (thought.thinking, answer.text) == (chat.choices[0].message.reasoning,
                                                       chat.choices[0].message.content)
            assert parsed.parsed_output == Count.model_validate_json(answer.text)  # held to the schema after thinking
            async with c.messages.stream(**ASK, output_config={"format": {"type": "json_schema", "schema": schema}}
                                         ) as stream:
                streamed = await stream.get_final_message()
            assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in parsed.content]
            await c.close()
            # The structured-outputs beta's name for it, output_format, holds the answer the same way.
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                beta = (await http.post("/v1/messages", json={
                    **ASK, "output_format": {"type": "json_schema", "schema": schema}})).json()
            assert [b.get("thinking", b.get("text")) for b in beta["content"]] == [thought.thinking, answer.text]
            assert json.loads(answer.text).keys() == {"n"}

    asyncio.run(main())
