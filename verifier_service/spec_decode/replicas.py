"""Every replica behind a drafter target, one by one: for what each of them should hear.

A verifier's calls reach one replica of a drafter Service at a time (its draft stream, or the pick
of round_robin), so a replica learns only the requests it served. A finished request is worth
learning on every replica (PROTOCOL.md section 7): the verifier resolves the drafter's target itself,
to the addresses gRPC's own resolver finds (a `dns:` name's records, an `ipv4:` or `ipv6:` list), and
keeps a channel to each, opened when an address appears and closed when it leaves; the addresses are
looked up again every RESOLVE_EVERY_S, as replicas come and go. A target with one address has no
other replica, and one of a kind not resolved here (`unix:`, `xds:`) is left to gRPC alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable

import grpc

from drafter_sdk.proto import drafter_pb2_grpc

log = logging.getLogger(__name__)

RESOLVE_EVERY_S = 30.0
DEFAULT_PORT = "443"  # gRPC's, for a target without one


def parse_target(target: str) -> tuple[str, str, list[str]]:
    """(host to resolve, port, addresses already given) of a gRPC target: ("", "", [host:port, ...]) for an
    `ipv4:`/`ipv6:` list, (host, port, []) for a `dns:` name or a bare host:port, ("", "", []) for a kind
    not resolved here."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        return "", "", [address for address in rest.split(",") if address]
    if sep and scheme == "dns":
        rest = rest.removeprefix("//")
        rest = rest.partition("/")[2] if "/" in rest else rest  # dns://authority/host:port
    elif sep and not rest[:1].isdigit() and not target.startswith("["):
        return "", "", []  # unix:, xds:, ... (a bare host:port has digits after its colon)
    else:
        rest = target
    if rest.startswith("["):  # [v6 address]:port
        host, _, port = rest[1:].partition("]")
        return host, port.removeprefix(":") or DEFAULT_PORT, []
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    return host, port or DEFAULT_PORT, []


def resolve(host: str, port: str) -> list[str]:
    """host:port of every TCP address `host` resolves to, sorted; [] where it does not resolve. Loopback
    addresses count once: `localhost` names 127.0.0.1 and ::1, one server listening on both."""
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        log.debug("cannot resolve drafter replicas of %s: %s", host, exc)
        return []
    ips = sorted({info[4][0] for info in infos})
    remote = [ip for ip in ips if not ipaddress.ip_address(ip.partition("%")[0]).is_loopback]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in (remote if remote else ips[:1])]


class Replicas:
    """A DrafterService stub per replica address of `target`, where it has more than one."""

    def __init__(self, target: str, open_channel: Callable[[str, str], grpc.Channel]) -> None:
        """`open_channel(address, host)`: a channel to one replica; `host` is the name the target
        gave ("" for an address list), which a TLS certificate names rather than the address."""
        self.host, self.port, self._given = parse_target(target)
        self._open = open_channel
        self._channels: dict[str, tuple[grpc.Channel, drafter_pb2_grpc.DrafterServiceStub]] = {}
        self._resolved_at = -RESOLVE_EVERY_S

    async def stubs(self) -> list[drafter_pb2_grpc.DrafterServiceStub]:
        """One stub per replica, looked up again after RESOLVE_EVERY_S; [] with fewer than two."""
        if time.monotonic() - self._resolved_at >= RESOLVE_EVERY_S:
            self._resolved_at = time.monotonic()
            found = self._given or (await asyncio.to_thread(resolve, self.host, self.port) if self.host else [])
            self._keep(found if len(found) > 1 else [])
        return [stub for _, stub in self._channels.values()]

    def _keep(self, addresses: list[str]) -> None:
        for gone in set(self._channels) - set(addresses):
            self._channels.pop(gone)[0].close()
        for address in addresses:
            if address not in self._channels:
                channel = self._open(address, self.host)
                self._channels[address] = (channel, drafter_pb2_grpc.DrafterServiceStub(channel))

    def close(self) -> None:
        self._keep([])
