"""The Responses API from a reasoning model (--reasoning-parser), through the official openai client on a real
verifier (the tiny thinking model, a remote n-gram drafter): the thinking is a reasoning item before the answer's
message, whole and streamed alike (the client's stream helper builds the same response), and together they are
the raw output; usage counts the thinking's tokens; a text format or a tool choice holds the answer after free
thinking; thinking sent back as a reasoning item, or kept by a stored conversation, reaches the template."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import httpx
from http_support import WAIT_S, http_verifier
from thinking_model import THINKING_CHAT, THINKING_TEMPLATE, thinking_model, thinking_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

ARGS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "count", "parameters": ARGS}]
COUNT = [{"role": "user", "content": "Count to three."}]  # with TOOLS rendered, thought for 31 tokens
REGEX = r"(fox|dog)+ [0-9]{3}"
LOGPROBS = ["message.output_text.logprobs"]


def serving(reasoning_parser: str | None = "deepseek_r1", **settings: object):  # noqa: ANN201
    """The thinking model, its template rendering the tools where a request has some."""
    tokenizer = copy.deepcopy(thinking_tokenizer())
    tokenizer.chat_template = "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}" + THINKING_TEMPLATE
    return http_verifier(model=thinking_model(), tokenizer=tokenizer, reasoning_parser=reasoning_parser,
                         max_model_len=512, **settings)


def items(response) -> list[dict]:  # noqa: ANN001
    """The response's output items as the server sent them, without their ids (each response draws its own),
    their log-probabilities by token (their values vary in the last digits from run to run)."""
    dumped = [item.model_dump(exclude={"id", "call_id", "parsed_arguments"}) for item in response.output]
    for part in (part for item in dumped for part in item.get("content") or []):
        part.pop("parsed", None)  # the stream helper's parse of the text
        part["logprobs"] = [lp["token"] for lp in part.get("logprobs") or []]
    return dumped


def counts(response) -> dict:  # noqa: ANN001
    """The response's token counts (without the prompt's cached ones, which depend on what ran before)."""
    return response.usage.model_dump(exclude={"input_tokens_details"})


def thought_and_answer(response) -> tuple[str, str]:  # noqa: ANN001
    """The text of the response's reasoning item and of its message, after checking that it holds just these."""
    reasoning, message = response.output
    assert (reasoning.type, reasoning.summary, message.type) == ("reasoning", [], "message")
    (thought,), (answer,) = reasoning.content, message.content
    assert thought.type == "reasoning_text"
    return thought.text, answer.text


def first_only(text: str, start: int) -> str:
    """Four printable characters at or after `start` that appear nowhere before them: a stop string that ends
    `text` exactly there."""
    return next(text[i:i + 4] for i in range(start, len(text) - 4)
                if text[i:i + 4].isprintable() and text[i:i + 4].strip() and text.find(text[i:i + 4]) == i)


