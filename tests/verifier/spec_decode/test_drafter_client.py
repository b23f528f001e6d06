"""DrafterClient's overlapping deltas: what it sends, how it reacts, and replicas behind round_robin.

In-process replicas (SDK servicers behind a fake round-robin transport) for the
client's rules and the byte bound; two real SDK servers behind one gRPC target
with round_robin for the protocol end to end.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from round_robin import ANSWER_LOST, RoundRobin

from drafter_sdk import CACHE_SALT, LEARNS_FROM_FINISHED, Drafter, DraftRequest, ReleaseReason, start_server
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.spec_decode import drafter_client
from verifier_service.spec_decode.drafter_client import DeltaHistory, DrafterClient, DraftQuery, ReleasedRequest
from verifier_service.spec_decode.transport import GrpcTransport
from verifier_service.tools.local_services import free_port

OK = pb.DRAFT_STATUS_OK
RESYNC = pb.DRAFT_STATUS_RESYNC_REQUIRED


class Echo(Drafter):
    """Drafts the last draft_len tokens; counts the sequences it was asked about (= in sync)."""

    name = "echo"

    def __init__(self) -> None:
        self.in_sync = 0
        self.histories: dict[tuple[str, str], list[int]] = {}

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.in_sync += len(requests)
        for r in requests:
            self.histories[r.key] = list(r.tokens)
        return [list(r.tokens[len(r.tokens) - r.draft_len:]) if r.draft_len else [] for r in requests]


def replica() -> DrafterServicer:
    servicer = DrafterServicer(Echo())
    servicer.load()
    return servicer


def query(tokens: list[int], history: DeltaHistory, request_id: str = "r", draft_len: int = 3) -> DraftQuery:
    """One sequence's query; `history` is what the verifier keeps on that sequence between calls."""
    return DraftQuery(request_id, tokens, prompt_len=min(3, len(tokens)), draft_len=draft_len, history=history)


def sent_deltas(transport: RoundRobin) -> list[tuple[int, list[int]]]:
    return [(r.sequences[0].context_len, list(r.sequences[0].new_tokens)) for r in transport.sent]


def test_client_re_sends_the_last_overlap_steps_and_the_whole_context_until_it_has_them():
    async def body():
        transport = RoundRobin(replica())
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=3)
        h = DeltaHistory()  # kept on the sequence by the verifier
        tokens = [1, 2, 3]
        for step in range(6):
            await client.propose([query(tokens, h)])
            tokens = tokens + [10 + step]
        # Lengths after the calls: 3, 4, 5, 6, 7, 8. The first three calls carry everything;
        # then each starts where the third most recent call ended.
        assert [ctx for ctx, _ in sent_deltas(transport)] == [0, 0, 0, 3, 4, 5]
        assert sent_deltas(transport)[4] == (4, [11, 12, 13])  # committed: 1 2 3 10 | 11 12 13
        assert client.context_len(h) == 6

    asyncio.run(body())


def test_overlap_steps_1_sends_plain_deltas():
    async def body():
        transport = RoundRobin(replica())
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        h = DeltaHistory()  # kept on the sequence by the verifier
        await client.propose([query([1, 2, 3], h)])
        await client.propose([query([1, 2, 3, 4, 5], h)])
        assert sent_deltas(transport) == [(0, [1, 2, 3]), (3, [4, 5])]

    asyncio.run(body())


def test_one_replica_gets_plain_deltas_whatever_overlap_steps_says_and_replicas_get_overlaps_again():
    """A draft stream lives on one replica: it needs no overlap. A fallback to unary calls spread
    over replicas re-sends overlap_steps calls' worth again."""
    async def body():
        transport = RoundRobin(replica())
        transport.one_replica = True
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=3)
        h = DeltaHistory()  # kept on the sequence by the verifier
        for tokens in ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):
            await client.propose([query(tokens, h)])
        assert sent_deltas(transport) == [(0, [1, 2, 3]), (3, [4]), (4, [5, 6])]
        transport.one_replica = False  # the drafter lost its stream: unary calls
        await client.propose([query([1, 2, 3, 4, 5, 6, 7], h)])
        assert sent_deltas(transport)[-1] == (3, [4, 5, 6, 7])  # from the third most recent call
        assert (await client.propose([query([1, 2, 3, 4, 5, 6, 7, 8], h)])).drafts != [[]]

    asyncio.run(body())


