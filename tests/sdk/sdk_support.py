"""Shared helpers of the drafter SDK tests: a recording drafter and a server on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from drafter_sdk import Drafter, DraftRequest, RunningDrafter, start_server
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc

DRAFTER_SCRIPT = Path(sys.executable).with_name("splitspec-drafter")


@dataclass
class Seen:
    """A snapshot of one DraftRequest (the SDK's token buffer keeps changing after the call)."""

    key: tuple[str, str]
    tokens: list[int]
    prompt_len: int
    draft_len: int
    last_num_drafted: int
    last_num_accepted: int
    temperature: float
    top_p: float
    top_k: int


class RecordingDrafter(Drafter):
    """Drafts `propose(request)` (default: the last draft_len tokens reversed) and records every call."""

    def __init__(self, propose: Callable[[DraftRequest], list[int]] | None = None) -> None:
        self.propose = propose or (lambda r: list(reversed(r.tokens))[: r.draft_len])
        self.calls: list[list[Seen]] = []
        self.released: list[tuple[str, str]] = []

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.calls.append([Seen(r.key, list(r.tokens), r.prompt_len, r.draft_len, r.last_num_drafted,
                                r.last_num_accepted, r.sampling.temperature, r.sampling.top_p, r.sampling.top_k)
                           for r in requests])
        return [self.propose(r) for r in requests]

    def on_release(self, key: tuple[str, str]) -> None:
        self.released.append(key)


@dataclass
class Client:
    running: RunningDrafter
    channel: grpc.aio.Channel
    stub: drafter_pb2_grpc.DrafterServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)

    async def prepare(self, verifier_id: str, *sequences: pb.DraftSequence,
                      metadata: tuple[tuple[str, str], ...] | None = None) -> pb.PrepareDraftTokensResponse:
        return await self.stub.PrepareDraftTokens(
            pb.PrepareDraftTokensRequest(verifier_id=verifier_id, sequences=sequences), timeout=10,
            metadata=metadata)


@contextlib.asynccontextmanager
async def serving(drafter: Drafter, *, wait_loaded: bool = True,
                  channel_credentials: grpc.ChannelCredentials | None = None,
                  **options: object) -> AsyncIterator[Client]:
    """A drafter server on a free port of 127.0.0.1 and a client channel to it (TLS with credentials)."""
    running = await start_server(drafter, host="127.0.0.1", port=0, **options)  # type: ignore[arg-type]
    target = f"127.0.0.1:{running.port}"
    try:
        if wait_loaded:
            await running.wait_loaded()
        async with (grpc.aio.insecure_channel(target) if channel_credentials is None
                    else grpc.aio.secure_channel(target, channel_credentials)) as channel:
            yield Client(running, channel)
    finally:
        await running.stop(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seq(request_id: str, context_len: int, new_tokens: list[int], draft_len: int = 4,
        prompt_len: int = 0, **fields: object) -> pb.DraftSequence:
    return pb.DraftSequence(request_id=request_id, context_len=context_len, new_tokens=new_tokens,
                            draft_len=draft_len, prompt_len=prompt_len, **fields)


async def still_serving(c: Client) -> None:
    response = await c.prepare("ok", seq("probe", 0, [1, 2], draft_len=1))
    assert response.results[0].status == pb.DRAFT_STATUS_OK


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
