"""TLS, mutual TLS and bearer-token auth of drafter servers (drafter_sdk.service.security)."""

import asyncio
import os
import signal
import subprocess

import grpc
import pytest
from certs import make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sdk_support import DRAFTER_SCRIPT, RecordingDrafter, seq, serving

from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server import cli
from drafter_sdk.service.security import (
    BearerTokenServerInterceptor,
    auth_metadata,
    call_credentials,
    channel_credentials,
    read_named_tokens,
    read_token,
    read_tokens,
    server_credentials,
)

TOKEN = "s3cret-token"


async def assert_ok(c, metadata=None) -> None:
    response = await c.prepare("v", seq("r", 0, [1, 2, 3], draft_len=1), metadata=metadata)
    assert list(response.results[0].draft_tokens) == [3]


async def assert_refused(c, code: grpc.StatusCode, metadata=None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.prepare("v", seq("r", 0, [1, 2, 3]), metadata=metadata)
    assert info.value.code() == code, info.value.details()


def test_tls_serves_clients_that_trust_the_ca_only(tmp_path):
    pki = make_pki(tmp_path)
    other = make_pki(tmp_path, prefix="other-")

    async def body():
        creds = server_credentials(pki.server_cert, pki.server_key)
        async with serving(RecordingDrafter(), server_credentials=creds,
                           channel_credentials=channel_credentials(pki.ca_cert)) as c:
            await assert_ok(c)
        async with serving(RecordingDrafter(), server_credentials=creds,
                           channel_credentials=channel_credentials(other.ca_cert)) as c:
            await assert_refused(c, grpc.StatusCode.UNAVAILABLE)  # the server's certificate is not trusted
        async with serving(RecordingDrafter(), server_credentials=creds) as c:  # a plaintext client
            await assert_refused(c, grpc.StatusCode.UNAVAILABLE)

    asyncio.run(body())


@pytest.mark.parametrize("client", ["valid", "none", "foreign"])
def test_mutual_tls_requires_a_client_certificate_from_the_ca(tmp_path, client):
    pki = make_pki(tmp_path)
    foreign = make_pki(tmp_path, prefix="foreign-")
    client_creds = {
        "valid": channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key),
        "none": channel_credentials(pki.ca_cert),
        "foreign": channel_credentials(pki.ca_cert, foreign.client_cert, foreign.client_key),
    }[client]

    async def body():
        creds = server_credentials(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
        async with serving(RecordingDrafter(), server_credentials=creds, channel_credentials=client_creds) as c:
            if client == "valid":
                await assert_ok(c)
            else:
                await assert_refused(c, grpc.StatusCode.UNAVAILABLE)

    asyncio.run(body())


def test_bearer_token_is_required_on_the_drafter_service_only():
    async def body():
        async with serving(RecordingDrafter(), auth_token=TOKEN) as c:
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED)
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED, metadata=auth_metadata("wrong"))
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED, metadata=(("authorization", TOKEN),))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.stub.GetDrafterInfo(pb.GetDrafterInfoRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await assert_ok(c, metadata=auth_metadata(TOKEN))
            await assert_ok(c, metadata=(("authorization", f"bearer {TOKEN}"),))  # the scheme is case-insensitive

            health = await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(c.channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            assert [r async for r in reflection][0].list_services_response.service

    asyncio.run(body())


def test_named_tokens_keep_each_clients_sequences_its_own():
    """Two clients with two named tokens send the same verifier_id and request id: neither can
    release, overwrite or feed the other's sequence, and a shared verifier_id stays two namespaces."""
    alice, mallory = auth_metadata("alice-token"), auth_metadata("mallory-token")
    drafter = RecordingDrafter()

    async def body():
        async with serving(drafter, auth_token={"alice": "alice-token", "mallory": "mallory-token"}) as c:
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED, metadata=auth_metadata("nobody"))
            first = await c.prepare("v", seq("r", 0, [1, 2, 3], draft_len=1), metadata=alice)
            assert list(first.results[0].draft_tokens) == [3]
            # Mallory, sending Alice's verifier_id: a release finds nothing, a delta is a stranger's.
            released = await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["r"]),
                                                    metadata=mallory, timeout=10)
            assert released.released == 0
            stranger = await c.prepare("v", seq("r", 3, [9]), metadata=mallory)
            assert stranger.results[0].status == pb.DRAFT_STATUS_RESYNC_REQUIRED
            await c.prepare("v", seq("r", 0, [7, 7, 7, 7]), metadata=mallory)  # her own sequence "r"
            # Alice's sequence is intact: her next delta extends her own history.
            again = await c.prepare("v", seq("r", 3, [4], draft_len=4), metadata=alice)
            assert again.results[0].status == pb.DRAFT_STATUS_OK
            assert drafter.calls[-1][0].tokens == [1, 2, 3, 4]
            assert drafter.calls[-1][0].key == ("v@token:alice", "r")
            assert drafter.released == []
            assert set(c.running.servicer.state_stats().bytes_by_namespace) == {"v@token:alice", "v@token:mallory"}

    asyncio.run(body())


def test_a_client_certificate_names_the_namespace(tmp_path):
    pki = make_pki(tmp_path)
    drafter = RecordingDrafter()

    async def body():
        creds = server_credentials(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
        async with serving(drafter, server_credentials=creds,
                           channel_credentials=channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)) as c:
            await assert_ok(c)
        assert drafter.calls[-1][0].key == ("v@cert:CN=splitspec test client", "r")

    asyncio.run(body())


