"""The OpenAI-compatible HTTP API as a FastAPI app over the same Generations the gRPC front uses.

Routes: POST /v1/chat/completions, /v1/completions and /v1/responses (streamed as Server-Sent
Events with `stream: true`), GET and DELETE /v1/responses/{id} (the stored responses), POST
/tokenize and /detokenize (vLLM's), GET /v1/models, /health, /metrics, and / (the playground).
Bodies are read and checked here, not by FastAPI's own validation, so every mistake
is an OpenAI error object with the status the issue and OpenAI's server give it
(http_errors.py). /health and the playground page are open; everything else needs
the bearer token when one is configured, as gRPC does. Web pages of the allowed origins
may call it from a browser (CORS, as vLLM's --allowed-origins).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from drafter_sdk.proto import verifier_pb2
from verifier_service.api.generation import GenerationFailed, Generations, Unavailable
from verifier_service.api.http_errors import GRPC_TO_HTTP, HttpError, from_validation
from verifier_service.api.http_responses import DONE, Choice, Responder, sse, token_name
from verifier_service.api.http_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationBody,
    TokenizeRequest,
)
from verifier_service.api.request_parsing import PromptTooLong, RequestError
from verifier_service.api.response_store import ResponseStore
from verifier_service.api.responses_output import ResponseBuilder
from verifier_service.api.responses_schema import ITEMS, ResponsesRequest, chat_history
from verifier_service.engine.scheduler import QueueFullError
from verifier_service.engine.sequence import Output, Sequence

log = logging.getLogger(__name__)

T = TypeVar("T")
Body = TypeVar("Body", GenerationBody, ResponsesRequest, TokenizeRequest, DetokenizeRequest)


@dataclass
class HttpState:
    """What the routes need besides the generations: limits, auth, and the requests in flight
    (the drain waits for them)."""

    generations: Generations
    auth_token: str | None
    max_body_bytes: int
    responses: ResponseStore  # the Responses API's stored responses
    served_names: tuple[str, ...] = ()  # (): the model's name, and the --model value as given
    tool_call_parser: str | None = None  # answers "auto" tool choice (tool_calls.py); None: refused
    allowed_origins: tuple[str, ...] = ()  # whose web pages may call the API (CORS; "*": any); (): none
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


def build_app(state: HttpState) -> FastAPI:
    app = FastAPI(title="splitspec", docs_url=None, redoc_url=None, openapi_url=None)
    if state.allowed_origins:
        # A browser asks first (a preflight) before it sends a JSON body or an Authorization header from
        # another origin; the token is still checked on the request itself.
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(HttpError)
    async def http_error(_: Request, exc: HttpError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:  # a bug: still an error object
        log.exception("HTTP request failed")
        return HttpError(500, f"internal error: {type(exc).__name__}").response()

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown path, method
        return HttpError(exc.status_code, str(exc.detail)).response()

    def authorize(request: Request) -> None:
        if state.auth_token is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.auth_token.encode()):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                            code="invalid_api_key")

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        return HTMLResponse(resources.files("verifier_service.api").joinpath("playground.html").read_text())

    @app.get("/health")
    async def health() -> Response:
        gen = state.generations
        if gen.ready:
            return JSONResponse({"status": "ok"})
        reason = gen.failure or ("draining" if gen.draining else "loading")
        return HttpError(503, f"not serving: {reason}").response()

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def metrics() -> Response:
        if state.generations.metrics is None:
            raise HttpError(404, "metrics are off; start the verifier with --metrics-port")
        return Response(generate_latest(state.generations.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> JSONResponse:
        rt = state.generations.runtime
        if rt is None:
            raise HttpError(503, "the model is still loading; retry shortly")
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "splitspec", "root": rt.model_name,
             "max_model_len": rt.max_model_len} for name in state.names()]})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request) -> Response:
        return await _generate(state, request, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await _generate(state, request, CompletionRequest, chat=False)

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create_response(request: Request) -> Response:
        return await _respond(state, request)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def get_response(response_id: str) -> JSONResponse:
        entry = state.responses.get(response_id)
        if entry is None:
            raise _not_stored(response_id)
        return JSONResponse(entry.body)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def delete_response(response_id: str) -> JSONResponse:
        if not state.responses.delete(response_id):
            raise _not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> JSONResponse:
        body = await _body(state, request, TokenizeRequest)
        tokens = _refusals_as_errors(lambda: state.generations.tokenize(body.request()))
        return JSONResponse({"count": len(tokens.token_ids), "max_model_len": tokens.max_model_len,
                             "tokens": list(tokens.token_ids),
                             "token_strs": list(tokens.token_strs) if body.return_token_strs else None})

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> JSONResponse:
        body = await _body(state, request, DetokenizeRequest)
        return JSONResponse({"prompt": _refusals_as_errors(lambda: state.generations.detokenize(body.request())).text})

    return app


async def _read_json(request: Request, limit: int) -> object:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise HttpError(413, f"the body has {length} bytes; the limit is {limit} (--max-message-bytes)")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HttpError(413, f"the body is over the limit of {limit} bytes (--max-message-bytes)")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"the body is not valid JSON: {exc}") from None


async def _body(state: HttpState, request: Request, schema: type[Body]) -> Body:
    """The request's body, checked against `schema`, naming a served model (or none)."""
    data = await _read_json(request, state.max_body_bytes)
    if not isinstance(data, dict):
        raise HttpError(400, "the body must be a JSON object")
    try:
        body = schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
    names = state.names()
    if body.model is not None and names and body.model not in names:
        raise HttpError(404, f"the model {body.model!r} is not served here; served: {', '.join(names)}",
                        param="model", code="model_not_found")
    return body


