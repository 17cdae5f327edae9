"""The offloaded experts' host store and device slot cache (verifier_svc/expert_store.py, expert_cache.py), on the
CPU: a host "slot pool" and the torch reference kernel exercise every path but the CUDA copies."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdflash_kernels.installer import expert_weights, experts_modules
from pdflash_kernels.reference import moe_reference
from tests.conftest import DEVICE, DTYPE
from verifier_svc.expert_cache import ExpertCache, min_slots
from verifier_svc.expert_store import HostExpertStore

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def store(request, tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny.target(request.param), dtype=getattr(torch, DTYPE)).to(DEVICE)
    s = HostExpertStore.from_model(model)
    s.model = model
    return s


def test_store_holds_each_expert_as_one_slice_and_the_byte_map_says_so(store):
    layers = experts_modules(store.model)
    assert store.byte_map() == {l: [store.layout.nbytes] * len(store.byte_map()[l]) for l in layers}
    assert store.total_bytes == sum(len(v) for v in store.byte_map().values()) * store.slice_bytes
    for layer, module in layers.items():
        w = expert_weights(module, "mxfp4")
        for e in (0, w.w1.shape[0] - 1):
            v = store.layout.views(store.slice(layer, e).reshape(1, -1))
            assert torch.equal(v["w1_blocks"][0], w.w1[e]) and torch.equal(v["w2_scales"][0], w.s2[e])
            if w.b1 is not None:
                assert torch.equal(v["b1"][0], w.b1[e])


def test_counters_add_up_and_lru_keeps_pinned_experts(store):
    layer = next(iter(store.num_experts))
    need = 2
    with pytest.raises(ValueError, match=r"at least 3 slots"):
        ExpertCache(store, 2, CPU, need=3)
    cache = ExpertCache(store, 3, CPU, need=need)
    cache.lookup(layer, [0, 1])
    cache.release()
    cache.lookup(layer, [1, 2])  # 1 hits; 2 fills the last free slot
    cache.release()
    cache.lookup(layer, [3])  # evicts the least recently used: expert 0
    assert not cache.resident(layer, 0) and all(cache.resident(layer, e) for e in (1, 2, 3))
    cache.lookup(layer, [2])  # pinned with 3 now
    cache.lookup(layer, [4])  # must evict 1 (2 and 3 are pinned)
    assert cache.resident(layer, 2) and cache.resident(layer, 3) and not cache.resident(layer, 1)
    cache.release()
    st = cache.stats
    assert st.hits + st.misses == st.lookups == 7
    assert (st.hits, st.misses, st.evictions) == (2, 5, 2)
    assert st.bytes_moved == (st.misses + st.prefetched) * store.slice_bytes
    table = cache.tables[layer]
    for e in (2, 3, 4):  # the table points at slots holding exactly the expert's slice
        assert torch.equal(cache.pool[int(table[e])], store.slice(layer, e))
    assert int(table[0]) == int(table[1]) == -1


def test_prefetch_counts_used_and_wasted_bytes(store):
    layer = next(iter(store.num_experts))
    cache = ExpertCache(store, 2, CPU, need=1)
    assert cache.prefetch({layer: {0, 1}}) == 2
    cache.lookup(layer, [0])  # a prefetched expert used
    cache.release()
    cache.lookup(layer, [2])  # evicts 1, prefetched and never used
    st = cache.stats
    assert (st.prefetched, st.prefetch_used, st.hits, st.misses) == (2, 1, 1, 1)
    assert st.wasted_bytes == store.slice_bytes and st.bytes_moved == 3 * store.slice_bytes
    cache.release()
    cache.lookup(layer, [2, 3])
    assert cache.prefetch({layer: {5}}) == 0  # every slot pinned: a prefetch never evicts those


def test_a_prefetch_never_evicts_what_an_earlier_prefetch_brought_for_later(store):
    """A projected union larger than the cache fills the free slots and stops: it does not evict its own unused
    slices (they would be wasted) nor pinned ones; a forward's demand may still evict unused prefetches."""
    layer = next(iter(store.num_experts))
    cache = ExpertCache(store, 3, CPU, need=1)
    assert cache.prefetch({layer: {0, 1, 2, 3, 4}}) == 3
    assert cache.stats.wasted_bytes == 0 and cache.stats.evictions == 0
    cache.lookup(layer, [0])  # used: now an ordinary resident expert, evictable by a later prefetch
    cache.release()
    assert cache.prefetch({layer: {5, 6}}) == 1 and cache.resident(layer, 5) and not cache.resident(layer, 0)
    st = cache.stats
    assert (st.prefetched, st.prefetch_used, st.evictions, st.wasted_bytes) == (4, 1, 1, 0)
    assert st.coverage == 1.0  # the one expert a forward needed came from a prefetch


