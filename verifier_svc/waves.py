"""Multi-session verify waves: which of the Verify calls waiting for the device share the next forward.

Pure policy (no asyncio, no torch): the servicer keeps the waiting calls in arrival order and, each time the device
frees, asks `take_wave` for the next wave; `VerifierCore.verify_wave` runs it (one forward over every block on the
paged KV, each block's rows with the bits of a forward of its own). A session's rounds stay in order: a second call
of a session already in the wave waits for the next one (a drafter sends a session's rounds one at a time anyway).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def take_wave(waiting: Sequence[T], session_of: Callable[[T], str], rows_of: Callable[[T], int],
              max_sessions: int, max_rows: int) -> list[int]:
    """Indices into `waiting` (oldest first) of the next wave: from the front, each call whose session is not in the
    wave yet, while the wave holds fewer than `max_sessions` calls and its rows stay within `max_rows`. The oldest
    call always goes (whatever its rows), so a large block is never starved by smaller ones behind it; a call that
    would overflow the rows is skipped for now, and later smaller calls may still join."""
    picked: list[int] = []
    sessions: set[str] = set()
    rows = 0
    for i, item in enumerate(waiting):
        if len(picked) >= max_sessions:
            break
        sid = session_of(item)
        if sid in sessions:
            continue
        n = rows_of(item)
        if picked and rows + n > max_rows:
            continue
        picked.append(i)
        sessions.add(sid)
        rows += n
    return picked
