"""VerifierService over gRPC: Generate, GenerateStream, GetServerInfo, Tokenize and Detokenize on a Runtime.

Only reads the runtime: a request is started and its outputs relayed by
generation.py (shared with the HTTP front); this file turns them into messages
and status codes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.api.generation import LOADING, GenerationFailed, Generations, Unavailable
from verifier_service.api.reasoning_split import ThoughtSplit
from verifier_service.api.request_parsing import MAX_REQUEST_ID_CHARS, RequestError
from verifier_service.builder import Runtime
from verifier_service.engine.sampler import TokenLogprob
from verifier_service.engine.scheduler import QueueFullError
from verifier_service.engine.sequence import FinishReason, Output, Sequence
from verifier_service.spec_decode.transport import GrpcTransport
from verifier_service.tracing import Arrival

VERSION = "0.1.0"
FINISH = {FinishReason.STOP: verifier_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: verifier_pb2.FINISH_REASON_LENGTH}


def stats_message(seq: Sequence) -> verifier_pb2.SpeculationStats:
    s = seq.stats
    return verifier_pb2.SpeculationStats(
        num_steps=s.num_steps, num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens, num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
        mean_acceptance_length=s.mean_acceptance_length, acceptance_rate=s.acceptance_rate,
        num_drafter_failures=s.num_drafter_failures, auto_disabled=seq.spec.auto_disabled,
        num_draft_nodes=s.num_draft_nodes, drafter_wait_s=s.drafter_wait_s,
        accepted_prediction_tokens=s.accepted_prediction_tokens,
        rejected_prediction_tokens=s.rejected_prediction_tokens)


def logprob_messages(logprobs: list[TokenLogprob]) -> list[verifier_pb2.TokenLogprob]:
    return [verifier_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                      top=[verifier_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in logprobs]


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, generations: Generations) -> None:
        self.generations = generations

    async def _start(self, params: verifier_pb2.GenerationParams, context: grpc.aio.ServicerContext) -> Sequence:
        async with _refusals_as_statuses(context):
            return await self.generations.start(params)
        raise AssertionError("unreachable: abort raises")

    async def _outputs(self, seq: Sequence, context: grpc.aio.ServicerContext,
                       arrival: Arrival) -> AsyncIterator[Output]:
        try:
            async for out in self.generations.outputs(seq, arrival):
                yield out
        except GenerationFailed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE if exc.unavailable else grpc.StatusCode.INTERNAL, str(exc))

    def _thoughts(self, params: verifier_pb2.GenerationParams, seq: Sequence) -> ThoughtSplit | None:
        """Where the request asked for separate_reasoning (checked: the server has a reasoning parser)."""
        rt = self.generations.runtime
        return ThoughtSplit(rt.reasoning, seq.prompt_ids) if params.separate_reasoning and rt.reasoning else None

    async def Generate(self, request: verifier_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> verifier_pb2.GenerateResponse:
        arrival = await _arrival(request.params, context)
        seq = await self._start(request.params, context)
        text: list[str] = []
        async for out in self._outputs(seq, context, arrival):
            text.append(out.text)
        thoughts = self._thoughts(request.params, seq)
        thought, answer = ("", "".join(text)) if thoughts is None else thoughts.feed("".join(text), final=True)
        return verifier_pb2.GenerateResponse(output=verifier_pb2.GenerationOutput(
            request_id=arrival.request_id, text=answer, reasoning_text=thought,
            token_ids=seq.output_ids, finish_reason=FINISH[seq.finish_reason], stop_reason=seq.stop_reason,
            prompt_tokens=len(seq.prompt_ids), stats=stats_message(seq),
            logprobs=logprob_messages(seq.output_logprobs), drafted=seq.output_drafted,
            cached_prompt_tokens=seq.cached_prompt_tokens, prompt_logprobs=logprob_messages(seq.prompt_token_logprobs)))

    async def GenerateStream(self, request: verifier_pb2.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.GenerateStreamResponse]:
        arrival = await _arrival(request.params, context)
        seq = await self._start(request.params, context)
        thoughts = self._thoughts(request.params, seq)
        async for out in self._outputs(seq, context, arrival):
            thought, answer = ("", out.text) if thoughts is None else thoughts.feed(
                out.text, final=out.finish_reason is not None)
            chunk = verifier_pb2.GenerationOutput(request_id=arrival.request_id, text=answer, reasoning_text=thought,
                                                  token_ids=out.token_ids, logprobs=logprob_messages(out.logprobs),
                                                  drafted=out.drafted,
                                                  prompt_logprobs=logprob_messages(out.prompt_logprobs))
            if out.finish_reason is not None:
                chunk.finish_reason = FINISH[out.finish_reason]
                chunk.stop_reason = out.stop_reason
                chunk.prompt_tokens = len(seq.prompt_ids)
                chunk.cached_prompt_tokens = seq.cached_prompt_tokens
                chunk.stats.CopyFrom(stats_message(seq))
            yield verifier_pb2.GenerateStreamResponse(output=chunk)

    async def Tokenize(self, request: verifier_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> verifier_pb2.TokenizeResponse:
        async with _refusals_as_statuses(context):
            return self.generations.tokenize(request)
        raise AssertionError("unreachable: abort raises")

    async def Detokenize(self, request: verifier_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> verifier_pb2.DetokenizeResponse:
        async with _refusals_as_statuses(context):
            return self.generations.detokenize(request)
        raise AssertionError("unreachable: abort raises")

    async def GetServerInfo(self, request: verifier_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> verifier_pb2.GetServerInfoResponse:
        rt = self.generations.runtime
        if rt is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
        runner, scheduler = rt.engine.runner, rt.engine.scheduler
        return verifier_pb2.GetServerInfoResponse(
            model=rt.model_name, tokenizer=getattr(rt.tokenizer, "name_or_path", "") or rt.model_name,
            vocab_size=rt.vocab_size, max_model_len=rt.max_model_len,
            max_num_seqs=scheduler.max_num_seqs, max_queue_len=scheduler.max_queue_len,
            default_max_new_tokens=rt.default_max_new_tokens or rt.max_model_len,  # none set: the rest of the context
            speculative_config=rt.settings.speculative,
            drafter=_drafter_health(rt), verifier_id=rt.verifier_id, version=VERSION,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            tensor_parallel_size=rt.settings.tensor_parallel_size, tokenizer_fingerprint=rt.tokenizer_fingerprint,
            scheduling_policy=rt.settings.scheduling_policy, reasoning_parser=rt.settings.reasoning_parser or "",
            default_sampling=verifier_pb2.SamplingParams(**rt.sampling_defaults.sampling))


async def _arrival(params: verifier_pb2.GenerationParams, context: grpc.aio.ServicerContext) -> Arrival:
    """The request's arrival, named by its request_id (request_parsing checks it), else its x-request-id
    metadata (a gateway's), checked here."""
    arrival = Arrival.now(context.invocation_metadata() or (), params.request_id)
    if not params.request_id and len(arrival.request_id) > MAX_REQUEST_ID_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the x-request-id metadata is longer than {MAX_REQUEST_ID_CHARS} characters")
    return arrival


@contextlib.asynccontextmanager
async def _refusals_as_statuses(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """A request refused (not served yet, a client mistake, a full queue) ends its call with the status
    that says so."""
    try:
        yield
    except Unavailable as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except RequestError as exc:
        await context.abort(exc.code, exc.message)
    except QueueFullError as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


def _drafter_health(rt: Runtime) -> verifier_pb2.DrafterHealth:
    client = rt.drafter
    if client is None:
        return verifier_pb2.DrafterHealth(state=verifier_pb2.DRAFTER_STATE_NOT_CONFIGURED)
    info = client.info
    state = (verifier_pb2.DRAFTER_STATE_INCOMPATIBLE if client.disabled_reason
             else verifier_pb2.DRAFTER_STATE_HEALTHY if client.healthy else verifier_pb2.DRAFTER_STATE_UNAVAILABLE)
    return verifier_pb2.DrafterHealth(
        state=state, target=client.transport.target, name=info.name if info else "",
        version=info.version if info else "", calls=client.stats.calls, failures=client.stats.failures,
        last_error=client.stats.last_error, disabled_reason=client.disabled_reason,
        draft_stream=isinstance(client.transport, GrpcTransport) and client.transport.streaming)
