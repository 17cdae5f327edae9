"""Per-sequence state on the verifier: KV cache, committed length, the pending anchor, limits.

The anchor (the last emitted token) is NOT in the KV cache: it is the first token of the next block.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import torch
from transformers import DynamicCache

from pdflash.errors import NotFound, ResourceExhausted
from pdflash.types import FinishReason, SamplingParams


@dataclasses.dataclass
class Session:
    session_id: str
    request_id: str
    cache: DynamicCache | None
    committed: int  # tokens in the KV cache (prompt + committed generations)
    anchor: int
    generated: int  # tokens emitted so far (the anchor included)
    max_tokens: int
    stop_ids: frozenset[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    feature_layer_ids: tuple[int, ...]
    kv: object | None = None  # verifier_svc.kv.SequenceKV when the verifier runs on the paged KV pool
    top_logprobs: int | None = None  # None: no logprobs; else each emitted token's, and this many alternatives
    penalties: object | None = None  # pdflash.penalties.Penalties when the sampling asks for any
    round: int = 0
    finished: FinishReason | None = None
    last_used: float = dataclasses.field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def close(self) -> None:
        """Give back what the session holds beyond Python memory (its KV pages)."""
        if self.kv is not None:
            self.kv.free()
            self.kv = None


class SessionStore:
    def __init__(self, max_sessions: int, idle_ttl_s: float):
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._sessions: dict[str, Session] = {}
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def check_capacity(self, starting: int = 0) -> None:
        """`starting`: sessions whose prefill is under way (chunked prefills: not in the store until their last chunk)."""
        if len(self._sessions) + starting >= self.max_sessions:
            raise ResourceExhausted(
                f"verifier holds its maximum of {self.max_sessions} sessions; retry shortly", retry_after_s=1.0
            )

    def add(self, session: Session) -> None:
        self.check_capacity()
        self._sessions[session.session_id] = session

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown or expired session {session_id!r}; start a new one with Prefill")
        s.touch()
        return s

    def peek(self, session_id: str) -> Session:
        """As get, without counting as a use (a hint about a session does not keep it alive)."""
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown or expired session {session_id!r}; start a new one with Prefill")
        return s

    def end(self, session_id: str) -> bool:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            s.close()
        return s is not None

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        dead = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_ttl_s]
        for sid in dead:
            self._sessions.pop(sid).close()
        self.expired_total += len(dead)
        return dead
