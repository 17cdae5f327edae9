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
with n, concavely (gpt-oss-20b shapes, 32 experts top-4, random routing: 4, 7.5, 10.6, 13.3 experts a
layer for 1-4 tokens; on the H200 with a 25% cache a round of 1 token took 24 ms, 2 tokens 43, 3 tokens
63-80, 9 tokens 113-134: benchmarks/results/offload_h200_round_log.json). So once the verifier says its
experts are offloaded (its model info up front, `RoundCost(offloaded=True)`, or `observe(...,
offloaded=True)`), the growth rule's width is capped by the width that maximizes expected tokens per unit
of round time, E(k) / T(k + 1), both measured rather than assumed:
- E(k) = 1 + S(1) + ... + S(k), S(i) the chance that drafts 1..i are all accepted, from this session's
  verdicts draft position by draft position (each position's accepted/rejected counts, decayed as that
  position is verified again), shrunk by SHRINK pseudo-verdicts toward the drafter kind's recent rate at
  that position (shared in the `RoundCost`, itself shrunk toward the kind's pooled rate): a new session
  starts from what the kind's rounds earned. A geometric rate alone misprices drafters whose runs have a
  typical length (a drafter right twice, then wrong, prices a third draft like a second one).
- T(n): the median round time of the window's rounds that verified n tokens; for widths not measured, a
  least-squares curve a + b n^p (p in 0.25..1) through those medians, shifted to the nearest measured
  width. A line (the rule before) overprices one-token rounds when the union grows concavely.
A session's first round is not priced (it follows the prefill, which streamed most experts through the
cache). Until 4 rounds are priced the width starts small, 0, 1, 2, 3 drafts (WARM_WIDTHS), from a session's
first round where the model info says the cache cannot keep every expert, else from the first priced round
(a first round of the whole block would stream the union of 16 tokens' experts, gpt-oss-20b shapes: ~28 of
32 a layer, to learn its price). Where the line is flat (resident weights: a verify is launch-bound; a full block
priced under 1.25x one token) there is no cap and nothing changes. Every `PROBE_EVERY`-th priced round
probes one draft more than the cap, the next such round one fewer, so the widths on either side keep being
measured; a side priced below PROBE_GAP of the cap's tokens per ms is probed only every PROBE_RARE-th
time. `python benchmarks/width_price.py` runs the rule against modelled offloaded round times.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import statistics

GROWTH = 3
FLOOR = 3
COST_WINDOW = 64  # rounds the round-time estimates are drawn from
COST_MIN_ROUNDS = 4  # rounds (at >= 2 widths) before the cap applies
PROBE_EVERY = 8
PROBE_GAP = 0.85  # a side of the cap priced below this share of the cap's tokens per ms ...
PROBE_RARE = 4  # ... is probed only every 4th probe
CURVE_POWERS = tuple(x / 20 for x in range(5, 21))  # 0.25 .. 1.0
WARM_WIDTHS = (0, 1, 2, 3)  # drafts of the priced rounds before a curve exists
STEP_DECAY = 0.9  # per verdict at a draft position, of that position's counts
KIND_DECAY = 0.95  # per verdict, of a drafter kind's shared counts (a new session's prior)
SHRINK = 2.0  # pseudo-verdicts at the pooled rate added to each draft position's counts
MATERIAL = 1.25  # the cap applies only where a full block's round is priced at >= 1.25x a one-token round
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts: a = 0.5 before any evidence


def best_drafts(survival: list[float], time_of, max_drafts: int) -> int:
    """argmax over k in 0..max_drafts of E(k) / time_of(k + 1), E(k) = survival[0] + ... + survival[k]
    (survival[i]: the chance that drafts 1..i are all accepted, survival[0] = 1; positions past the list keep
    its last value); the smallest k on ties."""
    best, best_k, tokens = -1.0, 0, 0.0
    for k in range(max_drafts + 1):
        tokens += survival[min(k, len(survival) - 1)]
        v = tokens / max(time_of(k + 1), 1e-9)
        if v > best * (1 + 1e-9):
            best, best_k = v, k
    return best_k


