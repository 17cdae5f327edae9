"""Prefetch hints: once the scheduler admits a demand, it tells the verifier (`Verifier.Prefetch`), so the demand's
projected expert union starts streaming into the verifier's expert cache before the Verify that carries it arrives
(an admission ahead of drafting is made a round early: its union can stream in while the round before it verifies).

The edge's business, not the policy's (scheduler_svc/policy.py stays pure): the servicer calls `admitted()` after it
has a ticket to answer with. A hint is sent on a task of its own and never awaited by the Admit, so it can neither delay
nor fail an admission. Best effort throughout: a failed hint (verifier unreachable, an error status, its timeout) is
logged at debug and counted (`pdflash_prefetch_hints_total{outcome="failed"}`); at most `max_in_flight` hints are
outstanding (more are dropped, counted); a verifier that answers it has no expert cache, or prefetches no union, is
not hinted again for `quiet_s` (it may be restarted with other options). The hint carries the demand's ticket, which a
verifier with a --ticket-secret checks as it checks a Verify's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from pdflash.convert import union_to_pb
from pdflash.logging import get_logger
from pdflash.server import channel
from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
from scheduler_svc.core import IssuedTicket
from scheduler_svc.policy import Demand

log = get_logger("pdflash.scheduler")

_OUTCOMES = {
    verifier_pb2.PREFETCH_OUTCOME_QUEUED: "queued",
    verifier_pb2.PREFETCH_OUTCOME_NO_EXPERT_CACHE: "no_expert_cache",
    verifier_pb2.PREFETCH_OUTCOME_DISABLED: "disabled",
    verifier_pb2.PREFETCH_OUTCOME_STALE: "stale",
}
_QUIET = (verifier_pb2.PREFETCH_OUTCOME_NO_EXPERT_CACHE, verifier_pb2.PREFETCH_OUTCOME_DISABLED)


class PrefetchHints:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None, metrics=None, timeout_s: float = 2.0,
                 max_in_flight: int = 64, quiet_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.target, self.credentials, self.metrics = target, credentials, metrics
        self.timeout_s, self.max_in_flight, self.quiet_s = timeout_s, max_in_flight, quiet_s
        self._clock = clock
        self._channel: grpc.aio.Channel | None = None  # made on first use, inside the server's event loop
        self._stub: verifier_pb2_grpc.VerifierStub | None = None
        self._tasks: set[asyncio.Task] = set()
        self._quiet_until = float("-inf")
        self.sent = 0  # hints handed to the channel (tests and logs)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.prefetch_hints.labels(outcome=outcome).inc()

    def admitted(self, demand: Demand, ticket: IssuedTicket) -> bool:
        """An admitted demand, its ticket about to be answered: queue its hint. Returns whether one was queued
        (not when its union is empty, the verifier said it has nothing to prefetch into, or too many are
        outstanding). Never raises, never waits."""
        try:
            layers = union_to_pb(demand.expert_union)  # a union off the wire goes on as its messages, unparsed
            if not any(le.expert_ids for le in layers):
                return False
            if self._clock() < self._quiet_until:
                return False
            if len(self._tasks) >= self.max_in_flight:
                self._count("dropped")
                log.debug("prefetch hint dropped: too many outstanding", session_id=demand.session_id, round=demand.round,
                          outstanding=len(self._tasks))
                return False
            request = verifier_pb2.PrefetchRequest(
                request_id=demand.request_id, session_id=demand.session_id, round=demand.round, expert_union=layers,
                ticket_id=ticket.ticket_id, ticket_signature=ticket.signature, ticket_expires_at_unix=ticket.expires_at_unix,
                ticket_tokens=ticket.tokens, ticket_expert_bytes=ticket.expert_bytes,
            )
            if self._stub is None:
                self._channel = channel(self.target, self.credentials)
                self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
            task = asyncio.get_running_loop().create_task(self._send(request), name="prefetch-hint")
        except Exception as e:  # noqa: BLE001 - a hint must never fail an admission
            self._count("failed")
            log.debug("prefetch hint not sent", session_id=demand.session_id, round=demand.round, error=repr(e))
            return False
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.sent += 1
        return True

    async def _send(self, request: verifier_pb2.PrefetchRequest) -> None:
        try:
            response = await self._stub.Prefetch(request, timeout=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            self._count("failed")
            log.debug("prefetch hint failed", verifier=self.target, session_id=request.session_id, round=request.round,
                      code=e.code().name, details=e.details())
            return
        except Exception as e:  # noqa: BLE001
            self._count("failed")
            log.debug("prefetch hint failed", verifier=self.target, session_id=request.session_id, round=request.round,
                      error=repr(e))
            return
        outcome = _OUTCOMES.get(response.outcome, "queued")
        self._count(outcome)
        if response.outcome in _QUIET:
            if self._clock() >= self._quiet_until:
                log.info("prefetch hints paused: the verifier has nothing to prefetch into", verifier=self.target,
                         outcome=outcome, pause_s=self.quiet_s)
            self._quiet_until = self._clock() + self.quiet_s
        else:
            log.debug("prefetch hint", session_id=request.session_id, round=request.round, outcome=outcome,
                      experts_queued=response.experts_queued)

    async def close(self) -> None:
        """Cancel what is outstanding and close the channel."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
