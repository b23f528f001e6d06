"""Webhooks for background responses, as OpenAI sends them: when a background response ends, an event
is POSTed to --webhook-url, so that a client need not poll.

The event is OpenAI's (`{"id": "evt_...", "object": "event", "type": "response.completed", "created_at":
..., "data": {"id": "resp_..."}}`; types response.completed, .incomplete, .failed and .cancelled),
signed as OpenAI signs it (the Standard Webhooks scheme: headers webhook-id, webhook-timestamp and
webhook-signature, `v1,` and the base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the secret of
--webhook-secret-file, `whsec_` and base64 as OpenAI writes it), so that the official client's
`client.webhooks.unwrap(body, headers, secret=...)` checks and reads it. The secret file is read again when it
changes (watch_secret), as the TLS and token files are: a rotated secret signs the next delivery.

A delivery is answered by any 2xx. Where the receiver cannot be reached, times out, or answers 429 or
5xx, it is sent again, the same event under the same webhook-id (a receiver drops repeats by it), after
0.5 s, doubling, for MAX_ATTEMPTS in all; another answer, or the last failure, is logged and the event is
dropped. Deliveries run as tasks of the servers' loop: they never hold a response back. At shutdown
those still pending get CLOSE_S to finish.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from drafter_sdk.service.watched_files import WatchedFiles, current

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 6
FIRST_RETRY_S = 0.5
TIMEOUT_S = 10.0
CLOSE_S = 5.0
ENDINGS = ("completed", "incomplete", "failed", "cancelled")  # a response's final statuses, each an event


def read_secret(path: str) -> bytes:
    """The signing key a --webhook-secret-file holds (`whsec_` and base64, as OpenAI gives it, or any other
    text, taken as it is). Raises ValueError naming what is wrong."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if text.startswith("whsec_"):
        try:
            key = base64.b64decode(text.removeprefix("whsec_"), validate=True)
        except ValueError:
            raise ValueError(f"{path}: a whsec_ secret is base64 after its prefix") from None
    else:
        key = text.encode()
    if not key:
        raise ValueError(f"{path} holds an empty secret")
    return key


def watch_secret(path: str) -> WatchedFiles[bytes]:
    """read_secret's key, read again when the file changes (drafter_sdk/service/watched_files.py)."""
    return WatchedFiles(lambda: read_secret(path), [path], "webhook secret file")


def signed_headers(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": "v1," + base64.b64encode(mac.digest()).decode(), "content-type": "application/json"}


class Webhooks:
    def __init__(self, url: str, key: bytes | WatchedFiles[bytes]) -> None:
        self.url = url
        self._key = key
        # Imported here: only a server with --webhook-url pays for it (0.3 s of a start where httpx's command
        # line, rich and pygments, is installed too).
        import httpx

        self._client = httpx.AsyncClient(timeout=TIMEOUT_S)
        self._http_error: type[httpx.HTTPError] = httpx.HTTPError
        self._pending: set[asyncio.Task[None]] = set()

    def response_ended(self, response: dict[str, object]) -> None:
        """Announce a background response's end (its final object), in the background."""
        status = response["status"]
        assert status in ENDINGS, status
        event = {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "type": f"response.{status}",
                 "created_at": int(time.time()), "data": {"id": response["id"]}}
        task = asyncio.get_running_loop().create_task(self._deliver(event), name=f"webhook {event['id']}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _deliver(self, event: dict[str, object]) -> None:
        body = json.dumps(event).encode()
        webhook_id = str(event["id"])
        delay = FIRST_RETRY_S
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                answer = await self._client.post(self.url, content=body, headers=signed_headers(
                    current(self._key), webhook_id, int(time.time()), body))
            except self._http_error as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if answer.is_success:
                    return
                why = f"answered {answer.status_code}"
                if answer.status_code != 429 and answer.status_code < 500:
                    log.warning("webhook %s (%s) to %s dropped: the receiver %s", webhook_id, event["type"],
                                self.url, why)
                    return
            if attempt < MAX_ATTEMPTS:
                await asyncio.sleep(delay)
                delay *= 2
        log.warning("webhook %s (%s) to %s dropped after %d attempts: last %s", webhook_id, event["type"], self.url,
                    MAX_ATTEMPTS, why)

    async def close(self) -> None:
        """Give pending deliveries CLOSE_S to finish, then stop."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=CLOSE_S)
        for task in set(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._client.aclose()
