"""Run a real verifier gRPC server in-process on port 0 around a given model (tiny by default)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch
from google.protobuf import json_format
from tiny_model import tiny_model, tiny_tokenizer
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.proto import speculative_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.api.server import RunningVerifier, attach_model, start_server
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import parse_mode


def spec_config(mode: str = "NONE", max_draft_len: int = 0, drafter_target: str = "",
                deadline_ms: int = 0, **policy: object) -> speculative_pb2.SpeculativeConfig:
    config = speculative_pb2.SpeculativeConfig(mode=parse_mode(mode), max_draft_len=max_draft_len)
    if drafter_target:
        config.user_provided.drafter_target = drafter_target
        if deadline_ms:
            config.user_provided.call_deadline.FromMilliseconds(deadline_ms)
    # Tests pin draft lengths to the cap unless they ask for the adaptive planner.
    config.policy.adaptive_draft_len = False
    if policy:
        json_format.ParseDict(policy, config.policy)
    return config


@dataclass
class VerifierHandle:
    running: RunningVerifier
    stub: verifier_pb2_grpc.VerifierServiceStub
    channel: grpc.aio.Channel
    address: str


@contextlib.asynccontextmanager
async def run_verifier(speculative: speculative_pb2.SpeculativeConfig | None = None,
                       model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                       **settings: object) -> AsyncIterator[VerifierHandle]:
    model = model if model is not None else tiny_model()
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    # The step token budget is pinned (whole prompts of this harness's size in one step) unless a test
    # asks for chunks: derived from a cost curve measured on a busy machine, it would vary run to run.
    options = {"host": "127.0.0.1", "port": 0, "http_port": 0, "max_model_len": 256, "kv_cache_memory_gb": 0.25,
               "grace_period_s": 1.0, "max_num_batched_tokens": 512, **settings}
    running = await start_server(ServerSettings(speculative=speculative or spec_config(), **options))
    try:
        await attach_model(running, model, tokenizer, "tiny")
        address = f"127.0.0.1:{running.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            yield VerifierHandle(running, verifier_pb2_grpc.VerifierServiceStub(channel), channel, address)
    finally:
        await running.stop(0)


def reference_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate(), the ground truth for exactness."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def token_request(ids: list[int], max_new_tokens: int, **fields: object) -> verifier_pb2.GenerateRequest:
    return verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=ids),
                                        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens),
                                        **fields))
