"""A starting replica takes what its peers learned (GetLearnedState, drafter_sdk/server/peers.py): whole, in
pieces, over TLS and tokens, ahead of its own file; and starts cold, never failing, where no peer answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from certs import make_pki
from sdk_support import DRAFTER_SCRIPT, Client, free_port, seq, serving
from test_sdk_learned_state import contexts, drafts, learned, outputs
from test_sdk_metrics import scrape, value
from test_sdk_process import wait_serving

from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server import cli, peers
from drafter_sdk.server.peers import PEERS_TOKEN_NAME, Peers
from drafter_sdk.server.serve import start_server
from drafter_sdk.service.security import auth_metadata, channel_credentials, read_named_tokens, server_credentials


def nobody() -> str:
    """A target nothing listens at: a replica with peers but none up."""
    return f"ipv4:127.0.0.1:{free_port()}"


def at(*clients: Client) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{c.running.port}" for c in clients)


@contextlib.asynccontextmanager
async def peer(drafter: SuffixDrafter, **options: object) -> AsyncIterator[Client]:
    """A replica that shares what it was taught (its own peers are down)."""
    async with serving(drafter, peers=Peers(nobody()), **options) as c:
        yield c


async def learned_state(c: Client, metadata: tuple[tuple[str, str], ...] | None = None) -> list[bytes]:
    return [answer.chunk async for answer in c.stub.GetLearnedState(pb.GetLearnedStateRequest(), timeout=10,
                                                                     metadata=metadata)]


def test_a_starting_replica_drafts_what_its_peer_learned() -> None:
    taught = learned(SuffixDrafter(), outputs(40), verifiers="AB")
    probes = contexts(1)

    async def body() -> None:
        async with peer(taught) as a, serving(SuffixDrafter(), peers=Peers(at(a)), metrics_port=0) as b:
            started = b.running.servicer.drafter
            assert started.cached_requests == 40
            assert started.save_learned() == taught.save_learned()
            assert drafts(started, probes, "AB") == drafts(taught, probes, "AB") and any(drafts(started, probes))
            samples = await scrape(b.running.metrics_port)
            assert value(samples, "learned_state_restores_total", source="peer") == 1
            assert value(samples, "learned_state_restores_total", source="none") == 0

    asyncio.run(body())


def test_the_state_travels_in_pieces_joined_in_order(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(peers, "CHUNK_BYTES", 1000)
    taught = learned(SuffixDrafter(), outputs(40))

    async def body() -> None:
        async with peer(taught, metrics_port=0) as a:
            answers = await learned_state(a)
            assert len(answers) > 3 and all(len(piece) <= 1000 for piece in answers)
            assert b"".join(answers) == taught.save_learned()
            async with serving(SuffixDrafter(), peers=Peers(at(a))) as b:
                assert b.running.servicer.drafter.save_learned() == taught.save_learned()
            samples = await scrape(a.running.metrics_port)
            assert value(samples, "calls_total", method="GetLearnedState", code="OK") == 2

    asyncio.run(body())


def test_a_replica_without_peers_shares_nothing_and_one_still_loading_answers_unavailable() -> None:
    class Slow(SuffixDrafter):
        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def load(self) -> None:
            assert self.release.wait(10)

    async def body() -> None:
        async with serving(learned(SuffixDrafter(), outputs(3))) as alone:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await learned_state(alone)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--peers" in refused.value.details()
        slow = Slow()
        async with serving(slow, wait_loaded=False, peers=Peers(nobody())) as loading:
            with pytest.raises(grpc.aio.AioRpcError) as unavailable:
                await learned_state(loading)
            assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
            slow.release.set()
            await loading.running.wait_loaded()
            assert await learned_state(loading)  # an empty drafter's state, whole

    asyncio.run(body())


def test_a_peer_whose_drafter_fails_to_save_answers_internal_and_keeps_serving() -> None:
    class Broken(SuffixDrafter):
        def save_learned(self) -> bytes:
            raise RuntimeError("a bug")

    async def body() -> None:
        async with peer(Broken()) as broken:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await learned_state(broken)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            async with serving(SuffixDrafter(), peers=Peers(at(broken))) as b:
                assert b.running.servicer.drafter.cached_requests == 0
            assert (await broken.prepare("v", seq("r", 0, [1, 2, 3]))).results[0].status == pb.DRAFT_STATUS_OK

    asyncio.run(body())


def test_a_peer_comes_before_the_file_which_serves_where_no_peer_answers(tmp_path) -> None:  # noqa: ANN001
    state = tmp_path / "suffix.state"
    state.write_bytes(learned(SuffixDrafter(), outputs(3, seed=7)).save_learned())
    taught = learned(SuffixDrafter(), outputs(40))

    async def body() -> None:
        async with peer(taught) as a:
            async with serving(SuffixDrafter(), peers=Peers(at(a)), learned_state_file=state) as b:
                assert b.running.servicer.drafter.save_learned() == taught.save_learned()
            # It saved what it took from its peer at shutdown: that is what the file holds now.
            assert state.read_bytes() == taught.save_learned()
        state.write_bytes(learned(SuffixDrafter(), outputs(3, seed=7)).save_learned())
        async with serving(SuffixDrafter(), peers=Peers(nobody()), learned_state_file=state, metrics_port=0) as b:
            assert b.running.servicer.drafter.cached_requests == 3
            samples = await scrape(b.running.metrics_port)
            assert value(samples, "learned_state_restores_total", source="file") == 1

    asyncio.run(body())


def test_a_peer_whose_state_does_not_fit_is_skipped_for_the_next(caplog) -> None:  # noqa: ANN001
    other_scope = learned(SuffixDrafter(cache_scope="verifier"), outputs(5))
    taught = learned(SuffixDrafter(), outputs(40))
    caplog.set_level(logging.INFO, logger="drafter_sdk.server.peers")

    async def body() -> None:
        async with peer(other_scope) as wrong, peer(taught) as right:
            for _ in range(4):  # peers are asked in random order: the one that fits wins either way
                async with serving(SuffixDrafter(), peers=Peers(at(wrong, right))) as b:
                    assert b.running.servicer.drafter.save_learned() == taught.save_learned()
            async with serving(SuffixDrafter(), peers=Peers(at(wrong)), metrics_port=0) as b:
                assert b.running.servicer.drafter.cached_requests == 0  # it starts cold, and serves
                response = await b.prepare("v", seq("r", 0, [1, 2, 3]))
                assert response.results[0].status == pb.DRAFT_STATUS_OK
                samples = await scrape(b.running.metrics_port)
                assert value(samples, "learned_state_restores_total", source="none") == 1

    asyncio.run(body())
    assert "cannot restore the learned state of peer" in caplog.text and "cache scope" in caplog.text


@contextlib.contextmanager
def silent_peers(n: int) -> Iterator[str]:
    """A target of `n` peers that accept connections and never speak."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
            s.listen()
        yield "ipv4:" + ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in sockets)
    finally:
        for s in sockets:
            s.close()


