"""pdflash_kernels/offload.py: the Triton admission and fill kernels against their Python reference (on CPU machines under
Triton's interpreter, TRITON_INTERPRET=1 set by conftest.py; on a GPU for real), and the reference's own rules."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdflash_kernels import offload as ko
from pdflash_kernels import runtime

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not runtime.triton_usable(DEV), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")


def _state(rng: random.Random, n: int, c: int, base: int, tick: int):
    """A consistent layer state: some partition slots own distinct experts, the table points back at them."""
    table = [-1] * n
    owner = [-1] * c
    for s in range(c):
        if rng.random() < 0.7:
            e = rng.randrange(n)
            if table[e] < 0:
                table[e], owner[s] = base + s, e
    last = [rng.randrange(tick) if o >= 0 else 0 for o in owner]
    unused = [int(o >= 0 and rng.random() < 0.3) for o in owner]
    codes = [rng.choice([0, 0, ko.PREFETCHED]) for _ in range(n)]
    return (torch.tensor(table, dtype=torch.int32), torch.tensor(owner, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int64), torch.tensor(unused, dtype=torch.int8), torch.tensor(codes, dtype=torch.int32))


def _case(seed: int):
    rng = random.Random(seed)
    n = rng.choice([4, 8, 32, 128])
    c = rng.choice([0, 1, 3, n // 2, n, n + 5]) if n > 1 else 1
    c = max(c, 1)
    rows, k = rng.choice([1, 2, 16, 32]), min(n, rng.choice([1, 2, 4, 8]))
    ids = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100 + r))[:k] for r in range(rows)])
    valid = rng.randrange(1, rows + 1)
    extra = torch.tensor([int(rng.random() < 0.2) for _ in range(n)], dtype=torch.int8) if rng.random() < 0.5 else None
    prefetch = rng.random() < 0.4
    if not prefetch and rng.random() < 0.5:
        extra = None
    base, tick = 3, 50
    return n, c, ids, valid, extra, prefetch, base, tick, _state(rng, n, c, base, tick)


@needs_triton
@pytest.mark.parametrize("seed", range(24))
def test_admit_kernel_equals_reference(seed):
    n, c, ids, valid, extra, prefetch, base, tick, state = _case(seed)
    inflight = seed % 3 == 0  # (fill -1 for demand hits on prefetched, unused slots)
    groups = 1 + seed % 4  # (a demand's copies split into copy groups)
    scratch = base + c + 7
    # abortable guesses on half the seeds: a prefetch sets its copies' stop flags to 0; a demand aborts the guessed
    # experts (this forward's prefetch fill row) it does not route to
    rng = random.Random(seed + 1000)
    stop = torch.tensor([rng.randrange(2) for _ in range(n)], dtype=torch.int8) if seed % 2 else None
    guessed = (torch.tensor([int(rng.random() < 0.4) for _ in range(n)], dtype=torch.int8)
               if stop is not None and not prefetch else None)
    ref = [t.clone() for t in state]
    eff_r, fill_r = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
    stop_r = stop.clone() if stop is not None else None
    ko.admit_reference(ids, valid, extra, *ref[:4], ref[4], eff_r, fill_r, tick, base, scratch, prefetch, inflight, groups,
                       guessed=guessed, stop=stop_r)
    dev = [t.clone().to(DEV) for t in state]
    eff, fl = torch.zeros(n, dtype=torch.int32, device=DEV), torch.zeros(n, dtype=torch.int8, device=DEV)
    mark = torch.zeros(n, dtype=torch.int8, device=DEV)
    order = torch.zeros(ko._pow2(c), dtype=torch.int32, device=DEV)
    stop_d = stop.clone().to(DEV) if stop is not None else None
    ko.admit(ids.to(DEV), torch.tensor([valid], dtype=torch.int32, device=DEV), None if extra is None else extra.to(DEV),
             mark, *dev[:4], dev[4], eff, fl, order, torch.tensor([tick], device=DEV), base, scratch, prefetch, inflight,
             groups, None if guessed is None else guessed.to(DEV), stop_d)
    for name, a, b in zip(("table", "owner", "last", "unused", "codes", "stop"), ref + [stop_r], dev + [stop_d]):
        assert (a is None and b is None) or torch.equal(a, b.cpu()), name
    assert torch.equal(fill_r, fl.cpu())
    needed = set(ids[:valid].reshape(-1).tolist()) | (set(torch.nonzero(extra).reshape(-1).tolist()) if extra is not None else set())
    for e in needed:  # the slot table the experts kernel reads: equal wherever an expert is needed
        assert int(eff_r[e]) == int(eff[e]), e


def test_admit_reference_rules():
    """Free slots first, then least recently used; a needed expert's slot is never taken; overflow beyond."""
    n, base, scratch = 8, 10, 100
    table = torch.full((n,), -1, dtype=torch.int32)
    owner = torch.tensor([5, -1, 6], dtype=torch.int32)
    table[5], table[6] = base + 0, base + 2
    last = torch.tensor([3, 0, 1], dtype=torch.int64)
    unused = torch.tensor([0, 0, 1], dtype=torch.int8)
    codes = torch.zeros(n, dtype=torch.int32)
    eff, fill = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
    ids = torch.tensor([[5, 1], [2, 3]])  # 5 resident (its slot kept); 1, 2, 3 missing: free slot 1, then slot 2 (LRU), then overflow
    ko.admit_reference(ids, None, None, table, owner, last, unused, codes, eff, fill, 9, base, scratch, False)
    assert owner.tolist() == [5, 1, 2] and int(table[6]) == -1
    assert eff[5] == base + 0 and eff[1] == base + 1 and eff[2] == base + 2 and eff[3] == scratch + 3
    assert fill.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert codes[5] == ko.ROUTED | ko.HIT and codes[1] == ko.ROUTED | ko.MISS
    assert codes[2] == ko.ROUTED | ko.MISS | ko.EVICTED | ko.WASTED  # slot 2 held 6, prefetched and never used
    assert codes[3] == ko.ROUTED | ko.MISS | ko.OVERFLOW
    assert last.tolist() == [9, 9, 9]


