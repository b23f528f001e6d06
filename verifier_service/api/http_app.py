"""The OpenAI-compatible HTTP API as a FastAPI app over the same Generations the gRPC front uses.

Routes: POST /v1/chat/completions, /v1/completions and /v1/responses (streamed as Server-Sent
Events with `stream: true`), GET and DELETE /v1/responses/{id}, GET .../input_items and POST
.../cancel (the stored and background responses), POST /v1/responses/input_tokens (a request's prompt
counted), /v1/conversations and its items (conversations_route.py), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API, its errors in its shape and its x-api-key header
taken for the token), POST /tokenize and /detokenize (vLLM's), GET /v1/models (read by either SDK),
/health, /metrics, and / (the playground). Every request has an id (request_ids.py), and every
response is counted by route and status (http_metrics.py).
Bodies are read and checked (http_requests.py), not by FastAPI's own validation, so every mistake
is an OpenAI error object (Anthropic's on its routes) with the status the issue and OpenAI's server give it
(http_errors.py). /health and the playground page are open; everything else needs
the bearer token when one is configured, as gRPC does. Web pages of the allowed origins
may call it from a browser (CORS, as vLLM's --allowed-origins).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from drafter_sdk.service.metrics_endpoint import TEXT_FORMAT
from drafter_sdk.service.package_version import package_version
from drafter_sdk.service.security import bearer_value
from verifier_service.api import conversations_route, messages_route, responses_route
from verifier_service.api.generation import GenerationFailed
from verifier_service.api.http_errors import AnthropicError, HttpError
from verifier_service.api.http_metrics import CountedResponses
from verifier_service.api.http_requests import (
    HttpState,
    collect_unless_gone,
    merged_outputs,
    not_served,
    parse_body,
    read_body,
    read_json,
    refusals_as_errors,
    start_sequences,
)
from verifier_service.api.http_responses import DONE, Responder, sse
from verifier_service.api.http_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationBody,
    TokenizeRequest,
)
from verifier_service.api.item_pages import listed
from verifier_service.api.request_ids import RequestIds
from verifier_service.engine.sequence import Sequence
from verifier_service.tracing import Arrival

log = logging.getLogger(__name__)


def build_app(state: HttpState) -> FastAPI:
    app = FastAPI(title="splitspec", docs_url=None, redoc_url=None, openapi_url=None)
    if state.generations.metrics is not None:  # first added: the innermost
        app.add_middleware(CountedResponses, count=state.generations.metrics.count_http_response)
    if state.allowed_origins:
        # A browser asks first (a preflight) before it sends a JSON body or an Authorization header from
        # another origin; the token is still checked on the request itself.
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIds)

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

    def bearer_token(request: Request) -> str:
        return bearer_value(request.headers.get("authorization", ""))

    def authorize(request: Request) -> None:
        if (tokens := state.auth_tokens) is not None and tokens.name_of(bearer_token(request)) is None:
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                            code="invalid_api_key")

    def authorize_anthropic(request: Request) -> None:
        """Anthropic's clients send the token as x-api-key (or, given one, as a bearer token)."""
        if (tokens := state.auth_tokens) is not None and all(tokens.name_of(token) is None for token in (
                request.headers.get("x-api-key", ""), bearer_token(request))):
            raise AnthropicError(401, "missing or wrong API key (x-api-key: <token>, or Authorization: Bearer "
                                      "<token>)")

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

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) name for the health check."""
        return await health()

    @app.get("/version", dependencies=[Depends(authorize)])
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def metrics() -> Response:
        if state.generations.metrics is None:
            raise HttpError(404, "metrics are off (--disable-log-stats and no --metrics-port)")
        return Response(generate_latest(state.generations.metrics.registry), media_type=TEXT_FORMAT)

    def authorize_either(request: Request) -> None:
        """Both SDKs list models at /v1/models: Anthropic's says so with its version header."""
        (authorize_anthropic if "anthropic-version" in request.headers else authorize)(request)

    def model_cards() -> dict[str, dict[str, object]]:
        """Each served name's model object, as GET /v1/models lists them: OpenAI's fields (vLLM's
        max_model_len among them) and Anthropic's, so that either SDK reads it."""
        rt = state.generations.runtime
        if rt is None:
            raise HttpError(503, "the model is still loading; retry shortly")
        since = datetime.datetime.fromtimestamp(state.started_at, datetime.timezone.utc).isoformat()
        longest = rt.max_model_len - 1  # a prompt, or an answer, leaves room for one token of the other
        return {name: {"id": name, "object": "model", "created": state.started_at, "owned_by": "splitspec",
                       "root": rt.model_name, "max_model_len": rt.max_model_len,
                       "type": "model", "display_name": name, "created_at": since, "max_input_tokens": longest,
                       "max_tokens": longest} for name in state.names()}

    @app.get("/v1/models", dependencies=[Depends(authorize_either)])
    async def models() -> JSONResponse:
        return JSONResponse(listed(list(model_cards().values())))  # OpenAI's list, and Anthropic's page, whole

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize_either)])
    async def model(name: str) -> JSONResponse:
        """OpenAI's retrieve (`client.models.retrieve`); a name may hold slashes, as hub ids do."""
        cards = model_cards()
        if name not in cards:
            raise not_served(name, tuple(cards))
        return JSONResponse(cards[name])

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    @app.post("/invocations", dependencies=[Depends(authorize)])
    async def invocations(request: Request) -> Response:
        """vLLM's (SageMaker's) one route for both: a body with `messages` is a chat completion, one with
        `prompt` a completion, answered as its own route answers it (its errors included)."""
        data = await read_json(state, request)
        kind = next((key for key in ("messages", "prompt") if isinstance(data, dict) and key in data), None)
        if kind is None:
            raise HttpError(400, "an /invocations body is a chat completion (with `messages`) or a completion "
                                 "(with `prompt`)")
        return await _generate(state, request, chat=kind == "messages", data=data)

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create_response(request: Request) -> Response:
        return await responses_route.respond(state, request)

    @app.post("/v1/responses/input_tokens", dependencies=[Depends(authorize)])
    async def count_response_tokens(request: Request) -> JSONResponse:
        return await responses_route.input_tokens(state, request)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def get_response(response_id: str, request: Request) -> Response:
        return responses_route.retrieve(state, response_id, request.query_params)

    @app.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(authorize)])
    async def cancel_response(response_id: str) -> JSONResponse:
        return await responses_route.cancel(state, response_id)

    @app.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(authorize)])
    async def get_input_items(response_id: str, request: Request) -> JSONResponse:
        return responses_route.input_items(state, response_id, request.query_params)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def delete_response(response_id: str) -> JSONResponse:
        return await responses_route.delete(state, response_id)

    @app.post("/v1/conversations", dependencies=[Depends(authorize)])
    async def create_conversation(request: Request) -> JSONResponse:
        return await conversations_route.create(state, request)

    @app.get("/v1/conversations/{conversation_id}", dependencies=[Depends(authorize)])
    async def get_conversation(conversation_id: str) -> JSONResponse:
        return conversations_route.retrieve(state, conversation_id)

    @app.post("/v1/conversations/{conversation_id}", dependencies=[Depends(authorize)])
    async def update_conversation(conversation_id: str, request: Request) -> JSONResponse:
        return await conversations_route.update(state, conversation_id, request)

    @app.delete("/v1/conversations/{conversation_id}", dependencies=[Depends(authorize)])
    async def delete_conversation(conversation_id: str) -> JSONResponse:
        return conversations_route.delete(state, conversation_id)

    @app.post("/v1/conversations/{conversation_id}/items", dependencies=[Depends(authorize)])
    async def add_conversation_items(conversation_id: str, request: Request) -> JSONResponse:
        return await conversations_route.add_items(state, conversation_id, request)

    @app.get("/v1/conversations/{conversation_id}/items", dependencies=[Depends(authorize)])
    async def list_conversation_items(conversation_id: str, request: Request) -> JSONResponse:
        return conversations_route.list_items(state, conversation_id, request.query_params)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", dependencies=[Depends(authorize)])
    async def get_conversation_item(conversation_id: str, item_id: str) -> JSONResponse:
        return conversations_route.retrieve_item(state, conversation_id, item_id)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", dependencies=[Depends(authorize)])
    async def delete_conversation_item(conversation_id: str, item_id: str) -> JSONResponse:
        return conversations_route.delete_item(state, conversation_id, item_id)

    @app.post("/v1/messages", dependencies=[Depends(authorize_anthropic)])
    async def create_message(request: Request) -> Response:
        return await messages_route.respond(state, request)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorize_anthropic)])
    async def count_message_tokens(request: Request) -> JSONResponse:
        return await messages_route.count_tokens(state, request)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(state, request, TokenizeRequest)
        tokens = refusals_as_errors(lambda: state.generations.tokenize(body.request()))
        return JSONResponse({"count": len(tokens.token_ids), "max_model_len": tokens.max_model_len,
                             "tokens": list(tokens.token_ids),
                             "token_strs": list(tokens.token_strs) if body.return_token_strs else None})

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(state, request, DetokenizeRequest)
        return JSONResponse({"prompt": refusals_as_errors(lambda: state.generations.detokenize(body.request())).text})

    return app


