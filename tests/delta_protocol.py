"""The delta protocol under any interleaving of calls: a hypothesis state machine for any drafter server.

A verifier keeps each request's committed context and, per call, sends a delta from a point of its
choosing: the whole context, the tokens since its last call, or an overlap of the last few. Now and
then it replaces a request's context, releases it, finishes it (released FINISHED: a drafter that
learns from finished requests learns it), skips tokens (a gap, as after a lost call) or sends an
overlap that contradicts what it sent before (a corrupted message). Whatever the interleaving, over
several requests of two verifiers (and, where the target has one, under a state budget that evicts):

- a sequence in sync is drafted from exactly its committed context: the draft, chain or tree, equals
  what the same kind of drafter answers, fresh, to one call carrying that whole context after learning
  the same finished sequences in the same order;
- one out of sync (never seen, released, a gap, a contradiction, evicted) is answered RESYNC_REQUIRED,
  never drafted from the wrong context, and the whole context brings it back;
- a release counts exactly the sequences the protocol says are held (and, where the target shows its
  store, the store holds exactly those); releasing every request leaves nothing held.

The same machine runs against the SDK's servicer (tests/sdk/test_sdk_protocol_fuzz.py) and the Node.js
example drafter over gRPC (tests/examples/test_node_drafter_protocol_fuzz.py): two implementations of
PROTOCOL.md §4, held to one model of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

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

from drafter_sdk.proto import drafter_pb2 as pb

OK, RESYNC = pb.DRAFT_STATUS_OK, pb.DRAFT_STATUS_RESYNC_REQUIRED
VERIFIERS = ("v1", "v2")
REQUESTS = ("a", "b", "c", "d")
KEYS = [(v, r) for v in VERIFIERS for r in REQUESTS]
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=12)  # a small alphabet: n-gram drafters match
DELTAS = ("full", "since", "overlap", "gap", "contradict")
# Contexts stay short, so that a state budget can be set that no one sequence outgrows (it would then be
# followed by length alone, undrafted) while several together do (the least recently synced are evicted).
MAX_CONTEXT = 60
Key = tuple[str, str]


class Target(Protocol):
    """A drafter server as the machine drives it: its own verifier ids, so that runs do not meet."""

    evicts: bool  # whether it may drop a sequence the protocol says it holds (a state budget)

    def prepare(self, verifier: str, sequences: list[pb.DraftSequence]) -> list[pb.DraftResult]: ...

    def release(self, verifier: str, request_ids: list[str], finished: bool = False) -> int:
        """Release the requests, as finished (ReleaseReason FINISHED: a learning drafter learns them) or not."""

    def fresh_target(self) -> Target:
        """The same kind of drafter, holding nothing and having learned nothing."""

    def holds(self, key: Key) -> bool | None:
        """Whether its store holds `key`; None where it does not show its store."""

    def close(self) -> None: ...


class DeltaProtocol(RuleBasedStateMachine):
    """Drives the target made by `make_target` (the class attribute a `run` sets)."""

    make_target: Callable[[], Target]

    @initialize()
    def start(self) -> None:
        self.target = self.make_target()
        self.truth: dict[Key, list[int]] = {}  # the verifier's committed context
        self.sent: dict[Key, int] = {}  # where the verifier's last sent delta ended
        # What the drafter should hold, by the protocol: the tokens, and the prompt length they came with (a
        # drafter keeps the one of the call that started holding them; a full context extending them is an append).
        self.held: dict[Key, tuple[list[int], int]] = {}
        self.prompt_len: dict[Key, int] = {}  # fixed for a context, as a verifier sends it
        self.finished: set[Key] = set()  # request ids are not used again once finished
        self.learned: list[tuple[list[int], int]] = []  # the finished sequences (tokens, prompt_len), in order

    @rule(key=st.sampled_from(KEYS), prompt=tokens, data=st.data())
    def new_context(self, key: Key, prompt: list[int], data: st.DataObject) -> None:
        """A new request under this id, or a request's context replaced: only the whole context may follow."""
        if key in self.finished:
            return
        self.truth[key] = prompt
        self.prompt_len[key] = data.draw(st.integers(0, min(len(prompt), 3)))
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
        mine = sorted(k for k in self.truth if k[0] == verifier and k not in self.finished)
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
            held = len(self.held[key][0]) if key in self.held else None
            if start > len(truth) or (kind == "contradict" and (held is None or start >= held)):
                kind, start = "full", 0  # nothing to skip, or no held token to contradict: the whole context
            new = list(truth[start:])
            if kind == "contradict":
                new[0] = (new[0] + 1) % 6  # a token the drafter already holds, changed
            seq = pb.DraftSequence(request_id=key[1], context_len=start, new_tokens=new,
                                   prompt_len=self.prompt_len[key], draft_len=data.draw(st.integers(0, 8)),
                                   max_draft_nodes=data.draw(st.sampled_from([0, 0, 3, 10])))
            sequences.append(seq)
            expected.append(self._expect(key, seq, kind))
        results = self.target.prepare(verifier, sequences)
        assert [r.request_id for r in results] == [k[1] for k in keys]
        for key, seq, result, status in zip(keys, sequences, results, expected):
            assert result.status == status, (key, seq)
            if status == OK:
                tokens, prompt_len = self.held[key]  # the whole context, now held
                fresh = self._fresh(pb.DraftSequence(request_id=seq.request_id, new_tokens=tokens,
                                                     prompt_len=prompt_len, draft_len=seq.draft_len,
                                                     max_draft_nodes=seq.max_draft_nodes))
                assert (list(result.draft_tokens), list(result.draft_parents)) == (
                    list(fresh.draft_tokens), list(fresh.draft_parents)), (key, seq)
            else:
                assert not result.draft_tokens
        self._note_evictions()

    def _fresh(self, whole: pb.DraftSequence) -> pb.DraftResult:
        """What the same kind of drafter answers to one call carrying the whole context, having learned the
        finished sequences first, in the same order."""
        fresh = self.target.fresh_target()
        try:
            for i, (learned, prompt_len) in enumerate(self.learned):
                fresh.prepare("learn", [pb.DraftSequence(request_id=str(i), new_tokens=learned, prompt_len=prompt_len)])
                assert fresh.release("learn", [str(i)], finished=True) == 1
            [result] = fresh.prepare("fresh", [whole])
            assert result.status == OK
            return result
        finally:
            fresh.release("fresh", [whole.request_id])
            fresh.close()

    def _expect(self, key: Key, seq: pb.DraftSequence, kind: str) -> int:
        """The status the protocol gives this delta (PROTOCOL.md §4); what the drafter holds after it."""
        held, start = len(self.held[key][0]) if key in self.held else None, seq.context_len
        if kind != "contradict":
            self.sent[key] = len(self.truth[key])
        if start == 0:
            extends = key in self.held and list(seq.new_tokens[:held]) == self.held[key][0]
            self.held[key] = (list(seq.new_tokens), self.held[key][1] if extends else seq.prompt_len)
            return OK
        if held is None or held < start:  # never seen, released or evicted; or a gap: what is held stays
            return RESYNC
        if kind == "contradict":  # a held token changed, but committed tokens never change: the state is dropped
            del self.held[key]
            self.sent.pop(key, None)
            return RESYNC
        self.held[key] = (self.truth[key][:start + len(seq.new_tokens)], self.held[key][1])
        return OK

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        verifier = data.draw(st.sampled_from(VERIFIERS))
        ids = data.draw(st.lists(st.sampled_from(REQUESTS), unique=True, max_size=3))
        if not ids:
            return
        self._note_evictions()
        assert self.target.release(verifier, ids) == sum((verifier, r) in self.held for r in ids)
        for r in ids:
            self.held.pop((verifier, r), None)
            self.sent.pop((verifier, r), None)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request finishes: released FINISHED, what the drafter holds of it is a finished output."""
        self._note_evictions()
        if not self.held:
            return
        key = data.draw(st.sampled_from(sorted(self.held)))
        assert self.target.release(key[0], [key[1]], finished=True) == 1
        self.learned.append(self.held.pop(key))
        self.finished.add(key)
        self.sent.pop(key, None)

    def _note_evictions(self) -> None:
        """A state budget may evict any sequence after a call (none is evicted without one)."""
        if self.target.evicts:
            for key in [k for k in self.held if self.target.holds(k) is False]:
                del self.held[key]

    @invariant()
    def store_holds_what_the_protocol_says(self) -> None:
        for key in KEYS if hasattr(self, "target") else ():
            assert self.target.holds(key) in (None, key in self.held), key

    def teardown(self) -> None:
        if not hasattr(self, "target"):
            return
        self._note_evictions()
        for verifier in VERIFIERS:
            assert self.target.release(verifier, list(REQUESTS)) == sum(k[0] == verifier for k in self.held)
        self.target.close()


def run(make_target: Callable[[], Target], examples: int) -> None:
    """Run the machine `examples` times (seeded: the same cases every run), each on a new target."""
    machine = type("DeltaProtocolOn", (DeltaProtocol,), {"make_target": staticmethod(make_target)})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


def fresh_ids(prefix: str) -> Callable[[], str]:
    """Unique names for the runs that share one server."""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"
