"""PrepareDraftTokens (and ReleaseRequests) over one long-lived gRPC stream, for a thread that
blocks on each answer.

A unary call pays gRPC's per-call setup on both sides (an HTTP/2 stream, headers, the
server's call object and its interceptors): about half a millisecond of every remote step
on two busy cores (`splitspec bench --engine-only --engine-sections overhead`). The stream
pays it once. What a stream message lacks is a deadline of its own, so a watchdog thread
cancels the stream when an answer is late; the next call opens a new stream. The watchdog
sleeps a whole deadline at a time while nothing is pending, so sending a message costs the
stepping thread no wake-up of another thread (only a call with a shorter deadline than any
before wakes it, to sleep that much less).

A stream ends when its drafter goes away, restarts or ages its connection out (the SDK's
`max_connection_age_s`); a stream found ended before a message is sent is replaced then,
so only a message in flight at that moment fails. A new stream goes wherever the channel's
load balancing sends a new call, so one verifier drafts on one replica at a time. What the
verifier needs no answer to (a finished request's sync-only call; its release, to drafters with
the capability "stream-releases") goes on the same stream, to that replica, without waiting
(`send`): its answer is read, and dropped, before the next call's own, so a slow or hung drafter
costs those messages nothing on the stepping thread.

A call can also be split in two (`start`, then `finish`): the message goes out at once, and
its answer is read later, while the thread did other work (the engine runs the step's
forward) and gRPC's own threads received it. Its deadline still counts from the send; an
answer already there is taken however late it is read.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from drafter_sdk.proto import drafter_pb2

Request = drafter_pb2.PrepareDraftTokensStreamRequest
Response = drafter_pb2.PrepareDraftTokensStreamResponse
# A stream call of the sync API: responses by next(), plus grpc.Future's done() and cancel().
OpenStream = Callable[[Iterator[Request]], Iterator[Response]]
ANSWER = {"request": "response", "release": "released"}  # a message's kind -> its answer's
# How long the watchdog leaves a `finish` that starts past its ticket's deadline to read an answer
# that is already there, before it cancels the stream.
LATE_READ_S = 0.005


class StreamError(grpc.RpcError):
    """A stream message that failed, with the status a unary call would have failed with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__()
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamDeadlineExceeded(StreamError):
    """No answer within the deadline on the stream (which was cancelled)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no answer within {timeout_s * 1000:g} ms on PrepareDraftTokensStream")


class StreamAnswerMismatch(StreamError):
    """The drafter answered a message with the other kind of answer (a release's for a request's,
    or the reverse): it breaks the protocol, so the stream was dropped."""

    def __init__(self, asked: str, answered: str | None) -> None:
        super().__init__(grpc.StatusCode.INTERNAL,
                         f"PrepareDraftTokensStream answered {answered or 'nothing'} where {asked} was due")


class StreamEnded(StreamError):
    """The drafter ended the stream (OK) without answering the message: it stops (the SDK's
    `DrafterServicer.drain`), or it is broken."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, "PrepareDraftTokensStream ended without an answer")


@dataclass(eq=False)
class Ticket:
    """A PrepareDraftTokensRequest sent by `start`, whose answer `finish` reads."""

    request: drafter_pb2.PrepareDraftTokensRequest
    stream: "_Open"
    deadline: float  # time.monotonic()
    timeout_s: float
    response: drafter_pb2.PrepareDraftTokensResponse | None = None  # read already (an earlier ticket's finish)


@dataclass
class _Open:
    """One stream: where its requests go, where its answers come from."""

    requests: queue.SimpleQueue[Request | None]  # None ends the request iterator
    responses: Iterator[Response]
    # The answers due, in the order their messages were sent: the kind of an answer nobody reads
    # (`send`), or the ticket of one `finish` reads.
    due: deque[str | Ticket] = field(default_factory=deque)

    def end(self) -> None:
        """Half-close, and cancel whatever is still in flight."""
        self.due.clear()
        self.requests.put(None)  # lets gRPC's request-consuming thread finish
        self.responses.cancel()  # type: ignore[attr-defined]


@dataclass
class _Pending:
    stream: _Open
    deadline: float  # time.monotonic()
    expired: bool = False


