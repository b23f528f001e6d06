"""The Responses API's state: stored responses and conversations, in memory, under one budget.

A stored response is what GET /v1/responses/{id} (and .../input_items) returns and what
`previous_response_id` continues. Each entry holds the response object, its request's input items and
the conversation it ended (the chat's messages without its instructions, its answer last), so that a
follow-up renders the whole chat without walking a chain of entries, and an entry stays usable after
the ones before it are evicted. A conversation shares its earlier messages with its predecessor's
entry, but each entry is charged all of them (the JSON size of the response, its input items and
every message, and a background response's events: background_runs.py), so the charge bounds the
memory from above.

A conversation (the Conversations API, conversations_route.py) is its object and its items, each as
its items list shows it, charged their JSON size; it is charged again whenever items are added.

Past the budget the least recently used entries of either kind go first; an entry larger than the
whole budget is not kept. A budget of 0 keeps nothing: responses then say `store: false`, as vLLM's
do without its store, and conversations are refused. The store is one process's: a follow-up must
reach the replica that answered (a sticky session), or send the conversation itself as `input`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

from verifier_service.api.http_schema import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    input_items: tuple[dict[str, Any], ...]  # its request's input, as GET .../input_items lists it
    size: int  # bytes charged
    events: tuple[str, ...] = ()  # a background response's stream, to be streamed again


@dataclass(frozen=True)
class StoredConversation:
    body: dict[str, Any]  # the conversation object: id, created_at, metadata
    items: tuple[dict[str, Any], ...]  # oldest first, each with its id
    size: int  # bytes charged


Entry = TypeVar("Entry", StoredResponse, StoredConversation)


class ResponseStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        # Either kind under its id (resp_..., conv_...), least recently used first.
        self._entries: OrderedDict[str, StoredResponse | StoredConversation] = OrderedDict()
        self._responses = 0  # how many of the entries are responses

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        """The responses stored."""
        return self._responses

    @property
    def conversations(self) -> int:
        return len(self._entries) - self._responses

    def put(self, response_id: str, body: dict[str, Any], conversation: tuple[ChatMessage, ...],
            input_items: tuple[dict[str, Any], ...] = (), events: tuple[str, ...] = ()) -> bool:
        """Keep the response (evicting the least recently used past the budget); False if it does not fit."""
        size = (len(json.dumps(body)) + sum(len(m.model_dump_json()) for m in conversation)
                + len(json.dumps(input_items)) + sum(map(len, events)))
        return self._keep(response_id, StoredResponse(body, conversation, input_items, size, events))

    def get(self, response_id: str) -> StoredResponse | None:
        return self._use(response_id, StoredResponse)

    def delete(self, response_id: str) -> bool:
        return self._remove(response_id, StoredResponse)

    def put_conversation(self, body: dict[str, Any], items: tuple[dict[str, Any], ...]) -> bool:
        """Keep the conversation, or its new state under the same id; False if it does not fit (what was
        kept under that id then stays)."""
        size = len(json.dumps(body)) + len(json.dumps(items))
        return self._keep(body["id"], StoredConversation(body, items, size))

    def conversation(self, conversation_id: str) -> StoredConversation | None:
        return self._use(conversation_id, StoredConversation)

    def delete_conversation(self, conversation_id: str) -> bool:
        return self._remove(conversation_id, StoredConversation)

    def _keep(self, key: str, entry: StoredResponse | StoredConversation) -> bool:
        if entry.size > self.budget_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.used_bytes + entry.size > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = entry
        self.used_bytes += entry.size
        self._responses += isinstance(entry, StoredResponse)
        return True

    def _use(self, key: str, kind: type[Entry]) -> Entry | None:
        """The entry under `key` if it is of `kind`; any entry found counts as used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry if isinstance(entry, kind) else None

    def _remove(self, key: str, kind: type[Entry]) -> bool:
        if self._use(key, kind) is None:
            return False
        self._drop(key)
        return True

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry.size
        self._responses -= isinstance(entry, StoredResponse)
