"""Prometheus /metrics of drafter servers, scraped over HTTP."""

import asyncio
import logging
import re
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sdk_support import RecordingDrafter, seq, serving, until

from drafter_sdk.proto import drafter_pb2 as pb


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200
            return response.read().decode()

    text = await asyncio.to_thread(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples.get((f"splitspec_drafter_{name}", tuple(sorted(labels.items()))), 0.0)


def test_counters_follow_calls_sequences_drafts_resyncs_errors_and_evictions():
    async def body():
        async with serving(RecordingDrafter(), metrics_port=0, idle_timeout_s=0.5) as c:
            port = c.running.metrics_port
            await c.prepare("v", seq("a", 0, [1, 2, 3], draft_len=2), seq("b", 5, [1]))
            await c.prepare("v", seq("a", 3, [4], draft_len=1))
            with pytest.raises(grpc.aio.AioRpcError):
                await c.prepare("", seq("a", 4, [5]))
            samples = await scrape(port)
            assert value(samples, "calls_total", method="PrepareDraftTokens", code="OK") == 2
            assert value(samples, "calls_total", method="PrepareDraftTokens", code="INVALID_ARGUMENT") == 1
            assert value(samples, "errors_total", method="PrepareDraftTokens", code="INVALID_ARGUMENT") == 1
            assert value(samples, "errors_total", method="PrepareDraftTokens", code="OK") == 0
            assert value(samples, "call_latency_seconds_count", method="PrepareDraftTokens") == 3
            assert value(samples, "sequences_total") == 3
            assert value(samples, "resyncs_total") == 1
            assert value(samples, "draft_tokens_total") == 3  # [3, 2], then [4]
            assert value(samples, "held_sequences") == 1
            assert {("process_cpu_seconds_total", ()), ("python_gc_collections_total", (("generation", "2"),))} \
                <= samples.keys()

            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["a"]))
            await c.prepare("v", seq("c", 0, [1], draft_len=0))
            samples = await scrape(port)
            assert value(samples, "calls_total", method="ReleaseRequests", code="OK") == 1
            assert value(samples, "held_sequences") == 1  # "a" released, "c" new
            assert value(samples, "state_evictions_total", cause="release") == 1

            for _ in range(100):  # "c" idles out after 0.5 s
                samples = await scrape(port)
                # A scrape reads the held count before the eviction counters, so one taken while the sweeper
                # runs may see the eviction without its drop: wait for both.
                idle = value(samples, "state_evictions_total", cause="idle")
                if idle == 1 and value(samples, "held_sequences") == 0:
                    break
                await asyncio.sleep(0.05)
            assert value(samples, "state_evictions_total", cause="idle") == 1
            assert value(samples, "held_sequences") == 0
            assert value(samples, "eviction_resyncs_total") == 0
            await c.prepare("v", seq("c", 1, [2]))  # "c" comes back after its eviction: a resync
            assert value(await scrape(port), "eviction_resyncs_total") == 1

    asyncio.run(body())


def test_a_refused_call_is_counted_by_the_time_its_client_has_its_status():
    """abort() sends the status before it raises: counted after it, a refusal was missing from the counter its
    client read at once (2-14 times in 200 refusals with the cores busy)."""
    async def body():
        async with serving(RecordingDrafter(), metrics_port=0) as c:
            registry = c.running.servicer.metrics.registry
            for refused in range(1, 301):
                with pytest.raises(grpc.aio.AioRpcError):
                    await c.prepare("", seq("a", 0, [5]))
                assert registry.get_sample_value("splitspec_drafter_calls_total", {
                    "method": "PrepareDraftTokens", "code": "INVALID_ARGUMENT"}) == refused

    asyncio.run(body())


def test_each_server_has_its_own_registry():
    async def body():
        async with serving(RecordingDrafter(), metrics_port=0) as one, \
                serving(RecordingDrafter(), metrics_port=0) as two:
            await one.prepare("v", seq("a", 0, [1]))
            assert value(await scrape(one.running.metrics_port), "sequences_total") == 1
            assert value(await scrape(two.running.metrics_port), "sequences_total") == 0
            assert one.running.metrics_port != two.running.metrics_port

    asyncio.run(body())


def test_no_metrics_endpoint_unless_asked():
    """Without a port nothing is served; the metrics are kept for the stats line unless it is off too."""
    async def body():
        async with serving(RecordingDrafter(), log_stats_interval_s=0) as c:
            assert c.running.metrics_port is None and c.running.servicer.metrics is None
        async with serving(RecordingDrafter()) as c:
            assert c.running.metrics_port is None and c.running.servicer.metrics is not None

    asyncio.run(body())


def test_health_beside_metrics_follows_the_grpc_health_in_plain_http():
    """What a kubelet probes where the gRPC port serves TLS: 503 while loading and from the stop on."""
    loaded, entered, answer = threading.Event(), threading.Event(), threading.Event()

    class Slow(RecordingDrafter):
        def load(self) -> None:
            loaded.wait(30)

        def prepare_draft_tokens(self, requests):
            entered.set()
            answer.wait(30)
            return super().prepare_draft_tokens(requests)

    def health(port: int) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read()

    async def body():
        async with serving(Slow(), wait_loaded=False, metrics_port=0) as c:
            port = c.running.metrics_port
            assert await asyncio.to_thread(health, port) == (503, b"NOT_SERVING\n")
            loaded.set()
            await c.running.wait_loaded()
            assert await asyncio.to_thread(health, port) == (200, b"SERVING\n")
            in_flight = asyncio.create_task(c.prepare("v", seq("r", 0, [1, 2, 3])))
            assert await asyncio.to_thread(entered.wait, 10)
            stopping = asyncio.create_task(c.running.stop(10))  # drains the call in flight
            await until(lambda: not c.running.service.serving)
            assert await asyncio.to_thread(health, port) == (503, b"NOT_SERVING\n")
            answer.set()
            await in_flight
            await stopping

    asyncio.run(body())


def test_a_negative_stats_interval_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from drafter_sdk.server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["ngram", "--port", "0", "--log-stats-interval-s", "-1"])
    assert exited.value.code == 2 and "--log-stats-interval-s must be 0 (never) or positive" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["ngram", "--disable-log-stats"]).log_stats_interval_s == 0.0


def test_the_stats_line_says_what_the_calls_were(caplog: pytest.LogCaptureFixture) -> None:
    """Every interval in which calls came, one line whose figures are the metrics' differences; quiet while idle."""
    caplog.set_level(logging.INFO, logger="drafter_sdk.server.stats_log")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "drafter_sdk.server.stats_log"]

    async def body():
        async with serving(RecordingDrafter(), log_stats_interval_s=0.2) as c:
            for _ in range(4):
                await c.prepare("v", *(seq(f"r{i}", 0, [1, 2, 3, 1, 2, 3], draft_len=2) for i in range(3)))
            await until(lambda: bool(logged()))
            await asyncio.sleep(1.0)
            quiet = len(logged())
            await asyncio.sleep(1.0)
            assert len(logged()) == quiet, logged()  # nothing came: nothing logged
            assert all(line.startswith("Calls: ") and "failed), mean handling" in line for line in logged())
            held = [int(n) for n in re.findall(r"held: (\d+) sequences", "\n".join(logged()))]
            assert held[-1] == 3, logged()

    asyncio.run(body())
