"""VerifierService over gRPC: Generate, GenerateStream and GetServerInfo on a Runtime.

Only reads the runtime: a request is parsed (request_parsing.py), becomes a
Sequence submitted to the engine, and its outputs are relayed as they arrive.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc
import torch

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.api.request_parsing import (
    Limits,
    ParsedRequest,
    RequestError,
    parse,
)
from verifier_service.builder import Runtime
from verifier_service.engine.detokenizer import Detokenizer
from verifier_service.engine.scheduler import QueueFullError
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.metrics import RequestTimer, VerifierMetrics
from verifier_service.spec.policy import SpecState

VERSION = "0.1.0"
FINISH = {FinishReason.STOP: verifier_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: verifier_pb2.FINISH_REASON_LENGTH}
FINISHED_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # metric label; else "abort"


def stats_message(seq: Sequence) -> verifier_pb2.SpeculationStats:
    s = seq.stats
    return verifier_pb2.SpeculationStats(
        num_steps=s.num_steps, num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens, num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
        mean_acceptance_length=s.mean_acceptance_length, acceptance_rate=s.acceptance_rate,
        num_drafter_failures=s.num_drafter_failures, auto_disabled=seq.spec.auto_disabled,
        num_draft_nodes=s.num_draft_nodes)


def new_sequence(rt: Runtime, parsed: ParsedRequest) -> Sequence:
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
        detokenizer=Detokenizer(rt.tokenizer, parsed.stopping.stop), generator=generator)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, metrics: VerifierMetrics | None = None) -> None:
        self.metrics = metrics
        self.runtime: Runtime | None = None
        self.limits: Limits | None = None
        self.failure: str | None = None  # set when a rank of a sharded model failed: nothing more is served

    def attach(self, rt: Runtime) -> None:
        """Serve this runtime from now on."""
        self.limits = Limits.of(rt)
        self.runtime = rt

    def fail(self, reason: str) -> None:
        """A rank of the sharded model failed and the verifier is about to exit: every request in
        flight, and every new one, gets UNAVAILABLE (a client may retry on a restarted verifier)."""
        self.failure = f"the verifier lost a tensor-parallel rank and is restarting ({reason}); retry"
        if self.runtime is not None:
            scheduler = self.runtime.engine.scheduler
            for seq in [*scheduler.running, *scheduler.waiting]:
                seq.outputs.put_nowait(Output([], "", error=self.failure))

    async def _start(self, params: verifier_pb2.GenerationParams,
                     context: grpc.aio.ServicerContext) -> tuple[Runtime, Sequence]:
        rt, limits = self.runtime, self.limits
        if self.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        if rt is None or limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        try:
            seq = new_sequence(rt, parse(params, rt.tokenizer, limits))
            rt.engine.submit(seq)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return rt, seq

    async def _outputs(self, rt: Runtime, seq: Sequence, context: grpc.aio.ServicerContext,
                       arrival: float) -> AsyncIterator[Output]:
        timer = RequestTimer(self.metrics, len(seq.prompt_ids), arrival) if self.metrics is not None else None
        reason = "abort"
        try:
            while True:
                out = await seq.outputs.get()
                if out.error:
                    reason = "error"
                    if self.failure is not None:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
                    await context.abort(grpc.StatusCode.INTERNAL, out.error)
                if timer is not None:
                    timer.tokens(len(out.token_ids))
                if out.finish_reason is not None:
                    reason = FINISHED_REASON.get(out.finish_reason, "abort")
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            # Client cancelled or disconnected: free the sequence at the next step.
            rt.engine.cancel(seq)
            if timer is not None:
                timer.finish(reason)

    async def Generate(self, request: verifier_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> verifier_pb2.GenerateResponse:
        arrival = time.perf_counter()
        rt, seq = await self._start(request.params, context)
        text: list[str] = []
        async for out in self._outputs(rt, seq, context, arrival):
            text.append(out.text)
        return verifier_pb2.GenerateResponse(output=verifier_pb2.GenerationOutput(
            request_id=request.params.request_id or seq.request_id, text="".join(text), token_ids=seq.output_ids,
            finish_reason=FINISH[seq.finish_reason], stop_reason=seq.stop_reason,
            prompt_tokens=len(seq.prompt_ids), stats=stats_message(seq)))

    async def GenerateStream(self, request: verifier_pb2.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.GenerateStreamResponse]:
        arrival = time.perf_counter()
        rt, seq = await self._start(request.params, context)
        request_id = request.params.request_id or seq.request_id
        async for out in self._outputs(rt, seq, context, arrival):
            chunk = verifier_pb2.GenerationOutput(request_id=request_id, text=out.text, token_ids=out.token_ids)
            if out.finish_reason is not None:
                chunk.finish_reason = FINISH[out.finish_reason]
                chunk.stop_reason = out.stop_reason
                chunk.prompt_tokens = len(seq.prompt_ids)
                chunk.stats.CopyFrom(stats_message(seq))
            elif not out.text and not out.token_ids:
                continue
            yield verifier_pb2.GenerateStreamResponse(output=chunk)

    async def GetServerInfo(self, request: verifier_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> verifier_pb2.GetServerInfoResponse:
        rt = self.runtime
        if rt is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        runner, scheduler = rt.engine.runner, rt.engine.scheduler
        return verifier_pb2.GetServerInfoResponse(
            model=rt.model_name, tokenizer=getattr(rt.tokenizer, "name_or_path", "") or rt.model_name,
            vocab_size=rt.vocab_size, max_model_len=rt.max_model_len,
            max_num_seqs=scheduler.max_num_seqs, max_queue_len=scheduler.max_queue_len,
            default_max_new_tokens=rt.settings.default_max_new_tokens, speculative_config=rt.settings.speculative,
            drafter=_drafter_health(rt), verifier_id=rt.verifier_id, version=VERSION,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            tensor_parallel_size=rt.settings.tensor_parallel_size)


def _drafter_health(rt: Runtime) -> verifier_pb2.DrafterHealth:
    client = rt.drafter
    if client is None:
        return verifier_pb2.DrafterHealth(state=verifier_pb2.DRAFTER_STATE_NOT_CONFIGURED)
    info = client.info
    return verifier_pb2.DrafterHealth(
        state=verifier_pb2.DRAFTER_STATE_HEALTHY if client.healthy else verifier_pb2.DRAFTER_STATE_UNAVAILABLE,
        target=client.transport.target, name=info.name if info else "", version=info.version if info else "",
        calls=client.stats.calls, failures=client.stats.failures, last_error=client.stats.last_error)
