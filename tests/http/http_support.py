"""A real verifier (tiny random model) with its HTTP API on port 0, a remote SDK n-gram drafter,
and the official openai client pointed at it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
from tiny_model import tiny_tokenizer
from transformers import PreTrainedModel
from verifier_harness import VerifierHandle, run_verifier, spec_config
from verifier_support import serve_drafter, shared_model

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.server.serve import RunningDrafter

WAIT_S = 60.0
# Text on which the tiny random model loops (verifier_support.repetitive_prompt(48), which it tokenizes
# back to the same ids), so the n-gram drafter's drafts get accepted.
PROMPT = "d10 addd10 addd10 addd10 addd10 addd10 add"


@dataclass
class HttpVerifier:
    v: VerifierHandle
    client: openai.AsyncOpenAI
    drafter: RunningDrafter | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.v.running.http_port}"

    @property
    def tokenizer(self):  # noqa: ANN201
        return tiny_tokenizer()

    def idle(self) -> bool:
        """No sequence left in the engine, every KV slot free (or kept idle by the prefix cache, evictable),
        no drafter state held."""
        scheduler = self.v.running.runtime.engine.scheduler
        held = len(self.drafter.servicer.store) if self.drafter is not None else 0
        kv = scheduler.kv_cache
        return (not scheduler.running and not scheduler.waiting
                and kv.num_free_slots + scheduler.prefix_cache.num_idle == kv.shape.num_slots and held == 0)


@contextlib.asynccontextmanager
async def http_verifier(speculate: bool = True, api_key: str = "unused", model: PreTrainedModel | None = None,
                        **settings: object) -> AsyncIterator[HttpVerifier]:
    """With `speculate`, a remote SDK n-gram drafter over gRPC drafts up to 4 tokens a step. `model`: the
    tiny random one unless given."""
    async with contextlib.AsyncExitStack() as stack:
        spec, drafter = spec_config("NONE"), None
        if speculate:
            drafter = await stack.enter_async_context(serve_drafter(NgramDrafter(max_matching_ngram_size=2)))
            spec = spec_config("USER_PROVIDED", 4, f"127.0.0.1:{drafter.port}", deadline_ms=5000)
        v = await stack.enter_async_context(run_verifier(spec, model=model or shared_model(), **settings))
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{v.running.http_port}/v1", api_key=api_key,
                                    max_retries=0, timeout=WAIT_S)
        stack.push_async_callback(client.close)
        yield HttpVerifier(v, client, drafter)


def submitted_priorities(h: HttpVerifier) -> list[int]:
    """The priority of every request the engine takes from now on, in order (its submit wrapped)."""
    engine, seen = h.v.running.runtime.engine, []
    submit = engine.submit
    engine.submit = lambda seq: (seen.append(seq.priority), submit(seq))[-1]
    return seen


async def wait_until(condition, what: str) -> None:  # noqa: ANN001
    """Poll `condition()` (never a timing assertion: WAIT_S only bounds a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        assert loop.time() < deadline, f"still waiting for: {what}"
        await asyncio.sleep(0.02)
