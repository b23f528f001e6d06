"""The Responses API's routes: POST /v1/responses (the request served as the chat it describes,
responses_schema.py; answered whole or as OpenAI's events, responses_output.py, or run in the
background, background_runs.py), and the stored responses (response_store.py) that GET and DELETE
/v1/responses/{id} (and GET .../input_items) read and remove and that `previous_response_id`
continues, as `conversation` goes on from a conversation's items (conversations_route.py, which this
response's items then join). GET also reads a background response while it runs, and streams its
events again; POST .../cancel stops it. POST /v1/responses/input_tokens counts a request's prompt
without running it.

Under --reasoning-parser a response opens with its thinking as a reasoning item, and a stored
conversation keeps that thinking with the answer, as a reasoning item sent back in `input` does (with
or without a parser: the thinking is the conversation's, for the template to render or leave out)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import conversations_route
from verifier_service.api.background_runs import BackgroundRun
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
from verifier_service.api.item_pages import page
from verifier_service.api.request_parsing import PromptTooLong
from verifier_service.api.response_store import StoredConversation, StoredResponse
from verifier_service.api.responses_output import ResponseBuilder
from verifier_service.api.responses_schema import (
    ITEMS,
    InputTokensRequest,
    ResponsesRequest,
    chat_history,
    listed_item,
)
from verifier_service.tracing import Arrival

log = logging.getLogger(__name__)


def _found(state: HttpState, response_id: str) -> tuple[BackgroundRun | None, StoredResponse | None]:
    """The response running in the background or (else) stored under that id; a 404 where neither is."""
    run = state.background.get(response_id)
    entry = state.responses.get(response_id) if run is None else None
    if run is None and entry is None:
        raise not_stored(response_id)
    return run, entry


def retrieve(state: HttpState, response_id: str, query: Mapping[str, str]) -> Response:
    """The response as it stands (a background one's while it runs); with `stream=true`, a background
    response's events after the one `starting_after` numbers (all by default), then each as it comes."""
    run, entry = _found(state, response_id)
    stream = query.get("stream", "false")
    if stream not in ("true", "false"):
        raise HttpError(400, f"stream must be true or false, not {stream!r}", param="stream")
    if stream == "false":
        return JSONResponse(run.body() if run is not None else entry.body)
    asked = query.get("starting_after", "-1")
    after = int(asked) if re.fullmatch(r"-?[0-9]+", asked) else -2
    if after < -1:
        raise HttpError(400, f"starting_after must be an event's sequence number, not {asked!r}",
                        param="starting_after")
    if run is not None:
        return _streamed(run.follow(after))
    if not entry.body.get("background"):
        raise HttpError(400, f"response {response_id!r} was not run in the background: only a background "
                             "response's events are kept to be streamed again", param="stream")
    return _streamed(_replayed(entry.events[after + 1:]))


async def _replayed(events: tuple[str, ...]) -> AsyncIterator[str]:
    for event in events:
        yield event


def _streamed(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def cancel(state: HttpState, response_id: str) -> JSONResponse:
    """POST /v1/responses/{id}/cancel: a background response stopped, with its output so far (cancelling it
    again returns the same)."""
    run = state.background.get(response_id)
    if run is not None:
        await state.background.cancel(run)
        return JSONResponse(run.body())
    entry = state.responses.get(response_id)
    if entry is None:
        raise not_stored(response_id)
    status = entry.body["status"]
    if not entry.body.get("background"):
        raise HttpError(400, f"response {response_id!r} was not run in the background: only a background "
                             "response can be cancelled", param="response_id")
    if status != "cancelled":
        raise HttpError(400, f"response {response_id!r} has already ended ({status}): only a queued or "
                             "in-progress response can be cancelled", param="response_id")
    return JSONResponse(entry.body)


def input_items(state: HttpState, response_id: str, query: Mapping[str, str]) -> JSONResponse:
    """OpenAI's list of a stored (or running) response's input items, a page at a time (item_pages.py)."""
    run, entry = _found(state, response_id)
    return JSONResponse(page(run.input_items if run is not None else entry.input_items, query,
                             f"response {response_id!r}'s input"))


async def delete(state: HttpState, response_id: str) -> JSONResponse:
    """A stored response removed; a background one still running is cancelled first."""
    run = state.background.get(response_id)
    if run is not None:
        await state.background.cancel(run)
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
    if body.background and not (body.store and state.responses.enabled):
        where = "send store true (the default)" if state.responses.enabled else \
            "it is off here (--responses-store-mb 0)"
        raise HttpError(400, f"a background response is read back from the response store: {where}",
                        param="background")
    conversation = _whole_chat(state, body, rt.max_model_len)
    items = (conversations_route.new_items(conversation, body.input_items(), "input") if conversation is not None
             else tuple(listed_item(item) for item in body.input_items()))
    tools = body.tool_plan(state.tool_call_parser)
    if why := tools.unserved():
        raise HttpError(400, why, param="tool_choice")
    seqs = await start_sequences(gen, body)
    builder = ResponseBuilder(body, seqs[0], body.model or state.names()[0], tools,
                              token_name(rt.tokenizer, body.return_tokens_as_token_ids),
                              stored=body.store and state.responses.enabled, reasoning=rt.reasoning,
                              background=bool(body.background))
    if body.background:
        run = await state.background.start(builder, items, gen.outputs(seqs[0], arrival),
                                           lambda ended: _ended(state, builder, items, tuple(ended.events)),
                                           state.request())
        return _streamed(run.follow(-1)) if body.stream else JSONResponse(run.body())
    if body.stream:  # stored before the last event goes out: a follow-up may continue it at once
        return _streamed(stream_events(state, seqs[0], builder, arrival, lambda: _keep(state, builder, items)))
    choices = await collect_unless_gone(state, request, seqs, arrival)
    if choices is None:
        return Response(status_code=499)
    builder.whole(choices[0].joined())
    _keep(state, builder, items)
    return JSONResponse(builder.result)


async def input_tokens(state: HttpState, request: Request) -> JSONResponse:
    """POST /v1/responses/input_tokens (OpenAI's count): the prompt tokens the same request would start
    from, as its usage's `input_tokens` would say, with the conversation `previous_response_id` continues
    and what truncation "auto" leaves out; a chat too long to generate from is counted."""
    body = await read_body(state, request, InputTokensRequest)
    gen = state.generations
    rt, _ = refusals_as_errors(gen.check_ready)
    _whole_chat(state, body, rt.max_model_len)
    tokens = refusals_as_errors(lambda: gen.tokenize(verifier_pb2.TokenizeRequest(chat=body.chat())))
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(tokens.token_ids)})


