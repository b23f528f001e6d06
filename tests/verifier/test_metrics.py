"""The verifier's Prometheus /metrics, scraped over HTTP around real generations.

Counters are checked against what the same requests report in their own
speculation stats (GenerationOutput.stats) and against the drafter client's
counts, never against times.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import urllib.request
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    shared_model,
    stream_request,
    wait_until,
)

from drafter_sdk.errors import ListenError
from drafter_sdk.proto import verifier_pb2
from verifier_service.api.cli import parser, settings_from_args
from verifier_service.tools.local_services import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_sync(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(v) -> Samples:  # noqa: ANN001
    return await asyncio.to_thread(scrape_sync, v.running.metrics_port)


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (f"splitspec:{name}", tuple(sorted(labels.items())))
    assert key in samples, f"{key} not exposed"
    return samples[key]


def per_pos(samples: Samples) -> dict[int, float]:
    name = "splitspec:spec_decode_num_accepted_tokens_per_pos_total"
    return {int(dict(labels)["position"]): v for (n, labels), v in samples.items() if n == name}


def hold_after_prefill(engine) -> Callable[[], None]:  # noqa: ANN001
    """Let one forward pass (a prefill) through, then hold the engine at the next one until
    the returned function is called: scheduler, KV cache and counters stay as they are."""
    forward, permits = engine.runner.forward, threading.Semaphore(1)

    def gated(batch):  # noqa: ANN001, ANN202
        assert permits.acquire(timeout=WAIT_S), "the test never released the engine"
        return forward(batch)

    def release() -> None:
        engine.runner.forward = forward
        permits.release()

    engine.runner.forward = gated
    return release


COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_draft_nodes_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_auto_disabled_total", "prompt_tokens_total",
            "generation_tokens_total", "drafter_call_failures_total", "drafter_calls_skipped_total",
            "drafter_resyncs_total")
HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
              "drafter_call_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
              "request_queue_time_seconds")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def test_counters_follow_speculation_requests_and_scheduler_state():
    max_draft_len = 4
    prompts = [repetitive_prompt(seed) for seed in LOOPING_SEEDS[:6]]
    lengths = [24, 17, 30, 9, 24, 1]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", max_draft_len), model=shared_model(), metrics_port=0,
                                max_num_seqs=4, max_draft_nodes=16) as v:
            port = v.running.metrics_port
            assert isinstance(port, int) and port > 0
            before = await scrape(v)
            for name in COUNTERS:
                assert value(before, name) == 0, name
            for name in HISTOGRAMS:
                assert value(before, f"{name}_count") == 0, name
            for name in GAUGES:
                assert value(before, name) == 0, name
            assert per_pos(before) == {pos: 0 for pos in range(max_draft_len)}
            for reason in ("stop", "length", "abort", "error"):
                assert value(before, "request_success_total", finished_reason=reason) == 0
            assert value(before, "drafter_up") == 1
            assert ("process_cpu_seconds_total", ()) in before
            assert ("python_gc_collections_total", (("generation", "2"),)) in before

            # Hold the engine at the first decode forward of a streamed request, then send the
            # rest: 1 running (its prompt in the KV cache) and 5 waiting, frozen while we scrape.
            engine = engine_of(v)
            release = hold_after_prefill(engine)
            stream = v.stub.GenerateStream(stream_request(prompts[0], lengths[0]), timeout=WAIT_S)
            first = await stream.read()
            assert first.output.token_ids
            requests = [token_request(p, n) for p, n in zip(prompts[1:], lengths[1:])]
            requests[0].params.stopping.stop_token_ids.append(cached_reference(tuple(prompts[1]), lengths[1])[5])
            tasks = [asyncio.ensure_future(v.stub.Generate(r, timeout=WAIT_S)) for r in requests]
            try:
                await wait_until(lambda: engine.scheduler.num_waiting == 5, "5 requests waiting", *tasks)
                during = await scrape(v)
            finally:
                release()
            assert value(during, "num_requests_running") == 1
            assert value(during, "num_requests_waiting") == 5
            assert value(during, "kv_cache_usage_perc") == pytest.approx(engine.scheduler.kv_usage())
            assert value(during, "kv_cache_usage_perc") > 0
            assert value(during, "time_to_first_token_seconds_count") == 1
            assert value(during, "prompt_tokens_total") == len(prompts[0])
            assert value(during, "generation_tokens_total") == len(first.output.token_ids)
            responses = [await _rest_of_stream(stream, first), *await asyncio.gather(*tasks)]

            after = await scrape(v)
            stats = [r.output.stats for r in responses]
            assert sum(s.num_accepted_tokens for s in stats) > 0, "the n-gram drafts should be accepted"
            assert value(after, "spec_decode_num_drafts_total") == sum(s.num_drafts for s in stats)
            assert value(after, "spec_decode_num_draft_tokens_total") == sum(s.num_draft_tokens for s in stats)
            assert value(after, "spec_decode_num_accepted_tokens_total") == sum(s.num_accepted_tokens for s in stats)
            # The in-process n-gram drafter drafts token trees: every node counted, depth in draft tokens.
            assert value(after, "spec_decode_num_draft_nodes_total") == sum(s.num_draft_nodes for s in stats)
            assert sum(s.num_draft_nodes for s in stats) > sum(s.num_draft_tokens for s in stats)
            expected_pos = {pos: 0 for pos in range(max_draft_len)}
            for s in stats:
                for pos, n in enumerate(s.num_accepted_tokens_per_pos):
                    expected_pos[pos] += n
            assert per_pos(after) == expected_pos
            assert value(after, "spec_decode_auto_disabled_total") == 0

            # Requests: reasons, token counts, one latency sample per finished request.
            reasons = [r.output.finish_reason for r in responses]
            assert reasons.count(verifier_pb2.FINISH_REASON_STOP) == 1
            assert value(after, "request_success_total", finished_reason="stop") == 1
            assert value(after, "request_success_total", finished_reason="length") == 5
            assert value(after, "request_success_total", finished_reason="abort") == 0
            generated = [len(r.output.token_ids) for r in responses]
            assert value(after, "generation_tokens_total") == sum(generated)
            assert value(after, "prompt_tokens_total") == sum(len(p) for p in prompts)
            assert value(after, "e2e_request_latency_seconds_count") == len(prompts)
            assert value(after, "e2e_request_latency_seconds_sum") > 0
            assert value(after, "time_to_first_token_seconds_count") == len(prompts)
            # Each request waited for its slot before its first token: 5 of them behind the held one.
            assert value(after, "request_queue_time_seconds_count") == len(prompts)
            assert 0 < value(after, "request_queue_time_seconds_sum") <= value(after, "time_to_first_token_seconds_sum")
            assert value(during, "request_queue_time_seconds_count") == 1
            assert value(after, "time_per_output_token_seconds_count") == sum(1 for n in generated if n > 1)
            assert value(after, "request_prompt_tokens_sum") == sum(len(p) for p in prompts)
            assert value(after, "request_generation_tokens_sum") == sum(generated)
            assert value(after, "request_generation_tokens_count") == len(prompts)

            # Drafter calls: the in-process n-gram drafter, one call per decode step that drafted.
            client = engine.drafter
            assert client.stats.calls > 0
            assert value(after, "drafter_call_latency_seconds_count") == client.stats.calls
            assert value(after, "drafter_call_failures_total") == 0
            assert value(after, "drafter_resyncs_total") == client.stats.resyncs

            # Everything finished: nothing running, waiting or held in the KV cache.
            for name in GAUGES:
                assert value(after, name) == 0, name

    asyncio.run(main())


async def _rest_of_stream(call, first):  # noqa: ANN001, ANN202
    """A GenerateStream folded into one response-like object (text dropped)."""
    ids, last = list(first.output.token_ids), first
    while (msg := await call.read()) is not grpc.aio.EOF:
        ids.extend(msg.output.token_ids)
        last = msg
    return verifier_pb2.GenerateResponse(output=verifier_pb2.GenerationOutput(
        token_ids=ids, finish_reason=last.output.finish_reason, stats=last.output.stats))


def test_drafter_failures_are_counted_and_requests_still_succeed():
    async def main() -> None:
        spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{free_port()}", deadline_ms=200)
        async with run_verifier(spec, model=shared_model(), metrics_port=0) as v:
            prompts = [repetitive_prompt(seed) for seed in LOOPING_SEEDS[:3]]
            responses = await asyncio.gather(*(v.stub.Generate(token_request(p, 12), timeout=WAIT_S)
                                               for p in prompts))
            assert all(len(r.output.token_ids) == 12 for r in responses)
            samples = await scrape(v)
            client = engine_of(v).drafter
            assert client.stats.failures > 0
            assert value(samples, "drafter_call_failures_total") == client.stats.failures
            assert value(samples, "drafter_call_latency_seconds_count") == client.stats.calls
            assert value(samples, "drafter_calls_skipped_total") == client.stats.skipped
            assert value(samples, "drafter_up") == (1 if client.healthy else 0)
            assert value(samples, "spec_decode_num_draft_tokens_total") == 0
            assert value(samples, "request_success_total", finished_reason="length") == 3
            assert value(samples, "request_success_total", finished_reason="error") == 0

    asyncio.run(main())


def test_auto_disabled_requests_are_counted_once():
    """A drafter that is always wrong for one request and right for the other (an oracle
    via the n-gram drafter would depend on the model): the wrong one is disabled."""
    from verifier_support import OracleDrafter, serve_drafter

    n = 30
    prompts = [repetitive_prompt(seed) for seed in LOOPING_SEEDS[:2]]
    refs = {tuple(p): list(cached_reference(tuple(p), n)) for p in prompts}
    oracle = OracleDrafter(refs, corrupt_by_prompt={tuple(prompts[0]): 1.0, tuple(prompts[1]): 0.0})

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000,
                               autoDisable={"windowTokens": 8, "minAcceptanceRate": 0.5})
            async with run_verifier(spec, model=shared_model(), metrics_port=0) as v:
                bad, good = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n),
                                                                     timeout=WAIT_S) for p in prompts])
                assert bad.output.stats.auto_disabled and not good.output.stats.auto_disabled
                samples = await scrape(v)
                assert value(samples, "spec_decode_auto_disabled_total") == 1
                assert value(samples, "spec_decode_num_draft_tokens_total") == (
                    bad.output.stats.num_draft_tokens + good.output.stats.num_draft_tokens)
                assert value(samples, "spec_decode_num_accepted_tokens_total") == good.output.stats.num_accepted_tokens

    asyncio.run(main())


def test_cancelled_stream_counts_as_abort():
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), metrics_port=0) as v:
            engine = engine_of(v)
            release = hold_after_prefill(engine)  # the request cannot finish before it is cancelled
            try:
                call = v.stub.GenerateStream(stream_request(repetitive_prompt(LOOPING_SEEDS[0]), 200),
                                             timeout=WAIT_S)
                first = await call.read()
                assert first.output.token_ids
                call.cancel()
                registry = v.running.metrics.registry
                await wait_until(lambda: registry.get_sample_value(
                    "splitspec:request_success_total", {"finished_reason": "abort"}) == 1, "the abort")
            finally:
                release()
            samples = await scrape(v)
            assert value(samples, "request_success_total", finished_reason="abort") == 1
            assert value(samples, "request_success_total", finished_reason="length") == 0
            assert value(samples, "e2e_request_latency_seconds_count") == 0  # only finished requests
            assert value(samples, "time_to_first_token_seconds_count") == 1
            await wait_until(lambda: engine.scheduler.num_running == 0, "the cancelled sequence to leave")
            assert value(await scrape(v), "kv_cache_usage_perc") == 0

    asyncio.run(main())


def test_every_call_and_http_response_is_counted_by_its_final_status():
    """Refusals included: what the request metrics, of requests that started, cannot show."""
    token = (("authorization", "Bearer s3cret"),)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), metrics_port=0,
                                auth_token="s3cret") as v:
            stub = v.stub
            await stub.Generate(token_request([5, 6, 7], 3), metadata=token, timeout=WAIT_S)
            async for _ in stub.GenerateStream(stream_request([5, 6, 7], 3), metadata=token, timeout=WAIT_S):
                pass
            for call, code in ((stub.Generate(token_request([], 3), metadata=token), "INVALID_ARGUMENT"),
                               (stub.Tokenize(verifier_pb2.TokenizeRequest(prompt="hi")), "UNAUTHENTICATED")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code().name == code
            engine = engine_of(v)
            release = hold_after_prefill(engine)  # the stream cannot end before the client leaves it
            try:
                stream = stub.GenerateStream(stream_request(repetitive_prompt(LOOPING_SEEDS[0]), 200),
                                             metadata=token, timeout=WAIT_S)
                await stream.read()
                stream.cancel()
                await wait_until(lambda: v.running.metrics.registry.get_sample_value(
                    "splitspec:grpc_requests_total", {"method": "GenerateStream", "code": "CANCELLED"}) == 1,
                    "the cancelled stream counted")
            finally:
                release()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{v.running.http_port}", timeout=WAIT_S,
                                         headers={"authorization": "Bearer s3cret"}) as http:
                assert (await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
                assert (await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})).status_code == 400
                assert (await http.get("/v1/conversations/conv_1")).status_code == 404
                assert (await http.get("/v1/nowhere")).status_code == 404
                assert (await http.get("/v1/models", headers={"authorization": "Bearer wrong"})).status_code == 401
            samples = await scrape(v)
        grpc_counts = {(dict(labels)["method"], dict(labels)["code"]): n for (name, labels), n in samples.items()
                       if name == "splitspec:grpc_requests_total"}
        assert grpc_counts == {("Generate", "OK"): 1, ("GenerateStream", "OK"): 1, ("Generate", "INVALID_ARGUMENT"): 1,
                               ("Tokenize", "UNAUTHENTICATED"): 1, ("GenerateStream", "CANCELLED"): 1}
        http_counts = {tuple(dict(labels)[k] for k in ("handler", "method", "status")): n
                       for (name, labels), n in samples.items() if name == "splitspec:http_requests_total"}
        assert http_counts == {("/v1/completions", "POST", "200"): 1, ("/v1/completions", "POST", "400"): 1,
                               ("/v1/conversations/{conversation_id}", "GET", "404"): 1,
                               ("unmatched", "GET", "404"): 1, ("/v1/models", "GET", "401"): 1}

    asyncio.run(main())


def test_each_verifier_has_its_own_registry_and_none_where_metrics_are_off():
    """Without --metrics-port there is no metrics port; the registry is kept for the stats lines (stats_log.py),
    and served at the HTTP API's /metrics as vLLM serves it, unless the stats lines are off too."""
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), metrics_port=0) as one, \
                run_verifier(spec_config("NGRAM", 4), model=shared_model(), metrics_port=0) as two, \
                run_verifier(spec_config("NGRAM", 4), model=shared_model(), log_stats_interval_s=0) as off, \
                run_verifier(spec_config("NGRAM", 4), model=shared_model()) as logged:
            assert one.running.metrics_port != two.running.metrics_port
            await one.stub.Generate(token_request(repetitive_prompt(LOOPING_SEEDS[0]), 8), timeout=WAIT_S)
            await off.stub.Generate(token_request(repetitive_prompt(LOOPING_SEEDS[0]), 8), timeout=WAIT_S)
            assert value(await scrape(one), "generation_tokens_total") == 8
            assert value(await scrape(two), "generation_tokens_total") == 0
            assert off.running.metrics_port is None and off.running.metrics is None
            assert engine_of(off).metrics is None
            assert logged.running.metrics_port is None and engine_of(logged).metrics is logged.running.metrics
            await logged.stub.Generate(token_request(repetitive_prompt(LOOPING_SEEDS[0]), 5), timeout=WAIT_S)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{logged.running.http_port}") as http:
                served = await http.get("/metrics")
                assert served.status_code == 200 and "splitspec:generation_tokens_total 5.0" in served.text
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{off.running.http_port}") as http:
                none = await http.get("/metrics")  # none kept
                assert none.status_code == 404 and "--disable-log-stats" in none.json()["error"]["message"]
            port = one.running.metrics_port
        assert one.running.metrics_port is None
        with pytest.raises(OSError):  # the endpoint closed with its server
            scrape_sync(port)

    asyncio.run(main())