def test_overlap_steps_must_be_positive():
    with pytest.raises(ValueError, match="overlap_steps"):
        DrafterClient(RoundRobin(replica()), "v", vocab_size=100, deadline_s=1.0, overlap_steps=0)


def test_resync_forgets_the_history_and_a_failed_call_keeps_it():
    async def body():
        servicer = replica()
        transport = RoundRobin(servicer)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=2)
        h = DeltaHistory()  # kept on the sequence by the verifier
        tokens = [1, 2, 3]
        for _ in range(3):
            tokens = tokens + [len(tokens)]
            await client.propose([query(tokens, h)])
        assert client.context_len(h) == 5
        transport.fate = ANSWER_LOST
        tokens = tokens + [9]
        reply = await client.propose([query(tokens, h)])
        assert reply.failed == [True] and client.context_len(h) == 5  # unchanged
        servicer.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["r"]))  # the replica lost it
        tokens = tokens + [8]
        reply = await client.propose([query(tokens, h)])
        assert reply.drafts == [[]] and reply.failed == [False] and client.stats.resyncs == 1
        assert client.context_len(h) == 0
        for _ in range(3):
            tokens = tokens + [7]
            reply = await client.propose([query(tokens, h)])
            assert reply.drafts == [tokens[-3:]]
        assert [ctx for ctx, _ in sent_deltas(transport)][-4:] == [5, 0, 0, 9]

    asyncio.run(body())


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_round_robin_replicas_stay_in_sync_without_resyncs(replicas):
    async def body():
        servicers = [replica() for _ in range(replicas)]
        transport = RoundRobin(*servicers)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=8)
        rng = random.Random(replicas)
        ha, hb = DeltaHistory(), DeltaHistory()
        contexts = {rid: [rng.randrange(100) for _ in range(20)] for rid in ("a", "b")}
        for _ in range(40):
            reply = await client.propose([query(contexts["a"], ha, "a"), query(contexts["b"], hb, "b")])
            assert reply.drafts == [contexts["a"][-3:], contexts["b"][-3:]]
            for tokens in contexts.values():  # 1 to 4 tokens committed per step
                tokens.extend(rng.randrange(100) for _ in range(rng.randint(1, 4)))
        assert client.stats.resyncs == 0
        # Every replica drafted for both sequences on every call it got.
        assert [s.drafter.in_sync for s in servicers] == [2 * len(range(i, 40, replicas)) for i in range(replicas)]

    asyncio.run(body())


def test_without_overlap_round_robin_replicas_resync_every_other_step():
    """Why the overlap exists: plain deltas (overlap 1) over two replicas lock into a resync on
    every other call, because the full context always lands on the replica that has it already."""

    async def body():
        transport = RoundRobin(replica(), replica())
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        h = DeltaHistory()  # kept on the sequence by the verifier
        tokens = list(range(10))
        for step in range(20):
            await client.propose([query(tokens, h)])
            tokens = tokens + [step]
        assert client.stats.resyncs == 10
        assert [s.drafter.in_sync for s in transport.replicas] == [10, 0]

    asyncio.run(body())


def test_more_replicas_than_overlap_steps_resync_but_stay_correct():
    async def body():
        servicers = [replica() for _ in range(3)]
        transport = RoundRobin(*servicers)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=2)
        h = DeltaHistory()  # kept on the sequence by the verifier
        tokens = list(range(10))
        for step in range(30):
            reply = await client.propose([query(tokens, h)])
            assert reply.drafts in ([[]], [tokens[-3:]])
            tokens = tokens + [step % 7]
        assert client.stats.resyncs > 0
        for servicer in servicers:  # whatever a replica holds is a true prefix of the context
            for held in servicer.drafter.histories.values():
                assert held == tokens[:len(held)]

    asyncio.run(body())


def test_bytes_per_call_stay_flat_as_the_context_grows():
    async def body():
        transport = RoundRobin(replica(), replica())
        client = DrafterClient(transport, "v", vocab_size=50_000, deadline_s=1.0, overlap_steps=8)
        h = DeltaHistory()  # kept on the sequence by the verifier
        rng = random.Random(0)
        tokens = [rng.randrange(50_000) for _ in range(100)]
        sizes: dict[int, int] = {}
        step = 0
        while len(tokens) < 2_000:
            await client.propose([query(tokens, h, draft_len=4)])
            sizes[len(tokens)] = client.stats.last_request_bytes
            tokens.extend(rng.randrange(50_000) for _ in range(1 + step % 5))  # 1..5 tokens per step
            step += 1
        steady = [size for length, size in sizes.items() if length >= 150]
        first = sizes[100]
        assert first > 100 * 2  # the first call carries the whole 100-token context
        # Afterwards every call carries the tokens of its last 8 steps (at most 40), whatever the length.
        assert max(steady) < 40 * 3 + 60
        late = [size for length, size in sizes.items() if length >= 1_800]
        early = [size for length, size in sizes.items() if 150 <= length < 400]
        assert max(late) <= max(early) + 4 and min(late) >= min(early) - 4

    asyncio.run(body())