def test_without_identity_the_verifier_id_is_the_namespace():
    """One shared token identifies nobody: the namespace is the verifier_id as sent."""
    drafter = RecordingDrafter()

    async def body():
        async with serving(drafter, auth_token=TOKEN) as c:
            await assert_ok(c, metadata=auth_metadata(TOKEN))
        assert drafter.calls[-1][0].key == ("v", "r")

    asyncio.run(body())


@pytest.mark.parametrize("text, message", [
    ("alice a-token\nbob a-token\n", "'bob' has the token of 'alice'"),
    ("alice\n", "expected 'name token'"),
    ("# nobody\n\n", "names no token"),
])
def test_read_named_tokens_refuses_ambiguous_files(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_named_tokens(path)
    # A name on two lines: its old and new token while it rotates (the first is the one its client sends).
    path.write_text("# two clients\nalice a-new\n\nbob  b-token  \nalice a-old\nalice a-new\n")
    assert read_named_tokens(path) == {"alice": ("a-new", "a-old"), "bob": ("b-token",)}


@pytest.mark.parametrize("text, message", [
    ("old new\n", "expected one token a line"),
    ("# nothing yet\n\n", "is empty"),
])
def test_a_token_file_lists_one_token_a_line(tmp_path, text, message):
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_tokens(path)
    path.write_text("# rotating: new first from 12-07\nnew\n\n  old  \n")
    assert read_tokens(path) == ("new", "old")
    assert read_token(path) == "new"  # what a client sends


def test_every_listed_token_is_taken_and_a_named_clients_tokens_share_its_namespace():
    """During a rotation a server takes the old and the new token alike; a named client's sequences stay
    its own whichever of its tokens a call carries."""
    drafter = RecordingDrafter()

    async def body():
        async with serving(RecordingDrafter(), auth_token=("new", "old")) as c:
            for token in ("new", "old"):
                await assert_ok(c, metadata=auth_metadata(token))
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED, metadata=auth_metadata("older"))
        async with serving(drafter, auth_token={"alice": ("a-new", "a-old"), "bob": "b-token"}) as c:
            await c.prepare("v", seq("r", 0, [1, 2, 3], draft_len=1), metadata=auth_metadata("a-old"))
            again = await c.prepare("v", seq("r", 3, [4], draft_len=4), metadata=auth_metadata("a-new"))
            assert again.results[0].status == pb.DRAFT_STATUS_OK  # the same sequence, under the new token
            assert drafter.calls[-1][0].key == ("v@token:alice", "r") and drafter.calls[-1][0].tokens == [1, 2, 3, 4]
            await assert_refused(c, grpc.StatusCode.UNAUTHENTICATED, metadata=auth_metadata("a-older"))

    asyncio.run(body())


def test_token_as_call_credentials_over_mutual_tls(tmp_path):
    pki = make_pki(tmp_path)

    async def body():
        creds = grpc.composite_channel_credentials(
            channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key), call_credentials(TOKEN))
        async with serving(RecordingDrafter(), auth_token=TOKEN, channel_credentials=creds,
                           server_credentials=server_credentials(pki.server_cert, pki.server_key, pki.ca_cert)) as c:
            await assert_ok(c)

    asyncio.run(body())


def test_the_interceptor_refuses_streaming_calls_too():
    async def count(request: bytes, context):
        for i in range(3):
            yield bytes([i])

    async def body():
        server = grpc.aio.server(interceptors=[BearerTokenServerInterceptor(TOKEN)])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Counter", {"Count": grpc.unary_stream_rpc_method_handler(count)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method = channel.unary_stream("/test.Counter/Count")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in method(b"", timeout=5)]
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert [r async for r in method(b"", timeout=5, metadata=auth_metadata(TOKEN))] == [b"\0", b"\1", b"\2"]
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_read_token_prefers_the_file_and_strips_whitespace(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv("SPLITSPEC_AUTH_TOKEN", "from-env")
    assert read_token(token_file) == TOKEN
    assert read_token() == "from-env"
    monkeypatch.delenv("SPLITSPEC_AUTH_TOKEN")
    assert read_token() is None
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(token_file)
    with pytest.raises(ValueError):
        BearerTokenServerInterceptor("")
    with pytest.raises(ValueError):
        channel_credentials(cert_file=tmp_path / "only-a-cert.pem")


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
    (["--auth-token-file", "/nonexistent/token"], "No such file"),
    (["--auth-tokens-file", "/nonexistent/tokens"], "No such file"),
    (["--auth-tokens-file", "a", "--auth-token-file", "b"], "exclude each other"),
])
def test_cli_refuses_incomplete_security_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["ngram", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_serves_mutual_tls_with_a_token_from_the_environment(tmp_path):
    pki = make_pki(tmp_path)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [str(DRAFTER_SCRIPT), "ngram", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca_cert),
         "--log-level", "WARNING"],
        env=dict(os.environ, SPLITSPEC_AUTH_TOKEN=TOKEN), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async def body():
            while not port_file.exists():
                assert proc.poll() is None, proc.communicate()[0]
                await asyncio.sleep(0.05)
            creds = channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)
            async with grpc.aio.secure_channel(f"127.0.0.1:{int(port_file.read_text())}", creds) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != \
                        health_pb2.HealthCheckResponse.SERVING:
                    await asyncio.sleep(0.05)
                stub = drafter_pb2_grpc.DrafterServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                info = await stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=5, metadata=auth_metadata(TOKEN))
                assert info.name == "ngram"

        asyncio.run(asyncio.wait_for(body(), 30))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
