"""`splitspec bench-serve`: a running verifier's HTTP API under load, with speculation and without, side by side.

The other benches start their own services on this machine. This one measures a deployment as its clients see
it (a Kubernetes Service behind `kubectl port-forward`, a verifier on a GPU host): the same prompts, sent over
the OpenAI-compatible API as streams, at a request rate (Poisson arrivals, as `vllm bench serve` sends them)
and at most a number at a time, in passes that alternate between speculation on (the server's configuration)
and off for each request (`"speculation": {"disable": true}`, which only this server understands). Only the
requests' own setting differs between the passes, so the ratio is what speculation gives on that hardware,
model, drafter and traffic. Before the passes each prompt is sent once for one token (not measured), so that
every pass finds the prompts in the prefix cache alike. A later round asks the same prompts again: a drafter
that learns from finished requests (the suffix drafter) has seen their answers by then, which is why each
round is reported apart.

Per pass: requests done and failed (with the first error), request and output-token throughput, time to
first token, time per output token after the first (TPOT) and the gap between streamed chunks (ITL, per chunk
as vLLM counts it: a speculative step may bring several tokens at once), at the median and the 99th
percentile, the mean acceptance length the server reports per request, and the share of the requests' time
their steps spent on drafter calls (the server's `drafter_wait_s`: what drafting as a service cost). Each
prompt's tokens are compared between the passes: speculation is lossless, so greedy outputs (temperature 0, the
default) match, and so do sampled ones, each request seeded alike in both passes (on a GPU in bfloat16, up to
the rounding of batch-dependent kernels). `--temperature server` leaves the sampling to the server's defaults
(a reasoning model's generation config: what its clients get). Where requests carry
priorities (a dataset line's `"priority"`, or `--priorities`, for a verifier started with
`--scheduling-policy priority`), each pass is also broken down by priority: its requests' time to first token
and to their last token, at the median and the 99th percentile.

Prompts come from a JSONL file (`--dataset`: per line `{"messages": [...]}` for a chat or `{"prompt": "..."}`,
sent as a chat's user message, or as a completion with `"raw": true`; optional `"max_tokens"` and
`"priority"`) or a ShareGPT
JSON file (each conversation's first question), `--num-prompts` of them drawn at random, else from the
built-in workloads (serve_prompts.py). Results go to `--out`/bench-serve.json, every request included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from verifier_service.tools import http_client
from verifier_service.tools.bench.serve_prompts import WORKLOADS, Request, builtin, load_dataset, with_priorities

MODES = ("spec", "plain")


@dataclass
class Record:
    """What one request's stream showed."""

    mode: str
    round: int
    prompt: int
    priority: int = 0  # as sent (0: none given)
    sent_at: float = 0.0  # seconds from the pass's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks that carried tokens
    token_ids: list[int] | None = None  # None where the server does not send them (not a splitspec verifier)
    mean_acceptance_length: float | None = None
    drafter_wait_s: float | None = None  # its steps' time on drafter calls, as the server reports it
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the verifier's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model name to ask for (default: the first of /v1/models)")
    p.add_argument("--dataset", type=Path, metavar="FILE",
                   help='prompts, one JSON object a line ({"messages": [...]} or {"prompt": "...", "raw": false}), '
                        "or a ShareGPT JSON file (each conversation's first question)")
    p.add_argument("--num-prompts", type=int,
                   help="send this many of the prompts, drawn at random with --seed (default: all)")
    p.add_argument("--workloads", default="grounded,code,open",
                   help=f"without --dataset, built-in prompts: comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--prompts", type=int, default=4, help="built-in prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128, help="per request, unless its dataset line says")
    p.add_argument("--priorities", type=_int_list, metavar="P,P,...",
                   help="request priorities, prompt i taking the (i mod n)-th, unless its dataset line gives one "
                        "(for a verifier with --scheduling-policy priority; passes are then also reported by "
                        "priority)")
    p.add_argument("--temperature", type=_temperature, default=0.0, metavar="T|server",
                   help="0: greedy (default); above, sampled, each request seeded alike in both passes (their "
                        "tokens are compared either way); server: leave temperature out, the server's defaults apply")
    p.add_argument("--top-p", type=float, help="sent where given")
    p.add_argument("--top-k", type=int, help="sent where given")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes per mode, alternating spec, plain, plain, spec, ... (default 1)")
    p.add_argument("--no-plain", action="store_true",
                   help="only the server's own configuration (any OpenAI-compatible server then)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip sending each prompt once (one token) before the passes: the first pass then "
                        "prefills prompts the later ones find in the prefix cache")
    p.add_argument("--seed", type=int, default=0,
                   help="for the arrival times, --num-prompts' draw and sampled requests (prompt i: seed + i)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait to connect, or for its next bytes")
    p.add_argument("--out", default="bench-results", help="folder for bench-serve.json")
    http_client.add_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        reach = http_client.access(args)
        requests = load_dataset(args.dataset) if args.dataset else builtin(args.workloads, args.prompts)
        if args.num_prompts is not None and args.num_prompts < len(requests):
            requests = random.Random(args.seed).sample(requests, args.num_prompts)
        if args.priorities:
            requests = with_priorities(requests, args.priorities)
    except (OSError, ValueError) as exc:
        print(f"splitspec bench-serve: {exc}", file=sys.stderr)
        return 2
    try:
        passes, model = asyncio.run(_bench(reach, requests, args))
    except ServerProblem as exc:
        print(f"splitspec bench-serve: {exc}", file=sys.stderr)
        return 1
    summary = summarise(passes, args)
    print_summary(summary, reach.base_url, model, requests, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-serve.json").write_text(json.dumps(
        {"base_url": reach.base_url, "model": model, "args": {k: v for k, v in vars(args).items() if k != "func"},
         "prompts": [r.name for r in requests], "summary": summary,
         "requests": [asdict(r) for p in passes for r in p.records]}, indent=2, default=str))
    print(f"\nwrote {out / 'bench-serve.json'}")
    return 0 if all(row["failed"] == 0 for row in summary["passes"]) else 1