def test_two_grpc_replicas_behind_one_round_robin_target():
    """Two SDK drafter servers, one `ipv4:a,b` target with round_robin: both serve, no resyncs,
    a drafter call on every step; one replica losing its state costs it exactly one resync."""

    async def body():
        drafters = [Echo(), Echo()]
        servers = [await start_server(d, host="127.0.0.1", port=0) for d in drafters]
        try:
            for server in servers:
                await server.wait_loaded()
            ports = [server.port for server in servers]
            transport = GrpcTransport(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                                      load_balancing_policy="round_robin")
            client = DrafterClient(transport, "v-rr", vocab_size=1000, deadline_s=5.0, overlap_steps=8)
            h = DeltaHistory()  # kept on the sequence by the verifier
            rng = random.Random(1)
            tokens = [rng.randrange(1000) for _ in range(50)]
            drafted = 0
            for step in range(40):
                if step == 20:  # replica 0 loses every sequence (a restart, an eviction)
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
                        await drafter_pb2_grpc.DrafterServiceStub(channel).ReleaseRequests(
                            pb.ReleaseRequestsRequest(verifier_id="v-rr", request_ids=["r"]), timeout=5)
                reply = await client.propose([query(tokens, h, draft_len=4)])
                assert not reply.failed[0], client.stats.last_error
                drafted += reply.drafts == [tokens[-4:]]
                tokens.extend(rng.randrange(1000) for _ in range(rng.randint(1, 5)))
            await client.close()
            assert all(d.in_sync > 0 for d in drafters), [d.in_sync for d in drafters]
            # Before the loss: none; after it: one from the replica that lost the sequence (at most
            # one more from a replica that connected late).
            assert 1 <= client.stats.resyncs <= 2
            assert drafted >= 40 - client.stats.resyncs
            for d in drafters:
                held = d.histories[("v-rr", "r")]
                assert held == tokens[:len(held)]
        finally:
            for server in servers:
                await server.stop(0)

    asyncio.run(body())


class CountingInfo(RoundRobin):
    """Counts GetDrafterInfo calls; `unimplemented` makes them fail as a drafter without the method would."""

    def __init__(self, *servicers: DrafterServicer, unimplemented: bool = False) -> None:
        super().__init__(*servicers)
        self.info_calls = 0
        self.unimplemented = unimplemented

    async def info(self, timeout_s: float) -> pb.GetDrafterInfoResponse:
        self.info_calls += 1
        if self.unimplemented:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata())
        return await super().info(timeout_s)


def test_the_client_learns_who_the_drafter_is_on_connect_and_after_it_lost_state():
    async def body():
        servicer = replica()
        transport = CountingInfo(servicer)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        await client.connect()
        assert transport.info_calls == 1 and client.info.name == "echo"
        h, tokens = DeltaHistory(), [1, 2, 3]
        for _ in range(3):
            tokens = tokens + [4]
            await client.propose([query(tokens, h)])
        await asyncio.sleep(0)
        assert transport.info_calls == 1  # known, in sync: not asked again
        servicer.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["r"]))  # a restart loses it
        await client.propose([query(tokens + [5], h)])
        await asyncio.gather(*client._background)
        assert transport.info_calls == 2

    asyncio.run(body())


def test_a_drafter_without_get_drafter_info_is_asked_once():
    async def body():
        transport = CountingInfo(replica(), unimplemented=True)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        await client.connect()
        h, tokens = DeltaHistory(), [1, 2, 3]
        for _ in range(4):
            tokens = tokens + [4]
            reply = await client.propose([query(tokens, h)])
            await asyncio.gather(*client._background)
        assert reply.drafts == [tokens[-3:]] and transport.info_calls == 1
        assert client.info == pb.GetDrafterInfoResponse()

    asyncio.run(body())