def test_metrics_port_flag():
    assert settings_from_args(parser().parse_args([])).metrics_port is None
    assert settings_from_args(parser().parse_args(["--metrics-port", "0"])).metrics_port == 0
    assert settings_from_args(parser().parse_args(["--metrics-port", "9090"])).metrics_port == 9090


def test_metrics_endpoint_up_while_the_model_loads():
    """Kubernetes scrapes from pod start: /metrics answers before a model is attached."""
    from verifier_service.api.server import start_server
    from verifier_service.settings import ServerSettings

    async def main() -> None:
        running = await start_server(ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=None))
        try:
            samples = await asyncio.to_thread(scrape_sync, running.metrics_port)
            assert value(samples, "num_requests_running") == 0
            assert value(samples, "spec_decode_num_drafts_total") == 0
            assert ("splitspec:drafter_up", ()) not in samples  # no drafter known yet
        finally:
            await running.stop(0)

    asyncio.run(main())


# The Accept headers of Prometheus 2 (OpenMetrics first) and Prometheus 3 (with UTF-8 names allowed).
SCRAPER_ACCEPTS = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,text/plain;version=1.0.0;escaping=allow-utf-8;"
    "q=0.9,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    None,
)


def test_metric_names_are_the_same_whatever_format_the_scraper_prefers():
    """Asked for OpenMetrics, as Prometheus 2 asks, prometheus_client would write `splitspec_...` samples
    under `splitspec:...` types (prometheus/client_python#1177): /metrics answers the text format to
    every scraper, each name as registered."""
    from verifier_service.api.server import start_server
    from verifier_service.settings import ServerSettings

    def get(port: int, accept: str | None) -> tuple[str, str]:
        headers = {"Accept": accept} if accept else {}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.headers["Content-Type"], response.read().decode()

    async def main() -> None:
        running = await start_server(ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=None))
        try:
            for accept in SCRAPER_ACCEPTS:
                content_type, body = await asyncio.to_thread(get, running.metrics_port, accept)
                assert content_type == "text/plain; version=0.0.4; charset=utf-8", accept
                samples = [line.split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")]
                assert "splitspec:spec_decode_num_drafts_total" in samples, accept
                assert not [n for n in samples if n.startswith("splitspec_")], accept
        finally:
            await running.stop(0)

    asyncio.run(main())


def test_busy_metrics_port_fails_start_up():
    """A metrics port already taken fails start-up, naming it, before gRPC listens."""
    from verifier_service.api.server import start_server
    from verifier_service.settings import ServerSettings

    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port} \\(metrics\\)"):
                await start_server(ServerSettings(host="127.0.0.1", port=0, http_port=None, metrics_port=port))

    asyncio.run(main())



