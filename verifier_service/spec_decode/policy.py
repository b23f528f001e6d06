"""How many tokens each sequence drafts this step.

The knobs TensorRT-LLM and vLLM users know: a global max_draft_len, a
per-request cap, a draft-length schedule by batch size, acceptance-based
auto-disable per request (with periodic probes), and an adaptive length that
weighs each request's acceptance against the measured cost of verifying more
tokens and of calling the drafter (planner.py).

The policy holds configuration only; what it learns about a request lives in
that request's `SpecState`, on its Sequence, and goes with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drafter_sdk.proto import speculative_pb2
from drafter_sdk.tree import accepted_path, first_branch
from verifier_service.spec_decode.planner import FREE_CALLS, AcceptanceEstimate, DraftPlanner, StepPrice

# Bound of SpecState.shadow_wait (the planner's shadow_interval bounds it further).
MAX_SHADOW_WAIT = 1 << 12


@dataclass(frozen=True)
class SpeculationParams:
    """A request's own speculation overrides."""

    max_draft_len: int | None = None  # per-request cap
    disable: bool = False


@dataclass
class SpecState:
    """One request's speculation: its overrides and what the policy has learnt about its drafts."""

    params: SpeculationParams = field(default_factory=SpeculationParams)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    window: deque[tuple[int, int]] = field(default_factory=deque)  # (drafted, accepted) per drafting step
    disabled: bool = False
    steps_since_disabled: int = 0
    auto_disabled: bool = False  # ever switched off by the auto-disable policy (reported in its stats)
    # Of the previous verified draft: fed back to the drafter.
    last_num_drafted: int = 0
    last_num_accepted: int = 0
    node_budget: int = 0  # of the draft asked for this step: its tree's nodes, 0 for a chain
    steps_unasked: int = 0  # steps in a row the planner asked the drafter nothing for it (calls not paying)
    shadow_wait: int = 1  # steps between its shadow drafts while calls do not pay (shadow_came_back)

    def shadow_came_back(self, hit: bool) -> None:
        """Where calls do not pay, the next shadow comes sooner after a hit, later after a miss or an empty
        answer."""
        self.shadow_wait = max(1, self.shadow_wait // 2) if hit else min(2 * self.shadow_wait, MAX_SHADOW_WAIT)


@dataclass(frozen=True)
class DraftSizes:
    """A step's drafts, per decoding sequence (SpeculationPolicy.plan)."""

    lengths: list[int]  # draft tokens to verify
    asks: list[int]  # draft tokens to ask the drafter for (>= lengths; the rest is a shadow draft)
    call_saved: bool = False  # no call: it would cost more than the drafts gain, and no shadow is due


@dataclass(frozen=True)
class SpeculationPolicy:
    max_draft_len: int
    schedule: tuple[tuple[int, int], ...] = ()  # (max_batch_size, draft_len), ascending
    window_tokens: int = 0
    min_acceptance_rate: float = 0.0
    probe_interval_steps: int = 0
    planner: DraftPlanner | None = None  # adaptive draft lengths; None = always the cap
    max_draft_nodes: int = 0  # token-tree budget per sequence (drafters that draft trees); 0 = chains

    @classmethod
    def from_config(cls, config: speculative_pb2.SpeculativeConfig,
                    planner: DraftPlanner | None = None, max_draft_nodes: int = 0) -> "SpeculationPolicy":
        """`planner`: built by the builder from the measured cost curve when adaptive_draft_len is on."""
        p = config.policy
        return cls(
            max_draft_len=config.max_draft_len,
            schedule=tuple(sorted((r.max_batch_size, r.draft_len) for r in p.draft_len_schedule)),
            window_tokens=p.auto_disable.window_tokens,
            min_acceptance_rate=p.auto_disable.min_acceptance_rate,
            probe_interval_steps=p.auto_disable.probe_interval_steps,
            planner=planner,
            max_draft_nodes=max_draft_nodes,
        )

    def plan(self, states: list[SpecState], rooms: list[int], price: StepPrice = FREE_CALLS,
             calls: list[bool] | None = None) -> DraftSizes:
        """The step's draft sizes, given what a step costs beside its forward (`price`; `calls[i]` false
        where sequence i's draft needs no drafter call: its prediction drafts).

        `rooms[i]`: draft tokens sequence i can still use (drafts beyond the tokens it
        still wants, or past the context, are wasted work). With the planner, a sequence
        it keeps from drafting still asks for a shadow draft up to its cap, scored but
        never verified (observe_shadow), free where the step calls the drafter anyway;
        where no sequence drafts from a call, only once it waited its `shadow_wait` steps (at
        most the planner's `shadow_interval`).
        """
        caps = [self._cap(state, len(states), room) for state, room in zip(states, rooms)]
        if self.planner is None:
            return DraftSizes(caps, caps)
        calls = calls if calls is not None else [True] * len(states)
        lengths = self.planner.plan([s.acceptance for s in states], caps, price, calls)
        asks = [k or cap for k, cap in zip(lengths, caps)]
        interval = self.planner.shadow_interval(len(states), price)
        due = any(s.steps_unasked + 1 >= min(s.shadow_wait, interval)
                  for s, a, c in zip(states, asks, calls) if a and c)
        # No call where no draft verified needs one and no shadow is due (a prediction's asks need none).
        saved = not any(k for k, c in zip(lengths, calls) if c) and any(a for a, c in zip(asks, calls) if c) and not due
        if saved:
            asks = [0 if c else a for a, c in zip(asks, calls)]
        for state, cap, ask in zip(states, caps, asks):
            state.steps_unasked = state.steps_unasked + 1 if cap and not ask else 0
        return DraftSizes(lengths, asks, saved)

    def plan_nodes(self, states: list[SpecState], lengths: list[int], price: StepPrice = FREE_CALLS) -> list[int]:
        """Token-tree budgets (nodes; 0 = a chain) for a step whose drafter drafts trees, given the
        draft lengths (now maximum depths) `plan` chose: with the planner, only where they pay."""
        if not self.max_draft_nodes:
            nodes = [0] * len(lengths)
        elif self.planner is None:
            nodes = [self.max_draft_nodes if k else 0 for k in lengths]
        else:
            nodes = self.planner.plan_nodes([s.acceptance for s in states], lengths, self.max_draft_nodes, price)
        for state, m in zip(states, nodes):
            state.node_budget = m
        return nodes

    def _cap(self, state: SpecState, batch_size: int, room: int) -> int:
        if state.params.disable:
            return 0
        k = self.max_draft_len
        for bound, length in self.schedule:
            if batch_size <= bound:
                k = min(k, length)
                break
        else:
            if self.schedule:  # beyond the largest bound: the last rule's length
                k = min(k, self.schedule[-1][1])
        if state.params.max_draft_len is not None:
            k = min(k, state.params.max_draft_len)
        if state.disabled:
            state.steps_since_disabled += 1
            if not self.probe_interval_steps or state.steps_since_disabled < self.probe_interval_steps:
                return 0
        return max(0, min(k, room))

    def observe(self, state: SpecState, drafted: int, accepted: int, by_drafter: bool = True) -> None:
        """A verified draft: `accepted` of its `drafted` tokens were kept. `by_drafter` false: the draft was
        the request's prediction's, and the drafter, asked for none, answered none."""
        if not state.steps_unasked:  # feedback on the answer to the last call asked for this sequence
            state.last_num_drafted, state.last_num_accepted = (drafted, accepted) if by_drafter else (0, 0)
        if self.planner is not None and not state.node_budget:  # a tree: observe_tree
            state.acceptance.observe(drafted, accepted)
        if drafted:
            state.shadow_wait = 1
        if drafted == 0 or not self.window_tokens:
            return
        if state.disabled:  # this was a probe: resume only if it paid
            state.steps_since_disabled = 0
            if accepted / drafted >= self.min_acceptance_rate:
                state.disabled = False
                state.window.clear()
            return
        state.window.append((drafted, accepted))
        total = sum(d for d, _ in state.window)
        while state.window and total - state.window[0][0] >= self.window_tokens:
            total -= state.window.popleft()[0]
        if total >= self.window_tokens:
            rate = sum(a for _, a in state.window) / total
            if rate < self.min_acceptance_rate:
                state.disabled = True
                state.steps_since_disabled = 0
                state.auto_disabled = True

    def observe_tree(self, state: SpecState, draft: list[int], parents: list[int], new_tokens: list[int]) -> None:
        """A verified draft asked for as a tree (a chain-shaped one arrives as a chain), for the planner:
        what its first j nodes had accepted beyond its first branch, for every j up to its budget."""
        budget, state.node_budget = state.node_budget, 0
        if self.planner is None or not budget or not draft:
            return
        parents = parents or list(range(-1, len(draft) - 1))
        branch = first_branch(draft, parents)
        on_branch = 0
        while on_branch < min(len(branch), len(new_tokens) - 1) and branch[on_branch] == new_tokens[on_branch]:
            on_branch += 1
        # Its first branch is the chain the drafter would have drafted: the chain estimate learns from it
        # too, or it would go stale (and size depths from old evidence) while trees are verified.
        state.acceptance.observe(len(branch), on_branch)
        path = accepted_path(draft, parents, new_tokens[:-1])
        # Path nodes come in index order (parents first): the first j nodes hold those below j.
        state.acceptance.observe_tree([sum(1 for i in path if i < j) - on_branch for j in range(1, budget + 1)])

    def observe_answer(self, state: SpecState, asked: int, answer: list[int]) -> None:
        """A step's call asked for `asked` draft tokens (0: it asked for none) and the drafter answered
        `answer` (the draft verified, else the shadow draft). An empty answer also waits longer for the
        next shadow, as a miss does."""
        if self.planner is None or not asked:
            return
        state.acceptance.observe_answer(bool(answer))
        if not answer:
            state.shadow_came_back(hit=False)

    def observe_shadow(self, state: SpecState, shadow: list[int], produced: int) -> None:
        """A draft asked for but not verified: its first token against the token the target produced."""
        if self.planner is not None and shadow:
            hit = shadow[0] == produced
            state.acceptance.observe_shadow(hit)
            state.shadow_came_back(hit)
