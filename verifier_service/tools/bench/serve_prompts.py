"""The prompts `splitspec bench-serve` sends: a JSONL dataset, a ShareGPT file, or the built-in workloads.

Each becomes a `Request`: a chat's messages or a raw completion's text, which goes out as the body of
/v1/chat/completions or /v1/completions. A line or item that is not a prompt is named (file, line or item)
before anything is sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

# The built-in workloads this bench can send: those given as whole texts (agentic turns need the last answer).
WORKLOADS = ("grounded", "code", "open", "recurring", "templated")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Request:
    """One prompt as it goes out: a chat's messages, or a raw completion's text."""

    name: str
    messages: list[dict] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    priority: int | None = None  # vLLM's request priority (a verifier with --scheduling-policy priority)

    def body(self, model: str, args: argparse.Namespace, mode: str, index: int) -> tuple[str, dict]:
        """(path, body) of this prompt's streamed request (the `index`-th); mode "plain" turns speculation off
        for it alone. Sampled (any temperature but 0, the server's defaults included), it carries the seed
        --seed + index in every pass: a seeded request's tokens do not depend on its drafts, so the passes'
        outputs still compare."""
        body: dict = {"model": model, "max_tokens": self.max_tokens or args.max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}}
        if args.temperature is not None:  # None: the server's sampling defaults (the model's generation config)
            body["temperature"] = args.temperature
        body |= {name: value for name, value in (("top_p", args.top_p), ("top_k", args.top_k)) if value is not None}
        if args.temperature != 0:
            body["seed"] = args.seed + index
        if self.priority is not None:
            body["priority"] = self.priority
        if args.ignore_eos:
            body["ignore_eos"] = True
        if mode == "plain":
            body["speculation"] = {"disable": True}
        if self.messages is not None:
            return "/v1/chat/completions", body | {"messages": self.messages}
        return "/v1/completions", body | {"prompt": self.prompt}


def load_dataset(path: Path) -> list[Request]:
    """The prompts of a JSONL file, or of a ShareGPT JSON file (a list of {"conversations": [...]}, as vLLM's
    benchmarks read it); ValueError naming the line or the item of the first one that is not a prompt."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        return _sharegpt(path, text)
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            requests.append(_request(item, f"{path.name}:{number}"))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}, line {number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return requests


def _sharegpt(path: Path, text: str) -> list[Request]:
    """Each conversation up to and including its first human turn, as a chat (the first question, after any
    system or gpt turn before it); a conversation without a human turn is passed over."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    requests = []
    for index, item in enumerate(items):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f"{path}, item {index}: a ShareGPT item holds a list of turns under \"conversations\"")
        messages = []
        for turn in turns:
            role = SHAREGPT_ROLES.get(turn.get("from"))
            if role is None or not isinstance(turn.get("value"), str):
                raise ValueError(f"{path}, item {index}: a turn is {{\"from\": human, gpt or system, \"value\": "
                                 f"text}}, not {json.dumps(turn)[:100]}")
            messages.append({"role": role, "content": turn["value"]})
            if role == "user":
                requests.append(Request(f"{path.name}:{item.get('id', index)}", messages=messages))
                break
    if not requests:
        raise ValueError(f"{path} holds no conversation with a human turn")
    return requests


def _request(item: object, name: str) -> Request:
    if not isinstance(item, dict):
        raise ValueError("a line must be a JSON object")
    max_tokens, priority = item.get("max_tokens"), item.get("priority")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be a positive integer, not {max_tokens!r}")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ValueError(f"priority must be an integer, not {priority!r}")
    if "messages" in item:
        messages = item["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise ValueError("messages must be a non-empty list of message objects")
        return Request(name, messages=messages, max_tokens=max_tokens, priority=priority)
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError('a line needs "messages" (a chat) or "prompt" (a non-empty string)')
    if item.get("raw", False):
        return Request(name, prompt=prompt, max_tokens=max_tokens, priority=priority)
    return Request(name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, priority=priority)


def with_priorities(requests: list[Request], priorities: list[int]) -> list[Request]:
    """Prompt i takes priorities[i % len(priorities)], unless its dataset line gave its own."""
    return [r if r.priority is not None else dataclasses.replace(r, priority=priorities[i % len(priorities)])
            for i, r in enumerate(requests)]


def builtin(names: str, count: int) -> list[Request]:
    from verifier_service.tools.bench import workloads  # reads the standard library's sources: only when asked

    requests = []
    for workload in names.split(","):
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        for name, text in workloads.WORKLOADS[workload](count):
            # Code is completed as it stands, as the other benches send it; the rest are chat questions.
            requests.append(Request(f"{workload}: {name}", prompt=text) if workload == "code" else
                            Request(f"{workload}: {name}", messages=[{"role": "user", "content": text}]))
    return requests
