"""OpenAI's Conversations API: a conversation is a list of items that responses go on from.

POST /v1/conversations makes one (with up to 20 first items, and metadata); GET, POST (its metadata)
and DELETE /v1/conversations/{id} read, update and remove it; POST and GET .../items add items and
list them a page at a time (item_pages.py); GET and DELETE .../items/{item_id} read and remove one. A
response created with `conversation` starts from the conversation's items (then its own `input`; the
`instructions` of earlier responses are not among them), and once it has ended with an answer
(completed, or cut short by its token limit) its input and output items are added to it
(responses_route.py): a chat goes on turn after turn with nothing sent twice. Responses that run at
once on one conversation each start from its items as they were, and add theirs as each ends.

Conversations are kept in the response store, under its budget (response_store.py): the least
recently used go first, a conversation is one verifier's, and with --responses-store-mb 0 there are
none. An item id is unique within its conversation.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from verifier_service.api.http_errors import HttpError
from verifier_service.api.http_requests import HttpState, read_body
from verifier_service.api.http_schema import RequestBody
from verifier_service.api.item_pages import listed, page
from verifier_service.api.response_store import StoredConversation
from verifier_service.api.responses_schema import InputItem, Metadata, listed_item

log = logging.getLogger(__name__)

MAX_ITEMS_ADDED = 20  # OpenAI's: the items one request may add


class ConversationCreate(RequestBody):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_ADDED)
    metadata: Metadata = None


class ConversationUpdate(RequestBody):
    metadata: Metadata


class ItemsCreate(RequestBody):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_ADDED)


def found(state: HttpState, conversation_id: str, param: str | None = None) -> StoredConversation:
    entry = state.responses.conversation(conversation_id)
    if entry is None:
        raise HttpError(404, f"no conversation {conversation_id!r}: it was deleted or evicted (conversations are "
                             "kept in one verifier's memory, --responses-store-mb), or never made here",
                        param=param, code="conversation_not_found")
    return entry


def new_items(entry: StoredConversation | None, items: Iterable[InputItem], param: str) -> tuple[dict[str, Any], ...]:
    """`items` as the conversation lists them, each with an id (a fresh one where none is given); a 400
    where an id is given twice or is one of the conversation's already."""
    listed = tuple(listed_item(item) for item in items)
    seen = {item["id"] for item in entry.items} if entry is not None else set()
    for item in listed:
        if item["id"] in seen:
            raise HttpError(400, f"item id {item['id']!r} is already in the conversation: an id is unique within "
                                 "it (leave ids out to have fresh ones)", param=param)
        seen.add(item["id"])
    return listed


def add(state: HttpState, conversation_id: str, items: tuple[dict[str, Any], ...]) -> None:
    """A response's items added to its conversation as it ends; where the conversation has gone meanwhile,
    or would outgrow the store, they are not (and a warning says so)."""
    entry = state.responses.conversation(conversation_id)
    if entry is None:
        log.warning("a response's items were not added to conversation %s: it was deleted or evicted while the "
                    "response ran", conversation_id)
    elif not state.responses.put_conversation(entry.body, entry.items + items):
        log.warning("a response's items were not added to conversation %s: it would be larger than the whole "
                    "store (--responses-store-mb)", conversation_id)


def _kept(state: HttpState, body: dict[str, Any], items: tuple[dict[str, Any], ...]) -> None:
    if not state.responses.enabled:
        raise HttpError(400, "conversations are kept in the response store, which is off here "
                             "(--responses-store-mb 0)")
    if not state.responses.put_conversation(body, items):
        raise HttpError(400, "the conversation would be larger than the whole response store "
                             "(--responses-store-mb): it was left as it was", param="items")


async def create(state: HttpState, request: Request) -> JSONResponse:
    body = await read_body(state, request, ConversationCreate)
    conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation", "created_at": int(time.time()),
                    "metadata": body.metadata or {}}
    _kept(state, conversation, new_items(None, body.items or (), "items"))
    return JSONResponse(conversation)


def retrieve(state: HttpState, conversation_id: str) -> JSONResponse:
    return JSONResponse(found(state, conversation_id).body)


async def update(state: HttpState, conversation_id: str, request: Request) -> JSONResponse:
    """Its metadata replaced (OpenAI's update)."""
    body = await read_body(state, request, ConversationUpdate)
    entry = found(state, conversation_id)
    conversation = {**entry.body, "metadata": body.metadata or {}}
    _kept(state, conversation, entry.items)
    return JSONResponse(conversation)


def delete(state: HttpState, conversation_id: str) -> JSONResponse:
    found(state, conversation_id)
    state.responses.delete_conversation(conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def add_items(state: HttpState, conversation_id: str, request: Request) -> JSONResponse:
    """Items added at its end; the list of those added."""
    body = await read_body(state, request, ItemsCreate)
    entry = found(state, conversation_id)
    added = new_items(entry, body.items, "items")
    _kept(state, entry.body, entry.items + added)
    return JSONResponse(listed(added))


def list_items(state: HttpState, conversation_id: str, query: Mapping[str, str]) -> JSONResponse:
    return JSONResponse(page(found(state, conversation_id).items, query, f"conversation {conversation_id!r}"))


def _index(entry: StoredConversation, item_id: str) -> int:
    for i, item in enumerate(entry.items):
        if item["id"] == item_id:
            return i
    raise HttpError(404, f"no item {item_id!r} in conversation {entry.body['id']!r}", param="item_id",
                    code="item_not_found")


def retrieve_item(state: HttpState, conversation_id: str, item_id: str) -> JSONResponse:
    entry = found(state, conversation_id)
    return JSONResponse(entry.items[_index(entry, item_id)])


def delete_item(state: HttpState, conversation_id: str, item_id: str) -> JSONResponse:
    """The item removed; the conversation (OpenAI's answer)."""
    entry = found(state, conversation_id)
    i = _index(entry, item_id)
    _kept(state, entry.body, entry.items[:i] + entry.items[i + 1:])
    return JSONResponse(entry.body)
