"""What every generation route of the HTTP API shares: the server's state, a body read and checked
against its schema, its sequences started all or none, and their outputs relayed until they finish
or the client goes away (which frees them at the next step)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from fastapi import Request
from pydantic import ValidationError

from drafter_sdk.service.security import AcceptedTokens
from verifier_service.api import json_text
from verifier_service.api.background_runs import BackgroundRuns
from verifier_service.api.generation import GenerationFailed, Generations, Unavailable
from verifier_service.api.http_errors import GRPC_TO_HTTP, HttpError, from_validation
from verifier_service.api.http_responses import Choice
from verifier_service.api.http_schema import GenerationBody, RequestBody
from verifier_service.api.request_parsing import RequestError
from verifier_service.api.response_store import ResponseStore
from verifier_service.api.webhooks import Webhooks
from verifier_service.engine.scheduler import QueueFullError
from verifier_service.engine.sequence import Output, Sequence
from verifier_service.tracing import Arrival

T = TypeVar("T")
Body = TypeVar("Body", bound=RequestBody)


@dataclass
class HttpState:
    """What the routes need besides the generations: limits, auth, and the requests in flight
    (the drain waits for them)."""

    generations: Generations
    auth_tokens: AcceptedTokens | None  # --auth-token-file's tokens are read again when the file changes
    max_body_bytes: int
    responses: ResponseStore  # the Responses API's stored responses
    served_names: tuple[str, ...] = ()  # (): the model's name, and the --model value as given
    tool_call_parser: str | None = None  # answers "auto" tool choice (tool_calls.py); None: refused
    allowed_origins: tuple[str, ...] = ()  # whose web pages may call the API (CORS; "*": any); (): none
    background: BackgroundRuns = field(default_factory=BackgroundRuns)  # the Responses API's, while they run
    started_at: int = field(default_factory=lambda: int(time.time()))  # the served models' `created`
    webhooks: Webhooks | None = None  # announces background responses' ends (--webhook-url)
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def names(self) -> tuple[str, ...]:
        """The names a request's `model` may give; the first is the one reported."""
        rt = self.generations.runtime
        if self.served_names or rt is None:
            return self.served_names
        return tuple(dict.fromkeys(n for n in (rt.model_name, rt.settings.model) if n))

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


async def read_json(state: HttpState, request: Request) -> object:
    """The request's body as JSON, within --max-message-bytes."""
    limit = state.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise HttpError(413, f"the body has {length} bytes; the limit is {limit} (--max-message-bytes)")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HttpError(413, f"the body is over the limit of {limit} bytes (--max-message-bytes)")
    try:
        return json_text.loads(body)
    except json_text.NotText as exc:
        raise HttpError(400, str(exc), param=exc.path or None) from None
    except ValueError as exc:  # UnicodeDecodeError is one, and json_text's nesting too deep
        raise HttpError(400, f"the body is not valid JSON: {exc}") from None


async def read_body(state: HttpState, request: Request, schema: type[Body]) -> Body:
    """The request's body, checked against `schema`, naming a served model (or none, or having no `model`)."""
    return parse_body(state, await read_json(state, request), schema)


def parse_body(state: HttpState, data: object, schema: type[Body]) -> Body:
    """A body read as JSON (read_json), checked as read_body checks it."""
    if not isinstance(data, dict):
        raise HttpError(400, "the body must be a JSON object")
    try:
        body = schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
    names = state.names()
    model = getattr(body, "model", None)
    if model is not None and names and model not in names:
        raise not_served(model, names)
    return body


def not_served(model: str, names: tuple[str, ...]) -> HttpError:
    return HttpError(404, f"the model {model!r} is not served here; served: {', '.join(names)}", param="model",
                     code="model_not_found")


def refusals_as_errors(answer: Callable[[], T]) -> T:
    """`answer()`, with a refusal (not served yet, a client mistake) as the HTTP error that says so."""
    try:
        return answer()
    except Unavailable as exc:
        raise HttpError(503, str(exc)) from None
    except RequestError as exc:
        raise HttpError(GRPC_TO_HTTP.get(exc.code, 400), exc.message) from None


