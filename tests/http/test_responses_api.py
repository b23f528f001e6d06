"""OpenAI's Responses API through the official openai client, against a real verifier (tiny random model,
HTTP on port 0) with a remote SDK n-gram drafter: a response is the chat it describes (the same text, usage
and logprobs as chat completions, which are exact against plain decoding); streamed, its events build the same
response in the client's own stream helper; previous_response_id continues a stored conversation (without
the earlier instructions), retrieved and deleted by id; tool calls go out as function_call items and their
outputs come back; mistakes are 400s and 404s naming them; a client that leaves mid-stream frees its sequence."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from test_tool_calls import NAMED, TOOLS, serving
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from verifier_service.api.http_schema import ChatMessage
from verifier_service.api.response_store import ResponseStore

INSTRUCTIONS = "Be brief."
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}]


def message_text(response) -> str:  # noqa: ANN001
    """The text of the response's one message item (the client's output_text joins every message's)."""
    messages = [item for item in response.output if item.type == "message"]
    assert len(messages) == 1 and len(messages[0].content) == 1
    return messages[0].content[0].text


def test_a_response_is_the_chat_it_describes_whole_and_streamed() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            chat = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30)
            response = await h.client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=PROMPT,
                                                       max_output_tokens=30, max_tool_calls=3)
            assert chat.choices[0].finish_reason == "length"
            assert message_text(response) == response.output_text == chat.choices[0].message.content
            assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
            assert response.output[0].status == "incomplete" and response.id.startswith("resp_")
            assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
                chat.usage.prompt_tokens, 30, chat.usage.total_tokens)
            assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 30
            assert response.max_tool_calls == 3  # OpenAI's built-in tools' bound: none run here, so echoed only
            spec = response.model_extra["speculation"]
            assert spec["num_drafts"] > 0  # the remote drafter drafted

            # Streamed: OpenAI's events in order, numbered; the last carries the same response.
            events = [e async for e in await h.client.responses.create(
                model="tiny", instructions=INSTRUCTIONS, input=PROMPT, max_output_tokens=30, stream=True)]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            kinds = [e.type for e in events]
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.incomplete"]
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert len(deltas) > 1 and "".join(deltas) == message_text(response)
            last = events[-1].response
            assert last.output_text == response.output_text and last.usage == response.usage
            assert last.output[0].id == events[2].item.id == events[-2].item.id

            # Ended by a stop string (vLLM's field): completed, and the client's stream helper builds the same.
            text = message_text(response)
            stop = text[8:11]
            assert len(stop) == 3 and stop.strip()
            ask = {"model": "tiny", "instructions": INSTRUCTIONS, "input": PROMPT, "max_output_tokens": 30,
                   "extra_body": {"stop": [stop]}}
            whole = await h.client.responses.create(**ask)
            assert whole.status == "completed" and whole.output_text == text[:text.index(stop)]
            async with h.client.responses.stream(**ask) as stream:
                final = await stream.get_final_response()
            assert final.output_text == whole.output_text and final.status == "completed"
            assert final.usage == whole.usage

    asyncio.run(main())


def assert_same_logprobs(got: list, want: list) -> None:
    """The same tokens and alternatives, their log-probabilities equal up to float32 rounding (a verify
    forward's width, which speculation varies, moves the last bits)."""
    def split(entries: list) -> tuple[list, list]:
        names = [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]
        return names, [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]

    (got_names, got_values), (want_names, want_values) = split(got), split(want)
    assert len(got) == 12 and got_names == want_names
    assert got_values == pytest.approx(want_values, abs=1e-4)


def test_logprobs_are_chats_where_included() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            chat = await h.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, logprobs=True,
                                                          top_logprobs=2)
            response = await h.client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=PROMPT,
                                                       max_output_tokens=12, top_logprobs=2,
                                                       include=["message.output_text.logprobs"])
            want = chat.choices[0].logprobs.content
            assert_same_logprobs(response.output[0].content[0].logprobs, want)
            streamed = [e async for e in await h.client.responses.create(
                model="tiny", instructions=INSTRUCTIONS, input=PROMPT, max_output_tokens=12, top_logprobs=2,
                include=["message.output_text.logprobs"], stream=True)]
            assert_same_logprobs([lp for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs],
                                 want)
            plain = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=12)
            assert plain.output[0].content[0].logprobs == []

    asyncio.run(main())


