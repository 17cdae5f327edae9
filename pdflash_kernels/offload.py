"""Device-side expert caching for offloaded experts: the decisions and the copies a CUDA graph can hold.

One MoE layer's slots are a contiguous range of a slot pool (its *partition*: `base .. base + C - 1`), plus a
shared *overflow* range of E slots (`scratch + e`) for the routed experts that find no evictable slot. Per layer the
state is device tensors: `table[E]` (expert -> global slot, -1 when not resident), `owner[C]` (partition slot ->
expert, -1 free), `last[C]` (the forward count of the slot's last use: LRU), `unused[C]` (brought by a prefetch and
not used since).

`admit` (one program, one launch) marks the experts a call needs (the routed ids of the real rows, or for a prefetch
the predicted ids and/or a projection row), then gives each needed expert that is not resident an evictable slot:
free slots first, then the least recently used, never a slot whose expert this call needs. It writes the kernel's
slot table (`eff`: resident slot, new slot, or the overflow slot) and which experts `fill` must copy. `fill` copies
those experts' slices from the host arena (pinned host memory, read by the kernel over PCIe: no copy engine, so the
copies can sit in a CUDA graph whose routing decides them) into their slots. A prefetch admits only into evictable
slots and never overflows. Per expert, `codes` collects what happened in this forward (bits below): the host
decodes them into the cache's counters after the forward.

`fill` values: 0 resident (or not needed); g >= 1 to copy, in copy group g (`groups` of a demand admission: the
missing experts split evenly, in expert order, into that many groups, each copied by its own `fill(..., group=g)` and
computed by the experts kernel's phase g + 1, so the first group's GEMMs run while the later groups copy; a prefetch
uses group 1); with `inflight` (a demand admission whose layer's prefetch may still be copying: the device cache's
asynchronous guess) -1 marks a hit on a slot a prefetch brought and nothing used yet, which `fill` leaves alone and
the experts kernel computes with group 1 (the side stream copies the prefetch before any group of this layer).

Abortable guesses (`stop`, the device cache's PDFLASH_EXPERT_GUESS_ABORT): a prefetch admission given a `stop` row sets
stop[e] = 0 for each expert it will copy, and its `fill(..., stop=, moved=)` checks stop[e] between load steps (a
volatile read: the flag is written by a kernel on another stream while the copy runs) and adds the words it copied to
moved[e]. The same layer's demand admission, given `guessed` (that prefetch's fill row: nonzero = this forward's guess
copies e) and `stop`, *aborts* each guessed expert the layer did not route to before anything else: stop[e] = 1, its
slot freed (owner -1, table -1, not unused), code ABORTED; the slot is then free for this call's misses, whose copies
the device cache queues behind the guess's on the same stream (so they land after the aborted copy's last write). A
wrong guess then costs only the link time up to its layer's admission, which was idle.

`admit_reference` / `fill_reference` are the same logic in plain Python/torch: the CPU path, and the spec the Triton
kernels are tested against (tests/test_offload_kernels.py, under Triton's interpreter on CPU machines).
"""

from __future__ import annotations

import os

import torch

from pdflash_kernels import runtime

triton, tl = runtime.triton, runtime.tl

