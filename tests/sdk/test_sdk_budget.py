"""The state budget: accounting, fair eviction across namespaces, oversize sequences, the n-gram
drafter's compact state, and a real `splitspec-drafter` process flooded under a small budget."""

from __future__ import annotations

import random
import subprocess
import urllib.request
from array import array

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from drafter_sdk import Drafter, DrafterError, DrafterServicer, NgramDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server.sequence_store import ENTRY_OVERHEAD_BYTES, SequenceStore
from sdk_support import DRAFTER_SCRIPT, free_port, seq

OK, RESYNC = pb.DRAFT_STATUS_OK, pb.DRAFT_STATUS_RESYNC_REQUIRED


def entry_size(tokens: list[int], drafter_bytes: int = 0) -> int:
    return ENTRY_OVERHEAD_BYTES + 4 * len(tokens) + drafter_bytes


# --- the store ----------------------------------------------------------------------------------

def test_accounting_counts_tokens_overhead_and_drafter_bytes_by_namespace():
    store = SequenceStore(max_state_bytes=None)
    store.sync(("a", "1"), 0, [1, 2, 3])
    store.sync(("a", "2"), 0, [4])
    store.sync(("b", "1"), 0, [5, 6])
    assert not store.account(("a", "1"), 1000)
    expected_a = entry_size([1, 2, 3], 1000) + entry_size([4])
    assert store.bytes_by_namespace() == {"a": expected_a, "b": entry_size([5, 6])}
    assert store.total_bytes == expected_a + entry_size([5, 6])
    assert store.held_tokens == 6
    store.release(("a", "1"))
    store.release(("b", "1"))
    assert store.bytes_by_namespace() == {"a": entry_size([4])}
    assert store.total_bytes == entry_size([4]) and store.held_tokens == 1
    assert store.evictions == {"release": 2}


def test_a_flooding_namespace_evicts_its_own_least_recent_sequences_first():
    one = entry_size([7] * 100)
    store = SequenceStore(max_state_bytes=10 * one)
    store.sync(("good", "g1"), 0, [7] * 100)
    store.sync(("good", "g2"), 0, [7] * 100)
    for i in range(20):
        store.sync(("flood", str(i)), 0, [7] * 100)
        if i == 10:
            store.sync(("good", "g1"), 100, [])  # the good verifier keeps syncing; flood 0..10 go stale
        evicted = store.evict_over_budget()
        assert all(key[0] == "flood" for key in evicted)
        assert store.total_bytes <= store.max_state_bytes
    assert ("good", "g1") in store and ("good", "g2") in store
    # The flood keeps its most recent sequences, within what the good verifier leaves.
    assert [str(i) for i in range(12, 20)] == [k for k in map(str, range(20)) if ("flood", k) in store]
    assert store.evictions["budget"] == 12


def test_the_namespace_holding_most_loses_its_oldest_even_when_all_are_small():
    store = SequenceStore(max_state_bytes=None)
    for key, n in ((("a", "1"), 50), (("b", "1"), 10), (("b", "2"), 10), (("a", "2"), 50)):
        store.sync(key, 0, [1] * n)
    store.sync(("a", "1"), 50, [2])  # "a"'s least recent is now "2"
    store.max_state_bytes = store.total_bytes - 1
    assert store.evict_over_budget() == [("a", "2")]
    # Room for drafter state tied to no sequence comes from whoever holds most now: "b" (2 x 10 > 51 tokens).
    assert store.evict_over_budget(shared_bytes=entry_size([1] * 50)) == [("b", "1")]
    assert sorted(store.bytes_by_namespace()) == ["a", "b"]


def test_an_evicted_sequence_resyncs_then_recovers_and_the_resync_is_counted():
    store = SequenceStore(max_state_bytes=entry_size([1] * 11))
    store.sync(("v", "old"), 0, [1] * 10)
    store.sync(("v", "new"), 0, [1] * 10)
    assert store.evict_over_budget() == [("v", "old")]
    assert store.sync(("v", "old"), 10, [2]).tokens is None
    assert store.eviction_resyncs == 1
    assert store.sync(("v", "never-held"), 3, [2]).tokens is None
    assert store.eviction_resyncs == 1, "only resyncs of evicted sequences count"
    assert store.sync(("v", "old"), 0, [1] * 10 + [2]).tokens.tolist() == [1] * 10 + [2]


