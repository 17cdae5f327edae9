"""Admission tickets signed by the scheduler and checked by the verifier (HMAC-SHA256, shared secret).

A ticket binds one verify: its id, the session and round, and the demand it was admitted for
(block length, projected expert bytes; for an admission ahead of drafting, the most the block may
use), plus a wall-clock expiry. The verifier recomputes the
signature from the Verify request itself, so a ticket cannot be reused for another block, another
round or after it expired. Pure: no grpc, no clock of its own (time is passed in).
"""

from __future__ import annotations

import hashlib
import hmac

from pdflash.errors import PermissionDenied


class TicketSigner:
    """HMAC-SHA256 over the ticket's identity and limits; empty signature when no secret is set.

    Signed text: "ticket_id|session_id|round|tokens|expert_bytes|expires_at_unix" with expires_at_unix
    written with 6 decimals.
    """

    def __init__(self, secret: str = ""):
        self._key = secret.encode() if secret else b""

    @property
    def enabled(self) -> bool:
        return bool(self._key)

    @staticmethod
    def message(ticket_id: str, session_id: str, round: int, tokens: int, expert_bytes: int, expires_at_unix: float) -> bytes:
        return f"{ticket_id}|{session_id}|{round}|{tokens}|{expert_bytes}|{expires_at_unix:.6f}".encode()

    def sign(self, ticket_id: str, session_id: str, round: int, tokens: int, expert_bytes: int, expires_at_unix: float) -> str:
        if not self._key:
            return ""
        msg = self.message(ticket_id, session_id, round, tokens, expert_bytes, expires_at_unix)
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def verify(self, signature: str, ticket_id: str, session_id: str, round: int, tokens: int, expert_bytes: int, expires_at_unix: float) -> bool:
        if not self._key:
            return True
        expected = self.sign(ticket_id, session_id, round, tokens, expert_bytes, expires_at_unix)
        return hmac.compare_digest(expected, signature)

    def require(
        self,
        now_unix: float,
        signature: str,
        ticket_id: str,
        session_id: str,
        round: int,
        tokens: int,
        expert_bytes: int,
        expires_at_unix: float,
        block_tokens: int | None = None,
        block_bytes: int | None = None,
        call: str = "Verify",
    ) -> None:
        """Raise PermissionDenied unless the ticket is present, correctly signed for the demand it was
        admitted for (`tokens`, `expert_bytes`), unexpired, and the block fits in that demand.

        `block_tokens` / `block_bytes`: the block actually verified when the ticket was admitted ahead
        for up to `tokens` (None = the same as the ticket's). `call`: the RPC that needs it, for the message. Does nothing
        when no secret is set.
        """
        if not self._key:
            return
        if not ticket_id:
            raise PermissionDenied(f"{call} needs an admission ticket (ticket_id, ticket_signature, ticket_expires_at_unix) "
                                   "from the scheduler's Admit")
        if not signature:
            raise PermissionDenied(f"ticket {ticket_id!r} is not signed: the scheduler must run with the same "
                                   "--ticket-secret as the verifier")
        if not self.verify(signature, ticket_id, session_id, round, tokens, expert_bytes, expires_at_unix):
            raise PermissionDenied(f"ticket {ticket_id!r} has an invalid signature for session {session_id!r} round {round} "
                                   f"({tokens} tokens, {expert_bytes} expert bytes): it was issued for another block, "
                                   "altered, or signed with another secret")
        if block_tokens is not None and block_tokens > tokens:
            raise PermissionDenied(f"ticket {ticket_id!r} was admitted for at most {tokens} tokens; the block has {block_tokens}")
        if block_bytes is not None and block_bytes > expert_bytes:
            raise PermissionDenied(f"ticket {ticket_id!r} was admitted for at most {expert_bytes} expert bytes; "
                                   f"the block projects {block_bytes}")
        if expires_at_unix <= now_unix:
            raise PermissionDenied(f"ticket {ticket_id!r} expired {now_unix - expires_at_unix:.3f}s ago; admit the round again")
