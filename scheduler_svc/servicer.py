"""pdflash.v1.Scheduler over gRPC: validate, convert, call the core, convert back.

The only scheduler module that knows protobuf. Errors from the core map to statuses in
pdflash.errors.abort_with (INVALID_ARGUMENT + field violations, RESOURCE_EXHAUSTED + RetryInfo, ...).
"""

from __future__ import annotations

import grpc

from pdflash.convert import union_from_pb
from pdflash.errors import DeadlineExceeded, FieldViolation, PdflashError, abort_with, check
from pdflash.v1 import scheduler_pb2, scheduler_pb2_grpc
from pdflash.validation import MAX_ID_CHARS
from scheduler_svc.core import IssuedTicket, SchedulerCore
from scheduler_svc.policy import Demand, Stats

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Bounds on one demand, far above any real block: a malformed Admit cannot claim absurd budget.
MAX_BLOCK_TOKENS = 4096
MAX_UNION_LAYERS = 4096
MAX_RELEASES_PER_ADMIT = 16

# A deadline further away than this is treated as none (some stacks report "infinite" as a huge number).
_NO_DEADLINE_S = 1e8


def demand_from_pb(request: scheduler_pb2.AdmitRequest) -> Demand:
    violations: list[FieldViolation] = []
    if not request.HasField("draft"):
        violations.append(FieldViolation("draft", "required: the DraftResult to admit"))
    d = request.draft
    if request.HasField("draft"):
        if not d.session_id:
            violations.append(FieldViolation("draft.session_id", "must not be empty"))
        elif len(d.session_id) > MAX_ID_CHARS:
            violations.append(FieldViolation("draft.session_id", f"longer than {MAX_ID_CHARS} characters"))
        if d.round < 1:
            violations.append(FieldViolation("draft.round", "must be >= 1 (rounds are 1-based)"))
        if request.reserve_tokens:
            if request.reserve_tokens > MAX_BLOCK_TOKENS:
                violations.append(FieldViolation("reserve_tokens", f"{request.reserve_tokens} tokens; at most {MAX_BLOCK_TOKENS}"))
            if len(d.tokens) > request.reserve_tokens:
                violations.append(FieldViolation("draft.tokens", f"block of {len(d.tokens)} tokens exceeds reserve_tokens {request.reserve_tokens}"))
        elif not d.tokens:
            violations.append(FieldViolation("draft.tokens", "must hold the block (at least the anchor token); or set reserve_tokens to admit ahead"))
        elif len(d.tokens) > MAX_BLOCK_TOKENS:
            violations.append(FieldViolation("draft.tokens", f"block of {len(d.tokens)} tokens; at most {MAX_BLOCK_TOKENS}"))
        if len(d.expert_union) > MAX_UNION_LAYERS:
            violations.append(FieldViolation("draft.expert_union", f"{len(d.expert_union)} layers; at most {MAX_UNION_LAYERS}"))
        if d.expert_bytes and not any(le.expert_ids for le in d.expert_union):
            violations.append(FieldViolation("draft.expert_bytes", f"{d.expert_bytes} bytes for an empty expert_union: must be 0"))
    if len(request.request_id) > MAX_ID_CHARS:
        violations.append(FieldViolation("request_id", f"longer than {MAX_ID_CHARS} characters"))
    if len(request.release_ticket_ids) > MAX_RELEASES_PER_ADMIT:
        violations.append(FieldViolation("release_ticket_ids", f"{len(request.release_ticket_ids)} ids; at most {MAX_RELEASES_PER_ADMIT}"))
    elif any(not t or len(t) > MAX_ID_CHARS for t in request.release_ticket_ids):
        violations.append(FieldViolation("release_ticket_ids", f"ids must be non-empty and at most {MAX_ID_CHARS} characters"))
    check(violations, "invalid AdmitRequest")
    return Demand(
        session_id=d.session_id,
        round=int(d.round),
        tokens=int(request.reserve_tokens) or len(d.tokens),
        expert_bytes=int(d.expert_bytes),
        expert_union=union_from_pb(d.expert_union),
        request_id=request.request_id,
    )


def ticket_to_pb(t: IssuedTicket) -> scheduler_pb2.Ticket:
    return scheduler_pb2.Ticket(
        ticket_id=t.ticket_id,
        session_id=t.session_id,
        round=t.round,
        tokens=t.tokens,
        expert_bytes=t.expert_bytes,
        lease_s=t.lease_s,
        waited_ms=t.waited_ms,
        admitted_alone=t.admitted_alone,
        signature=t.signature,
        expires_at_unix=t.expires_at_unix,
    )


def stats_to_pb(s: Stats) -> scheduler_pb2.SchedulerStats:
    return scheduler_pb2.SchedulerStats(
        token_budget=s.token_budget or 0,  # 0 = unlimited
        byte_budget=s.byte_budget or 0,
        tokens_in_use=s.tokens_in_use,
        bytes_in_use=s.bytes_in_use,
        in_flight=s.in_flight,
        waiting=s.waiting,
        admitted_total=s.admitted_total,
        released_total=s.released_total,
        expired_total=s.expired_total,
        rejected_total=s.rejected_total,
        sessions_waiting=s.sessions_waiting,
    )


def _ticket_id(ticket_id: str) -> str:
    if not ticket_id:
        check([FieldViolation("ticket_id", "must not be empty")], "invalid request")
    if len(ticket_id) > MAX_ID_CHARS:
        check([FieldViolation("ticket_id", f"longer than {MAX_ID_CHARS} characters")], "invalid request")
    return ticket_id


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore, hints=None):
        self.core = core
        self.hints = hints  # scheduler_svc.hints.PrefetchHints (--verifier) or None: no prefetch hints

    async def Admit(self, request: scheduler_pb2.AdmitRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.Ticket:
        try:
            demand = demand_from_pb(request)
            for ticket_id in request.release_ticket_ids:  # finished rounds first: their budget may seat this one
                self.core.release(ticket_id)
            if request.reserve_tokens:
                ticket = self.core.admit_ahead(demand)
                if ticket is None:
                    return scheduler_pb2.Ticket(session_id=demand.session_id, round=demand.round, deferred=True)
            else:
                remaining = context.time_remaining()
                if remaining is not None and remaining > _NO_DEADLINE_S:
                    remaining = None
                ticket = await self.core.admit(demand, deadline_s=remaining)
            left = context.time_remaining()
            if left is not None and left <= 0:  # the caller has given up: the ticket would be lost on the way
                self.core.release(ticket.ticket_id)
                raise DeadlineExceeded("admitted only after the call's deadline; the ticket was released")
            if self.hints is not None:  # the verifier may start streaming the demand's experts (sent apart, never awaited)
                self.hints.admitted(demand, ticket)
            return ticket_to_pb(ticket)
        except PdflashError as e:
            err = e
        await abort_with(context, err)

    async def Release(self, request: scheduler_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.ReleaseResponse:
        try:
            return scheduler_pb2.ReleaseResponse(released=self.core.release(_ticket_id(request.ticket_id)))
        except PdflashError as e:
            err = e
        await abort_with(context, err)

    async def Renew(self, request: scheduler_pb2.RenewRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.Ticket:
        try:
            return ticket_to_pb(self.core.renew(_ticket_id(request.ticket_id)))
        except PdflashError as e:
            err = e
        await abort_with(context, err)

    async def GetStats(self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        return stats_to_pb(self.core.stats())
