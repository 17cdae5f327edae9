"""Tickets as leases: ids and expiry bookkeeping. Pure: time is passed in. Signing: pdflash.tickets.

A lease holds budget from the moment a demand is seated until it is released or its expiry passes,
so a drafter that dies between Admit and Release cannot leak budget. Renew moves the expiry forward.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdflash.tickets import TicketSigner  # noqa: F401  (re-exported: the signer lives in pdflash, shared with the verifier)

if TYPE_CHECKING:
    from scheduler_svc.policy import Demand


@dataclasses.dataclass
class Lease:
    ticket_id: str
    demand: Demand  # kept whole: a later wave admission looks at in-flight expert unions
    admitted_at: float
    expires_at: float
    waited_s: float
    alone: bool  # exceeded a budget and was seated with nothing else in flight

    @property
    def session_id(self) -> str:
        return self.demand.session_id

    @property
    def round(self) -> int:
        return self.demand.round

    @property
    def tokens(self) -> int:
        return self.demand.tokens

    @property
    def expert_bytes(self) -> int:
        return self.demand.expert_bytes


class TicketIds:
    """Unique ticket ids: a random per-process prefix (ids never repeat across restarts) + a counter."""

    def __init__(self, prefix: str | None = None):
        self.prefix = secrets.token_hex(4) if prefix is None else prefix
        self._counter = itertools.count(1)

    def __call__(self) -> str:
        return f"t-{self.prefix}-{next(self._counter)}"


class LeaseTable:
    """Leases by ticket id and by (session_id, round), with the budget they hold."""

    def __init__(self) -> None:
        self._by_id: dict[str, Lease] = {}
        self._by_key: dict[tuple[str, int], str] = {}
        self.tokens_in_use = 0
        self.bytes_in_use = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def get(self, ticket_id: str) -> Lease | None:
        return self._by_id.get(ticket_id)

    def held(self, session_id: str, round: int) -> Lease | None:
        tid = self._by_key.get((session_id, round))
        return None if tid is None else self._by_id[tid]

    def add(self, lease: Lease) -> None:
        self._by_id[lease.ticket_id] = lease
        self._by_key[(lease.session_id, lease.round)] = lease.ticket_id
        self.tokens_in_use += lease.tokens
        self.bytes_in_use += lease.expert_bytes

    def remove(self, ticket_id: str) -> Lease | None:
        lease = self._by_id.pop(ticket_id, None)
        if lease is None:
            return None
        if self._by_key.get((lease.session_id, lease.round)) == ticket_id:
            del self._by_key[(lease.session_id, lease.round)]
        self.tokens_in_use -= lease.tokens
        self.bytes_in_use -= lease.expert_bytes
        return lease

    def due(self, now: float) -> list[Lease]:
        """Leases whose expiry has passed (not removed)."""
        return [lease for lease in self._by_id.values() if lease.expires_at <= now]

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._by_id.values()), default=None)
