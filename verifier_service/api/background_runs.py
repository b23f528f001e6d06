"""Background responses (OpenAI's background mode): a response generated apart from the request that
asked for it, for agents whose answers take longer than a connection should be held open.

POST /v1/responses with `background: true` answers at once, with the response `queued`; its generation
runs on as a task of the servers' loop, whatever becomes of that connection. Every event a streamed
response has is kept, in order (its sequence_number is its place), so that a client can stream them
again from any point, the live ones as they come (GET /v1/responses/{id}?stream=true&starting_after=N),
poll the response as it stands (its status, `queued` until its first tokens, then `in_progress`, and its
output so far), or cancel it (its output so far, `cancelled`). While it runs it is held here, outside the
store's budget, so that nothing evicts it before anyone has read it (the engine's queue bounds how many
run); once it ends, it and its events go to the store (response_store.py) like any stored response, and
its end is announced where --webhook-url asks (webhooks.py). The runs are one verifier's: behind several
replicas, poll the one that answered (a sticky session)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from verifier_service.api.generation import GenerationFailed
from verifier_service.api.responses_output import ResponseBuilder
from verifier_service.engine.sequence import Output

log = logging.getLogger(__name__)


@dataclass
class BackgroundRun:
    """One background response while it runs: its builder and every event it has made so far."""

    builder: ResponseBuilder
    input_items: tuple[dict[str, Any], ...]  # its request's input, as GET .../input_items lists it
    events: list[str] = field(default_factory=list)  # SSE events; an event's sequence_number is its index
    started: bool = False  # its first tokens have come
    task: asyncio.Task[None] | None = None
    _grown: asyncio.Event = field(default_factory=asyncio.Event)  # set, and replaced, when events are added

    @property
    def finished(self) -> bool:
        return self.builder.result is not None

    def body(self) -> dict[str, Any]:
        """The response as it stands."""
        if self.builder.result is not None:
            return self.builder.result
        return self.builder.body("in_progress" if self.started else "queued")

    def add(self, events: list[str]) -> None:
        self.events += events
        self._grown.set()
        self._grown = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """Its events after the one numbered `after`, then each as it comes, until it ends."""
        sent = max(after + 1, 0)
        while True:
            grown = self._grown
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.finished:
                return
            await grown.wait()


class BackgroundRuns:
    """The background responses running now, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    async def start(self, builder: ResponseBuilder, input_items: tuple[dict[str, Any], ...],
                    outputs: AsyncIterator[Output], keep: Callable[[BackgroundRun], None],
                    in_flight: AbstractContextManager[None]) -> BackgroundRun:
        """Run the response of `outputs` (its sequence's; closing them frees the sequence) apart from its
        request; `keep` stores it when it ends; `in_flight` is held while it runs (a drain waits for it)."""
        run = BackgroundRun(builder, input_items)
        run.add(builder.opening())
        self._runs[builder.id] = run
        run.task = asyncio.get_running_loop().create_task(self._run(run, outputs, keep, in_flight),
                                                          name=f"background {builder.id}")
        await asyncio.sleep(0)  # the task begins (the loop runs in order): from here a cancel reaches its try
        return run

    async def _run(self, run: BackgroundRun, outputs: AsyncIterator[Output], keep: Callable[[BackgroundRun], None],
                   in_flight: AbstractContextManager[None]) -> None:
        builder = run.builder
        with in_flight:
            try:
                last: Output | None = None
                async with contextlib.aclosing(outputs) as outs:
                    async for last in outs:
                        if not run.started:
                            run.started = True
                            run.add(builder.started())
                        run.add(builder.feed(last))
                assert last is not None  # the outputs end with the one that finishes the sequence
                run.add(builder.closing(last))
            except GenerationFailed as exc:
                run.add(builder.failed(str(exc)))
            except asyncio.CancelledError:  # cancel() or close(): the run ends here, its output so far kept
                builder.cancelled()
            except Exception:
                log.exception("background response %s failed", builder.id)
                run.add(builder.failed("the verifier failed to finish this response"))
            finally:
                try:
                    keep(run)
                except Exception:  # not stored (GET answers 404), but its followers still see its end
                    log.exception("background response %s could not be stored", builder.id)
                del self._runs[builder.id]
                run.add([])  # wakes its followers: it has ended

    async def cancel(self, run: BackgroundRun) -> None:
        """Stop the run (its sequence is freed at the next step) and wait until it is stored."""
        assert run.task is not None
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every run (the server is closing)."""
        await asyncio.gather(*(self.cancel(run) for run in list(self._runs.values())))
