"""Every HTTP response counted by route, method and status (splitspec:http_requests_total, with the
label names of the HTTP counter vLLM's /metrics carries), so that what never started a generation is
seen: a client's mistakes (400, 404), a missing token (401), a full queue (429), a verifier loading or
draining (503), and the traffic of the routes that generate nothing.

The route is its path template (`/v1/conversations/{conversation_id}`), never the path itself, so ids
do not grow the series; a path no route matched is "unmatched". A response is counted as it ends,
with the status it began with (a stream that failed midway began 200); an exception that escaped
every handler, 500. A pure ASGI middleware, the innermost, where the router leaves the route it
matched in the request's scope.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

Count = Callable[[str, str, int], None]  # (route, method, status)


class CountedResponses:
    def __init__(self, app: ASGIApp, count: Count) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response begins

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = scope.get("route")
            self.count(getattr(route, "path", "unmatched"), scope["method"], status)
