"""How the verifier reaches a drafter: over gRPC, or in-process through an SDK servicer.

`DrafterClient` (drafter_client.py) decides what to send and what to trust of the answer; a transport
only carries calls. Both transports take the same protobuf messages, so a remote drafter and an SDK
drafter in-process differ by the network hop alone. `GrpcTransport` keeps a step's call on the thread
that steps (no hop to an event loop) and on one long-lived PrepareDraftTokensStream where the drafter
serves it (draft_stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from drafter_sdk.drafter import Drafter
from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc
from drafter_sdk.service.security import auth_metadata
from drafter_sdk.service.watched_files import WatchedFiles, current
from verifier_service.spec_decode.draft_stream import DraftStream, Ticket
from verifier_service.spec_decode.replicas import Replicas

log = logging.getLogger(__name__)
T = TypeVar("T")

# A drafter without PrepareDraftTokensStream gets unary calls; try the stream again this often
# (a rolling update may bring it).
STREAM_RECHECK_S = 60.0

# Reads the answer to a call already sent (raises as the call would have failed).
Answer = Callable[[], drafter_pb2.PrepareDraftTokensResponse]


class Transport(Protocol):
    target: str
    # Every call reaches the same drafter (in-process, or over one draft stream): plain deltas do.
    one_replica: bool
    splits_calls: bool  # `start` sends a call whose answer is read later

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse: ...

    # Where it splits calls: send a PrepareDraftTokens call now and return what reads its answer.
    def start(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> Answer | None: ...

    # A sync-only PrepareDraftTokens (draft_len 0) whose answer nobody needs.
    async def sync(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> None: ...

    # on_stream: the drafter takes releases where it drafts (capability "stream-releases").
    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float,
                      on_stream: bool) -> None: ...

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse: ...

    # `sync` (a whole context) then `release` to every replica behind the target, where there are several;
    # how many replicas took both.
    async def tell_every_replica(self, sync: drafter_pb2.PrepareDraftTokensRequest,
                                 release: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> int: ...

    async def close(self) -> None: ...


class GrpcTransport:
    """A DrafterService over gRPC; `dns:///name:port` plus round_robin spreads calls over replicas.

    Calls are made with gRPC's threaded API and awaited as futures. With `block`, the verifier's
    case (its engine loop runs on the model thread, apart from the servers' loop), a step's
    PrepareDraftTokens call blocks: the thread sends it and reads the answer itself, no hop (the
    step has nothing else to do meanwhile), on one long-lived PrepareDraftTokensStream
    (draft_stream.py) where the drafter serves it, else as a unary call. grpc.aio would hand
    every answer to the process's first event loop (the servers') and from there to the
    engine's: two thread hops per step. Never block on a loop that serves the drafter itself."""

    def __init__(self, target: str, *,
                 credentials: grpc.ChannelCredentials | WatchedFiles[grpc.ChannelCredentials] | None = None,
                 auth_token: str | WatchedFiles[str] | None = None, load_balancing_policy: str = "round_robin",
                 max_message_bytes: int = 16 * 1024 * 1024, server_name_override: str = "",
                 block: bool = False) -> None:
        self.target = target
        self._block = block
        self.splits_calls = block
        options = [
            ("grpc.lb_policy_name", load_balancing_policy or "round_robin"),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect quickly after a drafter restarts; the breaker paces calls.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if server_name_override:
            options.append(("grpc.ssl_target_name_override", server_name_override))
        self._options = options
        self._server_name_override = server_name_override
        self._credentials = credentials
        self._connect(current(credentials))
        self._auth_token = auth_token
        self._stream = DraftStream(lambda requests: self._stub.PrepareDraftTokensStream(
            requests, metadata=self._metadata)) if block else None
        self._unary_until = 0.0  # time.monotonic() until which the drafter is taken to lack the stream
        self._lacking_said: list[tuple[str, str]] = []  # capabilities some replica lacks (info), as last logged
        # The stream has answered, and not been refused since (GetServerInfo.drafter.draft_stream).
        self.streaming = False

    def _connect(self, credentials: grpc.ChannelCredentials | None) -> None:
        """Channels to the target and its replicas, with these credentials."""
        def open_channel(address: str, extra: list[tuple[str, Any]]) -> grpc.Channel:
            if credentials is None:
                return grpc.insecure_channel(address, options=self._options + extra)
            return grpc.secure_channel(address, credentials, options=self._options + extra)

        self._in_use = credentials
        self._channel = open_channel(self.target, [])
        # A replica's channel is to its address, but its certificate names the Service's host.
        self._replicas = Replicas(self.target, lambda address, host: open_channel(address, [
            ("grpc.ssl_target_name_override", host)] if host and not self._server_name_override else []))
        self._stub = drafter_pb2_grpc.DrafterServiceStub(self._channel)

    def _follow_credentials(self) -> None:
        """Once the TLS files changed (a renewed client certificate), new channels with them: a channel keeps
        the credentials it was opened with, and would present an expired certificate at its next
        reconnection. Closing the old ones fails what they carry at that moment, a draft, once."""
        if not isinstance(self._credentials, WatchedFiles) or (latest := self._credentials.get()) is self._in_use:
            return
        channel, replicas = self._channel, self._replicas
        self._connect(latest)
        channel.close()  # ends the draft stream on it too: the next call opens one on the new channel
        replicas.close()

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Each call's: a token file's token as it is now (security.watch_token)."""
        return auth_metadata(current(self._auth_token)) if self._auth_token else None

    @property
    def one_replica(self) -> bool:
        """The next call goes over the draft stream, to the replica that had the last ones (unless
        the stream ended: a new replica answers RESYNC_REQUIRED, and the sequence starts over)."""
        return self._stream is not None and time.monotonic() >= self._unary_until

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        answer = self.start(request, timeout_s)
        if answer is not None:
            return answer()
        return await _awaitable(self._stub.PrepareDraftTokens.future(request, timeout=timeout_s,
                                                                     metadata=self._metadata))

    def start(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> Answer | None:
        """With `block`: on the draft stream where the drafter serves it, else as a unary call (whose
        answer gRPC's threads receive meanwhile too). Every step's call starts here, so here the
        channels follow their TLS files."""
        self._follow_credentials()
        if not self._block:
            return None
        if self.one_replica:  # the stream is due
            assert self._stream is not None
            started = time.monotonic()
            ticket = self._stream.start(request, timeout_s)
            return lambda: self._finish(ticket, request, timeout_s - (time.monotonic() - started))
        call = self._stub.PrepareDraftTokens.future(request, timeout=timeout_s, metadata=self._metadata)
        return call.result

    def _finish(self, ticket: Ticket, request: drafter_pb2.PrepareDraftTokensRequest,
                left_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        assert self._stream is not None
        try:
            response = self._stream.finish(ticket)
            self.streaming = True
            return response
        except grpc.RpcError as exc:
            if status_of(exc) != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.streaming = False
            log.info("drafter %s does not serve PrepareDraftTokensStream: unary calls for %g s",
                     self.target, STREAM_RECHECK_S)
            self._unary_until = time.monotonic() + STREAM_RECHECK_S
        return self._stub.PrepareDraftTokens(request, timeout=max(left_s, 0.001), metadata=self._metadata)

    async def sync(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> None:
        """On the draft stream, unanswered (draft_stream.py), where the steps go; else a unary call
        awaited as a future: the stepping thread never waits for it."""
        if self.one_replica:
            assert self._stream is not None
            self._stream.send(drafter_pb2.PrepareDraftTokensStreamRequest(request=request))
            return
        await _awaitable(self._stub.PrepareDraftTokens.future(request, timeout=timeout_s, metadata=self._metadata))

    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float,
                      on_stream: bool) -> None:
        """On the draft stream, unanswered, where the drafter takes it there: it reaches the replica
        that holds the sequences. Else unary, to whichever replica the balancer picks."""
        if on_stream and self.one_replica:
            assert self._stream is not None
            self._stream.send(drafter_pb2.PrepareDraftTokensStreamRequest(release=request))
            return
        await _awaitable(self._stub.ReleaseRequests.future(request, timeout=timeout_s, metadata=self._metadata))

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse:
        """What the drafter says of itself; where several replicas stand behind the target, with only the
        capabilities every replica that answers lists. In a rolling update they differ, and a capability
        one lacks cannot be relied on: a salted request could reach a replica that does not keep cache
        salts apart, whichever replica answered here."""
        request = drafter_pb2.GetDrafterInfoRequest()

        def ask(stub: drafter_pb2_grpc.DrafterServiceStub) -> Awaitable[drafter_pb2.GetDrafterInfoResponse]:
            return _awaitable(stub.GetDrafterInfo.future(request, timeout=timeout_s, metadata=self._metadata))

        info = await ask(self._stub)
        # A replica that does not answer is down: the balancer sends it nothing either.
        answers = [info, *await self._on_every_replica(ask, "did not say what it is")]
        listed = {c for answer in answers for c in answer.capabilities}  # whichever replica answered first
        lacking = sorted({(c, answer.version) for answer in answers for c in listed if c not in answer.capabilities})
        if lacking != self._lacking_said:  # said as it changes, not at every ask of a rollout
            self._lacking_said = lacking
            if lacking:
                log.warning("drafter replicas behind %s differ (a rolling update?): relying only on the "
                            "capabilities every replica lists; lacking: %s", self.target,
                            ", ".join(f"{c!r} (version {v})" for c, v in lacking))
        unsure = {c for c, _ in lacking}
        kept = [c for c in info.capabilities if c not in unsure]
        del info.capabilities[:]
        info.capabilities.extend(kept)
        return info

    async def tell_every_replica(self, sync: drafter_pb2.PrepareDraftTokensRequest,
                                 release: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> int:
        """Unary calls to each replica's own channel; a replica that fails misses it, nothing more."""
        async def tell(stub: drafter_pb2_grpc.DrafterServiceStub) -> bool:
            await _awaitable(stub.PrepareDraftTokens.future(sync, timeout=timeout_s, metadata=self._metadata))
            await _awaitable(stub.ReleaseRequests.future(release, timeout=timeout_s, metadata=self._metadata))
            return True

        return len(await self._on_every_replica(tell, "missed a finished request"))

    async def _on_every_replica(self, call: Callable[[drafter_pb2_grpc.DrafterServiceStub], Awaitable[T]],
                                what: str) -> list[T]:
        """`call` on each replica's own channel (replicas.py; none where the target has one), all at once:
        the answers of those that gave one. A replica whose call fails is left out (`what` it did, at debug)."""
        async def one(stub: drafter_pb2_grpc.DrafterServiceStub) -> T | None:
            try:
                return await call(stub)
            except grpc.RpcError as exc:
                log.debug("a drafter replica %s: %s", what, status_of(exc))
                return None

        return [a for a in await asyncio.gather(*(one(stub) for stub in await self._replicas.stubs())) if a is not None]

    async def ready(self, timeout_s: float) -> None:
        """Wait until the channel is connected (raises grpc.FutureTimeoutError)."""
        await asyncio.get_running_loop().run_in_executor(None, grpc.channel_ready_future(self._channel).result,
                                                         timeout_s)

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()
        self._replicas.close()


def _awaitable(call: grpc.Future) -> asyncio.Future[Any]:
    """A gRPC future as an asyncio one of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(_: grpc.Future) -> None:
        if future.done():
            return
        if call.exception() is not None:
            future.set_exception(call.exception())
        else:
            future.set_result(call.result())

    call.add_done_callback(lambda _: loop.call_soon_threadsafe(settle, call))
    return future


class InProcessTransport:
    """Calls an SDK `DrafterServicer`'s logic directly, without gRPC, where a drafter service runs
    it (`DrafterServicer.run`): on the calling loop for a drafter that `runs_inline` (n-gram,
    suffix), else on the servicer's worker thread (a draft model's forwards must not block the
    loop). `load` loads it on the worker."""

    target = "in-process"
    one_replica = True
    splits_calls = False  # no wire to keep busy: the drafter runs on this loop or its worker

    def __init__(self, servicer: "SupportsDrafterLogic") -> None:
        self._servicer = servicer

    async def load(self) -> None:
        """Load the drafter if it is not yet (what it raises fails the verifier's start-up)."""
        if not self._servicer.loaded:
            await self._servicer.run_in_worker(self._servicer.load)

    async def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest,
                      timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        return await self._servicer.run(self._servicer.prepare, request)

    def start(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> Answer | None:
        return None

    async def sync(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> None:
        await self._servicer.run(self._servicer.prepare, request)

    async def release(self, request: drafter_pb2.ReleaseRequestsRequest, timeout_s: float,
                      on_stream: bool) -> None:
        await self._servicer.run(self._servicer.release, request)

    async def info(self, timeout_s: float) -> drafter_pb2.GetDrafterInfoResponse:
        return self._servicer.info()

    async def tell_every_replica(self, sync: drafter_pb2.PrepareDraftTokensRequest,
                                 release: drafter_pb2.ReleaseRequestsRequest, timeout_s: float) -> int:
        return 0  # one drafter, which the release reached

    async def close(self) -> None:
        close = getattr(self._servicer.drafter, "close", None)  # e.g. the model drafter's own thread
        if close is not None:
            await self._servicer.run(close)
        self._servicer.close()


class SupportsDrafterLogic(Protocol):
    loaded: bool
    drafter: Drafter

    def load(self) -> None: ...

    def prepare(self, request: drafter_pb2.PrepareDraftTokensRequest) -> drafter_pb2.PrepareDraftTokensResponse: ...

    def release(self, request: drafter_pb2.ReleaseRequestsRequest) -> drafter_pb2.ReleaseRequestsResponse: ...

    def info(self) -> drafter_pb2.GetDrafterInfoResponse: ...

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T: ...

    def close(self) -> None: ...


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """A failed call's status code (blocking or asyncio), else None."""
    return exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None
