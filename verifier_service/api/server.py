"""The verifier's gRPC server: VerifierService, health, reflection, graceful shutdown.

The server starts first with health NOT_SERVING, then loads the model, so
Kubernetes probes see a live process during a long model load.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.metrics import MetricsServer, start_metrics_server
from drafter_sdk.proto import drafter_pb2, verifier_pb2, verifier_pb2_grpc
from drafter_sdk.security import BearerTokenServerInterceptor
from drafter_sdk.security import server_credentials as tls_server_credentials
from verifier_service.model import loader as model_loader
from verifier_service.spec.config import mode_name
from verifier_service.metrics import RequestTimer, VerifierMetrics
from verifier_service.api.request_parsing import GenerateLike, RequestError, parse
from verifier_service.builder import Runtime, build_runtime
from verifier_service.engine.scheduler import QueueFullError
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.settings import ServerSettings

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
VERSION = "0.1.0"
FINISH = {FinishReason.STOP: verifier_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: verifier_pb2.FINISH_REASON_LENGTH}
FINISHED_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # metric label; else "abort"


def stats_message(seq: Sequence) -> verifier_pb2.SpeculationStats:
    s = seq.stats
    return verifier_pb2.SpeculationStats(
        num_steps=s.num_steps, num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens, num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
        mean_acceptance_length=s.mean_acceptance_length, acceptance_rate=s.acceptance_rate,
        num_drafter_failures=s.num_drafter_failures, auto_disabled=s.auto_disabled)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, settings: ServerSettings, metrics: VerifierMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.runtime: Runtime | None = None

    async def _start(self, request: GenerateLike, context: grpc.aio.ServicerContext) -> tuple[Runtime, Sequence]:
        rt = self.runtime
        if rt is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        try:
            seq = rt.new_sequence(parse(request, rt.tokenizer, rt.limits))
            rt.engine.submit(seq)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return rt, seq

    async def _outputs(self, rt: Runtime, seq: Sequence, context: grpc.aio.ServicerContext,
                       arrival: float) -> AsyncIterator[Output]:
        timer = RequestTimer(self.metrics, seq, arrival) if self.metrics is not None else None
        reason = "abort"
        try:
            while True:
                out = await seq.outputs.get()
                if out.error:
                    reason = "error"
                    await context.abort(grpc.StatusCode.INTERNAL, out.error)
                if timer is not None:
                    timer.tokens(len(out.token_ids))
                if out.finish_reason is not None:
                    reason = FINISHED_REASON.get(out.finish_reason, "abort")
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            # Client cancelled or disconnected: free the sequence at the next step.
            rt.engine.cancel(seq)
            if timer is not None:
                timer.finish(reason)

    async def Generate(self, request: verifier_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> verifier_pb2.GenerateResponse:
        arrival = time.perf_counter()
        rt, seq = await self._start(request, context)
        text: list[str] = []
        async for out in self._outputs(rt, seq, context, arrival):
            text.append(out.text)
        return verifier_pb2.GenerateResponse(
            request_id=request.request_id or seq.request_id, text="".join(text), token_ids=seq.output_ids,
            finish_reason=FINISH[seq.finish_reason], stop_reason=seq.stop_reason,
            prompt_tokens=len(seq.prompt_ids), stats=stats_message(seq))

    async def GenerateStream(self, request: verifier_pb2.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.GenerateStreamResponse]:
        arrival = time.perf_counter()
        rt, seq = await self._start(request, context)
        request_id = request.request_id or seq.request_id
        async for out in self._outputs(rt, seq, context, arrival):
            msg = verifier_pb2.GenerateStreamResponse(request_id=request_id, text=out.text, token_ids=out.token_ids)
            if out.finish_reason is not None:
                msg.finish_reason = FINISH[out.finish_reason]
                msg.stop_reason = out.stop_reason
                msg.prompt_tokens = len(seq.prompt_ids)
                msg.stats.CopyFrom(stats_message(seq))
            elif not out.text and not out.token_ids:
                continue
            yield msg

    async def GetServerInfo(self, request: verifier_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> verifier_pb2.GetServerInfoResponse:
        rt = self.runtime
        if rt is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        runner = rt.engine.runner
        if rt.drafter is not None and not rt.drafter_name and rt.drafter.stats.calls > rt.drafter.stats.failures:
            await _probe_drafter(rt, timeout_s=1.0)  # absent at start-up, answering now: learn who it is
        return verifier_pb2.GetServerInfoResponse(
            model=rt.model_name, tokenizer=getattr(rt.tokenizer, "name_or_path", "") or rt.model_name,
            vocab_size=rt.limits.vocab_size, max_model_len=rt.limits.max_model_len,
            max_num_seqs=rt.engine.scheduler.max_num_seqs, max_queue_len=rt.engine.scheduler.max_queue_len,
            default_max_new_tokens=rt.limits.default_max_new_tokens, speculative_config=rt.settings.speculative,
            drafter=self._drafter_health(rt), verifier_id=rt.verifier_id, version=VERSION,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."))

    @staticmethod
    def _drafter_health(rt: Runtime) -> verifier_pb2.DrafterHealth:
        client = rt.drafter
        if client is None:
            return verifier_pb2.DrafterHealth(state=verifier_pb2.DRAFTER_STATE_NOT_CONFIGURED)
        return verifier_pb2.DrafterHealth(
            state=verifier_pb2.DRAFTER_STATE_HEALTHY if client.healthy else verifier_pb2.DRAFTER_STATE_UNAVAILABLE,
            target=client.transport.target, name=rt.drafter_name, version=rt.drafter_version,
            calls=client.stats.calls, failures=client.stats.failures, last_error=client.stats.last_error)


@dataclass
class RunningVerifier:
    server: grpc.aio.Server
    servicer: VerifierServicer
    health: health.HealthServicer
    port: int
    grace_period_s: float
    metrics_server: MetricsServer | None = None

    @property
    def runtime(self) -> Runtime | None:
        return self.servicer.runtime

    @property
    def metrics(self) -> VerifierMetrics | None:
        return self.servicer.metrics

    @property
    def metrics_port(self) -> int | None:
        """The bound port of /metrics (useful with metrics_port 0); None without metrics."""
        return self.metrics_server.port if self.metrics_server is not None else None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        await self.set_serving(False)
        await self.server.stop(self.grace_period_s if grace_s is None else grace_s)
        if self.runtime is not None:
            await self.runtime.engine.stop()
        if self.metrics_server is not None:
            # shutdown() blocks until the serving thread notices; keep the event loop free meanwhile.
            await asyncio.to_thread(self.metrics_server.close)
            self.metrics_server = None


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
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes) -> object:
            try:
                return deserialize(data)
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's
                return _Undecodable(f"the request to {method} is not a valid protobuf message: {exc}")

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


async def start_server(settings: ServerSettings,
                       server_credentials: grpc.ServerCredentials | None = None,
                       interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> RunningVerifier:
    """Bind and start the gRPC server (health NOT_SERVING, no model yet).

    Without explicit `server_credentials`, settings.tls_cert/tls_key serve TLS and
    settings.tls_client_ca requires client certificates (mTLS); settings.auth_token
    requires `authorization: Bearer <token>` on every call but health and reflection.
    With settings.metrics_port (0: any free port), Prometheus metrics are served over
    HTTP at /metrics on settings.host, from before the model loads.
    """
    if server_credentials is None and settings.tls_cert:
        server_credentials = tls_server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    interceptors = (*((BearerTokenServerInterceptor(settings.auth_token),) if settings.auth_token else ()),
                    MalformedRequestInterceptor(), *interceptors)
    metrics = metrics_server = None
    if settings.metrics_port is not None:  # first: a taken port fails start-up before gRPC binds
        metrics = VerifierMetrics()
        metrics_server = start_metrics_server(metrics.registry, settings.host, settings.metrics_port)
        log.info("metrics on http://%s:%d/metrics", settings.host, metrics_server.port)
    try:
        return await _start_grpc(settings, server_credentials, interceptors, metrics, metrics_server)
    except BaseException:
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)
        raise


async def _start_grpc(settings: ServerSettings, server_credentials: grpc.ServerCredentials | None,
                      interceptors: tuple[grpc.aio.ServerInterceptor, ...], metrics: VerifierMetrics | None,
                      metrics_server: MetricsServer | None) -> RunningVerifier:
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ], maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    servicer = VerifierServicer(settings, metrics)
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    port = (server.add_secure_port(address, server_credentials) if server_credentials
            else server.add_insecure_port(address))
    await server.start()
    running = RunningVerifier(server, servicer, health_servicer, port, settings.grace_period_s, metrics_server)
    await running.set_serving(False)
    log.info("verifier listening on %s:%d (%s%s; loading model)", settings.host, port,
             "plaintext" if server_credentials is None else "mutual TLS" if settings.tls_client_ca else "TLS",
             ", bearer auth" if settings.auth_token else "")
    return running


async def attach_model(running: RunningVerifier, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       model_name: str) -> Runtime:
    """Wire a loaded model into the running server and report SERVING."""
    rt = await build_runtime(model, tokenizer, running.servicer.settings, model_name, running.servicer.metrics)
    await rt.engine.start()
    if rt.drafter is not None:
        await _probe_drafter(rt)
    running.servicer.runtime = rt
    await running.set_serving(True)
    log.info("serving %s, speculation %s", model_name, mode_name(rt.settings.speculative.mode))
    return rt


async def _probe_drafter(rt: Runtime, timeout_s: float = 2.0) -> None:
    """Learn the drafter's identity; a missing drafter is not fatal (the breaker retries)."""
    try:
        info: drafter_pb2.GetDrafterInfoResponse = await rt.drafter.info(timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - absent drafter: serve without speculation until it appears
        log.warning("drafter %s not reachable yet (%s); decoding without drafts until it is",
                    rt.drafter.transport.target, exc)
        return
    rt.drafter_name, rt.drafter_version = info.name, info.version
    if info.vocab_size and info.vocab_size != rt.limits.vocab_size:
        log.warning("drafter %s expects vocab size %d, the model has %d; its drafts will mostly be rejected",
                    info.name, info.vocab_size, rt.limits.vocab_size)
    log.info("drafter %s %s at %s", info.name, info.version, rt.drafter.transport.target)


async def run(settings: ServerSettings, port_file: str | None = None,
              server_credentials: grpc.ServerCredentials | None = None,
              interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> None:
    """Serve until SIGTERM/SIGINT: load the model, then drain gracefully on a signal."""
    running = await start_server(settings, server_credentials, interceptors)
    if port_file:
        Path(port_file).write_text(str(running.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        source = model_loader.resolve_source(settings.model)
        device = model_loader.pick_device(settings.device)
        dtype = model_loader.pick_dtype(settings.dtype, device)
        loading = asyncio.ensure_future(asyncio.to_thread(model_loader.load, source, dtype, device))
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            model, tokenizer = loading.result()
            await attach_model(running, model, tokenizer, source.name)
            await stop.wait()
        log.info("shutting down: draining for up to %.0f s", settings.grace_period_s)
    finally:
        await running.stop()
    log.info("stopped")
