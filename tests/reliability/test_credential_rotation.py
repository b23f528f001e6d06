"""Certificates and tokens rotated on disk while the services run, as Kubernetes updates a mounted
Secret (cert-manager renewing a certificate, an operator rotating a token): each takes effect at the
next handshake or call, without a restart, and a rotation that does not load keeps the service up.

The files live in SecretVolumes (tests/certs.py), laid out and swapped as the kubelet does."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import urllib.request

import grpc
import httpx
import openai
import pytest
from certs import SecretVolume, make_pki, tls_files
from reliability_support import Proc, VerifierThread, reference
from verifier_harness import run_verifier, spec_config, token_request

from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from drafter_sdk.proto import verifier_pb2 as pb
from drafter_sdk.service import watched_files
from drafter_sdk.service.security import auth_metadata, channel_credentials, watch_tokens
from verifier_service.tools.local_services import script

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture(scope="module")
def pkis(tmp_path_factory):
    """Three CAs, each with its server and client certificates: the first issue and two renewals."""
    root = tmp_path_factory.mktemp("pkis")
    return [make_pki(root, prefix=f"{n}-") for n in "abc"]


def client(address: str, pki, token: str) -> tuple[grpc.Channel, tuple]:
    """A new channel (a new connection, so a new handshake) trusting `pki`'s CA with its client certificate."""
    return (grpc.secure_channel(address, channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)),
            auth_metadata(token))