def add_verdicts(acc: list[float], rej: list[float], accepted: int, seen: int, decay: float) -> None:
    """Positions 0..seen-1 (drafts 1..seen) got a verdict this round: each position's counts decay, then the first
    `accepted` count an acceptance and the next (if seen) a rejection."""
    for i in range(seen):
        acc[i] *= decay
        rej[i] *= decay
        if i < accepted:
            acc[i] += 1.0
        else:
            rej[i] += 1.0


class RoundCost:
    """Recent (verified tokens, round ms) of priced rounds: their least-squares line, the median round time per
    width and a concave curve through those; and the drafter kind's acceptance per draft position. One per drafter
    kind per process, shared by its sessions (the price of width is the verifier's, not a session's): a new
    request's first round is capped by what earlier requests measured."""

    def __init__(self, window: int = COST_WINDOW, offloaded: bool = False):
        self._times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.offloaded = offloaded  # the verifier said so up front (its model info): priced from the first round
        # what this drafter kind's drafts earn, position by position (the prior of a new session's rates)
        self._acc: list[float] = []
        self._rej: list[float] = []
        self._pool = [PRIOR[0], PRIOR[1]]
        self._memo: dict[str, object] = {}  # line / medians / estimator of the current window
        self.stamp = 0  # counts changes (rounds priced, verdicts recorded): sessions' drafts() memos follow it

    def record(self, accepted: int, proposed: int) -> None:
        """A round's verdicts: drafts 1..accepted accepted, draft accepted + 1 rejected (if proposed)."""
        seen = min(accepted + 1, proposed)
        while len(self._acc) < seen:
            self._acc.append(0.0)
            self._rej.append(0.0)
        add_verdicts(self._acc, self._rej, accepted, seen, KIND_DECAY)
        self.stamp += 1
        if seen:
            self._pool = [self._pool[0] * KIND_DECAY + accepted, self._pool[1] * KIND_DECAY + (accepted < proposed)]

    def position_rates(self, positions: int) -> list[float]:
        """[q(1), ..., q(positions)]: the chance this kind's draft i is accepted given drafts 1..i-1 were, each
        position's counts shrunk toward the kind's pooled rate by SHRINK pseudo-verdicts."""
        pool = self._pool[0] / (self._pool[0] + self._pool[1])
        out = []
        for i in range(positions):
            a, r = (self._acc[i], self._rej[i]) if i < len(self._acc) else (0.0, 0.0)
            out.append((a + SHRINK * pool) / (a + r + SHRINK))
        return out

    def warming(self) -> bool:
        """No line yet, and the experts are offloaded: said up front (a cache that cannot keep them all), or a priced
        round was seen (then the widths must differ for a line to exist at all): the slow start."""
        return (self.offloaded or len(self._times) > 0) and self.line() is None

    def add(self, tokens: int, round_ms: float) -> None:
        self._times.append((int(tokens), float(round_ms)))
        self._memo.clear()  # the line, medians and curve follow the window
        self.stamp += 1

    def _memoized(self, key: str, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def __len__(self) -> int:
        return len(self._times)

    def line(self) -> tuple[float, float] | None:
        """(intercept ms, slope ms per verified token), or None before there are enough rounds at two widths or
        more."""
        return self._memoized("line", self._line)

    def _line(self) -> tuple[float, float] | None:
        pts = list(self._times)
        if len(pts) < COST_MIN_ROUNDS or len({n for n, _ in pts}) < 2:
            return None
        mn = sum(n for n, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        var = sum((n - mn) ** 2 for n, _ in pts)
        slope = sum((n - mn) * (t - mt) for n, t in pts) / var
        return mt - slope * mn, slope

    def means(self) -> dict[int, float]:
        """The typical round ms per verified-token count in the window: the median of that width's rounds (one slow
        round, a pause or a queue behind another session, does not price a width out for a whole window)."""
        return {n: m for n, (m, _c) in self._medians().items()}

    def _medians(self) -> dict[int, tuple[float, int]]:
        """Per verified-token count in the window: (median round ms, rounds)."""
        def compute():
            by_width: dict[int, list[float]] = {}
            for n, t in self._times:
                by_width.setdefault(n, []).append(t)
            return {n: (statistics.median(ts), len(ts)) for n, ts in by_width.items()}

        return self._memoized("medians", compute)

    def curve(self) -> tuple[float, float, float] | None:
        """(a, b, p): the least-squares T(n) = a + b * n^p through the window's per-width medians (`means`, each
        weighted by its rounds), p in 0.25..1 (the union of the experts n tokens route grows at most linearly in n,
        and less where tokens share experts), b >= 0. None before there are enough rounds at two widths or more."""
        return self._memoized("curve", self._curve)

    def _curve(self) -> tuple[float, float, float] | None:
        medians = self._medians()
        if len(self._times) < COST_MIN_ROUNDS or len(medians) < 2:
            return None
        pts = [(n, m, c) for n, (m, c) in medians.items()]
        total = sum(c for _n, _m, c in pts)
        mt = sum(c * m for _n, m, c in pts) / total
        best = None
        for p in CURVE_POWERS:  # 16 powers x a few widths, once per window change: plain Python is fast enough
            xs = [n**p for n, _m, _c in pts]  # (numpy stays out of the light client install)
            mx = sum(c * x for x, (_n, _m, c) in zip(xs, pts)) / total
            sxx = sum(c * (x - mx) ** 2 for x, (_n, _m, c) in zip(xs, pts))
            sxt = sum(c * (x - mx) * (m - mt) for x, (_n, m, c) in zip(xs, pts))
            b = max(sxt / sxx, 0.0) if sxx > 0 else 0.0
            a = mt - b * mx
            sse = sum(c * (a + b * x - m) ** 2 for x, (_n, m, c) in zip(xs, pts))
            if best is None or sse < best[0]:  # the first (smallest p) on ties
                best = (sse, a, b, p)
        _sse, a, b, p = best
        return float(a), float(b), float(p)

    def estimator(self):
        """time_of(n) -> ms for a round verifying n tokens: the measured median at n where rounds of that width are in
        the window, else the fitted curve (`curve`), shifted to agree with the nearest measured width. None: no
        curve yet."""
        return self._memoized("estimator", self._estimator)

    def _estimator(self):
        fit = self.curve()
        if fit is None:
            return None
        _a, b, p = fit
        means = self.means()
        widths = sorted(means)

        def time_of(n: int) -> float:
            if n in means:
                return means[n]
            i = bisect.bisect_left(widths, n)
            near = widths[min(i, len(widths) - 1)] if i == 0 or i == len(widths) else min(
                widths[i - 1], widths[i], key=lambda w: abs(w - n))
            return max(means[near] + b * (n**p - near**p), 1e-6)

        return time_of


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
    _priced_rounds: int = 0
    _rounds: int = 0  # rounds observed with their verdicts
    _step_acc: list[float] = dataclasses.field(default_factory=list)  # [i]: draft position i + 1's accepted verdicts
    _step_rej: list[float] = dataclasses.field(default_factory=list)
    _memo: tuple = ()  # (state key, drafts): the round loop asks twice a round (its admission reserve, then the draft)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.growth < 1 or self.floor < 1:
            raise ValueError(f"growth and floor must be >= 1, got {self.growth}, {self.floor}")
        if self.cost is None:
            self.cost = RoundCost()
        self._step_acc = [0.0] * self.max_drafts
        self._step_rej = [0.0] * self.max_drafts

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def drafts(self) -> int:
        """Drafts to propose this round (before the caller's own caps, such as tokens left)."""
        if not self.adaptive:
            return self.max_drafts
        key = (self._rounds, self._next, self.cost.stamp)
        if not self._memo or self._memo[0] != key:
            self._memo = (key, self._drafts())
        return self._memo[1]

    def _drafts(self) -> int:
        grown = self.max_drafts if self._next is None else self._next  # round 1: the whole block
        prices = self._prices()
        if prices is None:
            if self.cost_aware and self.cost.warming():
                # slow start: 0, 1, 2, 3 drafts in the priced rounds before a curve exists, so a first round
                # never streams a full block's union (every token's experts) to learn what a width costs
                return min(grown, WARM_WIDTHS[min(len(self.cost), len(WARM_WIDTHS) - 1)], self.max_drafts)
            return grown
        survival, time_of = prices
        cap = best_drafts(survival, time_of, self.max_drafts)
        if self._priced_rounds % PROBE_EVERY == PROBE_EVERY - 1:
            # a probe: the rates and the round times keep being measured on both sides of the cap; a side priced
            # well below the cap is probed only every PROBE_RARE-th time (it costs a round at a worse width)
            n = self._priced_rounds // PROBE_EVERY
            side = cap + 1 if n % 2 == 0 or cap == 0 else cap - 1
            if side <= self.max_drafts:
                def value(k: int) -> float:
                    return sum(survival[: k + 1]) / max(time_of(k + 1), 1e-9)

                if value(side) >= PROBE_GAP * value(cap) or (n // 2) % PROBE_RARE == PROBE_RARE - 1:
                    cap = side
        return min(grown, cap)

    def observe(self, accepted: int, proposed: int | None = None, round_ms: float | None = None,
                offloaded: bool = False) -> None:
        """The round's accepted drafts (its emitted tokens are accepted + 1); with `proposed` (the drafts it
        verified) the acceptance rates, and with `round_ms` of a round whose verifier streamed offloaded experts
        (`offloaded`) the round times the cost cap uses."""
        self._next = min(self.max_drafts, max(self.floor, self.growth * (accepted + 1)))
        if proposed is None:
            return
        self.cost.record(accepted, proposed)
        add_verdicts(self._step_acc, self._step_rej, accepted, min(accepted + 1, proposed, self.max_drafts), STEP_DECAY)
        self._rounds += 1
        # a session's first round is not priced: it follows the prefill, which streamed most experts through the
        # cache (and evicted what the decode keeps using), so it costs more than its width does
        if self.cost_aware and offloaded and round_ms is not None and round_ms > 0 and self._rounds > 1:
            self.cost.add(proposed + 1, round_ms)
            self._priced_rounds += 1

    def survival(self) -> list[float]:
        """[S(0) = 1, S(1), ..., S(max_drafts)]: the chance that drafts 1..i are all accepted, position by position:
        this session's verdicts at each position, shrunk by SHRINK pseudo-verdicts toward its drafter kind's rate
        there (`RoundCost.position_rates`: a new session starts from what the kind's recent rounds earned)."""
        out, s = [1.0], 1.0
        for a, r, q in zip(self._step_acc, self._step_rej, self.cost.position_rates(self.max_drafts)):
            s *= min((a + SHRINK * q) / (a + r + SHRINK), 0.99)
            out.append(s)
        return out

    def time_line(self) -> tuple[float, float] | None:
        """The shared round-time line (RoundCost.line)."""
        return self.cost.line()

    def _prices(self):
        """(survival, time_of) where rounds are priced (the cost cap applies), else None."""
        if not self.cost_aware:
            return None
        line = self.time_line()
        if line is None or line[1] <= 0:
            return None
        a, b = line
        if a + b * (self.max_drafts + 1) < MATERIAL * (a + b):
            return None  # the whole block costs little more than one token: width is (nearly) free
        return self.survival(), self.cost.estimator()

    def cost_cap(self) -> int | None:
        """The width that maximizes expected tokens per ms of round (None: no priced line yet, or a flat one)."""
        prices = self._prices()
        return None if prices is None else best_drafts(*prices, self.max_drafts)

    def bound_after(self, proposed: int) -> int:
        """The most drafts the round after one proposing `proposed` can ask for (it cannot accept more)."""
        if not self.adaptive:
            return self.max_drafts
        return min(self.max_drafts, max(self.floor, self.growth * (proposed + 1)))