def test_inflight_marks_hits_on_unused_prefetched_slots_for_the_second_phase_and_fill_skips_them():
    """`inflight` (the asynchronous guess): a demand hit on a slot a prefetch brought and nothing used yet gets fill -1
    (its copy may still run: the experts' second phase waits for it), a hit on a used slot 0, a miss 1; fill copies only
    its group's. `groups`: the misses split evenly, in expert order, into copy groups 1..G."""
    n, base, scratch = 6, 0, 50
    table = torch.tensor([0, 1, -1, -1, -1, -1], dtype=torch.int32)
    owner = torch.tensor([0, 1, -1], dtype=torch.int32)
    last = torch.tensor([1, 1, 0], dtype=torch.int64)
    unused = torch.tensor([1, 0, 0], dtype=torch.int8)  # slot 0 (expert 0) prefetched, not used yet
    codes = torch.zeros(n, dtype=torch.int32)
    eff, fill = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
    ko.admit_reference(torch.tensor([[0, 1, 2]]), None, None, table, owner, last, unused, codes, eff, fill, 2, base,
                       scratch, False, inflight=True)
    assert fill.tolist()[:3] == [-1, 0, 1] and codes[0] & ko.PREFETCH_USED and int(unused[0]) == 0
    arena = torch.arange(n * 8, dtype=torch.uint8).reshape(n, 8)
    pool = torch.zeros(3, 8, dtype=torch.uint8)
    ko.fill_reference(arena, pool, 0, eff, fill)
    assert torch.equal(pool[2], arena[2]) and not pool[0].any() and not pool[1].any()
    table = torch.full((8,), -1, dtype=torch.int32)
    owner, last, unused = torch.full((8,), -1, dtype=torch.int32), torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int8)
    codes, eff, fill = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int8)
    ko.admit_reference(torch.tensor([[1, 3, 4, 6, 7]]), None, None, table, owner, last, unused, codes, eff, fill, 1, 0, 50,
                       False, groups=3)
    assert fill.tolist() == [0, 1, 0, 1, 2, 0, 2, 3]  # five misses in three groups: ranks 0-4 -> 1 + r * 3 // 5


@needs_triton
def test_fill_copies_only_flagged_slices():
    rows, words = 6, 3000  # a slice not a multiple of the chunk
    arena = torch.randint(0, 255, (rows, words * 4), dtype=torch.uint8)
    if DEV == "cuda":
        arena = arena.pin_memory()
    pool = torch.zeros(5, words * 4, dtype=torch.uint8, device=DEV)
    eff = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    flags = torch.tensor([1, -1, 1], dtype=torch.int8, device=DEV)  # (-1: in flight from a prefetch, not copied again)
    ko.fill(arena, pool, 2, eff, flags, chunk_words=1024)
    ref = torch.zeros(5, words * 4, dtype=torch.uint8)
    ko.fill_reference(arena, ref, 2, eff.cpu(), flags.cpu())
    assert torch.equal(pool.cpu(), ref)
    assert torch.equal(ref[4], arena[2]) and torch.equal(ref[2], arena[4]) and not ref[0].any()
    flags[0] = 2  # copy group 2: only fill(..., group=2) copies it
    pool.zero_()
    ko.fill(arena, pool, 2, eff, flags, chunk_words=1024, group=2)
    assert torch.equal(pool[4].cpu(), arena[2]) and not pool[2].any() and not pool[0].any()


