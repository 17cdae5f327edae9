"""Whether the next-layer router guess pays for its copies: measured, per cache, while it serves.

The `layer` prefetch applies layer l + 1's router to layer l's input and streams the experts it picks while layer l
computes. A right guess hides a copy under compute; a wrong one moves a whole expert slice over PCIe for nothing and
may evict a resident expert that was needed. Which wins depends on the model: on the H200 with random weights
(gpt-oss-20b shapes, benchmarks/results/offload_h200.md) about half the guesses were used and every prefetching row
was slower than no prefetch (10% cache: 32.1 vs 34.5 tok/s at block 1; 25%: 36.5 vs 41.9); trained routers are
reported to be far more predictable from the previous layer's input. So the cache measures the guess instead of
assuming it: each forward with the guess on reports how many experts it prefetched and how many of those its forward
then used; a decayed precision (used / prefetched) below `MIN_PRECISION` turns the guess off, and every `PROBE_EVERY`-th
forward it runs again to re-measure (so a model whose routing becomes predictable gets it back).

Pure policy: no tensors. `DeviceExpertCache` applies the decision through a device flag that its captured forwards
read (the guess's rows are masked to none), so no graph is captured anew when it flips.
"""

from __future__ import annotations

import dataclasses

MIN_PRECISION = 0.75  # used / prefetched below this: the guess's wasted copies cost more than its hidden ones save
MIN_PREFETCHES = 64  # decayed prefetches before the first decision
PROBE_EVERY = 16  # forwards: while off, one forward in this many runs the guess to re-measure
DECAY = 0.9  # per measured forward


@dataclasses.dataclass
class GuessGate:
    min_precision: float = MIN_PRECISION
    min_prefetches: float = MIN_PREFETCHES
    probe_every: int = PROBE_EVERY
    decay: float = DECAY
    prefetched: float = 0.0  # decayed counts over the forwards that ran the guess
    used: float = 0.0
    on: bool = True  # the decision for the next forward
    losing: bool = False  # the measured precision is below the bar (the guess runs only as a probe)
    _since_probe: int = 0

    @property
    def precision(self) -> float | None:
        return self.used / self.prefetched if self.prefetched > 0 else None

    def observe(self, guessed: bool, prefetched: int, used: int) -> bool:
        """After a forward: `guessed` whether it ran the guess, with its prefetch counts. Returns whether the next
        forward runs it."""
        if guessed and prefetched > 0:
            self.prefetched = self.prefetched * self.decay + prefetched
            self.used = self.used * self.decay + min(used, prefetched)
        p = self.precision
        self.losing = p is not None and self.prefetched >= self.min_prefetches and p < self.min_precision
        if self.losing:
            self._since_probe += 1
            self.on = self._since_probe % self.probe_every == 0  # a probe now and then
        else:
            self._since_probe = 0
            self.on = True
        return self.on

    def reset(self) -> None:
        """Forget the measurements (after a warm-up's dummy requests)."""
        self.prefetched = self.used = 0.0
        self.on, self.losing, self._since_probe = True, False, 0
