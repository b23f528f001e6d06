"""The rendered cpu-suffix-tls overlay run as local processes (local_stack.py), its Secrets from a throwaway PKI
and throwaway tokens: components/tls, components/api-key and components/drafter-tokens beside the suffix drafter.
It holds every component of cpu-tls, whose n-gram drafter serves the same mutual TLS without tokens. A file of
its own, so the suite's workers can run it beside test_deploy_local.py."""

from __future__ import annotations

import grpc
import pytest
from certs import make_pki, tls_files
from grpc_health.v1 import health_pb2, health_pb2_grpc
from local_stack import assert_probes_serving, generate_with_drafts, grpc_port, health_check, running_stack

from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from drafter_sdk.service.security import auth_metadata, channel_credentials

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


def test_the_tls_overlay_serves_tls_on_every_hop_and_is_probed_in_plain_http(tmp_path):
    """The kubelet's probes reach both services through /health on their metrics ports; a client reaches the
    verifier over TLS with the API key only, and the verifier the drafter over mutual TLS with its token
    (drafted tokens); a drafter's learned state is its replicas' only (the token named peers)."""
    pki = make_pki(tmp_path)
    secrets = {"splitspec-verifier-tls": tls_files(pki, "service"), "splitspec-drafter-tls": tls_files(pki),
               "splitspec-api-key": {"token": b"the-api-key\n"},
               "splitspec-drafter-tokens": {"tokens": b"verifier the-verifiers-token\npeers the-peers-token\n",
                                            "verifier": b"the-verifiers-token\n"}}
    with running_stack("cpu-suffix-tls", tmp_path, secrets) as stack:
        assert_probes_serving(stack)
        generate_with_drafts(stack, channel_credentials(pki.ca_cert), auth_metadata("the-api-key"))
        with grpc.secure_channel(f"127.0.0.1:{grpc_port(stack['verifier'])}", channel_credentials(pki.ca_cert)) as ch:
            with pytest.raises(grpc.RpcError) as refused:  # without the key
                verifier_pb2_grpc.VerifierServiceStub(ch).Tokenize(verifier_pb2.TokenizeRequest(prompt="hi"),
                                                                   timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for name in ("verifier", "drafter"):
            assert health_check(grpc_port(stack[name])) == "rpc error: UNAVAILABLE"  # plaintext: no TLS handshake
        drafter = f"127.0.0.1:{grpc_port(stack['drafter'])}"
        with grpc.secure_channel(drafter, channel_credentials(pki.ca_cert)) as ch:
            with pytest.raises(grpc.RpcError) as refused:  # no client certificate
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(drafter, channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)) as ch:
            stub = drafter_pb2_grpc.DrafterServiceStub(ch)

            def learned_state(token: str | None) -> str:
                try:
                    list(stub.GetLearnedState(drafter_pb2.GetLearnedStateRequest(), timeout=30,
                                              metadata=auth_metadata(token) if token else None))
                except grpc.RpcError as exc:
                    return exc.code().name
                return "OK"

            assert [learned_state(t) for t in (None, "the-api-key", "the-verifiers-token", "the-peers-token")] == [
                "UNAUTHENTICATED", "UNAUTHENTICATED", "PERMISSION_DENIED", "OK"]