def test_a_demand_aborts_the_guesses_it_does_not_route_to_and_reuses_their_slots():
    """Abortable guesses: this forward's prefetch for the layer copied experts 2 and 3 (its fill row); the layer routes to
    3 and 4. Guess 2 is aborted before the slot choice: stop[2] = 1, its slot freed and given to the miss 4 (whose copy
    the device cache queues behind the guess's); guess 3 is a hit on an unused prefetched slot (in flight: fill -1).
    A prefetch admission resets its copies' flags; an expert already stopped is skipped by the host fill."""
    n, base, scratch = 6, 0, 50
    table = torch.tensor([0, -1, 1, 2, -1, -1], dtype=torch.int32)  # 0 in slot 0 (used), 2 and 3 guessed into 1 and 2
    owner = torch.tensor([0, 2, 3], dtype=torch.int32)
    last = torch.tensor([1, 5, 5], dtype=torch.int64)
    unused = torch.tensor([0, 1, 1], dtype=torch.int8)
    codes = torch.zeros(n, dtype=torch.int32)
    eff, fill = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
    guessed = torch.tensor([0, 0, 1, 1, 0, 0], dtype=torch.int8)
    stop = torch.zeros(n, dtype=torch.int8)
    ko.admit_reference(torch.tensor([[3, 4]]), None, None, table, owner, last, unused, codes, eff, fill, 6, base, scratch,
                       False, inflight=True, guessed=guessed, stop=stop)
    assert stop.tolist() == [0, 0, 1, 0, 0, 0] and codes[2] == ko.ABORTED
    assert owner.tolist() == [0, 4, 3] and int(table[2]) == -1 and int(table[4]) == 1 and int(table[0]) == 0
    assert fill.tolist() == [0, 0, 0, -1, 1, 0] and codes[4] == ko.ROUTED | ko.MISS  # the freed slot: no eviction
    assert codes[3] == ko.ROUTED | ko.HIT | ko.PREFETCH_USED and unused.tolist() == [0, 0, 0]
    # the next forward's guess for this layer: 2 again, into a free slot... none is free, so the LRU one (slot 0)
    ko.admit_reference(torch.tensor([[2]]), None, None, table, owner, last, unused, codes.zero_(), eff, fill, 7, base,
                       scratch, True, stop=stop)
    assert stop.tolist() == [0] * n and fill.tolist()[2] == 1 and int(table[2]) == 0 and unused.tolist()[0] == 1
    arena = torch.arange(n * 8, dtype=torch.uint8).reshape(n, 8)
    pool = torch.zeros(3, 8, dtype=torch.uint8)
    moved = torch.zeros(n, dtype=torch.int32)
    stop[2] = 1  # (stopped before the host copy started: nothing copied, nothing moved)
    ko.fill_reference(arena, pool, 0, eff, fill, stop=stop, moved=moved)
    assert not pool.any() and not moved.any()
    stop[2] = 0
    ko.fill_reference(arena, pool, 0, eff, fill, stop=stop, moved=moved)
    assert torch.equal(pool[0], arena[2]) and moved.tolist() == [0, 0, 2, 0, 0, 0]


@needs_triton
def test_an_abortable_fill_reports_the_words_it_moved_and_a_stopped_one_copies_nothing():
    rows, words = 6, 5000
    arena = torch.randint(0, 255, (rows, words * 4), dtype=torch.uint8)
    if DEV == "cuda":
        arena = arena.pin_memory()
    pool = torch.zeros(5, words * 4, dtype=torch.uint8, device=DEV)
    eff = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    flags = torch.tensor([1, 0, 1], dtype=torch.int8, device=DEV)
    stop = torch.tensor([0, 0, 1], dtype=torch.int8, device=DEV)  # expert 2: stopped before its copy
    moved = torch.zeros(3, dtype=torch.int32, device=DEV)
    ko.fill(arena, pool, 2, eff, flags, chunk_words=1024, block_words=256, stop=stop, moved=moved)
    assert torch.equal(pool[4].cpu(), arena[2]) and not pool[2].any() and not pool[0].any()
    assert moved.tolist() == [words, 0, 0]
    with pytest.raises(ValueError, match="stop and moved go together"):
        ko.fill(arena, pool, 2, eff, flags, stop=stop)


