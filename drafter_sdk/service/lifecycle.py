"""The one gRPC server lifecycle both splitspec services use (a drafter and the verifier).

`GrpcService.start` binds a grpc.aio server with health reporting NOT_SERVING,
server reflection, an interceptor that answers undecodable requests with
INVALID_ARGUMENT, optional bearer-token auth and TLS, and optional Prometheus
metrics on their own port. The owner flips health to SERVING once it is ready
(a drafter's `load()`, the verifier's model), and `stop` drains: health goes
NOT_SERVING for every service, new calls are refused, in-flight ones get the
grace period (a later `stop` with a shorter one ends it sooner). `write_port_file` publishes the bound
port atomically, and `stop_on_signals` wires SIGTERM/SIGINT, and the parent's exit, to a callback, and a
second signal to another: someone who presses Ctrl-C twice wants the drain over, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from drafter_sdk.errors import ListenError
from drafter_sdk.service.metrics_endpoint import MetricsServer, start_metrics_server
from drafter_sdk.service.rpc_counting import Count, RpcCounting
from drafter_sdk.service.security import BearerTokenServerInterceptor, TokenSource

log = logging.getLogger(__name__)

MIB = 1 << 20
# Set by a process that starts this one as its child (verifier_service/tools/local_services.py): the
# read end of a pipe whose only write end that parent holds, as "descriptor:inode". The kernel closes
# the write end when the parent exits, however it exits (SIGKILL included, where the parent can stop
# nothing itself), and this process then stops. PR_SET_PDEATHSIG would not do: it fires when the
# forking *thread* exits.
LIFELINE_FD_ENV = "SPLITSPEC_LIFELINE_FD"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcService:
    """A started server: `port` is the bound port (useful with port 0), `metrics_port` the bound
    port of /metrics (None without metrics)."""

    def __init__(self, server: grpc.aio.Server, port: int, service_name: str,
                 health_servicer: health.aio.HealthServicer, metrics_server: MetricsServer | None) -> None:
        self.server = server
        self.port = port
        self.service_name = service_name
        self.health = health_servicer
        self.metrics_server = metrics_server  # None once stopped
        self.serving = False  # the overall health status, for /health beside /metrics

    @classmethod
    async def start(cls, service_name: str, add_servicers: Callable[[grpc.aio.Server], None], *,
                    host: str, port: int, server_credentials: grpc.ServerCredentials | None = None,
                    auth_token: TokenSource | None = None, max_message_bytes: int = 16 * MIB,
                    max_concurrent_rpcs: int | None = None, options: Sequence[tuple[str, object]] = (),
                    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                    metrics_registry: CollectorRegistry | None = None,
                    metrics_port: int | None = None, count_calls: Count | None = None) -> "GrpcService":
        """Bind and start, health NOT_SERVING. `add_servicers(server)` registers the service's own
        servicers; `service_name` is its full name, for health and reflection. With `metrics_port`
        (0: any free port) and a registry, /metrics is served over HTTP on `host` from now on. With
        `count_calls`, every call of the service's methods is counted by its final status (rpc_counting.py)."""
        metrics_server, service = None, None
        if metrics_port and metrics_port == port:  # gRPC would find it taken by /metrics, and say only "taken"
            raise ListenError(f"the metrics port and the gRPC port are both {port}: give each its own")
        if metrics_port is not None and metrics_registry is not None:
            # First: a taken metrics port fails start-up before gRPC binds.
            try:
                metrics_server = start_metrics_server(metrics_registry, host, metrics_port,
                                                      lambda: service is not None and service.serving)
            except OSError as exc:
                raise ListenError(f"cannot listen on {host}:{metrics_port} (metrics): {exc.strerror or exc}") from exc
            log.info("metrics on http://%s:%d/metrics", host, metrics_server.port)
        try:
            service = await cls._start_grpc(service_name, add_servicers, host, port, server_credentials, auth_token,
                                            max_message_bytes, max_concurrent_rpcs, options, interceptors,
                                            metrics_server, count_calls)
            return service
        except BaseException:
            if metrics_server is not None:
                await asyncio.to_thread(metrics_server.close)
            raise

    @classmethod
    async def _start_grpc(cls, service_name: str, add_servicers: Callable[[grpc.aio.Server], None], host: str,
                          port: int, server_credentials: grpc.ServerCredentials | None, auth_token: TokenSource | None,
                          max_message_bytes: int, max_concurrent_rpcs: int | None,
                          options: Sequence[tuple[str, object]], interceptors: Sequence[grpc.aio.ServerInterceptor],
                          metrics_server: MetricsServer | None, count_calls: Count | None) -> "GrpcService":
        # The counting first: it sees what the others refuse.
        chain = [*([RpcCounting(count_calls, frozenset({service_name}))] if count_calls is not None else []),
                 *([BearerTokenServerInterceptor(auth_token)] if auth_token else []), MalformedRequestInterceptor(),
                 *interceptors]
        server = grpc.aio.server(interceptors=chain, maximum_concurrent_rpcs=max_concurrent_rpcs, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Two servers must never silently share one port.
            ("grpc.so_reuseport", 0),
            *options,
        ])
        add_servicers(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{host}:{port}"
        try:
            bound = (server.add_insecure_port(address) if server_credentials is None
                     else server.add_secure_port(address, server_credentials))
        except RuntimeError as exc:  # gRPC says only that it failed
            raise ListenError(f"cannot listen on {address} (gRPC): the port is taken, or the address is not "
                              "this host's") from exc
        service = cls(server, bound, service_name, health_servicer, metrics_server)
        await service.set_serving(False)
        await server.start()
        log.info("%s listening on %s:%d (%s%s)", service_name, host, bound,
                 "plaintext" if server_credentials is None else "TLS", ", bearer auth" if auth_token else "")
        return service

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server is not None else None

    async def set_serving(self, serving: bool) -> None:
        """The overall status ("") and the service's own follow the owner's readiness."""
        for name in ("", self.service_name):
            await self.health.set(name, _SERVING if serving else _NOT_SERVING)
        self.serving = serving

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING (for good), refuse new calls, let in-flight ones finish within grace_s. A call
        made while one is under way with a shorter grace_s ends both sooner (grpc keeps the shortest)."""
        await self.health.enter_graceful_shutdown()
        self.serving = False
        await self.server.stop(grace_s)
        if self.metrics_server is not None:
            metrics_server, self.metrics_server = self.metrics_server, None
            # shutdown() blocks until the serving thread notices; keep the event loop free meanwhile.
            await asyncio.to_thread(metrics_server.close)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    def write_port_file(self, path: str | os.PathLike[str]) -> None:
        """Publish the bound port; readers polling for the file never see it half written."""
        write_port_file(path, self.port)


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Write `port` to `path` atomically: readers polling for the file never see it half written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def stop_on_signals(callback: Callable[[signal.Signals], None],
                    again: Callable[[signal.Signals], None] | None = None) -> None:
    """Call `callback(signal)` on SIGTERM or SIGINT, from the running event loop; and as on SIGTERM
    when this process's lifeline breaks (`LIFELINE_FD_ENV`). Each signal after the first calls
    `again(signal)` instead (the drain cut short), where given."""
    loop = asyncio.get_running_loop()
    stopping = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            callback(sig)
        elif again is not None:
            log.warning("received %s again: ending the calls still in flight now", sig.name)
            again(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    lifeline = held_lifeline(os.environ.pop(LIFELINE_FD_ENV, ""))  # popped: no child of this one holds it
    if lifeline is None:
        return

    def broken() -> None:  # readable means end of file: its writer never writes
        loop.remove_reader(lifeline)
        os.close(lifeline)
        if not stopping:  # else it stops already: a parent gone is no second signal
            log.warning("the process that started this one has gone: stopping as on SIGTERM")
            on_signal(signal.SIGTERM)

    loop.add_reader(lifeline, broken)


def held_lifeline(value: str) -> int | None:
    """The lifeline's descriptor, if this process holds the very pipe `value` ("fd:inode") names. A
    process started by the one given it (torchrun's ranks) inherits the variable but not the pipe,
    and may hold an unrelated file under that number."""
    fd, _, inode = value.partition(":")
    try:
        held = os.fstat(int(fd))
    except (ValueError, OSError):
        return None
    return int(fd) if stat.S_ISFIFO(held.st_mode) and str(held.st_ino) == inode else None


class _Undecodable:
    """Stands in for a request whose bytes do not parse as its message type."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers requests that do not decode (corrupt wire format, invalid UTF-8 in a string)
    with INVALID_ARGUMENT; gRPC's own answer would be UNKNOWN, as for a server bug."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes) -> object:
            try:
                return deserialize(data)
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's
                return _Undecodable(f"the request to {method} is not a valid protobuf message: {exc}")

        if handler.request_streaming:
            return _checked_stream_stream(handler, safe_deserialize)
        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=safe_deserialize, response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):  # writes with context.write (health Watch): leave as is
            return handler

        async def stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            async for item in inner_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=safe_deserialize, response_serializer=handler.response_serializer)


def _checked_stream_stream(handler: grpc.RpcMethodHandler,
                           deserialize: Callable[[bytes], object]) -> grpc.RpcMethodHandler:
    """A request stream whose messages decode with `deserialize`: the first undecodable one ends
    the call with INVALID_ARGUMENT (PrepareDraftTokensStream). Other shapes are left as they are."""
    inner = handler.stream_stream
    if not handler.response_streaming or not inspect.isasyncgenfunction(inner):
        return handler

    async def stream(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        async def decoded() -> AsyncIterator[object]:
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                yield request

        async for item in inner(decoded(), context):
            yield item

    return grpc.stream_stream_rpc_method_handler(
        stream, request_deserializer=deserialize, response_serializer=handler.response_serializer)