def _temperature(text: str) -> float | None:
    """--temperature: a number, or "server" (None: sent without one)."""
    if text == "server":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 'server', not {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of integers, not {text!r}") from None


class ServerProblem(Exception):
    """The server cannot be benchmarked: unreachable, the token refused, or no model served."""


def check_args(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "prompts", "rounds", "max_concurrency", "num_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), not {args.request_rate}")


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """When each of `count` requests is sent, in seconds from the start: a Poisson process of `rate` per
    second (exponential gaps, the first at 0), all at 0 for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def pass_order(rounds: int, plain: bool) -> list[str]:
    """spec, plain, plain, spec, spec, plain, ...: each mode first as often as the other, so a drift of the
    server's speed during the run (another tenant, clocks) favours neither."""
    if not plain:
        return ["spec"] * rounds
    order: list[str] = []
    for r in range(rounds):
        order += ["spec", "plain"] if r % 2 == 0 else ["plain", "spec"]
    return order


@dataclass
class Pass:
    mode: str
    round: int
    wall_s: float
    records: list[Record]


async def _bench(reach: http_client.HttpAccess, requests: list[Request],
                 args: argparse.Namespace) -> tuple[list[Pass], str]:
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests))
    async with httpx.AsyncClient(base_url=reach.base_url, headers=reach.headers, verify=reach.verify,
                                 timeout=args.timeout, limits=limits) as http:
        model = args.model or await _served_model(http)
        if not args.no_warmup:
            await _warm_up(http, model, requests, args)
        passes: list[Pass] = []
        for mode in pass_order(args.rounds, not args.no_plain):
            round_ = sum(p.mode == mode for p in passes)
            print(f"{mode} pass {round_ + 1}: {len(requests)} requests ...", flush=True)
            passes.append(await _pass(http, model, requests, mode, round_, args))
    return passes, model


async def _warm_up(http: httpx.AsyncClient, model: str, requests: list[Request], args: argparse.Namespace) -> None:
    """Each prompt once for one token, so that every pass finds the prompts in the prefix cache alike."""
    print(f"warm-up: {len(requests)} requests of one token, not measured ...", flush=True)
    gate = asyncio.Semaphore(args.max_concurrency or len(requests))

    async def one(i: int, request: Request) -> str:
        async with gate:
            record = Record("warm-up", 0, 0)
            path, body = request.body(model, args, "plain", i)
            await stream_request(http, path, body | {"max_tokens": 1, "ignore_eos": False}, record)
            return record.error

    failed = [error for error in await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))) if error]
    if failed:
        raise ServerProblem(f"{len(failed)} of {len(requests)} warm-up requests failed, the first with {failed[0]}")


async def _served_model(http: httpx.AsyncClient) -> str:
    try:
        response = await http.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ServerProblem(f"no answer from {http.base_url}: {exc}") from None
    if response.status_code != 200:
        raise ServerProblem(f"GET /v1/models answered {response.status_code}: {response.text[:300]}")
    served = [m.get("id") for m in response.json().get("data", [])]
    if not served:
        raise ServerProblem("the server lists no model")
    return served[0]


