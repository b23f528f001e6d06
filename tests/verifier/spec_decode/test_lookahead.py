"""Drafter calls overlapped with the forward (spec_decode/lookahead.py): with a drafter that looks ahead,
a step whose drafts what is left of the last answer covers sends its call before its forward and
reads the answer after it. Real SDK drafter servers on port 0; every output is plain decoding's,
whatever the lookahead holds, and a call that fails while it is in flight costs only drafts."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
)

from drafter_sdk import LOOKAHEAD, Drafter, DraftRequest
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2
from verifier_service.spec_decode.lookahead import Lookahead, ask, covers

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:8]]
LENGTH = 40


def references() -> list[list[int]]:
    return [list(cached_reference(tuple(p), LENGTH)) for p in PROMPTS]


def test_what_is_left_of_a_lookahead_after_the_tokens_committed_since():
    chain = Lookahead(base=3, tokens=[10, 11, 12, 13, 14])
    assert chain.remaining([1, 2, 3]) == [10, 11, 12, 13, 14]  # nothing generated since
    assert chain.remaining([1, 2, 3, 10, 11]) == [12, 13, 14]  # a token accepted, then the target's own
    assert chain.remaining([1, 2, 3, 10, 11, 12, 13, 14]) == []  # all of it generated
    assert chain.remaining([1, 2, 3, 10, 99]) == []  # the target parted from it
    assert chain.remaining([1, 2]) == []  # shorter than when it was asked: not this sequence's
    assert ask(verify=4, room=100) == 9 and ask(verify=4, room=6) == 6 and ask(verify=0, room=9) == 1


def test_a_step_waits_unless_every_draft_and_every_shadow_is_covered():
    assert covers([[1, 2, 3], [4, 5]], verify=[3, 2], asks=[7, 5])
    assert not covers([[1, 2, 3], [4]], verify=[3, 2], asks=[7, 5])  # one sequence lacks a token
    assert covers([[7]], verify=[0], asks=[8])  # a shadow draft: one token to score
    assert not covers([[]], verify=[0], asks=[8])  # nothing to score: the planner would see only hits
    assert covers([[], [1, 2]], verify=[0, 2], asks=[0, 5])  # asked for nothing: no draft, no shadow


async def one_by_one(v, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    """Batch 1: each request alone, so that every step's drafts are one sequence's."""
    return [list((await v.stub.Generate(token_request(p, LENGTH), timeout=WAIT_S)).output.token_ids)
            for p in prompts]


def test_calls_answered_during_the_forward_keep_decoding_exact_and_off_every_call_is_waited_for():
    refs = references()

    async def main() -> dict[bool, tuple[int, int, int]]:
        seen = {}
        async with serve_drafter(NgramDrafter(max_draft_len=32)) as drafter:
            for overlap in (True, False):
                spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
                spec.user_provided.overlap_calls = overlap
                async with run_verifier(spec, model=shared_model()) as v:
                    assert await one_by_one(v, PROMPTS) == refs
                    together = await run_together(v, [functools.partial(
                        v.stub.Generate, token_request(p, LENGTH), timeout=WAIT_S) for p in PROMPTS])
                    assert [list(r.output.token_ids) for r in together] == refs
                    stats = engine_of(v).drafter.stats
                    seen[overlap] = (stats.overlapped, stats.calls, stats.failures)
        return seen

    seen = asyncio.run(main())
    overlapped, calls, failures = seen[True]
    assert overlapped > 0 and failures == 0, seen
    assert seen[False][0] == 0 and seen[False][2] == 0


class LookaheadOracle(Drafter):
    """Drafts each prompt's true continuation. Asked for 2k + 1 tokens (a verifier that looks ahead),
    it keeps the first k + 1 true and corrupts each later token with probability `corrupt`: those are
    verified only on steps that did not wait for the call (and `fail_every`-th calls fail)."""

    capabilities = (LOOKAHEAD,)

    def __init__(self, refs: dict[tuple[int, ...], list[int]], corrupt: float, fail_every: int = 0) -> None:
        self.refs = refs
        self.corrupt = corrupt
        self.fail_every = fail_every
        self.calls = 0
        self.rng = random.Random(5)

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("a drafter fault")
        drafts = []
        for r in requests:
            ref = self.refs[tuple(r.tokens[:r.prompt_len])]
            done = len(r.tokens) - r.prompt_len
            truth = ref[done:done + r.draft_len]
            kept = (r.draft_len - 1) // 2 + 1
            drafts.append([t if i < kept or self.rng.random() >= self.corrupt else (t + 1) % 400
                           for i, t in enumerate(truth)])
        return drafts


@pytest.mark.parametrize("fail_every", [0, 4])
def test_a_wrong_lookahead_is_rejected_and_a_call_failing_in_flight_costs_only_drafts(fail_every):
    refs = references()
    oracle = LookaheadOracle({tuple(p): r for p, r in zip(PROMPTS, refs)}, corrupt=0.3, fail_every=fail_every)

    async def main() -> tuple[list[verifier_pb2.GenerateResponse], int, int]:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            spec.policy.adaptive_draft_len = False  # always 4 verified: the lookahead is asked for 9
            async with run_verifier(spec, model=shared_model()) as v:
                responses = [await v.stub.Generate(token_request(p, LENGTH), timeout=WAIT_S) for p in PROMPTS]
                stats = engine_of(v).drafter.stats
                return responses, stats.overlapped, stats.failures

    responses, overlapped, failures = asyncio.run(main())
    assert [list(r.output.token_ids) for r in responses] == refs
    assert overlapped > 0
    drafted = sum(r.output.stats.num_draft_tokens for r in responses)
    accepted = sum(r.output.stats.num_accepted_tokens for r in responses)
    assert 0 < accepted < drafted  # corrupted tokens are verified where a step did not wait for its call
    assert (failures > 0) == bool(fail_every)
    assert (sum(r.output.stats.num_drafter_failures for r in responses) > 0) == bool(fail_every)


class UnsaltedOracle(LookaheadOracle):
    """The oracle, saying it learns across requests and not that it keeps cache salts apart: the verifier
    sends it nothing of a salted request."""

    @property
    def learns_across_requests(self) -> bool:
        return True


def test_a_salted_request_the_drafter_is_not_sent_leaves_the_others_calls_overlapped():
    """Planned no drafter draft (none would come), a salted request the drafter is not sent does not keep
    the unsalted requests beside it from verifying what is left of their chains while their calls are in
    flight; it decodes plainly and exactly."""
    refs = references()[:3]
    oracle = UnsaltedOracle({tuple(p): r for p, r in zip(PROMPTS, refs)}, corrupt=0.0)

    async def main() -> tuple[list[verifier_pb2.GenerateResponse], int, int]:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            spec.policy.adaptive_draft_len = False
            async with run_verifier(spec, model=shared_model()) as v:
                requests = [token_request(p, LENGTH, cache_salt="tenant-a" if i == 0 else "")
                            for i, p in enumerate(PROMPTS[:3])]
                responses = await run_together(v, [functools.partial(v.stub.Generate, r, timeout=WAIT_S)
                                                   for r in requests])
                stats = engine_of(v).drafter.stats
                return responses, stats.overlapped, stats.calls

    responses, overlapped, calls = asyncio.run(main())
    assert [list(r.output.token_ids) for r in responses] == refs
    assert [r.output.stats.num_draft_tokens > 0 for r in responses] == [False, True, True]
    # Whole drafts accepted: a call is waited for only where an unsalted request starts its chain (both in
    # one step, or one each where they were admitted apart); every other is sent before its step's forward.
    assert 0 < calls - 2 <= overlapped, (overlapped, calls)


def test_a_seeded_sampled_request_gives_plain_decodings_output_with_calls_overlapped():
    """One draw per emitted token, whatever the draft: a lookahead verified instead of a fresh draft
    changes no sampled token."""
    sampling = verifier_pb2.SamplingParams(temperature=0.5, top_p=0.9, seed=0)

    async def main() -> tuple[list[list[int]], list[list[int]], int]:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            plain = [list((await v.stub.Generate(token_request(p, LENGTH, sampling=sampling), timeout=WAIT_S))
                          .output.token_ids) for p in PROMPTS]
        async with serve_drafter(NgramDrafter(max_draft_len=32)) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=shared_model()) as v:
                spec_out = [list((await v.stub.Generate(token_request(p, LENGTH, sampling=sampling),
                                                        timeout=WAIT_S)).output.token_ids) for p in PROMPTS]
                return plain, spec_out, engine_of(v).drafter.stats.overlapped

    plain, spec_out, overlapped = asyncio.run(main())
    assert spec_out == plain
    assert overlapped > 0
