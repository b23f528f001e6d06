"""One page of a list of items, as OpenAI's item lists are paged: GET /v1/responses/{id}/input_items
and GET /v1/conversations/{id}/items read the same query (`order` asc, as the items came, or desc, the
default; `limit` 1-100, 20 by default; `after`: the id of the item the page starts after). The list
object itself (`listed`) is every list route's, GET /v1/models and the items a conversation adds too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verifier_service.api.http_errors import HttpError


def page(items: Sequence[dict[str, Any]], query: Mapping[str, str], whose: str) -> dict[str, Any]:
    """The list object for `query`'s page of `items` (oldest first); `whose`: what holds them, for errors."""
    asked, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not asked.isdigit() or not 1 <= int(asked) <= 100:
        raise HttpError(400, f"limit must be a whole number within [1, 100], not {asked!r}", param="limit")
    limit = int(asked)
    if order not in ("asc", "desc"):
        raise HttpError(400, f"order must be asc or desc, not {order!r}", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise HttpError(400, f"after names no item of {whose}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    return listed(ordered[:limit], has_more=len(ordered) > limit)


def listed(shown: Sequence[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    """OpenAI's list object of `shown` items."""
    return {"object": "list", "data": list(shown), "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": has_more}
