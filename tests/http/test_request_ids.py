"""Every request goes by one id: the caller's X-Request-Id (a gateway's), or one the server makes,
echoed in the response's X-Request-Id and naming its chat or completion (`chatcmpl-<id>`, as vLLM's).
Over gRPC, GenerationParams.request_id, else x-request-id metadata. The trace that carries it:
tests/verifier/test_tracing.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from http_support import WAIT_S, http_verifier, wait_until
from verifier_harness import token_request

CHAT = [{"role": "user", "content": "hi"}]


def test_the_callers_id_names_the_answer_and_comes_back() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            c = h.client
            raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=3,
                                                                    extra_headers={"X-Request-Id": "gw-41"})
            assert raw.headers["x-request-id"] == "gw-41" and raw.parse().id == "chatcmpl-gw-41"
            raw = await c.completions.with_raw_response.create(model="tiny", prompt="def", max_tokens=3)
            made = raw.headers["x-request-id"]  # none given: the server's, the same in both places
            assert len(made) == 32 and raw.parse().id == f"cmpl-{made}"
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                async with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "gw-42"},
                                       json={"messages": CHAT, "max_tokens": 3, "stream": True}) as stream:
                    assert stream.headers["x-request-id"] == "gw-42"
                    chunks = [json.loads(line[6:]) async for line in stream.aiter_lines()
                              if line.startswith("data: {")]
                assert chunks and {chunk["id"] for chunk in chunks} == {"chatcmpl-gw-42"}
                # A stored response and a message keep ids of their own (two requests may share an
                # X-Request-Id: a retry), and say the request's.
                r = await http.post("/v1/responses", headers={"X-Request-Id": "gw-43"},
                                    json={"input": "hi", "max_output_tokens": 3})
                assert r.headers["x-request-id"] == "gw-43" and r.json()["id"].startswith("resp_")
                r = await http.post("/v1/messages", headers={"X-Request-Id": "gw-44"},
                                    json={"model": "tiny", "messages": CHAT, "max_tokens": 3})
                assert r.headers["x-request-id"] == "gw-44" and r.json()["id"].startswith("msg_")
                # Refusals say it too, and so does every other route.
                r = await http.post("/v1/completions", headers={"X-Request-Id": "gw-45"}, json={"prompt": "def",
                                                                                                "max_tokens": -1})
                assert r.status_code == 400 and r.headers["x-request-id"] == "gw-45"
                assert (await http.get("/health", headers={"X-Request-Id": "probe"})).headers["x-request-id"] == "probe"
                # Sent twice: the first, in both places.
                r = await http.post("/v1/completions", headers=[("X-Request-Id", "one"), ("X-Request-Id", "two")],
                                    json={"prompt": "def", "max_tokens": 2})
                assert r.headers.get_list("x-request-id") == ["one"] and r.json()["id"] == "cmpl-one"
                # Web pages may read it (CORS).
                r = await http.get("/v1/models", headers={"Origin": "https://app.example"})
                assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
            await wait_until(h.idle, "the engine idle")

    asyncio.run(main())


def test_an_id_too_long_is_refused_before_anything_runs() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            long = "x" * 257
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                r = await http.post("/v1/completions", headers={"X-Request-Id": long},
                                    json={"prompt": "def", "max_tokens": 3})
                assert r.status_code == 400
                assert r.json()["error"]["message"] == "X-Request-Id must be 1 to 256 characters, not 257"
                assert r.json()["error"]["param"] == "X-Request-Id"
                r = await http.post("/v1/messages", headers={"X-Request-Id": long},
                                    json={"model": "tiny", "messages": CHAT, "max_tokens": 3})
                assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's shape on its route
                assert r.json()["error"]["type"] == "invalid_request_error"
            assert h.idle() and h.v.running.runtime.engine.decode_steps == 0

    asyncio.run(main())


def test_grpc_takes_the_params_id_else_the_metadatas() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            stub = h.v.stub
            out = (await stub.Generate(token_request([5, 6, 7], 2), metadata=(("x-request-id", "gw-1"),),
                                       timeout=WAIT_S)).output
            assert out.request_id == "gw-1"
            out = (await stub.Generate(token_request([5, 6, 7], 2, request_id="mine"),
                                       metadata=(("x-request-id", "gw-2"),), timeout=WAIT_S)).output
            assert out.request_id == "mine"
            async for chunk in stub.GenerateStream(token_request([5, 6, 7], 2), metadata=(("x-request-id", "gw-3"),),
                                                   timeout=WAIT_S):
                assert chunk.output.request_id == "gw-3"
            assert len((await stub.Generate(token_request([5, 6, 7], 2), timeout=WAIT_S)).output.request_id) == 32
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(token_request([5, 6, 7], 2), metadata=(("x-request-id", "y" * 257),),
                                    timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "the x-request-id metadata is longer than 256 characters"

    asyncio.run(main())