async def start_sequences(gen: Generations, body: GenerationBody) -> list[Sequence]:
    """Start every choice (n for each prompt) as its own sequence; all or none."""
    choices = body.num_prompts * body.n
    scheduler = gen.runtime.engine.scheduler
    most = scheduler.max_num_seqs + scheduler.max_queue_len
    if choices > most:  # a batch that could never be queued whole: retrying would not help
        raise HttpError(400, f"{body.num_prompts} prompts x n={body.n} make {choices} sequences; this server "
                             f"takes at most {most} at once (--max-num-seqs + --max-queue-len): split the batch",
                        param="prompt")
    seqs: list[Sequence] = []
    try:
        for i in range(choices):
            seqs.append(await gen.start(body.params(i), body.default_max_new_tokens))
    except BaseException as exc:
        for seq in seqs:
            gen.runtime.engine.cancel(seq)
        if isinstance(exc, Unavailable):
            raise HttpError(503, str(exc)) from None
        if isinstance(exc, RequestError):
            which = f"prompt.{len(seqs) // body.n}: " if body.num_prompts > 1 else ""  # as pydantic names items
            raise HttpError(GRPC_TO_HTTP.get(exc.code, 400), which + exc.message) from None
        if isinstance(exc, QueueFullError):
            raise HttpError(429, str(exc)) from None
        raise
    return seqs


async def collect_unless_gone(state: HttpState, request: Request, seqs: list[Sequence],
                               arrival: Arrival) -> list[Choice] | None:
    """Every choice's outputs, joined; None if the client went away first (its sequences are then freed
    at the next step)."""
    with state.request():
        collecting = asyncio.ensure_future(_collect(state.generations, seqs, arrival))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():
                collecting.cancel()
                await asyncio.gather(collecting, return_exceptions=True)
        if collecting.cancelled():
            return None
        try:
            return collecting.result()
        except GenerationFailed as exc:
            raise HttpError(503 if exc.unavailable else 500, str(exc)) from None


class EventBuilder(Protocol):
    """What a streamed answer's events come from (responses_output.py, messages_output.py)."""

    def opening(self) -> list[str]: ...

    def feed(self, out: Output) -> list[str]: ...

    def closing(self, last: Output) -> list[str]: ...

    def failed(self, message: str) -> list[str]: ...


async def stream_events(state: HttpState, seq: Sequence, builder: EventBuilder, arrival: Arrival,
                        finished: Callable[[], None] = lambda: None) -> AsyncIterator[str]:
    """One sequence's answer as the builder's events: its opening, its events for each output, then,
    once `finished()` has had the route's last word (storing the answer, say), its closing; or its
    failure. The sequence is freed whatever happens (a client gone frees it at the next step)."""
    with state.request():
        try:
            for event in builder.opening():
                yield event
            last: Output | None = None
            async with contextlib.aclosing(state.generations.outputs(seq, arrival)) as outputs:
                async for last in outputs:
                    for event in builder.feed(last):
                        yield event
            if last is not None:
                closing = builder.closing(last)
                finished()
                for event in closing:
                    yield event
        except GenerationFailed as exc:
            for event in builder.failed(str(exc)):
                yield event
        finally:
            state.generations.runtime.engine.cancel(seq)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged_outputs(gen: Generations, seqs: list[Sequence], arrival: Arrival) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs as they arrive, tagged with the choice's index. Leaving early (or an
    error in one choice) closes every choice's stream, which cancels its sequence."""
    if len(seqs) == 1:  # the common case, without a task in between
        async with contextlib.aclosing(gen.outputs(seqs[0], arrival)) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, seq: Sequence) -> None:
        try:
            async with contextlib.aclosing(gen.outputs(seq, arrival)) as outputs:
                async for out in outputs:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, seq)) for i, seq in enumerate(seqs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(gen: Generations, seqs: list[Sequence], arrival: Arrival) -> list[Choice]:
    choices = [Choice() for _ in seqs]
    async with contextlib.aclosing(merged_outputs(gen, seqs, arrival)) as outputs:
        async for i, out in outputs:
            choices[i].add(out)
    return choices
