"""A real verifier (tiny random model) with its HTTP API on port 0, a remote SDK n-gram drafter,
and the official openai client pointed at it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
from tiny_model import tiny_tokenizer
from verifier_harness import VerifierHandle, run_verifier, spec_config
from verifier_support import serve_drafter, shared_model

from drafter_sdk.drafters.ngram import NgramDrafter

WAIT_S = 60.0
# Repetitive text: the n-gram drafter's drafts get accepted.
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The"


@dataclass
class HttpVerifier:
    v: VerifierHandle
    client: openai.AsyncOpenAI

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.v.running.http_port}"

    @property
    def tokenizer(self):  # noqa: ANN201
        return tiny_tokenizer()


@contextlib.asynccontextmanager
async def http_verifier(speculate: bool = True, api_key: str = "unused", **settings: object
                        ) -> AsyncIterator[HttpVerifier]:
    """With `speculate`, a remote SDK n-gram drafter over gRPC drafts up to 4 tokens a step."""
    async with contextlib.AsyncExitStack() as stack:
        spec = spec_config("NONE")
        if speculate:
            drafter = await stack.enter_async_context(serve_drafter(NgramDrafter(max_matching_ngram_size=2)))
            spec = spec_config("USER_PROVIDED", 4, f"127.0.0.1:{drafter.port}", deadline_ms=5000)
        v = await stack.enter_async_context(run_verifier(spec, model=shared_model(), **settings))
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{v.running.http_port}/v1", api_key=api_key,
                                    max_retries=0, timeout=WAIT_S)
        stack.push_async_callback(client.close)
        yield HttpVerifier(v, client)
