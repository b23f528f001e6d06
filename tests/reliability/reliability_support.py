"""Shared helpers of the reliability tests: real drafter processes (restartable on their port),
a workload with known answers, a load generator, and waits with generous bounds.

No test here asserts on durations: the machine is shared. Waits poll a condition
with a generous timeout; assertions are on counts and outputs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from faulty_drafters import CONTROL_ENV, MODEL_ENV, STATS_ENV, read_stats, write_control
from tiny_model import tiny_model
from verifier_harness import (
    VerifierHandle,
    reference_greedy,
    run_verifier,
    token_request,
)

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.tools.local_services import LocalService, script

TESTS = Path(__file__).resolve().parent.parent
WAIT_S = 30.0  # bound on any wait for a condition (never a timing assertion)
# The tiny model gains nothing from intra-op threads; on a shared machine spinning pools hurt.
torch.set_num_threads(1)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# --- processes ----------------------------------------------------------------------------------

@dataclass
class Proc(LocalService):
    """A LocalService the tests can SIGKILL and restart on its port; a `with` block only kills it at the end."""

    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.env = {**CHILD_ENV, **(self.env or {})}

    def kill(self) -> None:
        """SIGKILL: no goodbye, state lost."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class VerifierProcess(Proc):
    """`splitspec-verifier` on a model folder (the tiny model saved by the tiny_model_dir fixture)."""

    def __init__(self, model_dir: Path, *extra_args: str, name: str = "verifier", **kwargs: object) -> None:
        super().__init__([script("splitspec-verifier"), "--model", str(model_dir), "--max-model-len", "256",
                          "--kv-cache-memory-gb", "0.25", "--log-level", "INFO", "--http-port", "off", *extra_args], name=name, **kwargs)


class SdkFaultyDrafter(Proc):
    """tests/faulty_drafters.py:FaultyDrafter served by `splitspec-drafter` (the SDK's real CLI)."""

    def __init__(self, name: str = "sdk-drafter", extra_args: tuple[str, ...] = (), draft_model: Path | None = None,
                 **kwargs: object) -> None:
        """With `draft_model` (a model folder), the faults sit in front of the SDK's ModelDrafter."""
        drafter = "FaultyModelDrafter" if draft_model is not None else "FaultyDrafter"
        self.looks_ahead = draft_model is None  # FaultyDrafter advertises "lookahead"
        super().__init__([script("splitspec-drafter"), f"{TESTS}/faulty_drafters.py:{drafter}",
                          "--log-level", "WARNING", "--grace-period-s", "5", *extra_args], name=name, **kwargs)
        self.control_path = self.workdir / "control.json"
        self.stats_path = self.workdir / f"{name}-stats.json"
        self.env.update({CONTROL_ENV: str(self.control_path), STATS_ENV: str(self.stats_path),
                         **({MODEL_ENV: str(draft_model)} if draft_model is not None else {})})
        self._oracle: list = []
        self.set("ok")

    def set(self, mode: str, oracle: list | None = None, **knobs: object) -> None:
        if oracle is not None:
            self._oracle = oracle
        write_control(self.control_path, mode, self._oracle, **knobs)

    def stats(self) -> dict:
        """Counters of the current process (zero until it served a call)."""
        stats = read_stats(self.stats_path)
        if self.process is None or stats.get("pid") != self.process.pid:
            return {"pid": None, "calls": 0, "sequences": 0, "released": 0, "calls_by_mode": {}}
        return stats

    def calls(self) -> int:
        return int(self.stats()["calls"])


class RawFaultyDrafter(Proc):
    """tests/faulty_drafter_server.py: a raw gRPC DrafterService steered over faulty.Control."""

    def __init__(self, vocab_size: int, name: str = "raw-drafter", **kwargs: object) -> None:
        super().__init__([sys.executable, str(TESTS / "faulty_drafter_server.py"), "--vocab-size", str(vocab_size)],
                         name=name, **kwargs)

    def _call(self, method: str, body: dict) -> dict:
        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_unary(f"/faulty.Control/{method}", request_serializer=lambda d: json.dumps(d).encode(),
                                       response_deserializer=json.loads)
            return call(body, timeout=10)

    def set(self, mode: str, oracle: list | None = None, **knobs: object) -> dict:
        body: dict = {"mode": mode, **knobs}
        if oracle is not None:
            body["oracle"] = [{"ids": list(ids), "prompt_len": n} for ids, n in oracle]
        return self._call("Set", body)

    def stats(self) -> dict:
        return self._call("Stats", {})

    def calls(self) -> int:
        return int(self.stats()["calls"])


# --- workload -----------------------------------------------------------------------------------

@functools.cache
def reference_model() -> torch.nn.Module:
    return tiny_model()