def test_asking_is_bounded_where_peers_never_answer(caplog) -> None:  # noqa: ANN001
    """Peers that accept connections and never speak (as behind a firewall that drops, or a stuck process):
    a few are asked, each given the connect timeout, and the replica starts cold, not stuck."""
    caplog.set_level(logging.INFO, logger="drafter_sdk.server.peers")

    async def body(target: str) -> None:
        started = time.monotonic()
        async with serving(SuffixDrafter(), peers=Peers(target, connect_timeout_s=0.5, max_asked=2)) as b:
            assert b.running.servicer.drafter.cached_requests == 0
            assert time.monotonic() - started < 10  # not gRPC's own 20 s a connection attempt
            assert (await b.prepare("v", seq("r", 0, [1, 2, 3]))).results[0].status == pb.DRAFT_STATUS_OK

    with silent_peers(4) as target:
        asyncio.run(body(target))
    assert caplog.text.count("gave no learned state: UNAVAILABLE") == 2
    assert "no peer at" in caplog.text


def test_a_server_stopped_while_it_asks_ends_the_question_and_keeps_its_file(tmp_path) -> None:  # noqa: ANN001
    state = tmp_path / "suffix.state"
    saved = learned(SuffixDrafter(), outputs(3)).save_learned()
    state.write_bytes(saved)

    async def body(target: str) -> None:
        running = await start_server(SuffixDrafter(), host="127.0.0.1", port=0, learned_state_file=state,
                                     peers=Peers(target, connect_timeout_s=30))
        await asyncio.sleep(0.5)  # it is connecting to the first peer
        started = time.monotonic()
        await running.stop(0)
        await asyncio.to_thread(running.servicer._worker.shutdown, wait=True)  # the question ended too
        assert time.monotonic() - started < 5  # not the 30 s the connection attempt had
        assert not running.servicer.loaded or running.servicer.drafter.cached_requests == 0

    with silent_peers(3) as target:
        asyncio.run(body(target))
    assert state.read_bytes() == saved  # a drafter that never served saves nothing over its file


