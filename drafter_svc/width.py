"""How many drafts a session's next verify carries: the width adapts to what its rounds earn.

A verify forward costs a fixed part plus a part per token (measured on the demo target, one CPU
thread, benchmarks/results/replay.json: 3.1 ms for 1 token, 5.8 ms for 8, 9.8 ms for 32), and drafts past the first rejection are
thrown away. Drafting the full block every round pays for tokens that rounds seldom keep; drafting
few caps what long accepted runs (copied code, boilerplate) can earn. So each round drafts
`growth` x what the previous round emitted (accepted drafts + 1), between `floor` and the
request's block - 1: a rejected round shrinks the next to a cheap probe, an accepted run grows it
geometrically. The first round drafts the full block.

An offline replay over greedy reference outputs (`python benchmarks/replay.py`; benchmarks/README.md,
"Verify width") chose growth 3, floor 3: with the n-gram drafter's weak-match cap, 15-22% less time
than a fixed 32-token block on held-out stdlib prompts and 13% on this project's own source; for DFlash
the rule alone saves 4-7%. Lossless either way: the width only decides how many drafts are proposed,
never which tokens are accepted.
"""

from __future__ import annotations

import dataclasses

GROWTH = 3
FLOOR = 3


@dataclasses.dataclass
class VerifyWidth:
    """Per-session controller. `drafts()` before a round, `observe()` after it."""

    block_size: int  # anchor + drafts: the most one verify may carry
    adaptive: bool = True
    growth: int = GROWTH
    floor: int = FLOOR
    _next: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.growth < 1 or self.floor < 1:
            raise ValueError(f"growth and floor must be >= 1, got {self.growth}, {self.floor}")

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def drafts(self) -> int:
        """Drafts to propose this round (before the caller's own caps, such as tokens left)."""
        if not self.adaptive or self._next is None:
            return self.max_drafts
        return self._next

    def observe(self, accepted: int) -> None:
        """The round's accepted drafts (its emitted tokens are accepted + 1)."""
        self._next = min(self.max_drafts, max(self.floor, self.growth * (accepted + 1)))

    def bound_after(self, proposed: int) -> int:
        """The most drafts the round after one proposing `proposed` can ask for (it cannot accept more)."""
        if not self.adaptive:
            return self.max_drafts
        return min(self.max_drafts, max(self.floor, self.growth * (proposed + 1)))
