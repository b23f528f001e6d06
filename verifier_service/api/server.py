"""The verifier process: gRPC up first (NOT_SERVING), then the model, then SERVING; drain on SIGTERM.

The server starts before the model loads, so Kubernetes probes see a live
process during a long load. The server lifecycle itself is the SDK's
(drafter_sdk/service.py), shared with every drafter.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from drafter_sdk.security import server_credentials as tls_server_credentials
from drafter_sdk.service import GrpcService, stop_on_signals
from verifier_service.api.servicer import VerifierServicer
from verifier_service.builder import Runtime, build_runtime
from verifier_service.metrics import VerifierMetrics
from verifier_service.model import loader
from verifier_service.settings import ServerSettings
from verifier_service.spec.config import mode_name

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


@dataclass
class RunningVerifier:
    service: GrpcService
    servicer: VerifierServicer
    settings: ServerSettings

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def runtime(self) -> Runtime | None:
        return self.servicer.runtime

    @property
    def metrics(self) -> VerifierMetrics | None:
        return self.servicer.metrics

    @property
    def metrics_port(self) -> int | None:
        """The bound port of /metrics (useful with metrics_port 0); None without metrics."""
        return self.service.metrics_port

    async def stop(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        await self.service.stop(self.settings.grace_period_s if grace_s is None else grace_s)
        if self.runtime is not None:
            await self.runtime.engine.stop()


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
    metrics = VerifierMetrics() if settings.metrics_port is not None else None
    servicer = VerifierServicer(metrics)
    service = await GrpcService.start(
        SERVICE_NAME, lambda server: verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server),
        host=settings.host, port=settings.port, server_credentials=server_credentials,
        auth_token=settings.auth_token, max_message_bytes=settings.max_message_bytes,
        max_concurrent_rpcs=settings.max_concurrent_rpcs, interceptors=interceptors,
        metrics_registry=metrics.registry if metrics else None, metrics_port=settings.metrics_port)
    if server_credentials is not None and settings.tls_client_ca:
        log.info("clients must present a certificate (mutual TLS)")
    return RunningVerifier(service, servicer, settings)


async def attach_model(running: RunningVerifier, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       model_name: str) -> Runtime:
    """Wire a loaded model into the running server and report SERVING."""
    rt = await build_runtime(model, tokenizer, running.settings, model_name, running.metrics)
    rt.engine.start()
    running.servicer.attach(rt)
    await running.service.set_serving(True)
    log.info("serving %s, speculation %s", model_name, mode_name(rt.settings.speculative.mode))
    return rt


async def run(settings: ServerSettings, port_file: str | None = None,
              server_credentials: grpc.ServerCredentials | None = None,
              interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> None:
    """Serve until SIGTERM/SIGINT: load the model, then drain gracefully on a signal."""
    running = await start_server(settings, server_credentials, interceptors)
    if port_file:
        running.service.write_port_file(port_file)
    stop = asyncio.Event()
    stop_on_signals(lambda sig: stop.set())
    try:
        source = loader.resolve_source(settings.model)
        device = loader.pick_device(settings.device)
        dtype = loader.pick_dtype(settings.dtype, device)
        loading = asyncio.ensure_future(asyncio.to_thread(loader.load, source, dtype, device))
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
