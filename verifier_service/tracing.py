"""Request traces over OpenTelemetry (vLLM's --otlp-traces-endpoint).

Each request is one `llm_request` span (SERVER), as vLLM records it: from its arrival to its end, under
the trace its caller named (a W3C `traceparent` header over HTTP, gRPC metadata of the same name), so a
request shows up inside the trace of whatever called the verifier. Its attributes are vLLM's GenAI ones
(ids: `gen_ai.request.id` is the id the caller knows, its X-Request-Id, and `splitspec.sequence_id` the
one drafters see; sampling, token counts, queue time, time to first token, end-to-end latency) and what only a
speculating server knows: drafts, draft tokens, accepted tokens, acceptance length, drafter failures,
prompt tokens the prefix cache supplied. Metadata only, as in vLLM: no prompt or generated text.

The same attributes are what --enable-log-requests logs of each request (`request_attributes`).

Spans are exported in batches from the SDK's own thread, so a slow or absent collector costs no request
anything (its exports time out and are dropped); at shutdown what is left is flushed, for at most
EXPORT_TIMEOUT_S. A plain `http://` endpoint is spoken to without TLS, `https://` with it, as OTLP does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from verifier_service.engine.sequence import Sequence
from verifier_service.metrics import RequestTimer

SPAN_NAME = "llm_request"
EXPORT_TIMEOUT_S = 5.0
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class Arrival:
    """When a request arrived (perf_counter), the trace its caller named, if any, and the id it goes by."""

    at: float = field(default_factory=time.perf_counter)
    trace: Context | None = None
    # The caller's (GenerationParams.request_id, else an x-request-id header or metadata), else a fresh one.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def now(cls, headers: Iterable[tuple[str, str]] = (), request_id: str = "") -> Arrival:
        """`headers`: the request's HTTP headers or gRPC metadata, read for `traceparent`, `tracestate` and
        `x-request-id`; `request_id`: an id the request's body gives, which comes first."""
        carrier: dict[str, str] = {}
        for name, value in headers:  # a header sent twice: its first value, as request_ids.py takes it
            if name.lower() in ("traceparent", "tracestate", "x-request-id"):
                carrier.setdefault(name.lower(), value)
        trace = _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None
        return cls(trace=trace, request_id=request_id or carrier.get("x-request-id") or uuid.uuid4().hex)


Attributes = dict[str, str | int | float | bool]


def request_attributes(seq: Sequence, arrival: Arrival, timer: RequestTimer, reason: str, model_name: str,
                       ended_at: float) -> Attributes:
    """What is recorded of a request that ended at `ended_at` (perf_counter; `reason`: stop, length, abort or
    error): vLLM's GenAI attributes and splitspec's, metadata only."""
    sampling, stats = seq.sampling, seq.stats
    attributes: Attributes = {
        "gen_ai.request.id": arrival.request_id, "splitspec.sequence_id": seq.request_id,
        "gen_ai.response.model": model_name,
        "gen_ai.request.max_tokens": seq.stopping.max_new_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p, "gen_ai.usage.prompt_tokens": len(seq.prompt_ids),
        "gen_ai.usage.completion_tokens": len(seq.output_ids), "gen_ai.latency.e2e": ended_at - arrival.at,
        "splitspec.finish_reason": reason, "splitspec.cached_prompt_tokens": seq.cached_prompt_tokens,
        "splitspec.priority": seq.priority, "splitspec.num_preemptions": seq.num_preemptions,
        "splitspec.speculation.num_steps": stats.num_steps, "splitspec.speculation.num_drafts": stats.num_drafts,
        "splitspec.speculation.num_draft_tokens": stats.num_draft_tokens,
        "splitspec.speculation.num_accepted_tokens": stats.num_accepted_tokens,
        "splitspec.speculation.mean_acceptance_length": stats.mean_acceptance_length,
        "splitspec.speculation.num_drafter_failures": stats.num_drafter_failures,
        "splitspec.speculation.drafter_wait_s": stats.drafter_wait_s}
    if seq.admitted_at is not None:
        attributes["gen_ai.latency.time_in_queue"] = timer.time_in_queue(seq.admitted_at)
    if timer.time_to_first_token is not None:
        attributes["gen_ai.latency.time_to_first_token"] = timer.time_to_first_token
    return attributes


class RequestTracer:
    """Exports one span per request to an OTLP/gRPC collector at `endpoint`."""

    def __init__(self, endpoint: str) -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": "splitspec-verifier"}))
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        self._tracer = self._provider.get_tracer("splitspec.verifier")

    def record(self, attributes: Attributes, arrival: Arrival, ended_at: float) -> None:
        """The span of a request that ended at `ended_at` (perf_counter), with its `request_attributes`."""
        now_ns, now = time.time_ns(), time.perf_counter()

        def wall_ns(at: float) -> int:  # a perf_counter instant on the span's clock
            return now_ns - int((now - at) * 1e9)

        span = self._tracer.start_span(SPAN_NAME, context=arrival.trace, kind=SpanKind.SERVER,
                                       start_time=wall_ns(arrival.at), attributes=attributes)
        if attributes["splitspec.finish_reason"] == "error":
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=wall_ns(ended_at))

    def shutdown(self) -> None:
        """Flush what is left (for at most EXPORT_TIMEOUT_S) and stop exporting."""
        self._provider.shutdown()