@pytest.mark.parametrize("name,value", [("PDFLASH_FILL_CHUNK_WORDS", "100"), ("PDFLASH_FILL_BLOCK_WORDS", "big"),
                                        ("PDFLASH_EXPERT_FILL_GROUPS", "9"), ("PDFLASH_EXPERT_FILL_GROUPS", "two")])
def test_fill_shape_and_group_variables_refuse_bad_values_with_their_name(name, value, monkeypatch):
    """A typo in an expert-copy knob stops with the variable's name and the allowed values, not a bare int() error."""
    from verifier_svc import device_cache

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        if name == "PDFLASH_EXPERT_FILL_GROUPS":
            device_cache._fill_groups()
        else:
            ko._words(name, 2048)
    monkeypatch.delenv(name)
    assert ko._words("PDFLASH_FILL_CHUNK_WORDS", 1 << 16) == 1 << 16 and device_cache._fill_groups() == 1


def _layer_run(steps, n: int, c: int, abort: bool):
    """One layer's slots through forwards of (guess, routing) pairs, as the device cache drives them on a CPU: the guess's
    prefetch admission and fill, then the demand admission (aborting the guess's unrouted experts when `abort`) and
    fill. Checks after each forward: the table and the owners agree, no slot holds two experts, and every routed
    expert's slot (partition or overflow) holds that expert's bytes."""
    base, scratch = 0, c
    arena = torch.arange(n, dtype=torch.int32).repeat_interleave(4).reshape(n, 4).view(torch.uint8) + 1
    pool = torch.zeros(c + n, arena.shape[1], dtype=torch.uint8)
    table = torch.full((n,), -1, dtype=torch.int32)
    owner, last = torch.full((c,), -1, dtype=torch.int32), torch.zeros(c, dtype=torch.int64)
    unused, stop, moved = torch.zeros(c, dtype=torch.int8), torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.int32)
    aborted = 0
    for tick, (guess, routed) in enumerate(steps, start=1):
        codes = torch.zeros(n, dtype=torch.int32)
        g_eff, g_fill = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
        ko.admit_reference(torch.tensor([guess]), None, None, table, owner, last, unused, codes, g_eff, g_fill, tick, base,
                           scratch, True, stop=stop if abort else None)
        ko.fill_reference(arena, pool, 0, g_eff, g_fill, stop=stop if abort else None, moved=moved if abort else None)
        eff, fill = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int8)
        ko.admit_reference(torch.tensor([routed]), None, None, table, owner, last, unused, codes, eff, fill, tick, base,
                           scratch, False, inflight=True, guessed=g_fill if abort else None, stop=stop if abort else None)
        ko.fill_reference(arena, pool, 0, eff, fill)
        aborted += int(((codes & ko.ABORTED) != 0).sum())
        held = {int(o) for o in owner if o >= 0}
        assert len(held) == int((owner >= 0).sum())  # no expert in two slots
        for e in range(n):
            s = int(table[e])
            assert (s >= 0) == (e in held) and (s < 0 or int(owner[s - base]) == e)
        for e in set(routed):
            assert torch.equal(pool[int(eff[e])], arena[e]), (tick, e)
            assert not codes[e] & ko.ABORTED
        for e in range(n):  # an aborted guess: not resident, its flag set; with aborts every copied wrong guess is one
            if codes[e] & ko.ABORTED:
                assert abort and int(table[e]) == -1 and int(stop[e]) == 1 and e not in routed
            elif abort and int(g_fill[e]) == 1 and e not in routed:
                raise AssertionError(f"forward {tick}: guess {e} copied, not routed, not aborted")
    return aborted


@given(st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_aborting_guesses_keeps_every_slot_consistent_and_every_routed_expert_exact(data):
    """Property: over random forwards, with and without aborts, the slot state stays consistent and the experts
    kernel reads each routed expert's own bytes; with aborts, every wrong guess is aborted."""
    n = data.draw(st.sampled_from([4, 8, 16, 32]))
    k = data.draw(st.integers(1, min(4, n)))
    c = data.draw(st.integers(1, n))
    picks = st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True)
    steps = data.draw(st.lists(st.tuples(picks, picks), min_size=1, max_size=12))
    assert _layer_run(steps, n, c, abort=False) == 0
    _layer_run(steps, n, c, abort=True)
