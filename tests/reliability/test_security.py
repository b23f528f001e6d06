"""TLS, mutual TLS and bearer-token auth on the verifier, on its client to the drafter, and on the
`splitspec generate` client. The tests make their own throwaway PKI (tests/certs.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from certs import make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from reliability_support import Proc, VerifierProcess, VerifierThread, reference
from verifier_harness import run_verifier, spec_config, token_request

from drafter_sdk.proto import verifier_pb2 as pb
from drafter_sdk.proto import verifier_pb2_grpc
from drafter_sdk.service.security import auth_metadata, channel_credentials, current_tokens
from verifier_service.api import cli
from verifier_service.spec_decode.config import ConfigError
from verifier_service.tools import cli as cli_client
from verifier_service.tools.local_services import script

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-token-4f2a"
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("foreign-pki"), prefix="foreign-")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


def generate(channel: grpc.Channel, metadata=None) -> pb.GenerateResponse:
    return verifier_pb2_grpc.VerifierServiceStub(channel).Generate(token_request(PROMPT, 6), timeout=30,
                                                                   metadata=metadata)


def refused(channel: grpc.Channel, metadata=None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        generate(channel, metadata)
    return info.value.code()


def test_verifier_serves_tls_to_clients_that_trust_its_ca(pki, foreign):
    with VerifierThread(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)) as v:
        with grpc.secure_channel(v.address, channel_credentials(pki.ca_cert)) as channel:
            assert list(generate(channel).output.token_ids) == list(reference(tuple(PROMPT), 6))
        with grpc.secure_channel(v.address, channel_credentials(foreign.ca_cert)) as channel:
            assert refused(channel) == grpc.StatusCode.UNAVAILABLE  # the server's certificate is not trusted
        with grpc.insecure_channel(v.address) as channel:
            assert refused(channel) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port


@pytest.mark.parametrize("client", ["valid", "none", "foreign"])
def test_verifier_mutual_tls_refuses_clients_without_a_valid_certificate(pki, foreign, client):
    creds = {"valid": channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key),
             "none": channel_credentials(pki.ca_cert),
             "foreign": channel_credentials(pki.ca_cert, foreign.client_cert, foreign.client_key)}[client]
    with VerifierThread(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                        tls_client_ca=str(pki.ca_cert)) as v, grpc.secure_channel(v.address, creds) as channel:
        if client == "valid":
            assert list(generate(channel).output.token_ids) == list(reference(tuple(PROMPT), 6))
        else:
            assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_verifier_bearer_token_guards_everything_but_health_and_reflection():
    with VerifierThread(auth_token=TOKEN) as v, grpc.insecure_channel(v.address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        for metadata in (None, auth_metadata("wrong"), (("authorization", TOKEN),), (("authorization", "Basic x"),)):
            assert refused(channel, metadata) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateStream(pb.GenerateStreamRequest(params=pb.GenerationParams(token_ids=pb.TokenIds(ids=PROMPT))), timeout=30,
                                         metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in info.value.details()
        assert list(generate(channel, auth_metadata(TOKEN)).output.token_ids) == list(reference(tuple(PROMPT), 6))
        # Probes cannot send a token: health and reflection stay open.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for r in replies for s in r.list_services_response.service}
        assert "splitspec.v1.VerifierService" in services


def test_verifier_cli_reads_the_token_from_a_file_or_the_environment_never_a_flag(token_file, pki, monkeypatch,
                                                                                     capsys):
    settings = cli.settings_from_args(cli.parser().parse_args(["--auth-token-file", str(token_file)]))
    assert current_tokens(settings.auth_token) == (TOKEN,)  # as the file holds it now
    monkeypatch.setenv("SPLITSPEC_AUTH_TOKEN", "from-env")
    assert cli.settings_from_args(cli.parser().parse_args([])).auth_token == "from-env"
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")  # a vLLM deployment's key is kept, below ours
    assert cli.settings_from_args(cli.parser().parse_args([])).auth_token == "from-env"
    monkeypatch.delenv("SPLITSPEC_AUTH_TOKEN")
    assert cli.settings_from_args(cli.parser().parse_args([])).auth_token == "from-vllm-env"
    assert current_tokens(cli.settings_from_args(cli.parser().parse_args(
        ["--auth-token-file", str(token_file)])).auth_token) == (TOKEN,)
    monkeypatch.delenv("VLLM_API_KEY")
    assert cli.settings_from_args(cli.parser().parse_args([])).auth_token is None
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--auth-token", TOKEN])  # no flag takes the token itself (ps would show it)
    capsys.readouterr()
    settings = cli.settings_from_args(cli.parser().parse_args(
        ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca_cert)]))
    assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == (
        str(pki.server_cert), str(pki.server_key), str(pki.ca_cert))
    for argv, words in ((["--tls-cert", str(pki.server_cert)], "go together"),
                        (["--tls-client-ca", str(pki.ca_cert)], "needs --tls-cert"),
                        (["--tls-cert", "/nope.pem", "--tls-key", str(pki.server_key)], "/nope.pem: no such file"),
                        (["--auth-token-file", "/nope/token"], "--auth-token-file"),
                        (["--speculative-mode", "user_provided", "--drafter-target", "x:1",
                          "--drafter-tls-cert", str(pki.client_cert)], "both cert_file and key_file"),
                        (["--speculative-mode", "user_provided", "--drafter-target", "x:1",
                          "--drafter-auth-token-file", "/nope/token"], "auth_token_file /nope/token: no such file")):
        with pytest.raises(ConfigError, match=words):
            cli.settings_from_args(cli.parser().parse_args(argv))


def drafter_process(pki, token_file) -> Proc:
    """The SDK's n-gram drafter over mutual TLS with a bearer token."""
    return Proc([script("splitspec-drafter"), "ngram", "--log-level", "WARNING", "--tls-cert", str(pki.server_cert),
                 "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca_cert),
                 "--auth-token-file", str(token_file)], name="mtls-drafter",
                channel_credentials=channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key))


