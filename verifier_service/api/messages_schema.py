"""Anthropic's Messages API request (POST /v1/messages), served as the chat it describes.

As for OpenAI's Responses API (responses_schema.py), the body becomes GenerationParams exactly as a
chat completion's does: `system` is the system message; each message's text blocks its content, an
assistant's `tool_use` blocks its tool calls (their `input` written as the call's JSON arguments) and a
user's `tool_result` blocks the tools' messages before it; `tools` (`{name, description,
input_schema}`) are the chat's tools, `tool_choice` (auto, any, tool, none) its tool_choice ("any" is
"required"), `disable_parallel_tool_use` its parallel_tool_calls false, `stop_sequences` its stop
strings and `max_tokens` (required, as Anthropic's) its limit. A last message from the assistant
is the start of the answer (Anthropic's prefill), which the answer continues. Images and documents are
refused: this server serves text.

Extended thinking. `thinking` renders the chat with the switch hybrid reasoning models' templates read,
`enable_thinking` (Qwen3's, SmolLM3's): `{"type": "disabled"}` false, `{"type": "enabled", ...}` true; left
out or `"adaptive"`, the template's own default. Left out (or `"adaptive"`), the answer shows the thinking
as a thinking block (messages_output.py); `{"type": "enabled", "budget_tokens": N}` shows it too and holds
it to N tokens (the engine's thinking budget, after which `</think>` is forced); `{"type": "disabled"}`
leaves the block out (a model whose template has no switch may still think); `display: "omitted"` keeps the
block but leaves its text out, as Anthropic does (no summarizer runs here, so "summarized" shows the
thinking as it is). An assistant's `thinking`
blocks sent back are its earlier thinking, the chat message's `reasoning` (the template's
`reasoning_content`); its `redacted_thinking` blocks, which nobody here can read, are dropped.
`output_config.effort` is the template's `reasoning_effort` (reasoning_effort.py).

Structured outputs. `output_config.format` (`{"type": "json_schema", "schema"}`; `output_format`, its
beta's name) holds the answer to the schema, as chat's response_format json_schema does (after the
thinking, under a reasoning parser), with no whitespace between items, as a tool_use block's input.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import tool_calls
from verifier_service.api.http_schema import (
    INT32,
    PART_SEPARATOR,
    UINT32,
    CalledFunction,
    ChatMessage,
    GenerationBody,
    JsonSchemaFormat,
    RequestBody,
    ResponseFormat,
    TextOrList,
    Tool,
    ToolCallMessage,
    chat_messages,
    refused_unless_neutral,
)
from verifier_service.api.reasoning_effort import AnthropicEffort, anthropic_variables

# Anthropic's fields that change the answer and that this server does not serve, with their neutral values.
# (context_management and compaction, the beta's: what the model sees, or what it is asked for, would change)
UNSUPPORTED_IN_MESSAGES = {"mcp_servers": None, "container": None, "context_management": None, "compaction": None}


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: TextOrList[TextBlock] = ""  # (is_error has no place in a chat template: the text says it)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else PART_SEPARATOR.join(b.text for b in self.content)


class ThinkingConfig(RequestBody):
    """Anthropic's `thinking` (module docstring)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=UINT32)  # "enabled"'s, which needs one
    # "omitted": the thinking block comes with its text left out; "summarized" (no summarizer runs here) as is
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise PydanticCustomError("thinking", 'budget_tokens goes with "type": "enabled", and only with it')
        return self


class JsonOutputFormat(RequestBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    """Anthropic's `output_config` (module docstring)."""

    effort: AnthropicEffort | None = None
    format: JsonOutputFormat | None = None


class ThinkingBlock(RequestBody):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # Anthropic's proof that Claude wrote it: nothing to check here


class RedactedThinkingBlock(RequestBody):
    type: Literal["redacted_thinking"]
    data: str  # encrypted for Claude: unreadable here, so dropped


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type, custom_error_type="content_block", custom_error_message=(
        "a content block is text, tool_use, tool_result, thinking or redacted_thinking (only text is served "
        "here)"))]