def test_a_projection_larger_than_the_cache_streams_in_a_window_ahead_of_the_layers(store):
    """begin() prefetches the projected layers that fit in half the cache; advance(l) adds layer l + window."""
    layers = sorted(store.num_experts)
    cache = ExpertCache(store, 4, CPU, need=1)
    projection = {l: {0, 1} for l in layers}  # 2 experts a layer: a window of 4 / 2 / 2 = 1 layer
    assert cache.begin(projection) == 2 and cache._window == 1
    assert all(cache.resident(layers[0], e) for e in (0, 1)) and not cache.resident(layers[1], 0)
    cache.lookup(layers[0], [0, 1])
    cache.release()
    assert cache.advance(layers[0]) == 2 and cache.resident(layers[1], 0) and cache.resident(layers[1], 1)
    assert cache.stats.wasted_bytes == 0 and cache.advance(layers[-1]) == 0
    assert cache.begin({}) == 0 and cache.advance(layers[0]) == 0  # no projection, nothing ahead


def test_experts_read_through_the_cache_equal_the_resident_store(store):
    """The same reference kernel over the slot pool + slot table as over all experts resident: bit-identical, with
    a cache so small that every call evicts."""
    g = torch.Generator().manual_seed(0)
    hidden = store.layout.hidden
    resident = store.weights(store.arena)
    for layer, n in store.num_experts.items():
        cache = ExpertCache(store, min_slots(store), CPU, need=min_slots(store))
        first = store.row(layer, 0)
        for step in range(4):
            x = torch.randn(4, hidden, generator=g)
            ids = torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(4)])
            wts = torch.softmax(torch.randn(4, 2, generator=g), -1)
            table = cache.lookup(layer, ids.unique().tolist())
            got = moe_reference(x, ids, wts, cache.weights, n, slot_of_expert=table)
            want = moe_reference(x, ids, wts, resident, n, slot_of_expert=torch.arange(first, first + n))
            cache.release()
            assert torch.equal(got, want), (layer, step)
        assert cache.stats.evictions > 0 or n <= cache.num_slots


def _three_layer_store() -> HostExpertStore:
    from pdflash_kernels.mxfp4 import ExpertLayout
    from verifier_svc.expert_store import GateLayout

    return HostExpertStore(ExpertLayout(64, 64, False), {0: 4, 1: 4, 2: 4}, GateLayout(1, 64, 0, 1.0, 7.0))


