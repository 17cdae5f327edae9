"""The expert cache: a fixed pool of slots on the device, each holding one expert's MXFP4 slice, filled from the
host store (verifier_svc/expert_store.py) and read by the grouped MoE kernel through a per-layer slot table.

- allocated once (`slots x slice bytes`), no allocator calls afterwards;
- `lookup(layer, experts)` makes every listed expert resident and pins it until `release()` (the end of the
  layer's kernel, see below), counting hits and misses; a miss evicts an unpinned slot chosen by the eviction
  policy (`eviction`, below);
- `prefetch(union)` brings experts in ahead of need without pinning. `begin(projection)` (a verify arrives with
  its projected union) prefetches the projection of the first layers that fit in half the cache, and
  `advance(layer)` (each layer's experts call) tops it up one layer further, so a projection larger than the
  cache streams in a window ahead of the forward instead of evicting itself; with `layer_ahead` the experts call
  also prefetches what the next layer's router picks for this layer's input. A prefetch only takes free slots and
  slots nobody is waiting for: it never evicts a pinned slot or a prefetched one not yet used; `wasted_bytes`
  counts prefetched slices evicted before any forward used them. `arriving(projection)` is called by the servicer
  the moment a Verify arrives, from its own thread, while the verify before it may still run: it streams the first
  window of the new projection at once (every method holds the cache's lock; a forward's pinned slots stay put);
- on CUDA the copies run on two side streams, one for a forward's misses and one for prefetches, so a miss never
  queues behind a long prefetch. Each slot remembers the event after its copy (the compute stream waits for the
  newest copy per stream that a layer needs, not for the whole queue) and the event after the last kernel that
  read it (a copy into an evicted slot waits for that one only). `copy_ms()` sums the copies' GPU time.

Eviction (`eviction`, measured in benchmarks/cache_policy.py):
- `lru`: the least recently used slot.
- `cyclic`: a forward visits the MoE layers in order, so the experts of the layer that just ran are needed again
  only in the next forward, and LRU evicts exactly the ones needed soonest (those of the layers ahead, used one
  forward ago) once the cache is smaller than what a forward routes. A slot is *expected* while its expert was
  routed at its layer's latest lookup, or prefetched since; a layer's lookup turns its expected slots that it did
  not route into *cold* ones. A miss evicts a cold slot first (the earliest turned cold), else an expected slot of
  the layer whose next lookup is furthest away in the layer cycle (the layer just looked up first, then the ones
  before it). Victim choice is O(1) amortised plus, once nothing is cold, a walk over the layers (not the slots).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch

from verifier_svc.expert_store import HostExpertStore


@dataclasses.dataclass
class CacheStats:
    lookups: int = 0  # experts asked for by forwards
    hits: int = 0  # already resident (or on their way from a prefetch) when asked for
    misses: int = 0  # fetched on demand
    evictions: int = 0
    prefetched: int = 0  # slices copied ahead of need
    prefetch_used: int = 0  # of those, asked for by a forward before eviction
    bytes_moved: int = 0  # host -> device, demand and prefetch
    wasted_bytes: int = 0  # prefetched, evicted unused (device cache: and the part an aborted guess copied)
    prefetch_aborted: int = 0  # device cache: guesses the next layer did not route to, their copies stopped (of prefetched)

    # (field by field: dataclasses.astuple deep-copies, ~20 us a call, several calls a verify)
    def minus(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(*(getattr(self, n) - getattr(other, n) for n in _STAT_FIELDS))

    def plus(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(*(getattr(self, n) + getattr(other, n) for n in _STAT_FIELDS))

    @property
    def coverage(self) -> float | None:
        """Of the experts a forward needed that earlier forwards had not left resident, the share a prefetch
        brought (or had on its way) in time."""
        new = self.prefetch_used + self.misses
        return self.prefetch_used / new if new else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(CacheStats))

EVICTIONS = ("lru", "cyclic")


def min_slots(store: HostExpertStore) -> int:
    """Slots one layer of one forward can need at once: every expert of the largest layer (a prompt may route to
    all of them)."""
    return max(store.num_experts.values())


def check_slots(store: HostExpertStore, num_slots: int, need: int) -> None:
    """Refuse, at load, a cache too small for one layer's routed experts (a prompt may route to all of them)."""
    if num_slots < need:
        raise ValueError(
            f"the expert cache holds {num_slots} experts ({num_slots * store.slice_bytes / 2**30:.4f} GiB), fewer than one "
            f"layer's routed experts may need at once: at least {need} slots = {need * store.slice_bytes / 2**30:.4f} GiB "
            f"({need * store.slice_bytes} bytes)"
        )


