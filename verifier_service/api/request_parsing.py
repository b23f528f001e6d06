"""Turn GenerationParams (the body of Generate and GenerateStream) into engine parameters,
refusing client mistakes with clear messages. Tokenize's input goes through the same tokenization."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import jinja2
from transformers import PreTrainedTokenizerBase

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import json_text
from verifier_service.builder import Runtime
from verifier_service.engine.prefix_cache import salt_root
from verifier_service.engine.reasoning import Reasoning
from verifier_service.engine.sampler import SamplingParams
from verifier_service.engine.sequence import StoppingParams
from verifier_service.engine.structured_output import Constraint
from verifier_service.model import generation_config
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import ConfigError
from verifier_service.spec_decode.policy import SpeculationParams

MAX_TEMPERATURE = 100.0
# Below this a temperature is greedy (as in vLLM): dividing logits by it would overflow.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # frequency and presence penalties, as OpenAI bounds them
MAX_LOGIT_BIAS = 100.0  # as OpenAI bounds it
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_BAD_WORDS = 128
MAX_REQUEST_ID_CHARS = 256
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's top_logprobs
CHAT_ROLES = ("system", "user", "assistant", "tool")

class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PromptTooLong(RequestError):
    """The prompt does not fit the context (or has more characters than it could hold)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    default_max_new_tokens: int | None  # None: the rest of the context
    eos_token_ids: frozenset[int]
    # Longer prompt text cannot fit the context whatever it tokenizes to (0: no check);
    # refusing it before tokenizing keeps a huge prompt from stalling the server.
    max_prompt_chars: int = 0
    by_priority: bool = False  # --scheduling-policy priority: GenerationParams.priority is served
    reasoning: Reasoning | None = None  # --reasoning-parser's markers: GenerationParams.thinking_token_budget is served
    # SamplingParams fields a request leaves unset take these (the model's generation config).
    default_sampling: Mapping[str, float | int] = field(default_factory=dict)

    @classmethod
    def of(cls, rt: Runtime) -> "Limits":
        return cls(vocab_size=rt.vocab_size, max_model_len=rt.max_model_len,
                   default_max_new_tokens=rt.default_max_new_tokens, eos_token_ids=rt.eos_token_ids,
                   max_prompt_chars=max_prompt_chars(rt.tokenizer, rt.max_model_len),
                   by_priority=rt.settings.by_priority, reasoning=rt.reasoning,
                   default_sampling=rt.sampling_defaults.sampling)


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    speculation: SpeculationParams
    prompt_logprobs: int | None = None  # alternatives at each prompt position (None: no prompt log-probabilities)
    constraint: Constraint | None = None  # structured output, compiled when the sequence is made
    skip_special_tokens: bool = True  # special tokens' text left out of the answer's
    priority: int = 0  # lower runs first (priority scheduling)
    thinking_budget: int | None = None  # most thinking tokens of a reasoning model (None: no limit)
    prediction: list[int] = field(default_factory=list)  # its predicted output's tokens (none: [])
    cache_root: bytes = b""  # where its prefix-cache hash chain starts: its cache salt's (prefix_cache.salt_root)