def test_cyclic_eviction_spares_the_layers_ahead_and_evicts_cold_slots_first():
    """A forward visits layers 0, 1, 2 in turn: when every slot is expected, LRU evicts layer 0's expert (used longest
    ago, needed next), cyclic the one of the layer just run before (needed last); a layer's lookup turns its experts
    it did not route cold, and a cold slot goes before any expected one. Pins and unused prefetches are spared."""
    def drive(eviction):
        store = _three_layer_store()
        cache = ExpertCache(store, 4, CPU, need=2, eviction=eviction)
        for layer, experts in ((0, [0]), (1, [0]), (2, [0]), (0, [0]), (1, [0, 1]), (2, [0, 1])):
            cache.lookup(layer, experts)
            cache.release()
        return cache

    lru, cyc = drive("lru"), drive("cyclic")
    assert not lru.resident(0, 0) and lru.resident(1, 0)
    assert cyc.resident(0, 0) and not cyc.resident(1, 0) and cyc.resident(1, 1) and cyc.resident(2, 1)
    cyc.lookup(0, [2])  # (0, 0) not routed: cold, evicted before any expected slot
    assert not cyc.resident(0, 0) and all(cyc.resident(l, e) for l, e in ((0, 2), (1, 1), (2, 0), (2, 1)))
    cyc.release()
    assert cyc.prefetch({1: {2, 3}}) == 2  # layer 0 just ran: its expert goes first, then layer 2's (the one before)
    assert cyc.resident(1, 2) and cyc.resident(1, 3) and not cyc.resident(0, 2) and not cyc.resident(2, 0)
    assert cyc.prefetch({0: {0, 1, 3}}) == 2  # takes (2, 1) and (1, 1), never the unused prefetches (1, 2), (1, 3)
    assert cyc.resident(1, 2) and cyc.resident(1, 3) and cyc.prefetch({2: {3}}) == 0
    st = cyc.stats
    assert st.hits + st.misses == st.lookups == 9 and (st.hits, st.misses) == (3, 6)
    assert st.evictions == 1 + 1 + 2 + 2 and st.prefetched == 4 and st.wasted_bytes == 0
    assert st.bytes_moved == (st.misses + st.prefetched) * cyc.store.slice_bytes
    table = cyc.tables[1]
    for e in (2, 3):  # the slot tables follow the evictions
        assert torch.equal(cyc.pool[int(table[e])], cyc.store.slice(1, e))
    assert int(cyc.tables[2][0]) == int(cyc.tables[0][2]) == -1
    with pytest.raises(ValueError, match="eviction"):
        ExpertCache(_three_layer_store(), 4, CPU, need=1, eviction="mru")


def test_cyclic_eviction_never_takes_a_pinned_slot_and_fails_like_lru_when_all_are():
    store = _three_layer_store()
    cache = ExpertCache(store, 3, CPU, need=3, eviction="cyclic")
    cache.lookup(0, [0, 1, 2])
    with pytest.raises(RuntimeError, match="pinned"):
        cache.lookup(1, [0])
    cache.release()
    cache.lookup(1, [0, 1])  # evicts two of layer 0's (the only ones), keeps the pinned ones of this layer
    cache.lookup(1, [2])
    assert cache.resident(1, 0) and cache.resident(1, 1) and cache.resident(1, 2)


# ---- the device-managed cache's arrivals (verifier_svc/device_cache.py `arriving`), on the CPU references ----------

def _device_cache(partition: int = 4, share: float = 0.5, prefetch: str = "union"):
    """Three layers of 4 experts, `partition` slots each (+ the overflow range of 4); the arena's slices distinct."""
    from verifier_svc.device_cache import DeviceExpertCache

    store = _three_layer_store()
    g = torch.Generator().manual_seed(0)
    store.arena.copy_(torch.randint(0, 100, store.arena.shape, generator=g, dtype=torch.uint8))
    cache = DeviceExpertCache(store, 4 + 3 * partition, CPU, need=4, prefetch=prefetch, arrival_share=share)
    assert cache.sizes == [partition] * 3
    return cache


def _forward(cache, routed: dict[int, list[int]]) -> None:
    """One forward as the verifier core brackets it: begin, each layer's experts call (its rows route `routed[layer]`,
    one expert a row), collect."""
    from types import SimpleNamespace

    cache.begin({})
    for layer in cache.layers:
        ids = torch.tensor([[e] for e in routed.get(layer, [0])])
        x = torch.zeros(ids.shape[0], cache.store.layout.hidden)
        cache.forward_experts(SimpleNamespace(_pdflash_num_experts=4), layer, x, ids, torch.ones(ids.shape), None)
    cache.collect()


