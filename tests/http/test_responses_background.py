"""Background responses (OpenAI's background mode) through the official openai client, against a real verifier
(tiny random model, HTTP on port 0) with a remote SDK n-gram drafter: a background response answers at once,
queued, runs on apart from its request and, polled, ends with the same answer as a response served in the
foreground (which is exact against plain decoding); its events stream again from any sequence number, the live
ones as they come, after the client that started it has gone; cancelling it keeps its output so far and frees
its sequence; a step that fails ends it failed, stored so; mistakes are 400s and 404s naming them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from http_support import PROMPT, WAIT_S, HttpVerifier, http_verifier, wait_until
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

ENDED = {"completed", "incomplete", "failed", "cancelled"}


async def ended(h: HttpVerifier, response_id: str):  # noqa: ANN201
    """The response, polled (as OpenAI's guide does) until it has ended."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (response := await h.client.responses.retrieve(response_id)).status not in ENDED:
        assert response.status in ("queued", "in_progress") and loop.time() < deadline, response.status
        await asyncio.sleep(0.02)
    return response


@contextlib.contextmanager
def engine_held(h: HttpVerifier, once: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """The engine's steps held back, from the first at which `once()` holds (asked on the model thread before
    each step) to the end of the block, so that a response cannot end while the test acts on it; requests
    and cancellations are still taken meanwhile."""
    engine = h.v.running.runtime.engine
    step, holding = engine.step, threading.Event()
    holding.set()

    async def held_step() -> None:
        while holding.is_set() and once():
            await asyncio.sleep(0.002)
        await step()

    engine.step = held_step
    try:
        yield
    finally:
        holding.clear()
        del engine.step


def text_of(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_polled_and_streamed_again_is_the_foreground_answer() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            ask = {"model": "tiny", "input": PROMPT, "max_output_tokens": 30}
            foreground = await h.client.responses.create(**ask)
            with engine_held(h):
                started = await h.client.responses.create(**ask, background=True)
                assert started.status == "queued" and started.background is True and started.output == []
                assert (await h.client.responses.retrieve(started.id)) == started
                (item,) = (await h.client.responses.input_items.list(started.id)).data  # listed while it runs too
            done = await ended(h, started.id)
            assert done.status == "incomplete" and done.background is True
            assert done.output_text == foreground.output_text
            assert (done.usage.input_tokens, done.usage.output_tokens) == (foreground.usage.input_tokens, 30)
            assert done.model_extra["speculation"]["num_drafts"] > 0  # the remote drafter drafted for it
            assert [i.id for i in (await h.client.responses.input_items.list(started.id)).data] == [item.id]

            # Streamed again once it has ended: every event, numbered, queued first; then from a cursor.
            events = [e async for e in await h.client.responses.retrieve(started.id, stream=True)]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert [e.type for e in events[:4]] == ["response.created", "response.queued", "response.in_progress",
                                                    "response.output_item.added"]
            assert events[0].response.status == "queued" and events[-1].type == "response.incomplete"
            assert text_of(events) == done.output_text and events[-1].response == done
            later = [e async for e in await h.client.responses.retrieve(started.id, stream=True, starting_after=5)]
            assert [e.model_dump() for e in later] == [e.model_dump() for e in events[6:]]

            # Continued like any stored response, and deleted like one.
            follow = await h.client.responses.create(model="tiny", input="and then?", max_output_tokens=4,
                                                     previous_response_id=started.id)
            assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
            await h.client.responses.delete(started.id)
            with pytest.raises(openai.NotFoundError):
                await h.client.responses.retrieve(started.id)

    asyncio.run(main())


def test_a_background_stream_outlives_its_client_and_resumes_from_its_cursor() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            ask = {"model": "tiny", "input": PROMPT, "max_output_tokens": 120}
            foreground = await h.client.responses.create(**ask)
            with engine_held(h):  # nothing is generated until the client has left
                stream = await h.client.responses.create(**ask, background=True, stream=True)
                seen = []
                async for event in stream:
                    seen.append(event)
                    if event.type == "response.queued":
                        break
                await stream.close()
            response_id = seen[0].response.id
            assert seen[0].response.background is True and seen[0].response.status == "queued"
            # The run goes on without its client: streamed again from where it left, live.
            rest = [e async for e in await h.client.responses.retrieve(response_id, stream=True,
                                                                          starting_after=seen[-1].sequence_number)]
            numbers = [e.sequence_number for e in seen + rest]
            assert numbers == list(range(len(numbers)))
            assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "incomplete"
            assert text_of(rest) == foreground.output_text == rest[-1].response.output_text
            assert (await h.client.responses.retrieve(response_id)).output_text == foreground.output_text
            await wait_until(h.idle, "its sequence and the drafter's state freed")

    asyncio.run(main())


def test_cancelling_keeps_the_output_so_far_and_frees_the_sequence() -> None:
    async def main() -> None:
        async with http_verifier(metrics_port=0) as h:
            metrics = h.v.running.generations.metrics.registry
            scheduler = h.v.running.runtime.engine.scheduler
            with engine_held(h, once=lambda: any(len(s.output_ids) >= 3 for s in scheduler.running)):
                running = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=150,
                                                          background=True)
                await wait_until(lambda: h.v.running.http.state.background.get(running.id).started,
                                 "its first tokens")
                assert metrics.get_sample_value("splitspec:responses_in_background") == 1
                polled = await h.client.responses.retrieve(running.id)
                assert polled.status == "in_progress" and polled.output_text  # its output so far
                cancelled = await h.client.responses.cancel(running.id)
                assert cancelled.status == "cancelled" and cancelled.output_text.startswith(polled.output_text)
                assert 0 < cancelled.usage.output_tokens < 150 and cancelled.output[0].status == "incomplete"
                assert metrics.get_sample_value("splitspec:responses_in_background") == 0
            await wait_until(h.idle, "its sequence and the drafter's state freed")
            again = await h.client.responses.cancel(running.id)  # idempotent: the same response
            assert again == cancelled == await h.client.responses.retrieve(running.id)
            events = [e async for e in await h.client.responses.retrieve(running.id, stream=True)]
            assert text_of(events) == cancelled.output_text

            # A response deleted while it runs is cancelled first; one still queued at shutdown ends cancelled.
            state = h.v.running.http.state
            with engine_held(h):
                doomed = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=150,
                                                         background=True)
                await h.client.responses.delete(doomed.id)
                last = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=150,
                                                       background=True)
                await state.background.close()
            assert len(state.background) == 0
            assert (await h.client.responses.retrieve(last.id)).status == "cancelled"
            with pytest.raises(openai.NotFoundError):
                await h.client.responses.retrieve(doomed.id)
            await wait_until(h.idle, "every sequence and the drafter's state freed")

            finished = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2,
                                                       background=True)
            await ended(h, finished.id)
            with pytest.raises(openai.BadRequestError, match="already ended"):
                await h.client.responses.cancel(finished.id)
            foreground = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2)
            with pytest.raises(openai.BadRequestError, match="not run in the background"):
                await h.client.responses.cancel(foreground.id)
            with pytest.raises(openai.NotFoundError):
                await h.client.responses.cancel("resp_nope")

    asyncio.run(main())


