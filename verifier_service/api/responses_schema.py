"""OpenAI's Responses API request (POST /v1/responses), served as the chat it describes.

A Responses request is a chat in other clothes: `instructions` are its system message, `input` its
messages (a text is one user message; items of type message, function_call and function_call_output
are the chat's messages, an assistant's tool calls and the tools' results), `tools` its tools (flat:
`{type, name, parameters}`), `text.format` its response_format and `max_output_tokens` its
max_completion_tokens. So the body becomes GenerationParams exactly as a chat completion's does
(http_schema.py), and both fronts refuse the same mistakes with the same messages. With
`previous_response_id`, the chat starts with that stored response's conversation (its instructions
are not carried over, as OpenAI's are not): response_store.py; with `conversation`, with that
conversation's items (conversations_route.py).

A reasoning item, a reasoning model's thinking sent back from an earlier response, is the
`reasoning` of the assistant's message after it (or of one of its own, where none follows), for the
chat template to render, as a chat message's `reasoning` is: its content's text (or its summary's),
never its encrypted_content, which nothing here could read; with or without a reasoning parser.

Logprobs are returned where `include` holds "message.output_text.logprobs" (with `top_logprobs`
alternatives). truncation "auto" leaves out the conversation's earliest turns until it fits the
context. `reasoning.effort` reaches the chat template as chat's `reasoning_effort` does
(reasoning_effort.py); `background` runs it apart from the request (background_runs.py). Fields this
server does not serve (reusable prompts, compaction) are refused unless neutral; `max_tool_calls`
bounds calls to OpenAI's built-in tools, of which none run here, so it is echoed and changes nothing;
vLLM's sampling fields (top_k, min_p, seed, stop, ...) are taken as in chat completions.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import tool_calls
from verifier_service.api.http_schema import (
    FUNCTIONS_ONLY,
    INT32,
    CalledFunction,
    ChatMessage,
    GenerationBody,
    JsonSchemaFormat,
    RequestBody,
    ResponseFormat,
    TextOrList,
    TextPart,
    Tool,
    ToolCallMessage,
    chat_messages,
    refused_unless_neutral,
    served_types,
    text_of,
)
from verifier_service.api.reasoning_effort import OpenAIEffort, openai_variables
from verifier_service.api.request_parsing import MAX_LOGPROBS

LOGPROBS = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
# OpenAI's fields that change the answer and that this server does not serve, with their neutral values.
UNSUPPORTED_IN_RESPONSES = {"prompt": None, "context_management": None,  # compaction: what the model sees would change
                            "prompt_logprobs": None}  # vLLM's: a response has nowhere to put them
# `reasoning`'s: which earlier thinking the model sees is the chat template's to say, and one mode runs.
UNSUPPORTED_IN_REASONING = {"context": "auto", "mode": "standard"}
SummaryKind = Literal["auto", "concise", "detailed"]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"  # OpenAI's "easy" message leaves the type out
    id: str | None = None  # an item sent back from an earlier response keeps its id
    role: Literal["user", "assistant", "system", "developer"]
    content: TextOrList[TextPart]

    @property
    def text(self) -> str:
        return text_of(self.content)


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


class ReasoningText(RequestBody):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(RequestBody):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(RequestBody):
    """A reasoning model's thinking, sent back from an earlier response (responses_output.py): its
    content's text or, without one, its summary's."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # OpenAI's own models' thinking, sealed: nothing here can read it

    @field_validator("encrypted_content")
    @classmethod
    def _readable(cls, sealed: str | None) -> str | None:
        if sealed:
            raise PydanticCustomError("encrypted_content", "encrypted_content cannot be read by this server: send "
                                                           "the thinking as content (reasoning_text) or summary "
                                                           "(summary_text) parts, or leave the item out")
        return sealed

    @property
    def text(self) -> str:
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(part.text for part in self.summary)


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: TextOrList[TextPart]

    @property
    def text(self) -> str:
        return text_of(self.output)


def _item_type(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item", custom_error_message=(
        "an input item is a message, a function_call, a function_call_output or a reasoning item (only text is "
        "served here)"))]
