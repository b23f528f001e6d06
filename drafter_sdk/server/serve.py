"""Run a Drafter as a gRPC DrafterService: the shared server lifecycle (service/lifecycle.py), plus the
drafter's own `load()` in the background, the idle-state sweep, and what it learned taken from its
peer replicas when it starts (peers.py) or kept in a file across restarts (learned_state.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import grpc

from drafter_sdk.drafter import Drafter
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server import stats_log
from drafter_sdk.server.learned_state import LearnedStateFile
from drafter_sdk.server.metrics import DrafterMetrics
from drafter_sdk.server.peers import Asking, Peers
from drafter_sdk.server.sequence_store import DEFAULT_MAX_STATE_MIB, SequenceStore
from drafter_sdk.server.servicer import SERVICE_NAME, DrafterServicer
from drafter_sdk.service.lifecycle import MIB, GrpcService, stop_on_signals
from drafter_sdk.service.process_exit import exit_at_once
from drafter_sdk.service.security import CallerIdentity, TokenSource
from drafter_sdk.service.start_up_heap import freeze_start_up_heap
from drafter_sdk.service.stats_lines import log_every

log = logging.getLogger(__name__)

# In-flight calls may finish this long after a connection reached max_connection_age_s
# (PrepareDraftTokens calls last milliseconds; this only bounds stuck ones).
MAX_CONNECTION_AGE_GRACE_S = 10.0
# At exit: for drafter code the stop cut short (a load() asking its peers, which the stop ends) to return;
# what still runs after that (a long load(), a call past the grace period) is not waited for.
DRAFTER_CODE_WAIT_S = 1.0


class RunningDrafter:
    """A started drafter server. `port` is the bound port (useful with port 0); `metrics_port` the
    bound port of /metrics, None without metrics."""

    def __init__(self, service: GrpcService, servicer: DrafterServicer, grace_period_s: float,
                 idle_timeout_s: float, learned: LearnedStateFile | None = None, peers: Peers | None = None,
                 log_stats_interval_s: float = 0.0) -> None:
        self.service = service
        self.servicer = servicer
        self.grace_period_s = grace_period_s
        self.learned = learned
        self.peers = peers
        self._asking = Asking()  # the peers' questions, ended when the server stops
        self.load_error: BaseException | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._ending: asyncio.Task[None] | None = None  # `end_drain`'s cut of the calls in flight
        self._load_task = asyncio.create_task(self._load())
        self._evict_task = asyncio.create_task(self._evict_idle(idle_timeout_s))
        self._save_task = asyncio.create_task(self._save_learned()) if learned is not None else None
        self._stats_task = (asyncio.create_task(self._log_stats(servicer.metrics, log_stats_interval_s))
                            if servicer.metrics is not None and log_stats_interval_s else None)

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def metrics_port(self) -> int | None:
        return self.service.metrics_port

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

    def end_drain(self) -> None:
        """Cut the grace period short (a second signal): the calls in flight end now, UNAVAILABLE. A call
        already inside the drafter's code runs on there (Python cannot stop a thread), its answer dropped;
        `serve` does not wait for it, but a learned state's last save (`--learned-state-file`) does."""
        self.request_stop()
        self._ending = asyncio.ensure_future(self.service.stop(0))

    async def wait_for_termination(self) -> None:
        await self.service.wait_for_termination()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        log.info("stopping (grace %.1fs)", grace)
        # A drafter still starting holds less than its file: the file is saved only by one that served.
        served = self._load_task.done() and self.load_error is None
        self._asking.cancel()  # a start that still asks its peers ends now, not at their deadlines
        self.servicer.drain()  # draft streams last as long as their verifier: end them now
        await self.service.stop(grace)
        self._load_task.cancel()
        self._evict_task.cancel()
        for task in (self._save_task, self._stats_task):
            if task is not None:
                task.cancel()
        if self.learned is not None and served:
            # After the last call, with the releases of requests that finished while draining.
            await self.learned.save(self.servicer)
        self.servicer.close()

    async def _load(self) -> None:
        name = self.servicer.drafter.name
        restore = self._restore if self.peers is not None or self.learned is not None else None
        try:
            await self.servicer.load_async(restore)
        except Exception as exc:
            # A drafter that cannot load can never serve: stop rather than linger NOT_SERVING.
            log.exception("%s.load() failed", name)
            self.load_error = exc
            self.request_stop(0)
            return
        await self.service.set_serving(True)
        log.info("%s loaded, SERVING", name)

    def _restore(self) -> None:
        # A peer holds everything this replica would have learned meanwhile; the file, what it knew at
        # its last save: the file is for when no peer answers (a lone replica, every replica restarted).
        servicer = self.servicer
        if self.peers is not None and self.peers.restore(servicer.restore_learned, servicer.drafter.name,
                                                         self._asking):
            source = "peer"
        elif self._asking.cancelled:  # the server stops: it will never serve what the file holds
            return
        elif self.learned is not None and self.learned.restore(servicer):
            source = "file"
        else:
            source = "none"
        if servicer.metrics is not None:
            servicer.metrics.record_learned_restore(source)

    async def _save_learned(self) -> None:
        # After load: what is saved before it would replace the file with an empty drafter's state.
        await asyncio.shield(self._load_task)
        if self.load_error is None and self.learned is not None:
            await self.learned.save_every(self.servicer)

    async def _log_stats(self, metrics: DrafterMetrics, interval_s: float) -> None:
        await asyncio.shield(self._load_task)
        if self.load_error is None:
            await log_every(interval_s, lambda: stats_log.read(metrics), stats_log.lines, stats_log.log)

    async def _evict_idle(self, idle_timeout_s: float) -> None:
        # After load: an inline drafter's code must then never run on the worker (servicer.run).
        await asyncio.shield(self._load_task)
        if self.load_error is not None:
            return
        # Sweeping four times per timeout bounds how long idle state outlives it.
        interval = min(max(idle_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            await self.servicer.run(self.servicer.evict_idle)


async def start_server(
    drafter: Drafter,
    *,
    host: str = "[::]",
    port: int = 0,
    grace_period_s: float = 10.0,
    idle_timeout_s: float = 600.0,
    max_state_mib: float | None = DEFAULT_MAX_STATE_MIB,
    max_message_bytes: int = 16 * MIB,
    max_concurrent_rpcs: int | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    auth_token: TokenSource | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics_port: int | None = None,
    max_connection_age_s: float | None = 300.0,
    learned_state_file: str | os.PathLike[str] | None = None,
    save_learned_every_s: float = 300.0,
    peers: Peers | None = None,
    log_stats_interval_s: float = 10.0,
) -> RunningDrafter:
    """Start serving `drafter`; its `load()` then runs in the background (health NOT_SERVING until done).

    `server_credentials` (see drafter_sdk.service.security) switches to TLS; with
    `auth_token`, every DrafterService call needs `authorization: Bearer <token>`
    (health and reflection stay open for probes); with named tokens (a mapping
    name -> token) or client certificates, a call's namespace includes who sent it
    (security.CallerIdentity); tokens from `security.watch_token` or `watch_named_tokens` follow their
    file as it changes. With `metrics_port` (0: any
    free port), Prometheus metrics are served over HTTP at /metrics on `host`. Every
    `log_stats_interval_s` (0: never) in which calls came, a stats line is logged (stats_log.py), read
    from the same metrics (kept for it without a `metrics_port`, but not served).

    `max_connection_age_s` (None or 0: never) closes each client connection
    gracefully (GOAWAY, in-flight calls finish) after about that long: gRPC
    clients re-resolve DNS only when a connection closes, so this is how
    verifiers behind a headless Service discover drafter replicas added later.

    `max_state_mib` (None or 0: no budget) bounds the state held for sequences
    (tokens plus what the drafter reports): past it, the least recently synced
    sequences of the namespace holding the most are evicted (sequence_store.py).

    With `learned_state_file`, what the drafter learned across requests
    (`Drafter.save_learned`) is restored from that file before the drafter serves,
    saved every `save_learned_every_s` seconds and once more at shutdown
    (learned_state.py); ValueError for a drafter that keeps nothing to save, or a
    file no save could be written to.

    With `peers` (the target of this drafter's replicas, peers.py), the drafter
    starts from what a peer learned, where one answers (else from the file), and
    answers the same question of theirs (GetLearnedState); ValueError for a
    drafter that keeps nothing to share.
    """
    for given, what in ((learned_state_file, "save in a learned-state file"), (peers, "share with its peers")):
        if given is not None and not drafter.learns_across_requests:
            raise ValueError(f"{drafter.name} keeps nothing across requests to {what}")
    if not save_learned_every_s > 0:
        raise ValueError(f"save_learned_every_s must be positive, not {save_learned_every_s}")
    if log_stats_interval_s < 0:
        raise ValueError(f"log_stats_interval_s must be 0 (never) or positive, not {log_stats_interval_s}")
    metrics = DrafterMetrics() if metrics_port is not None or log_stats_interval_s else None
    learned = (LearnedStateFile(Path(learned_state_file), save_learned_every_s, metrics)
               if learned_state_file is not None else None)
    if metrics is not None:
        drafter.register_metrics(metrics.registry)
    max_state_bytes = round(max_state_mib * MIB) if max_state_mib else None
    servicer = DrafterServicer(drafter, SequenceStore(idle_timeout_s, max_state_bytes), metrics,
                               identify=CallerIdentity(auth_token), shares_learned=peers is not None)
    connection_age = [("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
                      ("grpc.max_connection_age_grace_ms", round(MAX_CONNECTION_AGE_GRACE_S * 1000))
                      ] if max_connection_age_s else []
    service = await GrpcService.start(
        SERVICE_NAME, lambda server: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server),
        host=host, port=port, server_credentials=server_credentials, auth_token=auth_token,
        max_message_bytes=max_message_bytes, max_concurrent_rpcs=max_concurrent_rpcs, options=connection_age,
        interceptors=interceptors, metrics_registry=metrics.registry if metrics else None, metrics_port=metrics_port)
    log.info("serving %s", drafter.name)
    return RunningDrafter(service, servicer, grace_period_s, idle_timeout_s, learned, peers, log_stats_interval_s)


def serve(drafter: Drafter, *, port: int = 50052, host: str = "[::]", port_file: str | os.PathLike[str] | None = None,
          **options: object) -> None:
    """Serve `drafter` until SIGTERM or SIGINT, then shut down gracefully; a second signal ends the
    calls still in flight at once.

    `options` are start_server's keyword arguments. With `port_file`, the
    bound port is written there once the server listens (handy with port 0).
    Exits with status 1 when the drafter's `load()` fails, and at once (status 0, no finalization) when the
    drafter's own code is still running once the server has stopped: Python cannot stop the thread it runs on.
    For this process's own entry point: it freezes the start-up heap (service/start_up_heap.py).
    """
    asyncio.run(_serve(drafter, host=host, port=port, port_file=port_file, **options))


async def _serve(drafter: Drafter, *, port_file: str | os.PathLike[str] | None, **options: object) -> None:
    # Before load(): what the drafter learns, or restores, stays with the collector (the budget evicts it).
    freeze_start_up_heap()
    running = await start_server(drafter, **options)  # type: ignore[arg-type]

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s", sig.name)
        running.request_stop()

    stop_on_signals(on_signal, again=lambda sig: running.end_drain())
    if port_file is not None:
        running.service.write_port_file(port_file)
    await running.wait_for_termination()
    if running.load_error is not None:
        raise SystemExit(1)
    log.info("stopped")
    if not await running.servicer.worker_done(within_s=DRAFTER_CODE_WAIT_S):
        log.warning("%s's own code still runs (a load() not yet done, or a call the grace period cut off): "
                    "exiting without waiting for it", drafter.name)
        exit_at_once(0)
