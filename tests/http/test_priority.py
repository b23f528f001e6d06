"""A request's priority (vLLM's field) from every front to the engine, and its refusal where the
verifier serves requests in order of arrival. What priority does in the engine:
tests/verifier/engine/test_priority_scheduling.py."""

from __future__ import annotations

import asyncio

import anthropic
import grpc
import openai
import pytest
from http_support import WAIT_S, http_verifier, submitted_priorities
from verifier_harness import token_request

from drafter_sdk.proto import verifier_pb2
from verifier_service.api.cli import parser, settings_from_args


def test_every_route_hands_its_priority_to_the_engine() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False, scheduling_policy="priority") as h:
            submitted = submitted_priorities(h)
            chat = [{"role": "user", "content": "hi"}]
            await h.client.chat.completions.create(model="tiny", messages=chat, max_tokens=2,
                                                   extra_body={"priority": -1})
            await h.client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 2})
            await h.client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={"priority": 3})
            claude = anthropic.AsyncAnthropic(base_url=h.base_url, api_key="unused", max_retries=0, timeout=WAIT_S)
            await claude.messages.create(model="tiny", messages=chat, max_tokens=2, extra_body={"priority": 4})
            await claude.close()
            await h.v.stub.Generate(token_request([5, 6, 7], 2, priority=5), timeout=WAIT_S)
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert submitted == [-1, 2, 3, 4, 5] and info.scheduling_policy == "priority"

    asyncio.run(main())


def test_first_come_first_served_refuses_a_priority_and_says_how_to_serve_it() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            chat = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
                await h.client.chat.completions.create(model="tiny", messages=chat, max_tokens=2,
                                                       extra_body={"priority": 1})
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await h.v.stub.Generate(token_request([5, 6, 7], 2, priority=-2), timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "priority -2 needs a verifier started with --scheduling-policy priority" in refused.value.details()
            # 0, every request's priority when none is given, is served.
            out = await h.client.chat.completions.create(model="tiny", messages=chat, max_tokens=2,
                                                         extra_body={"priority": 0})
            assert out.choices[0].finish_reason == "length"
            info = await h.v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
            assert info.scheduling_policy == "fcfs" and h.idle()

    asyncio.run(main())


def test_the_flag() -> None:
    assert settings_from_args(parser().parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    assert settings_from_args(parser().parse_args([])).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduling-policy", "lifo"])
