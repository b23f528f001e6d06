"""`splitspec bench-http`: what the HTTP front costs over gRPC, on one verifier and the same prompts.

One verifier process (in-process n-gram drafter) serves both fronts. Two measurements, each
alternating the fronts request by request (or round by round) so that a shared machine's
drift does not favour one:

- batch 1: the same request through gRPC `Generate` and HTTP `/v1/completions` (token ids in,
  so both do the same work), one at a time; the per-request difference, median over the
  requests. With 1 new token it is the front's own cost; with `--max-new-tokens` a whole answer's.
- streaming at `--concurrency`: that many clients at once, each streaming its prompt through
  gRPC `GenerateStream` or HTTP SSE; generated tokens per second of wall time, per front, and
  the verifier process's CPU time per generated token (the clients run on the same machine: the
  HTTP one is a bare asyncio socket, as lean as gRPC's C core, so both figures measure the server).

Every answer is checked to be the same tokens through both fronts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx

from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.model import loader as model_loader
from verifier_service.tools.bench import workloads
from verifier_service.tools.local_services import LocalService, script


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default="grounded,open", help="comma list of grounded, code, open")
    p.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="batch-1 requests per prompt and front")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="streaming rounds per front (alternating)")
    p.set_defaults(func=main)


def _params(ids: list[int], max_new_tokens: int) -> verifier_pb2.GenerationParams:
    return verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=ids),
                                         sampling=verifier_pb2.SamplingParams(temperature=0.0),
                                         stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens,
                                                                                ignore_eos=True))


def _body(ids: list[int], max_new_tokens: int, stream: bool) -> dict[str, object]:
    return {"prompt": ids, "max_tokens": max_new_tokens, "ignore_eos": True, "stream": stream, "temperature": 0}


def main(args: argparse.Namespace) -> int:
    source = model_loader.resolve_source(args.model)
    tokenizer = model_loader.load_tokenizer(source)
    prompts = workloads.build(args.workloads.split(","), args.prompts, tokenizer)
    port_file = Path(tempfile.mkdtemp(prefix="splitspec-bench-http-")) / "http.port"
    argv = [script("splitspec-verifier"), "--speculative-mode", "ngram", "--log-level", "WARNING",
            "--http-port", "0", "--http-port-file", str(port_file), "--max-num-seqs", str(args.concurrency),
            *(["--model", args.model] if args.model else [])]
    print(f"starting a verifier ({source.name}) serving gRPC and HTTP ...", flush=True)
    # One intra-op thread: idle OpenMP threads spinning would count as the front's CPU time.
    verifier = LocalService(argv, name="verifier", startup_timeout_s=1200, env={"OMP_NUM_THREADS": "1"})
    try:
        verifier.start()
        http_base = f"http://127.0.0.1:{int(port_file.read_text())}"
        results = asyncio.run(_bench(verifier.address, http_base, [p.token_ids for p in prompts], args,
                                     verifier.process.pid))
    finally:  # also when it never became ready: no verifier left behind
        verifier.stop()
    _print(results, args)
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _bench(grpc_address: str, http_base: str, prompts: list[list[int]],
                 args: argparse.Namespace, server_pid: int) -> dict[str, object]:
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency + 2)
    async with grpc.aio.insecure_channel(grpc_address) as channel, \
            httpx.AsyncClient(base_url=http_base, timeout=600, limits=limits) as http:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)

        async def via_grpc(ids: list[int], n: int) -> list[int]:
            r = await stub.Generate(verifier_pb2.GenerateRequest(params=_params(ids, n)), timeout=600)
            return list(r.output.token_ids)

        async def via_http(ids: list[int], n: int) -> list[int]:
            r = await http.post("/v1/completions", json=_body(ids, n, False))
            r.raise_for_status()
            return r.json()["choices"][0]["splitspec"]["token_ids"]

        async def stream_grpc(ids: list[int], n: int) -> list[int]:
            out: list[int] = []
            async for m in stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=_params(ids, n)), timeout=600):
                out += m.output.token_ids
            return out

        async def stream_http(ids: list[int], n: int) -> list[int]:
            out: list[int] = []
            async for event in _sse(http_base, _body(ids, n, True)):
                if event.startswith(b"data: {"):
                    out += json.loads(event[6:])["choices"][0]["splitspec"]["token_ids"]
            return out

        await via_grpc(prompts[0][:32], 4)  # warm both fronts
        await via_http(prompts[0][:32], 4)
        results: dict[str, object] = {"identical": True}
        for n in (1, args.max_new_tokens):
            diffs, lat = [], {"grpc": [], "http": []}
            for r in range(args.repeats):
                for i, ids in enumerate(prompts):
                    order = [("grpc", via_grpc), ("http", via_http)]
                    if (r + i) % 2:
                        order.reverse()
                    got, took = {}, {}
                    for name, call in order:
                        start = time.perf_counter()
                        got[name] = await call(ids, n)
                        took[name] = time.perf_counter() - start
                        lat[name].append(took[name])
                    results["identical"] &= got["grpc"] == got["http"]
                    diffs.append(took["http"] - took["grpc"])
            results[f"batch1_{n}"] = {"grpc_p50_ms": 1000 * statistics.median(lat["grpc"]),
                                      "http_p50_ms": 1000 * statistics.median(lat["http"]),
                                      "http_minus_grpc_p50_ms": 1000 * statistics.median(diffs)}

        work = [prompts[i % len(prompts)] for i in range(args.concurrency)]
        tps: dict[str, list[float]] = {"grpc": [], "http": []}
        cpu_ms: dict[str, list[float]] = {"grpc": [], "http": []}
        for r in range(args.rounds):
            for name, call in ([("grpc", stream_grpc), ("http", stream_http)][::1 if r % 2 == 0 else -1]):
                start, cpu = time.perf_counter(), _cpu_s(server_pid)
                outs = await asyncio.gather(*(call(ids, args.max_new_tokens) for ids in work))
                tokens = sum(map(len, outs))
                tps[name].append(tokens / (time.perf_counter() - start))
                cpu_ms[name].append(1000 * (_cpu_s(server_pid) - cpu) / tokens)
                results.setdefault(f"stream_outputs_{r}", {})[name] = outs
        for r in range(args.rounds):
            outs = results.pop(f"stream_outputs_{r}")
            results["identical"] &= outs["grpc"] == outs["http"]
        results["stream"] = {name: statistics.median(v) for name, v in tps.items()}
        results["stream_server_cpu_ms_per_token"] = {name: statistics.median(v) for name, v in cpu_ms.items()}
        return results


async def _sse(base: str, body: dict[str, object]) -> AsyncIterator[bytes]:
    """POST and yield the Server-Sent Events of the chunked answer: a client as lean as gRPC's C
    core, so that the streaming figures measure the server rather than a Python HTTP client."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        buffer = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):  # chunked transfer encoding
            buffer += (await reader.readexactly(size + 2))[:-2]
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                yield event
    finally:
        writer.close()


def _print(results: dict[str, object], args: argparse.Namespace) -> None:
    print(f"\nbatch 1, one request at a time, median of {args.repeats} x prompts requests per front:")
    for n in (1, args.max_new_tokens):
        b = results[f"batch1_{n}"]
        print(f"  {n:4d} new tokens: gRPC p50 {b['grpc_p50_ms']:8.1f} ms   HTTP p50 {b['http_p50_ms']:8.1f} ms   "
              f"HTTP - gRPC (median of pairs) {b['http_minus_grpc_p50_ms']:+.2f} ms")
    s = results["stream"]
    print(f"streaming, {args.concurrency} clients at once, {args.max_new_tokens} new tokens each, median of "
          f"{args.rounds} rounds: gRPC {s['grpc']:.1f} tok/s   HTTP {s['http']:.1f} tok/s   "
          f"HTTP / gRPC {s['http'] / s['grpc']:.3f}")
    c = results["stream_server_cpu_ms_per_token"]
    print(f"  the verifier's CPU time per generated token: gRPC {c['grpc']:.2f} ms   HTTP {c['http']:.2f} ms")
    print(f"same tokens through both fronts: {'yes' if results['identical'] else 'NO'}")