class DraftStream:
    """Sends a PrepareDraftTokensRequest and waits for its answer (`call`), or sends a message
    whose answer nobody waits for (`send`), from one thread at a time. `close` ends the stream
    and the watchdog."""

    def __init__(self, open_stream: OpenStream) -> None:
        self._open_stream = open_stream
        self._stream: _Open | None = None
        self._lock = threading.Lock()  # _pending, between the caller and the watchdog
        self._pending: _Pending | None = None
        self._tick_s = float("inf")  # the watchdog's idle sleep: the shortest deadline asked for
        self._closed = threading.Event()
        self._wake = threading.Event()  # the tick shortened, or closed: the watchdog's sleep ends
        self._watchdog: threading.Thread | None = None

    def call(self, request: drafter_pb2.PrepareDraftTokensRequest,
             timeout_s: float) -> drafter_pb2.PrepareDraftTokensResponse:
        """The drafter's answer, or grpc.RpcError (StreamDeadlineExceeded when late; UNIMPLEMENTED
        from a drafter without the stream)."""
        return self.finish(self.start(request, timeout_s))

    def start(self, request: drafter_pb2.PrepareDraftTokensRequest, timeout_s: float) -> Ticket:
        """Send a request now; `finish` reads its answer."""
        stream = self._live_stream()
        ticket = Ticket(request, stream, time.monotonic() + timeout_s, timeout_s)
        stream.due.append(ticket)
        stream.requests.put(Request(request=request))
        return ticket

    def send(self, message: Request) -> None:
        """Send without waiting: the answer is read before a later call's, within its deadline
        (its failure is that call's). Lost with the stream if the stream ends first."""
        stream = self._live_stream()
        stream.due.append(ANSWER[str(message.WhichOneof("message"))])
        stream.requests.put(message)

    def finish(self, ticket: Ticket) -> drafter_pb2.PrepareDraftTokensResponse:
        """The answer to a `start`: read with the answers due before it, within its deadline (or at
        once, if it is already there). Raises as `call` does."""
        try:
            return self._read(ticket)
        except StreamEnded:  # a stopping drafter ended it before answering: once more, on a new one
            if time.monotonic() >= ticket.deadline:
                raise StreamDeadlineExceeded(ticket.timeout_s) from None
            return self._read(self.start(ticket.request, ticket.deadline - time.monotonic()))

    def _read(self, ticket: Ticket) -> drafter_pb2.PrepareDraftTokensResponse:
        stream = ticket.stream
        if ticket.response is not None:
            return ticket.response
        if not any(due is ticket for due in stream.due):  # its stream was dropped before it was answered
            raise StreamEnded()
        # Past its deadline (a long forward in between), an answer already there is still taken: the
        # watchdog waits a little before it cancels a read of it.
        pending = _Pending(stream, max(ticket.deadline, time.monotonic() + LATE_READ_S))
        with self._lock:
            self._pending = pending
        self._watch(ticket.timeout_s)
        try:
            while ticket.response is None:
                due = stream.due.popleft()
                response = next(stream.responses)
                if isinstance(due, Ticket):
                    self._expect(stream, response, ANSWER["request"])
                    due.response = response.response
                else:
                    self._expect(stream, response, due)
        except grpc.RpcError:
            if pending.expired:
                raise StreamDeadlineExceeded(ticket.timeout_s) from None
            raise
        except StopIteration:
            raise StreamEnded() from None
        finally:
            with self._lock:
                self._pending = None
            if pending.expired or stream.responses.done():  # type: ignore[attr-defined]
                self._drop(stream)
        return ticket.response

    def _expect(self, stream: _Open, response: Response, answer: str) -> None:
        if response.WhichOneof("message") != answer:  # out of step with the drafter: start over
            self._drop(stream)
            raise StreamAnswerMismatch(answer, response.WhichOneof("message"))

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._stream is not None:
            self._drop(self._stream)

    def _live_stream(self) -> _Open:
        if self._stream is not None and self._stream.responses.done():  # type: ignore[attr-defined]
            self._drop(self._stream)  # ended between calls (a restart, the connection aged out)
        if self._stream is None:
            requests: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
            self._stream = _Open(requests, self._open_stream(iter(requests.get, None)))
        return self._stream

    def _drop(self, stream: _Open) -> None:
        stream.end()
        if self._stream is stream:
            self._stream = None

    def _watch(self, timeout_s: float) -> None:
        if timeout_s < self._tick_s:  # the watchdog may be asleep for longer than this deadline
            self._tick_s = timeout_s
            self._wake.set()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._run_watchdog, name="draft-stream-deadline",
                                              daemon=True)
            self._watchdog.start()

    def _run_watchdog(self) -> None:
        """Cancel the stream of a message unanswered at its deadline. Asleep for a whole deadline
        while nothing is pending, so it sees every message before the message's deadline."""
        while not self._closed.is_set():
            self._wake.clear()  # before reading the tick: a shorter one set from here on wakes the wait
            with self._lock:
                pending = self._pending
                left = self._tick_s if pending is None else pending.deadline - time.monotonic()
                if pending is not None and left <= 0:
                    pending.expired = True
                    pending.stream.responses.cancel()  # type: ignore[attr-defined]
                    self._pending = None
                    continue
            self._wake.wait(left)