def test_a_failed_step_fails_the_background_response_and_is_stored_so() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            engine = h.v.running.runtime.engine
            verify = engine._verify

            def failing(plan):  # noqa: ANN001, ANN202 - the engine's own signature
                if plan.decodes:  # the prompt is in: the next step fails
                    del engine._verify
                    raise RuntimeError("a fault injected into the decoding step")
                return verify(plan)

            engine._verify = failing
            started = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=30,
                                                      background=True)
            failed = await ended(h, started.id)
            assert failed.status == "failed" and failed.error.code == "server_error"
            events = [e async for e in await h.client.responses.retrieve(started.id, stream=True)]
            assert [e.type for e in events[-2:]] == ["error", "response.failed"]
            again = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=30)
            assert again.status == "incomplete"  # the server still serves
            await wait_until(h.idle, "every sequence and the drafter's state freed")

    asyncio.run(main())


def test_mistakes_are_refused_naming_them() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h, httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            async def refused(answer: httpx.Response, status: int, param: str, words: str) -> None:
                assert answer.status_code == status, answer.text
                error = answer.json()["error"]
                assert error["param"] == param and words in error["message"], error

            ask = {"model": "tiny", "input": PROMPT, "max_output_tokens": 150}
            await refused(await c.post("/v1/responses", json={**ask, "background": True, "store": False}), 400,
                          "background", "send store true")
            foreground = (await c.post("/v1/responses", json={**ask, "max_output_tokens": 2})).json()
            await refused(await c.get(f"/v1/responses/{foreground['id']}", params={"stream": "true"}), 400, "stream",
                          "not run in the background")
            with engine_held(h):
                running = (await c.post("/v1/responses", json={**ask, "background": True})).json()
                await refused(await c.post("/v1/responses", json={**ask, "previous_response_id": running["id"]}),
                              400, "previous_response_id", "still running")
                for params, param in [({"stream": "yes"}, "stream"), ({"stream": "true", "starting_after": "--5"},
                                                                        "starting_after")]:
                    await refused(await c.get(f"/v1/responses/{running['id']}", params=params), 400, param, "not")
                await c.post(f"/v1/responses/{running['id']}/cancel")
        async with http_verifier(speculate=False, responses_store_mb=0) as h, \
                httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as c:
            await refused(await c.post("/v1/responses", json={**ask, "background": True}), 400, "background",
                          "--responses-store-mb 0")

    asyncio.run(main())


def test_the_background_example_runs_as_written() -> None:
    """examples/responses/background.py, a real process with the official client: the text it reads in two
    parts, before the stream it dropped and after its cursor, is the response's."""
    example = Path(__file__).parents[2] / "examples" / "responses" / "background.py"

    async def main() -> None:
        async with http_verifier() as h:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(example), "--base-url", f"{h.base_url}/v1", "--input", PROMPT,
                "--max-output-tokens", "150", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
            assert process.returncode == 0, err.decode()
            printed = out.decode()
            assert re.search(r"^resumed after event 7: incomplete, 150 tokens; the text read in two parts is the "
                             r"response's: True$", printed, re.MULTILINE), printed
            assert re.search(r"^resp_\w+: (cancelled with \d+ tokens written|not cancelled: .*already ended)",
                             printed, re.MULTILINE), printed
            await wait_until(h.idle, "every sequence and the drafter's state freed")

    asyncio.run(main())
