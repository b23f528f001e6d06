"""Drafter faults with real processes and real gRPC, under concurrent load.

For every fault: zero failed requests, every output identical to plain decoding
(transformers' greedy generate on the same model), and speculation resumes by
itself once the drafter is healthy again, through the circuit breaker's backoff
(counted at the drafter: a handful of calls during the fault, not one per step).

The verifier runs in-process (the harness's real gRPC server on port 0); the
drafters are child processes: the SDK's `splitspec-drafter` serving
tests/faulty_drafters.py, or the raw wire-level tests/faulty_drafter_server.py.
Drafters know the target's greedy continuations (an oracle), so a drafter that
works shows up as accepted tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from reliability_support import (
    FIGURES,
    Load,
    RawFaultyDrafter,
    SdkFaultyDrafter,
    Workload,
    accepted,
    make_workload,
    until,
)
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config

from drafter_sdk.proto import verifier_pb2
from verifier_service.tools.local_services import free_port

pytestmark = pytest.mark.timeout(120)

VOCAB = len(tiny_tokenizer())
DEADLINE_MS = 250  # generous: a healthy drafter answers in milliseconds, even on a busy machine
MAX_DRAFT_LEN = 4
# Calls a breaker may let through during a fault window of FAULT_WINDOW_S: the 3 failures that
# open it, trials after 0.5 s and 1.5 s (backoff doubling), the call in flight at the switch, slack.
FAULT_WINDOW_S = 1.2
MAX_CALLS_IN_WINDOW = 9



@pytest.fixture(scope="module")
def workload() -> Workload:
    wl = make_workload(12, seed=1)
    wl.oracle()  # compute the references once, before any clock starts
    return wl


@pytest.fixture(scope="module")
def raw_drafter(workload):
    with RawFaultyDrafter(VOCAB) as d:
        d.start()
        d.set("ok", oracle=workload.oracle())
        yield d


def user_provided(target: str, **extra: object):
    return spec_config("USER_PROVIDED", MAX_DRAFT_LEN, target, deadline_ms=DEADLINE_MS, **extra)


@dataclass
class Outcome:
    load: Load
    calls_in_window: int
    steps_in_window: int
    failures_in_window: int
    recovered_at: float
    state_during: int
    info: verifier_pb2.GetServerInfoResponse
    overlapped: int  # drafter calls read after their step's forward (a drafter that looks ahead)


async def run_fault(v, workload: Workload, inject: Callable[[], Awaitable[None] | None],
                    heal: Callable[[], Awaitable[None] | None], drafter_calls: Callable[[], int],
                    window_s: float = FAULT_WINDOW_S, concurrency: int = 6) -> Outcome:
    """Load the verifier, inject a fault for `window_s`, heal it, wait until drafts are accepted again."""
    rt = v.running.runtime
    client, engine = rt.drafter, rt.engine
    load = Load(v.stub, workload, concurrency).start()
    try:
        await until(lambda: accepted(load.done) > 0, "speculation works before the fault")
        calls0, steps0, failures0 = drafter_calls(), engine.decode_steps, client.stats.failures
        await _maybe_await(inject())
        await asyncio.sleep(window_s)
        state_during = (await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())).drafter.state
        calls1, steps1, failures1 = drafter_calls(), engine.decode_steps, client.stats.failures
        successes = client.stats.calls - client.stats.failures
        await _maybe_await(heal())
        await until(lambda: client.stats.calls - client.stats.failures > successes and client.healthy,
                    "the breaker closes again by itself once the drafter is healthy")
        recovered_at = time.monotonic()
        await until(lambda: accepted([d for d in load.since(recovered_at)]) > 0,
                    "drafts are accepted again after recovery")
    finally:
        await load.stop()
    info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
    return Outcome(load, calls1 - calls0, steps1 - steps0, failures1 - failures0, recovered_at, state_during, info,
                   client.stats.overlapped)


async def _maybe_await(x: object) -> None:
    if inspect.isawaitable(x):
        await x


def check(outcome: Outcome, fault: str, looks_ahead: bool = False) -> None:
    """`looks_ahead`: the drafter advertises "lookahead", so calls in flight during a forward met the fault too."""
    outcome.load.check()
    figures = {"fault": fault, "requests": len(outcome.load.done), "failed": len(outcome.load.failed),
               "drafter_calls_in_fault": outcome.calls_in_window, "steps_in_fault": outcome.steps_in_window,
               "drafter_failures": outcome.info.drafter.failures, "overlapped_calls": outcome.overlapped}
    FIGURES.append(figures)
    assert (outcome.overlapped > 0) == looks_ahead, figures
    assert outcome.info.drafter.state == verifier_pb2.DRAFTER_STATE_HEALTHY, outcome.info.drafter
    assert outcome.failures_in_window >= 3, figures  # the fault was seen ...
    assert outcome.state_during == verifier_pb2.DRAFTER_STATE_UNAVAILABLE, figures  # ... and opened the breaker
    # A breaker with backoff, not a retry per step: few calls while decoding went on.
    assert outcome.calls_in_window <= MAX_CALLS_IN_WINDOW, figures
    assert outcome.steps_in_window > 2 * outcome.calls_in_window, figures


# --- wire-level garbage and error statuses (raw servicer) ---------------------------------------

RAW_FAULTS = ["error:UNAVAILABLE", "error:INTERNAL", "error:RESOURCE_EXHAUSTED", "out_of_vocab", "negative",
              "too_many", "unknown_request", "wrong_count", "unspecified_status", "oversized"]


@pytest.mark.parametrize("fault", RAW_FAULTS)
def test_raw_drafter_fault_costs_drafts_only(raw_drafter, workload, fault):
    mode, _, code = fault.partition(":")

    async def body():
        raw_drafter.set("ok")
        async with run_verifier(user_provided(raw_drafter.address)) as v:
            outcome = await run_fault(v, workload, lambda: raw_drafter.set(mode, code=code or "UNAVAILABLE"),
                                      lambda: raw_drafter.set("ok"), raw_drafter.calls)
        check(outcome, fault)
        assert outcome.info.drafter.last_error  # says what went wrong, for the operator

    asyncio.run(body())


# --- the SDK drafter process: killed, hanging, slow, failing -------------------------------------

@pytest.fixture(scope="module", params=["oracle", "model"])
def sdk_drafter_process(request, workload, tiny_model_dir):
    """The SDK drafter process: drafting from the oracle, or with the SDK's ModelDrafter (the target
    model drafting for itself, so its drafts are accepted). One per kind for the module: each test
    starts a verifier of its own, which the drafter keeps apart from the earlier ones' requests."""
    with SdkFaultyDrafter(draft_model=tiny_model_dir if request.param == "model" else None) as d:
        d.set("ok", oracle=workload.oracle())
        d.start()
        yield d