@pytest.mark.parametrize("mistake", ["wrong token", "no client certificate"])
def test_verifier_drafter_connection_misconfigured_costs_drafts_only(pki, token_file, tmp_path, mistake):
    """A drafter that refuses the verifier (auth or mTLS) is a drafter failure: no failed request."""
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token")
    with drafter_process(pki, token_file) as drafter:
        drafter.start()
        spec = spec_config("USER_PROVIDED", 4, f"localhost:{drafter.port}", deadline_ms=2000)
        tls = spec.user_provided.tls
        tls.ca_cert_file = str(pki.ca_cert)
        if mistake == "wrong token":
            tls.cert_file, tls.key_file = str(pki.client_cert), str(pki.client_key)
            spec.user_provided.auth_token_file = str(wrong)
        else:
            spec.user_provided.auth_token_file = str(token_file)

        async def body():
            async with run_verifier(spec) as v:
                replies = [await v.stub.Generate(token_request(PROMPT, 12)) for _ in range(3)]
                info = await v.stub.GetServerInfo(pb.GetServerInfoRequest())
            return replies, info

        replies, info = asyncio.run(body())
    assert all(list(r.output.token_ids) == list(reference(tuple(PROMPT), 12)) for r in replies)
    assert info.drafter.failures >= 3 and info.drafter.state == pb.DRAFTER_STATE_UNAVAILABLE
    assert ("UNAUTHENTICATED" if mistake == "wrong token" else "UNAVAILABLE") in info.drafter.last_error


def test_end_to_end_mutual_tls_and_tokens_on_every_hop(tiny_model_dir, pki, foreign, token_file, capsys, monkeypatch):
    """splitspec generate --(mTLS + token)--> splitspec-verifier --(mTLS + token)--> splitspec-drafter."""
    client_creds = channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)
    with drafter_process(pki, token_file) as drafter:
        drafter.start()
        with VerifierProcess(
                tiny_model_dir, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                "--tls-client-ca", str(pki.ca_cert), "--auth-token-file", str(token_file),
                "--speculative-mode", "user_provided", "--drafter-target", f"localhost:{drafter.port}",
                "--drafter-deadline-ms", "2000", "--drafter-tls-ca", str(pki.ca_cert),
                "--drafter-tls-cert", str(pki.client_cert), "--drafter-tls-key", str(pki.client_key),
                "--drafter-auth-token-file", str(token_file), channel_credentials=client_creds) as verifier:
            verifier.start()
            for proc in (drafter, verifier):  # the token is in no command line
                assert TOKEN not in open(f"/proc/{proc.process.pid}/cmdline").read()

            def run_client(*flags: str, prompt: str = "hello hello hello hello") -> tuple[int, str, str]:
                code = cli_client.main(["generate", prompt, "--raw", "--max-new-tokens", "12",
                                        "--target", f"localhost:{verifier.port}", *flags])
                out, err = capsys.readouterr()
                return code, out, err

            full = ["--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert), "--tls-key",
                    str(pki.client_key), "--auth-token-file", str(token_file)]
            code, out, err = run_client(*full)
            assert code == 0 and out.strip() and "drafts=" in err, err
            code, _, err = run_client(*full[:6])
            assert code == 1 and "UNAUTHENTICATED" in err, err
            code, _, err = run_client("--tls-ca", str(pki.ca_cert), "--auth-token-file", str(token_file))
            assert code == 1 and "UNAVAILABLE" in err, err  # no client certificate
            code, _, err = run_client("--tls-ca", str(pki.ca_cert), "--tls-cert", str(foreign.client_cert),
                                      "--tls-key", str(foreign.client_key), "--auth-token-file", str(token_file))
            assert code == 1 and "UNAVAILABLE" in err, err  # a certificate from another CA
            code, _, err = run_client("--auth-token-file", str(token_file))
            assert code == 1 and "UNAVAILABLE" in err, err  # plaintext
            monkeypatch.setenv("SPLITSPEC_AUTH_TOKEN", TOKEN)
            code, out, err = run_client(*full[:6], "--stream", prompt="hi")
            assert code == 0 and out.strip(), err
            # The verifier reached the drafter over mTLS with its token: drafts, no failures.
            with grpc.secure_channel(verifier.address.replace("127.0.0.1", "localhost"), client_creds) as channel:
                info = verifier_pb2_grpc.VerifierServiceStub(channel).GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=30, metadata=auth_metadata(TOKEN))
            assert info.drafter.calls > 0 and info.drafter.failures == 0, info.drafter
            assert info.drafter.state == pb.DRAFTER_STATE_HEALTHY and info.drafter.name == "ngram"
            assert verifier.stop() == 0