def test_a_sequence_larger_than_the_budget_is_followed_by_length_only():
    store = SequenceStore(max_state_bytes=entry_size([1] * 100))
    big = store.sync(("v", "big"), 0, [1] * 200)
    assert big.tokens is None and big.oversize and not big.discarded
    assert store.held_tokens == 0 and store.total_bytes == ENTRY_OVERHEAD_BYTES
    # Deltas keep it in step without the tokens (no resync every step) ...
    step = store.sync(("v", "big"), 198, [1, 1, 5])
    assert step.oversize and step.tokens is None
    # ... and the length rules still hold: a gap needs a resync, the full context is oversize again.
    assert not store.sync(("v", "big"), 205, [1]).oversize
    assert store.sync(("v", "big"), 0, [1] * 201).oversize
    assert store.evictions["oversize"] == 2
    # A sequence that grows past the budget is discarded (its drafter state is stale) once.
    store.sync(("v", "grows"), 0, [1] * 50)
    grown = store.sync(("v", "grows"), 50, [1] * 60)
    assert grown.oversize and grown.discarded
    assert store.sync(("v", "grows"), 110, [1]).oversize


def test_drafter_bytes_can_make_a_sequence_oversize():
    store = SequenceStore(max_state_bytes=entry_size([1] * 10, 500))
    store.sync(("v", "r"), 0, [1] * 10)
    assert not store.account(("v", "r"), 500)
    assert store.account(("v", "r"), 501)
    assert store.sync(("v", "r"), 10, [2]).oversize
    assert store.total_bytes == ENTRY_OVERHEAD_BYTES


def test_idle_eviction_is_counted_and_spans_namespaces():
    now = [0.0]
    store = SequenceStore(idle_timeout_s=10, clock=lambda: now[0])
    store.sync(("a", "1"), 0, [1])
    store.sync(("b", "1"), 0, [1])
    now[0] = 5
    store.sync(("b", "2"), 0, [1])
    now[0] = 11
    assert sorted(store.evict_idle()) == [("a", "1"), ("b", "1")]
    assert store.evictions == {"idle": 2} and store.bytes_by_namespace() == {"b": entry_size([1])}
    assert store.sync(("a", "1"), 1, [2]).tokens is None and store.eviction_resyncs == 1


# --- the n-gram drafter's compact state ---------------------------------------------------------

def test_ngram_state_per_held_token_is_within_64_bytes_at_defaults():
    rng = random.Random(0)
    servicer = DrafterServicer(NgramDrafter(), SequenceStore(max_state_bytes=None))
    servicer.load()
    histories = [[rng.randrange(32000) for _ in range(4000)] for _ in range(4)]
    servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[
        seq(str(i), 0, h, draft_len=8) for i, h in enumerate(histories)]))
    drafter_bytes = sum(servicer.drafter.state_bytes(("v", str(i))) for i in range(4))
    assert drafter_bytes > 4 * 3 * 4000 * 4, "three 4-byte slots per token at least (one per pattern size)"
    assert servicer.store.held_tokens == 16000
    assert servicer.store.total_bytes / 16000 <= 64
    for i in range(4):
        servicer.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=[str(i)]))
        assert servicer.drafter.state_bytes(("v", str(i))) == 0
    assert servicer.store.total_bytes == 0


def test_ngram_public_pool_is_shared_state_and_starts_afresh_past_its_cap():
    drafter = NgramDrafter(max_draft_len=3, max_matching_ngram_size=1, is_public_pool=True,
                           max_public_pool_mib=4096 / (1 << 20))
    before = drafter.shared_state_bytes()
    assert drafter.draft(("v", "teacher"), array("i", [3, 1, 4, 1, 5]), 3) == []
    assert drafter.shared_state_bytes() > before
    assert 0 < drafter.state_bytes(("v", "teacher")) < 1000
    assert drafter.draft(("v", "student"), array("i", [9, 3]), 3) == [1, 4, 1]  # from the shared pool
    drafter.draft(("v", "flood"), array("i", range(10, 2010)), 3)
    assert drafter.shared_state_bytes() > 4096
    drafter.draft(("v", "next"), array("i", [7]), 3)  # the pool was over its cap: it starts afresh
    assert drafter.shared_state_bytes() < 4096
    assert drafter.draft(("v", "student2"), array("i", [9, 3]), 3) == []


