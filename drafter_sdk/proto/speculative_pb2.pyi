import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculativeDecodingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATIVE_DECODING_MODE_UNSPECIFIED: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_NONE: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_USER_PROVIDED: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_NGRAM: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_DRAFT_TARGET: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_EAGLE3: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_MEDUSA: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_MTP: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_LOOKAHEAD: _ClassVar[SpeculativeDecodingMode]
    SPECULATIVE_DECODING_MODE_SUFFIX: _ClassVar[SpeculativeDecodingMode]

class SuffixCacheScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUFFIX_CACHE_SCOPE_UNSPECIFIED: _ClassVar[SuffixCacheScope]
    SUFFIX_CACHE_SCOPE_GLOBAL: _ClassVar[SuffixCacheScope]
    SUFFIX_CACHE_SCOPE_VERIFIER: _ClassVar[SuffixCacheScope]
    SUFFIX_CACHE_SCOPE_REQUEST: _ClassVar[SuffixCacheScope]
SPECULATIVE_DECODING_MODE_UNSPECIFIED: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_NONE: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_USER_PROVIDED: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_NGRAM: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_DRAFT_TARGET: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_EAGLE3: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_MEDUSA: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_MTP: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_LOOKAHEAD: SpeculativeDecodingMode
SPECULATIVE_DECODING_MODE_SUFFIX: SpeculativeDecodingMode
SUFFIX_CACHE_SCOPE_UNSPECIFIED: SuffixCacheScope
SUFFIX_CACHE_SCOPE_GLOBAL: SuffixCacheScope
SUFFIX_CACHE_SCOPE_VERIFIER: SuffixCacheScope
SUFFIX_CACHE_SCOPE_REQUEST: SuffixCacheScope

class TlsConfig(_message.Message):
    __slots__ = ("ca_cert_file", "cert_file", "key_file", "server_name_override")
    CA_CERT_FILE_FIELD_NUMBER: _ClassVar[int]
    CERT_FILE_FIELD_NUMBER: _ClassVar[int]
    KEY_FILE_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAME_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    ca_cert_file: str
    cert_file: str
    key_file: str
    server_name_override: str
    def __init__(self, ca_cert_file: _Optional[str] = ..., cert_file: _Optional[str] = ..., key_file: _Optional[str] = ..., server_name_override: _Optional[str] = ...) -> None: ...

class UserProvidedConfig(_message.Message):
    __slots__ = ("drafter_target", "call_deadline", "tls", "load_balancing_policy", "auth_token_file", "delta_overlap_steps", "overlap_calls", "share_finished")
    DRAFTER_TARGET_FIELD_NUMBER: _ClassVar[int]
    CALL_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCING_POLICY_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FILE_FIELD_NUMBER: _ClassVar[int]
    DELTA_OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_CALLS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    drafter_target: str
    call_deadline: _duration_pb2.Duration
    tls: TlsConfig
    load_balancing_policy: str
    auth_token_file: str
    delta_overlap_steps: int
    overlap_calls: bool
    share_finished: bool
    def __init__(self, drafter_target: _Optional[str] = ..., call_deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tls: _Optional[_Union[TlsConfig, _Mapping]] = ..., load_balancing_policy: _Optional[str] = ..., auth_token_file: _Optional[str] = ..., delta_overlap_steps: _Optional[int] = ..., overlap_calls: _Optional[bool] = ..., share_finished: _Optional[bool] = ...) -> None: ...

class NgramConfig(_message.Message):
    __slots__ = ("max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool", "tree_min_prob")
    MAX_MATCHING_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_KEEP_ALL_FIELD_NUMBER: _ClassVar[int]
    IS_USE_OLDEST_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_POOL_FIELD_NUMBER: _ClassVar[int]
    TREE_MIN_PROB_FIELD_NUMBER: _ClassVar[int]
    max_matching_ngram_size: int
    is_keep_all: bool
    is_use_oldest: bool
    is_public_pool: bool
    tree_min_prob: float
    def __init__(self, max_matching_ngram_size: _Optional[int] = ..., is_keep_all: _Optional[bool] = ..., is_use_oldest: _Optional[bool] = ..., is_public_pool: _Optional[bool] = ..., tree_min_prob: _Optional[float] = ...) -> None: ...

