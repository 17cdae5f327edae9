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

Offloaded experts change the price of width: a verify of n tokens must bring the union of the experts
those n tokens route, and with little locality between tokens that union (and the copy time) grows
almost linearly in n (gpt-oss-20b shapes, a 10% cache, H200: block 1 33 tok/s, a tau-3 block of 16
23 tok/s). So once the verifier says its experts are offloaded (`observe(..., offloaded=True)`), the
growth rule's width is capped by the width that maximizes expected tokens per unit of round time:
E(k) / T(k + 1), with E(k) = 1 + a + ... + a^k for a per-draft acceptance rate a (decayed counts of
this session's rounds) and T(n) a least-squares line of the session's recent round times over their
verified tokens. Where the line is flat (resident weights: a verify is launch-bound; a full block priced
under 1.25x one token) there is no cap and nothing changes. Every `PROBE_EVERY`-th round asks for one draft more than the cap, so a
cap of 0 still learns the acceptance rate and the slope.
"""

from __future__ import annotations

import collections
import dataclasses

GROWTH = 3
FLOOR = 3
COST_WINDOW = 32  # rounds the time line is fitted over
COST_MIN_ROUNDS = 6  # rounds (at >= 2 widths) before the cap applies
PROBE_EVERY = 8
DECAY = 0.9  # per round, of the acceptance counts: the rate follows the text
MATERIAL = 1.25  # the cap applies only where a full block's round is priced at >= 1.25x a one-token round
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts: a = 0.5 before any evidence


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a round emits on average with `drafts` drafts each accepted with probability `rate` (until the
    first rejection), plus the verify's own token."""
    return sum(rate**i for i in range(drafts + 1))


def best_drafts(rate: float, intercept: float, slope: float, max_drafts: int) -> int:
    """argmax over k in 0..max_drafts of expected_tokens(rate, k) / T(k + 1), T(n) = max(intercept, 0) + slope * n
    (a fitted line's negative intercept read as no fixed cost; the smallest k on ties)."""
    best, best_k = -1.0, 0
    for k in range(max_drafts + 1):
        t = max(max(intercept, 0.0) + slope * (k + 1), 1e-9)
        v = expected_tokens(rate, k) / t
        if v > best * (1 + 1e-9):
            best, best_k = v, k
    return best_k


class RoundCost:
    """Recent (verified tokens, round ms) of priced rounds and their least-squares line. One per drafter kind per
    process, shared by its sessions (the price of width is the verifier's, not a session's): a new request's first
    round is capped by what earlier requests measured."""

    def __init__(self, window: int = COST_WINDOW):
        self._times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def add(self, tokens: int, round_ms: float) -> None:
        self._times.append((int(tokens), float(round_ms)))

    def __len__(self) -> int:
        return len(self._times)

    def line(self) -> tuple[float, float] | None:
        """(intercept ms, slope ms per verified token), or None before there are enough rounds at two widths or
        more."""
        pts = list(self._times)
        if len(pts) < COST_MIN_ROUNDS or len({n for n, _ in pts}) < 2:
            return None
        mn = sum(n for n, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        var = sum((n - mn) ** 2 for n, _ in pts)
        slope = sum((n - mn) * (t - mt) for n, t in pts) / var
        return mt - slope * mn, slope


@dataclasses.dataclass
class VerifyWidth:
    """Per-session controller. `drafts()` before a round, `observe()` after it."""

    block_size: int  # anchor + drafts: the most one verify may carry
    adaptive: bool = True
    growth: int = GROWTH
    floor: int = FLOOR
    cost_aware: bool = True  # cap the width by round time once the verifier reports offloaded experts
    cost: RoundCost | None = None  # shared with other sessions (default: this session's own)
    _next: int | None = None
    _accepted: float = 0.0
    _rejected: float = 0.0
    _priced_rounds: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.growth < 1 or self.floor < 1:
            raise ValueError(f"growth and floor must be >= 1, got {self.growth}, {self.floor}")
        if self.cost is None:
            self.cost = RoundCost()

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def drafts(self) -> int:
        """Drafts to propose this round (before the caller's own caps, such as tokens left)."""
        if not self.adaptive:
            return self.max_drafts
        grown = self.max_drafts if self._next is None else self._next  # round 1: the whole block
        cap = self.cost_cap()
        if cap is None:
            return grown
        if self._priced_rounds % PROBE_EVERY == PROBE_EVERY - 1:
            cap += 1  # a probe: the rate and the slope keep being measured past the cap
        return min(grown, cap)

    def observe(self, accepted: int, proposed: int | None = None, round_ms: float | None = None,
                offloaded: bool = False) -> None:
        """The round's accepted drafts (its emitted tokens are accepted + 1); with `proposed` (the drafts it
        verified) the acceptance rate, and with `round_ms` of a round whose verifier streamed offloaded experts
        (`offloaded`) the time line the cost cap uses."""
        self._next = min(self.max_drafts, max(self.floor, self.growth * (accepted + 1)))
        if proposed is None:
            return
        self._accepted = self._accepted * DECAY + accepted
        self._rejected = self._rejected * DECAY + (1 if accepted < proposed else 0)
        if self.cost_aware and offloaded and round_ms is not None and round_ms > 0:
            self.cost.add(proposed + 1, round_ms)
            self._priced_rounds += 1

    @property
    def acceptance_rate(self) -> float:
        """The per-draft acceptance rate of recent rounds (decayed counts, with a prior of one each way)."""
        a, r = self._accepted + PRIOR[0], self._rejected + PRIOR[1]
        return min(a / (a + r), 0.99)

    def time_line(self) -> tuple[float, float] | None:
        """The shared round-time line (RoundCost.line)."""
        return self.cost.line()

    def cost_cap(self) -> int | None:
        """The width that maximizes expected tokens per ms of round (None: no priced line yet, or a flat one)."""
        if not self.cost_aware:
            return None
        line = self.time_line()
        if line is None or line[1] <= 0:
            return None
        a, b = line
        if a + b * (self.max_drafts + 1) < MATERIAL * (a + b):
            return None  # the whole block costs little more than one token: width is (nearly) free
        return best_drafts(self.acceptance_rate, a, b, self.max_drafts)

    def bound_after(self, proposed: int) -> int:
        """The most drafts the round after one proposing `proposed` can ask for (it cannot accept more)."""
        if not self.adaptive:
            return self.max_drafts
        return min(self.max_drafts, max(self.floor, self.growth * (proposed + 1)))