def test_previous_response_id_continues_the_stored_conversation() -> None:
    async def main() -> None:
        async with http_verifier(metrics_port=0) as h:
            first = await h.client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=PROMPT,
                                                    max_output_tokens=10)
            assert first.store is True
            follow = "and then? " + PROMPT[:20]
            second = await h.client.responses.create(model="tiny", input=follow, previous_response_id=first.id,
                                                     max_output_tokens=10)
            # The same as the chat written out, without the first request's instructions (OpenAI's rule).
            chat = await h.client.chat.completions.create(model="tiny", max_tokens=10, messages=[
                {"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": follow}])
            assert second.output_text == chat.choices[0].message.content
            assert second.usage.input_tokens == chat.usage.prompt_tokens
            assert second.previous_response_id == first.id and second.instructions is None
            # ... and the same as the conversation sent whole, the earlier answer's items as input.
            sent = await h.client.responses.create(model="tiny", max_output_tokens=10, input=[
                {"role": "user", "content": PROMPT}, *[item.model_dump() for item in first.output],
                {"role": "user", "content": follow}])
            assert sent.output_text == second.output_text

            stored = await h.client.responses.retrieve(first.id)
            assert stored.model_dump() == first.model_dump()
            # Its input, as OpenAI lists it: newest first unless asked, in pages.
            (listed,) = (await h.client.responses.input_items.list(first.id)).data
            assert (listed.type, listed.role, listed.content[0].text) == ("message", "user", PROMPT)
            items = [{"role": "user", "content": "one"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                           "arguments": "{}", "id": "fc_given"},
                     {"type": "function_call_output", "call_id": "c1", "output": "two"}]
            several = await h.client.responses.create(model="tiny", input=items, max_output_tokens=2)
            asc = (await h.client.responses.input_items.list(several.id, order="asc")).data
            assert [i.type for i in asc] == ["message", "function_call", "function_call_output"]
            assert asc[1].id == "fc_given" and asc[2].output == "two"
            paged = [i.id async for i in h.client.responses.input_items.list(several.id, limit=1)]
            assert paged == [i.id for i in reversed(asc)]  # every page followed, newest first
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                bad = await http.get(f"/v1/responses/{several.id}/input_items", params={"limit": "x"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
            deleted = await h.client.responses.delete(first.id)
            assert deleted is None  # the client returns nothing for a delete
            with pytest.raises(openai.NotFoundError, match="no stored response"):
                await h.client.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError) as gone:
                await h.client.responses.create(model="tiny", input=follow, previous_response_id=first.id)
            assert gone.value.body["param"] == "previous_response_id"
            # A chain outlives what it continued: the second holds the whole conversation.
            third = await h.client.responses.create(model="tiny", input="more", previous_response_id=second.id,
                                                    max_output_tokens=4)
            assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
            # The conversation so far renders as it did: its blocks come from the prefix cache.
            assert third.usage.input_tokens_details.cached_tokens > 0

            unstored = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2, store=False)
            assert unstored.store is False
            with pytest.raises(openai.NotFoundError):
                await h.client.responses.retrieve(unstored.id)

            # The store's size, in the metrics.
            metrics = h.v.running.generations.metrics.registry
            assert metrics.get_sample_value("splitspec:responses_stored") == len(h.v.running.http.state.responses)
            assert metrics.get_sample_value("splitspec:responses_store_bytes") == \
                h.v.running.http.state.responses.used_bytes > 0

        async with http_verifier(speculate=False, responses_store_mb=0) as h:
            response = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2)
            assert response.store is False  # the store is off: nothing is kept, as the response says
            with pytest.raises(openai.NotFoundError):
                await h.client.responses.create(model="tiny", input=PROMPT, previous_response_id=response.id)

    asyncio.run(main())


