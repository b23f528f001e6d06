"""Request traces (tracing.py, --otlp-traces-endpoint): a real verifier exports one `llm_request` span per
request over OTLP/gRPC to a collector (an in-process OTLP TraceService on port 0), under the trace the caller
named in a `traceparent` header or gRPC metadata, with the token counts, latencies and speculation stats its
answer reports; a request the client abandons is traced too; a collector that is not there costs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import one_torch_thread, repetitive_prompt, shared_model  # noqa: F401 - autouse fixture

from verifier_service.api import cli

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector receives: (service.name, span) for every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 - gRPC's name
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(resource["service.name"], span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.asynccontextmanager
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    server, received = grpc.aio.server(), Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield received, port
    finally:
        await server.stop(0)


def attributes(span: trace_pb2.Span) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def test_each_request_is_a_span_under_its_callers_trace_with_what_its_answer_reports() -> None:
    prompt = repetitive_prompt(48)

    async def main() -> None:
        async with collector() as (received, port):
            async with run_verifier(spec_config("NGRAM", 4), model=shared_model(),
                                    otlp_traces_endpoint=f"http://127.0.0.1:{port}") as v:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{v.running.http_port}", timeout=60) as http:
                    answer = (await http.post("/v1/completions",
                                              headers={"traceparent": TRACEPARENT, "X-Request-Id": "gateway-7"},
                                              json={"prompt": prompt, "max_tokens": 24})).json()
                over_grpc = (await v.stub.Generate(token_request(prompt, 16, request_id="client-3"),
                                                   metadata=(("traceparent", TRACEPARENT),), timeout=60)).output
                untraced = (await v.stub.Generate(token_request(prompt, 8), timeout=60)).output
                stream = v.stub.GenerateStream(token_request(prompt, 200))
                await anext(aiter(stream))  # one output, then the client goes
                stream.cancel()
                await asyncio.sleep(0.5)
            # Stopping the verifier flushed its spans.
            assert {service for service, _ in received.spans} == {"splitspec-verifier"}
            spans = [span for _, span in received.spans]
            assert [s.name for s in spans] == ["llm_request"] * 4
            assert all(s.kind == trace_pb2.Span.SPAN_KIND_SERVER for s in spans)
            by_tokens = {attributes(s)["gen_ai.usage.completion_tokens"]: s for s in spans}
            http_span, grpc_span, root = by_tokens[24], by_tokens[16], by_tokens[8]
            for span in (http_span, grpc_span):  # the caller's trace, under the caller's span
                assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
            assert root.trace_id.hex() != TRACE_ID and not root.parent_span_id  # a trace of its own
            a, g = attributes(http_span), attributes(grpc_span)
            # Named as their callers know them; the id drafters see is another (each sequence's own).
            assert (a["gen_ai.request.id"], answer["id"], g["gen_ai.request.id"]) == ("gateway-7", "cmpl-gateway-7",
                                                                                      "client-3")
            assert len({a["splitspec.sequence_id"], g["splitspec.sequence_id"], "gateway-7", "client-3"}) == 4
            assert attributes(root)["gen_ai.request.id"] == untraced.request_id  # the server's, echoed
            assert a["gen_ai.usage.prompt_tokens"] == answer["usage"]["prompt_tokens"]
            assert a["splitspec.finish_reason"] == "length" and a["gen_ai.request.max_tokens"] == 24
            spec = answer["speculation"]
            assert a["splitspec.speculation.num_drafts"] == spec["num_drafts"] > 0
            assert a["splitspec.speculation.num_accepted_tokens"] == spec["num_accepted_tokens"] > 0
            assert a["splitspec.speculation.mean_acceptance_length"] == spec["mean_acceptance_length"]
            assert 0 < a["splitspec.speculation.drafter_wait_s"] < a["gen_ai.latency.e2e"]  # its steps' calls
            assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
                <= a["gen_ai.latency.e2e"]
            assert abs((http_span.end_time_unix_nano - http_span.start_time_unix_nano) / 1e9
                       - a["gen_ai.latency.e2e"]) < 0.01
            assert g["gen_ai.usage.prompt_tokens"] == over_grpc.prompt_tokens
            assert g["splitspec.speculation.num_accepted_tokens"] == over_grpc.stats.num_accepted_tokens
            assert attributes(root)["gen_ai.usage.completion_tokens"] == len(untraced.token_ids)
            (gone,) = [s for s in spans if attributes(s)["splitspec.finish_reason"] == "abort"]
            assert 0 < attributes(gone)["gen_ai.usage.completion_tokens"] < 200

    asyncio.run(main())


def test_a_collector_that_is_not_there_costs_no_request_anything() -> None:
    async def main() -> None:
        async with collector() as (_, port):
            pass  # the port is closed again: nothing listens there
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as plain:
            want = (await plain.stub.Generate(token_request([5, 6, 7], 16), timeout=60)).output
        async with contextlib.AsyncExitStack() as stack:
            v = await stack.enter_async_context(run_verifier(spec_config("NGRAM", 4), model=shared_model(),
                                                             otlp_traces_endpoint=f"http://127.0.0.1:{port}"))
            got = (await v.stub.Generate(token_request([5, 6, 7], 16), timeout=60)).output
            assert list(got.token_ids) == list(want.token_ids)
            start = time.monotonic()
        assert time.monotonic() - start < 30  # the flush gives up on it (a bound on a hang, not a speed)

    asyncio.run(main())


def test_the_flag_sets_the_endpoint() -> None:
    args = cli.parser().parse_args(["--otlp-traces-endpoint", "http://otel-collector:4317"])
    assert cli.settings_from_args(args).otlp_traces_endpoint == "http://otel-collector:4317"
    assert cli.settings_from_args(cli.parser().parse_args([])).otlp_traces_endpoint is None