def test_device_arrival_makes_the_next_forwards_lookups_hits_counted_as_prefetch():
    cache = _device_cache()
    # 2 slots of each layer's 4 at most (share 0.5), 6 in all; unknown layers and out-of-range ids ignored
    assert cache.arriving({0: {1, 2, 3}, 1: {0}, 2: {0, 1, 9}, 7: {0}}) == 2 + 1 + 2
    for layer, e in ((0, 1), (0, 2), (1, 0), (2, 0), (2, 1)):
        assert cache.resident(layer, e)
        assert torch.equal(cache.pool[int(cache.table[layer, e])], cache.store.slice(layer, e))
    assert not cache.resident(0, 3)  # beyond layer 0's share
    assert cache.stats.prefetched == 0  # counted with the next forward
    _forward(cache, {0: [1, 2], 1: [0], 2: [3]})
    st = cache.stats
    assert (st.lookups, st.hits, st.misses) == (4, 3, 1)
    assert (st.prefetched, st.prefetch_used, st.evictions, st.wasted_bytes) == (5, 3, 0, 0)
    assert st.bytes_moved == (st.misses + st.prefetched) * cache.store.slice_bytes and st.coverage == 3 / 4
    _forward(cache, {0: [1], 1: [0], 2: [1]})  # (2, 1): a prefetch used a forward later still counts once
    assert cache.stats.prefetch_used == 4 and cache.stats.hits == 6


def test_device_arrival_never_evicts_an_unused_prefetch():
    cache = _device_cache(partition=2, share=1.0)
    assert cache.arriving({0: {0, 1}}) == 2
    cache.arriving({0: {2, 3}})  # both slots hold prefetches nobody used yet: nothing taken
    assert cache.resident(0, 0) and cache.resident(0, 1) and not cache.resident(0, 2) and not cache.resident(0, 3)
    _forward(cache, {0: [0], 1: [0], 2: [0]})  # uses (0, 0); (0, 1) stays an unused prefetch
    cache.arriving({0: {2, 3}})  # may take (0, 0)'s slot only
    assert cache.resident(0, 1) and cache.resident(0, 2) and not cache.resident(0, 0) and not cache.resident(0, 3)
    _forward(cache, {0: [1], 1: [0], 2: [0]})
    st = cache.stats
    assert (st.prefetched, st.prefetch_used, st.evictions, st.wasted_bytes) == (3, 2, 1, 0)
    assert st.bytes_moved == (st.misses + st.prefetched) * cache.store.slice_bytes


def test_device_arrival_during_a_forward_waits_for_it_and_its_counters_join_the_next():
    cache = _device_cache()
    cache.begin({})  # a forward runs (from another thread in the server): the arrival is kept
    assert cache.arriving({0: {3}, 1: {3}}) == 2
    assert not cache.resident(0, 3) and not cache.resident(1, 3)
    for layer in cache.layers:
        from types import SimpleNamespace

        ids = torch.tensor([[0]])
        cache.forward_experts(SimpleNamespace(_pdflash_num_experts=4), layer, torch.zeros(1, 64), ids, torch.ones(1, 1), None)
    cache.collect()  # the forward is done: the kept arrival runs now
    assert cache.resident(0, 3) and cache.resident(1, 3) and cache.stats.prefetched == 0
    _forward(cache, {0: [3], 1: [3], 2: [0]})
    st = cache.stats
    assert (st.prefetched, st.prefetch_used) == (2, 2) and st.hits + st.misses == st.lookups == 6
    cache.arriving({2: {2}})
    cache.reset_stats()  # forgets the arrival's counters (the warm-up's), keeps what is resident
    _forward(cache, {})
    assert cache.stats.prefetched == 0 and cache.resident(2, 2)


def test_device_arrival_is_off_without_union_prefetch_or_share():
    assert _device_cache(prefetch="layer").arriving({0: {1}}) == 0
    off = _device_cache(share=0.0)
    assert off.arriving({0: {1}}) == 0 and not off.resident(0, 1)


def test_device_begin_marks_the_projection_in_range_and_forgets_the_last_one():
    cache = _device_cache()
    # layer 0: 9 is out of range (4 experts); layer 1: a list with a repeat counts each entry; layer 7 is not a layer
    assert cache.begin({0: {1, 3, 9}, 1: [0, 0], 7: {1}}) == 4
    assert cache.proj.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    cache.collect()
    assert cache.begin({2: frozenset({2})}) == 1
    assert cache.proj.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    cache.collect()
    layer_only = _device_cache(prefetch="layer")
    assert layer_only.begin({0: {1}}) == 0 and int(layer_only.proj.sum()) == 0
    layer_only.collect()