def test_tool_calls_are_function_call_items_and_their_outputs_come_back() -> None:
    async def main() -> None:
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        ask = "What is the weather in Paris?"
        async with serving() as h:
            chat = await h.client.chat.completions.create(model="tiny", max_tokens=40, tools=TOOLS, tool_choice=NAMED,
                                                          messages=[{"role": "user", "content": ask}])
            call = chat.choices[0].message.tool_calls[0]
            response = await h.client.responses.create(model="tiny", max_output_tokens=40, tools=tools, input=ask,
                                                       tool_choice={"type": "function", "name": "get_weather"})
            assert [item.type for item in response.output] == ["function_call"]
            item = response.output[0]
            assert (item.name, item.arguments) == ("get_weather", call.function.arguments)
            assert response.tool_choice.name == "get_weather" and len(response.tools) == 2
            async with h.client.responses.stream(model="tiny", max_output_tokens=40, tools=tools, input=ask,
                                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
            assert [(i.name, i.arguments) for i in final.output] == [("get_weather", call.function.arguments)]

            # The call's result sent back: the same answer as the chat with its tool message.
            result = "sunny, 21 C"
            # (One tool: the tiny tokenizer spells the template out nearly character by character.)
            back = await h.client.responses.create(model="tiny", max_output_tokens=12, tools=tools[:1], input=[
                {"role": "user", "content": ask}, item.model_dump(),
                {"type": "function_call_output", "call_id": item.call_id, "output": result}], tool_choice="none")
            chat_back = await h.client.chat.completions.create(model="tiny", max_tokens=12, tools=TOOLS[:1],
                                                               tool_choice="none", messages=[
                {"role": "user", "content": ask},
                {"role": "assistant", "tool_calls": [{"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}}]},
                {"role": "tool", "tool_call_id": item.call_id, "content": result}])
            assert back.output_text == chat_back.choices[0].message.content
            assert back.usage.input_tokens == chat_back.usage.prompt_tokens
            # Continued by id, the call and its result are in the chat the same way.
            by_id = await h.client.responses.create(model="tiny", max_output_tokens=12, tools=tools[:1],
                                                    tool_choice="none",
                                                    previous_response_id=response.id, input=[
                {"type": "function_call_output", "call_id": item.call_id, "output": result}])
            assert by_id.output_text == back.output_text

            # "auto": the text before the model's Hermes block is a message item, its call a function_call
            # item after it, whole and streamed (the random model writes a block only when a regular
            # expression holds it to one, as in test_tool_calls).
            block = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
            auto = {"model": "tiny", "max_output_tokens": 80, "tools": tools, "input": ask,
                    "extra_body": {"structured_outputs": {"regex": block}}}
            whole = await h.client.responses.create(**auto)
            assert [i.type for i in whole.output] == ["message", "function_call"]
            assert whole.output[0].content[0].text == "Sure." and whole.output[1].name == "get_time"
            async with h.client.responses.stream(**auto) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            assert [i.type for i in final.output] == ["message", "function_call"]
            assert final.output[0].content[0].text.strip() == "Sure."  # streamed: the space before the block too
            assert final.output[1].arguments == whole.output[1].arguments
            assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")

    asyncio.run(main())


def test_input_tokens_counts_what_a_response_would_start_from() -> None:
    """OpenAI's responses.input_tokens.count: the usage.input_tokens of a response to the same request,
    instructions, tools and a continued conversation included, and nothing run."""
    async def main() -> None:
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        async with serving() as h:
            count = h.client.responses.input_tokens.count
            counts = []
            for request in ({"input": PROMPT}, {"input": PROMPT, "instructions": INSTRUCTIONS},
                            {"input": PROMPT, "instructions": INSTRUCTIONS, "tools": tools}):
                counted = await count(model="tiny", **request)
                assert counted.object == "response.input_tokens"
                made = await h.client.responses.create(model="tiny", max_output_tokens=2, **request)
                assert counted.input_tokens == made.usage.input_tokens, request
                counts.append(counted.input_tokens)
            assert counts[0] < counts[1] < counts[2]  # the instructions and the tools are in the prompt
            follow = {"previous_response_id": made.id, "input": "and then?", "tools": tools}
            followed = await h.client.responses.create(model="tiny", max_output_tokens=2, **follow)
            assert (await count(model="tiny", **follow)).input_tokens == followed.usage.input_tokens
            alone = await count(model="tiny", previous_response_id=made.id, tools=tools)  # no input: the stored chat
            assert 0 < followed.usage.input_tokens - alone.input_tokens < 20
            registry = h.v.running.generations.metrics.registry
            prefilled = registry.get_sample_value("splitspec:prompt_tokens_total")
            await count(model="tiny", input=PROMPT * 3)
            assert registry.get_sample_value("splitspec:prompt_tokens_total") == prefilled  # counting runs nothing

            with pytest.raises(openai.NotFoundError) as gone:
                await count(model="tiny", input="hi", previous_response_id="resp_nope")
            assert gone.value.body["param"] == "previous_response_id"
            with pytest.raises(openai.BadRequestError, match="no messages"):
                await count(model="tiny")
            with pytest.raises(openai.NotFoundError, match="not served"):
                await count(model="other", input="hi")

    asyncio.run(main())


def test_truncation_auto_leaves_out_the_fewest_earliest_turns_that_make_it_fit() -> None:
    turns = [{"role": "user", "content": PROMPT * 6}, {"role": "assistant", "content": "add " * 20},
             {"role": "user", "content": PROMPT}, {"role": "assistant", "content": "d10 " * 10},
             {"role": "user", "content": "again"}]
    system = [{"role": "system", "content": INSTRUCTIONS}]

    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            async def tokens(messages: list) -> int:
                return (await c.post("/tokenize", json={"messages": messages})).json()["count"]

            whole, context = await tokens(system + turns), h.v.running.runtime.max_model_len
            new = context - whole + 8  # too many for the whole chat; from the second user turn on, they fit
            assert new > 8 and await tokens(system + turns[2:]) + new <= context
            ask = {"model": "tiny", "instructions": INSTRUCTIONS, "input": turns, "max_output_tokens": new}
            with pytest.raises(openai.BadRequestError, match="exceeds the context"):
                await h.client.responses.create(**ask)
            response = await h.client.responses.create(**ask, truncation="auto")
            chat = await h.client.chat.completions.create(model="tiny", max_tokens=new, messages=system + turns[2:])
            assert response.truncation == "auto" and response.output_text == chat.choices[0].message.content
            assert response.usage.input_tokens == chat.usage.prompt_tokens
            # Counted, the same left out, and nothing left out where truncation is off (a chat is counted whole).
            count = h.client.responses.input_tokens.count
            counted = await count(model="tiny", instructions=INSTRUCTIONS, input=turns, truncation="auto",
                                  extra_body={"max_output_tokens": new})
            assert counted.input_tokens == response.usage.input_tokens
            assert (await count(model="tiny", instructions=INSTRUCTIONS, input=turns)).input_tokens == whole
            # Where it fits whole, nothing is left out.
            short = await h.client.responses.create(**{**ask, "max_output_tokens": context - whole}, truncation="auto")
            assert short.usage.input_tokens == whole

    asyncio.run(main())


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input.0", "function_call_output"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.message.content.0", "'input_image' parts are not served here: the model reads text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]}, 400,
     "input.0.function_call_output.output.0", "'input_file' parts are not served here"),
    ({"input": 7}, 400, "input", "neither a text nor a list"),
    ({"input": "hi", "conversation": "conv_1"}, 404, "conversation", "no conversation"),
    ({"input": "hi", "conversation": {"id": "conv_1"}, "previous_response_id": "resp_1"}, 400, "conversation",
     "not both"),
    ({"input": "hi", "context_management": [{"type": "compaction"}]}, 400, "context_management", "not supported"),
    ({"input": "hi", "max_tool_calls": -1}, 400, "max_tool_calls", "greater than or equal to 0"),
    ({"input": "hi", "truncation": "on"}, 400, "truncation", "'auto' or 'disabled'"),
    ({"input": "hi", "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}}, 400,
     "body", "not both"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     400, "body", "not among the tools"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "at most 16"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "no stored response"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "greater than or equal to 1"),
])
def test_mistakes_are_refused_naming_them(body: dict, status: int, param: str, words: str) -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            answer = await c.post("/v1/responses", json={"model": "tiny", **body})
            assert answer.status_code == status, answer.text
            error = answer.json()["error"]
            assert error["param"] == param and words in error["message"], error

    asyncio.run(main())


def test_a_client_leaving_mid_stream_frees_its_sequence() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            stream = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=200, stream=True)
            async for event in stream:
                if event.type == "response.output_text.delta":
                    break
            await stream.close()
            await wait_until(h.idle, "the sequence and the drafter's state freed")

    asyncio.run(main())


@pytest.mark.parametrize("conversation", [False, True], ids=["previous_response_id", "conversation"])
def test_the_multi_turn_example_runs_as_written(tmp_path: Path, conversation: bool) -> None:
    """examples/responses/multi_turn.py, a real process with the official client: every turn after the first
    reads the conversation so far from the prefix cache, chained by id or kept in a conversation."""
    example = Path(__file__).parents[2] / "examples" / "responses" / "multi_turn.py"
    document = tmp_path / "doc.txt"
    document.write_text(PROMPT)

    async def main() -> None:
        async with http_verifier() as h:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(example), "--base-url", f"{h.base_url}/v1", "--document", str(document),
                "--max-output-tokens", "6", *(["--conversation"] if conversation else []),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
            assert process.returncode == 0, err.decode()
            turns = re.findall(r"^turn (\d): .*prompt (\d+) tokens \((\d+) cached\)", out.decode(), re.MULTILINE)
            assert [t[0] for t in turns] == ["1", "2", "3", "4"], out.decode()
            assert all(0 < int(cached) < int(prompt) for _, prompt, cached in turns[1:])
            if conversation:  # each turn's question and answer
                assert re.search(r"^conversation conv_\w+: 8 items$", out.decode(), re.MULTILINE), out.decode()

    asyncio.run(main())


def test_the_store_keeps_the_most_recently_used_within_its_budget() -> None:
    message = ChatMessage(role="user", content="x" * 100)
    store = ResponseStore(1000)
    for name in "abc":
        assert store.put(name, {"id": name}, (message,))
    size = store.get("a").size
    assert size > 100 and store.used_bytes == 3 * size
    assert store.get("a") is not None  # a used again: b is now the least recently used
    room = 1000 // size
    for i in range(room - 2):  # one more than there is room for
        assert store.put(str(i), {"id": str(i)}, (message,))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == room and store.used_bytes == room * size <= 1000
    assert not store.put("huge", {"id": "huge"}, (ChatMessage(role="user", content="y" * 2000),))
    assert store.get("huge") is None and store.delete("0") and not store.delete("b")
    assert ResponseStore(0).enabled is False
