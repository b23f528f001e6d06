"""Every HTTP request has an id, and every response says it: the caller's `X-Request-Id` (a gateway such
as Envoy sets one on every request) or a fresh one, echoed in the response's `X-Request-Id`, as vLLM's
--enable-request-id-headers does.

Downstream it names the request wherever the verifier reports it (tracing.Arrival reads it from the
headers): the chat or completion id (`chatcmpl-<id>`, as vLLM's) and the request's trace span, so a log
line of the gateway, a response and a trace all carry one id. A pure ASGI middleware rather than
Starlette's BaseHTTPMiddleware, which would hold each streamed chunk back through a task of its own.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verifier_service.api.http_errors import AnthropicError, HttpError
from verifier_service.api.request_parsing import MAX_REQUEST_ID_CHARS

HEADER = b"x-request-id"


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == HEADER), None)
        if given is not None and not 0 < len(given) <= MAX_REQUEST_ID_CHARS:
            error = HttpError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} characters, not {len(given)}",
                              param="X-Request-Id")
            await (AnthropicError.of(error) if scope["path"].startswith("/v1/messages") else error).response()(
                scope, receive, send)
            return
        request_id = given if given is not None else uuid.uuid4().hex.encode()
        if given is None:  # downstream reads it where a caller's would be
            scope = {**scope, "headers": [*scope["headers"], (HEADER, request_id)]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
