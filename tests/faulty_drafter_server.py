"""A DrafterService written against the raw gRPC API, able to break the protocol on the wire.

The SDK sanitises what a user drafter returns; this server does not, so it can
send what a buggy drafter in another language might: error statuses, ids
outside the vocabulary, negative ids, drafts longer than asked, results for
unknown requests, the wrong number of results, a response over the
message-size limit. Run it as a process:

    python tests/faulty_drafter_server.py --port 0 --port-file PORT [--vocab-size N]

and steer it over gRPC with the extra service `faulty.Control` (JSON in, JSON out):

    /faulty.Control/Set    {"mode": ..., "oracle": [{"ids": [...], "prompt_len": n}, ...], ...} -> stats
    /faulty.Control/Stats  {} -> {"calls", "calls_by_mode", "sequences", "held", "released", "info_calls"}

Modes (what PrepareDraftTokens does):
  ok                  oracle drafts (see faulty_drafters.oracle_draft), protocol followed
  error               fails with status `code` (UNAVAILABLE, INTERNAL, RESOURCE_EXHAUSTED, ...)
  out_of_vocab        drafts hold the id vocab_size + 7
  negative            drafts hold the id -1
  too_many            drafts of draft_len + 3 tokens
  unknown_request     every result names a request id that was not asked
  wrong_count         one result fewer than sequences (one more when there is a single sequence)
  unspecified_status  results with DRAFT_STATUS_UNSPECIFIED
  oversized           a valid answer padded with an unknown field past 16 MiB
Deltas are applied (with the SDK's SequenceStore) in every mode but `error`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_sdk.proto import drafter_pb2 as pb  # noqa: E402
from drafter_sdk.proto import drafter_pb2_grpc  # noqa: E402
from drafter_sdk.server.sequence_store import SequenceStore  # noqa: E402
from faulty_drafters import OracleTable, oracle_draft, oracle_table  # noqa: E402

MIB = 1 << 20
OVERSIZE_BYTES = 17 * MIB


def _padding(size: int) -> bytes:
    """An unknown length-delimited field 15 of `size` bytes: parsers keep it, sizes count it."""
    length, varint = size, bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return bytes([15 << 3 | 2]) + bytes(varint) + b"\0" * size


class FaultyServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.control: dict = {"mode": "ok"}
        self.table: OracleTable = {}
        self.store = SequenceStore()
        self.calls = 0
        self.by_mode: Counter[str] = Counter()
        self.sequences = 0
        self.released = 0
        self.info_calls = 0
        self._padding = b""

    def stats(self) -> dict:
        return {"pid": os.getpid(), "calls": self.calls, "calls_by_mode": dict(self.by_mode),
                "sequences": self.sequences, "held": len(self.store), "released": self.released,
                "info_calls": self.info_calls, "mode": self.control.get("mode")}

    def set_control(self, control: dict) -> dict:
        if "oracle" in control:
            entries = control["oracle"]
            self.table = oracle_table([e["ids"] for e in entries], [e["prompt_len"] for e in entries])
        self.control = {k: v for k, v in control.items() if k != "oracle"}
        return self.stats()

    async def GetDrafterInfo(self, request, context):
        self.info_calls += 1
        return pb.GetDrafterInfoResponse(name="faulty-raw", version="1.0", vocab_size=self.vocab_size)

    async def ReleaseRequests(self, request, context):
        released = sum(self.store.release((request.verifier_id, rid)) for rid in request.request_ids)
        self.released += released
        return pb.ReleaseRequestsResponse(released=released)

    async def PrepareDraftTokens(self, request, context):
        mode = self.control.get("mode", "ok")
        self.calls += 1
        self.by_mode[mode] += 1
        self.sequences += len(request.sequences)
        if mode == "error":
            code = grpc.StatusCode[self.control.get("code", "UNAVAILABLE")]
            await context.abort(code, f"injected {code.name}")
        results = []
        for seq in request.sequences:
            synced = self.store.sync((request.verifier_id, seq.request_id), seq.context_len, list(seq.new_tokens))
            if synced.tokens is None:
                results.append(pb.DraftResult(request_id=seq.request_id, status=pb.DRAFT_STATUS_RESYNC_REQUIRED))
                continue
            draft = oracle_draft(self.table, synced.tokens, seq.prompt_len, seq.draft_len)
            status = pb.DRAFT_STATUS_OK
            request_id = seq.request_id
            if mode == "out_of_vocab":
                draft = [self.vocab_size + 7]
            elif mode == "negative":
                draft = [-1]
            elif mode == "too_many":
                draft = [1] * (seq.draft_len + 3)
            elif mode == "unknown_request":
                request_id = f"not-{seq.request_id}"
            elif mode == "unspecified_status":
                status = pb.DRAFT_STATUS_UNSPECIFIED
            results.append(pb.DraftResult(request_id=request_id, status=status, draft_tokens=draft))
        if mode == "wrong_count":
            results = results[:-1] if len(results) > 1 else results * 2
        response = pb.PrepareDraftTokensResponse(results=results)
        if mode == "oversized":
            if not self._padding:
                self._padding = _padding(OVERSIZE_BYTES)
            response = pb.PrepareDraftTokensResponse.FromString(response.SerializeToString() + self._padding)
        return response


def control_handler(servicer: FaultyServicer) -> grpc.GenericRpcHandler:
    def encode(obj: dict) -> bytes:
        return json.dumps(obj).encode()

    async def set_(request: bytes, context) -> bytes:
        return encode(servicer.set_control(json.loads(request)))

    async def stats(request: bytes, context) -> bytes:
        return encode(servicer.stats())

    return grpc.method_handlers_generic_handler("faulty.Control", {
        "Set": grpc.unary_unary_rpc_method_handler(set_),
        "Stats": grpc.unary_unary_rpc_method_handler(stats),
    })


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--vocab-size", type=int, default=0)
    args = parser.parse_args()
    servicer = FaultyServicer(args.vocab_size)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * MIB),
                                      ("grpc.max_send_message_length", 64 * MIB), ("grpc.so_reuseport", 0)])
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((control_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    for service in ("", "splitspec.v1.DrafterService"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main())
