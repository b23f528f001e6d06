"""The rendered cpu-tls overlay (components/tls) run as local processes (local_stack.py), its Secrets from a
throwaway PKI. A file of its own, so the suite's workers can run it beside test_deploy_local.py."""

from __future__ import annotations

import grpc
import pytest
from certs import make_pki, service_tls_files, tls_files
from deploy_support import flag_value, main_container
from grpc_health.v1 import health_pb2, health_pb2_grpc
from local_stack import assert_probes_serving, generate_with_drafts, health_check, running_stack

from drafter_sdk.service.security import channel_credentials

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


def test_the_tls_overlay_serves_tls_on_every_hop_and_is_probed_in_plain_http(tmp_path):
    """cpu-tls (components/tls), its Secrets from a throwaway PKI: the kubelet's probes reach both services
    through /health on their metrics ports; a client reaches the verifier over TLS only, and the verifier
    the drafter over mutual TLS (drafted tokens)."""
    pki = make_pki(tmp_path)
    secrets = {"splitspec-verifier-tls": service_tls_files(pki), "splitspec-drafter-tls": tls_files(pki)}
    with running_stack("cpu-tls", tmp_path, secrets) as stack:
        assert_probes_serving(stack)
        generate_with_drafts(stack, channel_credentials(pki.ca_cert))
        for name in ("verifier", "drafter"):
            p = stack[name]
            port = p.ports[int(flag_value(main_container(p.deployment)["args"], "--port"))]
            assert health_check(port) == "rpc error: UNAVAILABLE"  # plaintext: no TLS handshake
        drafter = stack["drafter"]
        port = drafter.ports[int(flag_value(main_container(drafter.deployment)["args"], "--port"))]
        with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(pki.ca_cert)) as ch:  # no certificate
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