def test_a_replica_process_stopped_while_it_asks_exits_at_once(tmp_path) -> None:  # noqa: ANN001
    with silent_peers(3) as target:  # 3 x 5 s to connect, were the questions left to their deadlines
        proc = subprocess.Popen([str(DRAFTER_SCRIPT), "suffix", "--host", "127.0.0.1", "--port", "0", "--peers",
                                 target, "--log-level", "INFO"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            time.sleep(1.5)  # started, and connecting to the first peer
            started = time.monotonic()
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
        finally:
            proc.kill()
    assert proc.returncode == 0, out
    assert time.monotonic() - started < 4, out
    assert "gave no learned state: CANCELLED" in out and "stops asking its peers: the server stops" in out, out


def test_replicas_reach_each_other_with_their_token_and_over_tls(tmp_path) -> None:  # noqa: ANN001
    """Where callers are told apart (named tokens, client certificates), only the replicas' token reads what
    a replica learned: it is every verifier's outputs. Where they are not (one shared token), any caller may."""
    pki = make_pki(tmp_path)
    taught = learned(SuffixDrafter(), outputs(10))
    tls = server_credentials(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
    client_tls = channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)
    tokens = {"verifier-a": "aaaa", PEERS_TOKEN_NAME: "pppp"}

    async def body() -> None:
        async with peer(taught, auth_token="s3cret") as shared:
            for token, cached in [("s3cret", 10), ("wrong", 0), (None, 0)]:
                async with serving(SuffixDrafter(), peers=Peers(at(shared), token=token)) as b:
                    assert b.running.servicer.drafter.cached_requests == cached, token
        server_only = server_credentials(pki.server_cert, pki.server_key)  # TLS, no client certificates
        async with peer(taught, server_credentials=server_only,
                        channel_credentials=channel_credentials(pki.ca_cert)) as a:
            target = f"localhost:{a.running.port}"
            for credentials, cached in [(channel_credentials(pki.ca_cert), 10), (channel_credentials(), 0)]:
                async with serving(SuffixDrafter(), peers=Peers(target, credentials, timeout_s=5)) as b:
                    assert b.running.servicer.drafter.cached_requests == cached  # the system's roots: unknown CA
        async with peer(taught, auth_token=tokens, server_credentials=tls, channel_credentials=client_tls) as a:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await learned_state(a, metadata=auth_metadata("aaaa"))
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert b"".join(await learned_state(a, metadata=auth_metadata("pppp"))) == taught.save_learned()
            target = f"localhost:{a.running.port}"  # the certificate names localhost, not the address
            for credentials, token, cached in [
                (client_tls, "pppp", 10),
                (client_tls, "aaaa", 0),  # a verifier's token: PERMISSION_DENIED, it starts cold
                (client_tls, "wrong", 0),  # UNAUTHENTICATED
                (channel_credentials(pki.ca_cert), "pppp", 0),  # no client certificate
                (None, "pppp", 0),  # plaintext to a TLS peer
            ]:
                async with serving(SuffixDrafter(), peers=Peers(target, credentials, token, timeout_s=5)) as b:
                    assert b.running.servicer.drafter.cached_requests == cached, (credentials, token)

    asyncio.run(body())


def test_the_cli_builds_peers_as_their_clients_reach_them(tmp_path, capsys) -> None:  # noqa: ANN001
    pki = make_pki(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("verifier-a aaaa\npeers pppp\n")
    args = cli.build_parser().parse_args(["suffix", "--peers", "dns:///drafter:50052", "--auth-tokens-file",
                                          str(tokens), "--tls-cert", str(pki.server_cert), "--tls-key",
                                          str(pki.server_key), "--tls-client-ca", str(pki.ca_cert)])
    built = cli.make_peers(args, read_named_tokens(tokens))
    assert (built.target, built.token) == ("dns:///drafter:50052", "pppp") and built.credentials is not None
    tls_only = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    args = cli.build_parser().parse_args(["suffix", "--peers", "x:1", *tls_only, "--peers-ca-file", str(pki.ca_cert)])
    assert cli.make_peers(args, None).credentials is not None
    assert cli.make_peers(cli.build_parser().parse_args(["suffix", "--peers", "x:1"]), "one").token == "one"
    tokens.write_text("verifier-a aaaa\n")
    token = tmp_path / "token"
    token.write_text("one\n")
    mutual_tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca",
                  str(pki.ca_cert)]
    for argv, message in [
        (["ngram", "--peers", "x:1"], "--peers: the ngram drafter keeps nothing across requests"),
        (["suffix", "--peers", "x:1", "--auth-tokens-file", str(tokens)], "name a token 'peers'"),
        (["suffix", "--peers", "x:1", *mutual_tls, "--auth-token-file", str(token)], "told apart by their certif"),
        (["suffix", "--peers-ca-file", str(pki.ca_cert)], "--peers-ca-file needs --peers"),
        (["suffix", "--peers", "x:1", "--peers-ca-file", str(pki.ca_cert)], "serve plaintext (no --tls-cert)"),
        (["suffix", "--peers", "x:1", *tls_only, "--peers-ca-file", str(tmp_path / "none.pem")], "none.pem"),
    ]:
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_replica_process_added_later_drafts_what_the_running_one_learned(tmp_path) -> None:  # noqa: ANN001
    """Two `splitspec-drafter suffix` processes with one --peers target naming both, as the replicas of a
    headless Service: the second, started after the first learned an answer, drafts it at once."""
    ports = [free_port(), free_port()]
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    prompt, output = [5, 6, 7], random.Random(3).sample(range(100, 1000), 60)  # no phrase repeats in it

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [str(DRAFTER_SCRIPT), "suffix", "--host", "127.0.0.1", "--port", str(port),
             "--peers", target, "--log-level", "INFO"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def probe(port: int) -> list[int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)  # the process is listening
            await wait_serving(channel)
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            response = await stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(
                verifier_id="v", sequences=[seq("probe", 0, [9, *output[:20]], draft_len=8)]), timeout=10)
            return list(response.results[0].draft_tokens)

    async def teach(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            await stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(
                verifier_id="v", sequences=[seq("r", 0, prompt + output, draft_len=0, prompt_len=3)]), timeout=10)
            await stub.ReleaseRequests(pb.ReleaseRequestsRequest(
                verifier_id="v", request_ids=["r"], reasons=[pb.RELEASE_REASON_FINISHED]), timeout=10)

    first = start(ports[0])
    second = None
    try:
        assert asyncio.run(probe(ports[0])) == []  # nothing learned yet
        asyncio.run(teach(ports[0]))
        assert asyncio.run(probe(ports[0])) == output[20:28]
        second = start(ports[1])
        assert asyncio.run(probe(ports[1])) == output[20:28]
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.terminate()
    logs = [proc.communicate(timeout=30)[0] for proc in (first, second) if proc is not None]
    assert "no peer at" in logs[0]  # the first found none up: it started cold
    assert f"restored the learned state of peer 127.0.0.1:{ports[0]}" in logs[1]
