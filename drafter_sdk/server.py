"""Run a Drafter as a gRPC DrafterService with health, reflection, idle eviction and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_sdk.drafter import Drafter
from drafter_sdk.metrics import DrafterMetrics, MetricsServer, start_metrics_server
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.security import BearerTokenServerInterceptor
from drafter_sdk.sequence_store import SequenceStore
from drafter_sdk.servicer import SERVICE_NAME, DrafterServicer

log = logging.getLogger(__name__)

MIB = 1 << 20
# In-flight calls may finish this long after a connection reached max_connection_age_s
# (PrepareDraftTokens calls last milliseconds; this only bounds stuck ones).
MAX_CONNECTION_AGE_GRACE_S = 10.0
_SERVING = health_pb2.HealthCheckResponse.SERVING


class RunningDrafter:
    """A started drafter server. `port` is the bound port (useful with port 0); `metrics_port` the
    bound port of /metrics, None without metrics."""

    def __init__(self, server: grpc.aio.Server, port: int, servicer: DrafterServicer,
                 health_servicer: health.aio.HealthServicer, grace_period_s: float, idle_timeout_s: float,
                 metrics_server: MetricsServer | None) -> None:
        self.server = server
        self.port = port
        self.servicer = servicer
        self.health = health_servicer
        self.grace_period_s = grace_period_s
        self.metrics_server = metrics_server
        self.load_error: BaseException | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._load_task = asyncio.create_task(self._load())
        self._evict_task = asyncio.create_task(self._evict_idle(idle_timeout_s))

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server is not None else None

    async def wait_loaded(self) -> None:
        """Return once the drafter serves; raise what `load()` raised if it failed."""
        await asyncio.shield(self._load_task)
        if self.load_error is not None:
            raise self.load_error

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight calls finish within `grace` seconds
        (default: grace_period_s). Later calls wait for the first one."""
        await asyncio.shield(self.request_stop(grace))

    def request_stop(self, grace: float | None = None) -> asyncio.Task[None]:
        """Start stopping (see `stop`) without waiting for it, e.g. from a signal handler."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(self.grace_period_s if grace is None else grace))
        return self._stopping

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        log.info("stopping (grace %.1fs)", grace)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self._load_task.cancel()
        self._evict_task.cancel()
        self.servicer.close()
        if self.metrics_server is not None:
            # shutdown() blocks until the serving thread notices; keep the event loop free meanwhile.
            await asyncio.to_thread(self.metrics_server.close)

    async def _load(self) -> None:
        name = self.servicer.drafter.name
        try:
            await self.servicer.run_in_worker(self.servicer.load)
        except Exception as exc:
            # A drafter that cannot load can never serve: stop rather than linger NOT_SERVING.
            log.exception("%s.load() failed", name)
            self.load_error = exc
            self.request_stop(0)
            return
        for service in ("", SERVICE_NAME):
            await self.health.set(service, _SERVING)
        log.info("%s loaded, SERVING", name)

    async def _evict_idle(self, idle_timeout_s: float) -> None:
        # Sweeping four times per timeout bounds how long idle state outlives it.
        interval = min(max(idle_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            evicted = await self.servicer.run_in_worker(self.servicer.evict_idle)
            if self.servicer.metrics is not None:
                self.servicer.metrics.evictions.inc(evicted)


async def start_server(
    drafter: Drafter,
    *,
    host: str = "[::]",
    port: int = 0,
    grace_period_s: float = 10.0,
    idle_timeout_s: float = 600.0,
    max_message_bytes: int = 16 * MIB,
    max_concurrent_rpcs: int | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    auth_token: str | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics_port: int | None = None,
    max_connection_age_s: float | None = 300.0,
) -> RunningDrafter:
    """Start serving `drafter`; its `load()` then runs in the background (health NOT_SERVING until done).

    `server_credentials` (see drafter_sdk.security) switches to TLS; with
    `auth_token`, every DrafterService call needs `authorization: Bearer <token>`
    (health and reflection stay open for probes). With `metrics_port` (0: any
    free port), Prometheus metrics are served over HTTP at /metrics on `host`.

    `max_connection_age_s` (None or 0: never) closes each client connection
    gracefully (GOAWAY, in-flight calls finish) after about that long: gRPC
    clients re-resolve DNS only when a connection closes, so this is how
    verifiers behind a headless Service discover drafter replicas added later.
    """
    metrics = DrafterMetrics() if metrics_port is not None else None
    servicer = DrafterServicer(drafter, SequenceStore(idle_timeout_s), metrics)
    if auth_token is not None:
        interceptors = [BearerTokenServerInterceptor(auth_token), *interceptors]
    server = grpc.aio.server(
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Two drafters must never silently share one port.
            ("grpc.so_reuseport", 0),
            *(
                [
                    ("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
                    ("grpc.max_connection_age_grace_ms", round(MAX_CONNECTION_AGE_GRACE_S * 1000)),
                ]
                if max_connection_age_s
                else []
            ),
        ],
    )
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    if server_credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, server_credentials)
    metrics_server = None
    if metrics is not None:
        metrics_server = start_metrics_server(metrics.registry, host, metrics_port)
        log.info("metrics on http://%s:%d/metrics", host, metrics_server.port)
    await server.start()
    log.info("serving %s on %s:%d (%s%s)", drafter.name, host, bound,
             "plaintext" if server_credentials is None else "TLS", ", bearer auth" if auth_token else "")
    return RunningDrafter(server, bound, servicer, health_servicer, grace_period_s, idle_timeout_s, metrics_server)


def serve(drafter: Drafter, *, port: int = 50052, host: str = "[::]", port_file: str | os.PathLike[str] | None = None,
          **options: object) -> None:
    """Serve `drafter` until SIGTERM or SIGINT, then shut down gracefully.

    `options` are start_server's keyword arguments. With `port_file`, the
    bound port is written there once the server listens (handy with port 0).
    Exits with status 1 when the drafter's `load()` fails.
    """
    asyncio.run(_serve(drafter, host=host, port=port, port_file=port_file, **options))


async def _serve(drafter: Drafter, *, port_file: str | os.PathLike[str] | None, **options: object) -> None:
    running = await start_server(drafter, **options)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, running, sig)
    if port_file is not None:
        _write_atomically(Path(port_file), f"{running.port}\n")
    await running.wait_for_termination()
    if running.load_error is not None:
        raise SystemExit(1)
    log.info("stopped")


def _on_signal(running: RunningDrafter, sig: signal.Signals) -> None:
    log.info("received %s", sig.name)
    running.request_stop()


def _write_atomically(path: Path, text: str) -> None:
    # Readers polling for the file must never see it half written.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
