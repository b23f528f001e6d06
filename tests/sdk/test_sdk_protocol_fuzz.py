"""The delta protocol under any interleaving of calls (a hypothesis state machine), through the SDK's servicer.

A verifier keeps each request's committed context and, per call, sends a delta from a point of its
choosing: the whole context, the tokens since its last call, or an overlap of the last few. Now and
then it replaces a request's context, releases it, skips tokens (a gap, as after a lost call) or sends
an overlap that contradicts what it sent before (a corrupted message). Whatever the interleaving, over
several requests of two verifiers, with and without a state budget that evicts:

- a sequence in sync is drafted from exactly its committed context: the n-gram drafter's chain or
  tree equals what a fresh drafter answers to one call carrying that whole context;
- one out of sync (never seen, released, a gap, a contradiction, evicted) is answered RESYNC_REQUIRED,
  never drafted from the wrong context, and the whole context brings it back;
- the store holds a sequence exactly when the protocol says it does, and releasing every request
  leaves nothing held.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer

OK, RESYNC = pb.DRAFT_STATUS_OK, pb.DRAFT_STATUS_RESYNC_REQUIRED
VERIFIERS = ("v1", "v2")
REQUESTS = ("a", "b", "c", "d")
KEYS = [(v, r) for v in VERIFIERS for r in REQUESTS]
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=12)  # a small alphabet: the n-gram drafter matches
DELTAS = ("full", "since", "overlap", "gap", "contradict")
# Contexts stay short enough that no one sequence outgrows the budget below (it would then be followed by
# length alone, undrafted), while several together do (the least recently synced are evicted).
MAX_CONTEXT, BUDGET_BYTES = 60, 6000


def servicer(max_state_bytes: int | None) -> DrafterServicer:
    s = DrafterServicer(NgramDrafter(max_draft_len=6, max_matching_ngram_size=3),
                        SequenceStore(max_state_bytes=max_state_bytes))
    s.load()
    return s


def fresh_draft(seq: pb.DraftSequence, context: list[int]) -> tuple[list[int], list[int]]:
    """What a fresh drafter answers to one call carrying the whole context."""
    whole = pb.DraftSequence(request_id=seq.request_id, context_len=0, new_tokens=context, prompt_len=seq.prompt_len,
                             draft_len=seq.draft_len, max_draft_nodes=seq.max_draft_nodes)
    [result] = servicer(None).prepare(pb.PrepareDraftTokensRequest(verifier_id="fresh", sequences=[whole])).results
    assert result.status == OK
    return list(result.draft_tokens), list(result.draft_parents)


class DeltaProtocol(RuleBasedStateMachine):
    @initialize(budget=st.sampled_from([None, BUDGET_BYTES]))
    def start(self, budget: int | None) -> None:
        self.budget = budget
        self.servicer = servicer(budget)
        self.truth: dict[tuple[str, str], list[int]] = {}  # the verifier's committed context
        self.sent: dict[tuple[str, str], int] = {}  # where the verifier's last sent delta ended
        self.held: dict[tuple[str, str], int] = {}  # what the drafter should hold, by the protocol

    @rule(key=st.sampled_from(KEYS), prompt=tokens)
    def new_context(self, key: tuple[str, str], prompt: list[int]) -> None:
        """A new request under this id, or a request's context replaced: only the whole context may follow."""
        self.truth[key] = prompt
        self.sent.pop(key, None)

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), more=tokens)
    def commit(self, data: st.DataObject, more: list[int]) -> None:
        """A step's tokens committed, told to the drafter at some later call."""
        key = data.draw(st.sampled_from(sorted(self.truth)))
        if len(self.truth[key]) + len(more) <= MAX_CONTEXT:
            self.truth[key] = self.truth[key] + more

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def call(self, data: st.DataObject) -> None:
        verifier = data.draw(st.sampled_from(VERIFIERS))
        mine = sorted(k for k in self.truth if k[0] == verifier)
        if not mine:
            return
        keys = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        sequences, expected = [], []
        for key in keys:
            truth, sent = self.truth[key], self.sent.get(key)
            kind = data.draw(st.sampled_from(DELTAS if sent is not None else ("full",)))
            if kind == "overlap":
                start = data.draw(st.integers(0, sent))
            elif kind == "contradict":  # from 1: a delta from 0 is the whole context, which replaces what is held
                start = data.draw(st.integers(1, max(sent, 1)))
            else:
                start = {"full": 0, "since": sent, "gap": (sent or 0) + 1}[kind]
            held = self.held.get(key)
            if start > len(truth) or (kind == "contradict" and (held is None or start >= held)):
                kind, start = "full", 0  # nothing to skip, or no held token to contradict: the whole context
            new = list(truth[start:])
            if kind == "contradict":
                new[0] = (new[0] + 1) % 6  # a token the drafter already holds, changed
            seq = pb.DraftSequence(request_id=key[1], context_len=start, new_tokens=new,
                                   prompt_len=data.draw(st.integers(0, min(len(truth), 3))),
                                   draft_len=data.draw(st.integers(0, 8)),
                                   max_draft_nodes=data.draw(st.sampled_from([0, 0, 3, 10])))
            sequences.append(seq)
            expected.append(self._expect(key, seq, kind))
        response = self.servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id=verifier, sequences=sequences))
        assert [r.request_id for r in response.results] == [k[1] for k in keys]
        for key, seq, result, status in zip(keys, sequences, response.results, expected):
            assert result.status == status, (key, seq, self.held.get(key))
            if status == OK:
                got = (list(result.draft_tokens), list(result.draft_parents))
                assert got == fresh_draft(seq, self.truth[key]), (key, seq)
        self._note_evictions()

    def _expect(self, key: tuple[str, str], seq: pb.DraftSequence, kind: str) -> int:
        """The status the protocol gives this delta (PROTOCOL.md §4); what the drafter holds after it."""
        held, start = self.held.get(key), seq.context_len
        if kind != "contradict":
            self.sent[key] = len(self.truth[key])
        if start == 0:
            self.held[key] = len(seq.new_tokens)
            return OK
        if held is None or held < start:  # never seen, released or evicted; or a gap: what is held stays
            return RESYNC
        if kind == "contradict" and start < held:  # committed tokens never change: the state is dropped
            del self.held[key]
            self.sent.pop(key, None)
            return RESYNC
        self.held[key] = start + len(seq.new_tokens)
        return OK

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        verifier = data.draw(st.sampled_from(VERIFIERS))
        ids = data.draw(st.lists(st.sampled_from(REQUESTS), unique=True, max_size=3))
        if not ids:
            return
        answer = self.servicer.release(pb.ReleaseRequestsRequest(verifier_id=verifier, request_ids=ids))
        assert answer.released == sum((verifier, r) in self.held for r in ids)
        for r in ids:
            self.held.pop((verifier, r), None)
            self.sent.pop((verifier, r), None)

    def _note_evictions(self) -> None:
        """The state budget may evict any sequence after a call; none is evicted without one."""
        for key in [k for k in self.held if k not in self.servicer.store]:
            assert self.budget is not None, f"{key} was dropped with no budget to enforce"
            del self.held[key]

    @invariant()
    def store_holds_what_the_protocol_says(self) -> None:
        if hasattr(self, "servicer"):
            assert {k for k in KEYS if k in self.servicer.store} == set(self.held)

    def teardown(self) -> None:
        if not hasattr(self, "servicer"):
            return
        for verifier in VERIFIERS:
            self.servicer.release(pb.ReleaseRequestsRequest(verifier_id=verifier, request_ids=REQUESTS))
        assert len(self.servicer.store) == 0 and not any(self.servicer.drafter.state_bytes(k) for k in KEYS)
        self.servicer.close()


TestDeltaProtocol = DeltaProtocol.TestCase
TestDeltaProtocol.settings = settings(max_examples=250, stateful_step_count=40, deadline=None, derandomize=True,
                                      suppress_health_check=list(HealthCheck))
pytestmark = pytest.mark.timeout(240)
