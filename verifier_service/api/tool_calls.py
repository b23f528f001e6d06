"""Tool calling on the OpenAI front, with vLLM's semantics.

The chat's `tools` reach the model's chat template (request_parsing.py); `tool_choice` says how an
answer becomes calls:
- "none": text, as without tools.
- a named function: the answer is held to that function's `parameters` schema (structured output,
  so speculation stays lossless) and is the call's arguments; `finish_reason` "stop", as OpenAI
  answers a forced call.
- "required": held to a JSON array of one or more `{"name", "parameters"}` of the tools (exactly one
  when `parallel_tool_calls` is false), as vLLM holds it; `finish_reason` "tool_calls".
- "auto" (the default with tools): the model decides, and its calls are parsed out of its text by
  the server's `--tool-call-parser`: `hermes`, the `<tool_call>{"name", "arguments"}</tool_call>`
  blocks of Hermes, Qwen2.5 and Qwen3. Text before the first block is the content; a block that is
  not a call leaves the whole answer as text, as vLLM's parser does.

Streamed, a named call's arguments go out as they are generated, as vLLM streams them; an
answer's text goes out as it comes, up to where a call may begin; required and auto calls go out
whole, in the choice's last chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from drafter_sdk.proto import verifier_pb2

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text

    def message(self, index: int | None = None) -> dict[str, object]:
        """OpenAI's tool_calls[i] (with `index` in a stream's delta)."""
        call: dict[str, object] = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                                   "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """How this request's answers become calls (module docstring)."""

    mode: str  # "none", "named", "required" or "auto"
    name: str = ""  # the named function's
    constraint: verifier_pb2.StructuredOutput | None = None
    parser: str | None = None  # auto's: the server's --tool-call-parser (None: auto is not served)

    def unserved(self) -> str | None:
        """Why this server cannot answer the plan, if it cannot."""
        if self.mode == "auto" and self.parser is None:
            return ('"auto" tool choice needs a tool call parser: start the verifier with --enable-auto-tool-choice '
                    '--tool-call-parser hermes, or name a function, or send "required"')
        return None

    def answer(self, text: str, finish: str | None) -> tuple[str | None, list[Call], str | None]:
        """(content, calls, finish_reason) of a whole answer that ended with `finish`."""
        if self.mode == "named":
            return None, [Call(self.name, text)], finish
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short by max_tokens: what there is stays, as text
                return text, [], finish
            return None, calls, "tool_calls" if finish == "stop" else finish
        if self.mode == "auto":
            content, calls = hermes(text)
            if calls:
                return content, calls, "tool_calls" if finish == "stop" else finish
        return text, [], finish


def plan(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None, parallel: bool,
         parser: str | None) -> ToolPlan:
    """The plan for these tools and tool_choice (with tools, "auto" unless chosen), answered "auto"
    with `parser`; ValueError says what is wrong with them."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise ValueError("tools: two tools have the same name")
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise ValueError("tool_choice needs tools")
        return ToolPlan("none")
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        return ToolPlan("auto", parser=parser)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | ({} if parallel else {"maxItems": 1})
        return ToolPlan("required", constraint=compact_json_schema(array))
    name = choice["function"]["name"]
    if name not in schemas:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
    return ToolPlan("named", name=name, constraint=compact_json_schema(schemas[name]))


def compact_json_schema(schema: dict[str, Any]) -> verifier_pb2.StructuredOutput:
    """JSON of `schema` with no whitespace between items (llguidance's schema option; vLLM's
    disable_any_whitespace). Calls are held to it: their arguments are read by programs, and a small
    model held to JSON that may hold any whitespace can fill max_tokens with whitespace."""
    options = schema.get("x-guidance")
    compact = {**schema, "x-guidance": {**(options if isinstance(options, dict) else {}), "whitespace_flexible": False}}
    return verifier_pb2.StructuredOutput(json_schema=json.dumps(compact))


def _required_calls(text: str) -> list[Call] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and {"name", "parameters"} <= i.keys()
                                              for i in items):
        return None
    return [Call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def hermes(text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of an answer in the Hermes format; (text, []) when a block is not a call."""
    if START not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return text, []
        calls.append(Call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    content = text[:text.index(START)].strip()
    return content or None, calls


class CallStream:
    """One streamed choice's text under a tool plan that makes calls (named, required or auto): per
    piece, the content and tool-call deltas that can go out now; at the end, the rest."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self._plan = tool_plan
        self._text = ""
        self._sent = 0  # characters of _text sent, as content or as a named call's arguments

    def feed(self, piece: str) -> tuple[str, list[dict[str, object]]]:
        """(content, tool-call deltas) of `piece`. A named call's arguments go out as they come, its
        first delta naming it, as vLLM streams them; required calls wait for the end; an auto answer's
        text goes out up to its first call, keeping back an end that may be a call's start."""
        self._text += piece
        if self._plan.mode == "named":
            first = self._sent == 0 and self._text
            self._sent = len(self._text)
            if first:
                return "", [Call(self._plan.name, self._text).message(0)]
            return "", [{"index": 0, "function": {"arguments": piece}}] if piece else []
        if self._plan.mode == "required":  # the whole answer is the calls' JSON
            return "", []
        start = self._text.find(START)
        end = start if start >= 0 else len(self._text) - _partial_start(self._text)
        out, self._sent = self._text[self._sent:end], max(self._sent, end)
        return out, []

    def finish(self, finish: str | None) -> tuple[str, list[dict[str, object]], str | None]:
        """(the content not yet sent, the tool-call deltas not yet sent, the finish_reason) once the
        answer has ended."""
        _, calls, reason = self._plan.answer(self._text, finish)
        if self._plan.mode == "named":
            return "", [] if self._text else [Call(self._plan.name, "").message(0)], reason
        if calls:
            return "", [call.message(i) for i, call in enumerate(calls)], reason
        return self._text[self._sent:], [], reason


def _partial_start(text: str) -> int:
    """How many of the text's last characters could be the start of a tool call's opening tag."""
    return next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if text.endswith(START[:n])), 0)
