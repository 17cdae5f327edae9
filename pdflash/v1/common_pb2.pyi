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
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "expert_ids")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("session_id", "round", "tokens", "expert_union", "expert_bytes", "draft_dists")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_UNION_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    expert_union: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    expert_bytes: int
    draft_dists: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., expert_union: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., expert_bytes: _Optional[int] = ..., draft_dists: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("total_ms", "forward_ms", "accept_ms", "queue_ms")
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    total_ms: float
    forward_ms: float
    accept_ms: float
    queue_ms: float
    def __init__(self, total_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., accept_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
