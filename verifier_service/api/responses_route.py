"""The Responses API's routes: POST /v1/responses (the request served as the chat it describes,
responses_schema.py; answered whole or as OpenAI's events, responses_output.py), and the stored
responses (response_store.py) that GET and DELETE /v1/responses/{id} (and GET .../input_items) read
and remove and that `previous_response_id` continues.

Under --reasoning-parser a response opens with its thinking as a reasoning item, and a stored
conversation keeps that thinking with the answer, as a reasoning item sent back in `input` does (with
or without a parser: the thinking is the conversation's, for the template to render or leave out)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from drafter_sdk.proto import verifier_pb2
from verifier_service.api.generation import Generations
from verifier_service.api.http_errors import HttpError
from verifier_service.api.http_requests import (
    HttpState,
    collect_unless_gone,
    read_body,
    refusals_as_errors,
    start_sequences,
    stream_events,
)
from verifier_service.api.http_responses import token_name
from verifier_service.api.request_parsing import PromptTooLong
from verifier_service.api.responses_output import ResponseBuilder
from verifier_service.api.responses_schema import ITEMS, ResponsesRequest, chat_history, listed_item
from verifier_service.tracing import Arrival

log = logging.getLogger(__name__)


def retrieve(state: HttpState, response_id: str) -> JSONResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise not_stored(response_id)
    return JSONResponse(entry.body)


def input_items(state: HttpState, response_id: str, query: Mapping[str, str]) -> JSONResponse:
    """OpenAI's list of a stored response's input items: `order` asc (as sent) or desc (the default),
    `limit` (1-100, 20) of them after the item `after` names."""
    entry = state.responses.get(response_id)
    if entry is None:
        raise not_stored(response_id)
    asked, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not asked.isdigit() or not 1 <= int(asked) <= 100:
        raise HttpError(400, f"limit must be a whole number within [1, 100], not {asked!r}", param="limit")
    limit = int(asked)
    if order not in ("asc", "desc"):
        raise HttpError(400, f"order must be asc or desc, not {order!r}", param="order")
    items = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise HttpError(400, f"after names no input item of response {response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def delete(state: HttpState, response_id: str) -> JSONResponse:
    if not state.responses.delete(response_id):
        raise not_stored(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def not_stored(response_id: str, param: str | None = None) -> HttpError:
    return HttpError(404, f"no stored response {response_id!r}: it was not stored (store false, or the verifier's "
                          "--responses-store-mb is 0), or it was deleted or evicted", param=param,
                     code="response_not_found")


async def respond(state: HttpState, request: Request) -> Response:
    """POST /v1/responses: the request as the chat it describes (responses_schema.py), answered as a
    response (responses_output.py), and kept where asked and the store has room (response_store.py)."""
    arrival = Arrival.now(request.headers.items())
    body = await read_body(state, request, ResponsesRequest)
    gen = state.generations
    rt, _ = refusals_as_errors(gen.check_ready)
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise not_stored(body.previous_response_id, "previous_response_id")
        body.continues(list(previous.conversation))
    refusals_as_errors(lambda: body.truncate(_fits(gen, rt.max_model_len, reserve=body.max_new_tokens or 1)))
    tools = body.tool_plan(state.tool_call_parser)
    if why := tools.unserved():
        raise HttpError(400, why, param="tool_choice")
    seqs = await start_sequences(gen, body)
    builder = ResponseBuilder(body, seqs[0], body.model or state.names()[0], tools,
                              token_name(rt.tokenizer, body.return_tokens_as_token_ids),
                              stored=body.store and state.responses.enabled, reasoning=rt.reasoning)
    if body.stream:  # stored before the last event goes out: a follow-up may continue it at once
        return StreamingResponse(stream_events(state, seqs[0], builder, arrival, lambda: _keep(state, builder)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices = await collect_unless_gone(state, request, seqs, arrival)
    if choices is None:
        return Response(status_code=499)
    builder.whole(choices[0].joined())
    _keep(state, builder)
    return JSONResponse(builder.result)


def _fits(gen: Generations, context: int, reserve: int) -> Callable[[verifier_pb2.ChatMessages], bool]:
    """Whether a chat fits the context with `reserve` tokens for the answer (truncation "auto" asks)."""
    def fits(chat: verifier_pb2.ChatMessages) -> bool:
        try:
            ids = gen.tokenize(verifier_pb2.TokenizeRequest(chat=chat)).token_ids
        except PromptTooLong:
            return False
        return len(ids) + reserve <= context
    return fits


def _keep(state: HttpState, builder: ResponseBuilder) -> None:
    """Store a finished response, with its conversation (its answer last), where it asked to be."""
    if not builder.stored or builder.result is None:
        return
    answer = chat_history(ITEMS.validate_python(builder.result["output"]))
    items = tuple(listed_item(item) for item in builder.request.input_items())
    if not state.responses.put(builder.id, builder.result, (*builder.request.continued_chat(), *answer), items):
        log.warning("response %s not stored: larger than the whole store (--responses-store-mb)", builder.id)