async def _generate(state: HttpState, request: Request, chat: bool, data: object = None) -> Response:
    """A chat completion or a completion; `data`: its body, where the route has read it already."""
    arrival = Arrival.now(request.headers.items())
    schema: type[GenerationBody] = ChatCompletionRequest if chat else CompletionRequest
    body = parse_body(state, data if data is not None else await read_json(state, request), schema)
    gen = state.generations
    rt, _ = refusals_as_errors(gen.check_ready)
    names = state.names()
    tools = body.tool_plan(state.tool_call_parser)
    if tools is not None and (why := tools.unserved()):
        raise HttpError(400, why, param="tool_choice")
    seqs = await start_sequences(gen, body)
    responder = Responder(chat, body.model or names[0], rt.tokenizer, body.n, body.include_usage,
                          body.continuous_usage, body.echoes_prompt, body.prompt_only,
                          body.prompt_logprobs is not None, tools, body.return_tokens_as_token_ids,
                          body.echoed_message, rt.reasoning if chat else None, body.shows_reasoning,
                          id=arrival.request_id)
    if body.stream:
        return StreamingResponse(_stream(state, seqs, responder, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices = await collect_unless_gone(state, request, seqs, arrival)
    if choices is None:
        return Response(status_code=499)  # nobody is left to read it
    return JSONResponse(responder.response(seqs, choices))


async def _stream(state: HttpState, seqs: list[Sequence], responder: Responder,
                  arrival: Arrival) -> AsyncIterator[str]:
    with state.request():
        sent = [0] * len(seqs)  # characters per choice so far
        try:
            if responder.chat:
                for i in range(len(seqs)):
                    yield responder.role_chunk(i, seqs[i])
            async with contextlib.aclosing(merged_outputs(state.generations, seqs, arrival)) as outputs:
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