def test_scrape_time_reads_survive_concurrent_changes():
    """The KV usage is read on the HTTP thread while the event loop admits and finishes sequences."""
    from verifier_service.engine.scheduler import Scheduler
    from verifier_service.model.kv_cache import KVCache, KVCacheShape
    from verifier_service.spec_decode.policy import SpeculationPolicy

    kv = KVCache(KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=2, num_slots=8, capacity=64),
                 torch.float32, torch.device("cpu"))
    scheduler = Scheduler(kv, SpeculationPolicy(max_draft_len=0), max_num_seqs=8, max_queue_len=8, max_model_len=60)
    seqs = [SimpleNamespace(num_cached_tokens=n) for n in range(1, 9)]
    stop, reads, errors = threading.Event(), [], []

    def scrape_loop() -> None:
        while not stop.is_set():
            try:
                reads.append(scheduler.kv_usage())
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)

    scraper = threading.Thread(target=scrape_loop)
    scraper.start()
    for _ in range(2000):
        scheduler.running.extend(seqs)
        del scheduler.running[:]
    stop.set()
    scraper.join()
    assert not errors and reads and all(0 <= r <= 1 for r in reads)


def test_a_refused_call_is_counted_by_the_time_its_client_has_its_status():
    """abort() sends the status before it raises: counted after it, a call was missing from the counter that a
    client on the same loop read at once (4-16 times in 200 refusals)."""
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), metrics_port=0) as v:
            registry = v.running.metrics.registry
            for refused in range(1, 301):
                with pytest.raises(grpc.aio.AioRpcError):
                    await v.stub.Generate(token_request([], 3), timeout=WAIT_S)
                assert registry.get_sample_value("splitspec:grpc_requests_total", {
                    "method": "Generate", "code": "INVALID_ARGUMENT"}) == refused

    asyncio.run(main())
