from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_STATUS_UNSPECIFIED: _ClassVar[DraftStatus]
    DRAFT_STATUS_OK: _ClassVar[DraftStatus]
    DRAFT_STATUS_RESYNC_REQUIRED: _ClassVar[DraftStatus]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_FINISHED: _ClassVar[ReleaseReason]
    RELEASE_REASON_CANCELLED: _ClassVar[ReleaseReason]
    RELEASE_REASON_EVICTED: _ClassVar[ReleaseReason]
DRAFT_STATUS_UNSPECIFIED: DraftStatus
DRAFT_STATUS_OK: DraftStatus
DRAFT_STATUS_RESYNC_REQUIRED: DraftStatus
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_FINISHED: ReleaseReason
RELEASE_REASON_CANCELLED: ReleaseReason
RELEASE_REASON_EVICTED: ReleaseReason

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterInfoResponse(_message.Message):
    __slots__ = ("name", "version", "max_draft_len", "vocab_size", "tokenizer", "capabilities", "tokenizer_fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    max_draft_len: int
    vocab_size: int
    tokenizer: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    tokenizer_fingerprint: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., max_draft_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...

class SamplingHints(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class DraftSequence(_message.Message):
    __slots__ = ("request_id", "context_len", "new_tokens", "prompt_len", "draft_len", "sampling", "last_num_drafted", "last_num_accepted", "max_draft_nodes", "cache_salt_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LAST_NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LAST_NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    draft_len: int
    sampling: SamplingHints
    last_num_drafted: int
    last_num_accepted: int
    max_draft_nodes: int
    cache_salt_id: str
    def __init__(self, request_id: _Optional[str] = ..., context_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., draft_len: _Optional[int] = ..., sampling: _Optional[_Union[SamplingHints, _Mapping]] = ..., last_num_drafted: _Optional[int] = ..., last_num_accepted: _Optional[int] = ..., max_draft_nodes: _Optional[int] = ..., cache_salt_id: _Optional[str] = ...) -> None: ...

class PrepareDraftTokensRequest(_message.Message):
    __slots__ = ("verifier_id", "sequences")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    def __init__(self, verifier_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("request_id", "status", "draft_tokens", "draft_parents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: DraftStatus
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[DraftStatus, str]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareDraftTokensResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ...) -> None: ...

class PrepareDraftTokensStreamRequest(_message.Message):
    __slots__ = ("request", "release")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    request: PrepareDraftTokensRequest
    release: ReleaseRequestsRequest
    def __init__(self, request: _Optional[_Union[PrepareDraftTokensRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequestsRequest, _Mapping]] = ...) -> None: ...

class PrepareDraftTokensStreamResponse(_message.Message):
    __slots__ = ("response", "released")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    response: PrepareDraftTokensResponse
    released: ReleaseRequestsResponse
    def __init__(self, response: _Optional[_Union[PrepareDraftTokensResponse, _Mapping]] = ..., released: _Optional[_Union[ReleaseRequestsResponse, _Mapping]] = ...) -> None: ...

class ReleaseRequestsRequest(_message.Message):
    __slots__ = ("verifier_id", "request_ids", "reasons")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    reasons: _containers.RepeatedScalarFieldContainer[ReleaseReason]
    def __init__(self, verifier_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., reasons: _Optional[_Iterable[_Union[ReleaseReason, str]]] = ...) -> None: ...

class ReleaseRequestsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetLearnedStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLearnedStateResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    def __init__(self, chunk: _Optional[bytes] = ...) -> None: ...