def test_kept_bytes_is_what_a_cache_can_keep_resident():
    """The verifier's model info reports it (`expert_cache_bytes`): below the store's total, some expert must stream."""
    from verifier_svc.device_cache import DeviceExpertCache

    store = _three_layer_store()  # 12 experts
    assert ExpertCache(store, 5, CPU, need=1).kept_bytes == 5 * store.slice_bytes
    assert ExpertCache(store, 40, CPU, need=1).kept_bytes == store.total_bytes  # never more than every expert
    small = DeviceExpertCache(store, 4 + 6, CPU, need=4)  # the overflow range (4) passes experts through
    assert small.kept_bytes == sum(small.sizes) * store.slice_bytes < store.total_bytes
    assert DeviceExpertCache(store, 4 + 12, CPU, need=4).kept_bytes == store.total_bytes


def test_a_pair_word_store_holds_the_same_slices_in_pair_words_and_serves_the_same_experts(store):
    """`pair_words` (what a GPU verifier's store holds with PDFLASH_FP4_PAIR_WORDS=1): the same slice sizes and byte map,
    each slice's blocks as pdflash_kernels.mxfp4.to_pair_words of the nibble-order store's (scales and biases as they are), its
    ExpertWeights say so, and the torch reference serves the same outputs from it. put_expert converts nibble-order parts."""
    from pdflash_kernels import mxfp4

    model = store.model
    pw = HostExpertStore.from_model(model, pair_words=True)
    assert pw.byte_map() == store.byte_map() and pw.slice_bytes == store.slice_bytes
    layer = next(iter(store.num_experts))
    for e in (0, store.num_experts[layer] - 1):
        a = store.layout.views(store.slice(layer, e).reshape(1, -1))
        b = pw.layout.views(pw.slice(layer, e).reshape(1, -1))
        for name in a:
            want = mxfp4.to_pair_words(a[name][0]) if name.endswith("_blocks") else a[name][0]
            assert torch.equal(b[name][0], want), name
    w, wp = store.layer_weights(layer), pw.layer_weights(layer)
    assert wp.pair_words and not w.pair_words
    g = torch.Generator().manual_seed(0)
    n = store.num_experts[layer]
    x = torch.randn(3, store.layout.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2, generator=g), -1)
    assert torch.equal(moe_reference(x, ids, wts, wp, n), moe_reference(x, ids, wts, w, n))
    parts = {k: v[0] for k, v in store.layout.views(store.slice(layer, 1).reshape(1, -1)).items()}
    pw.put_expert(layer, 0, parts)  # nibble-order parts (a checkpoint's bytes) into the pair-word store
    assert torch.equal(pw.slice(layer, 0), pw.slice(layer, 1))


def test_a_fragment_store_holds_the_same_slices_as_fragment_words_and_serves_the_same_experts(store):
    """The fragments format (a GPU verifier's store with Gluon, PDFLASH_FP4_FRAGMENTS=1): the same slice sizes and byte
    map; each slice's weights and scales are pdflash_kernels.fragments.to_fragment_parts of the nibble-order store's
    (biases as they are); its weights are FragmentExperts over the arena (no copy) that give back the nibble-order
    experts, and the torch reference serves the same outputs from them. put_expert converts nibble-order parts."""
    from pdflash_kernels import fragments as F

    model = store.model
    fs = HostExpertStore.from_model(model, fmt="fragments")
    assert fs.format == "fragments" and not fs.pair_words and not fs.demoted
    assert fs.byte_map() == store.byte_map() and fs.slice_bytes == store.slice_bytes
    g = store.gate
    layer = next(iter(store.num_experts))
    n = store.num_experts[layer]
    w, wf = store.layer_weights(layer), fs.layer_weights(layer)
    assert isinstance(wf, F.FragmentExperts) and wf.w1.data_ptr() == fs.slice(layer, 0).data_ptr()  # a view
    back = wf.to_weights()
    for name in ("w1", "s1", "w2", "s2", "b1", "b2"):
        a, b = getattr(w, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    nib = {k: v for k, v in store.layout.views(store.arena).items() if not k.startswith("b")}
    raw = F.to_fragment_parts(nib, g.row_mul, g.up_off)
    for name, want in raw.items():
        assert torch.equal(F.section_bytes(fs.arena, fs.layout, name), want), name
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, store.layout.hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n, generator=gen)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2, generator=gen), -1)
    assert torch.equal(moe_reference(x, ids, wts, wf, n), moe_reference(x, ids, wts, w, n))
    parts = {k: v[0] for k, v in store.layout.views(store.slice(layer, 1).reshape(1, -1)).items()}
    fs.put_expert(layer, 0, parts)  # nibble-order parts (a checkpoint's bytes) into the fragment store
    assert torch.equal(fs.slice(layer, 0), fs.slice(layer, 1))


