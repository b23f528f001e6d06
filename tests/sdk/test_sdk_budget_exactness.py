"""A drafter evicting sequences mid-generation under its state budget: the verifier resyncs them,
and every output still equals plain greedy decoding."""

from __future__ import annotations

import asyncio

from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import LOOPING_SEEDS, WAIT_S, cached_reference, repetitive_prompt, shared_model

from drafter_sdk import NgramDrafter
from drafter_sdk.server.serve import start_server

# A few KiB: room for about one short sequence and its n-gram pool, so the three below keep
# evicting each other.
BUDGET_MIB = 2.5 / 1024


def test_sequences_evicted_mid_generation_resync_and_outputs_stay_exact() -> None:
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:3]]
    n = 40
    refs = [list(cached_reference(tuple(p), n)) for p in prompts]

    async def main():  # noqa: ANN202
        drafter = await start_server(NgramDrafter(max_draft_len=4), host="127.0.0.1", port=0, grace_period_s=0.0,
                                     max_state_mib=BUDGET_MIB)
        try:
            await drafter.wait_loaded()
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                responses = await asyncio.gather(*[v.stub.Generate(token_request(p, n), timeout=WAIT_S)
                                                   for p in prompts])
            return responses, drafter.servicer.state_stats()
        finally:
            await drafter.stop(0)

    responses, stats = asyncio.run(main())
    for r, ref in zip(responses, refs):
        assert list(r.output.token_ids) == ref
    assert stats.evictions.get("budget", 0) > 0
    assert stats.eviction_resyncs > 0, "no evicted sequence came back"
    assert sum(r.output.stats.num_accepted_tokens for r in responses) > 0, "nothing was drafted and accepted"
