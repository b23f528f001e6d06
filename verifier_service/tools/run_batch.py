"""`splitspec run-batch`: a file of requests in OpenAI's batch format, answered by a running verifier.

The input is the JSONL that OpenAI's Batch API and `vllm run-batch` read: one request a line, with its
`custom_id`, `method` POST, `url` (/v1/chat/completions, /v1/completions or /v1/responses) and `body`. The
output is the JSONL they write: per request its `id`, `custom_id`, `response` (`status_code`,
`request_id`, `body`) and `error`. Where `vllm run-batch` loads the model itself, this sends the lines to
a verifier that is already serving (a deployment, with its drafters), at most `--concurrency` at a time, so
that a batch takes the path live traffic takes: the same drafters, and a suffix drafter that learns from
every answer of the fleet learns from the batch's too.

The whole file is checked before anything is sent, as OpenAI validates a batch: every mistake is listed
with its line, and nothing runs (exit status 2). Answers are written as they come (so in no set order:
match them by custom_id), each line flushed, so that a batch cut short (a crash, Ctrl-C) goes on with
`--resume`, which keeps the lines already answered and sends only the rest. A server that is full (429),
draining or behind a failing proxy (502-504), or out of reach is retried with growing pauses, up to
`--max-retries` times; a request it refuses (400, 404...) is answered as it is, in its line. The exit
status is 0 when every request has its answer and 1 when some could not get one (their lines carry an
`error`, or the 429 or 5xx they got last; `--resume` sends them again). At the end a summary: answers by
status, tokens, time, and the mean acceptance length the verifier reported over the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from verifier_service.api import json_text
from verifier_service.tools import http_client
from verifier_service.tools.cli import whole_number

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRIED = frozenset({429, 502, 503, 504})  # the server could answer later; any other status is its answer
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.25, 8.0


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict[str, Any]


class BatchFileError(ValueError):
    """The input's mistakes, one per line that has one."""

    def __init__(self, mistakes: list[str]) -> None:
        super().__init__("\n".join(mistakes))
        self.mistakes = mistakes


def read_requests(path: Path) -> list[BatchRequest]:
    """Every request of the file, checked; raises BatchFileError listing each line's mistake."""
    requests: list[BatchRequest] = []
    mistakes: list[str] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json_text.loads(line)
            except json_text.NotText as exc:
                mistakes.append(f"line {number}: {exc}")
                continue
            except ValueError as exc:
                mistakes.append(f"line {number}: not JSON ({exc})")
                continue
            if mistake := _mistake(item, seen):
                mistakes.append(f"line {number}: {mistake}")
                continue
            seen.add(item["custom_id"])
            requests.append(BatchRequest(item["custom_id"], item["url"], item["body"]))
    if not requests and not mistakes:
        mistakes.append("the file holds no requests")
    if mistakes:
        raise BatchFileError(mistakes)
    return requests


def _mistake(item: object, seen: set[str]) -> str | None:
    if not isinstance(item, dict):
        return "not a JSON object"
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string"
    if custom_id in seen:
        return f"custom_id {custom_id!r} is used by an earlier line; each request needs its own"
    if item.get("method") != "POST":
        return f"method must be POST, not {item.get('method')!r}"
    if url not in URLS:
        return f"url must be one of {', '.join(URLS)}, not {url!r}"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("stream"):
        return "body.stream: a batch's answers are whole; leave stream out"
    if body.get("background"):
        return "body.background: a batch's answers are waited for; leave background out"
    return None


def _final(line: str) -> tuple[str, str] | None:
    """(custom_id, line) of an output line that holds a final answer; None for a line cut short, an
    error, or a status worth retrying."""
    try:
        answer = json.loads(line)
        custom_id, response = answer["custom_id"], answer["response"]
        final = response is not None and response["status_code"] not in RETRIED
    except (ValueError, KeyError, TypeError):
        return None
    return (custom_id, line) if final else None


def kept_answers(output: Path) -> dict[str, str]:
    """--resume: the output's final answers (custom_id -> its line), the file rewritten with just those, so
    that a line cut short or an answer to retry does not stay beside its new one."""
    if not output.exists():
        return {}
    kept = dict(filter(None, (_final(line.rstrip("\n")) for line in output.open(encoding="utf-8"))))
    rewritten = output.with_name(output.name + ".resume")
    rewritten.write_text("".join(line + "\n" for line in kept.values()), encoding="utf-8")
    rewritten.replace(output)
    return kept


def _answer(request: BatchRequest, reply: httpx.Response | None, error: str = "") -> dict[str, Any]:
    """The output line of a request: OpenAI's batch output shape."""
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
                            "response": None, "error": None}
    if reply is None:
        line["error"] = {"code": "unreachable", "message": error}
        return line
    try:
        body: object = reply.json()
    except ValueError:  # not the verifier's own answer (a proxy's page, say): kept as text
        body = reply.text
    line["response"] = {"status_code": reply.status_code, "request_id": reply.headers.get("x-request-id", ""),
                        "body": body}
    return line


