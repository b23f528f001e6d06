"""Stored responses of the Responses API: what GET /v1/responses/{id} (and .../input_items) returns
and what `previous_response_id` continues, in memory, under a budget.

Each entry holds the response object, its request's input items and the conversation it ended (the
chat's messages without its instructions, its answer last), so that a follow-up renders the whole
chat without walking a chain of entries, and an entry stays usable after the ones before it are
evicted. A conversation shares its earlier messages with its predecessor's entry, but each entry is
charged all of them (the JSON size of the response, its input items and every message, and a
background response's events: background_runs.py), so the charge bounds the memory from above. Past
the budget the least recently used entries go first; an entry larger than the whole budget is not
kept. A budget of 0 keeps nothing: responses then say `store: false`, as vLLM's do without its store.
The store is one process's: a follow-up must reach the replica that answered (a sticky session), or
send the conversation itself as `input`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from verifier_service.api.http_schema import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    input_items: tuple[dict[str, Any], ...]  # its request's input, as GET .../input_items lists it
    size: int  # bytes charged
    events: tuple[str, ...] = ()  # a background response's stream, to be streamed again


class ResponseStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict[str, Any], conversation: tuple[ChatMessage, ...],
            input_items: tuple[dict[str, Any], ...] = (), events: tuple[str, ...] = ()) -> bool:
        """Keep the response (evicting the least recently used past the budget); False if it does not fit."""
        size = (len(json.dumps(body)) + sum(len(m.model_dump_json()) for m in conversation)
                + len(json.dumps(input_items)) + sum(map(len, events)))
        if size > self.budget_bytes:
            return False
        self.delete(response_id)
        while self.used_bytes + size > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.size
        self._entries[response_id] = StoredResponse(body, conversation, input_items, size, events)
        self.used_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.used_bytes -= entry.size
        return True
