"""The Responses API's response object and its stream of events, built from the engine's outputs.

A response's `output` is a list of items: the assistant's message (one output_text part, with its
log-probabilities where asked) and, under a tool choice that makes calls, a function_call item per
call after it (tool_calls.py reads them from the answer, as for chat). Streamed, the events are
OpenAI's, in its order: response.created and response.in_progress; per item output_item.added, then
its content (content_part.added, output_text.delta..., output_text.done, content_part.done; or
function_call_arguments.delta..., function_call_arguments.done) and output_item.done; last,
response.completed (response.incomplete where max_output_tokens cut the answer short), carrying the
whole response, as a non-streamed request gets it. Each event has its sequence_number. A background
response (background_runs.py) opens with response.created and response.queued, and its
response.in_progress comes with its first tokens. Usage counts
the prompt's tokens reused from the prefix cache as cached_tokens; the speculation stats ride under
vLLM's names, as in chat responses.

Under --reasoning-parser, a model that thought opens the output with a reasoning item, as OpenAI's
and vLLM's reasoning models do: its thinking as one reasoning_text content part, its summary empty
(nothing here summarises). Streamed, its events come first, as the model thinks (content_part.added,
reasoning_text.delta..., reasoning_text.done, content_part.done). The message, its log-probabilities
and the calls are the answer's after the thinking alone (reasoning_split.py), never the markers; a
model that thought and answered nothing (max_output_tokens cut its thinking short) has no message
item, as with OpenAI. Usage counts the thinking's tokens, markers included, as reasoning_tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verifier_service.api.http_responses import FINISH, chat_logprob, event_sse, speculation
from verifier_service.api.reasoning_split import ThoughtSplit
from verifier_service.api.responses_schema import ResponsesRequest
from verifier_service.api.tool_calls import CallStream, ToolPlan
from verifier_service.engine.reasoning import Phase, Reasoning
from verifier_service.engine.sequence import Output, Sequence


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _applied(value: float) -> float:
    """A sampling value as the request (or the model's defaults) wrote it: it went through a float32."""
    return float(f"{value:.7g}")


@dataclass
class ResponseBuilder:
    """One response (of `seq`): its body, whole (`whole`) or as events (`opening`, `feed` per output,
    `closing`, which leaves the finished body in `result`; or `failed` or `cancelled`). `token` names a
    token as log-probabilities show it; `stored`: whether it will be kept; `reasoning`: the server's
    --reasoning-parser."""

    request: ResponsesRequest
    seq: Sequence
    model: str
    tools: ToolPlan
    token: Callable[[int], str]
    stored: bool
    reasoning: Reasoning | None = None
    background: bool = False  # run apart from the request (background_runs.py): it opens queued
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)  # the items so far
    result: dict[str, Any] | None = None  # the finished response
    _message: dict[str, Any] | None = None  # streaming: the message item open now
    _thinking: dict[str, Any] | None = None  # streaming: the reasoning item open now
    _calls: CallStream | None = None  # streaming under a plan that makes calls
    _call_items: list[dict[str, Any]] = field(default_factory=list)  # streaming: by the call's index
    _thoughts: ThoughtSplit | None = None  # under a reasoning parser: the text, as thinking and answer
    _phase: Phase = Phase.ANSWER  # where the output's tokens so far have left it (all answer without a parser)
    _answered: bool = True  # some answer text has come (under a reasoning parser, not yet at first)
    _due: list[dict[str, object]] = field(default_factory=list)  # streaming: the answer's logprobs not yet sent
    _events: int = 0

    def __post_init__(self) -> None:
        if self.tools.makes_calls:
            self._calls = CallStream(self.tools)
        if self.reasoning is not None:
            self._thoughts = ThoughtSplit(self.reasoning, self.seq.prompt_ids)
            self._phase = self.reasoning.phase_after(self.seq.prompt_ids)
            self._answered = False

    def body(self, status: str, finished: bool = False) -> dict[str, Any]:
        """The response object as it stands (`finished`: with its usage)."""
        r = self.request
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        tool_choice: object = self.tools.mode
        if self.tools.mode == "named":
            tool_choice = {"type": "function", "name": self.tools.name}
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": self.background, "error": None,
            "conversation": {"id": r.conversation_id} if r.conversation_id is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "metadata": r.metadata or {},
            "model": self.model, "output": [dict(item) for item in self.output],
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning.echoed() if r.reasoning is not None else None, "store": self.stored,
            "temperature": _applied(self.seq.sampling.temperature), "top_p": _applied(self.seq.sampling.top_p),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_logprobs": r.top_logprobs, "truncation": r.truncation, "user": r.user, "usage": None}
        seq = self.seq
        if finished:
            thought = 0 if self.reasoning is None else self.reasoning.thought_tokens(seq.prompt_ids, seq.output_ids)
            body["usage"] = {"input_tokens": len(seq.prompt_ids),
                             "input_tokens_details": {"cached_tokens": seq.cached_prompt_tokens},
                             "output_tokens": len(seq.output_ids),
                             "output_tokens_details": {"reasoning_tokens": thought},
                             "total_tokens": len(seq.prompt_ids) + len(seq.output_ids)}
            body["speculation"] = speculation([seq])
        return body

    def _split(self, out: Output) -> tuple[str, str, list[dict[str, object]]]:
        """(thinking, answer, the answer's tokens' log-probabilities where asked) of the output's next
        piece: the text split as reasoning_split.py does, the tokens as engine/reasoning.py does (text
        and tokens line up only without calls)."""
        thinking, answer = "", out.text
        if self._thoughts is not None:
            thinking, answer = self._thoughts.feed(out.text, final=out.finish_reason is not None)
        self._answered |= bool(answer)
        logprobs = out.logprobs
        if self.reasoning is not None:
            self._phase, answer_ids, _ = self.reasoning.walk(self._phase, out.token_ids)
            logprobs = logprobs[len(logprobs) - len(answer_ids):]
        if self.request.logprobs_count is None or self.tools.makes_calls:
            return thinking, answer, []
        return thinking, answer, [chat_logprob(lp, self.token) for lp in logprobs]

    def _thought_status(self, status: str) -> str:
        """The reasoning item's: complete once the thinking has ended, else the response's."""
        return "completed" if self._answered or self._phase is Phase.ANSWER else status

    @staticmethod
    def _status(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    @staticmethod
    def _reasoning_item(text: str, status: str) -> dict[str, Any]:
        return {"id": _id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def _message_item(self, text: str, status: str, logprobs: list[dict[str, object]]) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"id": _id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"id": _id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": arguments}

    def whole(self, out: Output) -> dict[str, Any]:
        """The finished response of a request not streamed; `out`: its outputs joined."""
        finish = FINISH.get(out.finish_reason)
        status = self._status(finish)
        thinking, answer, logprobs = self._split(out)
        if thinking:
            self.output.append(self._reasoning_item(thinking, self._thought_status(status)))
        content, calls = (answer, [])
        if self.tools.makes_calls:
            content, calls, _ = self.tools.answer(answer, finish)
        if content or not (calls or thinking):
            self.output.append(self._message_item(content or "", status, logprobs))
        self.output += [self._call_item(f"call_{uuid.uuid4().hex}", c.name, c.arguments, status) for c in calls]
        self.result = self.body(status, finished=True)
        return self.result

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._events, **fields}
        self._events += 1
        return event_sse(event)

    def opening(self) -> list[str]:
        """The first events: created and in_progress; in the background, created and queued (`started`
        follows when its first tokens come)."""
        if self.background:
            return [self._event("response.created", response=self.body("queued")),
                    self._event("response.queued", response=self.body("queued"))]
        return [self._event("response.created", response=self.body("in_progress")), *self.started()]

    def started(self) -> list[str]:
        return [self._event("response.in_progress", response=self.body("in_progress"))]

    def feed(self, out: Output) -> list[str]:
        """The events of one output of the sequence (the last one included)."""
        thinking, content, logprobs = self._split(out)
        self._due += logprobs
        events = self._think(thinking) if thinking else []
        if self._answered:
            events += self._close_thinking("completed")
        deltas: list[dict[str, Any]] = []
        if self.tools.makes_calls:
            content, deltas, _ = self._calls.advance(content, out.finish_reason is not None,
                                                     FINISH.get(out.finish_reason))
        if content or (self._answered and not self.tools.makes_calls):
            events += self._text(content)
        for delta in deltas:
            events += self._call_delta(delta)
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _open(self, item: dict[str, Any]) -> list[str]:
        """A message or reasoning item (empty) begins: its output_item.added and content_part.added."""
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=item | {"content": []}),
                self._event("response.content_part.added", **self._where(item), content_index=0,
                            part=dict(item["content"][0]))]

    def _close(self, item: dict[str, Any], status: str, kind: str, **done: Any) -> list[str]:
        """A message or reasoning item ends (`kind`: its text's events')."""
        item["status"] = status
        part = item["content"][0]
        where = self._where(item)
        return [self._event(f"response.{kind}.done", **where, content_index=0, text=part["text"], **done),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _think(self, text: str) -> list[str]:
        """`text` added to the reasoning item (begun where none is open)."""
        events = []
        if self._thinking is None:
            self._thinking = self._reasoning_item("", "in_progress")
            events += self._open(self._thinking)
        self._thinking["content"][0]["text"] += text
        return [*events, self._event("response.reasoning_text.delta", **self._where(self._thinking), content_index=0,
                                     delta=text)]

    def _close_thinking(self, status: str) -> list[str]:
        thinking, self._thinking = self._thinking, None
        return [] if thinking is None else self._close(thinking, status, "reasoning_text")

    def _text(self, text: str) -> list[str]:
        """`text` and the answer's log-probabilities due, added to the message (begun where none is open)."""
        events = []
        if self._message is None:
            self._message = self._message_item("", "in_progress", [])
            events += self._open(self._message)
        logprobs, self._due = self._due, []
        part = self._message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        if text or logprobs:
            events.append(self._event("response.output_text.delta", **self._where(self._message), content_index=0,
                                      delta=text, logprobs=logprobs))
        return events

    def _close_message(self, status: str) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        return self._close(message, status, "output_text", logprobs=message["content"][0]["logprobs"])

    def _call_delta(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool-call delta (tool_calls.CallStream) as the function_call item's events."""
        events = []
        function = delta["function"]
        if "id" in delta:  # a call begins: the message before it is done
            events += self._close_message("completed")
            item = self._call_item(delta["id"], function["name"], "", "in_progress")
            self._call_items.append(item)
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        item = self._call_items[delta["index"]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", **self._where(item),
                                      delta=function["arguments"]))
        return events

    def closing(self, last: Output) -> list[str]:
        """The events that end the response (`last`: its last output), the whole response last."""
        status = self._status(FINISH.get(last.finish_reason))
        events = self._close_thinking(self._thought_status(status))
        if not self.output:  # an empty answer is an empty message (unless the model thought)
            events += self._text("")
        events += self._close_message(status)
        for item in self._call_items:
            item["status"] = status
            where = self._where(item)
            events += [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=where["output_index"], item=item)]
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        self.result = self.body(status, finished=True)
        return [*events, self._event(kind, response=self.result)]

    def failed(self, message: str) -> list[str]:
        """The events of a response the engine failed after it started (`result`: its body)."""
        self.result = self.body("failed") | {"error": {"code": "server_error", "message": message}}
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self.result)]

    def cancelled(self) -> dict[str, Any]:
        """The body of a background response cancelled (`result`): its output so far (the items it had
        begun, incomplete), its usage."""
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        self.result = self.body("cancelled", finished=True)
        return self.result
