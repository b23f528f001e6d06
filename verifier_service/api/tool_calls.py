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

A call's arguments are the JSON text the model wrote for them, whole and streamed alike (a Hermes
call without arguments has "{}"). Streamed, every call goes out as it is generated, as vLLM streams
them: its first delta (id, name) once its name has been read, then its arguments as they come. An
auto answer's text goes out as it comes, up to where a call may begin. Where the whole answer would
stay text (auto: a block that is not a call; required: JSON cut short by max_tokens; either: a call
holding a lone surrogate, json_text.py), what was already streamed stands: the calls sent so far, and
no more of the text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import json_text
from verifier_service.engine.detokenizer import partial_start

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
# The start of a call's object up to its arguments' value: {"name": "...", "<key>": (the key: ARGUMENTS).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
ARGUMENTS = {"auto": "arguments", "required": "parameters"}


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

    @property
    def makes_calls(self) -> bool:
        return self.mode != "none"

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
    """JSON of `schema` with no whitespace between items (compact_schema). Calls are held to it."""
    return verifier_pb2.StructuredOutput(json_schema=json.dumps(compact_schema(schema)))


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, for JSON with no whitespace between items (llguidance's schema option; vLLM's
    disable_any_whitespace): for JSON read by programs, as calls' arguments are, since a small model
    held to JSON that may hold any whitespace can fill max_tokens with whitespace."""
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(options if isinstance(options, dict) else {}), "whitespace_flexible": False}}


def _required_calls(text: str) -> list[Call] | None:
    try:
        items = json_text.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and {"name", "parameters"} <= i.keys()
                                              for i in items):
        return None
    starts = _item_starts(text)
    return [_call(text, start, item["name"], item["parameters"], "parameters") for start, item in zip(starts, items)]


def hermes(text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of an answer in the Hermes format; (text, []) when a block is not a call."""
    if START not in text:
        return text, []
    calls = []
    for block in _BLOCK.finditer(text):
        try:
            call = json_text.loads(block.group(1))
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return text, []
        calls.append(_call(text, block.start(1), call["name"], call.get("arguments", {}), "arguments"))
    content = text[:text.index(START)].strip()
    return content or None, calls


def _call(text: str, start: int, name: str, arguments: Any, key: str) -> Call:
    """The call whose object starts at `start`, its arguments as the text wrote them (json.dumps of
    them where that text is not where the head reads it: another key order, a repeated key)."""
    head = _head(text, start, key)
    if head is not None:
        end = _value_end(text, head[1])
        if end is not None and json.loads(text[head[1]:end]) == arguments:
            return Call(name, text[head[1]:end])
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def _head(text: str, start: int, key: str) -> tuple[str, int] | None:
    """(name, where its arguments' object starts) of a call's object at `start`, once that much is written."""
    head = _HEAD.match(text, start)
    if head is None or head.group(2) != key or not text.startswith("{", head.end()):
        return None
    try:
        return json_text.loads(f'"{head.group(1)}"'), head.end()
    except ValueError:  # not a JSON string (a bad escape, a lone surrogate): not a call, as the whole answer reads
        return None


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at `start` ends (past its close); None: not yet written."""
    return _ValueScan(start).end(text)


@dataclass
class _ValueScan:
    """Reads a JSON object or array as its text grows, each character once: a stream asks again after
    every piece, and a call's arguments may be long (a file's content)."""

    pos: int  # the next character to read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """Where the value ends (past its close); None: not yet written (the scan resumes there)."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for i in range(self.pos, len(text)):
            c = text[i]
            if escaped:
                escaped = False
            elif in_string:
                escaped, in_string = c == "\\", c != '"'
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.pos, self.depth = i + 1, 0
                    return i + 1
        self.pos, self.depth, self.in_string, self.escaped = len(text), depth, in_string, escaped
        return None


def _item_starts(text: str) -> list[int]:
    """Where each object of a JSON array of objects starts."""
    starts, i = [], text.index("[") + 1
    while (i := _next_item(text, i)) is not None:
        starts.append(i)
        end = _value_end(text, i)
        if end is None:
            break
        i = end
    return starts


def _next_item(text: str, i: int) -> int | None:
    """Where the next object of an array starts, past `i` (after the array's opening or an item's end)."""
    while i < len(text) and text[i] in " \t\r\n,":
        i += 1
    return i if text.startswith("{", i) else None


