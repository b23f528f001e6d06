"""Speculation policy: per-request draft caps, a draft-length schedule by batch size,
and per-request acceptance-based auto-disable (window, threshold, probes), so a
drafter that does not help costs little."""

from __future__ import annotations

import asyncio
import collections
import functools

from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    EngineSpy,
    OracleDrafter,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
)

from drafter_sdk.proto import verifier_pb2

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:4]]


def oracle_for(prompts, lengths, **kwargs) -> tuple[OracleDrafter, list[list[int]]]:  # noqa: ANN001
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(prompts, lengths)]
    return OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, **kwargs), refs


def capped(prompt: list[int], n: int, cap: int | None = None) -> verifier_pb2.GenerateRequest:
    spec = verifier_pb2.SpeculationOverrides()
    if cap is not None:
        spec.max_draft_len = cap
    return token_request(prompt, n, speculation=spec)


def test_per_request_max_draft_len_caps_within_the_server_limit() -> None:
    n = 16
    oracle, refs = oracle_for(PROMPTS[:1], [n], corrupt=0.0)

    async def main() -> dict[int | None, list[int]]:
        seen: dict[int | None, list[int]] = {}
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                for cap in (None, 1, 3, 10, 0):
                    before = len(oracle.calls)
                    r = await v.stub.Generate(capped(PROMPTS[0], n, cap), timeout=WAIT_S)
                    assert list(r.output.token_ids) == refs[0]
                    seen[cap] = [c.draft_lens[0] for c in oracle.calls[before:]]
        return seen

    seen = asyncio.run(main())
    # Drafts shrink only near the end, where fewer tokens are still wanted.
    assert seen[None][0] == 4 and max(seen[None]) == 4
    assert seen[1] and set(seen[1]) == {1}
    assert seen[3][0] == 3 and max(seen[3]) == 3
    assert seen[10][0] == 4 and max(seen[10]) == 4, "a request may not draft beyond the server's max_draft_len"
    assert seen[0] == [], "max_draft_len 0 still called the drafter"


def test_draft_length_schedule_by_batch_size() -> None:
    lengths = [10, 22, 34]
    prompts = PROMPTS[:3]
    # Rules out of order on purpose: the policy orders them by max_batch_size.
    schedules = {
        "with-zero": [{"maxBatchSize": 3, "draftLen": 0}, {"maxBatchSize": 1, "draftLen": 4},
                      {"maxBatchSize": 2, "draftLen": 2}],
        "beyond-last": [{"maxBatchSize": 1, "draftLen": 4}, {"maxBatchSize": 2, "draftLen": 1}],
    }

    async def run(schedule) -> tuple[dict[int, set[int]], list[int]]:  # noqa: ANN001
        oracle, refs = oracle_for(prompts, lengths, corrupt=0.0)
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000,
                               draftLenSchedule=schedule)
            async with run_verifier(spec, model=shared_model()) as v:
                spy = EngineSpy(engine_of(v))
                calls = [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
                         for p, n in zip(prompts, lengths)]
                responses = await run_together(v, calls, spy)
        for r, ref in zip(responses, refs):
            assert list(r.output.token_ids) == ref
        by_size: dict[int, set[int]] = collections.defaultdict(set)
        for call in oracle.calls:  # draft lengths asked, by the batch size of the step
            by_size[len(call.request_ids)].update(call.draft_lens)
        rows = [s.forwards[-1][0] for s in spy.steps if s.forwards and not s.prefills]
        return by_size, rows

    by_size, rows = asyncio.run(run(schedules["with-zero"]))
    assert 3 in rows, "the three requests never decoded together"
    assert 3 not in by_size, "batches of 3 draft 0 tokens: the drafter must not be called"
    assert max(by_size[2]) == 2 and max(by_size[1]) == 4
    by_size, rows = asyncio.run(run(schedules["beyond-last"]))
    assert by_size[3] - {0} == {1} and max(by_size[2]) == 1 and max(by_size[1]) == 4  # 0: a request at its end


def test_auto_disable_is_per_request_and_stops_calling_a_useless_drafter() -> None:
    """In one batch, a request whose drafts are always wrong stops drafting after
    its window; its neighbour with good drafts keeps drafting. Once no request
    drafts, the drafter is not called at all."""
    n = 30
    prompts = PROMPTS[:2]
    oracle, refs = oracle_for(prompts, [n, n], corrupt_by_prompt={tuple(prompts[0]): 1.0, tuple(prompts[1]): 0.0})
    auto = {"autoDisable": {"windowTokens": 8, "minAcceptanceRate": 0.5}}

    async def main() -> None:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000,
                               **auto)
            async with run_verifier(spec, model=shared_model()) as v:
                bad, good = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n),
                                                                     timeout=WAIT_S) for p in prompts])
                assert list(bad.output.token_ids) == refs[0] and list(good.output.token_ids) == refs[1]
                assert bad.output.stats.auto_disabled and not good.output.stats.auto_disabled
                assert bad.output.stats.num_draft_tokens == 8 and bad.output.stats.num_accepted_tokens == 0
                assert good.output.stats.num_accepted_tokens > 8
                # Alone, a useless drafter is consulted for the window and then never again.
                calls = engine_of(v).drafter.stats.calls
                r = await v.stub.Generate(token_request(prompts[0], n), timeout=WAIT_S)
                assert list(r.output.token_ids) == refs[0] and r.output.stats.auto_disabled
                assert engine_of(v).drafter.stats.calls - calls == 2
                assert r.output.stats.num_steps == n - 1  # every decode step still ran, without drafts
        assert not oracle.feedback_errors

    asyncio.run(main())


class TurningDrafter(OracleDrafter):
    """Always wrong for the first `turn` generated tokens, always right after."""

    turn = 12

    def propose(self, r):  # noqa: ANN001, ANN201
        self.corrupt = 1.0 if len(r.tokens) - r.prompt_len < self.turn else 0.0
        return super().propose(r)


def test_auto_disable_probes_and_resumes_when_drafts_pay_again() -> None:
    n = 40
    prompt = PROMPTS[2]
    ref = list(cached_reference(tuple(prompt), n))
    probes = {"autoDisable": {"windowTokens": 4, "minAcceptanceRate": 0.5, "probeIntervalSteps": 5}}

    async def main() -> None:
        for drafter_obj, turns in ((OracleDrafter({tuple(prompt): ref}, corrupt=1.0), False),
                                   (TurningDrafter({tuple(prompt): ref}), True)):
            async with serve_drafter(drafter_obj) as drafter:
                spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}",
                                   deadline_ms=30000, **probes)
                async with run_verifier(spec, model=shared_model()) as v:
                    r = await v.stub.Generate(token_request(prompt, n), timeout=WAIT_S)
            assert list(r.output.token_ids) == ref and r.output.stats.auto_disabled
            calls = drafter_obj.calls
            if not turns:
                # The first draft disables it; then one probe per 5 plain steps, all failing.
                assert r.output.stats.num_accepted_tokens == 0
                assert 3 <= len(calls) <= 2 + r.output.stats.num_steps // 5
            else:
                # A probe after the turn pays: drafting resumes at every step until the end.
                resumed = next(i for i, c in enumerate(calls) if c.drafts[0] and
                               len(c.drafts[0]) == 4 and c.lengths[0] - len(prompt) >= TurningDrafter.turn)
                assert len(calls) - resumed >= 3
                assert all(c.draft_lens[0] > 0 for c in calls[resumed:])
                assert r.output.stats.num_accepted_tokens >= 4 * (len(calls) - resumed - 1)

    asyncio.run(main())