# --- the servicer ---------------------------------------------------------------------------------

class Sized(Drafter):
    """Echoes, and claims `per_token` bytes per token of each sequence it saw."""

    def __init__(self, per_token: int = 0, broken: bool = False) -> None:
        self.per_token, self.broken = per_token, broken
        self.lengths: dict[tuple[str, str], int] = {}
        self.drafted: list[str] = []
        self.released: list[tuple[str, str]] = []

    def prepare_draft_tokens(self, requests):  # noqa: ANN001, ANN201
        for r in requests:
            self.lengths[r.key] = len(r.tokens)
            self.drafted.append(r.request_id)
        return [[1] * r.draft_len for r in requests]

    def state_bytes(self, key):  # noqa: ANN001, ANN201
        if self.broken:
            raise RuntimeError("cannot count")
        return self.per_token * self.lengths.get(key, 0)

    def on_release(self, key):  # noqa: ANN001, ANN201
        self.lengths.pop(key, None)
        self.released.append(key)


def prepare(servicer: DrafterServicer, verifier_id: str, *sequences: pb.DraftSequence) -> list[tuple[str, int, int]]:
    reply = servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id=verifier_id, sequences=sequences))
    return [(r.request_id, r.status, len(r.draft_tokens)) for r in reply.results]


def loaded(drafter: Drafter, max_state_bytes: int | None) -> DrafterServicer:
    servicer = DrafterServicer(drafter, SequenceStore(max_state_bytes=max_state_bytes))
    servicer.load()
    return servicer


def test_budget_eviction_releases_drafter_state_and_the_next_call_resyncs():
    drafter = Sized(per_token=100)
    servicer = loaded(drafter, max_state_bytes=entry_size([1] * 10, 1000) * 2)
    assert prepare(servicer, "v", seq("a", 0, [1] * 10), seq("b", 0, [1] * 10)) == [("a", OK, 4), ("b", OK, 4)]
    assert prepare(servicer, "v", seq("c", 0, [1] * 10)) == [("c", OK, 4)]
    assert drafter.released == [("v", "a")], "the least recently synced sequence goes, and its drafter state"
    assert servicer.store.total_bytes <= servicer.store.max_state_bytes
    assert prepare(servicer, "v", seq("a", 10, [2]), seq("b", 10, [2])) == [("a", RESYNC, 0), ("b", OK, 4)]
    stats = servicer.state_stats()
    assert stats.evictions["budget"] >= 1 and stats.eviction_resyncs == 1


def test_an_oversize_sequence_gets_no_draft_and_the_others_still_do():
    drafter = Sized()
    servicer = loaded(drafter, max_state_bytes=entry_size([1] * 1000))
    reply = prepare(servicer, "v", seq("huge", 0, [1] * 5000), seq("small", 0, [1] * 10))
    assert reply == [("huge", OK, 0), ("small", OK, 4)]
    assert drafter.drafted == ["small"], "the drafter never sees an oversize sequence"
    assert prepare(servicer, "v", seq("huge", 5000, [1, 2]), seq("small", 10, [3])) == [
        ("huge", OK, 0), ("small", OK, 4)]


def test_a_sequence_whose_drafter_state_outgrows_the_budget_stops_drafting():
    drafter = Sized(per_token=1000)
    # 21 tokens fit with the drafter's 20,000 bytes for 20 tokens, not with its 21,000 for 21.
    servicer = loaded(drafter, max_state_bytes=entry_size([1] * 20, 20 * 1000) + 100)
    assert prepare(servicer, "v", seq("r", 0, [1] * 20)) == [("r", OK, 4)]
    assert prepare(servicer, "v", seq("r", 20, [1])) == [("r", OK, 4)]  # drafted, then found too large
    assert drafter.released == [("v", "r")]
    assert prepare(servicer, "v", seq("r", 21, [1])) == [("r", OK, 0)]
    assert servicer.store.evictions["oversize"] == 1


