"""The drafter replicas a verifier tells of each finished request: a channel per replica, opened and closed
as replicas come and go (the addresses themselves: tests/sdk/test_sdk_addresses.py)."""

from __future__ import annotations

import asyncio

from verifier_service.spec_decode import replicas
from verifier_service.spec_decode.replicas import Replicas


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

        def unary_stream(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return None

        def close(self) -> None:
            closed.append(self.address)

    def open_channel(address: str, host: str) -> Channel:
        opened.append((address, host))
        return Channel(address)

    found = [["10.0.0.1:5", "10.0.0.2:5"], ["10.0.0.2:5", "10.0.0.3:5"], ["10.0.0.3:5"]]
    monkeypatch.setattr(replicas, "lookup", lambda host, port, given: found.pop(0))
    monkeypatch.setattr(replicas, "RESOLVE_EVERY_S", 0.0)
    fleet = Replicas("dns:///drafter:5", open_channel)

    async def body() -> list[int]:
        return [len(await fleet.stubs()) for _ in range(3)]

    assert asyncio.run(body()) == [2, 2, 0]  # one replica left: the draft stream reaches it already
    assert opened == [("10.0.0.1:5", "drafter"), ("10.0.0.2:5", "drafter"), ("10.0.0.3:5", "drafter")]
    assert sorted(closed) == ["10.0.0.1:5", "10.0.0.2:5", "10.0.0.3:5"]
