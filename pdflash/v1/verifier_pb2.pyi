from pdflash.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_OUTCOME_UNSPECIFIED: _ClassVar[PrefetchOutcome]
    PREFETCH_OUTCOME_QUEUED: _ClassVar[PrefetchOutcome]
    PREFETCH_OUTCOME_NO_EXPERT_CACHE: _ClassVar[PrefetchOutcome]
    PREFETCH_OUTCOME_DISABLED: _ClassVar[PrefetchOutcome]
    PREFETCH_OUTCOME_STALE: _ClassVar[PrefetchOutcome]
PREFETCH_OUTCOME_UNSPECIFIED: PrefetchOutcome
PREFETCH_OUTCOME_QUEUED: PrefetchOutcome
PREFETCH_OUTCOME_NO_EXPERT_CACHE: PrefetchOutcome
PREFETCH_OUTCOME_DISABLED: PrefetchOutcome
PREFETCH_OUTCOME_STALE: PrefetchOutcome

class VerifierModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerExpertBytes(_message.Message):
    __slots__ = ("layer", "expert_bytes")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., expert_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifierModelInfo(_message.Message):
    __slots__ = ("model", "architecture", "num_layers", "hidden_size", "vocab_size", "max_context", "moe_layers", "experts_per_layer", "experts_per_token", "expert_bytes", "total_expert_bytes", "eos_token_ids", "dtype", "device", "max_block_size", "sessions_alive", "max_sessions", "batch_invariant", "kernels", "experts_format", "warmup_seconds", "expert_cache_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    experts_per_layer: int
    experts_per_token: int
    expert_bytes: _containers.RepeatedCompositeFieldContainer[LayerExpertBytes]
    total_expert_bytes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    max_block_size: int
    sessions_alive: int
    max_sessions: int
    batch_invariant: bool
    kernels: str
    experts_format: str
    warmup_seconds: float
    expert_cache_bytes: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., experts_per_layer: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., expert_bytes: _Optional[_Iterable[_Union[LayerExpertBytes, _Mapping]]] = ..., total_expert_bytes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_block_size: _Optional[int] = ..., sessions_alive: _Optional[int] = ..., max_sessions: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., kernels: _Optional[str] = ..., experts_format: _Optional[str] = ..., warmup_seconds: _Optional[float] = ..., expert_cache_bytes: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "feature_layer_ids", "logprobs", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("session_id", "first_token", "finished", "finish_reason", "features", "routed_union", "routed_bytes", "timings", "committed_tokens", "logprobs", "top_logprobs", "wave_sessions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_UNION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WAVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token: int
    finished: bool
    finish_reason: _common_pb2.FinishReason
    features: _common_pb2.Tensor
    routed_union: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerExperts]
    routed_bytes: int
    timings: _common_pb2.Timings
    committed_tokens: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    wave_sessions: int
    def __init__(self, session_id: _Optional[str] = ..., first_token: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., routed_union: _Optional[_Iterable[_Union[_common_pb2.LayerExperts, _Mapping]]] = ..., routed_bytes: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., committed_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., wave_sessions: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "draft", "ticket_id", "return_features", "ticket_signature", "ticket_expires_at_unix", "ticket_tokens", "ticket_expert_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TICKET_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    TICKET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _common_pb2.DraftResult
    ticket_id: str
    return_features: bool
    ticket_signature: str
    ticket_expires_at_unix: float
    ticket_tokens: int
    ticket_expert_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.DraftResult, _Mapping]] = ..., ticket_id: _Optional[str] = ..., return_features: _Optional[bool] = ..., ticket_signature: _Optional[str] = ..., ticket_expires_at_unix: _Optional[float] = ..., ticket_tokens: _Optional[int] = ..., ticket_expert_bytes: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("session_id", "round", "accepted_tokens", "num_accepted_drafts", "committed_tokens", "finished", "finish_reason", "features", "routed_union", "routed_bytes", "timings", "expert_cache", "logprobs", "top_logprobs", "wave_sessions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_UNION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WAVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_drafts: int
    committed_tokens: int
    finished: bool
    finish_reason: _common_pb2.FinishReason
    features: _common_pb2.Tensor
    routed_union: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerExperts]
    routed_bytes: int
    timings: _common_pb2.Timings
    expert_cache: ExpertCacheRound
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    wave_sessions: int
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., num_accepted_drafts: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., routed_union: _Optional[_Iterable[_Union[_common_pb2.LayerExperts, _Mapping]]] = ..., routed_bytes: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., expert_cache: _Optional[_Union[ExpertCacheRound, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., wave_sessions: _Optional[int] = ...) -> None: ...

class ExpertCacheRound(_message.Message):
    __slots__ = ("lookups", "hits", "misses", "evictions", "prefetched", "prefetch_used", "bytes_moved", "wasted_bytes", "prefetch_aborted")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WASTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ABORTED_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    misses: int
    evictions: int
    prefetched: int
    prefetch_used: int
    bytes_moved: int
    wasted_bytes: int
    prefetch_aborted: int
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., prefetched: _Optional[int] = ..., prefetch_used: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., wasted_bytes: _Optional[int] = ..., prefetch_aborted: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "round", "expert_union", "ticket_id", "ticket_signature", "ticket_expires_at_unix", "ticket_tokens", "ticket_expert_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPERT_UNION_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    TICKET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TICKET_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    round: int
    expert_union: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerExperts]
    ticket_id: str
    ticket_signature: str
    ticket_expires_at_unix: float
    ticket_tokens: int
    ticket_expert_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., expert_union: _Optional[_Iterable[_Union[_common_pb2.LayerExperts, _Mapping]]] = ..., ticket_id: _Optional[str] = ..., ticket_signature: _Optional[str] = ..., ticket_expires_at_unix: _Optional[float] = ..., ticket_tokens: _Optional[int] = ..., ticket_expert_bytes: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("outcome", "experts_queued", "bytes_queued")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    BYTES_QUEUED_FIELD_NUMBER: _ClassVar[int]
    outcome: PrefetchOutcome
    experts_queued: int
    bytes_queued: int
    def __init__(self, outcome: _Optional[_Union[PrefetchOutcome, str]] = ..., experts_queued: _Optional[int] = ..., bytes_queued: _Optional[int] = ...) -> None: ...
