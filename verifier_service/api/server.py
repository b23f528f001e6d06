"""The verifier process: gRPC and HTTP up first (NOT_SERVING), then the model, then SERVING; drain on SIGTERM.

The servers start before the model loads, so Kubernetes probes see a live
process during a long load. The gRPC server's lifecycle is the SDK's
(drafter_sdk/service/lifecycle.py), shared with every drafter; the OpenAI-compatible HTTP
API (api/http_server.py) runs beside it on the same event loop, over the same
Generations, and drains with it.

A sharded model (tensor parallelism) runs in N processes: rank 0 is this server
(`run`), and ranks 1..N-1 (`run_follower`) serve nothing and only run the forwards
rank 0 sends them (model/tensor_parallel.py). When a rank dies or hangs, rank 0
fails the requests in flight with UNAVAILABLE, turns health NOT_SERVING and exits
with status 1, so that Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from drafter_sdk.service.lifecycle import GrpcService, stop_on_signals, write_port_file
from drafter_sdk.service.process_exit import exit_at_once
from drafter_sdk.service.security import server_credentials as tls_server_credentials
from drafter_sdk.service.start_up_heap import freeze_start_up_heap
from verifier_service import builder, stats_log
from verifier_service.api import request_parsing
from verifier_service.api.generation import Generations
from verifier_service.api.http_server import HttpServer
from verifier_service.api.servicer import VerifierServicer
from verifier_service.builder import Runtime, build_runtime, reasoning_of
from verifier_service.engine.model_thread import ModelThread
from verifier_service.metrics import VerifierMetrics
from verifier_service.model import loader, ranks, tensor_parallel
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import mode_name
from verifier_service.tracing import RequestTracer

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
RANK_FAILURE_EXIT = 1
FAILURE_GRACE_S = 2.0  # after a rank failed or a drain ended: time for the UNAVAILABLE answers to go out
OTHERS_STOP_S = 30.0  # after a clean shutdown: time for the ranks this process started to exit
SHUT_DOWN = "the verifier was shut down before this request finished; retry"


@dataclass
class RunningVerifier:
    service: GrpcService
    generations: Generations
    settings: ServerSettings
    http: HttpServer | None = None
    stats: asyncio.Task[None] | None = None  # the stats lines' task (stats_log.py), once the model is attached
    ending: asyncio.Task[None] | None = None  # `end_drain`'s shorter stop of the gRPC server, once called

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def http_port(self) -> int | None:
        """The bound port of the HTTP API (useful with http_port 0); None when it is off."""
        return self.http.port if self.http is not None else None

    @property
    def runtime(self) -> Runtime | None:
        return self.generations.runtime

    @property
    def metrics(self) -> VerifierMetrics | None:
        return self.generations.metrics

    @property
    def metrics_port(self) -> int | None:
        """The bound port of /metrics (useful with metrics_port 0); None without metrics."""
        return self.service.metrics_port

    async def stop(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING (HTTP /health 503), refuse new calls, let in-flight ones finish within
        the grace period, on both fronts at once; those still running then end as `end_drain` ends them
        (the fronts' own cut, FAILURE_GRACE_S later, is for what does not end then)."""
        grace_s = self.settings.grace_period_s if grace_s is None else grace_s
        self.generations.draining = True
        if self.stats is not None:
            self.stats.cancel()
        cut = asyncio.get_running_loop().call_later(grace_s, self.end_drain)
        fronts_grace_s = grace_s + FAILURE_GRACE_S
        try:
            await asyncio.gather(self.service.stop(fronts_grace_s),
                                 *([self.http.stop(fronts_grace_s)] if self.http else []))
        finally:
            cut.cancel()
        if self.runtime is not None:
            await self.runtime.engine.stop()
        if self.generations.tracer is not None:  # the last spans, flushed off the event loop
            await asyncio.to_thread(self.generations.tracer.shutdown)

    def end_drain(self) -> None:
        """End the grace period now (a second signal, or its end): the requests still in flight end as
        unavailable with SHUT_DOWN, on both fronts (an HTTP stream with an error event, then [DONE]); the
        other gRPC calls (health Watches) get FAILURE_GRACE_S, and `stop` returns."""
        if self.ending is None:
            self.generations.fail(SHUT_DOWN)
            self.ending = asyncio.ensure_future(self.service.stop(FAILURE_GRACE_S))