def test_a_fragment_store_turns_into_pair_words_when_a_scale_byte_is_above_128(store):
    """Fragment words decode scale bytes up to 128 only (|w| <= 12 a group): a store that meets a larger one while
    loading turns every slice into pair words (`demoted`), layers put before it included, and serves the same experts."""
    from pdflash_kernels import mxfp4

    model = store.model
    fs = HostExpertStore.from_model(model, fmt="fragments")
    layers = list(store.num_experts)
    parts = {k: v[0].clone() for k, v in store.layout.views(store.slice(layers[-1], 0).reshape(1, -1)).items()}
    parts["w2_scales"][0, 0] = 140  # (a group of weights up to 6 * 2^13)
    fs.put_expert(layers[-1], 0, parts)
    assert fs.demoted and fs.format == "pair_words" and fs.big_scales
    for layer in layers:
        w, wp = store.layer_weights(layer), fs.layer_weights(layer)
        assert wp.pair_words and wp.big_scales
        e0 = 1 if layer == layers[-1] else 0  # (expert 0 of the last layer was replaced)
        assert torch.equal(mxfp4.nibble_blocks(wp.w1, True)[e0:], w.w1[e0:])
        assert torch.equal(wp.s1[e0:], w.s1[e0:]) and torch.equal(wp.s2[e0:], w.s2[e0:])
    assert int(fs.layer_weights(layers[-1]).s2[0, 0, 0]) == 140
    with pytest.raises(ValueError, match="multiples of 64"):
        from pdflash_kernels.mxfp4 import ExpertLayout
        from verifier_svc.expert_store import GateLayout

        HostExpertStore(ExpertLayout(64, 32, False), {0: 2}, GateLayout(1, 32, 0, 1.0, 7.0), fmt="fragments")


def test_a_cache_made_before_the_store_turned_into_pair_words_reads_pair_words():
    """A verifier sizes its expert cache before it reads the experts (verifier_svc.model.load_direct): when the store
    turns into pair words while loading, the cache's weights follow at its next lookup (else the pool's pair-word
    slices would be read as fragment words)."""
    from pdflash_kernels import fragments as F
    from pdflash_kernels import mxfp4
    from pdflash_kernels.mxfp4 import ExpertLayout
    from verifier_svc.expert_store import GateLayout

    store = HostExpertStore(ExpertLayout(64, 64, False), {0: 4, 1: 4}, GateLayout(1, 64, 0, 1.0, 7.0), fmt="fragments")
    cache = ExpertCache(store, 5, CPU, need=1)
    assert isinstance(cache.weights, F.FragmentExperts)
    b1, s1 = mxfp4.quantize(torch.randn(128, 64) * 0.05)
    b2, s2 = mxfp4.quantize(torch.randn(64, 64) * 0.05)
    s2[3, 1] = 150
    store.put_expert(1, 2, dict(w1_blocks=b1, w1_scales=s1, w2_blocks=b2, w2_scales=s2))
    assert store.demoted
    cache.lookup(1, [2])
    w = cache.weights
    assert not getattr(w, "fragments", False) and w.pair_words and w.big_scales
    slot = int(cache.lookup(1, [2])[2])
    assert torch.equal(mxfp4.nibble_blocks(w.w2[slot], True), b2) and torch.equal(w.s2[slot], s2)