def test_the_budget_holds_when_the_drafter_fails():
    class Failing(Sized):
        def prepare_draft_tokens(self, requests):  # noqa: ANN001, ANN201
            raise RuntimeError("broken")

    servicer = loaded(Failing(), max_state_bytes=entry_size([1] * 100))
    for i in range(5):
        with pytest.raises(DrafterError):  # INTERNAL, as for any failing drafter
            prepare(servicer, "v", seq(str(i), 0, [1] * 100))
    assert len(servicer.store) == 1 and servicer.store.total_bytes <= servicer.store.max_state_bytes


def test_a_failing_state_bytes_hook_does_not_fail_the_call():
    servicer = loaded(Sized(broken=True), max_state_bytes=1 << 20)
    assert prepare(servicer, "v", seq("r", 0, [1, 2])) == [("r", OK, 4)]
    assert servicer.store.total_bytes == entry_size([1, 2])


# --- a real process -----------------------------------------------------------------------------

def test_flooded_drafter_process_stays_within_its_budget_and_keeps_serving(tmp_path):
    budget_mib = 1.0
    metrics_port = free_port()
    port_file = tmp_path / "port"
    proc = subprocess.Popen([str(DRAFTER_SCRIPT), "ngram", "--host", "127.0.0.1", "--port", "0",
                             "--port-file", str(port_file), "--max-state-mib", str(budget_mib),
                             "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = wait_port(proc, port_file)
        rng = random.Random(0)
        good = [5, 6, 7, 8] * 10
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            grpc.channel_ready_future(channel).result(timeout=30)
            call = wait_serving(stub)
            assert call("good", seq("g", 0, good))[0].status == OK
            for i in range(12):  # ~0.4 MiB a call, so three calls fill the budget
                flood = [seq(f"{i}-{j}", 0, [rng.randrange(32000) for _ in range(3000)]) for j in range(4)]
                assert [r.status for r in call("flood", *flood)] == [OK] * 4
                good.extend([5, 6, 7, 8])
                reply = call("good", seq("g", len(good) - 4, good[-4:]))
                assert reply[0].status == OK and list(reply[0].draft_tokens) == [5, 6, 7, 8]
            # One sequence larger than the whole budget: no draft, and the drafter keeps serving.
            huge = call("huge", seq("h", 0, [rng.randrange(32000) for _ in range(300_000)]))
            assert huge[0].status == OK and not huge[0].draft_tokens
            good.extend([5, 6, 7, 8])
            assert list(call("good", seq("g", len(good) - 4, good[-4:]))[0].draft_tokens) == [5, 6, 7, 8]
        samples = scrape(metrics_port)
        held = sum(v for (name, _), v in samples.items() if name == "splitspec_drafter_state_bytes")
        assert 0 < held <= budget_mib * (1 << 20)
        assert samples[("splitspec_drafter_state_budget_bytes", ())] == budget_mib * (1 << 20)
        assert samples[("splitspec_drafter_state_evictions_total", (("cause", "budget"),))] > 0
        assert samples[("splitspec_drafter_state_evictions_total", (("cause", "oversize"),))] == 1
        assert samples.get(("splitspec_drafter_state_bytes", (("verifier_namespace", "good"),)), 0) > 0
    finally:
        proc.terminate()
        proc.wait(30)


def wait_port(proc: subprocess.Popen, port_file) -> int:  # noqa: ANN001
    import time

    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no port file"
        time.sleep(0.05)
    return int(port_file.read_text())


def wait_serving(stub: drafter_pb2_grpc.DrafterServiceStub):  # noqa: ANN201
    import time

    def call(verifier_id: str, *sequences: pb.DraftSequence):  # noqa: ANN202
        return stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(verifier_id=verifier_id, sequences=sequences),
                                       timeout=30).results

    deadline = time.monotonic() + 30
    while True:
        try:
            call("probe", seq("p", 0, [1]))
            return call
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
