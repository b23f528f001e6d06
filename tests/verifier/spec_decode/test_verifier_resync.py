"""The delta/resync protocol seen from the verifier: a drafter restarted
mid-generation (stopped, then a fresh one on the same port) loses every
sequence's context; outputs stay exact, the client counts the resyncs, resends
whole contexts and drafting resumes."""

from __future__ import annotations

import asyncio
import functools

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    OracleDrafter,
    cached_reference,
    engine_of,
    on_loop,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    shared_model,
)

from drafter_sdk.proto import drafter_pb2
from drafter_sdk.server.serve import start_server

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[4:7]]
N = 48


@pytest.mark.parametrize(("overlap", "restart_at", "fail_first"), [(1, 5, False), (8, 12, False), (1, 5, True)],
                         ids=["plain-deltas", "overlapping-deltas", "calls-fail-while-down"])
def test_drafter_restart_mid_generation(overlap: int, restart_at: int, fail_first: bool) -> None:
    refs = [list(cached_reference(tuple(p), N)) for p in PROMPTS]
    references = {tuple(p): r for p, r in zip(PROMPTS, refs)}
    first, second = OracleDrafter(references, corrupt=0.5, seed=1), OracleDrafter(references, corrupt=0.5, seed=2)

    async def main() -> None:
        old = await start_server(first, host="127.0.0.1", port=0, grace_period_s=0.0)
        await old.wait_loaded()
        port = old.port
        spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{port}", deadline_ms=30000)
        spec.user_provided.delta_overlap_steps = overlap
        new = None
        try:
            async with run_verifier(spec, model=shared_model()) as v:
                client = engine_of(v).drafter
                transport = client.transport
                prepare = transport.prepare
                sent: list[drafter_pb2.PrepareDraftTokensRequest] = []
                outcomes: list[str] = []
                test_loop = asyncio.get_running_loop()

                async def start_new() -> None:  # on the test's loop, where the drafter servers run
                    nonlocal new
                    new = await start_server(second, host="127.0.0.1", port=port, grace_period_s=0.0)
                    await new.wait_loaded()

                async def restarting_prepare(request, timeout_s):  # noqa: ANN001, ANN202
                    # On the engine's loop (the model thread), where the drafter channel lives.
                    if len(sent) == restart_at:
                        await on_loop(test_loop, old.stop(0))
                    if len(sent) == restart_at + (2 if fail_first else 0):
                        await on_loop(test_loop, start_new())
                        await transport.ready(WAIT_S)
                    sent.append(request)
                    try:
                        response = await prepare(request, timeout_s)
                    except Exception:
                        outcomes.append("failed")
                        raise
                    outcomes.append("ok")
                    return response

                transport.prepare = restarting_prepare
                responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, N),
                                                                     timeout=WAIT_S) for p in PROMPTS])
                stats = client.stats
        finally:
            await old.stop(0)
            if new is not None:
                await new.stop(0)

        for r, ref in zip(responses, refs):
            assert list(r.output.token_ids) == ref, "a drafter restart changed the output"
        assert len(sent) > restart_at + 3, "generation ended before the restart could matter"
        assert first.calls and second.calls, "the restarted drafter was never reached"
        # Every live sequence got RESYNC_REQUIRED once from the new drafter, then its whole context.
        live = len(sent[restart_at].sequences)
        assert stats.resyncs == live
        if fail_first:
            assert outcomes[restart_at:restart_at + 2] == ["failed", "failed"]
            assert stats.failures == 2 and sum(r.output.stats.num_drafter_failures for r in responses) == 2 * live
        else:
            assert "failed" not in outcomes and stats.failures == 0
        resync_call = restart_at + (2 if fail_first else 0)
        assert all(s.context_len > 0 for s in sent[resync_call].sequences)
        assert all(s.context_len == 0 for s in sent[resync_call + 1].sequences)
        # Drafting resumed on the new drafter: its drafts were accepted.
        assert sum(len(d) for c in second.calls for d in c.drafts) > 0
        assert len(second.accepted_at) > 0 and not second.feedback_errors
        assert not first.feedback_errors

    asyncio.run(main())
