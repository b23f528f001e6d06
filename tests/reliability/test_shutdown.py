"""SIGTERM: health turns NOT_SERVING, in-flight calls finish within the grace period, new calls get
UNAVAILABLE, the process exits 0 - for the verifier (`splitspec-verifier`) and for the drafter SDK
server (`splitspec-drafter`), both as real processes. A second signal ends the drain at once; a signal
while the verifier starts ends it at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_support import CHILD_ENV, WAIT_S, SdkFaultyDrafter, VerifierProcess, idle, until
from tiny_model import tiny_model, tiny_tokenizer
from verifier_harness import run_verifier, token_request

from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from drafter_sdk.proto import verifier_pb2 as pb
from verifier_service.tools.local_services import script

pytestmark = pytest.mark.timeout(120)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPT = [5, 6, 7]
NEW_TOKENS = 200


def long_request() -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(params=pb.GenerationParams(token_ids=pb.TokenIds(ids=PROMPT),
                                    stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)))


def watch_until_not_serving(channel: grpc.Channel, statuses: list[int]) -> list[int]:
    """Statuses a health Watch opened now reports (appended to `statuses` as they come), up to NOT_SERVING."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    try:
        for reply in watch:
            statuses.append(reply.status)
            if reply.status == NOT_SERVING:
                break
    finally:
        watch.cancel()  # an open Watch is an in-flight call too: it would hold the drain
    return statuses


