"""OpenAI's Conversations API through the official openai client, against a real verifier (tiny random
model, HTTP on port 0) with a remote SDK n-gram drafter: responses created with `conversation` go on from
its items and add theirs (whole, streamed and in the background), and the answer is exactly the chat
written out; items are added, listed a page at a time, read and removed by id; metadata is updated; a
deleted conversation is gone; mistakes are 400s and 404s naming them; conversations share the response
store's budget and leave it with --responses-store-mb 0."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from test_responses_background import engine_held
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from verifier_service.api.http_schema import ChatMessage
from verifier_service.api.response_store import ResponseStore

FOLLOW = "and then? " + PROMPT[:20]


def test_responses_go_on_from_a_conversation_and_add_their_items() -> None:
    async def main() -> None:
        async with http_verifier(metrics_port=0) as h:
            c = h.client
            conv = await c.conversations.create(metadata={"topic": "numbers"},
                                                items=[{"role": "user", "content": PROMPT}])
            assert conv.object == "conversation" and conv.metadata == {"topic": "numbers"}
            first = await c.responses.create(model="tiny", conversation=conv.id, input=[], instructions="Be brief.",
                                             max_output_tokens=10)
            assert first.conversation.id == conv.id
            second = await c.responses.create(model="tiny", conversation={"id": conv.id}, input=FOLLOW,
                                              max_output_tokens=10)
            # The chat written out: the conversation's items, without the first response's instructions.
            chat = await c.chat.completions.create(model="tiny", max_tokens=10, messages=[
                {"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": FOLLOW}])
            assert second.output_text == chat.choices[0].message.content
            assert second.usage.input_tokens == chat.usage.prompt_tokens
            # What a third turn would start from, counted without running it.
            counted = await c.responses.input_tokens.count(model="tiny", conversation=conv.id, input="more")
            assert counted.input_tokens > second.usage.input_tokens + second.usage.output_tokens

            items = [item async for item in c.conversations.items.list(conv.id, order="asc")]
            assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                         ("message", "user"), ("message", "assistant")]
            assert [i.content[0].text for i in items] == [PROMPT, first.output_text, FOLLOW, second.output_text]
            assert items[1].id == first.output[0].id and items[3].id == second.output[0].id
            paged = [i.id async for i in c.conversations.items.list(conv.id, limit=1)]
            assert paged == [i.id for i in reversed(items)]  # every page followed, newest first
            read = await c.conversations.items.retrieve(items[2].id, conversation_id=conv.id)
            assert read.content[0].text == FOLLOW

            # Streamed, and not stored: its items join the conversation all the same.
            async with c.responses.stream(model="tiny", conversation=conv.id, input="again", max_output_tokens=4,
                                          store=False) as stream:
                streamed = [event async for event in stream][-1].response  # incomplete: cut at 4 tokens
            listed = (await c.conversations.items.list(conv.id, limit=2)).data
            assert listed[0].id == streamed.output[0].id and listed[1].content[0].text == "again"
            # In the background: its items join it once it has ended.
            queued = await c.responses.create(model="tiny", conversation=conv.id, input="last", max_output_tokens=4,
                                              background=True)
            await wait_until(lambda: h.v.running.http.state.background.get(queued.id) is None,
                             "the background response to end")
            newest = (await c.conversations.items.list(conv.id, limit=1)).data[0]
            assert newest.id == (await c.responses.retrieve(queued.id)).output[0].id

            # Items added by hand, then one removed: the answer is the conversation object.
            added = await c.conversations.items.create(conv.id, items=[
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
                {"type": "message", "role": "assistant", "content": "two", "id": "msg_given"}])
            assert [i.id for i in added.data][1] == "msg_given" and added.data[0].id.startswith("msg_")
            with pytest.raises(openai.BadRequestError, match="already in the conversation") as twice:
                await c.conversations.items.create(conv.id, items=[{"role": "user", "content": "x", "id": "msg_given"}])
            assert twice.value.body["param"] == "items"
            before = len([i async for i in c.conversations.items.list(conv.id)])
            assert (await c.conversations.items.delete("msg_given", conversation_id=conv.id)).id == conv.id
            assert len([i async for i in c.conversations.items.list(conv.id)]) == before - 1
            with pytest.raises(openai.NotFoundError) as missing:
                await c.conversations.items.retrieve("msg_given", conversation_id=conv.id)
            assert missing.value.body["param"] == "item_id"

            updated = await c.conversations.update(conv.id, metadata={"topic": "words"})
            assert updated.metadata == {"topic": "words"} == (await c.conversations.retrieve(conv.id)).metadata
            registry = h.v.running.generations.metrics.registry
            assert registry.get_sample_value("splitspec:conversations_stored") == 1

            with pytest.raises(openai.BadRequestError) as both:
                await c.responses.create(model="tiny", conversation=conv.id, previous_response_id=first.id,
                                         input="x")
            assert both.value.body["param"] == "conversation"
            deleted = await c.conversations.delete(conv.id)
            assert deleted.deleted and deleted.id == conv.id
            with pytest.raises(openai.NotFoundError, match="no conversation"):
                await c.conversations.retrieve(conv.id)
            with pytest.raises(openai.NotFoundError) as gone:
                await c.responses.create(model="tiny", conversation=conv.id, input="x")
            assert gone.value.body["param"] == "conversation"
            assert registry.get_sample_value("splitspec:conversations_stored") == 0

        async with http_verifier(speculate=False, responses_store_mb=0) as h:
            with pytest.raises(openai.BadRequestError, match="--responses-store-mb 0"):
                await h.client.conversations.create()

    asyncio.run(main())


def test_responses_at_once_on_one_conversation_each_start_from_it_as_it_was() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            c = h.client
            conv = (await c.conversations.create(items=[{"role": "user", "content": PROMPT}])).id
            asks = ["first question", "second question, longer"]
            scheduler = h.v.running.runtime.engine.scheduler
            with engine_held(h):  # both arrive before either ends
                calls = [asyncio.ensure_future(c.responses.create(model="tiny", conversation=conv, input=ask,
                                                                  max_output_tokens=6)) for ask in asks]
                await wait_until(lambda: scheduler.num_waiting + scheduler.num_running == 2, "both to arrive")
            answers = await asyncio.gather(*calls)
            for ask, answer in zip(asks, answers):  # neither saw the other's turn
                counted = await c.responses.input_tokens.count(model="tiny", input=[
                    {"role": "user", "content": PROMPT}, {"role": "user", "content": ask}])
                assert answer.usage.input_tokens == counted.input_tokens
            items = [i async for i in c.conversations.items.list(conv, order="asc")]
            assert len(items) == 5 and items[0].content[0].text == PROMPT
            for answer, ask in zip(answers, asks):  # each turn added whole: its question, then its answer
                at = [i.id for i in items].index(answer.output[0].id)
                assert items[at - 1].content[0].text == ask

    asyncio.run(main())


def test_conversations_share_the_store_budget_least_recently_used_first() -> None:
    store = ResponseStore(1000)
    body = {"id": "conv_a", "object": "conversation", "created_at": 0, "metadata": {}}
    assert store.put_conversation(body, ({"id": "msg_1", "text": "x" * 300},))
    assert store.put("resp_b", {"id": "resp_b"}, (ChatMessage(role="user", content="y" * 300),))
    assert store.conversations == 1 and len(store) == 1
    # Grown past the whole budget, a conversation stays as it was.
    assert not store.put_conversation(body, ({"id": "msg_1", "text": "x" * 2000},))
    assert store.conversation("conv_a").items[0]["text"] == "x" * 300
    # Grown within it, the least recently used entry (the response) makes room.
    assert store.put_conversation(body, ({"id": "msg_1", "text": "x" * 300}, {"id": "msg_2", "text": "z" * 300}))
    assert store.get("resp_b") is None and store.used_bytes <= 1000 and len(store) == 0
    # One kind's id is not the other's.
    assert store.get("conv_a") is None and not store.delete("conv_a") and store.delete_conversation("conv_a")
    assert store.used_bytes == 0 and store.conversations == 0


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "words"), [
    ("POST", "", {"items": [{"role": "user", "content": "x"}] * 21}, 400, "items", "at most 20"),
    ("POST", "", {"metadata": {"k" * 65: "v"}}, 400, "metadata", "at most 16 pairs"),
    ("POST", "", {"items": [{"type": "web_search_call"}]}, 400, "items.0", "function_call_output"),
    ("POST", "/{id}", {}, 400, "metadata", "Field required"),
    ("POST", "/{id}/items", {"items": []}, 400, "items", "at least 1"),
    ("GET", "/{id}/items?limit=0", None, 400, "limit", "[1, 100]"),
    ("GET", "/{id}/items?after=msg_nope", None, 400, "after", "names no item"),
    ("GET", "/conv_nope", None, 404, None, "no conversation"),
    ("DELETE", "/{id}/items/msg_nope", None, 404, "item_id", "no item"),
])
def test_conversation_mistakes_are_refused_naming_them(method: str, path: str, body: dict | None, status: int,
                                                      param: str | None, words: str) -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            made = (await c.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]})).json()
            answer = await c.request(method, "/v1/conversations" + path.format(id=made["id"]), json=body)
            assert answer.status_code == status, answer.text
            error = answer.json()["error"]
            assert error["param"] == param and words in error["message"], error

    asyncio.run(main())
