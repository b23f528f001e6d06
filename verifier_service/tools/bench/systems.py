"""The systems compared: our verifier (plain, in-process n-gram, remote n-gram) and transformers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import torch
from transformers import PreTrainedModel

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.tools.bench.workloads import Prompt


@dataclass
class Run:
    token_ids: list[int]
    seconds: float  # whole request
    decode_seconds: float  # after the first token (prefill excluded)
    stats: verifier_pb2.SpeculationStats = field(default_factory=verifier_pb2.SpeculationStats)


class VerifierSystem:
    """A running verifier; `speculate=False` sends the per-request override that disables drafting."""

    def __init__(self, name: str, address: str, speculate: bool) -> None:
        self.name = name
        self.speculate = speculate
        self._channel = grpc.insecure_channel(address)
        self._stub = verifier_pb2_grpc.VerifierServiceStub(self._channel)

    def run(self, prompt: Prompt, max_new_tokens: int) -> Run:
        request = verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
            token_ids=verifier_pb2.TokenIds(ids=prompt.token_ids),
            sampling=verifier_pb2.SamplingParams(temperature=0.0),  # greedy, whatever the model's defaults
            stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens),
            speculation=verifier_pb2.SpeculationOverrides(disable=not self.speculate)))
        tokens: list[int] = []
        started = time.perf_counter()
        first = None
        stats = verifier_pb2.SpeculationStats()
        for message in self._stub.GenerateStream(request, timeout=1800):
            if first is None and message.output.token_ids:
                first = time.perf_counter()
            tokens.extend(message.output.token_ids)
            stats = message.output.stats
        end = time.perf_counter()
        return Run(tokens, end - started, end - (first or end), stats)

    def close(self) -> None:
        self._channel.close()


class TransformersSystem:
    """transformers generate() greedy, optionally with its prompt lookup decoding."""

    def __init__(self, name: str, model: PreTrainedModel, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int = 3) -> None:
        self.name = name
        self.speculate = prompt_lookup_num_tokens is not None
        self._model = model
        self._extra = ({"prompt_lookup_num_tokens": prompt_lookup_num_tokens,
                        "max_matching_ngram_size": max_matching_ngram_size} if self.speculate else {})

    def run(self, prompt: Prompt, max_new_tokens: int) -> Run:
        ids = torch.tensor([prompt.token_ids], device=self._model.device)
        started = time.perf_counter()
        out = self._model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                   attention_mask=torch.ones_like(ids), **self._extra)
        seconds = time.perf_counter() - started
        # generate() streams nothing, so its prefill cannot be split off; decode time is the whole call.
        return Run(out[0, ids.shape[1]:].tolist(), seconds, seconds)

    def close(self) -> None:
        return None
