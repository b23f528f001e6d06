from drafter_sdk.proto import speculative_pb2 as _speculative_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class DrafterState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_STATE_UNSPECIFIED: _ClassVar[DrafterState]
    DRAFTER_STATE_NOT_CONFIGURED: _ClassVar[DrafterState]
    DRAFTER_STATE_HEALTHY: _ClassVar[DrafterState]
    DRAFTER_STATE_UNAVAILABLE: _ClassVar[DrafterState]
    DRAFTER_STATE_INCOMPATIBLE: _ClassVar[DrafterState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
DRAFTER_STATE_UNSPECIFIED: DrafterState
DRAFTER_STATE_NOT_CONFIGURED: DrafterState
DRAFTER_STATE_HEALTHY: DrafterState
DRAFTER_STATE_UNAVAILABLE: DrafterState
DRAFTER_STATE_INCOMPATIBLE: DrafterState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "reasoning", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "template_kwargs", "tools", "add_generation_prompt", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    template_kwargs: str
    tools: str
    add_generation_prompt: bool
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., template_kwargs: _Optional[str] = ..., tools: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_p", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "min_new_tokens", "include_stop_str_in_output")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_new_tokens: int
    include_stop_str_in_output: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class SpeculationOverrides(_message.Message):
    __slots__ = ("max_draft_len", "disable")
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    max_draft_len: int
    disable: bool
    def __init__(self, max_draft_len: _Optional[int] = ..., disable: _Optional[bool] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "token_ids", "sampling", "stopping", "speculation", "logprobs", "prompt_logprobs", "structured_output", "skip_special_tokens", "truncate_prompt_tokens", "priority", "thinking_token_budget", "separate_reasoning", "prediction", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SEPARATE_REASONING_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingCriteria
    speculation: SpeculationOverrides
    logprobs: int
    prompt_logprobs: int
    structured_output: StructuredOutput
    skip_special_tokens: bool
    truncate_prompt_tokens: int
    priority: int
    thinking_token_budget: int
    separate_reasoning: bool
    prediction: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationOverrides, _Mapping]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., thinking_token_budget: _Optional[int] = ..., separate_reasoning: _Optional[bool] = ..., prediction: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredOutputChoices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutputChoices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StructuredOutputChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: GenerationParams
    def __init__(self, params: _Optional[_Union[GenerationParams, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: GenerationParams
    def __init__(self, params: _Optional[_Union[GenerationParams, _Mapping]] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "mean_acceptance_length", "acceptance_rate", "num_drafter_failures", "auto_disabled", "num_draft_nodes", "drafter_wait_s", "accepted_prediction_tokens", "rejected_prediction_tokens")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    AUTO_DISABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    mean_acceptance_length: float
    acceptance_rate: float
    num_drafter_failures: int
    auto_disabled: bool
    num_draft_nodes: int
    drafter_wait_s: float
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, num_steps: _Optional[int] = ..., num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., num_drafter_failures: _Optional[int] = ..., auto_disabled: _Optional[bool] = ..., num_draft_nodes: _Optional[int] = ..., drafter_wait_s: _Optional[float] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerationOutput(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stop_reason", "prompt_tokens", "stats", "logprobs", "drafted", "cached_prompt_tokens", "prompt_logprobs", "reasoning_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stop_reason: str
    prompt_tokens: int
    stats: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    drafted: _containers.RepeatedScalarFieldContainer[bool]
    cached_prompt_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    reasoning_text: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., drafted: _Optional[_Iterable[bool]] = ..., cached_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., reasoning_text: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: GenerationOutput
    def __init__(self, output: _Optional[_Union[GenerationOutput, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: GenerationOutput
    def __init__(self, output: _Optional[_Union[GenerationOutput, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterHealth(_message.Message):
    __slots__ = ("state", "target", "name", "version", "calls", "failures", "last_error", "disabled_reason", "draft_stream")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STREAM_FIELD_NUMBER: _ClassVar[int]
    state: DrafterState
    target: str
    name: str
    version: str
    calls: int
    failures: int
    last_error: str
    disabled_reason: str
    draft_stream: bool
    def __init__(self, state: _Optional[_Union[DrafterState, str]] = ..., target: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., calls: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., disabled_reason: _Optional[str] = ..., draft_stream: _Optional[bool] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("model", "tokenizer", "vocab_size", "max_model_len", "max_num_seqs", "max_queue_len", "default_max_new_tokens", "speculative_config", "drafter", "verifier_id", "version", "device", "dtype", "tensor_parallel_size", "tokenizer_fingerprint", "scheduling_policy", "reasoning_parser", "default_sampling")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_queue_len: int
    default_max_new_tokens: int
    speculative_config: _speculative_pb2.SpeculativeConfig
    drafter: DrafterHealth
    verifier_id: str
    version: str
    device: str
    dtype: str
    tensor_parallel_size: int
    tokenizer_fingerprint: str
    scheduling_policy: str
    reasoning_parser: str
    default_sampling: SamplingParams
    def __init__(self, model: _Optional[str] = ..., tokenizer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_queue_len: _Optional[int] = ..., default_max_new_tokens: _Optional[int] = ..., speculative_config: _Optional[_Union[_speculative_pb2.SpeculativeConfig, _Mapping]] = ..., drafter: _Optional[_Union[DrafterHealth, _Mapping]] = ..., verifier_id: _Optional[str] = ..., version: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., scheduling_policy: _Optional[str] = ..., reasoning_parser: _Optional[str] = ..., default_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat", "return_token_strs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    return_token_strs: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strs", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