class SuffixConfig(_message.Message):
    __slots__ = ("max_tree_depth", "max_cached_requests", "max_spec_factor", "max_spec_offset", "min_token_prob", "cache_prompts", "cache_scope", "own_spec_factor", "prefer_longer_match", "learn_choice", "max_cached_mib")
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    CACHE_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    OWN_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PREFER_LONGER_MATCH_FIELD_NUMBER: _ClassVar[int]
    LEARN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_MIB_FIELD_NUMBER: _ClassVar[int]
    max_tree_depth: int
    max_cached_requests: int
    max_spec_factor: float
    max_spec_offset: float
    min_token_prob: float
    cache_prompts: bool
    cache_scope: SuffixCacheScope
    own_spec_factor: float
    prefer_longer_match: bool
    learn_choice: bool
    max_cached_mib: float
    def __init__(self, max_tree_depth: _Optional[int] = ..., max_cached_requests: _Optional[int] = ..., max_spec_factor: _Optional[float] = ..., max_spec_offset: _Optional[float] = ..., min_token_prob: _Optional[float] = ..., cache_prompts: _Optional[bool] = ..., cache_scope: _Optional[_Union[SuffixCacheScope, str]] = ..., own_spec_factor: _Optional[float] = ..., prefer_longer_match: _Optional[bool] = ..., learn_choice: _Optional[bool] = ..., max_cached_mib: _Optional[float] = ...) -> None: ...

class DraftModelConfig(_message.Message):
    __slots__ = ("model", "device", "dtype", "kv_cache_memory_gb", "draft_ahead")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    model: str
    device: str
    dtype: str
    kv_cache_memory_gb: float
    draft_ahead: bool
    def __init__(self, model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_memory_gb: _Optional[float] = ..., draft_ahead: _Optional[bool] = ...) -> None: ...

class LookaheadConfig(_message.Message):
    __slots__ = ("max_window_size", "max_ngram_size", "max_verification_set_size")
    MAX_WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_VERIFICATION_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_window_size: int
    max_ngram_size: int
    max_verification_set_size: int
    def __init__(self, max_window_size: _Optional[int] = ..., max_ngram_size: _Optional[int] = ..., max_verification_set_size: _Optional[int] = ...) -> None: ...

class DraftLengthRule(_message.Message):
    __slots__ = ("max_batch_size", "draft_len")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    draft_len: int
    def __init__(self, max_batch_size: _Optional[int] = ..., draft_len: _Optional[int] = ...) -> None: ...

class AutoDisablePolicy(_message.Message):
    __slots__ = ("window_tokens", "min_acceptance_rate", "probe_interval_steps")
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    PROBE_INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    window_tokens: int
    min_acceptance_rate: float
    probe_interval_steps: int
    def __init__(self, window_tokens: _Optional[int] = ..., min_acceptance_rate: _Optional[float] = ..., probe_interval_steps: _Optional[int] = ...) -> None: ...

class SpeculationPolicy(_message.Message):
    __slots__ = ("draft_len_schedule", "auto_disable", "adaptive_draft_len")
    DRAFT_LEN_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    AUTO_DISABLE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    draft_len_schedule: _containers.RepeatedCompositeFieldContainer[DraftLengthRule]
    auto_disable: AutoDisablePolicy
    adaptive_draft_len: bool
    def __init__(self, draft_len_schedule: _Optional[_Iterable[_Union[DraftLengthRule, _Mapping]]] = ..., auto_disable: _Optional[_Union[AutoDisablePolicy, _Mapping]] = ..., adaptive_draft_len: _Optional[bool] = ...) -> None: ...

class SpeculativeConfig(_message.Message):
    __slots__ = ("mode", "max_draft_len", "user_provided", "ngram", "draft_model", "lookahead", "suffix", "policy")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    USER_PROVIDED_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculativeDecodingMode
    max_draft_len: int
    user_provided: UserProvidedConfig
    ngram: NgramConfig
    draft_model: DraftModelConfig
    lookahead: LookaheadConfig
    suffix: SuffixConfig
    policy: SpeculationPolicy
    def __init__(self, mode: _Optional[_Union[SpeculativeDecodingMode, str]] = ..., max_draft_len: _Optional[int] = ..., user_provided: _Optional[_Union[UserProvidedConfig, _Mapping]] = ..., ngram: _Optional[_Union[NgramConfig, _Mapping]] = ..., draft_model: _Optional[_Union[DraftModelConfig, _Mapping]] = ..., lookahead: _Optional[_Union[LookaheadConfig, _Mapping]] = ..., suffix: _Optional[_Union[SuffixConfig, _Mapping]] = ..., policy: _Optional[_Union[SpeculationPolicy, _Mapping]] = ...) -> None: ...
