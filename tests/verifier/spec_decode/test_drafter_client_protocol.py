"""The verifier's side of the delta protocol (PROTOCOL.md §4, "What the verifier does") as a hypothesis state
machine: the real DrafterClient against real SDK servicers (the n-gram drafter) behind a lossy transport.

Sequences grow step by step. Each step's call goes to the next of the replicas in turn (round robin, as
behind a Kubernetes Service), and may be lost on the way there (the drafter never sees it) or on the way
back (the drafter applied it; the verifier never hears). Whatever the losses, with one replica (plain
deltas) or three (each call re-sends the tokens of the last overlap_steps successful calls):

- every message carries the sequence's true committed tokens from its context_len to its end, the whole
  context on a sequence's first call and on the first call after a replica asked for a resync, and
  otherwise from where one of the last overlap_steps successful calls ended;
- every draft the client hands over is what a fresh drafter drafts from the whole committed context, so a
  replica that missed calls never drafts from a context that is not the sequence's;
- with one replica no call is ever answered RESYNC_REQUIRED, losses or not: what a lost call or a lost
  answer leaves behind, the next call's delta covers.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from round_robin import ANSWER_LOST, ANSWERED, LOST_ON_THE_WAY, RoundRobin

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.spec_decode.circuit_breaker import CircuitBreaker
from verifier_service.spec_decode.drafter_client import DeltaHistory, DrafterClient, DraftQuery

OVERLAP_STEPS = 3
REQUESTS = ("a", "b", "c")
VOCAB = 6
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
FATES = (ANSWERED, ANSWERED, LOST_ON_THE_WAY, ANSWER_LOST)


def ngram_servicer() -> DrafterServicer:
    servicer = DrafterServicer(NgramDrafter(max_draft_len=6, max_matching_ngram_size=3))
    servicer.load()
    return servicer


def fresh_draft(request_id: str, context: list[int], draft_len: int, nodes: int) -> tuple[list[int], list[int]]:
    """What a fresh drafter answers to one call carrying the whole context."""
    servicer = ngram_servicer()
    try:
        [result] = servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="fresh", sequences=[pb.DraftSequence(
            request_id=request_id, new_tokens=context, draft_len=draft_len, max_draft_nodes=nodes)])).results
        return list(result.draft_tokens), list(result.draft_parents)
    finally:
        servicer.close()


class VerifierSide(RuleBasedStateMachine):
    replicas: int  # set by `run`

    @initialize()
    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.transport = RoundRobin(*(ngram_servicer() for _ in range(self.replicas)), one_replica=self.replicas == 1)
        self.client = DrafterClient(self.transport, verifier_id="v", vocab_size=VOCAB, deadline_s=5.0,
                                    overlap_steps=OVERLAP_STEPS, breaker=CircuitBreaker(failure_threshold=10**9),
                                    share_finished=False)
        self.loop.run_until_complete(self.client.connect())
        self.truth: dict[str, list[int]] = {}
        self.history: dict[str, DeltaHistory] = {}
        self.ends: dict[str, list[int]] = {}  # per sequence, where each successful call's delta ended
        self.full_next: set[str] = set()  # sequences whose next call must carry the whole context
        self.resyncs = 0

    @rule(request_id=st.sampled_from(REQUESTS), prompt=tokens)
    def new_sequence(self, request_id: str, prompt: list[int]) -> None:
        if request_id not in self.truth:
            self.truth[request_id] = prompt
            self.history[request_id] = DeltaHistory()
            self.ends[request_id] = []
            self.full_next.add(request_id)

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), more=tokens)
    def commit(self, data: st.DataObject, more: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.truth)))
        if len(self.truth[request_id]) + len(more) <= 60:
            self.truth[request_id] = self.truth[request_id] + more

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), fate=st.sampled_from(FATES))
    def step(self, data: st.DataObject, fate: str) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.truth)), min_size=1, unique=True))
        queries = [DraftQuery(r, list(self.truth[r]), 0, data.draw(st.integers(0, 6)), self.history[r],
                              max_draft_nodes=data.draw(st.sampled_from([0, 0, 4]))) for r in ids]
        self.transport.fate = fate
        sent_before = len(self.transport.sent)
        reply = self.loop.run_until_complete(self.client.propose(queries))
        assert len(self.transport.sent) == sent_before + 1
        request, response = self.transport.sent[-1], self.transport.answered[-1]
        assert [s.request_id for s in request.sequences] == ids
        for query, seq in zip(queries, request.sequences):
            self._check_message(query.request_id, seq)
        for i, query in enumerate(queries):
            result = response.results[i] if response is not None else None
            if result is None:  # lost: no draft, and the history as it was
                assert reply.drafts[i] == [] and reply.failed[i]
                continue
            if result.status == pb.DRAFT_STATUS_RESYNC_REQUIRED:
                self.resyncs += 1
                self.full_next.add(query.request_id)
                self.ends[query.request_id] = []
                assert reply.drafts[i] == []
                continue
            self.ends[query.request_id].append(len(query.tokens))
            expected = fresh_draft(query.request_id, query.tokens, query.draft_len, query.max_draft_nodes)
            assert (reply.drafts[i], reply.parents[i] if reply.parents else []) == expected, (query.request_id, seq)

    def _check_message(self, request_id: str, seq: pb.DraftSequence) -> None:
        truth = self.truth[request_id]
        assert list(seq.new_tokens) == truth[seq.context_len:], "not the committed tokens from context_len on"
        if request_id in self.full_next:
            assert seq.context_len == 0, f"{request_id}: a first call, or one after a resync, sends everything"
            self.full_next.discard(request_id)
        else:
            assert seq.context_len == 0 or seq.context_len in self.ends[request_id][-OVERLAP_STEPS:], (
                f"{request_id}: context_len {seq.context_len} is not where a recent successful call ended "
                f"({self.ends[request_id]})")

    @invariant()
    def one_replica_never_resyncs(self) -> None:
        if hasattr(self, "transport") and self.transport.one_replica:
            assert self.resyncs == 0

    def teardown(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run_until_complete(self.client.close())
            self.loop.close()
            for servicer in self.transport.replicas:
                servicer.close()


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_verifier_side_of_the_delta_protocol_under_lost_calls_and_answers(replicas: int) -> None:
    machine = type("VerifierSideOf", (VerifierSide,), {"replicas": replicas})
    run_state_machine_as_test(machine, settings=settings(max_examples=100, stateful_step_count=40, deadline=None,
                                                         derandomize=True, suppress_health_check=list(HealthCheck)))