def test_the_thinking_is_a_reasoning_item_before_the_answer_whole_and_streamed() -> None:
    async def main() -> None:
        async with serving() as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            response = await h.client.responses.create(model="tiny", input=THINKING_CHAT, max_output_tokens=40,
                                                       include=LOGPROBS)
            thought, answer = thought_and_answer(response)
            assert thought and answer and "think>" not in thought + answer
            assert response.output[0].status == "completed"  # the thinking ended; the answer was cut short
            assert response.status == response.output[1].status == "incomplete"
            assert response.output_text == answer
            # The same as the chat completion's reasoning and content, and together the raw output: the same
            # prompt's completion, which nothing splits.
            chat = (await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT,
                                                           max_tokens=40)).choices[0].message
            assert (chat.reasoning, chat.content) == (thought, answer)
            ids = (await http.post("/tokenize", json={"messages": THINKING_CHAT})).json()["tokens"]
            raw = (await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 40})).json()["choices"][0]
            assert raw["text"] == f"{thought}</think>{answer}"
            thought_tokens = raw["splitspec"]["token_ids"].index(thinking_tokenizer().convert_tokens_to_ids(
                "</think>")) + 1
            usage = response.usage
            assert usage.output_tokens_details.reasoning_tokens == thought_tokens and usage.output_tokens == 40
            # The message's log-probabilities are its answer's tokens'.
            assert len(response.output[1].content[0].logprobs) == 40 - thought_tokens

            # Streamed: the reasoning item's events first, the thinking as it is generated, then the message's.
            events = [e async for e in await h.client.responses.create(
                model="tiny", input=THINKING_CHAT, max_output_tokens=40, include=LOGPROBS, stream=True)]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            kinds = [e.type for e in events]
            deltas = kinds.count("response.reasoning_text.delta")
            assert deltas > 1
            assert kinds[:4 + deltas + 7] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", *["response.reasoning_text.delta"] * deltas,
                "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.delta"]
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
            assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
            assert kinds[-1] == "response.incomplete" and items(events[-1].response) == items(response)
            assert counts(events[-1].response) == counts(response)

            # Ended by a stop string in the answer: the client's stream helper builds the same response.
            ask = {"model": "tiny", "input": THINKING_CHAT, "max_output_tokens": 40, "include": LOGPROBS,
                   "extra_body": {"stop": [first_only(raw["text"], len(thought) + len("</think>") + 4)]}}
            whole = await h.client.responses.create(**ask)
            assert whole.status == "completed" and thought_and_answer(whole)[0] == thought
            async with h.client.responses.stream(**ask) as stream:
                final = await stream.get_final_response()
            assert items(final) == items(whole) and counts(final) == counts(whole)

            # Thinking cut short by max_output_tokens: a reasoning item alone, incomplete, whole and streamed.
            cut = await h.client.responses.create(model="tiny", input=THINKING_CHAT, max_output_tokens=5)
            (reasoning,) = cut.output
            assert (reasoning.type, reasoning.status, cut.status, cut.output_text) == (
                "reasoning", "incomplete", "incomplete", "")
            assert thought.startswith(reasoning.content[0].text)
            assert cut.usage.output_tokens_details.reasoning_tokens == 5
            events = [e async for e in await h.client.responses.create(
                model="tiny", input=THINKING_CHAT, max_output_tokens=5, stream=True)]
            assert items(events[-1].response) == items(cut) and events[-2].item.status == "incomplete"

    asyncio.run(main())


def test_a_text_format_or_a_tool_choice_holds_the_answer_after_free_thinking() -> None:
    async def main() -> None:
        async with serving() as h:
            free, _ = thought_and_answer(await h.client.responses.create(model="tiny", input=THINKING_CHAT,
                                                                         max_output_tokens=60))
            ask = {"model": "tiny", "input": THINKING_CHAT, "max_output_tokens": 60,
                   "text": {"format": {"type": "json_schema", "name": "count", "schema": ARGS, "strict": True}}}
            held = await h.client.responses.create(**ask)
            thought, answer = thought_and_answer(held)
            assert held.status == "completed" and thought == free and 0 <= json.loads(answer)["n"] <= 99
            async with h.client.responses.stream(**ask) as stream:
                assert items(await stream.get_final_response()) == items(held)
            # vLLM's structured_outputs, as in chat completions.
            regex = await h.client.responses.create(model="tiny", input=THINKING_CHAT, max_output_tokens=60,
                                                    extra_body={"structured_outputs": {"regex": REGEX}})
            thought, answer = thought_and_answer(regex)
            assert thought == free and re.fullmatch(REGEX, answer)
            # A tool choice that calls: the call is read from the answer alone, after the same thinking.
            free, _ = thought_and_answer(await h.client.responses.create(
                model="tiny", input=COUNT, max_output_tokens=120, tools=TOOLS, tool_choice="none"))
            for choice in ("required", {"type": "function", "name": "count"}):
                ask = {"model": "tiny", "input": COUNT, "max_output_tokens": 120, "tools": TOOLS, "tool_choice": choice}
                called = await h.client.responses.create(**ask)
                reasoning, call = called.output
                assert reasoning.type == "reasoning" and reasoning.content[0].text == free, choice
                assert call.type == "function_call" and call.name == "count"
                assert 0 <= json.loads(call.arguments)["n"] <= 99
                async with h.client.responses.stream(**ask) as stream:
                    assert items(await stream.get_final_response()) == items(called), choice

    asyncio.run(main())


