"""Webhooks for background responses (--webhook-url), against a real receiver on port 0: the end of a
background response, and only of one, is POSTed as OpenAI's event, which the official client's
`webhooks.unwrap` verifies (signature, timestamp) and reads; a receiver that fails with 5xx gets the same
event again under the same webhook-id until it answers 2xx, one that refuses it (4xx) gets it once, one
that cannot be reached is tried as many times, then the event is dropped; a cancelled response is
announced cancelled; the flags are checked at start-up."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import uvicorn
from http_support import PROMPT, http_verifier, wait_until
from test_responses_background import engine_held
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from drafter_sdk.service import watched_files
from verifier_service.api import cli, webhooks
from verifier_service.api.webhooks import watch_secret

KEY = b"splitspec webhook test key"
SECRET = "whsec_" + base64.b64encode(KEY).decode()  # as OpenAI writes a secret, and unwrap() takes it
Delivery = tuple[dict[str, str], bytes]


@contextlib.asynccontextmanager
async def receiver(answers: tuple[int, ...] = ()) -> AsyncIterator[tuple[str, list[Delivery]]]:
    """A webhook receiver: its URL and what it was sent; its n-th answer is answers[n] (then 200)."""
    got: list[Delivery] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        got.append(({k.decode(): v.decode() for k, v in scope["headers"]}, body))
        status = answers[len(got) - 1] if len(got) <= len(answers) else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None,
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/hooks", got
    finally:
        server.should_exit = True
        await task


def unwrapped(delivery: Delivery):  # noqa: ANN201
    headers, body = delivery
    return openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=SECRET)


async def ended(h, response_id: str):  # noqa: ANN001, ANN201
    await wait_until(lambda: h.v.running.http.state.background.get(response_id) is None, "the response to end")
    return await h.client.responses.retrieve(response_id)


def test_a_background_responses_end_is_announced_signed_as_openai_signs_it() -> None:
    async def main() -> None:
        async with receiver() as (url, got), http_verifier(webhook_url=url, webhook_secret=KEY) as h:
            await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=4)  # not announced
            queued = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=4, background=True)
            done = await ended(h, queued.id)
            await wait_until(lambda: got, "the webhook")
            (delivery,) = got
            event = unwrapped(delivery)
            assert (event.type, event.data.id) == (f"response.{done.status}", queued.id)
            assert event.id == delivery[0]["webhook-id"] and event.id.startswith("evt_")
            headers, body = delivery
            with pytest.raises(openai.InvalidWebhookSignatureError):
                openai.OpenAI(api_key="unused").webhooks.unwrap(body + b" ", headers, secret=SECRET)

            with engine_held(h):  # cancelled before it could end
                doomed = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=200,
                                                         background=True)
                await h.client.responses.cancel(doomed.id)
            await wait_until(lambda: len(got) == 2, "the second webhook")
            assert (unwrapped(got[1]).type, unwrapped(got[1]).data.id) == ("response.cancelled", doomed.id)

    asyncio.run(main())


def test_a_failing_receiver_gets_the_same_event_again_and_a_refusing_one_once() -> None:
    async def main() -> None:
        async with receiver(answers=(503, 500)) as (url, got), \
                http_verifier(speculate=False, webhook_url=url, webhook_secret=KEY) as h:
            queued = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2, background=True)
            await wait_until(lambda: len(got) == 3, "the third attempt")
            assert len({headers["webhook-id"] for headers, _ in got}) == 1  # one event, sent three times
            assert unwrapped(got[2]).data.id == queued.id
        async with receiver(answers=(400,)) as (url, got):
            async with http_verifier(speculate=False, webhook_url=url, webhook_secret=KEY) as h:
                first = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2,
                                                        background=True)
                await wait_until(lambda: got, "the webhook")
                second = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2,
                                                         background=True)
                await wait_until(lambda: len(got) == 2, "the next response's webhook")
            # Closing waits for deliveries still pending: the refused event was never sent again.
            assert [unwrapped(delivery).data.id for delivery in got] == [first.id, second.id]

    asyncio.run(main())


def test_a_receiver_that_cannot_be_reached_is_tried_every_attempt_then_the_event_is_dropped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(webhooks, "FIRST_RETRY_S", 0.01)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/hooks"

    async def main() -> None:
        hooks = webhooks.Webhooks(url, KEY)
        hooks.response_ended({"status": "completed", "id": "resp_1"})
        await hooks.close()  # waits for the delivery's attempts: 0.01 s, doubling

    with caplog.at_level(logging.WARNING, logger=webhooks.__name__):
        asyncio.run(main())
    [dropped] = [r.getMessage() for r in caplog.records]
    assert f"dropped after {webhooks.MAX_ATTEMPTS} attempts: last ConnectError" in dropped, dropped


@pytest.mark.parametrize(("flags", "words"), [
    (["--webhook-url", "http://hooks.example/x"], "give --webhook-url and --webhook-secret-file together"),
    (["--webhook-url", "ftp://hooks.example/x", "--webhook-secret-file", "{secret}"], "http:// or https://"),
    (["--webhook-url", "http://hooks.example/x", "--webhook-secret-file", "{bad}"], "base64 after its prefix"),
    (["--webhook-url", "http://hooks.example/x", "--webhook-secret-file", "{tmp}/none"], "cannot read"),
])
def test_webhook_flags_are_checked_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               flags: list[str], words: str) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    (tmp_path / "bad").write_text("whsec_not base64!\n")
    paths = {"secret": tmp_path / "secret", "bad": tmp_path / "bad", "tmp": tmp_path}
    argv = [flag.format(**paths) for flag in flags]
    assert cli.main([*argv, "--model", str(tmp_path / "never-loaded")]) == 2
    assert words in capsys.readouterr().err


def test_the_secret_is_read_as_openai_writes_it(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    args = cli.parser().parse_args(["--webhook-url", "https://hooks.example/x", "--webhook-secret-file",
                                    str(tmp_path / "secret")])
    settings = cli.settings_from_args(args)
    assert settings.webhook_url == "https://hooks.example/x" and settings.webhook_secret.get() == KEY


def test_a_rotated_secret_signs_the_next_delivery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret file is read again when it changes (a rotated Kubernetes Secret): no restart."""
    monkeypatch.setattr(watched_files, "RECHECK_S", 0.0)  # every delivery looks at the file
    rotated = b"the next webhook key"
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")

    async def main() -> None:
        async with receiver() as (url, got), \
                http_verifier(speculate=False, webhook_url=url, webhook_secret=watch_secret(str(path))) as h:
            first = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2, background=True)
            await wait_until(lambda: got, "the webhook")
            path.write_text("whsec_" + base64.b64encode(rotated).decode() + "\n")
            second = await h.client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2, background=True)
            await wait_until(lambda: len(got) == 2, "the second webhook")
        assert unwrapped(got[0]).data.id == first.id
        headers, body = got[1]
        with pytest.raises(openai.InvalidWebhookSignatureError):
            unwrapped(got[1])  # not the old key's
        rotated_secret = "whsec_" + base64.b64encode(rotated).decode()
        assert openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=rotated_secret).data.id == \
            second.id

    asyncio.run(main())