def test_the_store_format_a_device_gets(monkeypatch):
    """CPU: nibbles. A GPU: fragment words where Gluon is installed and the shape fits (PDFLASH_FP4_FRAGMENTS=1, the
    default), else pair words (PDFLASH_FP4_PAIR_WORDS=1, the default), else nibbles; other values refused at import."""
    from pdflash_kernels import fragments, moe
    from pdflash_kernels.mxfp4 import ExpertLayout

    assert moe.expert_format_for("cpu") == "nibbles"
    monkeypatch.setattr(fragments, "gluon", object())
    assert moe.expert_format_for("cuda", ExpertLayout(2880, 2880, True)) == "fragments"
    assert moe.expert_format_for("cuda", ExpertLayout(2880, 2880 + 32, True)) == "pair_words"  # does not fit
    monkeypatch.setattr(moe, "FRAGMENTS", False)
    assert moe.expert_format_for("cuda", ExpertLayout(2880, 2880, True)) == "pair_words"
    monkeypatch.setattr(moe, "PAIR_WORDS", False)
    assert moe.expert_format_for("cuda") == "nibbles"
    from tests.test_kernels import _import_refuses

    _import_refuses("PDFLASH_FP4_FRAGMENTS", "yes", "pdflash_kernels.moe")


def test_the_installation_report_names_pair_words(tiny):
    """The model info's kernels JSON says which stored form the MXFP4 experts take (an operator can tell a GPU store's
    pair words from the nibble order): resident experts and an expert cache over a pair-word store."""
    import dataclasses

    from pdflash_kernels import mxfp4
    from pdflash_kernels.installer import serve_offloaded_experts
    from verifier_svc.expert_cache import new_cache

    model = AutoModelForCausalLM.from_pretrained(tiny.target("qwen3_moe"), dtype=getattr(torch, DTYPE)).to(DEVICE)
    store = HostExpertStore.from_model(model)
    layer, module = next(iter(experts_modules(model).items()))
    w = store.layer_weights(layer)
    module._pdflash_mxfp4 = dataclasses.replace(w, w1=mxfp4.to_pair_words(w.w1), w2=mxfp4.to_pair_words(w.w2), pair_words=True)
    try:
        import pdflash_kernels

        inst = pdflash_kernels.install(model, experts_format="mxfp4", probe=False)
        try:
            assert inst.experts[layer] == "triton mxfp4 (pair words)"
        finally:
            inst.uninstall()
    finally:
        del module._pdflash_mxfp4
    pw = HostExpertStore.from_model(model, pair_words=True)
    fs = HostExpertStore.from_model(model, fmt="fragments")
    for store, words in ((pw, "pair words"), (fs, "fragment words")):
        serve_offloaded_experts(model, new_cache(store, 1e9, CPU, prefetch=""))
        inst = pdflash_kernels.install(model, experts_format="mxfp4", probe=False)
        try:
            assert inst.experts[layer] == f"triton mxfp4 (offloaded: expert cache, {words})"
        finally:
            inst.uninstall()


@pytest.mark.parametrize("name,attr,default", [("PDFLASH_EXPERT_GUESS_ASYNC", "guess_async", True),
                                               ("PDFLASH_EXPERT_GUESS_ABORT", "guess_abort", True),
                                               ("PDFLASH_EXPERT_GUESS_MISSES", "guess_misses", False)])
def test_the_device_cache_guess_flags_follow_their_variables(name, attr, default, monkeypatch):
    """PDFLASH_EXPERT_GUESS_ASYNC (on since stop 31's H200 A/B), PDFLASH_EXPERT_GUESS_ABORT (stop 38's) and
    PDFLASH_EXPERT_GUESS_MISSES (opt-in, stop 39): unset their default, 1 on, 0 off, another value refused with the name."""
    from verifier_svc.device_cache import DeviceExpertCache

    store = _three_layer_store()
    monkeypatch.delenv(name, raising=False)
    assert getattr(DeviceExpertCache(store, 4 + 6, CPU, need=4), attr) is default
    monkeypatch.setenv(name, "1")
    assert getattr(DeviceExpertCache(store, 4 + 6, CPU, need=4), attr) is True
    monkeypatch.setenv(name, "0")
    assert getattr(DeviceExpertCache(store, 4 + 6, CPU, need=4), attr) is False
    monkeypatch.setenv(name, "on")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        DeviceExpertCache(store, 4 + 6, CPU, need=4)
