"""The OpenAI request bodies the HTTP front accepts, and their translation into GenerationParams
(and vLLM's /tokenize and /detokenize bodies into their gRPC requests).

Field names and meanings are OpenAI's (plus vLLM's `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens`,
`allowed_token_ids`, `bad_words`, `return_tokens_as_token_ids` and `truncate_prompt_tokens`);
unknown fields are ignored, as OpenAI's own server ignores them. Structured output comes as
OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`: one of them. Known fields that would change
the answer but are not served here (tools, functions, `best_of`, `suffix`, and vLLM's own options
such as `use_beam_search` or `chat_template`) are refused unless neutral: an answer that silently
ignored them would look right and not be what was asked for.
Only the shape is checked here (types, finite numbers, ranges a field's wire type
imposes); everything else is request_parsing.py's, exactly as for a gRPC request.
A per-request speculation override rides in `speculation: {disable, max_draft_len}`
(the openai client's `extra_body`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import json_text, tool_calls
from verifier_service.api.reasoning_effort import OpenAIEffort, openai_variables, with_explicit
from verifier_service.api.request_parsing import MAX_LOGPROBS

MAX_CHOICES = 8
# A completion's longest length when max_tokens is left out (the server's default length, if shorter, applies):
# OpenAI's and vLLM's default for that route, which keeps short a base model's continuation, that may never
# reach an end-of-sequence token. An explicit null takes the server's default, as every other route does.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
UINT32 = 2**32 - 1
INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32)]


# OpenAI's and vLLM's fields that change the answer and that this server does not serve, with the
# values that change nothing (besides leaving them out or null).
UNSUPPORTED = {"best_of": 1, "functions": [], "suffix": None,
               # vLLM's own sampling and output options
               "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
               "logits_processors": None,
               "guided_whitespace_pattern": None}
# vLLM's options for rendering a chat otherwise than with the model's own template as it is (chat
# completions and /tokenize).
CHAT_RENDERING = {"chat_template": None, "documents": None}
# The special tokens that chat completions always render as the template has them; OpenAI's audio output,
# web search, and verbosities other than the default (as Responses' text.verbosity).
UNSUPPORTED_IN_CHAT = {"add_special_tokens": False, **CHAT_RENDERING, "audio": None, "modalities": ["text"],
                       "web_search_options": None, "verbosity": "medium"}
# A prompt always gets the tokenizer's special tokens; tools need a chat for the template to render them in.
UNSUPPORTED_IN_COMPLETIONS = {"add_special_tokens": True, "tools": [], "tool_choice": None}
UNSUPPORTED_IN_TOKENIZE = CHAT_RENDERING
# vLLM's structured_outputs options that llguidance's constraints here do not take.
UNSUPPORTED_IN_STRUCTURED_OUTPUTS = {"structural_tag": None, "whitespace_pattern": None,
                                     "disable_additional_properties": False}
# What a tool of another type than "function" (a hosted tool: web search, file search, MCP) is told.
FUNCTIONS_ONLY = "only function tools, which the model calls and the client runs"


class RequestBody(BaseModel):
    """Every HTTP body's base: unknown fields ignored (as OpenAI's server does), NaN and infinity refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def refused_unless_neutral(neutral_values: dict[str, Any]) -> Any:
    """The validator, for a body class that declares them, of the fields `neutral_values` names, which
    this server does not serve: each is refused unless left out, null or at its value there (the
    one that changes nothing)."""
    def check(value: Any, info: ValidationInfo) -> None:
        neutral = neutral_values[info.field_name]
        if value is not None and value != neutral:
            hint = "leave it out" if neutral is None else f"leave it out or send {json.dumps(neutral)}"
            raise PydanticCustomError("unsupported", f"not supported by this server ({hint})")
    return field_validator(*neutral_values, mode="before")(check)


