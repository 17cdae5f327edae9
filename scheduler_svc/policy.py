"""Verify admission under two budgets at once (verify tokens in flight, expert bytes in flight).

Pure logic: no grpc, no asyncio, no clock (every method that needs time takes `now`).

How a demand is seated:
- Cost = dominant share: max(tokens / token_budget, bytes / byte_budget), in integer credit units
  where SCALE is one whole budget; clamped to [1, SCALE] (a demand over a budget costs one budget).
- Sessions with waiting demands form a deficit round-robin ring. Each session carries credit in
  [0, SCALE] across rounds (cap = SCALE >= every clamped cost; forgotten once the session is idle for
  forget_idle_s). The head session is the pick while its credit covers its oldest demand; otherwise it
  gains one quantum and goes to the back. Seating pays the cost from the credit (floored at 0). So
  under contention each session gets about one quantum of dominant share per turn, and a demand
  costing k quanta waits k turns (among fresh sessions, cheaper demands are funded first).
- The pick is seated if it fits both budgets, or if nothing is in flight (the alone rule: a demand
  bigger than a budget, or any demand under a zero budget, still runs, by itself).
- A pick that does not fit blocks the ring. Other sessions' demands that fit may backfill the idle
  budget, each counting as one bypass of the pick; after `max_bypass` bypasses nothing else is seated
  until the pick fits (in flight drains, so it does): big demands cannot starve behind small ones.
- Otherwise the budgets are never exceeded: with two or more leases in flight, both sums fit.
- Admission ahead (`seat_now`): a session may reserve its next round while the current one verifies.
  It never waits and never queues: it is seated at once only when no demand is waiting and it fits
  beside the leases in flight (no alone rule), so it only ever takes budget nobody else asked for.

Seated demands become leases (`leases.py`) that expire unless released or renewed. A later wave
admission (several sessions verified together so their expert unions overlap) can replace `_next`:
every waiting demand and every lease keeps its expert_union.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from pdflash.types import ExpertUnion
from scheduler_svc.leases import Lease, LeaseTable, TicketIds

SCALE = 1 << 16  # credit units in one whole budget


@dataclasses.dataclass(frozen=True)
class Budgets:
    """In-flight limits. None = unlimited; 0 = every demand runs alone."""

    tokens: int | None
    expert_bytes: int | None

    def cost(self, tokens: int, expert_bytes: int) -> int:
        """Dominant share of the budgets, in credit units, clamped to [1, SCALE]."""
        share = max(_share(tokens, self.tokens), _share(expert_bytes, self.expert_bytes))
        return min(max(share, 1), SCALE)

    def fit(self, tokens_in_use: int, bytes_in_use: int, tokens: int, expert_bytes: int) -> bool:
        return (self.tokens is None or tokens_in_use + tokens <= self.tokens) and (
            self.expert_bytes is None or bytes_in_use + expert_bytes <= self.expert_bytes
        )


def _share(amount: int, budget: int | None) -> int:
    if budget is None or amount <= 0:
        return 0
    if budget <= 0:
        return SCALE
    return -(-amount * SCALE // budget)  # ceil


@dataclasses.dataclass(frozen=True)
class Demand:
    session_id: str
    round: int
    tokens: int
    expert_bytes: int
    expert_union: ExpertUnion = dataclasses.field(default_factory=dict, compare=False)
    request_id: str = dataclasses.field(default="", compare=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.session_id, self.round)


@dataclasses.dataclass(frozen=True)
class Admission:
    waiter_id: int
    lease: Lease


@dataclasses.dataclass(frozen=True)
class Stats:
    token_budget: int | None
    byte_budget: int | None
    tokens_in_use: int
    bytes_in_use: int
    in_flight: int
    waiting: int
    admitted_total: int
    released_total: int
    expired_total: int
    rejected_total: int
    sessions_waiting: int


class QueueFull(Exception):
    """A new demand was refused: too many are waiting (in all, or for this session)."""

    def __init__(self, message: str, scope: str):
        super().__init__(message)
        self.scope = scope  # "total" or "session"


@dataclasses.dataclass
class _Waiter:
    id: int
    demand: Demand
    cost: int
    arrived_at: float
    bypassed: int = 0


@dataclasses.dataclass
class _Session:
    queue: collections.deque[_Waiter] = dataclasses.field(default_factory=collections.deque)
    credit: int = 0
    in_flight: int = 0
    last_active: float = 0.0


class AdmissionPolicy:
    def __init__(
        self,
        budgets: Budgets,
        *,
        lease_s: float,
        max_waiting: int,
        max_waiting_per_session: int,
        max_bypass: int = 8,
        quantum: int = SCALE // 16,
        forget_idle_s: float = 60.0,
        ticket_ids: Callable[[], str] | None = None,
    ):
        if quantum <= 0:
            raise ValueError("quantum must be > 0")
        self.budgets = budgets
        self.lease_s = lease_s
        self.max_waiting = max_waiting
        self.max_waiting_per_session = max_waiting_per_session
        self.max_bypass = max_bypass
        self.quantum = quantum
        self.forget_idle_s = forget_idle_s
        self._new_ticket_id = ticket_ids or TicketIds()
        self.leases = LeaseTable()
        self._sessions: dict[str, _Session] = {}
        self._ring: collections.deque[str] = collections.deque()  # sessions with waiting demands
        self._waiters: dict[int, tuple[str, _Waiter]] = {}
        self._by_key: dict[tuple[str, int], int] = {}
        self._next_waiter_id = 1
        self.admitted_total = 0
        self.released_total = 0
        self.expired_total = 0
        self.rejected_total = 0

    # -- waiting ---------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def is_waiting(self, waiter_id: int) -> bool:
        return waiter_id in self._waiters

    def submit(self, demand: Demand, now: float) -> int:
        """Queue a demand; returns its waiter id. Call `pump` to seat what fits.

        A demand for a (session, round) that is already waiting takes that waiter's place (same id,
        same position): a retried Admit does not lose its turn. Raises QueueFull beyond the limits.
        """
        cost = self.budgets.cost(demand.tokens, demand.expert_bytes)
        wid = self._by_key.get(demand.key)
        if wid is not None:
            _, w = self._waiters[wid]
            w.demand, w.cost = demand, cost
            return wid
        session = self._sessions.get(demand.session_id)
        if len(self._waiters) >= self.max_waiting:
            self.rejected_total += 1
            raise QueueFull(f"{len(self._waiters)} demands already waiting (max_waiting {self.max_waiting})", "total")
        if session is not None and len(session.queue) >= self.max_waiting_per_session:
            self.rejected_total += 1
            raise QueueFull(
                f"session {demand.session_id!r} already has {len(session.queue)} demands waiting "
                f"(max_waiting_per_session {self.max_waiting_per_session})",
                "session",
            )
        if session is None:
            session = self._sessions[demand.session_id] = _Session()
        wid = self._next_waiter_id
        self._next_waiter_id += 1
        w = _Waiter(wid, demand, cost, now)
        if not session.queue:
            self._ring.append(demand.session_id)
        session.queue.append(w)
        session.last_active = now
        self._waiters[wid] = (demand.session_id, w)
        self._by_key[demand.key] = wid
        return wid

    def withdraw(self, waiter_id: int, *, rejected: bool = False) -> bool:
        """Take a waiting demand out (cancelled or timed out). False if it is not waiting."""
        entry = self._waiters.pop(waiter_id, None)
        if entry is None:
            return False
        sid, w = entry
        del self._by_key[w.demand.key]
        session = self._sessions[sid]
        session.queue.remove(w)
        if not session.queue:
            self._ring.remove(sid)
        if rejected:
            self.rejected_total += 1
        return True

    # -- seating ---------------------------------------------------------------------------------

    def pump(self, now: float) -> list[Admission]:
        """Seat every demand the rules allow now, in order."""
        seated: list[Admission] = []
        while self._ring:
            sid = self._next()
            pick = self._sessions[sid].queue[0]
            if self._fits(pick.demand):
                seated.append(self._seat(sid, pick, now))
                continue
            seated.extend(self._backfill(pick, now))
            break
        return seated

    def seat_now(self, demand: Demand, now: float) -> Lease | None:
        """Seat a demand at once without queueing (admission ahead of drafting), or None.

        None when any demand is waiting, or when it does not fit beside the leases in flight: ahead
        admissions only take budget that nobody waits for, and never use the alone rule.
        """
        if self._waiters or not self.budgets.fit(
            self.leases.tokens_in_use, self.leases.bytes_in_use, demand.tokens, demand.expert_bytes
        ):
            return None
        session = self._sessions.get(demand.session_id)
        if session is None:
            session = self._sessions[demand.session_id] = _Session()
        session.credit = max(0, session.credit - self.budgets.cost(demand.tokens, demand.expert_bytes))
        session.in_flight += 1
        session.last_active = now
        lease = Lease(ticket_id=self._new_ticket_id(), demand=demand, admitted_at=now, expires_at=now + self.lease_s,
                      waited_s=0.0, alone=False)
        self.leases.add(lease)
        self.admitted_total += 1
        return lease

    def _next(self) -> str:
        """Deficit round-robin: the first session in the ring whose credit covers its oldest demand."""
        while True:
            sid = self._ring[0]
            session = self._sessions[sid]
            if session.credit >= session.queue[0].cost:
                return sid
            session.credit = min(SCALE, session.credit + self.quantum)
            self._ring.rotate(-1)

    def _fits(self, demand: Demand) -> bool:
        if not len(self.leases):
            return True  # the alone rule
        return self.budgets.fit(self.leases.tokens_in_use, self.leases.bytes_in_use, demand.tokens, demand.expert_bytes)

    def _backfill(self, pick: _Waiter, now: float) -> list[Admission]:
        """Fill budget the blocked pick cannot use yet, at most max_bypass times per pick."""
        seated: list[Admission] = []
        for sid in list(self._ring)[1:]:
            session = self._sessions[sid]
            while session.queue and pick.bypassed < self.max_bypass and self._fits(session.queue[0].demand):
                seated.append(self._seat(sid, session.queue[0], now))
                pick.bypassed += 1
            if pick.bypassed >= self.max_bypass:
                break
        return seated

    def _seat(self, sid: str, w: _Waiter, now: float) -> Admission:
        session = self._sessions[sid]
        alone = not len(self.leases) and not self.budgets.fit(0, 0, w.demand.tokens, w.demand.expert_bytes)
        session.queue.popleft()
        if not session.queue:
            self._ring.remove(sid)
        session.credit = max(0, session.credit - w.cost)
        session.in_flight += 1
        session.last_active = now
        del self._waiters[w.id]
        del self._by_key[w.demand.key]
        lease = Lease(
            ticket_id=self._new_ticket_id(),
            demand=w.demand,
            admitted_at=now,
            expires_at=now + self.lease_s,
            waited_s=max(0.0, now - w.arrived_at),
            alone=alone,
        )
        self.leases.add(lease)
        self.admitted_total += 1
        return Admission(w.id, lease)

    # -- leases ----------------------------------------------------------------------------------

    def held(self, session_id: str, round: int) -> Lease | None:
        return self.leases.held(session_id, round)

    def release(self, ticket_id: str, now: float) -> Lease | None:
        """Give a lease's budget back. Idempotent: None if unknown, released or expired."""
        lease = self._drop(ticket_id, now)
        if lease is not None:
            self.released_total += 1
        return lease

    def renew(self, ticket_id: str, now: float) -> Lease | None:
        """Extend a live lease by lease_s from now. None if unknown, released or already past expiry."""
        lease = self.leases.get(ticket_id)
        if lease is None or lease.expires_at <= now:
            return None
        lease.expires_at = now + self.lease_s
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Reclaim leases past their expiry, and forget sessions idle for forget_idle_s."""
        expired = [self._drop(lease.ticket_id, now) for lease in self.leases.due(now)]
        self.expired_total += len(expired)
        for sid, s in list(self._sessions.items()):
            if not s.queue and not s.in_flight and now - s.last_active >= self.forget_idle_s:
                del self._sessions[sid]
        return [lease for lease in expired if lease is not None]

    def next_expiry(self) -> float | None:
        return self.leases.next_expiry()

    def _drop(self, ticket_id: str, now: float) -> Lease | None:
        lease = self.leases.remove(ticket_id)
        if lease is not None:
            session = self._sessions.get(lease.session_id)
            if session is not None:
                session.in_flight -= 1
                session.last_active = now
        return lease

    # -- introspection ---------------------------------------------------------------------------

    def credit(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None else s.credit

    def stats(self) -> Stats:
        return Stats(
            token_budget=self.budgets.tokens,
            byte_budget=self.budgets.expert_bytes,
            tokens_in_use=self.leases.tokens_in_use,
            bytes_in_use=self.leases.bytes_in_use,
            in_flight=len(self.leases),
            waiting=len(self._waiters),
            admitted_total=self.admitted_total,
            released_total=self.released_total,
            expired_total=self.expired_total,
            rejected_total=self.rejected_total,
            sessions_waiting=len(self._ring),
        )