async def _pass(http: httpx.AsyncClient, model: str, requests: list[Request], mode: str, round_: int,
                args: argparse.Namespace) -> Pass:
    gate = asyncio.Semaphore(args.max_concurrency or len(requests))
    start = time.perf_counter()

    async def one(i: int, at: float) -> Record:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with gate:
            record = Record(mode, round_, i, requests[i].priority or 0, round(time.perf_counter() - start, 6))
            await stream_request(http, *requests[i].body(model, args, mode, i), record)
            return record

    # The same arrival times for both modes' passes of a round: only the requests' setting differs.
    times = arrivals(len(requests), args.request_rate, args.seed + round_)
    records = await asyncio.gather(*(one(i, at) for i, at in enumerate(times)))
    return Pass(mode, round_, time.perf_counter() - start, list(records))


async def stream_request(http: httpx.AsyncClient, path: str, body: dict, record: Record) -> None:
    """Send one request as a stream and note when its tokens came; a failure is noted, never raised."""
    sent = time.perf_counter()
    last = sent
    exact = False  # whether the chunks name their tokens (a splitspec verifier's `splitspec.token_ids`)
    ended = False  # whether the stream said it was complete ([DONE])
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code}: {_message((await response.aread()).decode(errors='replace'))}"
                return
            async for line in response.aiter_lines():
                ended = ended or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("error"):
                    record.error = f"in the stream: {_message(json.dumps(event))}"
                    return
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    ext = choice.get("splitspec")
                    if ext is not None:
                        exact = True
                        record.token_ids = (record.token_ids or []) + list(ext.get("token_ids", []))
                        tokens = len(ext.get("token_ids", []))
                        if "speculation" in ext:
                            record.mean_acceptance_length = ext["speculation"].get("mean_acceptance_length")
                            record.drafter_wait_s = ext["speculation"].get("drafter_wait_s")
                    else:  # another server: a chunk with text counts as a token, the usage corrects the total
                        tokens = int(bool((choice.get("delta") or {}).get("content") or choice.get("text")))
                    if tokens:
                        if record.ttft_s is None:
                            record.ttft_s = now - sent
                        else:
                            record.chunk_gaps_s.append(now - last)
                        last = now
                        record.output_tokens += tokens
                usage = event.get("usage")
                if usage and not exact:
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        if not ended:
            record.error = "the stream ended before its [DONE]"
            return
        record.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


def _message(text: str) -> str:
    """An error body's message (OpenAI's error object), else the text itself, short."""
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the nearest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarise(passes: list[Pass], args: argparse.Namespace) -> dict:
    """A row per pass, and per round the spec pass against the plain pass (ratios; the same tokens?)."""
    rows = [_row(p) for p in passes]
    rounds = []
    for round_ in sorted({p.round for p in passes}):
        spec = next((r for r in rows if r["mode"] == "spec" and r["round"] == round_), None)
        plain = next((r for r in rows if r["mode"] == "plain" and r["round"] == round_), None)
        if spec is None or plain is None or not plain["output_tokens_per_s"]:
            continue
        compared: dict = {"round": round_,
                          "output_tokens_per_s_ratio": spec["output_tokens_per_s"] / plain["output_tokens_per_s"]}
        if spec["tpot_50_ms"] and plain["tpot_50_ms"]:
            compared["tpot_50_ratio"] = spec["tpot_50_ms"] / plain["tpot_50_ms"]
        compared["identical"] = _identical(*(p for p in passes if p.round == round_))
        rounds.append(compared)
    return {"passes": rows, "rounds": rounds}


def _row(p: Pass) -> dict:
    done = [r for r in p.records if not r.error]
    lengths = [r.mean_acceptance_length for r in done if r.mean_acceptance_length is not None]
    waited = [(r.drafter_wait_s, r.e2e_s) for r in done if r.drafter_wait_s is not None and r.e2e_s]
    tokens = sum(r.output_tokens for r in done)
    classes = sorted({r.priority for r in p.records})
    return {
        "mode": p.mode, "round": p.round, "done": len(done), "failed": len(p.records) - len(done),
        "first_error": next((r.error for r in p.records if r.error), ""), "wall_s": p.wall_s,
        "requests_per_s": len(done) / p.wall_s, "output_tokens": tokens, "output_tokens_per_s": tokens / p.wall_s,
        **_percentiles_ms(ttft=[r.ttft_s for r in done if r.ttft_s is not None],
                          tpot=[r.tpot_s for r in done if r.tpot_s is not None],
                          itl=[g for r in done for g in r.chunk_gaps_s]),
        "mean_acceptance_length": statistics.mean(lengths) if lengths else None,
        # Of the requests' time, the share their steps spent on drafter calls: what drafting as a service cost.
        "drafter_wait_share": sum(w for w, _ in waited) / sum(e for _, e in waited) if waited else None,
        "by_priority": [_class_row(p, k) for k in classes] if len(classes) > 1 else [],
    }