def grpc_answer(address: str, pki, token: str) -> str:
    """"ok", or the status code a new client trusting `pki` and sending `token` gets."""
    channel, metadata = client(address, pki, token)
    with channel:
        try:
            verifier_pb2_grpc.VerifierServiceStub(channel).Generate(token_request(PROMPT, 4), timeout=30,
                                                                    metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "ok"


def http_answer(port: int, pki, token: str) -> str:
    """"ok", the HTTP status, or "TLS" where the handshake failed, for a new HTTPS client trusting `pki`."""
    context = ssl.create_default_context(cafile=pki.ca_cert)
    context.load_cert_chain(pki.client_cert, pki.client_key)
    try:
        with httpx.Client(verify=context, timeout=30) as http:
            response = http.get(f"https://localhost:{port}/v1/models", headers={"Authorization": f"Bearer {token}"})
    except httpx.ConnectError:
        return "TLS"
    return "ok" if response.status_code == 200 else str(response.status_code)


def test_the_verifier_takes_a_renewed_certificate_and_a_rotated_token_without_a_restart(tmp_path, pkis, caplog,
                                                                                         monkeypatch):
    monkeypatch.setattr(watched_files, "RECHECK_S", 0.0)  # every use looks: a rotation shows at once
    a, b, c = pkis
    tls = SecretVolume(tmp_path / "tls", tls_files(a))
    token = SecretVolume(tmp_path / "token", {"token": b"first-token\n"})
    with VerifierThread(tls_cert=str(tls / "tls.crt"), tls_key=str(tls / "tls.key"),
                        tls_client_ca=str(tls / "ca.crt"), auth_token=watch_tokens(token / "token"),
                        metrics_port=0) as v:
        address, http_port = v.address.replace("127.0.0.1", "localhost"), v.handle.running.http_port
        # What the kubelet probes instead of the TLS port (it probes gRPC in plaintext only).
        health = f"http://127.0.0.1:{v.handle.running.metrics_port}/health"
        with urllib.request.urlopen(health, timeout=10) as response:
            assert response.status == 200
        assert (grpc_answer(address, a, "first-token"), http_answer(http_port, a, "first-token")) == ("ok", "ok")
        kept, metadata = client(address, a, "first-token")  # a connection made before the rotation
        kept_stub = verifier_pb2_grpc.VerifierServiceStub(kept)
        kept_stub.Generate(token_request(PROMPT, 4), timeout=30, metadata=metadata)

        tls.update(tls_files(b))  # a new CA: clients must trust it, and present certificates it signed
        token.update({"token": b"second-token\n"})
        assert grpc_answer(address, b, "second-token") == "ok"
        assert http_answer(http_port, b, "second-token") == "ok"
        assert grpc_answer(address, a, "second-token") == "UNAVAILABLE"  # the old CA's clients: no handshake
        assert http_answer(http_port, a, "second-token") == "TLS"
        assert grpc_answer(address, b, "first-token") == "UNAUTHENTICATED"
        assert http_answer(http_port, b, "first-token") == "401"
        # The connection made before goes on (TLS checks certificates at the handshake), with the new token.
        kept_stub.Generate(token_request(PROMPT, 4), timeout=30, metadata=auth_metadata("second-token"))
        with pytest.raises(grpc.RpcError) as refused:
            kept_stub.Generate(token_request(PROMPT, 4), timeout=30, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        kept.close()

        # A rotation caught half-way (c's certificate with b's key) keeps b in use, and says so.
        with caplog.at_level(logging.WARNING):
            tls.update({**tls_files(c), "tls.key": b.server_key.read_bytes()})
            token.update({"token": b""})
            assert (grpc_answer(address, b, "second-token"), http_answer(http_port, b, "second-token")) == ("ok", "ok")
        said = caplog.text
        assert "TLS certificate" in said and "TLS certificate (HTTP)" in said and "auth token file" in said, said
        assert "keeping the one in use" in said
        tls.update(tls_files(c))
        token.update({"token": b"third-token"})
        assert (grpc_answer(address, c, "third-token"), http_answer(http_port, c, "third-token")) == ("ok", "ok")


def drafter_info(port: int, pki, token: str) -> str:
    """"ok", or the status code of GetDrafterInfo from a new client trusting `pki` and sending `token`."""
    channel, metadata = client(f"localhost:{port}", pki, token)
    with channel:
        try:
            drafter_pb2_grpc.DrafterServiceStub(channel).GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(),
                                                                        timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "ok"


def test_a_drafter_process_takes_a_renewed_certificate_and_rotated_named_tokens(tmp_path, pkis):
    a, b, _ = pkis
    tls = SecretVolume(tmp_path / "tls", tls_files(a))
    tokens = SecretVolume(tmp_path / "tokens", {"tokens": b"verifier-a aaaa\nverifier-b bbbb\n"})
    with Proc([script("splitspec-drafter"), "ngram", "--log-level", "WARNING", "--tls-cert", str(tls / "tls.crt"),
               "--tls-key", str(tls / "tls.key"), "--tls-client-ca", str(tls / "ca.crt"),
               "--auth-tokens-file", str(tokens / "tokens")], name="rotating-drafter",
              channel_credentials=channel_credentials(a.ca_cert, a.client_cert, a.client_key)) as drafter:
        drafter.start()
        assert [drafter_info(drafter.port, a, t) for t in ("aaaa", "bbbb", "cccc")] == [
            "ok", "ok", "UNAUTHENTICATED"]
        tls.update(tls_files(b))
        tokens.update({"tokens": b"verifier-a cccc\n"})  # b's token revoked, a's rotated
        time.sleep(watched_files.RECHECK_S + 0.2)  # the drafter looks at its files once a second
        assert [drafter_info(drafter.port, b, t) for t in ("aaaa", "bbbb", "cccc")] == [
            "UNAUTHENTICATED", "UNAUTHENTICATED", "ok"]
        assert drafter_info(drafter.port, a, "cccc") == "UNAVAILABLE"


def test_the_verifier_follows_a_renewed_client_certificate_and_token_to_its_drafter(tmp_path, pkis):
    """The drafter restarts after the renewal, as a pod does: the verifier reconnects, and must then trust
    the new CA and present the renewed certificate and token, or every call fails."""
    a, b, _ = pkis
    drafter_tls = SecretVolume(tmp_path / "drafter-tls", tls_files(a))
    verifier_tls = SecretVolume(tmp_path / "verifier-tls", tls_files(a, "client"))
    token = SecretVolume(tmp_path / "token", {"token": b"first-token"})  # one Secret, mounted by both
    with Proc([script("splitspec-drafter"), "ngram", "--log-level", "WARNING",
               "--tls-cert", str(drafter_tls / "tls.crt"), "--tls-key", str(drafter_tls / "tls.key"),
               "--tls-client-ca", str(drafter_tls / "ca.crt"), "--auth-token-file", str(token / "token")],
              name="restarted-drafter",
              channel_credentials=channel_credentials(a.ca_cert, a.client_cert, a.client_key)) as drafter:
        drafter.start()
        spec = spec_config("USER_PROVIDED", 4, f"localhost:{drafter.port}", deadline_ms=2000)
        up = spec.user_provided
        up.tls.ca_cert_file, up.tls.cert_file = str(verifier_tls / "ca.crt"), str(verifier_tls / "tls.crt")
        up.tls.key_file, up.auth_token_file = str(verifier_tls / "tls.key"), str(token / "token")

        async def body() -> tuple[list[pb.GenerationOutput], pb.DrafterHealth, pb.DrafterHealth]:
            async with run_verifier(spec) as v:
                async def generate() -> pb.GenerationOutput:
                    return (await v.stub.Generate(token_request(PROMPT, 12))).output

                async def health() -> pb.DrafterHealth:
                    return (await v.stub.GetServerInfo(pb.GetServerInfoRequest())).drafter

                outputs = [await generate()]
                for volume, files in ((drafter_tls, tls_files(b)), (verifier_tls, tls_files(b, "client")),
                                      (token, {"token": b"second-token"})):
                    volume.update(files)
                outputs.append(await generate())
                drafter.kill()
                drafter.channel_credentials = channel_credentials(b.ca_cert, b.client_cert, b.client_key)
                await asyncio.to_thread(drafter.start)  # on its port, with the renewed files
                # Calls fail while it is down, and until the channel's reconnection backoff and the circuit
                # breaker try again: wait for a request whose calls all reached it.
                give_up, before = time.monotonic() + 30, await health()
                while time.monotonic() < give_up:
                    outputs.append(await generate())
                    earlier, before = before, await health()
                    if before.calls > earlier.calls and before.failures == earlier.failures:
                        break
                    await asyncio.sleep(0.2)
                outputs += [await generate() for _ in range(3)]
                after = await health()
                return outputs, before, after

        outputs, before, after = asyncio.run(body())
    assert all(list(o.token_ids) == list(reference(tuple(PROMPT), 12)) for o in outputs)
    # The calls since the reconnection all reached the drafter: the new certificate and token were taken.
    assert after.calls >= before.calls + 3 and after.failures == before.failures, (before, after)
    assert after.state == pb.DRAFTER_STATE_HEALTHY, after


def test_a_token_rotated_in_three_steps_refuses_no_call(tmp_path, monkeypatch):
    """The rotation security.py describes: one file for both ends of a connection, which their pods see up to
    a minute apart (the kubelet's sync period), lists the new token second (every server takes it), then
    first (every client sends it), then alone. Whichever end sees a step first, no call is refused: not the
    verifier's calls to its drafter, not an API client's until the old key is gone."""
    monkeypatch.setattr(watched_files, "RECHECK_S", 0.0)  # the verifier's files: a change shows at once
    steps = [b"old\n", b"# rotating\nold\nnew\n", b"new\nold\n", b"new\n"]
    drafter_side = SecretVolume(tmp_path / "drafter", {"token": steps[0]})  # the drafter's mount: it serves
    verifier_side = SecretVolume(tmp_path / "verifier", {"token": steps[0]})  # the verifier's: it calls
    api_key = SecretVolume(tmp_path / "api-key", {"token": steps[0]})  # the verifier's API key: it serves
    with Proc([script("splitspec-drafter"), "ngram", "--log-level", "WARNING",
               "--auth-token-file", str(drafter_side / "token")], name="rotating-drafter") as drafter:
        drafter.start()
        spec = spec_config("USER_PROVIDED", 4, f"127.0.0.1:{drafter.port}", deadline_ms=2000)
        spec.user_provided.auth_token_file = str(verifier_side / "token")

        async def body() -> list[list[str]]:
            async with run_verifier(spec, auth_token=watch_tokens(api_key / "token")) as v:
                async def generate() -> None:
                    before = (await v.stub.GetServerInfo(pb.GetServerInfoRequest(),
                                                         metadata=auth_metadata("new"))).drafter
                    out = (await v.stub.Generate(token_request(PROMPT, 12), metadata=auth_metadata("new"))).output
                    after = (await v.stub.GetServerInfo(pb.GetServerInfoRequest(),
                                                        metadata=auth_metadata("new"))).drafter
                    assert list(out.token_ids) == list(reference(tuple(PROMPT), 12))
                    assert after.calls > before.calls and after.failures == before.failures == 0, (before, after)

                async def api(key: str) -> str:
                    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{v.running.http_port}/v1", api_key=key)
                    try:
                        await client.models.list()
                    except openai.AuthenticationError:
                        return "401"
                    finally:
                        await client.close()
                    return "ok"

                answers = []
                for number, step in enumerate(steps[1:], 1):
                    api_key.update({"token": step})
                    answers.append(await asyncio.gather(
                        *(api(key) for key in ("old", "new")),
                        *(grpc_key(v.stub, key) for key in ("old", "new"))))
                    # Step 2 reaches the verifier (the client) first, step 3 the drafter (the server): the orders
                    # in which a switch made in one step refuses calls.
                    order = (verifier_side, drafter_side) if number == 2 else (drafter_side, verifier_side)
                    for volume in order:
                        volume.update({"token": step})
                        if volume is drafter_side:
                            await asyncio.sleep(1.2)  # its process looks at the file once a second
                        await generate()
                return answers

        answers = asyncio.run(body())
    assert answers == [
        ["ok", "ok", "ok", "ok"],  # old and new keys, over HTTP (the openai client), then over gRPC
        ["ok", "ok", "ok", "ok"],
        ["401", "ok", "UNAUTHENTICATED", "ok"],
    ]


async def grpc_key(stub: verifier_pb2_grpc.VerifierServiceStub, key: str) -> str:
    try:
        await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=auth_metadata(key))
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "ok"
