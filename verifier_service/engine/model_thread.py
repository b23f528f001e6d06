"""The verifier's one model thread: every torch op runs here, and so does the engine's step loop.

The thread runs an asyncio event loop of its own. The engine's loop is a task on it, so a
step (schedule, draft, forward, commit) makes no thread hand-off of its own: the forward
runs inline, an in-process drafter is called inline, and a remote drafter's call is sent
and awaited from here. The servers keep their own event loop on the main thread (health,
new requests, cancellations), which stays free during a forward; the engine hands it the
step's outputs once per step.

It is also a `concurrent.futures.Executor`, so one-off work can be queued on it
(`loop.run_in_executor(model_thread, fn)`): start-up, calibration, tensor-parallel
heartbeats. Such calls run between the engine's steps.

Why one thread for torch: on CPU, one OpenMP parallel region on another thread made every
later forward about 2x slower (SmolLM2 one-token step 30 -> 60 ms, measured). The model's load
runs here too: a GGUF's first load converts it, and converted on another thread it made every
forward about 1.5x slower.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread(Executor):
    def __init__(self, name: str = "model") -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn(*args, **kwargs)` on the thread, between steps (raises RuntimeError once shut down)."""
        if self._closed:
            raise RuntimeError("the model thread has shut down")
        future: Future[T] = Future()

        def call() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return future

    def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run a coroutine on the thread's loop (e.g. the engine's step loop)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the model thread has shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the loop after the calls queued so far."""
        if self._closed:
            return
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        if wait and not self.on_thread():
            self._thread.join()