@pytest.fixture
def sdk_drafter(sdk_drafter_process):
    """The module's drafter process, healthy: whatever fault the test before left on is off."""
    sdk_drafter_process.set("ok")
    yield sdk_drafter_process


def test_drafter_killed_mid_generation_then_restarted(sdk_drafter, workload):
    async def body():
        async with run_verifier(user_provided(sdk_drafter.address)) as v:
            client = v.running.runtime.drafter
            first_pid = sdk_drafter.process.pid

            async def restart():
                await asyncio.to_thread(sdk_drafter.start)  # same port, empty state

            outcome = await run_fault(v, workload, sdk_drafter.kill, restart, lambda: client.stats.calls)
        check(outcome, "drafter SIGKILL, restarted", sdk_drafter.looks_ahead)
        assert sdk_drafter.process.pid != first_pid and sdk_drafter.calls() > 0  # the new process drafts

    asyncio.run(body())


def test_drafter_hangs_past_the_deadline(sdk_drafter, workload):
    async def body():
        async with run_verifier(user_provided(sdk_drafter.address)) as v:
            outcome = await run_fault(v, workload, lambda: sdk_drafter.set("hang"), lambda: sdk_drafter.set("ok"),
                                      sdk_drafter.calls)
            last_error = outcome.info.drafter.last_error
        check(outcome, "drafter hangs past the deadline", sdk_drafter.looks_ahead)
        assert "DEADLINE_EXCEEDED" in last_error

    asyncio.run(body())


def test_drafter_raises_inside_the_sdk(sdk_drafter, workload):
    async def body():
        async with run_verifier(user_provided(sdk_drafter.address)) as v:
            outcome = await run_fault(v, workload, lambda: sdk_drafter.set("raise"), lambda: sdk_drafter.set("ok"),
                                      sdk_drafter.calls)
        check(outcome, "drafter raises (SDK answers INTERNAL)", sdk_drafter.looks_ahead)

    asyncio.run(body())


def test_drafter_slow_on_some_calls_only(sdk_drafter, workload):
    """Every 4th call sleeps past the deadline: those steps go without drafts, the others draft."""
    async def body():
        async with run_verifier(user_provided(sdk_drafter.address)) as v:
            client = v.running.runtime.drafter
            load = Load(v.stub, workload).start()
            try:
                await until(lambda: accepted(load.done) > 0, "speculation works")
                sdk_drafter.set("slow_some", slow_every=4, slow_s=DEADLINE_MS / 1000 * 2)
                failures0 = client.stats.failures
                switched = time.monotonic()
                await until(lambda: client.stats.failures >= failures0 + 2, "slow calls miss the deadline")
                await until(lambda: accepted(load.since(switched)) > 0, "fast calls still draft meanwhile")
            finally:
                await load.stop()
            info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
        load.check()
        FIGURES.append({"fault": "drafter slow on some calls", "requests": len(load.done), "failed": len(load.failed),
                        "drafter_failures": info.drafter.failures})
        assert "DEADLINE_EXCEEDED" in info.drafter.last_error

    asyncio.run(body())