class Learner(Echo):
    """Echo that learns from finished requests (it has something to save) and keeps no cache salts apart."""

    name = "learner"
    capabilities = (LEARNS_FROM_FINISHED,)

    def __init__(self) -> None:
        super().__init__()
        self.salts: dict[tuple[str, str], str] = {}
        self.finished: list[tuple[str, str]] = []

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.salts.update((r.key, r.cache_salt_id) for r in requests)
        return super().prepare_draft_tokens(requests)

    def on_release(self, key: tuple[str, str], reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        if reason == ReleaseReason.FINISHED:
            self.finished.append(key)

    def save_learned(self) -> bytes:
        return b""


class SaltedLearner(Learner):
    name = "salted-learner"
    capabilities = (LEARNS_FROM_FINISHED, CACHE_SALT)


@pytest.mark.parametrize("drafter", [Echo, Learner, SaltedLearner])
def test_a_salted_sequence_reaches_only_a_drafter_that_keeps_cache_salts_apart(drafter: type[Echo], caplog):
    """One that learns nothing across requests (the SDK advertises CACHE_SALT for it) or says it keeps
    salts apart is sent the salted sequence, its salt's id in each call, its last tokens and its release;
    one that learns across requests and does not say so is sent nothing of it: no draft, no failure, and
    one warning saying so."""
    async def body():
        d = drafter()
        servicer = DrafterServicer(d)
        servicer.load()
        transport = RoundRobin(servicer)
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        await client.connect()
        sees = drafter is not Learner
        assert (CACHE_SALT in client.info.capabilities) == sees
        salted = DraftQuery("s", [1, 2, 3, 4], 3, 2, DeltaHistory(), cache_salt_id="ab")
        plain = query([5, 6, 7, 8], DeltaHistory(), request_id="p", draft_len=2)
        reply = await client.propose([salted, plain])
        assert reply.drafts == [[3, 4] if sees else [], [7, 8]] and reply.failed == [False, False]
        assert [(q.request_id, q.cache_salt_id) for q in transport.sent[-1].sequences] == (
            [("s", "ab"), ("p", "")] if sees else [("p", "")])
        transport.fate = "lost on the way"
        assert (await client.propose([salted, plain])).failed == [sees, True]
        finished = pb.RELEASE_REASON_FINISHED
        client.release([ReleasedRequest("s", finished, [1, 2, 3, 4, 9], 3, salted.history, "ab"),
                        ReleasedRequest("p", finished, [5, 6, 7, 8, 9], 3, plain.history)])
        await asyncio.gather(*client._background)
        assert set(d.histories) == ({("v", "s"), ("v", "p")} if sees else {("v", "p")})
        if isinstance(d, Learner):
            assert d.histories[("v", "p")] == [5, 6, 7, 8, 9]  # the final sync
            assert d.salts == ({("v", "s"): "ab", ("v", "p"): ""} if sees else {("v", "p"): ""})
            assert d.finished == ([("v", "s"), ("v", "p")] if sees else [("v", "p")])
        said = [r.getMessage() for r in caplog.records if "cache salts apart" in r.getMessage()]
        assert said == ([] if sees else ["drafter learner does not say it keeps cache salts apart (no 'cache-salt' "
                                         "capability): requests with a cache_salt run without its drafts "
                                         "(PROTOCOL.md section 7)"])

    asyncio.run(body())


def test_while_salted_sequences_wait_the_drafter_is_asked_again_until_it_keeps_salts_apart(monkeypatch, caplog):
    """Salted traffic alone makes no call that would ask who the drafter is. So while a salted sequence is
    not sent, the client asks again, now and then: a drafter still down when the verifier connected (a pod
    started after it; said once, however often asked) and then one that does not keep salts apart, replaced
    by one that does (a rolling upgrade), are found without a single unsalted request."""
    monkeypatch.setattr(drafter_client, "INFO_RECHECK_S", 0.05)

    async def until_told(client: DrafterClient, name: str) -> None:
        for _ in range(200):
            client.sees("ab")  # as each engine step does while the salted sequence waits
            if client.info is not None and client.info.name == name:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the client did not learn of {name}")

    async def body():
        port = free_port()  # nothing listens on it yet
        client = DrafterClient(GrpcTransport(f"127.0.0.1:{port}"), "v", vocab_size=100, deadline_s=1.0,
                               overlap_steps=1)
        await client.connect(timeout_s=0.2)
        assert client.info is None and client.sees("") and not client.sees("ab")
        salted = DraftQuery("s", [1, 2, 3, 4], 3, 2, DeltaHistory(), cache_salt_id="ab")
        assert (await client.propose([salted])).drafts == [[]] and client.stats.calls == 0
        for _ in range(6):  # asked again, still down
            assert not client.sees("ab")
            await asyncio.sleep(0.06)
            await asyncio.gather(*client._background)
        assert sum("not reachable yet" in r.getMessage() for r in caplog.records) == 1
        for drafter in (Learner(), SaltedLearner()):
            server = await start_server(drafter, host="127.0.0.1", port=port, grace_period_s=0.0)
            try:
                await server.wait_loaded()
                await until_told(client, drafter.name)
                sees = drafter.name == "salted-learner"
                assert client.sees("ab") == sees
                assert (await client.propose([salted])).drafts == [[3, 4] if sees else []]
            finally:
                await server.stop(0)
        await client.close()
        said = [r.getMessage() for r in caplog.records]
        assert sum("does not say it keeps cache salts apart" in m for m in said) == 1, said

    asyncio.run(body())


def test_replicas_that_differ_are_relied_on_only_for_what_every_one_lists(monkeypatch, caplog):
    """A rolling update behind one target: a replica that keeps cache salts apart beside one that does not.
    Whichever answers GetDrafterInfo, a salted sequence is not sent (round_robin could take it to the other),
    until the other is replaced too; the difference is said once."""
    monkeypatch.setattr(drafter_client, "INFO_RECHECK_S", 0.05)

    async def body():
        old = await start_server(Learner(), host="127.0.0.1", port=0, grace_period_s=0.0)
        new = await start_server(SaltedLearner(), host="127.0.0.1", port=0, grace_period_s=0.0)
        servers = [old, new]
        try:
            for server in servers:
                await server.wait_loaded()
            ports = [old.port, new.port]
            client = DrafterClient(GrpcTransport(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"), "v",
                                   vocab_size=100, deadline_s=1.0, overlap_steps=1)
            names = set()
            for _ in range(50):  # round_robin takes each ready replica in turn for the call that asks
                await client._ask_info(1.0)
                names.add(client.info.name)
                assert CACHE_SALT not in client.info.capabilities and not client.sees("ab")
                if len(names) == 2:
                    break
            assert names == {"learner", "salted-learner"}
            await old.stop(0)
            servers[0] = await start_server(SaltedLearner(), host="127.0.0.1", port=ports[0], grace_period_s=0.0)
            await servers[0].wait_loaded()
            for _ in range(200):
                if client.sees("ab"):
                    break
                await asyncio.sleep(0.05)
            assert client.sees("ab")
            await client.close()
        finally:
            for server in servers:
                await server.stop(0)
        said = [r.getMessage() for r in caplog.records if "replicas behind" in r.getMessage()]
        assert len(said) == 1 and "lacking: 'cache-salt' (version " in said[0], said

    asyncio.run(body())


def test_after_a_restart_a_salted_sequence_waits_for_the_drafter_to_say_who_it_is():
    """A drafter that kept cache salts apart restarts as one that does not (a downgrade): its first answer
    after the restart (RESYNC_REQUIRED: it lost state) makes the client ask who it is, and until it has
    answered, the salted sequence's whole context is not sent on the old drafter's word."""
    async def body():
        transport = RoundRobin(DrafterServicer(SaltedLearner()))
        transport.replicas[0].load()
        client = DrafterClient(transport, "v", vocab_size=100, deadline_s=1.0, overlap_steps=1)
        await client.connect()
        salted = DraftQuery("s", [1, 2, 3, 4], 3, 2, DeltaHistory(), cache_salt_id="ab")
        assert (await client.propose([salted])).drafts == [[3, 4]]
        downgraded = Learner()
        transport.replicas[0] = DrafterServicer(downgraded)
        transport.replicas[0].load()
        salted.tokens.append(5)
        await client.propose([salted])  # its delta: the restarted drafter knows nothing of it
        salted.tokens.append(6)
        assert (await client.propose([salted])).drafts == [[]]  # before the ask is answered: nothing sent
        await asyncio.gather(*client._background)
        assert client.info.name == "learner" and not client.sees("ab")
        await client.propose([salted])
        assert ("v", "s") not in downgraded.histories and downgraded.salts == {}

    asyncio.run(body())