@dataclass
class _Streaming:
    """A call that has gone out, as far as it has."""

    start: int  # where its object starts in the answer's text
    sent: int  # where the part of its arguments sent so far ends (they start at its first value)
    arguments: _ValueScan  # its arguments, read as far as they are written
    end: int | None = None  # where they end, once written


class CallStream:
    """One streamed choice's text under a tool plan that makes calls (named, required or auto): per
    piece, the content and tool-call deltas that can go out now; at the end, the rest."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self._plan = tool_plan
        self._text = ""
        self._sent = 0  # characters of _text sent, as content or as a named call's arguments
        self._calls: list[_Streaming] = []  # required and auto: the calls begun, in order

    def feed(self, piece: str) -> tuple[str, list[dict[str, object]]]:
        """(content, tool-call deltas) of `piece` (module docstring). A named call's arguments are the
        whole answer; an auto answer's text goes out up to its first call, keeping back an end that
        may be a call's opening tag."""
        self._text += piece
        if self._plan.mode == "named":
            first = self._sent == 0 and self._text
            self._sent = len(self._text)
            if first:
                return "", [Call(self._plan.name, self._text).message(0)]
            return "", [{"index": 0, "function": {"arguments": piece}}] if piece else []
        content = ""
        if self._plan.mode == "auto" and not self._calls:
            start = self._text.find(START)
            end = start if start >= 0 else len(self._text) - partial_start(self._text, START)
            content, self._sent = self._text[self._sent:end], max(self._sent, end)
        return content, self._call_deltas()

    def advance(self, piece: str, ended: bool, finish: str | None) -> tuple[str, list[dict[str, object]], str | None]:
        """feed(piece) and, where the answer has `ended` (with `finish`), finish too: (content, tool-call
        deltas, finish_reason) of one output."""
        content, deltas = self.feed(piece)
        if not ended:
            return content, deltas, finish
        rest, last, finish = self.finish(finish)
        return content + rest, deltas + last, finish

    def _call_deltas(self) -> list[dict[str, object]]:
        """The deltas of the calls written since the last piece: each call's first (id, name), then
        its arguments as far as they are written."""
        deltas: list[dict[str, object]] = []
        key = ARGUMENTS[self._plan.mode]
        while True:
            if self._calls and self._calls[-1].end is None:
                call, index = self._calls[-1], len(self._calls) - 1
                call.end = call.arguments.end(self._text)
                upto = len(self._text) if call.end is None else call.end
                if upto > call.sent:
                    deltas.append({"index": index, "function": {"arguments": self._text[call.sent:upto]}})
                    call.sent = upto
                if call.end is None:
                    return deltas
            start = self._next_call()
            head = _head(self._text, start, key) if start is not None else None
            if head is None:
                return deltas
            deltas.append(Call(head[0], "").message(len(self._calls)))
            self._calls.append(_Streaming(start, head[1], _ValueScan(head[1])))

    def _next_call(self) -> int | None:
        """Where the next call's object starts, once it has begun."""
        after = self._calls[-1].end if self._calls else 0
        if self._plan.mode == "auto":
            opening = self._text.find(START, after)
            return opening + len(START) if opening >= 0 else None
        if not self._calls:
            opening = self._text.find("[")
            return _next_item(self._text, opening + 1) if opening >= 0 else None
        closed = _value_end(self._text, self._calls[-1].start)  # the last call's object, as _item_starts reads it
        return _next_item(self._text, closed) if closed is not None else None

    def finish(self, finish: str | None) -> tuple[str, list[dict[str, object]], str | None]:
        """(the content not yet sent, the tool-call deltas not yet sent, the finish_reason) once the
        answer has ended."""
        _, calls, reason = self._plan.answer(self._text, finish)
        if self._plan.mode == "named":
            return "", [] if self._text else [Call(self._plan.name, "").message(0)], reason
        if not self._calls:
            if calls:
                return "", [call.message(i) for i, call in enumerate(calls)], reason
            return self._text[self._sent:], [], reason
        # Some went out as they were written: they stand (module docstring), and so do the calls the
        # whole answer reads after them, where it reads calls.
        later = [call.message(i) for i, call in enumerate(calls[len(self._calls):], len(self._calls))]
        return "", later, "tool_calls" if finish == "stop" else finish

