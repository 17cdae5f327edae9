"""Whether the next-layer router guess pays for its copies: measured, per cache, while it serves.

The `layer` prefetch applies layer l + 1's router to layer l's input and streams the experts it picks while layer l
computes. A right guess hides a copy under compute; a wrong one moves a whole expert slice over PCIe for nothing and
may evict a resident expert that was needed. Which wins depends on the model and the cache size: on the H200 with
random weights (gpt-oss-20b shapes, benchmarks/results/offload_prefetch_h200.md) about half the guesses were used and every
prefetching row was slower than no prefetch (10% cache: 32.1 vs 34.5 tok/s at block 1; 25%: 36.5 vs 41.9, where the
guesses were mostly right but their slots evicted experts that were needed); trained routers are reported to be far
more predictable from the previous layer's input. So the cache measures instead of assuming: two arms, guess on and
guess off, each a decayed mean of its forwards' milliseconds per token; the cheaper arm (by `MARGIN`) serves, and
every `PROBE_EVERY`-th forward runs the other one to keep its mean current. Prefills (eager, hundreds of rows) are not
judged. The precision of the guess (used / prefetched) is kept for reporting.

Pure policy: no tensors. `DeviceExpertCache` applies the decision through a device flag that its captured forwards
read (the guess's rows are masked to none), so no graph is captured anew when it flips.
"""

from __future__ import annotations

import dataclasses

MARGIN = 0.05  # the other arm must be this much cheaper to take over
PROBE_EVERY = 6  # forwards: one in this many runs the arm not serving
MIN_SAMPLES = 2  # forwards an arm needs before it can be preferred
DECAY = 0.8  # per sample, of an arm's mean


@dataclasses.dataclass
class GuessGate:
    margin: float = MARGIN
    probe_every: int = PROBE_EVERY
    min_samples: int = MIN_SAMPLES
    decay: float = DECAY
    on: bool = True  # the decision for the next forward
    prefer_on: bool = True  # the arm serving (the other runs as a probe)
    prefetched: float = 0.0  # decayed prefetch counts of the forwards that ran the guess (precision, for reporting)
    used: float = 0.0
    _arms: dict = dataclasses.field(default_factory=lambda: {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]})  # sum, weight, n
    _since_probe: int = 0

    @property
    def precision(self) -> float | None:
        return self.used / self.prefetched if self.prefetched > 0 else None

    def mean_ms(self, on: bool) -> float | None:
        s, w, _ = self._arms[on]
        return s / w if w > 0 else None

    @property
    def losing(self) -> bool:
        """The guess is not the serving arm (it runs only as a probe)."""
        return not self.prefer_on

    def observe(self, guessed: bool, ms_per_token: float | None = None, prefetched: int = 0, used: int = 0) -> bool:
        """After a forward: `guessed` whether it ran the guess, its time per token (None: not judged, e.g. a prefill)
        and its prefetch counts. Returns whether the next forward runs the guess."""
        if guessed and prefetched > 0:
            self.prefetched = self.prefetched * 0.9 + prefetched
            self.used = self.used * 0.9 + min(used, prefetched)
        if ms_per_token is None:
            return self.on
        arm = self._arms[guessed]
        arm[0] = arm[0] * self.decay + ms_per_token
        arm[1] = arm[1] * self.decay + 1.0
        arm[2] += 1
        m_on, m_off = self.mean_ms(True), self.mean_ms(False)
        if self._arms[True][2] >= self.min_samples and self._arms[False][2] >= self.min_samples:
            if self.prefer_on and m_off < m_on * (1 - self.margin):
                self.prefer_on = False
            elif not self.prefer_on and m_on < m_off * (1 - self.margin):
                self.prefer_on = True
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self.on = not self.prefer_on
        else:
            self.on = self.prefer_on
        return self.on

    def reset(self) -> None:
        """Forget the measurements (after a warm-up's dummy requests)."""
        fresh = GuessGate(self.margin, self.probe_every, self.min_samples, self.decay)
        self.__dict__.update(fresh.__dict__)


LAYER_MIN_PRECISION = 0.5  # a layer whose guesses are used less often than this stops guessing (a wrong guess costs a
# slice's PCIe time and may evict a needed expert; a right one hides at most one copy)
LAYER_MIN_PREFETCHED = 8.0  # decayed prefetches a layer needs before it can be switched off
LAYER_PROBE_EVERY = 16  # guessing forwards: one in this many guesses on every layer, re-measuring the layers that are off
LAYER_DECAY = 0.9  # per guessing forward, of a layer's counts


@dataclasses.dataclass
class LayerGate:
    """Which layers' guesses to keep, by their own precision (used / prefetched): the next layer's router predicts it
    much better deep in a model than near its start, where consecutive layers' inputs differ most (random Qwen3-30B-A3B
    shapes with outputs x0.1, CPU: the router's top 2 among the layer's true top 8 for 0.36-0.51 of the rows at layers
    1-2, 0.81-0.98 from layer 3 on; benchmarks/results/guess_layers_qwen3-48l_cpu.json). One cache-wide arm (`GuessGate`) judges
    the guess by time; this keeps its copies to the layers whose guesses are used. Pure policy: per-layer counts in,
    per-layer flags out (`on[j]`: guess layer j's experts while layer j - 1 computes)."""

    layers: int
    min_precision: float = LAYER_MIN_PRECISION
    min_prefetched: float = LAYER_MIN_PREFETCHED
    probe_every: int = LAYER_PROBE_EVERY
    decay: float = LAYER_DECAY
    prefetched: list = dataclasses.field(default_factory=list)
    used: list = dataclasses.field(default_factory=list)
    on: list = dataclasses.field(default_factory=list)
    _since_probe: int = 0

    def __post_init__(self):
        self.prefetched = self.prefetched or [0.0] * self.layers
        self.used = self.used or [0.0] * self.layers
        self.on = self.on or [True] * self.layers

    def precision(self, j: int) -> float | None:
        return self.used[j] / self.prefetched[j] if self.prefetched[j] > 0 else None

    def observe(self, prefetched, used) -> list[bool]:
        """After a forward that ran the guess: each layer's prefetches and hits on prefetched slots. Returns the flags
        for the next guessing forward: every layer on for a probe, else the layers without enough prefetches to judge
        and those at or above `min_precision`."""
        if len(prefetched) != self.layers or len(used) != self.layers:
            raise ValueError(f"LayerGate: {self.layers} layers, got {len(prefetched)} / {len(used)} counts")
        for j in range(self.layers):
            self.prefetched[j] = self.prefetched[j] * self.decay + int(prefetched[j])
            self.used[j] = self.used[j] * self.decay + min(int(used[j]), int(prefetched[j]))
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self.on = [True] * self.layers
        else:
            self.on = [self.prefetched[j] < self.min_prefetched or self.used[j] >= self.min_precision * self.prefetched[j]
                       for j in range(self.layers)]
        return list(self.on)

    def reset(self) -> None:
        fresh = LayerGate(self.layers, self.min_precision, self.min_prefetched, self.probe_every, self.decay)
        self.__dict__.update(fresh.__dict__)
