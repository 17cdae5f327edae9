"""The expert cache that decides on the device: offloaded experts inside one CUDA graph per verify forward.

`verifier_svc.expert_cache.ExpertCache` decides on the host: each layer's forward stops once to read its routing back
(one sync a layer, the forward cut into one graph per layer). This cache keeps its whole state in device tensors and
makes every decision with `pdflash_kernels.offload` (an admission kernel and a fill kernel that reads the pinned host store
over PCIe), so the forward of an offloaded model needs no host step at all: it is captured whole, like a resident one.

Layout: the slot pool is one partition of slots per MoE layer (sizes as even as the budget allows, never more than the
layer's experts) plus an overflow range of E slots (E = the largest layer's experts) for routed experts beyond a
partition's evictable slots (copied, used, not kept). Policy per layer: free slots first, then least recently used
(by forward count), never a slot whose expert the same call needs.

Per experts call (layer l, all on the device):
1. admit + fill layer l's routed experts (its real rows only);
2. fork to a side stream: the experts layer l + 1's router picks for this layer's input (`layer` prefetch), or where
   there is no such guess the verify's projected union for layer l + 1 (`union` prefetch), are admitted and filled
   there, while layer l's experts and layer l + 1's attention compute; layer l + 1 joins it before its own admission.
   The guess runs while it pays: `verifier_svc.guess_gate` compares forwards with and without it (ms per token) and
   sets `guess_on`, device flags the captured forwards read (off: the guess's rows count as none), one per layer: the
   cache-wide decision and (unless PDFLASH_EXPERT_GUESS_LAYERS=0) the layer's own precision
   (`guess_gate.LayerGate`: a layer whose guesses go unused stops). With `guess_abort` (PDFLASH_EXPERT_GUESS_ABORT) the
   guess's copies are abortable: layer l + 1's demand admission stops the copies of guessed experts it did not route
   to and frees their slots (`pdflash_kernels.offload`, "Abortable guesses"), so a wrong guess costs only link time
   that was idle while layer l finished and layer l + 1's attention and router ran;
3. the grouped kernel over the pool through layer l's slot table.
Each call ORs what happened to each expert into `codes` (zeroed when a forward starts); the host decodes them after
the forward (`collect`, called by the verifier core) into the same counters as the host-side cache (`CacheStats`).

Arrivals (`arriving`, from the servicer's thread: a Verify has arrived, or the scheduler hinted an admitted demand with
the `Prefetch` RPC): the projected union's first layers are admitted and filled as prefetches (the same
`pdflash_kernels.offload` admission and fill, on the CPU their references) on the cache's copy stream, before the forward that
needs them starts. The state the forward's kernels read and write is not split between forwards and arrivals, so an
arrival never runs while a forward is between `begin()` and `collect()` (the verifier core's brackets around every
forward): then it is kept and issued by `collect()` on the forward's thread, right after that forward (on CUDA: ordered
after it, and the next forward's `begin()` makes the compute stream wait for the copy stream). So an arrival never
touches a slot a running forward uses. Bounded: at most `arrival_share` of each layer's slots and of all partition slots
(the window: the first projected layers that fit), only slots nobody is waiting for (never one prefetched and not used
yet), and at most the projected experts not resident. Its codes collect in their own rows (`arr_codes`) and join the
counters at the next `collect()` as prefetches (bytes moved, evictions, waste; a forward's hit on one counts as
`prefetch_used`). One lock (`_lock`) orders arrivals against `begin`, `collect` and `reset_stats`.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from pdflash_kernels import offload as ko
from pdflash_kernels import runtime
from verifier_svc.expert_cache import CacheStats, check_slots
from verifier_svc.expert_store import HostExpertStore
from verifier_svc.guess_gate import GuessGate, LayerGate


def partition(slots: int, num_experts: list[int]) -> list[int]:
    """Slots per layer: `slots` spread as evenly as possible, a layer never given more than its experts."""
    sizes = [0] * len(num_experts)
    left = slots
    while left > 0:
        open_ = [i for i, n in enumerate(num_experts) if sizes[i] < n]
        if not open_:
            break
        share = max(1, left // len(open_))
        for i in open_:
            add = min(share, num_experts[i] - sizes[i], left)
            sizes[i] += add
            left -= add
            if left == 0:
                break
    return sizes


class DeviceExpertCache:
    device_managed = True  # read by the installer (the experts call) and the verifier core (one graph per forward)

    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device, need: int,
                 prefetch: str = "union,layer", time_copies: bool = False, arrival_share: float = 0.5):
        check_slots(store, num_slots, need)
        self.store, self.device = store, torch.device(device)
        kinds = {p.strip() for p in prefetch.split(",")}
        self.prefetch_union, self.layer_ahead = "union" in kinds, "layer" in kinds
        self.layers = list(store.num_experts)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        counts = [store.num_experts[layer] for layer in self.layers]
        e_max = max(counts)
        self.sizes = partition(num_slots - e_max, counts)
        self.bases, pos = [], 0
        for size in self.sizes:
            self.bases.append(pos)
            pos += size
        self.overflow = pos  # overflow slot of expert e: overflow + e
        self._rows = [store.row(layer, 0) for layer in self.layers]  # arena row of each layer's expert 0
        dev, n_layers, c_max = self.device, len(self.layers), max(max(self.sizes), 1)
        self.pool = torch.zeros(pos + e_max, store.slice_bytes, dtype=torch.uint8, device=dev)
        self.weights = store.weights(self.pool)
        self.table = torch.full((n_layers, e_max), -1, dtype=torch.int32, device=dev)
        self.owner = torch.full((n_layers, c_max), -1, dtype=torch.int32, device=dev)
        self.last = torch.zeros(n_layers, c_max, dtype=torch.int64, device=dev)
        self.unused = torch.zeros(n_layers, c_max, dtype=torch.int8, device=dev)
        # the forward's per-expert codes and the arrivals' (`arr_codes`): one tensor, so `collect` reads both back in one
        # copy (views made here, before any graph captures them)
        # row 2: the words each in-forward prefetch copy moved, with abortable guesses (`moved`; an aborted copy moves part
        # of its slice)
        self._all_codes = torch.zeros(3, n_layers, e_max, dtype=torch.int32, device=dev)
        self.codes = self._all_codes[0]
        self.moved = self._all_codes[2]
        self._forward_rows = self._all_codes[0::2]  # zeroed when a forward starts
        self.stop = torch.zeros(n_layers, e_max, dtype=torch.int8, device=dev)  # abortable guesses' flags
        self.eff = torch.zeros(n_layers, e_max, dtype=torch.int32, device=dev)
        self.fills = torch.zeros(2, n_layers, e_max, dtype=torch.int8, device=dev)  # [demand, prefetch] rows
        self.marks = torch.zeros(2, n_layers, e_max, dtype=torch.int8, device=dev)
        self.order = torch.zeros(2, n_layers, ko._pow2(c_max), dtype=torch.int32, device=dev)
        self.effs = torch.zeros(n_layers, e_max, dtype=torch.int32, device=dev)  # a prefetch's slot table (unused)
        self.proj = torch.zeros(n_layers, e_max, dtype=torch.int8, device=dev)
        self._proj_host = torch.zeros(n_layers, e_max, dtype=torch.int8)
        self._proj_np = self._proj_host.numpy()  # the same memory: begin() fills it with numpy (a torch setitem per
        # expert cost ~5 us each, milliseconds a verify at 48 layers)
        self.tick = torch.zeros(1, dtype=torch.int64, device=dev)
        self._cuda = dev.type == "cuda"
        self._side = torch.cuda.Stream(dev) if self._cuda else None
        self._joins: set[int] = set()  # layers whose prefetch runs on the side stream (joined at their call)
        # A layer's demand copies on the side stream while its resident experts' GEMMs run (pdflash_kernels.moe two phases); the
        # flagged experts' GEMMs wait for this layer's event. Set before the graphs capture (`--no-expert-fill-overlap`).
        self.fill_overlap = True
        # The misses of a layer in this many copy groups, each with its own copy launch and event, so a group's GEMMs run
        # while the next group copies (pdflash_kernels.moe phases; worth it where one slice's copy outlasts a launch by far, as
        # gpt-oss-20b's 13 MB). Opt-in until a GPU has timed it (PDFLASH_EXPERT_FILL_GROUPS, default 1); before capture.
        self.fill_groups = _fill_groups()
        self._filled = [[torch.cuda.Event() for _ in range(8)] for _ in self.layers] if self._cuda else []
        # With the overlap, the next-layer guess need not hold up the next layer until its copies land: that layer waits
        # only for the guess's admission (`_admitted`), its demand admission marks hits on slots the guess brought as
        # still in flight (fill -1: computed with the first copy group), and its demand copies queue behind the guess's on the side
        # stream. On by default since the H200 timed it (stop 31: Qwen3 shapes +4..+25% tok/s at 10% and up to +8.5% at 25%
        # against the overlap alone in the same run, block 1's hidden copy fraction 0.17 -> 0.75 at 25%; gpt-oss shapes
        # within -4..+6.5%; benchmarks/results/offload_async_h200.md); PDFLASH_EXPERT_GUESS_ASYNC=0 turns it off. Set
        # before the graphs capture.
        self.guess_async = runtime.env_flag("PDFLASH_EXPERT_GUESS_ASYNC", default=True)
        self._admitted = [torch.cuda.Event() for _ in self.layers] if self._cuda else []
        # Abortable guesses (see the module's docstring): on the GPU only with the asynchronous guess, whose copies may
        # still run when the next layer admits; on a CPU the same admission rule runs (the guess's copies are done by
        # then, so an abort only frees the slot), so CI covers it. On by default since stop 38's H200 A/B (gpt-oss-24l
        # shapes at 25% and 10% caches: 12 of 12 rows faster than without it in the same run, +0.1..+3.3%; 25% rows
        # 0.82-0.83 -> 0.84-0.85 of the PCIe bound in the last run; Qwen3-48l at 10% within -1..+1.7%;
        # benchmarks/results/offload_abort_h200.md); PDFLASH_EXPERT_GUESS_ABORT=0 turns it off. Set before the graphs
        # capture.
        self.guess_abort = runtime.env_flag("PDFLASH_EXPERT_GUESS_ABORT", default=True)
        # The guess's width counts copies, not picks (pdflash_kernels.installer._predict_experts with the next layer's
        # table): each row takes the router's picks best first until `guess_width` of them are not resident. Without
        # it a guess whose best pick is already resident copies nothing and the link idles through the next layer's
        # attention and router. Opt-in (PDFLASH_EXPERT_GUESS_MISSES=1): on the H200 (stop 39,
        # benchmarks/results/offload_misses_h200.md) it raised prefetch coverage (gpt-oss-24l shapes 0.18 -> 0.20-0.24
        # on 6 of 8 rows, Qwen3-48l 0.01-0.04 -> 0.13-0.18) but not tok/s (gpt-oss -1.9..+0.4% at 25% and 10% caches, Qwen3 -13..+1.8%):
        # with random routing the picks after the best are poor guesses. Set before the graphs capture.
        self.guess_misses = runtime.env_flag("PDFLASH_EXPERT_GUESS_MISSES", default=False)
        self._stats = CacheStats()
        self.time_copies = False  # the copies run inside the forward's kernels: no separate copy timing
        self.gate = GuessGate()  # whether the next-layer guess pays (measured); its decision is `guess_on`
        # and which layers keep guessing, by each one's precision (`LayerGate`): guess_on[j] = gate.on and layer j's flag
        self.layer_gate = LayerGate(n_layers)
        # on by default since stop 35 (PDFLASH_EXPERT_GUESS_LAYERS=0: the cache-wide gate alone): on the H200, Qwen3-48l
        # shapes at a 10% cache ran 3.9-16.5% more tok/s with it (two runs against one without), gpt-oss-24l -1.3..+3.4%
        self.layer_gate_on = runtime.env_flag("PDFLASH_EXPERT_GUESS_LAYERS", default=True)
        self.judge_guess = self._cuda  # on a CPU the "copies" are host memcpys: their times say nothing about PCIe
        self.guess_on = torch.ones(n_layers, dtype=torch.int32, device=dev)
        self._guess_flags = [1] * n_layers
        self.guess_width = 0  # the next-layer guess: its router's top `guess_width` (0: auto, pdflash_kernels.installer.guess_k); set
        # before the graphs capture
        # arrivals (see the module's docstring): their own scratch and code rows, their own copy stream
        self.arrival_share = arrival_share  # most of each layer's slots (and of all partition slots) one arrival takes
        self.arr_proj = torch.zeros(n_layers, e_max, dtype=torch.int8, device=dev)
        self._arr_host = torch.zeros(n_layers, e_max, dtype=torch.int8)
        self.arr_codes = self._all_codes[1]
        self.arr_eff = torch.zeros(n_layers, e_max, dtype=torch.int32, device=dev)
        self.arr_fill = torch.zeros(n_layers, e_max, dtype=torch.int8, device=dev)
        self.arr_marks = torch.zeros(n_layers, e_max, dtype=torch.int8, device=dev)
        self.arr_order = torch.zeros(n_layers, ko._pow2(c_max), dtype=torch.int32, device=dev)
        self._copy = torch.cuda.Stream(dev) if self._cuda else None
        self._lock = threading.Lock()
        self._in_flight = False  # a forward runs between begin() and collect(): arrivals wait for it
        self._pending: dict[int, set[int]] = {}  # arrivals kept while a forward ran (layer -> experts), merged
        self._issued = False  # arrival work on the copy stream the next forward has not waited for yet

    # ---- what callers read -----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def kept_bytes(self) -> int:
        """The bytes of experts this cache can keep resident: its layers' partitions (the overflow range only passes
        experts through). Equal to the store's total when it holds every expert."""
        return sum(self.sizes) * self.store.slice_bytes

    @property
    def stats(self) -> CacheStats:
        return self._stats

    @classmethod
    def slots_for(cls, store: HostExpertStore, gib: float) -> int:
        """Slots a budget of `gib` GiB holds, never more than every expert plus the overflow range."""
        return min(int(gib * 2**30 // store.slice_bytes), sum(store.num_experts.values()) + max(store.num_experts.values()))

    def resident(self, layer: int, expert: int) -> bool:
        return int(self.table[self._index[layer], expert]) >= 0

    def copy_ms(self) -> float | None:
        """None: the copies are inside the forward's kernels (benchmarks/offload.py times the fill kernel apart)."""
        return None

    # ---- the verifier core's calls around a forward -----------------------------------------------------------
    def begin(self, projection: dict[int, frozenset[int] | set[int]]) -> int:
        """The projected union of the verify about to run: each layer's part is prefetched while the layer before it
        computes (with `union` prefetch). Returns the experts projected. A forward is running from here until its
        `collect()`: arrivals meanwhile wait for it; the ones issued before run first (on CUDA this stream waits for
        the copy stream)."""
        with self._lock:
            self._in_flight = True
            if self._issued:
                torch.cuda.current_stream(self.device).wait_stream(self._copy)
                self._issued = False
            self._proj_np.fill(0)
            n = 0
            if self.prefetch_union:
                index, counts, limits, cols = [], [], [], []
                for layer, experts in projection.items():
                    i = self._index.get(layer)
                    ids = list(experts) if i is not None else ()  # (any iterable of ids: sets, lists, arrays)
                    if ids:
                        index.append(i)
                        counts.append(len(ids))
                        limits.append(self.store.num_experts[layer])
                        cols.extend(ids)
                if cols:  # one assignment for every layer
                    r = np.repeat(np.asarray(index, np.int64), counts)
                    c = np.fromiter(cols, np.int64, len(cols))
                    ok = (c >= 0) & (c < np.repeat(np.asarray(limits, np.int64), counts))
                    self._proj_np[r[ok], c[ok]] = 1
                    n = int(ok.sum())
            self.proj.copy_(self._proj_host)  # pageable: staged at once, ordered before the forward on this stream
            return n

    def arriving(self, projection) -> int:
        """A verify's projected union, before its forward (a Verify arrived, or the scheduler hinted an admitted
        demand): admit and fill the window of its first layers now as prefetches, or right after the running forward
        when one runs (see the module's docstring). Unknown layers and out-of-range experts are ignored (the verify
        validates its own union). Returns the experts queued: at most that many slices are copied (those already
        resident are not). Nothing without `union` prefetch or with `arrival_share` 0."""
        with self._lock:
            plan = self._plan(projection)
            if not plan:
                return 0
            if self._in_flight:
                for i, experts, _cap in plan:
                    self._pending.setdefault(i, set()).update(experts)
                return sum(cap for _i, _e, cap in plan)
            return self._issue(plan)

    def _plan(self, projection, by_index: bool = False) -> list[tuple[int, list[int], int]]:
        """(layer index, projected experts, most slots to take) for the first projected layers that fit in
        `arrival_share` of the partition slots; each layer at most `arrival_share` of its own."""
        if not self.prefetch_union or self.arrival_share <= 0:
            return []
        budget = int(self.arrival_share * sum(self.sizes))
        plan, used = [], 0
        for i, layer in enumerate(self.layers):
            experts = projection.get(i if by_index else layer)
            if not experts or self.sizes[i] == 0:
                continue
            n = self.store.num_experts[layer]
            valid = sorted({int(e) for e in experts if 0 <= int(e) < n})
            if used >= budget:
                break
            cap = min(len(valid), int(self.arrival_share * self.sizes[i]), budget - used)
            if cap <= 0:
                continue  # nothing valid, or a partition too small for any share of it
            plan.append((i, valid, cap))
            used += cap
        return plan

    def _issue(self, plan: list[tuple[int, list[int], int]]) -> int:
        """Admit and fill a plan's experts as prefetches (lock held, no forward running). Per layer: the projected
        experts not resident, at most `cap` of them (in id order), into evictable slots; the resident projected ones and
        those prefetched and not used yet are marked needed, so this admission never evicts them."""
        self._arr_host.zero_()
        for i, experts, _cap in plan:
            self._arr_host[i, experts] = 1
        if self._cuda:
            self._copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy) if self._cuda else _nullcontext():
            self.arr_proj.copy_(self._arr_host, non_blocking=self._cuda)  # pageable: staged at once
            for i, _experts, cap in plan:
                n, c = self.store.num_experts[self.layers[i]], self.sizes[i]
                projected = self.arr_proj[i, :n] != 0
                missing = projected & (self.table[i, :n] < 0)
                take = missing & (torch.cumsum(missing.to(torch.int32), 0) <= cap)
                owner = self.owner[i, :c]
                spare = torch.zeros(n + 1, dtype=torch.int8, device=self.device)  # experts of unused prefetched slots
                spare.index_fill_(0, torch.where((self.unused[i, :c] != 0) & (owner >= 0), owner, n).long(), 1)
                need = (take | (projected & ~missing) | (spare[:n] != 0)).to(torch.int8)
                args = (self.table[i, :n], owner, self.last[i, :c], self.unused[i, :c], self.arr_codes[i, :n],
                        self.arr_eff[i, :n], self.arr_fill[i, :n])
                if self._cuda:
                    ko.admit(None, None, need, self.arr_marks[i, :n], *args, self.arr_order[i], self.tick, self.bases[i],
                             self.overflow, True)
                    ko.fill(self.store.arena, self.pool, self._rows[i], args[5], args[6])
                else:
                    ko.admit_reference(None, None, need, *args, int(self.tick), self.bases[i], self.overflow, True)
                    ko.fill_reference(self.store.arena, self.pool, self._rows[i], args[5], args[6])
        self._issued = self._cuda
        return sum(cap for _i, _e, cap in plan)

    def collect(self, ms: float | None = None, tokens: int = 0) -> CacheStats:
        """After a forward (its stream done): decode the per-expert codes into the counters. Returns this forward's.
        `ms` and `tokens`: the forward's wall time and rows, for the guess's gate (None: not judged, e.g. a prefill).
        The arrivals issued before this forward count with it (as prefetches); those kept while it ran are issued now."""
        # One copy back for both rows. The arrivals' are final too: the forward waited for the ones issued before it, and
        # those arriving while it runs are kept (`_pending`), not issued, until the end of this call.
        both = self._all_codes.cpu().numpy()
        st = self._decode(both[0], both[2] if self.guess_abort else None)
        with self._lock:
            arrivals = self._decode(both[1])
            self.arr_codes.zero_()
            self._stats = self._stats.plus(st).plus(arrivals)
            if self.layer_ahead and self.judge_guess:  # this forward ran the guess if the flag was on: judge it, set the flags
                was = self.gate.on
                per_token = ms / tokens if ms is not None and tokens > 0 else None
                self.gate.observe(was, per_token, st.prefetched, st.prefetch_used)
                if was and self.layer_gate_on:  # each layer's own precision (its codes row: the guess for layer j lands in row j)
                    self.layer_gate.observe(np.count_nonzero(both[0] & ko.PREFETCHED, axis=1),
                                            np.count_nonzero(both[0] & ko.PREFETCH_USED, axis=1))
                self._set_guess_flags()
            self._in_flight = False
            if self._pending:
                plan, self._pending = self._plan(self._pending, by_index=True), {}
                if plan:
                    self._issue(plan)
        return st.plus(arrivals)

    def _set_guess_flags(self) -> None:
        """guess_on[j] (read by the captured forwards: in place) = the cache-wide arm's decision and layer j's own."""
        flags = [int(self.gate.on and (on or not self.layer_gate_on)) for on in self.layer_gate.on]
        if flags != self._guess_flags:
            self._guess_flags = flags
            self.guess_on.copy_(torch.tensor(flags, dtype=torch.int32))

    def _decode(self, codes: np.ndarray | torch.Tensor, moved: np.ndarray | None = None) -> CacheStats:
        """`moved` (abortable guesses): the words each prefetch of this forward copied, an aborted one's part of its slice;
        its bytes count moved and, for an aborted guess, wasted. Without it every prefetch moved its whole slice."""
        codes = codes.numpy() if isinstance(codes, torch.Tensor) else codes  # (host memory; numpy: ~5 us a count)
        count = lambda bit: int(np.count_nonzero(codes & bit))  # noqa: E731
        misses, prefetched, sb = count(ko.MISS), count(ko.PREFETCHED), self.store.slice_bytes
        ahead = prefetched * sb if moved is None else 4 * int(moved.sum(dtype=np.int64))
        lost = 0 if moved is None else 4 * int(moved[(codes & ko.ABORTED) != 0].sum(dtype=np.int64))
        return CacheStats(lookups=count(ko.ROUTED), hits=count(ko.HIT), misses=misses, evictions=count(ko.EVICTED),
                          prefetched=prefetched, prefetch_used=count(ko.PREFETCH_USED),
                          bytes_moved=misses * sb + ahead, wasted_bytes=count(ko.WASTED) * sb + lost,
                          prefetch_aborted=count(ko.ABORTED))

    def reset_stats(self) -> None:
        """Zero the counters and the per-expert codes, forget which slots were prefetched and not yet used and the last
        projection; what is resident stays resident (as `ExpertCache.reset_stats`: after the warm-up, the first
        request's counters are its own). In place: the captured graphs read these tensors. Arrivals not counted yet
        are forgotten (and one kept for later is dropped)."""
        with self._lock:
            if self._issued:  # zeroed after the arrivals' kernels, not under them
                torch.cuda.current_stream(self.device).wait_stream(self._copy)
                self._issued = False
            self._stats = CacheStats()
            self._forward_rows.zero_()
            self.unused.zero_()
            self._proj_host.zero_()
            self.proj.zero_()
            self.arr_codes.zero_()
            self._pending = {}
            self.gate.reset()
            self.layer_gate.reset()
            self._set_guess_flags()

    # ---- the experts call (pdflash_kernels.installer) ----------------------------------------------------------------
    def _overlaps(self, i: int, n: int) -> bool:
        """Whether layer i's misses copy while its resident experts compute (a layer whose partition holds all its
        experts misses only while cold: one phase there, no empty launches)."""
        return self._cuda and self.fill_overlap and self.sizes[i] < n

    def _admit(self, i: int, which: int, ids, valid_rows, valid: int | None, extra, prefetch: bool, fill: bool = True,
               inflight: bool = False, admitted: torch.cuda.Event | None = None, groups: int = 1,
               abortable: bool = False) -> None:
        """abortable: a prefetch's copies can be stopped (it sets their flags and reports the words moved); a demand
        aborts this forward's guesses for its layer that it does not route to."""
        args = (self.table[i], self.owner[i, : self.sizes[i]], self.last[i, : self.sizes[i]], self.unused[i, : self.sizes[i]],
                self.codes[i], self.effs[i] if prefetch else self.eff[i], self.fills[which, i])
        n = self.store.num_experts[self.layers[i]]
        args = tuple(a[:n] if k in (0, 4, 5, 6) else a for k, a in enumerate(args))
        stop = self.stop[i, :n] if abortable else None
        guessed = self.fills[1, i, :n] if abortable and not prefetch else None
        moved = self.moved[i, :n] if abortable and prefetch else None
        if self._cuda:
            ko.admit(ids, valid_rows, extra, self.marks[which, i, :n], *args, self.order[which, i], self.tick,
                     self.bases[i], self.overflow, prefetch, inflight, groups, guessed, stop)
            if admitted is not None:
                admitted.record(torch.cuda.current_stream(self.device))
            if fill:
                ko.fill(self.store.arena, self.pool, self._rows[i], args[5], args[6], stop=stop if prefetch else None,
                        moved=moved)
        else:
            ko.admit_reference(ids, valid, extra, *args, int(self.tick), self.bases[i], self.overflow, prefetch,
                               guessed=guessed, stop=stop)
            ko.fill_reference(self.store.arena, self.pool, self._rows[i], args[5], args[6], stop=stop if prefetch else None,
                              moved=moved)

    def forward_experts(self, module, layer: int, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        valid_rows: torch.Tensor | None):
        from pdflash_kernels.installer import _predict_experts, offloaded_kernel

        i = self._index[layer]
        n = module._pdflash_num_experts
        self.weights = self.store.refresh(self.weights, self.pool)  # the store may have been filled after this cache was made
        valid = None
        if not self._cuda and valid_rows is not None:
            valid = int(valid_rows)
        if i == 0:  # a new forward (a forward nobody collected, e.g. a graph's warm-up, is forgotten here)
            if not self._in_flight:  # a forward without begin(): arrivals wait for collect() all the same
                with self._lock:
                    self._in_flight = True
            self.tick.add_(1)
            self._forward_rows.zero_()  # the codes and the prefetches' moved words
            self._joins.clear()
        cur = torch.cuda.current_stream(self.device) if self._cuda else None
        overlap = self._overlaps(i, n)
        early = overlap and self.guess_async  # the guess for this layer may still be copying (see __init__)
        if self._cuda and i in self._joins:
            if early:
                cur.wait_event(self._admitted[i])  # its admission only: the copies are the second phase's wait
            else:
                cur.wait_stream(self._side)
        groups = self.fill_groups if overlap else 1
        if self._cuda and not 1 <= groups <= len(self._filled[i]):
            raise ValueError(f"fill_groups {groups}: a layer's copies go in 1 to {len(self._filled[i])} groups")
        # abort this forward's wrong guesses for this layer: on the GPU where they may still copy (the asynchronous
        # guess), on a CPU always (the same rule, so CI runs it)
        abort = self.guess_abort and i > 0 and (early or not self._cuda)
        self._admit(i, 0, top_k_index, valid_rows, valid, None, prefetch=False, fill=not overlap, inflight=early,
                    groups=groups, abortable=abort)
        phase = between = None
        if overlap:  # this layer's misses copy on the side stream while its resident experts compute (phases)
            self._side.wait_stream(cur)
            done = self._filled[i]
            with torch.cuda.stream(self._side):
                for g in range(1, groups + 1):
                    ko.fill(self.store.arena, self.pool, self._rows[i], self.eff[i, :n], self.fills[0, i, :n], group=g)
                    done[g - 1].record(self._side)
            phase = self.fills[0, i, :n]
            between = lambda g: cur.wait_event(done[g - 1])  # noqa: E731 (a group's GEMMs wait for its copies)
        nxt = getattr(module, "_pdflash_next_router", None) if self.layer_ahead else None
        if i + 1 < len(self.layers) and (nxt is not None or self.prefetch_union):
            if self._cuda:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
                self._joins.add(i + 1)
            with torch.cuda.stream(self._side) if self._cuda else _nullcontext():
                n1 = self.store.num_experts[self.layers[i + 1]]
                table = self.table[i + 1, :n1] if self.guess_misses else None  # (the guess counts copies of absent experts)
                guess = _predict_experts(x, nxt, self.guess_width, table) if nxt is not None else None
                g_rows, g_valid = valid_rows, valid
                if guess is not None:  # the gate: off, the guess's rows count as none (a device flag: graph-safe)
                    if self._cuda:
                        g_rows = (valid_rows if valid_rows is not None else guess.shape[0]) * self.guess_on[i + 1 : i + 2]
                    else:
                        g_valid = (guess.shape[0] if valid is None else valid) if self._guess_flags[i + 1] else 0
                # The projection only where no router guess exists: a projected union (the previous verify's) marks
                # its experts needed, and in a small partition they are the ones resident, so with the guess it left
                # the guess no slot at all (nothing was prefetched); the guess, from this verify's own rows, is the
                # better of the two.
                extra = None
                if self.prefetch_union and guess is None:
                    extra = self.proj[i + 1, :n1]
                ahead = self._cuda and self.guess_async and self._overlaps(i + 1, n1)
                self._admit(i + 1, 1, guess, g_rows, g_valid, extra, prefetch=True,
                            admitted=self._admitted[i + 1] if ahead else None, abortable=self.guess_abort)
        return offloaded_kernel(x, top_k_index, top_k_weights, self, n, self.eff[i, :n], valid, valid_rows, phase, between,
                                groups)


def _fill_groups() -> int:
    value = os.environ.get("PDFLASH_EXPERT_FILL_GROUPS", "1")
    if not value.isdigit() or not 1 <= int(value) <= 8:
        raise ValueError(f"PDFLASH_EXPERT_FILL_GROUPS must be a number of copy groups from 1 to 8, got {value!r}")
    return int(value)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