ITEMS = TypeAdapter(list[InputItem])


def listed_item(item: Item) -> dict[str, Any]:
    """An input item as GET /v1/responses/{id}/input_items lists it: OpenAI's shape, with an id."""
    if isinstance(item, MessageItem):
        part = ({"type": "output_text", "text": item.text, "annotations": []} if item.role == "assistant"
                else {"type": "input_text", "text": item.text})
        return {"id": item.id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": item.role,
                "status": "completed", "content": [part]}
    if isinstance(item, FunctionCallItem):
        return {"id": item.id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": item.call_id,
                "name": item.name, "arguments": item.arguments, "status": "completed"}
    if isinstance(item, ReasoningItem):
        return {"id": item.id or f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                "summary": [part.model_dump() for part in item.summary],
                "content": [part.model_dump() for part in item.content or []], "status": "completed"}
    return {"id": item.id or f"fco_{uuid.uuid4().hex}", "type": "function_call_output", "call_id": item.call_id,
            "output": item.text, "status": "completed"}


def chat_history(items: list[Item]) -> list[ChatMessage]:
    """The chat messages that Responses items stand for: a function call joins the assistant's message
    before it (or opens one), as a chat answer holds its text and its calls together. Reasoning items
    are the thinking of the assistant's message or function call right after them (which then opens
    its own message); with neither right after, an assistant's message that thought and said nothing
    (a response whose thinking max_output_tokens cut short)."""
    messages: list[ChatMessage] = []
    thought: str | None = None  # the thinking of the reasoning items just before this item
    for item in items:
        if isinstance(item, ReasoningItem):
            thought = "\n\n".join(t for t in (thought, item.text) if t) or None
            continue
        if isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(ChatMessage(role="assistant", content=item.text, reasoning=thought))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallMessage(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
            if thought is None and messages and messages[-1].role == "assistant":
                last = messages[-1]
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call], reasoning=thought))
        else:
            if thought is not None:
                messages.append(ChatMessage(role="assistant", reasoning=thought))
            messages.append(ChatMessage(role=item.role, content=item.text) if isinstance(item, MessageItem)
                            else ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
        thought = None
    if thought is not None:
        messages.append(ChatMessage(role="assistant", reasoning=thought))
    return messages


def _within_openai_limits(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is not None and (len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items())):
        raise PydanticCustomError("metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                              f"{MAX_METADATA_KEY_CHARS} characters and values of at most "
                                              f"{MAX_METADATA_VALUE_CHARS}")
    return metadata


# OpenAI's metadata, on a response or a conversation.
Metadata = Annotated[dict[str, str] | None, AfterValidator(_within_openai_limits)]


class ConversationRef(RequestBody):
    id: str


class ResponsesTool(RequestBody):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: Any) -> Any:
        return served_types(tool, ("function",), "tools", FUNCTIONS_ONLY)

    def chat(self) -> dict[str, Any]:
        """The tool as chat completions write it."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedFunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ReasoningConfig(RequestBody):
    """OpenAI's `reasoning`: its effort goes to the chat template (reasoning_effort.py). No summarizer
    runs here: a summary asked for is left empty, and a reasoning item carries the thinking whole, as
    its content (responses_output.py)."""

    effort: OpenAIEffort | None = None
    summary: SummaryKind | None = None
    generate_summary: SummaryKind | None = None  # summary's older name
    # Refused unless neutral (UNSUPPORTED_IN_REASONING); never read.
    context: Any = None
    mode: Any = None

    _check_unsupported = refused_unless_neutral(UNSUPPORTED_IN_REASONING)

    def echoed(self) -> dict[str, Any]:
        """As a response shows it."""
        return {"effort": self.effort, "summary": self.summary or self.generate_summary}


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's other verbosities are for its reasoning models


class ResponsesRequest(GenerationBody):
    input: TextOrList[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None  # what else to return; only LOGPROBS changes anything here
    store: bool = True
    previous_response_id: str | None = None
    metadata: Metadata = None
    user: str | None = None
    n: Literal[1] = 1  # one answer per response
    # "auto": the conversation's earliest turns are left out until the chat fits the context (truncate()).
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: ReasoningConfig | None = None
    background: bool | None = None  # run apart from the request, polled or streamed again (background_runs.py)
    max_tool_calls: int | None = Field(None, ge=0, le=INT32)  # built-in tools' (none here): echoed only
    # The conversation whose items the chat starts with, and that this response's items are added to.
    conversation: str | ConversationRef | None = None
    # Refused unless neutral (UNSUPPORTED_IN_RESPONSES); never read.
    prompt: Any = None
    context_management: Any = None

    _check_unsupported_in_responses = refused_unless_neutral(UNSUPPORTED_IN_RESPONSES)
    # The stored conversation that previous_response_id names (responses_route.py sets it): the chat starts with it.
    _history: list[ChatMessage] = PrivateAttr(default_factory=list)
    _dropped: int = PrivateAttr(0)  # the conversation's first messages left out by truncation "auto"

    @field_validator("conversation")
    @classmethod
    def _one_history(cls, conversation: str | ConversationRef | None, info: ValidationInfo) -> object:
        if conversation is not None and info.data.get("previous_response_id") is not None:
            raise PydanticCustomError("conversation", "send conversation or previous_response_id, not both")
        return conversation

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def continues(self, history: list[ChatMessage]) -> None:
        self._history = history

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def input_items(self) -> list[Item]:
        """This request's input as items (a text is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def new_messages(self) -> list[ChatMessage]:
        """This request's input as chat messages (without the instructions)."""
        return chat_history(self.input_items())

    def continued_chat(self) -> list[ChatMessage]:
        """The stored conversation continued, then this request's input."""
        return [*self._history, *self.new_messages()]

    def chat(self, dropped: int | None = None) -> verifier_pb2.ChatMessages:
        """The chat: the instructions, then the conversation without its first `dropped` messages (by
        default, those truncation left out)."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        conversation = self.continued_chat()[self._dropped if dropped is None else dropped:]
        tools = [Tool.model_validate(t.chat()) for t in self.tools] if self.tools else None
        effort = openai_variables(self.reasoning.effort if self.reasoning is not None else None)
        return chat_messages([*system, *conversation], effort, tools)

    def truncate(self, fits: Callable[[verifier_pb2.ChatMessages], bool]) -> None:
        """truncation "auto", OpenAI's: where the chat does not fit the context (`fits`), leave out the
        fewest earliest turns of the conversation (whole: up to a user's message) with which it does; the
        instructions stay. Where even the last turn alone does not fit, nothing is left out (and the
        request is refused as too long)."""
        if self.truncation != "auto" or fits(self.chat(0)):
            return
        conversation = self.continued_chat()
        starts = [i for i, m in enumerate(conversation) if i > 0 and m.role == "user"]
        low, high = 0, len(starts)  # the fewest turns to leave out lies in starts[low:high], or none fits
        while low < high:
            mid = (low + high) // 2
            if fits(self.chat(starts[mid])):
                high = mid
            else:
                low = mid + 1
        if low < len(starts):
            self._dropped = starts[low]

    def _input(self, p: verifier_pb2.GenerationParams, prompt: int) -> None:
        p.chat.CopyFrom(self.chat())

    def tool_plan(self, parser: str | None) -> tool_calls.ToolPlan:
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        return tool_calls.plan([t.chat() for t in self.tools or []], choice, self.parallel_tool_calls, parser)

    def _response_format(self) -> tuple[str, ResponseFormat] | None:
        """text.format, as chat's response_format (one of them)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return super()._response_format()
        if self.response_format is not None:
            raise ValueError("send text.format or response_format, not both")
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict) \
            if fmt.type == "json_schema" else None
        return "text.format", ResponseFormat(type=fmt.type, json_schema=schema)


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a response's request, counted and not run. Its `input` may be left
    out, where `previous_response_id` or `instructions` hold the whole chat."""

    input: TextOrList[InputItem] = Field(default_factory=list)