def _class_row(p: Pass, priority: int) -> dict:
    """One priority's requests of a pass: how many, and their times to first and to last token."""
    records = [r for r in p.records if r.priority == priority]
    done = [r for r in records if not r.error]
    return {"priority": priority, "done": len(done), "failed": len(records) - len(done),
            **_percentiles_ms(ttft=[r.ttft_s for r in done if r.ttft_s is not None],
                              e2e=[r.e2e_s for r in done if r.e2e_s is not None])}


def _percentiles_ms(**series: list[float]) -> dict[str, float | None]:
    """name_50_ms and name_99_ms of each series of seconds."""
    return {f"{name}_{q}_ms": _ms(percentile(values, q)) for name, values in series.items() for q in (50, 99)}


def _identical(*passes: Pass) -> dict:
    """A round's outputs (greedy, or seeded alike) compared prompt by prompt between its spec and plain passes:
    how many were compared, how many were the same, and the prompts (indices) that were not."""
    spec = next(p for p in passes if p.mode == "spec")
    plain = next(p for p in passes if p.mode == "plain")
    pairs = [(a.prompt, a.token_ids, b.token_ids) for a, b in zip(spec.records, plain.records)
             if not (a.error or b.error) and a.token_ids is not None and b.token_ids is not None]
    differ = [prompt for prompt, a, b in pairs if a != b]
    return {"same": len(pairs) - len(differ), "compared": len(pairs), "differ": differ}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def print_summary(summary: dict, base: str, model: str, requests: list[Request], args: argparse.Namespace) -> None:
    prompts = len(requests)
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g}/s (Poisson)"
    print(f"\nbench-serve {base}, model {model}: {prompts} prompts a pass, sent {rate}, "
          f"at most {args.max_concurrency or prompts} at a time")
    header = (f"{'pass':<8}{'done':>6}{'failed':>7}{'req/s':>8}{'out tok/s':>11}{'TTFT p50/p99 ms':>20}"
              f"{'TPOT p50/p99 ms':>20}{'ITL p50/p99 ms':>20}{'MAL':>6}{'drafter':>9}")
    print(header)
    print("-" * len(header))
    for m in summary["passes"]:
        ttft, tpot, itl = (f"{_f(m[f'{name}_50_ms'])} / {_f(m[f'{name}_99_ms'])}" for name in ("ttft", "tpot", "itl"))
        print(f"{m['mode'] + ' ' + str(m['round'] + 1):<8}{m['done']:>6}{m['failed']:>7}{m['requests_per_s']:>8.2f}"
              f"{m['output_tokens_per_s']:>11.1f}{ttft:>20}{tpot:>20}{itl:>20}"
              f"{_f(m['mean_acceptance_length'], '.2f'):>6}"
              f"{_percent(m['drafter_wait_share']):>9}")
        for c in m["by_priority"]:
            print(f"  priority {c['priority']}: {c['done']} done, {c['failed']} failed; TTFT p50/p99 "
                  f"{_f(c['ttft_50_ms'])} / {_f(c['ttft_99_ms'])} ms, last token p50/p99 "
                  f"{_f(c['e2e_50_ms'])} / {_f(c['e2e_99_ms'])} ms")
        if m["first_error"]:
            print(f"  {m['failed']} failed, the first with {m['first_error']}")
    for compared in summary["rounds"]:
        line = (f"round {compared['round'] + 1}, speculation: {compared['output_tokens_per_s_ratio']:.2f}x the "
                f"output tokens/s")
        if "tpot_50_ratio" in compared:
            line += f", {compared['tpot_50_ratio']:.2f}x the median TPOT"
        if "identical" in compared:
            same = compared["identical"]
            line += f"; outputs identical: {same['same']} of {same['compared']}"
            if same["differ"]:
                line += f" (not: {', '.join(requests[i].name for i in same['differ'][:3])}"
                line += f" and {len(same['differ']) - 3} more)" if len(same["differ"]) > 3 else ")"
        print(line)
    if len(summary["rounds"]) > 1:
        print("(a later round asks the same prompts again: a drafter that learns from finished requests, as the "
              "suffix drafter does, has seen their answers)")


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"
