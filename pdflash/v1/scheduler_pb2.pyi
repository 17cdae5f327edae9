from pdflash.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "draft", "reserve_tokens", "release_ticket_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_TICKET_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _common_pb2.DraftResult
    reserve_tokens: int
    release_ticket_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.DraftResult, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., release_ticket_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Ticket(_message.Message):
    __slots__ = ("ticket_id", "session_id", "round", "tokens", "expert_bytes", "lease_s", "waited_ms", "admitted_alone", "signature", "expires_at_unix", "deferred")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_ALONE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    session_id: str
    round: int
    tokens: int
    expert_bytes: int
    lease_s: float
    waited_ms: float
    admitted_alone: bool
    signature: str
    expires_at_unix: float
    deferred: bool
    def __init__(self, ticket_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., tokens: _Optional[int] = ..., expert_bytes: _Optional[int] = ..., lease_s: _Optional[float] = ..., waited_ms: _Optional[float] = ..., admitted_alone: _Optional[bool] = ..., signature: _Optional[str] = ..., expires_at_unix: _Optional[float] = ..., deferred: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("token_budget", "byte_budget", "tokens_in_use", "bytes_in_use", "in_flight", "waiting", "admitted_total", "released_total", "expired_total", "rejected_total", "sessions_waiting")
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BYTE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_WAITING_FIELD_NUMBER: _ClassVar[int]
    token_budget: int
    byte_budget: int
    tokens_in_use: int
    bytes_in_use: int
    in_flight: int
    waiting: int
    admitted_total: int
    released_total: int
    expired_total: int
    rejected_total: int
    sessions_waiting: int
    def __init__(self, token_budget: _Optional[int] = ..., byte_budget: _Optional[int] = ..., tokens_in_use: _Optional[int] = ..., bytes_in_use: _Optional[int] = ..., in_flight: _Optional[int] = ..., waiting: _Optional[int] = ..., admitted_total: _Optional[int] = ..., released_total: _Optional[int] = ..., expired_total: _Optional[int] = ..., rejected_total: _Optional[int] = ..., sessions_waiting: _Optional[int] = ...) -> None: ...
