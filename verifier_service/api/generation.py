"""What the gRPC and HTTP fronts share: start a request on the runtime and relay its outputs.

Each front only translates: its own request format into GenerationParams (parsed and
checked by request_parsing.py, so both refuse the same mistakes with the same
messages), and these outputs and exceptions into its own responses and status codes.
The text relayed is the engine's: stop strings never leak and characters never split
(engine/detokenizer.py), whichever front it leaves through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import torch

from drafter_sdk.proto import verifier_pb2
from verifier_service.api.request_parsing import Limits, ParsedRequest, RequestError, in_vocabulary, input_ids, parse
from verifier_service.builder import Runtime
from verifier_service.engine.detokenizer import CONTEXT_TOKENS, Detokenizer
from verifier_service.engine.sequence import FinishReason, Output, Sequence, joined
from verifier_service.engine.structured_output import (
    Constrained,
    ConstraintError,
    ReasoningGate,
    StructuredOutputUnavailable,
)
from verifier_service.metrics import RequestTimer, VerifierMetrics
from verifier_service.spec_decode.policy import SpecState
from verifier_service.spec_decode.prediction import Prediction
from verifier_service.tracing import Arrival, Attributes, RequestTracer, request_attributes

log = logging.getLogger(__name__)

FINISHED_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # metric label; else "abort"
LOADING = "the model is still loading; retry shortly"
DRAINING = "the verifier is shutting down; retry on another replica"


class Unavailable(Exception):
    """Nothing can be served now (loading, draining, or a lost rank): the client may retry."""


class GenerationFailed(Exception):
    """The engine failed a request after it started (`unavailable`: retrying elsewhere may work)."""

    def __init__(self, message: str, unavailable: bool) -> None:
        super().__init__(message)
        self.unavailable = unavailable


def new_sequence(rt: Runtime, parsed: ParsedRequest, grammar: Constrained | None = None) -> Sequence:
    """`grammar`: parsed.constraint compiled (compile_constraint)."""
    generator = None
    if not parsed.sampling.greedy:
        generator = torch.Generator(device=rt.engine.runner.device)
        if parsed.sampling.seed is not None:
            generator.manual_seed(parsed.sampling.seed)
        else:
            generator.seed()
    return Sequence(
        request_id=uuid.uuid4().hex, prompt_ids=parsed.prompt_ids, sampling=parsed.sampling,
        stopping=parsed.stopping, spec=SpecState(parsed.speculation),
        detokenizer=Detokenizer(rt.tokenizer, parsed.stopping.stop, parsed.stopping.min_new_tokens,
                                parsed.stopping.include_stop_str, parsed.skip_special_tokens,
                                context=parsed.prompt_ids[-CONTEXT_TOKENS:]),
        generator=generator, prompt_logprobs=parsed.prompt_logprobs, grammar=grammar, priority=parsed.priority,
        prediction=Prediction(parsed.prediction) if parsed.prediction else None, cache_root=parsed.cache_root)


async def compile_constraint(rt: Runtime, parsed: ParsedRequest) -> Constrained | None:
    """What the request is held to: its structured-output constraint, compiled on a worker thread (llguidance
    lets go of the GIL, and a large schema takes a while: 0.34 s for 5,000 properties here, during which the
    servers keep answering). Under a reasoning parser the constraint holds the answer only, and the thinking
    budget the thinking (ReasoningGate). Raises RequestError."""
    grammar = None
    if parsed.constraint is not None:
        try:
            grammar = await asyncio.to_thread(rt.grammars.compile, parsed.constraint)
        except ConstraintError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except StructuredOutputUnavailable as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    if rt.reasoning is None or (grammar is None and parsed.thinking_budget is None):
        return grammar
    return ReasoningGate(rt.reasoning, rt.reasoning.phase_after(parsed.prompt_ids), rt.vocab_size, grammar,
                         parsed.thinking_budget)


def request_line(a: Attributes) -> str:
    """A request that ended, as --enable-log-requests logs it (the whole of `a` goes along as the record's
    structured fields, which --log-format json writes out)."""
    seconds = {name: a.get(f"gen_ai.latency.{name}") for name in ("time_in_queue", "time_to_first_token", "e2e")}
    queued, first, total = (f"{s:.3f} s" if s is not None else "-" for s in seconds.values())
    return (f"request {a['gen_ai.request.id']} {a['splitspec.finish_reason']}: {a['gen_ai.usage.prompt_tokens']} "
            f"prompt tokens ({a['splitspec.cached_prompt_tokens']} cached), {a['gen_ai.usage.completion_tokens']} "
            f"generated; queued {queued}, first token {first}, total {total}; mean acceptance length "
            f"{a['splitspec.speculation.mean_acceptance_length']:.2f}, drafter wait "
            f"{a['splitspec.speculation.drafter_wait_s']:.3f} s")


class Generations:
    """The runtime as both fronts see it: attached once the model is loaded, failed when a rank is
    lost, draining on shutdown."""

    def __init__(self, metrics: VerifierMetrics | None = None, tracer: RequestTracer | None = None,
                 log_requests: bool = False) -> None:
        self.metrics = metrics
        self.tracer = tracer  # --otlp-traces-endpoint: a span per request
        self.log_requests = log_requests  # --enable-log-requests: a line per request as it ends
        self.runtime: Runtime | None = None
        self.limits: Limits | None = None
        self.failure: str | None = None  # set when a rank of a sharded model failed: nothing more is served
        self.draining = False

    def attach(self, rt: Runtime) -> None:
        """Serve this runtime from now on."""
        self.limits = Limits.of(rt)
        self.runtime = rt

    @property
    def ready(self) -> bool:
        return self.runtime is not None and self.failure is None and not self.draining

    def fail(self, message: str) -> None:
        """The verifier is about to exit (a tensor-parallel rank failed; a drain ended by its grace period or
        a second signal): every request in flight, and every new one, is refused as unavailable with `message` (a
        client may retry on another replica or the restarted verifier)."""
        self.failure = message
        if self.runtime is not None:
            for seq in self.runtime.engine.in_flight():
                seq.outputs.put_nowait(Output([], "", error=self.failure))

    def check_ready(self) -> tuple[Runtime, Limits]:
        """Raises Unavailable unless requests can be started."""
        if self.failure is not None:
            raise Unavailable(self.failure)
        if self.runtime is None or self.limits is None:
            raise Unavailable(LOADING)
        if self.draining:
            raise Unavailable(DRAINING)
        return self.runtime, self.limits

    async def start(self, params: verifier_pb2.GenerationParams, default_max_new_tokens: int | None = None) -> Sequence:
        """Parse, check and submit; `default_max_new_tokens`, a route's own length for a request that sets
        none, caps the server's (as vLLM takes the least of them). Raises Unavailable,
        request_parsing.RequestError or scheduler.QueueFullError."""
        rt, limits = self.check_ready()
        if default_max_new_tokens is not None:
            server = limits.default_max_new_tokens or default_max_new_tokens
            limits = dataclasses.replace(limits, default_max_new_tokens=min(server, default_max_new_tokens))
        parsed = parse(params, rt.tokenizer, limits)
        grammar = await compile_constraint(rt, parsed)
        rt, _ = self.check_ready()  # still serving after the compile
        seq = new_sequence(rt, parsed, grammar)
        rt.engine.submit(seq)
        return seq

    def tokenize(self, request: verifier_pb2.TokenizeRequest) -> verifier_pb2.TokenizeResponse:
        """The ids Generate would start from for the same input; a prompt too long to generate from
        is counted, not refused. Raises Unavailable or request_parsing.RequestError."""
        rt, limits = self.check_ready()
        ids = input_ids(request, rt.tokenizer, limits, fit_context=False)
        return verifier_pb2.TokenizeResponse(
            token_ids=ids, token_strs=rt.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else [],
            max_model_len=limits.max_model_len)

    def detokenize(self, request: verifier_pb2.DetokenizeRequest) -> verifier_pb2.DetokenizeResponse:
        """Raises Unavailable or request_parsing.RequestError (an id outside the vocabulary)."""
        rt, limits = self.check_ready()
        return verifier_pb2.DetokenizeResponse(text=rt.tokenizer.decode(in_vocabulary(request.token_ids, limits)))

    async def outputs(self, seq: Sequence, arrival: Arrival | None = None) -> AsyncIterator[Output]:
        """The sequence's outputs as the engine emits them, empty ones skipped, until the one that
        finishes it. Those that queued while the caller was busy come joined into one: a front that falls
        behind the engine catches up in fewer, larger messages instead of a queue that keeps growing.
        Leaving early (a client gone) cancels it: its KV slot and drafter state are freed at the next step.
        Its metrics, its trace and its log line (--enable-log-requests) are recorded as it ends. Raises
        GenerationFailed."""
        rt = self.runtime
        assert rt is not None
        arrival = arrival or Arrival()
        timer = RequestTimer(self.metrics, len(seq.prompt_ids), arrival.at)
        reason = "abort"
        try:
            while True:
                queued = [await seq.outputs.get()]
                while queued[-1].finish_reason is None and not queued[-1].error and not seq.outputs.empty():
                    queued.append(seq.outputs.get_nowait())
                out = queued[0]
                if len(queued) > 1:
                    out = joined(queued)
                    if self.metrics is not None:
                        self.metrics.outputs_joined.inc(len(queued) - 1)
                if out.error:
                    reason = "error"
                    raise GenerationFailed(self.failure or out.error, self.failure is not None)
                timer.tokens(len(out.token_ids), seq.admitted_at)
                if out.finish_reason is not None:
                    reason = FINISHED_REASON.get(out.finish_reason, "abort")
                    yield out
                    return
                if out.text or out.token_ids:
                    yield out
        finally:
            rt.engine.cancel(seq)
            timer.finish(reason)
            if self.tracer is not None or self.log_requests:
                ended_at = time.perf_counter()
                attributes = request_attributes(seq, arrival, timer, reason, rt.model_name, ended_at)
                if self.tracer is not None:
                    self.tracer.record(attributes, arrival, ended_at)
                if self.log_requests:
                    log.info("%s", request_line(attributes), extra={"structured": {"request": attributes}})
