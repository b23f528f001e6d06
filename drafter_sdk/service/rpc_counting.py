"""Every call of a service's own methods counted by its final status, for the service's metrics.

An interceptor, first in the server's chain, so that what the others refuse (a missing bearer token,
a request that does not decode) is counted too. The status is the one the call ended with: the code
an abort set, OK where the method returned, CANCELLED where the call was cancelled (the client left,
or its deadline passed) and UNKNOWN where the method raised, as gRPC answers then. Health and
reflection calls are not counted. Calls refused by gRPC itself before any interceptor runs (over
--max-concurrent-rpcs) are not seen here.

A call is counted before its client can have its status. `abort()` sends the status before it raises, so
the handler is given a context whose `abort()` counts first: counted after it, a refusal was missing from
the counter that a client on the same event loop read at once, up to 16 times in 200.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

Count = Callable[[str, str], None]  # (method, status code name)


class RpcCounting(grpc.aio.ServerInterceptor):
    def __init__(self, count: Count, services: frozenset[str]) -> None:
        self._count = count
        self._services = services

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service not in self._services:
            return handler
        if handler.request_streaming:  # client streaming: no counted service has such a method
            return handler
        count = self._count
        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                counted = _CountedAbort(context, method, count)
                try:
                    response = await inner(request, counted)
                except BaseException as exc:
                    counted.count_once(_status(context, exc))
                    raise
                counted.count_once(_status(context, None))
                return response

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):  # writes with context.write: not ours to wrap
            return handler

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            counted = _CountedAbort(context, method, count)
            try:
                async for item in inner_stream(request, counted):
                    yield item
            except BaseException as exc:
                counted.count_once(_status(context, exc))
                raise
            counted.count_once(_status(context, None))

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


class _CountedAbort:
    """The call's context as its handler sees it: `abort()` counts the call, then aborts; all else is the
    context's own."""

    def __init__(self, context: grpc.aio.ServicerContext, method: str, count: Count) -> None:
        self._context = context
        self._method = method
        self._count: Count | None = count  # None once counted

    def count_once(self, code: str) -> None:
        if self._count is not None:
            self._count(self._method, code)
            self._count = None

    async def abort(self, code: grpc.StatusCode, *args: Any, **kwargs: Any) -> NoReturn:
        self.count_once(code.name)
        await self._context.abort(code, *args, **kwargs)
        raise AssertionError("unreachable: abort raises")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _status(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    code = context.code()
    if code is not None:
        return code.name
    if exc is None:
        return grpc.StatusCode.OK.name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name
