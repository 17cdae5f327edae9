from pdflash.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_NONE: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_DFLASH: _ClassVar[DrafterKind]
    DRAFTER_KIND_HYBRID: _ClassVar[DrafterKind]
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_NONE: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_DFLASH: DrafterKind
DRAFTER_KIND_HYBRID: DrafterKind

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_tokens", "messages", "max_tokens", "sampling", "stop_token_ids", "ignore_eos", "block_size", "drafter", "fixed_width", "stop", "logprobs", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    FIXED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_tokens: TokenIds
    messages: ChatMessages
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    block_size: int
    drafter: DrafterKind
    fixed_width: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., block_size: _Optional[int] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., fixed_width: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "round", "logprobs", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    round: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., round: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "rounds", "mean_acceptance_length", "draft_tokens", "accepted_draft_tokens", "rounds_admitted_ahead", "routed_expert_bytes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ADMITTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    mean_acceptance_length: float
    draft_tokens: int
    accepted_draft_tokens: int
    rounds_admitted_ahead: int
    routed_expert_bytes: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., rounds_admitted_ahead: _Optional[int] = ..., routed_expert_bytes: _Optional[int] = ...) -> None: ...

class PhaseTimings(_message.Message):
    __slots__ = ("prefill_ms", "draft_ms", "admit_ms", "verify_ms", "verify_server_ms", "verify_forward_ms")
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    prefill_ms: float
    draft_ms: float
    admit_ms: float
    verify_ms: float
    verify_server_ms: float
    verify_forward_ms: float
    def __init__(self, prefill_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., admit_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., verify_server_ms: _Optional[float] = ..., verify_forward_ms: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "text", "timings", "stop_sequence")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    text: str
    timings: PhaseTimings
    stop_sequence: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., text: _Optional[str] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., stop_sequence: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "default_drafter", "drafters", "block_size", "max_block_size", "max_tokens_limit", "max_prompt_tokens", "vocab_size", "drafter_model", "drafter_device", "drafter_dtype", "chat_template")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    default_drafter: DrafterKind
    drafters: _containers.RepeatedScalarFieldContainer[DrafterKind]
    block_size: int
    max_block_size: int
    max_tokens_limit: int
    max_prompt_tokens: int
    vocab_size: int
    drafter_model: str
    drafter_device: str
    drafter_dtype: str
    chat_template: bool
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., default_drafter: _Optional[_Union[DrafterKind, str]] = ..., drafters: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., block_size: _Optional[int] = ..., max_block_size: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., drafter_model: _Optional[str] = ..., drafter_device: _Optional[str] = ..., drafter_dtype: _Optional[str] = ..., chat_template: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "count", "fits_prompt")
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FITS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    fits_prompt: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., fits_prompt: _Optional[bool] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids", "skip_special_tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