class AnthropicMessage(RequestBody):
    role: Literal["user", "assistant"]
    content: TextOrList[Block]

    @model_validator(mode="after")
    def _thought_by_the_assistant(self) -> AnthropicMessage:
        if self.role == "user" and any(isinstance(b, ThinkingBlock | RedactedThinkingBlock) for b in self.blocks):
            raise PydanticCustomError("content_block", "thinking blocks are the assistant's, not the user's")
        return self

    @property
    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    def chat(self) -> list[ChatMessage]:
        """The chat messages this message stands for: a user's tool results first (as tool messages),
        then its text; an assistant's text with its tool calls and its thinking."""
        blocks = self.blocks
        # Joined as a chat's text parts (vLLM's Messages API passes the non-empty ones on as such).
        text = PART_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock) and b.text)
        if self.role == "assistant":
            calls = [ToolCallMessage(id=b.id, function=CalledFunction(name=b.name, arguments=json.dumps(b.input)))
                     for b in blocks if isinstance(b, ToolUseBlock)]
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            return [ChatMessage(role="assistant", content=text or None, tool_calls=calls or None,
                                reasoning=thought or None)]
        results = [ChatMessage(role="tool", content=b.text, tool_call_id=b.tool_use_id)
                   for b in blocks if isinstance(b, ToolResultBlock)]
        plain = [ChatMessage(role="user", content=text)] if text or not results else []
        return [*results, *plain]


class AnthropicTool(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule, and Anthropic's (up to 128)
    description: str | None = None
    input_schema: dict[str, Any]

    def chat(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class AnthropicToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_with_type_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice", 'a tool_choice names a tool with type "tool", and only then')
        return self


class MessagesRequest(GenerationBody):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: TextOrList[TextBlock] | None = None
    max_tokens: int = Field(ge=1, le=INT32)  # required, as Anthropic's
    stop_sequences: list[str] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    n: Literal[1] = 1  # one answer per message
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's output_config.format
    # Refused unless neutral (UNSUPPORTED_IN_MESSAGES); never read.
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None
    compaction: Any = None

    _check_unsupported_in_messages = refused_unless_neutral(UNSUPPORTED_IN_MESSAGES)

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)  # one system prompt, as vLLM's Messages API joins it

    @property
    def shows_thinking(self) -> bool:
        """Whether a reasoning model's thinking is in the answer: unless `thinking` is {"type": "disabled"}."""
        return self.thinking is None or self.thinking.type != "disabled"

    @property
    def omits_thinking(self) -> bool:
        """Whether a thinking block comes with its text left out (`thinking.display` "omitted")."""
        return self.thinking is not None and self.thinking.display == "omitted"

    @property
    def thinking_budget(self) -> int | None:
        if self.thinking is not None and self.thinking.type == "enabled":
            return self.thinking.budget_tokens
        return self.thinking_token_budget

    @property
    def prefilled(self) -> bool:
        """Whether the last message is the start of the answer, an assistant's text (Anthropic's prefill):
        the answer continues it (vLLM's continue_final_message)."""
        last = self.messages[-1]
        return last.role == "assistant" and not any(isinstance(b, ToolUseBlock) for b in last.blocks)

    def chat(self) -> verifier_pb2.ChatMessages:
        system = [ChatMessage(role="system", content=self.system_text)] if self.system_text else []
        messages = [m for message in self.messages for m in message.chat()]
        tools = [Tool.model_validate(t.chat()) for t in self.tools] if self.tools else None
        variables = anthropic_variables(self.thinking.type if self.thinking is not None else None,
                                        self.output_config.effort if self.output_config is not None else None)
        return chat_messages([*system, *messages], variables, tools, add_generation_prompt=not self.prefilled,
                             continue_final_message=self.prefilled)

    def _response_format(self) -> tuple[str, ResponseFormat] | None:
        """output_config.format (or output_format), as chat's response_format (one of them)."""
        named = [(name, fmt) for name, fmt in (
            ("output_config.format", self.output_config.format if self.output_config is not None else None),
            ("output_format", self.output_format)) if fmt is not None]
        if not named:
            return super()._response_format()
        if len(named) > 1 or self.response_format is not None:
            raise ValueError("send one of output_config.format, output_format and response_format")
        name, fmt = named[0]
        compact = tool_calls.compact_schema(fmt.schema_)  # for programs, as tool_use input is
        return name, ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=compact))

    def _input(self, p: verifier_pb2.GenerationParams, prompt: int) -> None:
        p.chat.CopyFrom(self.chat())

    def params(self, choice: int) -> verifier_pb2.GenerationParams:
        p = super().params(choice)
        p.stopping.stop.extend(self.stop_sequences or [])
        return p

    @property
    def logprobs_count(self) -> int | None:
        return None  # Anthropic's API has none

    def tool_plan(self, parser: str | None) -> tool_calls.ToolPlan:
        choice = self.tool_choice
        chosen: str | dict[str, Any] | None = None
        if choice is not None:
            chosen = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
        parallel = choice is None or not choice.disable_parallel_tool_use
        return tool_calls.plan([t.chat() for t in self.tools or []], chosen, parallel, parser)