class SpeculationOverride(RequestBody):
    disable: bool = False
    max_draft_len: int | None = Field(None, ge=0, le=UINT32)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class JsonSchemaFormat(RequestBody):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # optional in OpenAI's API: then any JSON object
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's: free text, any JSON object (JSON mode), or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if (value is None) == (info.data.get("type") == "json_schema"):
            raise PydanticCustomError("json_schema", "json_schema is required with type json_schema, and only then")
        return value


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs` (one of them). `disable_any_whitespace` makes JSON compact; vLLM's
    options this server does not serve are refused unless neutral."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Refused unless neutral (UNSUPPORTED_IN_STRUCTURED_OUTPUTS); never read.
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_additional_properties: Any = None

    _check_unsupported = refused_unless_neutral(UNSUPPORTED_IN_STRUCTURED_OUTPUTS)


def served_types(value: Any, served: tuple[str, ...], noun: str, instead: str) -> Any:
    """`value` (a dict, before its fields are read), refused by its `type` where that is not one of `served`:
    an image sent to a model that reads text, or a hosted tool, is named as such (with `instead`, what is
    served), rather than as a `type` that is not 'text' and the fields a text part would have."""
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in served:
        raise PydanticCustomError("not_served", "'{kind}' {noun} are not served here: {instead}",
                                  {"kind": kind, "noun": noun, "instead": instead})
    return value


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


Part = TypeVar("Part")
# A field that is a text or a list (of content parts, blocks, items), read as the one its JSON is: a mistake
# inside the list is named by its path alone, not also as a field that is not a text (from_validation leaves
# the tags out of the path, as it does type names).
TextOrList = Annotated[Annotated[str, Tag("str")] | Annotated[list[Part], Tag("list")],
                       Discriminator(_str_or_list, custom_error_type="text_or_list",
                                     custom_error_message="neither a text nor a list")]


TextPartType = Literal["text", "input_text", "output_text", "refusal"]


class TextPart(RequestBody):
    """A content part the model reads: OpenAI's text, and, as vLLM reads them in a chat, the Responses API's
    input_text and output_text and an assistant's refusal sent back (its `refusal` is its text)."""

    type: TextPartType
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        return served_types(part, get_args(TextPartType), "parts",
                            "the model reads text only (text, input_text, output_text and refusal parts)")

    @model_validator(mode="after")
    def _holds_its_text(self) -> TextPart:
        if self.value is None:
            raise PydanticCustomError("missing", "a {kind} part holds its {field}", {
                "kind": self.type, "field": "refusal" if self.type == "refusal" else "text"})
        return self

    @property
    def value(self) -> str | None:
        return self.refusal if self.type == "refusal" else self.text


# How a message's text parts (and blocks) join into its one text: with a newline, as vLLM joins them (and
# TensorRT-LLM), so that a chat sent in parts renders the prompt it renders there.
PART_SEPARATOR = "\n"


def text_of(content: str | list[TextPart] | None, separator: str = PART_SEPARATOR) -> str:
    """A message's content as one text: its parts joined with `separator`."""
    if isinstance(content, list):
        return separator.join(part.value or "" for part in content)
    return content or ""


class PredictedOutput(RequestBody):
    """OpenAI's Predicted Outputs: text the answer is expected to largely repeat, which the verifier
    drafts from (GenerationParams.prediction)."""

    type: Literal["content"]
    content: TextOrList[TextPart]

    @property
    def text(self) -> str:
        return text_of(self.content, "")  # pieces of one text the answer repeats, not a message's parts


class GenerationBody(RequestBody):
    """What chat and completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32)  # vLLM: -1 or 0 = off
    min_p: float | None = None  # vLLM's
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0, le=UINT32)  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's: the stop string or token that ended the text stays in it
    skip_special_tokens: bool = True  # vLLM's: false writes special tokens into the text
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: SpeculationOverride | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[TokenId, float] | None = None  # OpenAI sends the token ids as strings
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)  # vLLM's: only these can be generated
    bad_words: list[str] | None = None  # vLLM's: words that cannot be generated
    return_tokens_as_token_ids: bool = False  # vLLM's: log-probabilities name tokens "token_id:N", not by text
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's log-probability (the first's null) with this many alternatives, in each
    # completion choice's `prompt_logprobs` (a chat's: the response's). Not streamed, as in vLLM.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: only the prompt's last N tokens (after the chat template); -1, as many as leave room for the answer
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32)
    # vLLM's: with --scheduling-policy priority, lower runs first (else anything but 0 is a 400)
    priority: int = Field(0, ge=-INT32 - 1, le=INT32)
    # vLLM's: with --reasoning-parser, at most this many thinking tokens, then `</think>` (else a 400)
    thinking_token_budget: int | None = Field(None, ge=0, le=UINT32)
    prediction: PredictedOutput | None = None  # OpenAI's; completions take it too
    # vLLM's: only requests with the same salt share the prefix cache (GenerationParams.cache_salt)
    cache_salt: str | None = Field(None, min_length=1)
    # Refused unless neutral (UNSUPPORTED; pydantic checks that each has a field here); never read.
    best_of: Any = None
    functions: Any = None
    suffix: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None

    _check_unsupported = refused_unless_neutral(UNSUPPORTED)

    @field_validator("top_p")
    @classmethod
    def _top_p_keeps_a_token(cls, top_p: float | None) -> float | None:
        # gRPC's explicit 0 means no filtering (from before the field was optional); here it would be read
        # as OpenAI's narrowest nucleus and answered from the whole distribution. vLLM refuses it too.
        if top_p is not None and top_p <= 0:
            raise PydanticCustomError("top_p", "top_p must be within (0, 1]; 0 keeps no token (leave it out or "
                                               "send 1 for no filtering, or send temperature 0 for greedy decoding)")
        return top_p

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, count: int | None, info: ValidationInfo) -> int | None:
        if count is not None and info.data.get("stream"):
            raise PydanticCustomError("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        return count

    @model_validator(mode="after")
    def _one_structured_output(self) -> GenerationBody:
        try:
            self.structured_output()
        except ValueError as e:
            raise PydanticCustomError("structured_output", str(e)) from None
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def default_max_new_tokens(self) -> int | None:
        """The length where max_new_tokens is None; None: the server's (--default-max-new-tokens)."""
        return None

    @property
    def logprobs_count(self) -> int | None:
        raise NotImplementedError

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def echoes_prompt(self) -> bool:
        return False

    @property
    def echoed_message(self) -> str:
        """What each chat answer's content starts with (vLLM's chat echo): "" for none."""
        return ""

    @property
    def shows_reasoning(self) -> bool:
        """Whether a chat answer carries a reasoning model's thinking (vLLM's include_reasoning)."""
        return True

    @property
    def thinking_budget(self) -> int | None:
        """The most thinking tokens (GenerationParams.thinking_token_budget); None: no limit."""
        return self.thinking_token_budget

    @property
    def prompt_only(self) -> bool:
        return False

    def params(self, choice: int) -> verifier_pb2.GenerationParams:
        """The GenerationParams of choice `choice`. Choices run prompt by prompt, n for each (OpenAI's and
        vLLM's order); the j-th of a prompt's n is seeded seed + j, so that seeded choices differ and each
        prompt's choices are those it gets when sent alone."""
        p = verifier_pb2.GenerationParams()
        self._input(p, choice // self.n)
        s = p.sampling
        if self.temperature is not None:
            s.temperature = self.temperature
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.top_k is not None:
            s.top_k = max(self.top_k, 0)
        if self.min_p is not None:
            s.min_p = self.min_p
        if self.seed is not None:
            s.seed = (self.seed + choice % self.n) % 2**64
        if self.frequency_penalty is not None:
            s.frequency_penalty = self.frequency_penalty
        if self.presence_penalty is not None:
            s.presence_penalty = self.presence_penalty
        if self.repetition_penalty is not None:
            s.repetition_penalty = self.repetition_penalty
        if self.logit_bias:
            s.logit_bias.update(self.logit_bias)
        if self.allowed_token_ids:
            s.allowed_token_ids.extend(self.allowed_token_ids)
        if self.bad_words:
            s.bad_words.extend(self.bad_words)
        st = p.stopping
        if self.max_new_tokens is not None:
            st.max_new_tokens = self.max_new_tokens
        if self.stop is not None:
            st.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            st.stop_token_ids.extend(self.stop_token_ids)
        st.ignore_eos = self.ignore_eos
        if self.min_tokens is not None:
            st.min_new_tokens = self.min_tokens
        st.include_stop_str_in_output = self.include_stop_str_in_output
        p.skip_special_tokens = self.skip_special_tokens
        if self.speculation is not None:
            p.speculation.disable = self.speculation.disable
            if self.speculation.max_draft_len is not None:
                p.speculation.max_draft_len = self.speculation.max_draft_len
        if self.logprobs_count is not None:
            p.logprobs = self.logprobs_count
        if self.prompt_logprobs is not None:
            p.prompt_logprobs = self.prompt_logprobs
        if self.truncate_prompt_tokens is not None:
            p.truncate_prompt_tokens = self.truncate_prompt_tokens
        p.priority = self.priority
        if self.thinking_budget is not None:
            p.thinking_token_budget = self.thinking_budget
        if self.prediction is not None:
            p.prediction = self.prediction.text
        if self.cache_salt is not None:
            p.cache_salt = self.cache_salt
        constraint = self.structured_output()
        if constraint is not None:
            p.structured_output.CopyFrom(constraint)
        return p

    def tool_plan(self, parser: str | None) -> tool_calls.ToolPlan | None:
        """How answers become tool calls, "auto" with the server's parser (None: auto not served); None
        where the API has no tools."""
        return None

    def structured_output(self) -> verifier_pb2.StructuredOutput | None:
        """The one constraint asked for, by whichever field (None: free text); several are a ValueError.
        A named or required tool choice holds the answer to its calls' JSON, which leaves no room for
        another. The constraint itself is checked where gRPC's is (request_parsing.py)."""
        asked = self._asked_structured_output()
        tools = self.tool_plan(None)
        held = tools.constraint if tools is not None else None
        if held is None:
            return asked
        if asked is not None:
            raise ValueError("a named or required tool_choice holds the answer to its calls' JSON: send no "
                             "other structured output with it")
        return held

    def _response_format(self) -> tuple[str, ResponseFormat] | None:
        """OpenAI's response format, and the field it came in."""
        return ("response_format", self.response_format) if self.response_format is not None else None

    def _asked_structured_output(self) -> verifier_pb2.StructuredOutput | None:
        found: list[tuple[str, verifier_pb2.StructuredOutput]] = []
        named = self._response_format()
        if named is not None and named[1].type == "json_object":
            found.append((named[0], verifier_pb2.StructuredOutput(json_object=True)))
        elif named is not None and named[1].json_schema is not None:
            schema = named[1].json_schema.schema_
            found.append((named[0], _json_schema(schema) if schema is not None
                          else verifier_pb2.StructuredOutput(json_object=True)))
        so = self.structured_outputs
        if so is not None:
            found += [(f"structured_outputs.{name}", c) for name, c in _vllm_constraints(
                so.json_, so.regex, so.choice, so.grammar, so.json_object, compact=so.disable_any_whitespace)]
        found += [(name, c) for name, c in _vllm_constraints(
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, None, prefix="guided_")]
        if len(found) > 1:
            raise ValueError(f"ask for one structured output, not {len(found)} ({', '.join(n for n, _ in found)})")
        return found[0][1] if found else None

    def _input(self, p: verifier_pb2.GenerationParams, prompt: int) -> None:
        raise NotImplementedError


def _json_schema(schema: dict[str, Any] | str, compact: bool = False) -> verifier_pb2.StructuredOutput:
    """`compact`: no whitespace between JSON items (tool_calls.compact_json_schema)."""
    if compact:
        if isinstance(schema, str):
            try:
                schema = json_text.loads(schema)
            except ValueError:  # request_parsing names the mistake
                return verifier_pb2.StructuredOutput(json_schema=schema)
        if isinstance(schema, dict):
            return tool_calls.compact_json_schema(schema)
    return verifier_pb2.StructuredOutput(json_schema=schema if isinstance(schema, str) else json.dumps(schema))


def _vllm_constraints(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
                      grammar: str | None, json_object: bool | None, prefix: str = "", compact: bool = False
                      ) -> list[tuple[str, verifier_pb2.StructuredOutput]]:
    found = []
    if schema is not None:
        found.append((f"{prefix}json", _json_schema(schema, compact)))
    if regex is not None:
        found.append((f"{prefix}regex", verifier_pb2.StructuredOutput(regex=regex)))
    if choice is not None:
        found.append((f"{prefix}choice", verifier_pb2.StructuredOutput(
            choice=verifier_pb2.StructuredOutputChoices(choices=choice))))
    if grammar is not None:
        found.append((f"{prefix}grammar", verifier_pb2.StructuredOutput(grammar=grammar)))
    if json_object:
        found.append((f"{prefix}json_object", _json_schema({"type": "object"}, compact) if compact
                      else verifier_pb2.StructuredOutput(json_object=True)))
    return found


class CalledFunction(RequestBody):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's)


class ToolCallMessage(RequestBody):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestBody):
    role: str
    content: TextOrList[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result
    name: str | None = None  # the participant's, for templates that write it
    # An assistant's earlier thinking, sent back (vLLM's `reasoning`; its older name `reasoning_content`).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        return text_of(self.content)

    def message(self) -> verifier_pb2.ChatMessage:
        # OpenAI's newer "developer" role is what chat templates call "system".
        return verifier_pb2.ChatMessage(
            role="system" if self.role == "developer" else self.role, content=self.text,
            tool_calls=[verifier_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                        for c in self.tool_calls or []],
            tool_call_id=self.tool_call_id or "", reasoning=self.reasoning or self.reasoning_content or "",
            name=self.name or "")


class FunctionTool(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionTool

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: Any) -> Any:
        return served_types(tool, ("function",), "tools", FUNCTIONS_ONLY)


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


def chat_messages(messages: list[ChatMessage], template_kwargs: dict[str, Any] | None,
                  tools: list[Tool] | None = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> verifier_pb2.ChatMessages:
    return verifier_pb2.ChatMessages(
        messages=[m.message() for m in messages],
        template_kwargs=json.dumps(template_kwargs) if template_kwargs else "",
        tools=json.dumps([t.model_dump(exclude_none=True) for t in tools]) if tools else "",
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with logprobs (as vLLM and OpenAI require)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's: false leaves the assistant's turn unopened
    continue_final_message: bool = False  # vLLM's: the answer continues the last message
    echo: bool = False  # vLLM's: the answer's content starts with the last message's, if the assistant's
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the answer
    reasoning_effort: OpenAIEffort | None = None  # for the chat template (reasoning_effort.py)
    # Refused unless neutral (UNSUPPORTED_IN_CHAT); never read.
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    _check_unsupported_in_chat = refused_unless_neutral(UNSUPPORTED_IN_CHAT)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, count: int | None, info: ValidationInfo) -> int | None:
        if count and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true (without it no "
                                                      "log-probabilities are returned)")
        return count

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def shows_reasoning(self) -> bool:
        return self.include_reasoning

    @property
    def echoed_message(self) -> str:
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""

    def _input(self, p: verifier_pb2.GenerationParams, prompt: int) -> None:
        variables = with_explicit(openai_variables(self.reasoning_effort), self.chat_template_kwargs)
        p.chat.CopyFrom(chat_messages(self.messages, variables, self.tools, self.add_generation_prompt,
                                      self.continue_final_message))

    def tool_plan(self, parser: str | None) -> tool_calls.ToolPlan:
        """(Checked with the body, by structured_output: so are the tools against tool_choice.)"""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tool_calls.plan([t.model_dump() for t in self.tools or []], choice, self.parallel_tool_calls, parser)


def _prompt_kind(prompt: Any) -> str | None:
    """Which of a completion's prompt shapes its JSON is, told by its first item; None: none (an empty list)."""
    if isinstance(prompt, str):
        return "str"
    if not isinstance(prompt, list) or not prompt:
        return None
    first = prompt[0]
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


class CompletionRequest(GenerationBody):
    # Text, token ids, or a batch of either (OpenAI's and vLLM's); each prompt is answered as if sent alone.
    # Read as the shape its JSON is, so that a mistake is one problem, named by its path (tags are type names,
    # which from_validation leaves out of it).
    prompt: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[TokenId], Tag("list[int]")]
        | Annotated[list[str], Tag("list[str]")]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Tag("list[list[int]]")],
        Discriminator(_prompt_kind, custom_error_type="prompt", custom_error_message=(
            "a prompt is a text, token ids, or a list of texts or of token-id lists, none of them empty"))]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=0, le=UINT32)  # 0, with echo: the prompt alone (vLLM's)
    # The prompt before each choice's text; with logprobs, its tokens' log-probabilities too (the first
    # token's null), as an evaluation harness asks to score a text: echo, logprobs, max_tokens 1 (or 0).
    echo: bool = Field(False, validate_default=True)
    # Refused unless neutral (UNSUPPORTED_IN_COMPLETIONS); never read.
    add_special_tokens: Any = None
    tools: Any = None
    tool_choice: Any = None

    _check_unsupported_in_completions = refused_unless_neutral(UNSUPPORTED_IN_COMPLETIONS)

    @field_validator("echo")
    @classmethod
    def _prompt_alone_needs_echo(cls, echo: bool, info: ValidationInfo) -> bool:
        if info.data.get("max_tokens") == 0 and not echo:
            raise PydanticCustomError("echo", "max_tokens 0 asks for the prompt alone, which needs echo true")
        return echo

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_only(self) -> bool:
        """Echo the prompt and generate nothing: one token is generated (the prefill computes its logits
        anyway) and not shown."""
        return self.echo and self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    @property
    def default_max_new_tokens(self) -> int | None:
        return None if "max_tokens" in self.model_fields_set else COMPLETIONS_DEFAULT_MAX_TOKENS

    def params(self, choice: int) -> verifier_pb2.GenerationParams:
        p = super().params(choice)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:  # vLLM's precedence
            p.prompt_logprobs = self.logprobs
        return p

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts: one, unless a list of texts or of token-id lists was sent."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    def _input(self, p: verifier_pb2.GenerationParams, prompt: int) -> None:
        text_or_ids = self.prompts[prompt]
        if isinstance(text_or_ids, str):
            p.prompt = text_or_ids
        else:
            p.token_ids.ids.extend(text_or_ids)


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a `prompt`, tokenized as /v1/completions tokenizes it, or chat `messages`,
    rendered as /v1/chat/completions renders them (with or without the generation prompt, or the last
    message left open, as there). vLLM's options that would tokenize otherwise are refused unless they
    ask for just that (a prompt's special tokens added; no special tokens on top of a chat template's)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    return_token_strs: bool = False
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # Refused unless neutral (UNSUPPORTED_IN_TOKENIZE); never read.
    chat_template: Any = None
    documents: Any = None

    _check_unsupported = refused_unless_neutral(UNSUPPORTED_IN_TOKENIZE)

    @model_validator(mode="after")
    def _one_input_tokenized_as_generation_does(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("input", "send either prompt or messages")
        if self.chat_template_kwargs and self.messages is None:
            raise PydanticCustomError("chat_template_kwargs", "only messages take chat_template_kwargs")
        if self.tools and self.messages is None:
            raise PydanticCustomError("tools", "only messages take tools")
        chat = self.messages is not None
        if self.add_special_tokens is not None and self.add_special_tokens == chat:
            raise PydanticCustomError("add_special_tokens", (
                "messages are rendered by the chat template, which holds the special tokens, as chat completions "
                "do: leave add_special_tokens out or send false") if chat else (
                "a prompt gets the tokenizer's special tokens, as completions do: leave add_special_tokens out or "
                "send true"))
        for name in ("add_generation_prompt", "continue_final_message"):
            if getattr(self, name) and not chat:
                raise PydanticCustomError(name, f"only messages take {name}")
        return self

    def request(self) -> verifier_pb2.TokenizeRequest:
        if self.messages is not None:
            chat = chat_messages(self.messages, self.chat_template_kwargs, self.tools,
                                 self.add_generation_prompt is not False, self.continue_final_message)
            return verifier_pb2.TokenizeRequest(chat=chat, return_token_strs=self.return_token_strs)
        return verifier_pb2.TokenizeRequest(prompt=self.prompt, return_token_strs=self.return_token_strs)


class DetokenizeRequest(RequestBody):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]

    def request(self) -> verifier_pb2.DetokenizeRequest:
        return verifier_pb2.DetokenizeRequest(token_ids=self.tokens)