def _whole_chat(state: HttpState, body: ResponsesRequest, context: int) -> StoredConversation | None:
    """The request's chat made whole: the stored response's conversation it continues, or the items of its
    `conversation` (which it returns), first; then, under truncation "auto", its earliest turns left out
    until it fits the context with its answer."""
    conversation = None
    if body.conversation_id is not None:
        conversation = conversations_route.found(state, body.conversation_id, "conversation")
        body.continues(chat_history(ITEMS.validate_python(conversation.items)))
    if body.previous_response_id is not None:
        if state.background.get(body.previous_response_id) is not None:
            raise HttpError(400, f"response {body.previous_response_id!r} is still running in the background: "
                                 "continue it once it has ended", param="previous_response_id")
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise not_stored(body.previous_response_id, "previous_response_id")
        body.continues(list(previous.conversation))
    refusals_as_errors(lambda: body.truncate(_fits(state.generations, context, reserve=body.max_new_tokens or 1)))
    return conversation


def _fits(gen: Generations, context: int, reserve: int) -> Callable[[verifier_pb2.ChatMessages], bool]:
    """Whether a chat fits the context with `reserve` tokens for the answer (truncation "auto" asks)."""
    def fits(chat: verifier_pb2.ChatMessages) -> bool:
        try:
            ids = gen.tokenize(verifier_pb2.TokenizeRequest(chat=chat)).token_ids
        except PromptTooLong:
            return False
        return len(ids) + reserve <= context
    return fits


def _ended(state: HttpState, builder: ResponseBuilder, items: tuple[dict[str, Any], ...],
           events: tuple[str, ...]) -> None:
    """A background response has ended: kept as any response is, then announced (--webhook-url)."""
    _keep(state, builder, items, events)
    if state.webhooks is not None and builder.result is not None:
        state.webhooks.response_ended(builder.result)


def _keep(state: HttpState, builder: ResponseBuilder, items: tuple[dict[str, Any], ...],
          events: tuple[str, ...] = ()) -> None:
    """Store a finished response, with its conversation (its answer last), its input `items` and (in the
    background) its `events`, where it asked to be; add its input and output items to its `conversation`
    where it ended with an answer."""
    result = builder.result
    if result is None:
        return
    # The conversation its items join: one it went on from, where it ended with an answer.
    joined = builder.request.conversation_id if result["status"] in ("completed", "incomplete") else None
    if not builder.stored and joined is None:
        return
    output = ITEMS.validate_python(result["output"])
    if joined is not None:
        conversations_route.add(state, joined, items + tuple(listed_item(item) for item in output))
    if builder.stored and not state.responses.put(
            builder.id, result, (*builder.request.continued_chat(), *chat_history(output)), items, events):
        log.warning("response %s not stored: larger than the whole store (--responses-store-mb)", builder.id)