def test_verifier_sigterm_drains_in_flight_requests(tiny_model_dir):
    # One sequence at a time: at SIGTERM most requests are still queued or mid-generation.
    with VerifierProcess(tiny_model_dir, "--max-num-seqs", "1", "--grace-period-s", "60") as verifier:
        verifier.start()
        with grpc.insecure_channel(verifier.address) as channel, \
                concurrent.futures.ThreadPoolExecutor(8) as pool:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            streams = [stub.GenerateStream(long_request(), timeout=WAIT_S * 3) for _ in range(5)]
            first = [next(s) for s in streams[:1]]  # the first one is running
            statuses: list[int] = []
            watching = pool.submit(watch_until_not_serving, channel, statuses)
            # The Watch must be established (its first status received) before the signal.
            asyncio.run(until(lambda: statuses, "the health Watch to report"))
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
            rest = [pool.submit(list, s) for s in streams]
            verifier.process.send_signal(signal.SIGTERM)
            assert watching.result(WAIT_S) == [SERVING, NOT_SERVING]
            # New calls are refused, on this connection and on a new one.
            for target_channel in (channel, grpc.insecure_channel(verifier.address)):
                with pytest.raises(grpc.RpcError) as info:
                    verifier_pb2_grpc.VerifierServiceStub(target_channel).Generate(
                        token_request(PROMPT, 2), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Every request that was in flight finishes, exactly.
            outputs = [r.result(WAIT_S * 3) for r in rest]
        ids = [[t for m in (first if i == 0 else []) + messages for t in m.output.token_ids] for i, messages in enumerate(outputs)]
        assert all(messages[-1].output.finish_reason == pb.FINISH_REASON_LENGTH for messages in outputs)
        assert all(len(x) == NEW_TOKENS for x in ids) and all(x == ids[0] for x in ids)  # whole and identical
        assert verifier.process.wait(WAIT_S) == 0
    assert "shutting down" in verifier.tail(20_000)


def test_verifier_sigterm_during_start_up_exits_0(tmp_path):
    """A pod deleted while its verifier starts: the signal lands while the model thread times the forwards
    (a model wide enough for that to take a while). The process stops its servers and exits 0; left to the
    interpreter's exit under the busy thread, it aborted (status 134)."""
    model_dir = tmp_path / "wide"
    tiny_model(layers=4, width=512).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    process = subprocess.Popen(
        [script("splitspec-verifier"), "--model", str(model_dir), "--port", "0", "--http-port", "off",
         "--timing-cache", "refresh", "--log-level", "INFO"],
        env={**os.environ, **CHILD_ENV}, stderr=subprocess.PIPE, text=True)
    with process:
        lines = []
        for line in process.stderr:  # the KV cache's line comes just before the forwards are timed
            lines.append(line)
            if "KV cache:" in line:
                process.send_signal(signal.SIGTERM)
                break
        _, rest = process.communicate(timeout=WAIT_S)
    log = "".join(lines) + rest
    assert "KV cache:" in log and "forward timings found" not in log, log[-3000:]  # stopped mid-timing
    assert process.returncode == 0, log[-3000:]
    assert "terminate called" not in log and log.rstrip().endswith("stopped")


def test_a_second_signal_ends_the_verifiers_drain_at_once(tmp_path):
    """Ctrl-C twice: the first starts the drain, the second ends it. Requests that would have run for many
    seconds more end UNAVAILABLE at once, the running one and the queued ones, and the process exits 0."""
    tiny_model(max_positions=4096).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with VerifierProcess(tmp_path, "--max-num-seqs", "1", "--grace-period-s", "120", "--max-model-len", "4096",
                         "--log-stats-interval-s", "0.2") as verifier:
        verifier.start()
        with grpc.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            request = pb.GenerateStreamRequest(params=pb.GenerationParams(
                token_ids=pb.TokenIds(ids=PROMPT), stopping=pb.StoppingCriteria(max_new_tokens=4000, ignore_eos=True)))
            streams = [stub.GenerateStream(request, timeout=WAIT_S * 3)]
            next(streams[0])  # it runs; the next two wait for its slot
            streams += [stub.GenerateStream(request, timeout=WAIT_S * 3) for _ in range(2)]
            asyncio.run(until(lambda: "Waiting: 2 reqs" in verifier.tail(20_000), "the two to wait"))
            verifier.process.send_signal(signal.SIGINT)
            asyncio.run(until(lambda: "shutting down" in verifier.tail(20_000), "the drain to start"))
            verifier.process.send_signal(signal.SIGINT)
            for stream in streams:
                with pytest.raises(grpc.RpcError) as info:
                    for _ in stream:
                        pass
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in info.value.details()
        assert verifier.process.wait(WAIT_S) == 0
    assert "received SIGINT again" in verifier.tail(20_000)


def test_verifier_grace_period_bounds_the_drain():
    """Requests still running when the grace period ends are ended as shut down, on both fronts (an HTTP
    stream with an error event and [DONE], not a dropped connection); stop() returns, nothing is held."""
    async def body():
        async with run_verifier(max_num_seqs=1) as v, httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{v.running.http_port}", timeout=WAIT_S) as http:
            request = pb.GenerateRequest(params=pb.GenerationParams(token_ids=pb.TokenIds(ids=PROMPT),
                                         stopping=pb.StoppingCriteria(max_new_tokens=250, ignore_eos=True)))
            calls = [asyncio.ensure_future(v.stub.Generate(request, timeout=WAIT_S)) for _ in range(4)]
            await until(lambda: v.running.runtime.engine.scheduler.num_running == 1, "a request runs")
            async with http.stream("POST", "/v1/completions", json={"prompt": "def", "max_tokens": 250,
                                                                    "ignore_eos": True, "stream": True}) as stream:
                stopping = asyncio.ensure_future(v.running.stop(0.3))
                lines = [line async for line in stream.aiter_lines() if line]
                await stopping
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, lines, idle(v)

    results, lines, _ = asyncio.run(body())
    cut = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert cut and all(r.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in r.details() for r in cut), results
    assert lines[-1] == "data: [DONE]" and "shut down" in json.loads(lines[-2][6:])["error"]["message"], lines[-3:]


def test_drafter_sdk_sigterm_drains_in_flight_calls():
    with SdkFaultyDrafter(name="draining-drafter") as drafter:
        drafter.set("slow_some", oracle=[([1, 2, 3, 4, 5, 6, 7, 8], 3)], slow_every=1, slow_s=1.5)
        drafter.start()
        with grpc.insecure_channel(drafter.address) as channel, \
                concurrent.futures.ThreadPoolExecutor(4) as pool:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            call = drafter_pb2.PrepareDraftTokensRequest(verifier_id="v", sequences=[drafter_pb2.DraftSequence(
                request_id="r", context_len=0, new_tokens=[1, 2, 3], prompt_len=3, draft_len=4)])
            in_flight = pool.submit(stub.PrepareDraftTokens, call, timeout=WAIT_S)
            asyncio.run(until(lambda: drafter.calls() == 1, "the call is inside the drafter"))
            statuses: list[int] = []
            watching = pool.submit(watch_until_not_serving, channel, statuses)
            asyncio.run(until(lambda: statuses, "the health Watch to report"))
            drafter.process.send_signal(signal.SIGTERM)
            assert watching.result(WAIT_S)[-1] == NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                with grpc.insecure_channel(drafter.address) as fresh:
                    drafter_pb2_grpc.DrafterServiceStub(fresh).PrepareDraftTokens(call, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            reply = in_flight.result(WAIT_S)  # finished during the grace period
            assert list(reply.results[0].draft_tokens) == [4, 5, 6, 7]
        assert drafter.process.wait(WAIT_S) == 0


def test_a_second_signal_ends_the_drafters_drain_at_once():
    """The drafter's call in flight is cut off at the second signal instead of answered; the process
    exits 0 without waiting for the drafter's own code to return."""
    flags = ("--grace-period-s", "120", "--log-level", "INFO")
    with SdkFaultyDrafter(name="cut-drafter", extra_args=flags) as drafter:
        drafter.set("slow_some", oracle=[([1, 2, 3, 4, 5, 6, 7, 8], 3)], slow_every=1, slow_s=3)
        drafter.start()
        with grpc.insecure_channel(drafter.address) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = drafter_pb2.PrepareDraftTokensRequest(verifier_id="v", sequences=[drafter_pb2.DraftSequence(
                request_id="r", context_len=0, new_tokens=[1, 2, 3], prompt_len=3, draft_len=4)])
            in_flight = pool.submit(drafter_pb2_grpc.DrafterServiceStub(channel).PrepareDraftTokens, call,
                                    timeout=WAIT_S)
            asyncio.run(until(lambda: drafter.calls() == 1, "the call is inside the drafter"))
            drafter.process.send_signal(signal.SIGTERM)
            asyncio.run(until(lambda: "stopping" in drafter.tail(20_000), "the drain to start"))
            drafter.process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as info:
                in_flight.result(WAIT_S)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # grpc's "Cancelling all calls"
        assert drafter.process.wait(WAIT_S) == 0
    assert "received SIGTERM again" in drafter.tail(20_000)