async def start_server(settings: ServerSettings,
                       server_credentials: grpc.ServerCredentials | None = None,
                       interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> RunningVerifier:
    """Bind and start the gRPC server (health NOT_SERVING, no model yet).

    Without explicit `server_credentials`, settings.tls_cert/tls_key serve TLS and
    settings.tls_client_ca requires client certificates (mTLS); settings.auth_token
    requires `authorization: Bearer <token>` on every call but health and reflection.
    With settings.metrics_port (0: any free port), Prometheus metrics are served over
    HTTP at /metrics on settings.host, from before the model loads. With settings.http_port
    (0: any free port), the OpenAI-compatible HTTP API is served on settings.host, with the
    same TLS files and bearer token, and /metrics too where metrics are kept (vLLM's path on its API port).
    """
    if server_credentials is None and settings.tls_cert:
        server_credentials = tls_server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    # The stats lines read the metrics, so they are kept for them too (and then served on the HTTP port).
    metrics = VerifierMetrics() if settings.metrics_port is not None or settings.log_stats_interval_s else None
    tracer = RequestTracer(settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else None
    generations = Generations(metrics, tracer, settings.log_requests)
    servicer = VerifierServicer(generations)
    service = await GrpcService.start(
        SERVICE_NAME, lambda server: verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server),
        host=settings.host, port=settings.port, server_credentials=server_credentials,
        auth_token=settings.auth_token, max_message_bytes=settings.max_message_bytes,
        max_concurrent_rpcs=settings.max_concurrent_rpcs, interceptors=interceptors,
        metrics_registry=metrics.registry if metrics else None, metrics_port=settings.metrics_port,
        count_calls=metrics.count_grpc_call if metrics else None)
    if server_credentials is not None and settings.tls_client_ca:
        log.info("clients must present a certificate (mutual TLS)")
    http = None
    if settings.http_port is not None:
        try:
            http = await HttpServer.start(
                generations, host=settings.host, port=settings.http_port, auth_token=settings.auth_token,
                max_body_bytes=settings.max_message_bytes, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                tls_client_ca=settings.tls_client_ca, served_names=settings.served_model_names,
                tool_call_parser=settings.tool_call_parser if settings.enable_auto_tool_choice else None,
                allowed_origins=settings.allowed_origins, responses_store_bytes=settings.responses_store_mb << 20,
                webhook_url=settings.webhook_url,
                webhook_secret=settings.webhook_secret)
        except BaseException:
            await service.stop(0)
            if tracer is not None:
                tracer.shutdown()
            raise
    return RunningVerifier(service, generations, settings, http)


async def attach_model(running: RunningVerifier, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       model_name: str, leader: tensor_parallel.Leader | None = None,
                       model_thread: ModelThread | None = None, model_path: str | None = None) -> Runtime:
    """Wire a loaded model into the running server and report SERVING. `model_path`: the folder or hub id
    it came from, whose generation_config.json sets requests' sampling defaults (None: no file)."""
    defaults = request_parsing.sampling_defaults(running.settings, model_path)
    rt = await build_runtime(model, tokenizer, running.settings, model_name, running.metrics, leader, model_thread,
                             defaults)
    rt.engine.start()
    running.generations.attach(rt)
    if running.metrics is not None and running.settings.log_stats_interval_s:
        running.stats = asyncio.get_running_loop().create_task(
            stats_log.log_stats(running.metrics, running.settings.log_stats_interval_s), name="stats log")
    await running.service.set_serving(True)
    log.info("serving %s, speculation %s", model_name, mode_name(rt.settings.speculative.mode))
    return rt


async def run(settings: ServerSettings, port_file: str | None = None,
              server_credentials: grpc.ServerCredentials | None = None,
              interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
              rank: ranks.Ranks | None = None, argv: list[str] | None = None,
              http_port_file: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT: load the model, then drain gracefully on a signal.

    With settings.tensor_parallel_size > 1 this is rank 0 (`rank`, default from the environment):
    unless torchrun started the other ranks, it starts them with `argv` (default: this process's
    arguments). If a rank fails, this process exits with RANK_FAILURE_EXIT at once, without
    returning: a lost rank can leave the model thread stuck in a collective, which a normal exit
    would wait for forever. A signal during start-up (the load, the forwards' timing) ends the process at
    once too, with status 0, once the servers have stopped: the model thread cannot be stopped mid-op.
    For this process's own entry point: once the model has loaded, it freezes the start-up heap
    (drafter_sdk/service/start_up_heap.py).
    """
    running = await start_server(settings, server_credentials, interceptors)
    if port_file:
        running.service.write_port_file(port_file)
    if http_port_file and running.http_port is not None:
        write_port_file(http_port_file, running.http_port)
    loop = asyncio.get_running_loop()
    stop, failed = asyncio.Event(), asyncio.Event()
    stop_on_signals(lambda sig: stop.set(), again=lambda sig: running.end_drain())

    def lost_rank(reason: str) -> None:  # on the event loop
        running.generations.fail(f"the verifier lost a tensor-parallel rank and is restarting ({reason}); retry")
        failed.set()

    leader = None
    # The load runs torch ops too (a GGUF's conversion), so it runs on the thread that will run the model.
    model_thread = ModelThread()
    start_up: list[asyncio.Future] = []  # the load, then the attach: each runs on the model thread
    try:
        source = loader.resolve_source(settings.model)
        if settings.tensor_parallel_size > 1:
            rank = rank or ranks.this_rank(settings.tensor_parallel_size)
            device = ranks.rank_device(settings.device, rank)
            others = ranks.start_others(rank, sys.argv[1:] if argv is None else argv) if rank.start_others else []
            leader = tensor_parallel.Leader(settings.rank_timeout_s, others,
                                            lambda reason: loop.call_soon_threadsafe(lost_rank, reason))
        else:
            device = loader.pick_device(settings.device)
        dtype = loader.pick_dtype(settings.dtype, device)
        loading = asyncio.ensure_future(loop.run_in_executor(model_thread, _load, source, dtype, device, settings,
                                                             rank if leader is not None else None))
        start_up.append(loading)
        if await _until(loading, stop, failed):
            model, tokenizer = loading.result()
            freeze_start_up_heap()  # what the load made (cli.main froze the imports); the model thread is idle
            attaching = asyncio.ensure_future(attach_model(running, model, tokenizer, source.name, leader,
                                                           model_thread, source.path))
            start_up.append(attaching)
            if await _until(attaching, stop, failed):
                attaching.result()
                await _until(None, stop, failed)
        if failed.is_set():
            await _exit_on_rank_failure(running, leader)
        log.info("shutting down: draining for up to %.0f s", settings.grace_period_s)
    finally:
        if not failed.is_set():
            await running.stop()
            if leader is not None:
                leader.end_others(OTHERS_STOP_S if running.runtime is not None else 0)
        if running.runtime is None:  # else the engine stopped it
            model_thread.shutdown(wait=False)
    log.info("stopped")
    if not all(work.done() for work in start_up):
        # Stopped during start-up: the model thread is still inside torch (a load, a conversion, the forwards'
        # timing), and the interpreter's exit under it aborts (`terminate called without an active exception`).
        exit_at_once(0)


def _load(source: loader.ModelSource, dtype: torch.dtype, device: torch.device, settings: ServerSettings,
          rank: ranks.Ranks | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if rank is not None:
        tensor_parallel.join(rank, device)
    return loader.load(source, dtype, device, settings.tensor_parallel_size, settings.chat_template,
                       lambda tokenizer: reasoning_of(settings, tokenizer))


async def _until(task: asyncio.Future | None, stop: asyncio.Event, failed: asyncio.Event) -> bool:
    """Wait for `task`, a stop signal or a rank failure; True when the task finished (and no rank failed)."""
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(failed.wait())}
    await asyncio.wait(waits | ({task} if task is not None else set()), return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if task is not None and task.done() and isinstance(task.exception(), tensor_parallel.RankFailure):
        await failed.wait()  # reported by the leader's callback, already on its way
    return task is not None and task.done() and not failed.is_set()


async def _exit_on_rank_failure(running: RunningVerifier, leader: tensor_parallel.Leader) -> None:
    """Health NOT_SERVING, the UNAVAILABLE answers out (generations.fail sent them), the other ranks
    killed, then exit: the pod restarts."""
    await running.service.set_serving(False)
    await asyncio.gather(running.service.stop(FAILURE_GRACE_S),
                         *([running.http.stop(FAILURE_GRACE_S)] if running.http else []))
    leader.end_others(0)
    log.error("exiting with status %d: %s", RANK_FAILURE_EXIT, leader.failure)
    exit_at_once(RANK_FAILURE_EXIT)


def run_follower(settings: ServerSettings, rank: ranks.Ranks) -> int:
    """Rank 1..N-1 of a sharded verifier: no servers, no scheduler, all on this one thread. It
    loads its shard, then runs each forward rank 0 sends until rank 0 says stop (status 0) or
    goes away (status 1). Signals are left to rank 0, which leads the shutdown (torchrun and a
    terminal's Ctrl-C signal every rank)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    device = ranks.rank_device(settings.device, rank)
    try:
        tensor_parallel.join(rank, device)
        model = loader.load_model(loader.resolve_source(settings.model), loader.pick_dtype(settings.dtype, device),
                                  device, settings.tensor_parallel_size)
        runner = builder.make_runner(model, settings, builder.model_len(model.config, settings))
        freeze_start_up_heap()
        tensor_parallel.follow(runner, tensor_parallel.connect_follower(settings.rank_timeout_s))
    except Exception:  # noqa: BLE001 - whatever it was, this rank is done; rank 0 sees it go
        log.exception("rank %d failed", rank.rank)
        return 1
    tensor_parallel.leave()
    log.info("rank %d stopped", rank.rank)
    return 0