@dataclass
class Summary:
    statuses: Counter[int] = field(default_factory=Counter)  # of the lines with a response
    answered: int = 0  # final answers (not a status to retry)
    unanswered: int = 0  # unreachable, or their last status one to retry
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    draft_tokens: int = 0

    def add(self, line: dict[str, Any]) -> None:
        response = line["response"]
        final = response is not None and response["status_code"] not in RETRIED
        self.answered += final
        self.unanswered += not final
        if response is None:
            return
        self.statuses[response["status_code"]] += 1
        body = response["body"]
        if response["status_code"] != 200 or not isinstance(body, dict):
            return
        usage = body.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        spec = body.get("speculation") or {}
        self.drafts += spec.get("num_drafts", 0)
        self.accepted += spec.get("num_accepted_tokens", 0)
        self.draft_tokens += spec.get("num_draft_tokens", 0)

    def lines(self, total: int, resumed: int, seconds: float) -> list[str]:
        answered = ", ".join(f"{n} answered {status}" for status, n in sorted(self.statuses.items()))
        sent = total - resumed
        lines = [f"{total} requests ({resumed} answered before, kept by --resume; {sent} sent): {answered or 'none'}"
                 f"; {self.unanswered} without an answer; {self.retries} retries; {seconds:.1f} s",
                 f"tokens: {self.prompt_tokens} prompt, {self.completion_tokens} completion "
                 f"({self.completion_tokens / seconds if seconds else 0.0:.1f} completion tokens/s)"]
        if self.drafts:
            lines.append(f"speculation: mean acceptance length {1 + self.accepted / self.drafts:.2f} "
                         f"({self.accepted} of {self.draft_tokens} draft tokens accepted)")
        return lines


async def _send(client: httpx.AsyncClient, request: BatchRequest, max_retries: int, summary: Summary) -> dict:
    """The request's answer, retried (with growing pauses) while the server cannot take it yet; not where its
    certificate failed verification, which no later try would change."""
    pause, error = FIRST_PAUSE_S, ""
    for attempt in range(max_retries + 1):
        if attempt:
            summary.retries += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, LONGEST_PAUSE_S)
        try:
            reply = await client.post(request.url, json=request.body)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if _untrusted(exc):  # the server's certificate: no later try changes that
                break
            continue
        if reply.status_code not in RETRIED or attempt == max_retries:
            return _answer(request, reply)
    tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
    return _answer(request, None, f"no answer after {tries}; the last: {error}")


def _untrusted(exc: BaseException) -> bool:
    """Whether the server's certificate failed verification (another CA's, another name's, expired): an
    ssl.SSLCertVerificationError anywhere in what caused the error. (A server refusing this client's certificate,
    or its lack of one, closes the connection after TLS 1.3's handshake, as a server going away does: retried.)"""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _run(args: argparse.Namespace, requests: list[BatchRequest], reach: http_client.HttpAccess,
               summary: Summary) -> None:
    todo = iter(requests)  # shared by the workers: each takes the next request when it is free
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 10.0))
    async with httpx.AsyncClient(base_url=reach.base_url, headers=reach.headers, verify=reach.verify,
                                 timeout=timeout, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        with args.output.open("a", encoding="utf-8") as out:
            async def worker() -> None:
                for request in todo:
                    line = await _send(client, request, args.max_retries, summary)
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    out.flush()
                    summary.add(line)

            await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(requests)))))


def main(args: argparse.Namespace) -> int:
    try:
        if args.output.resolve() == args.input.resolve():
            raise ValueError("the output file must not be the input file")
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be positive, not {args.timeout}")
        reach = http_client.access(args)
        requests = read_requests(args.input)
        kept = kept_answers(args.output) if args.resume else {}
        if not args.resume:
            args.output.write_text("", encoding="utf-8")
    except BatchFileError as exc:
        shown = exc.mistakes[:20]
        more = [f"... and {len(exc.mistakes) - 20} more"] if len(exc.mistakes) > 20 else []
        print("\n".join([f"splitspec run-batch: {args.input}: nothing sent:", *shown, *more]), file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"splitspec run-batch: {exc}", file=sys.stderr)
        return 2
    todo = [r for r in requests if r.custom_id not in kept]
    resumed = len(requests) - len(todo)
    summary, started = Summary(), time.perf_counter()
    try:
        asyncio.run(_run(args, todo, reach, summary))
    except KeyboardInterrupt:
        print(f"splitspec run-batch: interrupted; {resumed + summary.answered} of {len(requests)} answers are in "
              f"{args.output}: --resume sends the rest", file=sys.stderr)
        return 130
    for line in summary.lines(len(requests), resumed, time.perf_counter() - started):
        print(f"splitspec run-batch: {line}", file=sys.stderr)
    return 1 if summary.unanswered else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", type=Path, required=True, metavar="FILE",
                   help="requests, one a line, in OpenAI's batch format (custom_id, method, url, body)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE",
                   help="answers, one a line, in OpenAI's batch output format (custom_id, response, error)")
    p.add_argument("--base-url", default="http://localhost:8000", help="the verifier's HTTP API")
    p.add_argument("--concurrency", type=whole_number(1, 4096), default=32, help="requests in flight at most")
    p.add_argument("--max-retries", type=whole_number(0, 100), default=8,
                   help="tries after the first for a request the server could not take yet (429, 502-504) or "
                        "did not answer")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--resume", action="store_true",
                   help="keep the answers already in the output file and send only the other requests")
    http_client.add_arguments(p)
    p.set_defaults(func=main)