def parse(request: verifier_pb2.GenerationParams, tokenizer: PreTrainedTokenizerBase,
          limits: Limits) -> ParsedRequest:
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise _invalid(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if request.priority and not limits.by_priority:
        raise _invalid(f"priority {request.priority} needs a verifier started with --scheduling-policy priority; "
                       "this one serves requests in order of arrival (send 0, or leave it out)")
    if request.separate_reasoning and limits.reasoning is None:  # how the gRPC front writes the output
        raise _invalid("separate_reasoning needs a verifier started with --reasoning-parser (a reasoning model's "
                       "markers); this one reads no thinking")
    prompt_ids = input_ids(request, tokenizer, limits, keep_last=_kept_prompt_tokens(request, limits))
    logprobs, prompt_logprobs = (_logprobs(request, name) for name in ("logprobs", "prompt_logprobs"))
    sampling = _with_defaults(request.sampling, limits.default_sampling)
    return ParsedRequest(prompt_ids, _sampling(sampling, logprobs, limits.vocab_size, tokenizer),
                         _stopping(request, len(prompt_ids), limits), _speculation(request.speculation),
                         prompt_logprobs, _constraint(request),
                         not request.HasField("skip_special_tokens") or request.skip_special_tokens, request.priority,
                         _thinking_budget(request, limits.reasoning),
                         _prediction(request.prediction, tokenizer, limits), salt_root(request.cache_salt))


def _prediction(text: str, tokenizer: PreTrainedTokenizerBase, limits: Limits) -> list[int]:
    """The predicted output's tokens, as the model would write that text; refused where no output could
    be that long."""
    if not text:
        return []
    too_long = f"prediction is longer than the model's context of {limits.max_model_len} tokens"
    if limits.max_prompt_chars and len(text) > limits.max_prompt_chars:
        raise _invalid(too_long)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > limits.max_model_len:
        raise _invalid(f"{too_long} ({len(ids)} tokens)")
    return ids


def _thinking_budget(request: verifier_pb2.GenerationParams, reasoning: Reasoning | None) -> int | None:
    """vLLM's thinking_token_budget, where it can be kept: once it is spent only `</think>` may follow, so
    nothing else the request asks may rule that token out."""
    if not request.HasField("thinking_token_budget"):
        return None
    if reasoning is None:
        raise _invalid("thinking_token_budget needs a verifier started with --reasoning-parser (a reasoning model's "
                       "markers); this one reads no thinking")
    end = reasoning.parser.end
    if request.sampling.allowed_token_ids:
        raise _invalid("thinking_token_budget cannot be combined with allowed_token_ids: once the budget is spent, "
                       f"only {end!r} may follow")
    if any(end in word for word in request.sampling.bad_words) or (
            request.stopping.min_new_tokens and reasoning.end_id in request.stopping.stop_token_ids):
        raise _invalid(f"thinking_token_budget cannot be combined with a bad word or a held stop token that rules out "
                       f"{end!r}: the budget ends the thinking with it")
    return request.thinking_token_budget


def _constraint(request: verifier_pb2.GenerationParams) -> Constraint | None:
    """The structured-output constraint's shape (it compiles later, against the model's tokenizer)."""
    if not request.HasField("structured_output"):
        return None
    so = request.structured_output
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise _invalid("structured_output: set one of json_schema, json_object, regex, choice or grammar")
    if request.stopping.ignore_eos or request.stopping.min_new_tokens:
        raise _invalid("structured_output cannot be combined with ignore_eos or min_new_tokens: the constraint "
                       "decides where the answer ends")
    if request.sampling.allowed_token_ids:
        raise _invalid("structured_output cannot be combined with allowed_token_ids: the two could leave no "
                       "token to generate; hold the answer with the constraint alone")
    if kind == "json_object":
        if not so.json_object:
            raise _invalid("structured_output.json_object must be true when set")
        return Constraint(kind)
    if kind == "choice":
        choices = list(so.choice.choices)
        if not choices or not all(choices):
            raise _invalid("structured_output.choice needs at least one choice, none of them empty")
        return Constraint(kind, json.dumps(choices))
    text = getattr(so, kind)
    if not text:
        raise _invalid(f"structured_output.{kind} is empty")
    if kind == "json_schema":
        try:
            json_text.loads(text)
        except ValueError as e:
            raise _invalid(f"structured_output.json_schema is not valid JSON: {e}") from None
    return Constraint(kind, text)


def _logprobs(request: verifier_pb2.GenerationParams, name: str) -> int | None:
    if not request.HasField(name):
        return None
    count = getattr(request, name)
    if count > MAX_LOGPROBS:
        raise _invalid(f"{name} must be within [0, {MAX_LOGPROBS}], not {count}")
    return count


def _kept_prompt_tokens(request: verifier_pb2.GenerationParams, limits: Limits) -> int | None:
    """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all of them)."""
    if not request.HasField("truncate_prompt_tokens"):
        return None
    kept = request.truncate_prompt_tokens
    if kept == -1:  # as many as leave room for the answer
        st = request.stopping
        answer = st.max_new_tokens if st.HasField("max_new_tokens") else limits.default_max_new_tokens
        if answer is None:  # no length: the prompt keeps what fits beside one token, the answer the rest
            return limits.max_model_len - 1
        return max(1, limits.max_model_len - answer)
    if kept < 1:
        raise _invalid(f"truncate_prompt_tokens must be -1 (what fits beside the answer) or at least 1, not {kept}")
    return kept


def input_ids(request: verifier_pb2.GenerationParams | verifier_pb2.TokenizeRequest,
              tokenizer: PreTrainedTokenizerBase, limits: Limits, fit_context: bool = True,
              keep_last: int | None = None) -> list[int]:
    """The prompt's token ids: a Generate request's, or what Tokenize answers for the same input
    (`fit_context` False: a prompt too long to generate from is counted, not refused); with
    `keep_last`, only that many of its last tokens."""
    which = request.WhichOneof("input")
    if which is None:
        *first, last = (f.name for f in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise _invalid(f"set one of {', '.join(first)} or {last}")
    if which == "prompt":
        if not request.prompt:
            raise _invalid("prompt is empty")
        _check_chars(len(request.prompt), limits)
        ids = tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
    elif which == "chat":
        ids = _chat_ids(request.chat, tokenizer, limits)
    else:
        ids = request.token_ids.ids
        if not ids:
            raise _invalid("token_ids is empty")
    if keep_last:
        ids = ids[-keep_last:]
    if which == "token_ids":  # refused as too long before each id is checked
        _check_length(len(ids), limits)
        ids = in_vocabulary(ids, limits)
    if not ids:
        raise _invalid("the prompt tokenizes to no tokens")
    if fit_context:
        _check_length(len(ids), limits)
    return ids


def in_vocabulary(ids: Iterable[int], limits: Limits) -> list[int]:
    """The ids, each checked to be a token of the model's vocabulary."""
    ids = list(ids)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _invalid(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return ids


def _check_length(num_tokens: int, limits: Limits) -> None:
    if num_tokens >= limits.max_model_len:
        raise PromptTooLong(f"the prompt has {num_tokens} tokens; the context is {limits.max_model_len} tokens "
                            f"(prompt plus at least one new token must fit)")


def _check_chars(num_chars: int, limits: Limits) -> None:
    if limits.max_prompt_chars and num_chars > limits.max_prompt_chars:
        raise PromptTooLong(f"the prompt has {num_chars} characters, more than the context of "
                            f"{limits.max_model_len} tokens can hold (at most {limits.max_prompt_chars} characters); "
                            "shorten it")


def _chat_ids(chat: verifier_pb2.ChatMessages, tokenizer: PreTrainedTokenizerBase, limits: Limits) -> list[int]:
    if not chat.messages:
        raise _invalid("chat has no messages")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise _invalid(f"chat message {i} has role {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
    _check_chars(len(chat.tools) + sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                                       for m in chat.messages), limits)
    if not tokenizer.chat_template:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           "this model has no chat template; send a plain prompt instead")
    messages = [_message(i, m) for i, m in enumerate(chat.messages)]
    tools = _tools(chat, tokenizer)
    generation_prompt = not chat.HasField("add_generation_prompt") or chat.add_generation_prompt
    if chat.continue_final_message and generation_prompt:
        raise _invalid("chat.continue_final_message leaves the last message open for the answer to continue: "
                       "set add_generation_prompt false too")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                             continue_final_message=chat.continue_final_message,
                                             **({"tools": tools} if tools else {}), **_template_kwargs(chat, tokenizer))
    except jinja2.TemplateError as e:  # a template's raise_exception: roles out of order, and the like
        raise _invalid(f"the model's chat template refused these messages: {e}") from None
    except RecursionError:  # tools or template variables nested hundreds deep (JSON lets them)
        raise _invalid("the model's chat template cannot render these messages: their tools or template "
                       "variables are nested too deeply") from None
    except ValueError as e:  # continue_final_message: the template does not write the last message as sent
        if not chat.continue_final_message:
            raise
        raise _invalid(f"chat.continue_final_message: {e}") from None
    # The template already holds the special tokens (BOS and the like).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _message(i: int, m: verifier_pb2.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: a tool's result names its call; an assistant's calls carry
    their arguments as an object (templates write them with `tojson`)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning:
        message["reasoning_content"] = m.reasoning
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            arguments = _json_object(call.arguments or "{}", f"chat message {i} tool call {j} arguments")
            calls.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
        message["tool_calls"] = calls
    return message


def _tools(chat: verifier_pb2.ChatMessages, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """The chat's tools, checked: OpenAI's function tools, for a template that renders them (else they
    would be dropped without a word, and the model never learn of them)."""
    if not chat.tools:
        return []
    try:
        tools = json_text.loads(chat.tools)
    except ValueError as e:
        raise _invalid(f"chat.tools is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise _invalid('chat.tools must be a JSON array of {"type": "function", "function": {"name": ...}}')
    template = tokenizer.chat_template
    if "tools" not in (template if isinstance(template, str) else json.dumps(template)):
        raise _invalid("this model's chat template does not render tools, so the model would never see them")
    return tools


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json_text.loads(text)
    except ValueError as e:
        raise _invalid(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise _invalid(f"{what} must be a JSON object")
    return value


def _template_kwargs(chat: verifier_pb2.ChatMessages, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    if not chat.template_kwargs:
        return {}
    kwargs = _json_object(chat.template_kwargs, "chat.template_kwargs")
    # The renderer's own parameters, and the messages, are the server's to set.
    taken = sorted(kwargs.keys() & (set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}))
    if taken:
        raise _invalid(f"chat.template_kwargs cannot set {', '.join(taken)}: the server renders the chat with its own")
    return kwargs


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise _invalid(f"{name} must be a finite number, not {value}")
    return value


def sampling_defaults(settings: ServerSettings, model_path: str | None) -> generation_config.SamplingDefaults:
    """What requests' unset sampling fields take (`model_path`: the model's folder or hub id, None: no
    file), checked as a request's own values are: ConfigError naming where a bad one comes from."""
    defaults = generation_config.read(settings.generation_config, model_path, settings.override_generation_config)
    try:
        _check_sampling(verifier_pb2.SamplingParams(**defaults.sampling))
    except RequestError as exc:
        raise ConfigError(f"{defaults.origin}: {exc.message}") from None
    if defaults.max_new_tokens is not None and defaults.max_new_tokens < 1:
        raise ConfigError(f"{defaults.origin}: max_new_tokens must be at least 1, not {defaults.max_new_tokens}")
    return defaults


def _with_defaults(s: verifier_pb2.SamplingParams,
                   defaults: Mapping[str, float | int]) -> verifier_pb2.SamplingParams:
    """`s` with each field it leaves unset that `defaults` sets taken from there."""
    missing = [name for name in defaults if not s.HasField(name)]
    if not missing:
        return s
    merged = verifier_pb2.SamplingParams()
    merged.CopyFrom(s)
    for name in missing:
        setattr(merged, name, defaults[name])
    return merged


def _check_sampling(s: verifier_pb2.SamplingParams) -> None:
    """The numeric fields' ranges."""
    if not 0.0 <= _finite("temperature", s.temperature) <= MAX_TEMPERATURE:
        raise _invalid(f"temperature must be within [0, {MAX_TEMPERATURE:g}] (0 = greedy), not {s.temperature:g}")
    if not 0.0 <= _finite("top_p", s.top_p) <= 1.0:
        raise _invalid(f"top_p must be within (0, 1] (0 = unset), not {s.top_p:g}")
    if s.top_k < 0:
        raise _invalid(f"top_k must be >= 0 (0 = off), not {s.top_k}")
    if not 0.0 <= _finite("min_p", s.min_p) <= 1.0:
        raise _invalid(f"min_p must be within [0, 1] (0 = off), not {s.min_p:g}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -MAX_PENALTY <= _finite(name, getattr(s, name)) <= MAX_PENALTY:
            raise _invalid(f"{name} must be within [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = none), "
                           f"not {getattr(s, name):g}")
    if _finite("repetition_penalty", s.repetition_penalty) < 0:
        raise _invalid(f"repetition_penalty must be > 0 (0 or 1 = none), not {s.repetition_penalty:g}")


def _sampling(s: verifier_pb2.SamplingParams, logprobs: int | None, vocab_size: int,
              tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    _check_sampling(s)
    temperature = s.temperature if s.temperature >= MIN_SAMPLING_TEMPERATURE else 0.0
    for token, bias in s.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise _invalid(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})")
        if not -MAX_LOGIT_BIAS <= _finite("logit_bias", bias) <= MAX_LOGIT_BIAS:
            raise _invalid(f"logit_bias must be within [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], not {bias:g} "
                           f"(token {token})")
    outside = next((t for t in s.allowed_token_ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise _invalid(f"allowed_token_ids: token id {outside} is outside the vocabulary [0, {vocab_size})")
    return SamplingParams(temperature=temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
                          seed=s.seed if s.HasField("seed") else None, logprobs=logprobs,
                          frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                          repetition_penalty=s.repetition_penalty or 1.0,
                          logit_bias=tuple(sorted((t, b) for t, b in s.logit_bias.items() if b)),
                          allowed_token_ids=tuple(sorted(set(s.allowed_token_ids))),
                          bad_words=_bad_words(s.bad_words, tokenizer, vocab_size))


def _bad_words(words: Sequence[str], tokenizer: PreTrainedTokenizerBase,
               vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM takes them: the word as written (leading spaces dropped),
    and after a space where that spells it with other tokens of the same count (a word-initial form)."""
    if len(words) > MAX_BAD_WORDS:
        raise _invalid(f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}")
    forms: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise _invalid("bad_words must not be empty or only spaces")
        if len(word) > MAX_STOP_STRING_CHARS:
            raise _invalid(f"bad_words must be at most {MAX_STOP_STRING_CHARS} characters")
        alone = tuple(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        forms.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            forms.append(spaced)
    bad = next((t for form in forms for t in form if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tuple(forms)


def _stopping(request: verifier_pb2.GenerationParams, prompt_len: int, limits: Limits) -> StoppingParams:
    st = request.stopping
    room = limits.max_model_len - prompt_len
    if st.HasField("max_new_tokens"):
        if st.max_new_tokens == 0:
            raise _invalid("max_new_tokens must be >= 1 (leave it unset for the server default)")
        if st.max_new_tokens > room:
            raise _invalid(f"prompt ({prompt_len} tokens) plus max_new_tokens ({st.max_new_tokens}) exceeds "
                           f"the context of {limits.max_model_len} tokens; at most {room} new tokens fit")
        max_new = st.max_new_tokens
    else:
        max_new = min(limits.default_max_new_tokens or room, room)
    if len(st.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(st.stop)}")
    for s in st.stop:
        if not s:
            raise _invalid("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise _invalid(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
    if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(st.stop_token_ids)}")
    bad = next((t for t in st.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _invalid(f"stop token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if st.min_new_tokens > max_new:
        raise _invalid(f"min_new_tokens ({st.min_new_tokens}) is more than max_new_tokens ({max_new})")
    return StoppingParams(
        max_new_tokens=max_new, stop=tuple(st.stop), stop_token_ids=frozenset(st.stop_token_ids),
        eos_token_ids=frozenset() if st.ignore_eos else limits.eos_token_ids, min_new_tokens=st.min_new_tokens,
        include_stop_str=st.include_stop_str_in_output)


def _speculation(s: verifier_pb2.SpeculationOverrides) -> SpeculationParams:
    return SpeculationParams(max_draft_len=s.max_draft_len if s.HasField("max_draft_len") else None,
                             disable=s.disable)


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """Characters past which a prompt cannot fit the context: no token spells more characters than
    its vocabulary entry, so more than max_model_len * longest-entry characters mean more than
    max_model_len tokens (doubled, for normalizers that fold characters together). 0: unknown."""
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: no early check
        return 0
    return 2 * max_model_len * longest if longest else 0