def _refusals_as_errors(answer: Callable[[], T]) -> T:
    """`answer()`, with a refusal (not served yet, a client mistake) as the HTTP error that says so."""
    try:
        return answer()
    except Unavailable as exc:
        raise HttpError(503, str(exc)) from None
    except RequestError as exc:
        raise HttpError(GRPC_TO_HTTP.get(exc.code, 400), exc.message) from None


async def _generate(state: HttpState, request: Request, schema: type[GenerationBody], chat: bool) -> Response:
    arrival = time.perf_counter()
    body = await _body(state, request, schema)
    gen = state.generations
    rt, _ = _refusals_as_errors(gen.check_ready)
    names = state.names()
    tools = body.tool_plan(state.tool_call_parser)
    if tools is not None and (why := tools.unserved()):
        raise HttpError(400, why, param="tool_choice")
    seqs = await _start(gen, body)
    responder = Responder(chat, body.model or names[0], rt.tokenizer, body.n, body.include_usage,
                          body.echoes_prompt, body.prompt_only, body.prompt_logprobs is not None, tools,
                          body.return_tokens_as_token_ids, body.echoed_message)
    if body.stream:
        return StreamingResponse(_stream(state, seqs, responder, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices = await _collect_unless_gone(state, request, seqs, arrival)
    if choices is None:
        return Response(status_code=499)  # nobody is left to read it
    return JSONResponse(responder.response(seqs, choices))


async def _collect_unless_gone(state: HttpState, request: Request, seqs: list[Sequence],
                               arrival: float) -> list[Choice] | None:
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


def _not_stored(response_id: str, param: str | None = None) -> HttpError:
    return HttpError(404, f"no stored response {response_id!r}: it was not stored (store false, or the verifier's "
                          "--responses-store-mb is 0), or it was deleted or evicted", param=param,
                     code="response_not_found")


async def _respond(state: HttpState, request: Request) -> Response:
    """POST /v1/responses: the request as the chat it describes (responses_schema.py), answered as a
    response (responses_output.py), and kept where asked and the store has room (response_store.py)."""
    arrival = time.perf_counter()
    body = await _body(state, request, ResponsesRequest)
    gen = state.generations
    rt, _ = _refusals_as_errors(gen.check_ready)
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise _not_stored(body.previous_response_id, "previous_response_id")
        body.continues(list(previous.conversation))
    reserve = body.max_new_tokens or 1  # what the answer needs of the context besides the prompt

    def fits(chat: verifier_pb2.ChatMessages) -> bool:
        try:
            ids = gen.tokenize(verifier_pb2.TokenizeRequest(chat=chat)).token_ids
        except PromptTooLong:
            return False
        return len(ids) + reserve <= rt.max_model_len

    _refusals_as_errors(lambda: body.truncate(fits))
    tools = body.tool_plan(state.tool_call_parser)
    if why := tools.unserved():
        raise HttpError(400, why, param="tool_choice")
    seqs = await _start(gen, body)
    builder = ResponseBuilder(body, body.model or state.names()[0], tools,
                              token_name(rt.tokenizer, body.return_tokens_as_token_ids),
                              stored=body.store and state.responses.enabled)
    if body.stream:
        return StreamingResponse(_stream_response(state, seqs[0], builder, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices = await _collect_unless_gone(state, request, seqs, arrival)
    if choices is None:
        return Response(status_code=499)
    result = builder.whole(seqs[0], choices[0].joined())
    _keep(state, builder, result)
    return JSONResponse(result)


def _keep(state: HttpState, builder: ResponseBuilder, result: dict[str, object]) -> None:
    """Store a finished response, with its conversation (its answer last), where it asked to be."""
    if not builder.stored:
        return
    answer = chat_history(ITEMS.validate_python(result["output"]))
    if not state.responses.put(builder.id, result, (*builder.request.continued_chat(), *answer)):
        log.warning("response %s not stored: larger than the whole store (--responses-store-mb)", builder.id)


async def _start(gen: Generations, body: GenerationBody) -> list[Sequence]:
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
            seqs.append(await gen.start(body.params(i)))
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


async def _stream_response(state: HttpState, seq: Sequence, builder: ResponseBuilder,
                           arrival: float) -> AsyncIterator[str]:
    with state.request():
        try:
            for event in builder.opening():
                yield event
            finish = None
            async with contextlib.aclosing(state.generations.outputs(seq, arrival)) as outputs:
                async for out in outputs:
                    for event in builder.feed(out):
                        yield event
                    finish = out.finish_reason
            events, result = builder.closing(seq, finish)
            _keep(state, builder, result)
            for event in events:
                yield event
        except GenerationFailed as exc:
            for event in builder.failed(str(exc)):
                yield event
        finally:  # closed before the outputs were read (client gone at once): free the sequence anyway
            state.generations.runtime.engine.cancel(seq)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merged(gen: Generations, seqs: list[Sequence], arrival: float) -> AsyncIterator[tuple[int, Output]]:
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


async def _collect(gen: Generations, seqs: list[Sequence], arrival: float) -> list[Choice]:
    choices = [Choice() for _ in seqs]
    async with contextlib.aclosing(_merged(gen, seqs, arrival)) as outputs:
        async for i, out in outputs:
            choices[i].add(out)
    return choices


async def _stream(state: HttpState, seqs: list[Sequence], responder: Responder,
                  arrival: float) -> AsyncIterator[str]:
    with state.request():
        sent = [0] * len(seqs)  # characters per choice so far
        try:
            if responder.chat:
                for i in range(len(seqs)):
                    yield responder.role_chunk(i)
            async with contextlib.aclosing(_merged(state.generations, seqs, arrival)) as outputs:
                async for i, out in outputs:
                    yield responder.chunk(i, out, sent[i], seqs[i])
                    sent[i] += len(out.text)
            if responder.include_usage:
                yield responder.usage_chunk(seqs)
        except GenerationFailed as exc:
            yield sse(HttpError(503 if exc.unavailable else 500, str(exc)).body())
        finally:  # closed before the outputs were read (client gone at once): free the sequences anyway
            for seq in seqs:
                state.generations.runtime.engine.cancel(seq)
        yield DONE
