"""The Node.js drafter behind a real verifier: exact outputs, drafts accepted, chains and token trees."""

from __future__ import annotations

import asyncio

import pytest
from node_drafter import node_available, run_node_drafter
from tiny_model import tiny_model
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request

pytestmark = pytest.mark.skipif(not node_available(), reason="node is not installed")

# Repetitive prompts: a tiny random model tends to loop, so prompt lookup has something to find.
PROMPTS = [[5, 6, 7, 8] * 5, [11, 12, 13] * 6 + [11], [20, 21, 22, 23, 24, 20, 21, 22], [3, 1, 4, 1, 5, 9, 2, 6]]
NEW_TOKENS = 48


def test_node_drafter_serves_a_verifier_exactly_with_acceptance() -> None:
    model = tiny_model()
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    with run_node_drafter(max_draft_len=6, max_ngram=3) as address:
        async def main() -> list:
            spec = spec_config("USER_PROVIDED", 6, drafter_target=address, deadline_ms=2000)
            async with run_verifier(spec, model=model) as v:
                return list(await asyncio.gather(*(v.stub.Generate(token_request(p, NEW_TOKENS), timeout=120)
                                                   for p in PROMPTS)))

        replies = asyncio.run(main())
    assert [list(r.output.token_ids) for r in replies] == expected
    assert all(r.output.stats.num_drafter_failures == 0 for r in replies)
    drafts = sum(r.output.stats.num_drafts for r in replies)
    accepted = sum(r.output.stats.num_accepted_tokens for r in replies)
    assert drafts > 0 and 1 + accepted / drafts > 1.0, "mean acceptance length above 1"


# Contexts where one suffix had several continuations: the drafter's trees branch there.
BRANCHING = [[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], [7, 8, 9, 7, 8, 10, 7, 8, 9, 7, 8], [30, 31, 32, 30, 31, 33, 30, 31]]


def test_node_drafters_token_trees_are_verified_exactly() -> None:
    model = tiny_model()
    prompts = BRANCHING + PROMPTS[:2]
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in prompts]
    with run_node_drafter(max_draft_len=6, max_ngram=3) as address:
        async def main() -> list:
            spec = spec_config("USER_PROVIDED", 6, drafter_target=address, deadline_ms=2000)
            async with run_verifier(spec, model=model, max_draft_nodes=12) as v:
                return list(await asyncio.gather(*(v.stub.Generate(token_request(p, NEW_TOKENS), timeout=120)
                                                   for p in prompts)))

        replies = asyncio.run(main())
    assert [list(r.output.token_ids) for r in replies] == expected
    stats = [r.output.stats for r in replies]
    assert all(s.num_drafter_failures == 0 for s in stats)
    assert sum(s.num_draft_nodes for s in stats) > sum(s.num_draft_tokens for s in stats), "trees verified"
    assert sum(s.num_accepted_tokens for s in stats) > 0