# `fill`'s launch shape: int32 words of a slice one program copies (its K range), and words a load step moves. A program
# has one load step in flight, so one slice (a layer's single miss) moves at about (its programs x a step) per PCIe round
# trip: smaller ranges put more programs on one slice (benchmarks/fill_sweep.py measures the shapes on the GPU).
def _words(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < 256 or int(value) & (int(value) - 1):
        raise ValueError(f"{name} must be a power of two >= 256, got {value!r}")
    return int(value)


FILL_CHUNK_WORDS = _words("PDFLASH_FILL_CHUNK_WORDS", 1 << 16)
FILL_BLOCK_WORDS = _words("PDFLASH_FILL_BLOCK_WORDS", 2048)

ROUTED = 1  # routed by a real row of this forward
HIT = 2  # resident when its layer ran (a prefetch of this forward counts)
MISS = 4  # routed, not resident: copied on demand (into a partition slot or the overflow)
OVERFLOW = 8  # of those, no evictable slot: copied into the overflow slot, not kept
PREFETCHED = 16  # copied by a prefetch into a partition slot
PREFETCH_USED = 32  # routed, resident because of a prefetch not used before
EVICTED = 64  # taking its slot evicted another expert
WASTED = 128  # the evicted expert had been prefetched and never used
ABORTED = 256  # guessed by this forward's prefetch for this layer, not routed to: its copy stopped, its slot freed
BIG = 1 << 40  # LRU key of a slot this call needs (never evicted); forward counts stay far below


def admit_reference(ids: torch.Tensor | None, valid: int | None, extra: torch.Tensor | None, table: torch.Tensor,
                    owner: torch.Tensor, last: torch.Tensor, unused: torch.Tensor, codes: torch.Tensor,
                    eff: torch.Tensor, fill: torch.Tensor, tick: int, base: int, scratch: int, prefetch: bool,
                    inflight: bool = False, groups: int = 1, guessed: torch.Tensor | None = None,
                    stop: torch.Tensor | None = None) -> None:
    """One layer's admission, in place on the layer's state rows (CPU tensors). ids [rows, k] (rows >= valid
    ignored) and/or extra [E] (nonzero = needed) say what this call needs. `inflight`: fill -1 for a demand hit on a
    prefetched, unused slot; `groups`: the demand's copy groups; `stop` (int8 [E]) with a prefetch: the abort flags
    its copies start with (0); with a demand and `guessed` (int8 [E]): the guesses to abort (see the module's
    docstring)."""
    n, c = table.shape[0], owner.shape[0]
    need_set = set()
    if ids is not None:
        rows = ids[: ids.shape[0] if valid is None else valid]
        need_set.update(int(e) for e in rows.reshape(-1).tolist())
    if extra is not None:
        need_set.update(e for e, v in enumerate(extra.tolist()) if v)
    tab, own, lst, unu = table.tolist(), owner.tolist(), last.tolist(), unused.tolist()
    cod = codes.tolist()
    stp = stop.tolist() if stop is not None else None
    if not prefetch and guessed is not None and stop is not None:  # abort this forward's wrong guesses first
        for e, g in enumerate(guessed.tolist()):
            if g and e not in need_set and tab[e] >= 0:
                s = tab[e] - base
                own[s], lst[s], unu[s], tab[e] = -1, 0, 0, -1
                stp[e] = 1
                cod[e] |= ABORTED
    tab0 = list(tab)
    key = [(-1 if own[s] < 0 else BIG if own[s] in need_set else lst[s], s) for s in range(c)]
    order = [s for k, s in sorted(key) if k < BIG]  # evictable, free first, then least recently used
    out_eff, out_fill = [0] * n, [0] * n
    rank = 0
    for e in range(n):
        code = cod[e]
        if e not in need_set:
            out_eff[e] = tab0[e] if tab0[e] >= 0 else scratch + e
            continue
        if not prefetch:
            code |= ROUTED
        if tab[e] >= 0:
            out_eff[e] = tab[e]
            if not prefetch:
                code |= HIT
                s = tab[e] - base
                lst[s] = tick
                if unu[s]:
                    code |= PREFETCH_USED
                    unu[s] = 0
                    if inflight:
                        out_fill[e] = -1
            cod[e] = code
            continue
        if rank < len(order):
            s = order[rank]
            old = own[s]
            if old >= 0:
                tab[old] = -1
                code |= EVICTED | (WASTED if unu[s] else 0)
            own[s], lst[s], unu[s] = e, tick, 1 if prefetch else 0
            tab[e] = base + s
            out_eff[e], out_fill[e] = base + s, 1
            if prefetch and stp is not None:
                stp[e] = 0
            code |= PREFETCHED if prefetch else MISS
        elif prefetch:
            out_eff[e] = scratch + e
        else:
            out_eff[e], out_fill[e] = scratch + e, 1
            code |= MISS | OVERFLOW
        rank += 1
        cod[e] = code
    if not prefetch and groups > 1:  # the missing experts (filled ones) split evenly, in expert order
        copied = [e for e in range(n) if out_fill[e] == 1]
        for r, e in enumerate(copied):
            out_fill[e] = 1 + r * groups // len(copied)
    out = [(table, tab), (owner, own), (last, lst), (unused, unu), (codes, cod), (eff, out_eff), (fill, out_fill)]
    if stp is not None:
        out.append((stop, stp))
    for t, v in out:
        t.copy_(torch.tensor(v, dtype=t.dtype))


def fill_reference(arena: torch.Tensor, pool: torch.Tensor, first_row: int, eff: torch.Tensor, fill: torch.Tensor,
                   group: int = 1, stop: torch.Tensor | None = None, moved: torch.Tensor | None = None) -> None:
    """(On the host a copy is done before anything could abort it: `stop` only skips experts already stopped;
    `moved` gets each copied expert's words.)"""
    for e in torch.nonzero(fill == group).reshape(-1).tolist():
        if stop is not None and int(stop[e]):
            continue
        pool[int(eff[e])].copy_(arena[first_row + e])
        if moved is not None:
            moved[e] += arena.shape[1] // 4


if triton is not None:

    _ROUTED = tl.constexpr(ROUTED)  # (a kernel reads module constants only as constexpr)
    _HIT = tl.constexpr(HIT)
    _MISS = tl.constexpr(MISS)
    _OVERFLOW = tl.constexpr(OVERFLOW)
    _PREFETCHED = tl.constexpr(PREFETCHED)
    _PREFETCH_USED = tl.constexpr(PREFETCH_USED)
    _EVICTED = tl.constexpr(EVICTED)
    _WASTED = tl.constexpr(WASTED)
    _ABORTED = tl.constexpr(ABORTED)
    _BIG = tl.constexpr(BIG)

    @triton.jit
    def _admit_kernel(ids_ptr, n_ids, valid_ptr, extra_ptr, mark_ptr, table_ptr, owner_ptr, last_ptr, unused_ptr,
                      codes_ptr, eff_ptr, fill_ptr, order_ptr, tick_ptr, guess_ptr, stop_ptr, E, C, base, scratch,
                      TOPK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_VALID: tl.constexpr, HAS_EXTRA: tl.constexpr,
                      PREFETCH: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, BI: tl.constexpr,
                      INFLIGHT: tl.constexpr = False, GROUPS: tl.constexpr = 1, STOP: tl.constexpr = False,
                      ABORT: tl.constexpr = False):
        e = tl.arange(0, BE)
        em = e < E
        c = tl.arange(0, BC)
        cm = c < C
        tick = tl.load(tick_ptr)
        # what this call needs: a mark per expert in a scratch row (duplicate ids store the same value)
        tl.store(mark_ptr + e, tl.zeros((BE,), tl.int8), mask=em)
        tl.debug_barrier()
        if HAS_IDS:
            nv = n_ids // TOPK
            if HAS_VALID:
                nv = tl.load(valid_ptr)
            i = tl.arange(0, BI)
            start = n_ids * 0
            while start < n_ids:
                offs = start + i
                ok = (offs < n_ids) & (offs // TOPK < nv)
                ids = tl.load(ids_ptr + offs, mask=ok, other=0)
                tl.store(mark_ptr + ids, tl.full((BI,), 1, tl.int8), mask=ok)
                start += BI
        if HAS_EXTRA:
            x = tl.load(extra_ptr + e, mask=em, other=0)
            tl.store(mark_ptr + e, tl.full((BE,), 1, tl.int8), mask=em & (x != 0))
        tl.debug_barrier()
        need = (tl.load(mark_ptr + e, mask=em, other=0) != 0) & em
        aborted = em & (e < 0)
        if ABORT:  # this forward's guesses the layer did not route to: stopped, their slots freed, before any choice
            guessed = tl.load(guess_ptr + e, mask=em, other=0) != 0
            tab_g = tl.load(table_ptr + e, mask=em, other=-1)
            aborted = guessed & (~need) & (tab_g >= 0) & em
            s_g = tab_g - base
            tl.store(owner_ptr + s_g, tl.full((BE,), -1, tl.int32), mask=aborted)
            tl.store(last_ptr + s_g, tl.zeros((BE,), tl.int64), mask=aborted)
            tl.store(unused_ptr + s_g, tl.zeros((BE,), tl.int8), mask=aborted)
            tl.store(table_ptr + e, tl.full((BE,), -1, tl.int32), mask=aborted)
            tl.store(stop_ptr + e, tl.full((BE,), 1, tl.int8), mask=aborted)
            tl.debug_barrier()
        tab = tl.load(table_ptr + e, mask=em, other=-1)
        resident = tab >= 0
        missing = need & (tab < 0)
        # eviction order: free slots, then least recently used; slots whose expert this call needs never
        own = tl.load(owner_ptr + c, mask=cm, other=-1)
        own_needed = tl.load(mark_ptr + own, mask=cm & (own >= 0), other=0) != 0
        lst = tl.load(last_ptr + c, mask=cm, other=0)
        key = tl.where(own < 0, -1, lst)
        key = tl.where(own_needed, _BIG, key)
        key = tl.where(cm, key, _BIG + 1)
        packed = tl.sort((key + 1) * BC + c)
        n_evict = tl.sum(((packed // BC) - 1 < _BIG).to(tl.int32), axis=0)
        tl.store(order_ptr + c, (packed % BC).to(tl.int32))
        tl.debug_barrier()
        rank = tl.cumsum(missing.to(tl.int32), axis=0) - 1
        ok = missing & (rank < n_evict)
        s = tl.load(order_ptr + rank, mask=ok, other=0)
        old = tl.load(owner_ptr + s, mask=ok, other=-1)
        was_unused = tl.load(unused_ptr + s, mask=ok, other=0) != 0
        hit_s = tab - base
        hit = need & resident
        hit_unused = tl.load(unused_ptr + hit_s, mask=hit, other=0) != 0
        tl.debug_barrier()  # every read of the old state above lands before the writes below
        evicted = ok & (old >= 0)
        tl.store(table_ptr + old, tl.full((BE,), -1, tl.int32), mask=evicted)
        tl.store(owner_ptr + s, e, mask=ok)
        tl.store(last_ptr + s, tl.zeros((BE,), tl.int64) + tick, mask=ok)
        tl.store(unused_ptr + s, tl.full((BE,), 1 if PREFETCH else 0, tl.int8), mask=ok)
        slot = base + s
        tl.debug_barrier()  # (an evicted expert's -1 and a new expert's slot are different entries; ordered anyway)
        tl.store(table_ptr + e, slot, mask=ok)
        code = tl.load(codes_ptr + e, mask=em, other=0)
        code = code | tl.where(evicted, _EVICTED, 0) | tl.where(evicted & was_unused, _WASTED, 0)
        code = code | tl.where(aborted, _ABORTED, 0)
        over = missing & (rank >= n_evict)
        if PREFETCH:
            code = code | tl.where(ok, _PREFETCHED, 0)
            fl = ok
            if STOP:
                tl.store(stop_ptr + e, tl.zeros((BE,), tl.int8), mask=ok)
        else:
            tl.store(last_ptr + hit_s, tl.zeros((BE,), tl.int64) + tick, mask=hit)
            tl.store(unused_ptr + hit_s, tl.zeros((BE,), tl.int8), mask=hit)
            code = code | tl.where(need, _ROUTED, 0) | tl.where(hit, _HIT, 0) | tl.where(hit & hit_unused, _PREFETCH_USED, 0)
            code = code | tl.where(missing, _MISS, 0) | tl.where(over, _OVERFLOW, 0)
            fl = ok | over
        fl = fl.to(tl.int8)
        if not PREFETCH:
            if GROUPS > 1:  # the copied experts split evenly into copy groups, in expert order
                copy = fl != 0
                crank = tl.cumsum(copy.to(tl.int32), axis=0) - 1
                ncopy = tl.maximum(tl.sum(copy.to(tl.int32), axis=0), 1)
                fl = tl.where(copy, 1 + crank * GROUPS // ncopy, 0).to(tl.int8)
            if INFLIGHT:
                fl = tl.where(hit & hit_unused, -1, fl).to(tl.int8)
        eff = tl.where(ok, slot, tl.where(resident, tab, scratch + e))
        tl.store(codes_ptr + e, code, mask=em)
        tl.store(eff_ptr + e, eff.to(tl.int32), mask=em)
        tl.store(fill_ptr + e, fl, mask=em)

    @triton.jit
    def _fill_kernel(src_ptr, dst_ptr, first_row, eff_ptr, fill_ptr, words, group, stop_ptr, moved_ptr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr, STOP: tl.constexpr = False):
        e = tl.program_id(0)
        if tl.load(fill_ptr + e) == group:
            slot = tl.load(eff_ptr + e).to(tl.int64)
            lo = tl.program_id(1).to(tl.int64) * CHUNK
            src = src_ptr + (first_row + e).to(tl.int64) * words
            dst = dst_ptr + slot * words
            if STOP:  # abortable: stop[e] read before every step (written by the next layer's admission meanwhile)
                # Every thread reads the flag, then the program takes their max: one value for the whole program (each
                # thread's own read could see the flag turn at a different step, and the program's warps would leave
                # the loop at different steps: `moved` would miscount and the loop would not be uniform).
                flag = stop_ptr + e + tl.zeros((128,), tl.int32)
                off = lo * 0
                live = tl.max(tl.load(flag, volatile=True).to(tl.int32), axis=0) == 0
                while live & (off < CHUNK):
                    o = lo + off + tl.arange(0, BLOCK)
                    m = o < words
                    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)
                    off += BLOCK
                    live = tl.max(tl.load(flag, volatile=True).to(tl.int32), axis=0) == 0
                done = tl.maximum(tl.minimum(lo + off, words) - lo, 0)
                tl.atomic_add(moved_ptr + e, done.to(tl.int32))
            else:
                for off in range(0, CHUNK, BLOCK):
                    o = lo + off + tl.arange(0, BLOCK)
                    m = o < words
                    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def _pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def admit(ids: torch.Tensor | None, valid: torch.Tensor | None, extra: torch.Tensor | None, mark: torch.Tensor,
          table: torch.Tensor, owner: torch.Tensor, last: torch.Tensor, unused: torch.Tensor, codes: torch.Tensor,
          eff: torch.Tensor, fill: torch.Tensor, order: torch.Tensor, tick: torch.Tensor, base: int, scratch: int,
          prefetch: bool, inflight: bool = False, groups: int = 1, guessed: torch.Tensor | None = None,
          stop: torch.Tensor | None = None) -> None:
    """The Triton admission (one program): same effect as admit_reference, on device tensors, no host sync.
    ids [rows, k] int64 or None; valid: int32 [1] (real rows) or None (all); extra int8 [E] or None; mark int8 [E]
    and order int32 [>= pow2(C)]: scratch rows; tick int64 [1]; guessed / stop int8 [E] or None (abortable
    guesses: the module's docstring)."""
    n, c = table.shape[0], owner.shape[0]
    topk = ids.shape[1] if ids is not None else 1
    n_ids = ids.numel() if ids is not None else 0
    dummy = table
    _admit_kernel[(1,)](
        ids if ids is not None else dummy, n_ids, valid if valid is not None else dummy,
        extra if extra is not None else dummy, mark, table, owner, last, unused, codes, eff, fill, order, tick,
        guessed if guessed is not None else dummy, stop if stop is not None else dummy,
        n, c, base, scratch, TOPK=topk, HAS_IDS=ids is not None, HAS_VALID=valid is not None,
        HAS_EXTRA=extra is not None, PREFETCH=prefetch, BE=_pow2(n), BC=_pow2(c), BI=_pow2(min(max(n_ids, 1), 1024)),
        INFLIGHT=inflight, GROUPS=groups, STOP=prefetch and stop is not None,
        ABORT=not prefetch and guessed is not None and stop is not None,
    )


def fill(arena: torch.Tensor, pool: torch.Tensor, first_row: int, eff: torch.Tensor, flags: torch.Tensor,
         chunk_words: int | None = None, block_words: int | None = None, num_warps: int = 4, group: int = 1,
         stop: torch.Tensor | None = None, moved: torch.Tensor | None = None) -> None:
    """Copy the slices of the experts whose flag is `group` (arena rows first_row + e) into their slots (eff[e]): one
    launch over every expert of the layer, the others' programs return at once. arena: pinned host memory (read over PCIe) or device
    memory; both [rows, slice_bytes] uint8 with slice_bytes a multiple of 4. stop (int8 [E]) and moved (int32 [E])
    together: abortable, each program stops at the step after stop[e] turns nonzero and adds its copied words to
    moved[e]."""
    if (stop is None) != (moved is None):
        raise ValueError("fill: stop and moved go together (an abortable copy reports the words it moved)")
    words = arena.shape[1] // 4
    chunk_words, block_words = chunk_words or FILL_CHUNK_WORDS, block_words or FILL_BLOCK_WORDS
    chunk = min(chunk_words, _pow2(words, 1024))
    _fill_kernel[(flags.shape[0], triton.cdiv(words, chunk))](
        arena.view(torch.int32), pool.view(torch.int32), first_row, eff, flags, words, group,
        stop if stop is not None else flags, moved if moved is not None else eff, CHUNK=chunk, BLOCK=min(chunk, block_words),
        STOP=stop is not None, num_warps=num_warps,
    )