@functools.cache
def reference(prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy generate() on the same tiny model: plain decoding's output."""
    return tuple(reference_greedy(reference_model(), list(prompt), max_new_tokens))


@dataclass
class Workload:
    prompts: list[list[int]]
    max_new_tokens: list[int]

    def expected(self, i: int) -> list[int]:
        return list(reference(tuple(self.prompts[i]), self.max_new_tokens[i]))

    def oracle(self) -> list[tuple[list[int], int]]:
        """(prompt + expected output, prompt_len) per prompt, for the oracle drafters."""
        return [(p + self.expected(i), len(p)) for i, p in enumerate(self.prompts)]

    def request(self, i: int, **fields: object) -> verifier_pb2.GenerateRequest:
        return token_request(self.prompts[i], self.max_new_tokens[i], **fields)


def make_workload(n: int, seed: int = 0, new_tokens: tuple[int, int] = (24, 64), vocab: int = 380) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*new_tokens) for _ in range(n)])


@dataclass
class Done:
    index: int
    started: float
    finished: float
    response: verifier_pb2.GenerateResponse


@dataclass
class Load:
    """`concurrency` clients issuing the workload's requests back to back until stopped."""

    stub: verifier_pb2_grpc.VerifierServiceStub
    workload: Workload
    concurrency: int = 6
    done: list[Done] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Future | None = None

    def start(self) -> "Load":
        self._task = asyncio.ensure_future(asyncio.gather(*(self._client(c) for c in range(self.concurrency))))
        return self

    async def _client(self, c: int) -> None:
        n = len(self.workload.prompts)
        k = c
        while not self._stop.is_set():
            i = k % n
            k += self.concurrency
            started = time.monotonic()
            try:
                response = await self.stub.Generate(self.workload.request(i), timeout=WAIT_S * 2)
            except grpc.aio.AioRpcError as exc:
                self.failed.append((i, f"{exc.code().name}: {exc.details()}"))
                continue
            self.done.append(Done(i, started, time.monotonic(), response))

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, WAIT_S * 2)

    def since(self, t: float) -> list[Done]:
        return [d for d in self.done if d.started >= t]

    def check(self) -> None:
        """Zero failed requests, and every output is plain decoding's."""
        assert not self.failed, f"{len(self.failed)} requests failed, e.g. {self.failed[:3]}"
        wrong = [d.index for d in self.done if list(d.response.output.token_ids) != self.workload.expected(d.index)]
        assert not wrong, f"{len(wrong)} of {len(self.done)} outputs differ from plain decoding (prompts {wrong[:5]})"


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.02)


async def until_async(predicate: Callable[[], "asyncio.Future[bool]"], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.05)


def accepted(done: list[Done]) -> int:
    return sum(d.response.output.stats.num_accepted_tokens for d in done)


# --- an in-process verifier on its own event loop thread ----------------------------------------

class VerifierThread:
    """The harness's in-process verifier, run on a background event loop so that sync tests (and
    hypothesis) can share one server. `on_loop(fn)` runs `fn(handle)` (sync or async) on its loop."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._args, self._kwargs = args, kwargs
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="verifier-loop", daemon=True)
        self._error: BaseException | None = None
        self.handle: VerifierHandle | None = None

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with run_verifier(*self._args, **self._kwargs) as handle:
            self.handle = handle
            self._ready.set()
            await self._stop.wait()

    @property
    def address(self) -> str:
        assert self.handle is not None
        return self.handle.address

    def on_loop(self, fn: Callable[[VerifierHandle], object]) -> object:
        async def call() -> object:
            result = fn(self.handle)
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(WAIT_S * 2)

    def __enter__(self) -> "VerifierThread":
        self._thread.start()
        self._ready.wait(WAIT_S * 4)
        if self._error is not None or self.handle is None:
            raise RuntimeError("the verifier did not start") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT_S * 2)


def idle(handle: VerifierHandle) -> dict:
    """What the engine still holds: all zero once every request finished or was cancelled (everything
    else kept for a request lives on its Sequence, and goes with it). Slots the prefix cache keeps idle
    (evictable) are not held; every cached block must belong to one of them."""
    engine = handle.running.runtime.engine
    cache = engine.scheduler.prefix_cache
    holders = {slot for slots in cache._holders.values() for slot in slots}
    return {"running": engine.scheduler.num_running, "waiting": engine.scheduler.num_waiting,
            "kv_slots": engine.runner.kv_cache.num_used_slots - cache.num_idle,
            "stray_cached_blocks": len(holders - set(cache._idle))}


# Figures of the run (fault, requests, failures, drafter calls; fuzz cases), printed by conftest.py.
FIGURES: list[dict] = []
