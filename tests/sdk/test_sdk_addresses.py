"""gRPC targets read as gRPC reads them, and names resolved to every address (loopback once): how a verifier
finds every replica of a drafter, and a starting replica its peers."""

from __future__ import annotations

import socket

import pytest

from drafter_sdk.service.addresses import parse_target, resolve


@pytest.mark.parametrize("target, parsed", [
    ("drafter:50052", ("drafter", "50052", [])),
    ("dns:///splitspec-drafter.splitspec.svc:50052", ("splitspec-drafter.splitspec.svc", "50052", [])),
    ("dns://10.0.0.10/drafter:50052", ("drafter", "50052", [])),
    ("dns:drafter:50052", ("drafter", "50052", [])),
    ("drafter", ("drafter", "443", [])),
    ("127.0.0.1:50052", ("127.0.0.1", "50052", [])),
    ("[::1]:50052", ("::1", "50052", [])),
    ("ipv4:10.0.0.1:50052,10.0.0.2:50052", ("", "", ["10.0.0.1:50052", "10.0.0.2:50052"])),
    ("ipv6:[::1]:50052,[::2]:50052", ("", "", ["[::1]:50052", "[::2]:50052"])),
    ("unix:/run/drafter.sock", ("", "", [])),
    ("xds:///drafter", ("", "", [])),
])
def test_targets_are_read_as_grpc_reads_them(target: str, parsed: tuple) -> None:
    assert parse_target(target) == parsed


def test_names_resolve_to_every_address_loopback_once(monkeypatch) -> None:  # noqa: ANN001
    def getaddrinfo(host: str, port: int, type: int = 0) -> list:  # noqa: A002
        ips = {"drafter": ["10.0.0.2", "10.0.0.1", "10.0.0.2"], "localhost": ["127.0.0.1", "::1"],
               "dual": ["fd00::1", "10.0.0.3"]}[host]
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert resolve("drafter", "50052") == ["10.0.0.1:50052", "10.0.0.2:50052"]
    assert resolve("localhost", "50052") == ["127.0.0.1:50052"]  # one server on both
    assert resolve("dual", "1") == ["10.0.0.3:1", "[fd00::1]:1"]