def test_drafter_absent_when_the_verifier_starts(workload):
    """The verifier starts and serves without speculation, then speculates once the drafter appears."""
    port = free_port()

    async def body():
        async with run_verifier(user_provided(f"127.0.0.1:{port}")) as v:
            client = v.running.runtime.drafter
            load = Load(v.stub, workload).start()
            try:
                await until(lambda: len(load.done) >= 6, "requests are served without a drafter")
                before = list(load.done)
                assert accepted(before) == 0 and client.stats.failures >= 1
                info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
                assert info.drafter.state == verifier_pb2.DRAFTER_STATE_UNAVAILABLE, info.drafter
                with SdkFaultyDrafter(name="late-drafter") as drafter:
                    drafter.set("ok", oracle=workload.oracle())
                    await asyncio.to_thread(drafter.start, port)
                    appeared = time.monotonic()
                    await until(lambda: accepted(load.since(appeared)) > 0, "speculation begins by itself")
                    await load.stop()
                    info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
                    assert drafter.calls() > 0
            finally:
                await load.stop()
        load.check()
        FIGURES.append({"fault": "drafter absent at start", "requests": len(load.done), "failed": len(load.failed),
                        "drafter_failures": info.drafter.failures})
        assert info.drafter.state == verifier_pb2.DRAFTER_STATE_HEALTHY
        assert info.drafter.name == "faulty-sdk"  # learnt once it appeared

    asyncio.run(body())


def test_drafter_replica_swapped_under_load():
    """Two replicas behind round_robin; the one the verifier's stream drafts on is replaced by a fresh
    process (state lost) under load. The stream moves to a replica that lacks the sequences."""
    # Long generations: sequences outlive the delta overlap, so the new replica gets deltas it cannot place.
    workload = make_workload(8, seed=5, new_tokens=(150, 220))
    workload.oracle()
    with SdkFaultyDrafter(name="replica-a") as a, SdkFaultyDrafter(name="replica-b") as b:
        for d in (a, b):
            d.set("ok", oracle=workload.oracle())
            d.start()
        target = f"ipv4:{a.address},{b.address}"

        async def body():
            async with run_verifier(user_provided(target)) as v:
                client = v.running.runtime.drafter
                load = Load(v.stub, workload).start()
                try:
                    await until(lambda: a.calls() + b.calls() > 0 and accepted(load.done) > 0, "a replica drafts")
                    drafting, other = (a, b) if a.calls() > 0 else (b, a)
                    assert other.calls() == 0  # one stream, one replica
                    resyncs0 = client.stats.resyncs
                    await asyncio.to_thread(drafting.stop)  # a rolling update: graceful stop ...
                    await asyncio.to_thread(drafting.start)  # ... and a new process on the same address
                    swapped = time.monotonic()
                    await until(lambda: drafting.calls() + other.calls() > 0, "a replica gets calls again")
                    await until(lambda: client.stats.resyncs > resyncs0, "the replica asks for resyncs")
                    await until(lambda: accepted(load.since(swapped)) > 0, "drafts are accepted after the swap")
                finally:
                    await load.stop()
                info = await v.stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())
            load.check()
            FIGURES.append({"fault": "replica swapped under load", "requests": len(load.done),
                            "failed": len(load.failed), "drafter_failures": info.drafter.failures,
                            "resyncs": client.stats.resyncs})

        asyncio.run(body())


def test_breaker_backs_off_while_the_drafter_stays_down(workload):
    """A long outage: trials spread out with doubling backoff instead of one call per step."""
    port = free_port()

    async def body():
        async with run_verifier(user_provided(f"127.0.0.1:{port}")) as v:
            client, engine = v.running.runtime.drafter, v.running.runtime.engine
            load = Load(v.stub, workload).start()
            try:
                await asyncio.sleep(4.0)
            finally:
                await load.stop()
        load.check()
        FIGURES.append({"fault": "drafter down for 4 s", "requests": len(load.done), "failed": len(load.failed),
                        "drafter_calls": client.stats.calls, "steps_without_call": client.stats.skipped})
        # 3 failures open the breaker; trials after 0.5, 1.5, 3.5 s: at most ~7 calls in 4 s.
        assert client.stats.calls <= 8, (client.stats.calls, engine.decode_steps)
        assert client.stats.skipped > 3 * client.stats.calls  # steps went on without calling
        assert client.breaker._backoff_s >= 2.0  # doubled at each failed trial

    asyncio.run(body())