class ExpertCache:
    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device, need: int,
                 prefetch: str = "union,layer", time_copies: bool = False, eviction: str = "lru", arrival_share: float = 0.5):
        check_slots(store, num_slots, need)
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction {eviction!r}: one of {', '.join(EVICTIONS)}")
        self.store, self.device, self.eviction = store, torch.device(device), eviction
        kinds = {p.strip() for p in prefetch.split(",")}
        self.prefetch_union = "union" in kinds  # read by the verifier core when a verify arrives
        self.layer_ahead = "layer" in kinds  # read by the experts forward (pdflash_kernels.installer): predict layer l+1 at layer l
        self.guess_width = 0  # that prediction: the next router's top `guess_width` experts (0: auto, pdflash_kernels.installer.guess_k)
        self.pool = torch.zeros(num_slots, store.slice_bytes, dtype=torch.uint8, device=self.device)
        self.weights = store.weights(self.pool)
        self._host_tables = {layer: torch.full((n,), -1, dtype=torch.int32) for layer, n in store.num_experts.items()}
        self.tables = {layer: t.to(self.device) for layer, t in self._host_tables.items()}
        self._owner: list[tuple[int, int] | None] = [None] * num_slots
        self._slot: dict[tuple[int, int], int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # slot -> None, least recent first
        self._cyclic = eviction == "cyclic"
        # cyclic: cold slots (eviction order), each layer's expected slots, the layer order and the last layer looked up
        self._cold: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._expected: dict[int, dict[int, None]] = {layer: {} for layer in store.num_experts}
        self._layers = sorted(store.num_experts)
        self._index = {layer: i for i, layer in enumerate(self._layers)}
        self._cursor = 0
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._unused_prefetch: set[int] = set()
        self.stats = CacheStats()
        self._cuda = self.device.type == "cuda"
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if self._cuda else ()  # misses, prefetches
        # per slot: (stream index, copy number on that stream, event after the copy)
        self._copied: list[tuple[int, int, torch.cuda.Event] | None] = [None] * num_slots
        self._used: list[torch.cuda.Event | None] = [None] * num_slots  # event after the last kernel that read it
        self._copies = [0, 0]
        self._projection: dict[int, frozenset[int]] = {}
        self._window = 0
        self.time_copies = time_copies and self._cuda
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.RLock()  # the forward's thread and the servicer's (arriving) share the cache
        self.arrival_share = arrival_share  # an arrival's window: the projected layers that fit in this share of the slots

    @property
    def num_slots(self) -> int:
        return len(self._owner)

    @property
    def kept_bytes(self) -> int:
        """The bytes of experts this cache can keep resident (its slots, at most the store's total)."""
        return min(self.num_slots * self.store.slice_bytes, self.store.total_bytes)

    @classmethod
    def slots_for(cls, store: HostExpertStore, gib: float) -> int:
        """Slots a budget of `gib` GiB holds, never more than there are experts."""
        return min(int(gib * 2**30 // store.slice_bytes), sum(store.num_experts.values()))

    def resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._slot

    def _victim(self, prefetch: bool) -> int | None:
        """The slot a fetch may take (never a pinned one; a prefetch spares unused prefetched slots too)."""
        if self._cyclic:
            return self._cyclic_victim(prefetch)
        for slot in self._lru:  # least recently used first
            if slot not in self._pinned and not (prefetch and slot in self._unused_prefetch):
                return slot
        return None

    def _cyclic_victim(self, prefetch: bool) -> int | None:
        for slot in self._cold:  # earliest turned cold first
            if slot not in self._pinned and not (prefetch and slot in self._unused_prefetch):
                return slot
        n = len(self._layers)
        for i in range(n):  # the layer just looked up is needed again last, then the ones before it
            for slot in self._expected[self._layers[(self._cursor - i) % n]]:
                if slot not in self._pinned and not (prefetch and slot in self._unused_prefetch):
                    return slot
        return None

    def _routed(self, layer: int, experts: list[int]) -> None:
        """cyclic: `layer` routes `experts`: its other expected slots turn cold, its resident routed ones expected."""
        expected = self._expected[layer]
        routed = set(experts)
        for slot in [s for s in expected if self._owner[s][1] not in routed]:
            del expected[slot]
            self._cold[slot] = None
        for e in experts:
            slot = self._slot.get((layer, e))
            if slot is not None and slot not in expected:
                self._cold.pop(slot, None)
                expected[slot] = None
        self._cursor = self._index[layer]

    def _take_slot(self, prefetch: bool = False) -> int | None:
        if self._free:
            return self._free.pop()
        slot = self._victim(prefetch)
        if slot is None:
            if prefetch:
                return None
            raise RuntimeError("every expert slot is pinned: the cache is smaller than one layer's routed experts")
        key = self._owner[slot]
        del self._slot[key]
        self._host_tables[key[0]][key[1]] = -1
        if self._cyclic:
            if slot in self._cold:
                del self._cold[slot]
            else:
                del self._expected[key[0]][slot]
        else:
            self._lru.pop(slot)
        self.stats.evictions += 1
        if slot in self._unused_prefetch:
            self._unused_prefetch.discard(slot)
            self.stats.wasted_bytes += self.store.slice_bytes
        return slot

    def _fetch(self, layer: int, expert: int, prefetch: bool = False) -> int | None:
        slot = self._take_slot(prefetch)
        if slot is None:
            return None
        src = self.store.slice(layer, expert)
        if self._cuda:
            which = 1 if prefetch else 0
            stream = self._streams[which]
            used = self._used[slot]
            if used is not None:  # a kernel already queued may still read what this slot held
                stream.wait_event(used)
                self._used[slot] = None
            before = self._copied[slot]
            if before is not None and before[0] != which:  # an earlier copy into this slot may still be running
                stream.wait_event(before[2])
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True) if self.time_copies else None
                if start is not None:
                    start.record()
                self.pool[slot].copy_(src, non_blocking=True)
                done = torch.cuda.Event(enable_timing=self.time_copies)
                done.record()
            if start is not None:
                self._timed.append((start, done))
            self._copies[which] += 1
            self._copied[slot] = (which, self._copies[which], done)
        else:
            self.pool[slot].copy_(src)
        self._owner[slot] = (layer, expert)
        self._slot[(layer, expert)] = slot
        self._host_tables[layer][expert] = slot
        if self._cyclic:
            self._expected[layer][slot] = None  # a miss is routed now, a prefetch is expected at its layer
        else:
            self._lru[slot] = None
        self.stats.bytes_moved += self.store.slice_bytes
        return slot

    def _lookup_unlocked(self, layer: int, experts) -> torch.Tensor:
        """Make `experts` of `layer` resident and pinned; returns the layer's slot table (device int32 [E]), valid on
        the current stream once the copies the layer needs are done (the stream waits for them)."""
        experts = sorted(set(int(e) for e in experts))
        self.weights = self.store.refresh(self.weights, self.pool)  # the store may have been filled after this cache was made
        if self._cyclic:
            self._routed(layer, experts)
        for e in experts:  # pin the resident ones first: a miss below must not evict them
            slot = self._slot.get((layer, e))
            if slot is not None:
                self._pinned.add(slot)
        newest: dict[int, tuple] = {}  # stream -> its newest copy this layer needs
        for e in experts:
            self.stats.lookups += 1
            slot = self._slot.get((layer, e))
            if slot is not None:
                self.stats.hits += 1
                if not self._cyclic:
                    self._lru.move_to_end(slot)
                if slot in self._unused_prefetch:
                    self._unused_prefetch.discard(slot)
                    self.stats.prefetch_used += 1
            else:
                self.stats.misses += 1
                slot = self._fetch(layer, e)
            self._pinned.add(slot)
            c = self._copied[slot] if self._cuda else None
            if c is not None and (c[0] not in newest or c[1] > newest[c[0]][1]):
                newest[c[0]] = c
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            for c in newest.values():  # a stream's copies run in order: its newest one needed covers the others
                compute.wait_event(c[2])
            self.tables[layer].copy_(self._host_tables[layer], non_blocking=True)  # pageable source: staged at once
        else:
            self.tables[layer].copy_(self._host_tables[layer])
        return self.tables[layer]

    def _release_unlocked(self) -> None:
        """Unpin everything; on CUDA the pinned slots remember the point of the compute stream after the kernels
        queued so far (a later copy into one of them waits for it)."""
        if self._cuda and self._pinned:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for slot in self._pinned:
                self._used[slot] = ev
        self._pinned.clear()

    def _prefetch_unlocked(self, union: dict[int, frozenset[int] | set[int]]) -> int:
        """Bring a projected union in, layer by layer in order, best effort (free slots and least recently used
        ones nobody waits for). Returns the slices copied."""
        moved = 0
        for layer in sorted(union):
            if layer not in self._host_tables:
                continue
            for e in sorted(union[layer]):
                if (layer, e) in self._slot:
                    continue
                slot = self._fetch(layer, e, prefetch=True)
                if slot is None:
                    return moved
                self._unused_prefetch.add(slot)
                self.stats.prefetched += 1
                moved += 1
        return moved

    def _begin_unlocked(self, projection: dict[int, frozenset[int] | set[int]]) -> int:
        """A verify arrives with its projected union: prefetch the layers that fit in half the cache (the window),
        remember the rest for `advance`. Returns the slices copied."""
        self._projection = {l: frozenset(e) for l, e in projection.items() if l in self._host_tables and e}
        if not self._projection:
            self._window = 0
            return 0
        self._window = self._window_of(self._projection)
        layers = sorted(self._projection)
        return self._prefetch_unlocked({l: self._projection[l] for l in layers[: self._window]})

    def _advance_unlocked(self, layer: int) -> int:
        """Layer `layer`'s experts are running: prefetch the projection `window` layers further on."""
        if not self._projection:
            return 0
        ahead = layer + self._window
        return self._prefetch_unlocked({ahead: self._projection[ahead]}) if ahead in self._projection else 0

    def _window_of(self, projection: dict, share: float = 0.5) -> int:
        per_layer = max(1.0, sum(len(e) for e in projection.values()) / max(1, len(projection)))
        return max(1, int(self.num_slots * share / per_layer))

    # the public methods: one at a time across threads
    def lookup(self, layer: int, experts) -> torch.Tensor:
        with self._lock:
            return self._lookup_unlocked(layer, experts)

    def release(self) -> None:
        with self._lock:
            self._release_unlocked()

    def prefetch(self, union) -> int:
        with self._lock:
            return self._prefetch_unlocked(union)

    def begin(self, projection) -> int:
        with self._lock:
            return self._begin_unlocked(projection)

    def advance(self, layer: int) -> int:
        with self._lock:
            return self._advance_unlocked(layer)

    def arriving(self, projection: dict[int, frozenset[int] | set[int]]) -> int:
        """A verify has arrived (the one before it may still be running), or the scheduler hinted an admitted demand
        (the Prefetch RPC): prefetch the first window of its projected union now (the layers that fit in
        `arrival_share` of the slots; 0 = none). Experts outside the model's range are ignored (the verify itself
        validates them). Returns the slices copied."""
        with self._lock:
            if self.arrival_share <= 0:
                return 0
            valid = {l: frozenset(int(e) for e in es if 0 <= int(e) < self.store.num_experts[l])
                     for l, es in projection.items() if l in self._host_tables}
            valid = {l: es for l, es in valid.items() if es}
            if not valid:
                return 0
            layers = sorted(valid)[: self._window_of(valid, self.arrival_share)]
            return self._prefetch_unlocked({l: valid[l] for l in layers})

    def reset_stats(self) -> None:
        """Zero the counters and forget which slices were prefetched and not yet used, and the last projection; what is
        resident stays resident. After the warm-up (verifier_svc.warmup) the first request's counters are its own: a
        slice the warm-up brought in is an ordinary resident one, neither a prefetch hit nor waste when evicted."""
        with self._lock:
            self.stats = CacheStats()
            self._unused_prefetch.clear()
            self._projection, self._window = {}, 0
            self._timed.clear()

    def copy_ms(self) -> float:
        """GPU time of the copies issued since the last call (time_copies=True; waits for them)."""
        total = 0.0
        for start, done in self._timed:
            done.synchronize()
            total += start.elapsed_time(done)
        self._timed.clear()
        return total


MODES = ("device", "host")


def new_cache(store: HostExpertStore, gib: float, device, prefetch: str = "union,layer", mode: str = "device",
              time_copies: bool = False, slots: int | None = None, eviction: str = "lru"):
    """The expert cache of a `gib` GiB budget (or exactly `slots` slots). mode "device": every decision on the device
    (verifier_svc.device_cache; the forward is one CUDA graph); "host": decided on the host, one sync per layer
    (ExpertCache above)."""
    if mode not in MODES:
        raise ValueError(f"--expert-cache-mode {mode!r}: choose device or host")
    if mode == "device":
        from verifier_svc.device_cache import DeviceExpertCache

        if eviction != "lru":
            raise ValueError(f"eviction {eviction!r} is a policy of the host-managed cache (the device-managed one evicts "
                             "LRU within each layer's slots): use --expert-cache-mode host")
        n = DeviceExpertCache.slots_for(store, gib) if slots is None else slots
        return DeviceExpertCache(store, n, device, need=min_slots(store), prefetch=prefetch, time_copies=time_copies)
    n = ExpertCache.slots_for(store, gib) if slots is None else slots
    return ExpertCache(store, n, device, need=min_slots(store), prefetch=prefetch, time_copies=time_copies, eviction=eviction)
