"""A drafter's chain kept past its step, so that the next step need not wait for a call.

A remote drafter's call costs a round trip on the critical path of every step: the
forward waits for the drafts (1.2-1.9 ms on an H200 host, about a third of a
small model's step). Where the drafter looks ahead (capability "lookahead": its
longer drafts cost it nothing), the verifier asks it for about twice what it
verifies and keeps the answer as a `Lookahead`. After the step, the tokens it
committed are stripped from the front: if the target accepted the whole draft and
its own token is the next one of the chain, the rest is a draft for the context as
it is now. The next step verifies that at once, and the call it sends for its own
context is answered while its forward runs (engine.py). When the chain and the
target part ways (a partial acceptance), nothing remains and the step waits for
its call, as without lookahead. So it pays only as often as whole drafts are
accepted: 0-28% of drafting steps in replays of six workloads (tree_replay
--lookahead; most on agentic and grounded text, almost none on open text).

Every draft is verified, so a stale or wrong lookahead costs speed, never a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Lookahead:
    """A chain the drafter proposed for a sequence after its first `base` generated tokens."""

    base: int
    tokens: list[int]

    def remaining(self, generated: Sequence[int]) -> list[int]:
        """What is left of the chain as a draft after `generated` (the sequence's generated tokens):
        [] when what was generated since `base` is not where the chain begins."""
        since = generated[self.base:]
        if len(generated) < self.base or len(since) >= len(self.tokens):
            return []
        if any(a != b for a, b in zip(since, self.tokens)):
            return []
        return self.tokens[len(since):]


def covers(left: list[list[int]], verify: list[int], asks: list[int]) -> bool:
    """Whether a step can verify what is left of its sequences' last chains instead of waiting for
    its call: every sequence asked for drafts has at least the `verify` tokens it verifies, and one
    that only scores a shadow draft (verifies 0, asks for some) has a token to score. (Without
    that token it would wait: skipping its shadow exactly when the last one missed would leave the
    planner counting only the hits.)"""
    return all(len(d) >= max(k, 1) for d, k, a in zip(left, verify, asks) if a)


def ask(verify: int, room: int) -> int:
    """Draft tokens to ask a drafter that looks ahead for, where `verify` are verified now: enough for
    this step's draft, its target token and a draft as long for the next step."""
    return min(2 * verify + 1, room)
