"""The expert cache: a fixed pool of slots on the device, each holding one expert's MXFP4 slice, filled from the
host store (verifier_svc/expert_store.py) and read by the grouped MoE kernel through a per-layer slot table.

- allocated once (`slots x slice bytes`), no allocator calls afterwards;
- `lookup(layer, experts)` makes every listed expert resident and pins it until `release()` (the end of the
  layer's kernel, see below), counting hits and misses; a miss evicts the least recently used unpinned slot;
- `prefetch(union)` brings experts in ahead of need (the projected union of an admitted verify) without pinning;
  `wasted_bytes` counts prefetched slices evicted before any forward used them;
- on CUDA the copies run on a side stream; a copy into an evicted slot first waits for everything already queued
  on the compute stream (the kernels that might still read the slot), and the compute stream waits for the copies
  before the layer's kernel runs.
"""

from __future__ import annotations

import collections
import dataclasses

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
    wasted_bytes: int = 0  # prefetched, evicted unused


def min_slots(store: HostExpertStore) -> int:
    """Slots one layer of one forward can need at once: every expert of the largest layer (a prompt may route to
    all of them)."""
    return max(store.num_experts.values())


class ExpertCache:
    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device, need: int):
        if num_slots < need:
            raise ValueError(
                f"the expert cache holds {num_slots} experts ({num_slots * store.slice_bytes / 2**30:.4f} GiB), fewer than one "
                f"layer's routed experts may need at once: at least {need} slots = {need * store.slice_bytes / 2**30:.4f} GiB "
                f"({need * store.slice_bytes} bytes)"
            )
        self.store, self.device = store, torch.device(device)
        self.pool = torch.zeros(num_slots, store.slice_bytes, dtype=torch.uint8, device=self.device)
        self.weights = store.weights(self.pool)
        self._host_tables = {layer: torch.full((n,), -1, dtype=torch.int32) for layer, n in store.num_experts.items()}
        self.tables = {layer: t.to(self.device) for layer, t in self._host_tables.items()}
        self._owner: list[tuple[int, int] | None] = [None] * num_slots
        self._slot: dict[tuple[int, int], int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # slot -> None, least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._unused_prefetch: set[int] = set()
        self.stats = CacheStats()
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None

    @property
    def num_slots(self) -> int:
        return len(self._owner)

    @classmethod
    def slots_for(cls, store: HostExpertStore, gib: float) -> int:
        """Slots a budget of `gib` GiB holds, never more than there are experts."""
        return min(int(gib * 2**30 // store.slice_bytes), sum(store.num_experts.values()))

    def resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._slot

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for slot in self._lru:  # least recently used first
            if slot not in self._pinned:
                break
        else:
            raise RuntimeError("every expert slot is pinned: the cache is smaller than one layer's routed experts")
        key = self._owner[slot]
        del self._slot[key]
        self._host_tables[key[0]][key[1]] = -1
        self._lru.pop(slot)
        self.stats.evictions += 1
        if slot in self._unused_prefetch:
            self._unused_prefetch.discard(slot)
            self.stats.wasted_bytes += self.store.slice_bytes
        return slot

    def _fetch(self, layer: int, expert: int, evicting: bool) -> int:
        slot = self._take_slot()
        src = self.store.slice(layer, expert)
        if self._cuda:
            if evicting:  # a kernel already queued may still read the evicted expert's slot
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self.pool[slot].copy_(src, non_blocking=True)
        else:
            self.pool[slot].copy_(src)
        self._owner[slot] = (layer, expert)
        self._slot[(layer, expert)] = slot
        self._host_tables[layer][expert] = slot
        self._lru[slot] = None
        self.stats.bytes_moved += self.store.slice_bytes
        return slot

    def _sync_table(self, layer: int) -> None:
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self.tables[layer].copy_(self._host_tables[layer], non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        else:
            self.tables[layer].copy_(self._host_tables[layer])

    def lookup(self, layer: int, experts) -> torch.Tensor:
        """Make `experts` of `layer` resident and pinned; returns the layer's slot table (device int32 [E])."""
        experts = sorted(set(int(e) for e in experts))
        for e in experts:  # pin the resident ones first: a miss below must not evict them
            slot = self._slot.get((layer, e))
            if slot is not None:
                self._pinned.add(slot)
        for e in experts:
            self.stats.lookups += 1
            slot = self._slot.get((layer, e))
            if slot is not None:
                self.stats.hits += 1
                self._lru.move_to_end(slot)
                if slot in self._unused_prefetch:
                    self._unused_prefetch.discard(slot)
                    self.stats.prefetch_used += 1
            else:
                self.stats.misses += 1
                slot = self._fetch(layer, e, evicting=not self._free)
            self._pinned.add(slot)
        self._sync_table(layer)
        return self.tables[layer]

    def release(self) -> None:
        """Unpin everything (the kernels that read the pinned slots are queued; later copies wait for them)."""
        self._pinned.clear()

    def prefetch(self, union: dict[int, frozenset[int] | set[int]]) -> int:
        """Bring a projected union in, best effort (never evicting a pinned slot). Returns the slices copied."""
        moved = 0
        for layer, experts in union.items():
            if layer not in self._host_tables:
                continue
            changed = False
            for e in sorted(experts):
                if (layer, e) in self._slot:
                    continue
                if not self._free and all(s in self._pinned for s in self._lru):
                    return moved
                slot = self._fetch(layer, e, evicting=not self._free)
                self._unused_prefetch.add(slot)
                self._lru.move_to_end(slot)
                self.stats.prefetched += 1
                moved += 1
                changed = True
            if changed:
                self._sync_table(layer)
        return moved