def test_thinking_sent_back_or_stored_reaches_the_template() -> None:
    """A reasoning item in `input` is the thinking of the assistant's message after it, as a chat message's
    `reasoning` is; a conversation continued by previous_response_id keeps its answer's thinking the same way."""
    async def main() -> None:
        async with serving(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
            async def tokens(messages: list, **tools: object) -> int:
                return (await http.post("/tokenize", json={"messages": messages, **tools})).json()["count"]

            first = await h.client.responses.create(model="tiny", input=THINKING_CHAT, max_output_tokens=30)
            thought, answer = thought_and_answer(first)
            more = {"role": "user", "content": "More?"}
            chat = [*THINKING_CHAT, {"role": "assistant", "content": answer, "reasoning": thought}, more]
            unthought = await tokens([*THINKING_CHAT, {"role": "assistant", "content": answer}, more])
            assert await tokens(chat) > unthought

            followed = await h.client.responses.create(model="tiny", input=[more], previous_response_id=first.id,
                                                       max_output_tokens=4)
            assert followed.usage.input_tokens == await tokens(chat)
            # A response that only thought (max_output_tokens cut it short) is an assistant's turn all the same.
            cut = await h.client.responses.create(model="tiny", input=THINKING_CHAT, max_output_tokens=5)
            followed = await h.client.responses.create(model="tiny", input=[more], previous_response_id=cut.id,
                                                       max_output_tokens=4)
            assert followed.usage.input_tokens == await tokens([*THINKING_CHAT, {
                "role": "assistant", "content": "", "reasoning": cut.output[0].content[0].text}, more])
            # The same conversation, its items sent back by the client.
            sent = [*THINKING_CHAT, *[item.model_dump(exclude_none=True) for item in first.output], more]
            resent = await h.client.responses.create(model="tiny", input=sent, max_output_tokens=4)
            followed_chat_tokens = await tokens(chat)
            assert resent.usage.input_tokens == followed_chat_tokens
            listed = (await h.client.responses.input_items.list(resent.id, order="asc")).data
            assert [i.type for i in listed] == ["message", "reasoning", "message", "message"]
            assert listed[1].content[0].text == thought
            # A reasoning item with a summary only (and nothing sealed), before an assistant's function call.
            summary = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "small ones"}],
                       "encrypted_content": ""}
            call = {"type": "function_call", "call_id": "c1", "name": "count", "arguments": '{"n": 3}'}
            result = {"type": "function_call_output", "call_id": "c1", "output": "3"}
            called = await h.client.responses.create(model="tiny", input=[*THINKING_CHAT, summary, call, result],
                                                     tools=TOOLS, tool_choice="none", max_output_tokens=4)
            called_chat = [*THINKING_CHAT, {"role": "assistant", "content": "", "reasoning": "small ones",
                                            "tool_calls": [{"id": "c1", "type": "function", "function": {
                                                "name": "count", "arguments": '{"n": 3}'}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "3"}]
            tools = {"tools": [{"type": "function", "function": {"name": "count", "parameters": ARGS}}]}
            assert called.usage.input_tokens == await tokens(called_chat, **tools) > await tokens(
                [called_chat[0], called_chat[1] | {"reasoning": None}, called_chat[2]], **tools)
            # Sealed thinking cannot be read: refused, named.
            sealed = await http.post("/v1/responses", json={"model": "tiny", "input": [
                *THINKING_CHAT, summary | {"encrypted_content": "gAAAA"}, {"role": "assistant", "content": "5"}]})
            assert sealed.status_code == 400, sealed.text
            error = sealed.json()["error"]
            assert error["param"] == "input.1.reasoning.encrypted_content" and "cannot be read" in error["message"]
        # A verifier without a reasoning parser takes the thinking sent back all the same: the conversation's.
        async with serving(reasoning_parser=None, speculate=False) as h:
            resent = await h.client.responses.create(model="tiny", input=sent, max_output_tokens=4)
            assert resent.usage.input_tokens == followed_chat_tokens

    asyncio.run(main())
