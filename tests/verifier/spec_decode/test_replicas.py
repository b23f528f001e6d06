"""The drafter replicas a verifier tells of each finished request: targets parsed as gRPC reads them,
names resolved (loopback once), and a channel per replica opened and closed as replicas come and go."""

from __future__ import annotations

import asyncio
import socket

import pytest

from verifier_service.spec_decode import replicas
from verifier_service.spec_decode.replicas import Replicas, parse_target, resolve


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


def test_a_channel_per_replica_opened_and_closed_as_they_come_and_go(monkeypatch) -> None:  # noqa: ANN001
    opened: list[tuple[str, str]] = []
    closed: list[str] = []

    class Channel:
        def __init__(self, address: str) -> None:
            self.address = address

        def unary_unary(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return None

        def stream_stream(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return None

        def close(self) -> None:
            closed.append(self.address)

    def open_channel(address: str, host: str) -> Channel:
        opened.append((address, host))
        return Channel(address)

    found = [["10.0.0.1:5", "10.0.0.2:5"], ["10.0.0.2:5", "10.0.0.3:5"], ["10.0.0.3:5"]]
    monkeypatch.setattr(replicas, "resolve", lambda host, port: found.pop(0))
    monkeypatch.setattr(replicas, "RESOLVE_EVERY_S", 0.0)
    fleet = Replicas("dns:///drafter:5", open_channel)

    async def body() -> list[int]:
        return [len(await fleet.stubs()) for _ in range(3)]

    assert asyncio.run(body()) == [2, 2, 0]  # one replica left: the draft stream reaches it already
    assert opened == [("10.0.0.1:5", "drafter"), ("10.0.0.2:5", "drafter"), ("10.0.0.3:5", "drafter")]
    assert sorted(closed) == ["10.0.0.1:5", "10.0.0.2:5", "10.0.0.3:5"]
