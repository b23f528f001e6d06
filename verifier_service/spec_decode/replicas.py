"""Every replica behind a drafter target, one by one: for what each of them should hear, and say.

A verifier's calls reach one replica of a drafter Service at a time (its draft stream, or the pick
of round_robin), so a replica learns only the requests it served. A finished request is worth
learning on every replica (PROTOCOL.md section 7), and a capability is safe to rely on only once
every replica lists it (in a rolling update they differ: transport.py's `info`). The verifier
resolves the drafter's target itself, to the addresses gRPC's own resolver finds
(drafter_sdk/service/addresses.py), and keeps a channel to each, opened when an address appears
and closed when it leaves; the addresses are looked up again every RESOLVE_EVERY_S, as replicas
come and go. A target with one address has no other replica, and one of a kind not resolved here
(`unix:`, `xds:`) is left to gRPC alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.service.addresses import lookup, parse_target

RESOLVE_EVERY_S = 30.0


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
            found = await asyncio.to_thread(lookup, self.host, self.port, self._given)
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
