"""The scheduler's asyncio side: callers wait here until the pure policy seats their demand.

One event loop owns everything, so the policy needs no lock. Every change to the budget (arrival,
release, expiry, withdrawal) pumps the policy and wakes the callers it seated. A background task
reclaims expired leases. Errors are pdflash.errors types; the servicer turns them into statuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import grpc

from pdflash.errors import DeadlineExceeded, NotFound, PdflashError, ResourceExhausted, Unavailable
from pdflash.logging import get_logger
from pdflash.tickets import TicketSigner
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.leases import Lease
from scheduler_svc.policy import AdmissionPolicy, Budgets, Demand, QueueFull, Stats

log = get_logger("pdflash.scheduler")


class Superseded(PdflashError):
    """A newer Admit for the same (session, round) took this caller's place in the queue."""

    code = grpc.StatusCode.ABORTED


@dataclasses.dataclass(frozen=True)
class IssuedTicket:
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


class SchedulerCore:
    def __init__(
        self,
        cfg: SchedulerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.policy = AdmissionPolicy(
            Budgets(tokens=cfg.token_budget, expert_bytes=cfg.byte_budget or None),
            lease_s=cfg.lease_s,
            max_waiting=cfg.max_waiting,
            max_waiting_per_session=cfg.max_waiting_per_session,
            max_bypass=cfg.max_bypass,
            forget_idle_s=max(60.0, 2 * cfg.lease_s),
        )
        self.signer = TicketSigner(cfg.ticket_secret)
        self._clock = clock
        self._wall_clock = wall_clock
        self._futures: dict[int, asyncio.Future[Lease]] = {}
        self._hold_s = 0.1  # moving average of how long leases are held: the retry delay we suggest
        self._closed = False
        self._expiry_task: asyncio.Task[None] | None = None
        self.metrics = None  # pdflash.metrics.SchedulerMetrics, set by the server

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._expiry_task = asyncio.create_task(self._expire_forever(), name="scheduler-expiry")

    def close(self) -> None:
        """Stop admitting: waiting callers get UNAVAILABLE now, new ones at once. Release still works."""
        self._closed = True
        for fut in list(self._futures.values()):
            if not fut.done():
                fut.set_exception(Unavailable("scheduler is shutting down; retry on another replica"))

    async def stop(self) -> None:
        self.close()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            try:
                await self._expiry_task
            except asyncio.CancelledError:
                pass
            self._expiry_task = None

    # -- the RPCs' work --------------------------------------------------------------------------

    def admit_ahead(self, demand: Demand) -> IssuedTicket | None:
        """Seat a reservation for a session's next round at once, or None (deferred: nothing held).

        Never waits (see AdmissionPolicy.seat_now). A retry for a (session, round) already held with
        the same demand returns that ticket.
        """
        now = self._clock()
        again = self._retried(demand, now)
        if again is not None:
            return again
        lease = self.policy.seat_now(demand, now)
        if self.metrics is not None:
            self.metrics.admitted_ahead.labels(outcome="deferred" if lease is None else "seated").inc()
            if lease is not None:
                self.metrics.admission_wait.observe(0.0)
        if lease is None:
            log.debug("admit ahead deferred", session_id=demand.session_id, round=demand.round, waiting=self.policy.waiting)
            return None
        log.debug("admitted ahead", ticket_id=lease.ticket_id, session_id=demand.session_id, round=demand.round)
        return self._issue(lease, now)

    async def admit(self, demand: Demand, deadline_s: float | None = None) -> IssuedTicket:
        """Wait until the demand is seated; at most min(deadline_s, max_wait_s) seconds.

        When the caller's own deadline is the shorter bound the answer is DEADLINE_EXCEEDED; when
        max_wait_s is, RESOURCE_EXHAUSTED with a retry delay (the scheduler is overloaded).
        """
        blog = log.bind(session_id=demand.session_id, round=demand.round, request_id=demand.request_id)
        now = self._clock()
        again = self._retried(demand, now)
        if again is not None:
            return again
        try:
            wid = self.policy.submit(demand, now)
        except QueueFull as e:
            blog.warning("admit refused: queue full", scope=e.scope, waiting=self.policy.waiting)
            raise ResourceExhausted(f"scheduler queue full: {e}", retry_after_s=self._retry_after()) from None
        previous = self._futures.get(wid)
        if previous is not None and not previous.done():
            previous.set_exception(Superseded(f"superseded by a newer Admit for session {demand.session_id!r} round {demand.round}"))
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._futures[wid] = fut
        self._pump()

        timeout = self.cfg.max_wait_s if deadline_s is None else min(deadline_s, self.cfg.max_wait_s)
        handed_over = gave_up = False
        try:
            if not fut.done():
                await asyncio.wait([fut], timeout=max(timeout, 0.0))
            if not fut.done():
                if deadline_s is not None and deadline_s <= self.cfg.max_wait_s:
                    blog.warning("admit gave up: caller's deadline", waited_s=timeout)
                    raise DeadlineExceeded(f"not admitted within the call's deadline ({timeout:.3f}s)")
                blog.warning("admit gave up: max_wait_s", waited_s=timeout)
                gave_up = True
                raise ResourceExhausted(
                    f"not admitted within max_wait_s={self.cfg.max_wait_s}s; the scheduler is overloaded",
                    retry_after_s=self._retry_after(),
                )
            lease = fut.result()
            ticket = self._issue(lease, self._clock())
            if self.metrics is not None:
                self.metrics.admission_wait.observe(ticket.waited_ms / 1000.0)
            blog.debug("admitted", ticket_id=lease.ticket_id, waited_ms=ticket.waited_ms, alone=lease.alone)
            handed_over = True
            return ticket
        except asyncio.CancelledError:
            blog.info("admit cancelled by the caller: demand withdrawn")
            raise
        finally:
            if self._futures.get(wid) is fut:
                del self._futures[wid]
                if self.policy.withdraw(wid, rejected=gave_up):
                    self._pump()  # the withdrawn demand may have been the one blocking others
            if not handed_over and fut.done() and not fut.cancelled() and fut.exception() is None:
                # Seated, but the caller is gone (cancelled) before it got the ticket: give it back now.
                self._release(fut.result().ticket_id, "caller left before receiving the ticket")

    def release(self, ticket_id: str) -> bool:
        return self._release(ticket_id, "released")

    def renew(self, ticket_id: str) -> IssuedTicket:
        now = self._clock()
        lease = self.policy.renew(ticket_id, now)
        if lease is None:
            raise NotFound(f"ticket {ticket_id!r} is unknown, released or expired; admit the round again")
        log.debug("renewed", ticket_id=ticket_id, session_id=lease.session_id, round=lease.round)
        return self._issue(lease, now)

    def stats(self) -> Stats:
        return self.policy.stats()

    def expire_now(self) -> int:
        """Reclaim expired leases (the background task calls this); returns how many."""
        expired = self.policy.expire(self._clock())
        if expired and self.metrics is not None:
            self.metrics.tickets_expired.inc(len(expired))
        for lease in expired:
            log.warning(
                "lease expired: budget reclaimed",
                ticket_id=lease.ticket_id,
                session_id=lease.session_id,
                round=lease.round,
                tokens=lease.tokens,
                expert_bytes=lease.expert_bytes,
            )
        if expired:
            self._pump()
        return len(expired)

    # -- internals -------------------------------------------------------------------------------

    def _retried(self, demand: Demand, now: float) -> IssuedTicket | None:
        """Refuse when closing; a retry for a (session, round) held with the same demand gets that ticket
        again; a different demand for a held round replaces it (the old lease is released). None: go on."""
        if self._closed:
            raise Unavailable("scheduler is shutting down; retry on another replica")
        held = self.policy.held(demand.session_id, demand.round)
        if held is None:
            return None
        if (held.tokens, held.expert_bytes) == (demand.tokens, demand.expert_bytes) and self.policy.renew(held.ticket_id, now):
            log.info("admit retried: returning the held ticket", ticket_id=held.ticket_id, session_id=demand.session_id,
                     round=demand.round, request_id=demand.request_id)
            return self._issue(held, now)
        self._release(held.ticket_id, "released: a new block was admitted for the same round")
        return None

    def _release(self, ticket_id: str, why: str) -> bool:
        now = self._clock()
        lease = self.policy.release(ticket_id, now)
        if lease is None:
            return False
        self._hold_s = 0.8 * self._hold_s + 0.2 * max(0.0, now - lease.admitted_at)
        log.debug(why, ticket_id=ticket_id, session_id=lease.session_id, round=lease.round)
        self._pump()
        return True

    def _pump(self) -> None:
        """Seat what fits and wake those callers. A seat nobody waits for any more is given back."""
        orphans = True
        while orphans:
            orphans = False
            now = self._clock()
            for adm in self.policy.pump(now):
                fut = self._futures.pop(adm.waiter_id, None)
                if fut is None or fut.done():
                    self.policy.release(adm.lease.ticket_id, now)
                    orphans = True
                else:
                    fut.set_result(adm.lease)

    def _issue(self, lease: Lease, now: float) -> IssuedTicket:
        remaining = max(0.0, lease.expires_at - now)
        expires_at_unix = self._wall_clock() + remaining
        signature = self.signer.sign(lease.ticket_id, lease.session_id, lease.round, lease.tokens, lease.expert_bytes, expires_at_unix)
        return IssuedTicket(
            ticket_id=lease.ticket_id,
            session_id=lease.session_id,
            round=lease.round,
            tokens=lease.tokens,
            expert_bytes=lease.expert_bytes,
            lease_s=remaining,
            waited_ms=lease.waited_s * 1000.0,
            admitted_alone=lease.alone,
            signature=signature,
            expires_at_unix=expires_at_unix,
        )

    def _retry_after(self) -> float:
        return min(max(self._hold_s, 0.01), self.cfg.max_wait_s)

    async def _expire_forever(self) -> None:
        tick = min(1.0, self.cfg.lease_s / 4)
        while True:
            await asyncio.sleep(tick)
            try:
                self.expire_now()
            except Exception:  # keep reclaiming whatever happened once
                log.exception("lease expiry failed")
