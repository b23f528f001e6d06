"""Anthropic's Messages API routes: POST /v1/messages (the request served as the chat it describes,
messages_schema.py; answered whole or as Anthropic's events, messages_output.py, with a reasoning
model's thinking apart under the server's --reasoning-parser) and POST /v1/messages/count_tokens.
Their errors are Anthropic's error objects, with the statuses the OpenAI routes give the same mistakes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from drafter_sdk.proto import verifier_pb2
from verifier_service.api.http_errors import AnthropicError, HttpError
from verifier_service.api.http_requests import (
    HttpState,
    collect_unless_gone,
    read_body,
    refusals_as_errors,
    start_sequences,
    stream_events,
)
from verifier_service.api.messages_output import MessageBuilder
from verifier_service.api.messages_schema import MessagesRequest
from verifier_service.tracing import Arrival


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # not asked for: nothing is generated


@contextlib.contextmanager
def _in_anthropic_shape() -> Iterator[None]:
    """A refusal on these routes as Anthropic's error object."""
    try:
        yield
    except HttpError as e:
        raise AnthropicError.of(e) from None


async def respond(state: HttpState, request: Request) -> Response:
    with _in_anthropic_shape():
        return await _respond(state, request)


async def count_tokens(state: HttpState, request: Request) -> JSONResponse:
    """The prompt tokens the same message would start from (a chat too long to generate from is counted)."""
    with _in_anthropic_shape():
        body = await read_body(state, request, CountTokensRequest)
        tokens = refusals_as_errors(lambda: state.generations.tokenize(verifier_pb2.TokenizeRequest(chat=body.chat())))
    return JSONResponse({"input_tokens": len(tokens.token_ids)})


async def _respond(state: HttpState, request: Request) -> Response:
    arrival = Arrival.now(request.headers.items())
    body = await read_body(state, request, MessagesRequest)
    rt, _ = refusals_as_errors(state.generations.check_ready)
    if body.thinking_budget is not None and rt.reasoning is None:
        raise HttpError(400, "thinking with a budget needs a verifier started with --reasoning-parser (a reasoning "
                             "model's markers); this one reads no thinking", param="thinking")
    tools = body.tool_plan(state.tool_call_parser)
    if why := tools.unserved():
        raise HttpError(400, why, param="tool_choice")
    (seq,) = await start_sequences(state.generations, body)
    builder = MessageBuilder(body, seq, body.model or state.names()[0], tools, rt.reasoning)
    if body.stream:
        return StreamingResponse(stream_events(state, seq, builder, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices = await collect_unless_gone(state, request, [seq], arrival)
    if choices is None:
        return Response(status_code=499)
    return JSONResponse(builder.whole(choices[0].joined()))
