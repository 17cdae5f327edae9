"""Errors the cores raise, and the one place that maps them to gRPC status codes.

Cores never import grpc: they raise these. `abort_with` turns one into a rich status
(google.rpc.Status with BadRequest / RetryInfo details) on an aio servicer context.
"""

from __future__ import annotations

import dataclasses

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclasses.dataclass
class FieldViolation:
    field: str
    description: str


class PdflashError(Exception):
    """Base class. `code` is a grpc.StatusCode."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(PdflashError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, violations: list[FieldViolation] | None = None):
        super().__init__(message)
        self.violations = violations or []


class NotFound(PdflashError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(PdflashError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PdflashError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(PdflashError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PdflashError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(PdflashError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(PdflashError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Aborted(PdflashError):
    code = grpc.StatusCode.CANCELLED


def check(violations: list[FieldViolation], what: str = "invalid request") -> None:
    """Raise InvalidArgument listing every violation, if any."""
    if violations:
        detail = "; ".join(f"{v.field}: {v.description}" for v in violations)
        raise InvalidArgument(f"{what}: {detail}", violations)


def to_status(err: PdflashError) -> status_pb2.Status:
    details = []
    if isinstance(err, InvalidArgument) and err.violations:
        br = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in err.violations
            ]
        )
        details.append(br)
    if isinstance(err, ResourceExhausted):
        secs = max(err.retry_after_s, 0.0)
        ri = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=int(secs), nanos=int((secs % 1) * 1e9))
        )
        details.append(ri)
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message, details=packed)


async def abort_with(context: grpc.aio.ServicerContext, err: PdflashError) -> None:
    """Abort the RPC with err's status and details. Never returns."""
    await context.abort_with_status(rpc_status.to_status(to_status(err)))


STATUS_DETAILS_KEY = "grpc-status-details-bin"

_BY_CODE: dict[grpc.StatusCode, type[PdflashError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.CANCELLED: Aborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNKNOWN: Unavailable,
}


def status_details(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status a callee attached to its error (None when there is none or it is unreadable)."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(value)
            except Exception:  # a malformed trailer must not hide the error itself
                return None
    return None


def from_rpc_error(err: grpc.RpcError, hop: str) -> PdflashError:
    """Re-raise a downstream failure as our own error, naming the hop (no opaque errors across hops).

    The details travel on: BadRequest field violations (prefixed with the hop) and RetryInfo's delay,
    so a client two hops away still learns which field was wrong and when to retry.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    msg = f"{hop}: {details}"
    violations: list[FieldViolation] = []
    retry_after_s: float | None = None
    status = status_details(err)
    for any_ in status.details if status is not None else ():
        if any_.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            any_.Unpack(br)
            violations += [FieldViolation(f"{hop}: {v.field}", v.description) for v in br.field_violations]
        elif any_.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            ri = error_details_pb2.RetryInfo()
            any_.Unpack(ri)
            retry_after_s = ri.retry_delay.seconds + ri.retry_delay.nanos / 1e9
    cls = _BY_CODE.get(code)
    if cls is InvalidArgument:
        return InvalidArgument(msg, violations)
    if cls is ResourceExhausted:
        return ResourceExhausted(msg, retry_after_s=1.0 if retry_after_s is None else retry_after_s)
    if cls is Unavailable:
        return Unavailable(f"{msg} (the service is down or restarting; retry shortly)")
    if cls is not None:
        return cls(msg)
    e = PdflashError(msg)
    e.code = code
    return e
