"""Anthropic's message object and its stream of events, built from the engine's outputs.

A message's `content` is a text block (where the answer has text) and, under a tool choice that makes
calls, a `tool_use` block per call after it, its `input` the call's JSON arguments as an object
(tool_calls.py reads the calls, as for chat). Under `--reasoning-parser`, a model that thought opens
its content with a `thinking` block, as Claude's extended thinking does (its `signature` empty: there
is nothing to sign), unless the request's `thinking` is disabled (with `display` "omitted", its text left
out, and no thinking_delta streamed); the text block and the calls are
read from the answer after the thinking alone (reasoning_split.py), and the markers reach neither.
`stop_reason`: "tool_use" where it calls, "max_tokens" where the limit cut it, "stop_sequence" (with
`stop_sequence`) where one of the request's ended it, else "end_turn". Streamed, Anthropic's events
in its order: message_start (usage so far), per block content_block_start, its deltas (thinking_delta,
text_delta, or input_json_delta: the arguments as they are written) and content_block_stop, then
message_delta (stop_reason, output tokens, the thinking's included as Anthropic counts them) and
message_stop; the client's own stream helper builds the same message from them (it needs no
signature_delta: the block's empty signature comes with its start). Usage is split as Anthropic splits
it: input_tokens are the prompt's tokens not read from the prefix cache, cache_read_input_tokens those
read from it, so that their sum is the prompt (message_start's usage may go out before the prompt is
admitted, and then counts it all as input; message_delta's has the split); the speculation stats ride
under vLLM's names.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from verifier_service.api.http_responses import FINISH, event_sse, speculation
from verifier_service.api.messages_schema import MessagesRequest
from verifier_service.api.reasoning_split import ThoughtSplit
from verifier_service.api.tool_calls import CallStream, ToolPlan
from verifier_service.engine.reasoning import Reasoning
from verifier_service.engine.sequence import FinishReason, Output, Sequence

# The blocks streamed text by text, as each starts out; its deltas are {"type": f"{kind}_delta", kind: text}.
_EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input: the object they spell, as far as they are written (a call
    cut short by max_tokens); {} where they spell no object."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class MessageBuilder:
    """One message (of `seq`): whole (`whole`) or as events (`opening`, `feed` per output, `closing`)."""

    request: MessagesRequest
    seq: Sequence
    model: str
    tools: ToolPlan
    reasoning: Reasoning | None = None  # the server's --reasoning-parser: the output opens with thinking
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    _blocks: list[dict[str, Any]] = field(default_factory=list)  # streaming: the blocks begun
    _open: int | None = None  # streaming: the block whose deltas go out now
    _calls: CallStream | None = None  # streaming under a plan that makes calls
    _call_blocks: list[int] = field(default_factory=list)  # streaming: each call's block index
    _called: bool = False
    _thoughts: ThoughtSplit | None = None  # under a reasoning parser: the output's text, thinking and answer

    def __post_init__(self) -> None:
        if self.tools.makes_calls:
            self._calls = CallStream(self.tools)
        if self.reasoning is not None:
            self._thoughts = ThoughtSplit(self.reasoning, self.seq.prompt_ids)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(the thinking to show, the answer) that the output's next `text` releases."""
        if self._thoughts is None:
            return "", text
        thinking, answer = self._thoughts.feed(text, final)
        return (thinking if self.request.shows_thinking else ""), answer

    def _stop(self, out_finish: FinishReason | None, stop_reason: str, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        finish = FINISH.get(out_finish)
        if finish == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if stop_reason and stop_reason in (self.request.stop_sequences or []) + self._stops():
            return "stop_sequence", stop_reason
        return "end_turn", None

    def _stops(self) -> list[str]:
        stop = self.request.stop
        return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)

    def _usage(self) -> dict[str, int]:
        cached = self.seq.cached_prompt_tokens
        return {"input_tokens": len(self.seq.prompt_ids) - cached, "output_tokens": len(self.seq.output_ids),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": self._usage()}

    @staticmethod
    def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": call_id, "name": name, "input": _input(arguments)}

    def whole(self, out: Output) -> dict[str, Any]:
        """The finished message of a request not streamed; `out`: its outputs joined."""
        thinking, content = self._split(out.text, final=True)
        calls = []
        if self.tools.makes_calls:
            content, calls, _ = self.tools.answer(content, FINISH.get(out.finish_reason))
        shown = "" if self.request.omits_thinking else thinking
        blocks = [{**_EMPTY["thinking"], "thinking": shown}] if thinking else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [self._tool_use(f"toolu_{uuid.uuid4().hex}", c.name, c.arguments) for c in calls]
        message = self._message(blocks, self._stop(out.finish_reason, out.stop_reason, bool(calls)))
        message["speculation"] = speculation([self.seq])
        return message

    def opening(self) -> list[str]:
        return [event_sse({"type": "message_start", "message": self._message([], (None, None))})]

    def feed(self, out: Output) -> list[str]:
        """The events of one output of the sequence (the last one included)."""
        ended = out.finish_reason is not None
        thinking, content = self._split(out.text, ended)
        deltas = []
        if self.tools.makes_calls:
            content, deltas, _ = self._calls.advance(content, ended, FINISH.get(out.finish_reason))
        events = []
        if thinking:
            events = self._opened("thinking") if self.request.omits_thinking else self._delta("thinking", thinking)
        events += self._delta("text", content) if content else []
        for delta in deltas:
            events += self._call_delta(delta)
        return events

    def _begin(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        return events + [event_sse({"type": "content_block_start", "index": self._open, "content_block": block})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [event_sse({"type": "content_block_stop", "index": index})]

    def _delta(self, kind: str, text: str) -> list[str]:
        """`text` added to the open block of `kind` ("text" or "thinking"), begun unless it is the one open."""
        return self._opened(kind) + [event_sse({"type": "content_block_delta", "index": self._open,
                                                "delta": {"type": f"{kind}_delta", kind: text}})]

    def _opened(self, kind: str) -> list[str]:
        """A block of `kind` begun, unless it is the one open."""
        if self._open is not None and self._blocks[self._open]["type"] == kind:
            return []
        return self._begin(dict(_EMPTY[kind]))

    def _call_delta(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool-call delta (tool_calls.CallStream) as the tool_use block's events."""
        events = []
        function = delta["function"]
        if "id" in delta:  # a call begins
            self._called = True
            events += self._begin({"type": "tool_use", "id": delta["id"], "name": function["name"], "input": {}})
            self._call_blocks.append(self._open)
        index = self._call_blocks[delta["index"]]
        if function.get("arguments"):
            events.append(event_sse({"type": "content_block_delta", "index": index,
                                     "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
        return events

    def closing(self, last: Output) -> list[str]:
        """The events that end the message (`last`: its last output)."""
        stop = self._stop(last.finish_reason, last.stop_reason, self._called)
        return [*self._close(),
                event_sse({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                           "usage": self._usage(), "speculation": speculation([self.seq])}),
                event_sse({"type": "message_stop"})]

    @staticmethod
    def failed(message: str) -> list[str]:
        return [event_sse({"type": "error", "error": {"type": "api_error", "message": message}})]
