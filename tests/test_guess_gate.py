"""The next-layer guess's gate (verifier_svc/guess_gate.py): pure policy, then the device-managed cache on the CPU
switching its guess off through the device flag its forwards read, without a token changing; the guess's width
(how many of the next router's picks it fetches)."""

from __future__ import annotations

import pytest
import torch

from verifier_svc.guess_gate import GuessGate


def _serve(g: GuessGate, ms_on: float, ms_off: float, forwards: int) -> list[bool]:
    ran = []
    for _ in range(forwards):
        on = g.on
        ran.append(on)
        g.observe(on, ms_on if on else ms_off, prefetched=8 if on else 0, used=6 if on else 0)
    return ran


def test_a_guess_that_saves_time_keeps_serving_and_the_other_arm_is_only_probed():
    g = GuessGate(probe_every=6)
    ran = _serve(g, ms_on=10.0, ms_off=14.0, forwards=60)
    assert g.prefer_on and not g.losing
    assert ran.count(False) == 9  # one probe of the other arm in 6 forwards (the 6th, 12th, ...)
    assert abs(g.precision - 0.75) < 1e-9


def test_a_guess_that_costs_time_is_switched_off_and_comes_back_when_it_pays():
    g = GuessGate(probe_every=6)
    ran = _serve(g, ms_on=14.0, ms_off=10.0, forwards=30)
    assert g.losing and ran[-12:].count(True) == 2  # off, but for probes
    _serve(g, ms_on=6.0, ms_off=10.0, forwards=40)  # the routing became predictable
    assert g.prefer_on


def test_within_the_margin_the_serving_arm_stays_and_prefills_are_not_judged():
    g = GuessGate(probe_every=3, margin=0.05)
    _serve(g, ms_on=10.0, ms_off=9.8, forwards=30)
    assert g.prefer_on
    before = list(g._arms[True])
    assert g.observe(True, None, prefetched=100, used=0) == g.on  # a prefill: counts for precision only
    assert list(g._arms[True]) == list(before)
    g.reset()
    assert g.on and g.prefer_on and g.precision is None and g.mean_ms(True) is None


def test_the_device_cache_switches_its_guess_off_through_the_device_flag_and_no_token_changes(tiny):
    """A guess that costs twice its forwards' time (synthetic timings fed to the real gate): the cache turns it off, its
    device flag reads 0, the forwards after prefetch nothing but on probes (1 in 4), and the tokens equal a cache without
    prefetch."""
    from tests.test_gpu_verifier import _no_drafts, _run
    from tests.test_offload import _core, tiny_cache_gb

    gb = tiny_cache_gb(_core(tiny, "qwen3_moe", 1.0), "device")
    prompt = list(range(3, 40))
    want = _run(_core(tiny, "qwen3_moe", gb, prefetch="none"), prompt, _no_drafts)
    core = _core(tiny, "qwen3_moe", gb, prefetch="layer")
    cache = core.target.expert_cache
    cache.judge_guess, cache.gate = True, GuessGate(probe_every=4)
    collect = cache.collect

    def timed(ms=None, tokens=0):  # the guess's forwards take twice as long
        ran = bool(int(cache.guess_on.max()))
        return collect(None if ms is None else (2.0 if ran else 1.0) * tokens, tokens)

    cache.collect = timed
    calls = []
    verify = core.verify
    core.verify = lambda *a, **k: calls.append(verify(*a, **k)) or calls[-1]
    assert _run(core, prompt, _no_drafts) == want
    assert cache.gate.losing and int(cache.guess_on.max()) == 0
    assert sum(c.expert_cache.prefetched for c in calls[:3]) > 0  # it guessed while it measured
    late = [c.expert_cache.prefetched for c in calls[-12:]]
    assert late.count(0) >= 8 and sum(1 for p in late if p > 0) <= 3  # and stopped once it knew, but for probes
    cache.reset_stats()
    assert cache.gate.on and bool(cache.guess_on.all())


def test_guess_k_takes_a_quarter_of_top_k_by_default_and_never_more_than_top_k():
    from pdflash_kernels.installer import guess_k

    assert [guess_k(k, 0) for k in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]
    assert [guess_k(4, w) for w in (1, 2, 4, 9)] == [1, 2, 4, 4]


def test_a_guess_width_keeps_the_routers_best_picks_in_order():
    from types import SimpleNamespace

    from pdflash_kernels.installer import _predict_experts

    g = torch.Generator().manual_seed(0)
    router = SimpleNamespace(weight=torch.randn(8, 16, generator=g), bias=None, top_k=4)
    x = torch.randn(5, 16, generator=g)
    full = _predict_experts(x, router)
    assert full.shape == (5, 4)
    assert torch.equal(_predict_experts(x, router, 2), full[:, :2])
    assert torch.equal(_predict_experts(x, router, 0), full[:, :1])  # auto: a quarter of top_k
    assert torch.equal(_predict_experts(x, router, 7), full)


def test_a_guess_counting_copies_takes_the_best_picks_until_that_many_are_absent():
    """guess_misses: with the next layer's slot table, each row walks the router's ranking until `width` picks are not
    resident; the resident picks on the way stay in, the rest of the row repeats its best pick."""
    from types import SimpleNamespace

    from pdflash_kernels.installer import _predict_experts

    g = torch.Generator().manual_seed(1)
    router = SimpleNamespace(weight=torch.randn(16, 32, generator=g), bias=torch.randn(16, generator=g), top_k=6)
    x = torch.randn(40, 32, generator=g)
    ranked = _predict_experts(x, router)
    for width in (0, 1, 2, 6):
        for trial in range(5):
            table = torch.where(torch.rand(16, generator=g) < 0.5, torch.arange(16) + 100, torch.full((16,), -1))
            got = _predict_experts(x, router, width, table)
            assert got.shape == ranked.shape
            w = max(1, 6 // 4) if width == 0 else width
            for row, picks in zip(got.tolist(), ranked.tolist()):
                want, absent = [], 0
                for e in picks:  # the spec, one row at a time
                    if absent == w:
                        break
                    want.append(e)
                    absent += int(table[e]) < 0
                assert row[: len(want)] == want and set(row[len(want):]) <= {picks[0]}
    # nothing resident: the plain top-width; everything resident: the whole ranking (no copy, every pick protected)
    assert torch.equal(_predict_experts(x, router, 2, torch.full((16,), -1)), torch.cat([ranked[:, :2]] + [ranked[:, :1]] * 4, 1))
    assert torch.equal(_predict_experts(x, router, 2, torch.arange(16)), ranked)


@pytest.mark.parametrize("mode", ["device", "host"])
def test_a_narrower_guess_fetches_fewer_experts_and_no_token_changes(tiny, mode):
    """The tiny qwen3_moe routes top-2 of 8 experts a layer: guessing both of the next router's picks, then only its best
    one (`guess_width`), the tokens equal a cache without prefetch and the narrow guess prefetches fewer experts."""
    from tests.test_gpu_verifier import _no_drafts, _run
    from tests.test_offload import _core, tiny_cache_gb

    gb = tiny_cache_gb(_core(tiny, "qwen3_moe", 1.0, mode=mode), mode)
    prompt = list(range(3, 40))
    want = _run(_core(tiny, "qwen3_moe", gb, prefetch="none", mode=mode), prompt, _no_drafts)
    prefetched = {}
    for width in (2, 1):
        core = _core(tiny, "qwen3_moe", gb, prefetch="layer", mode=mode)
        core.target.expert_cache.guess_width = width
        assert _run(core, prompt, _no_drafts) == want
        prefetched[width] = core.target.expert_cache.stats.prefetched
    assert 0 < prefetched[1] < prefetched[2]


def test_a_guess_counting_copies_prefetches_more_than_one_counting_picks_and_no_token_changes(tiny):
    """The device cache's `guess_misses` reaches the guess: with the best pick already resident a width-1 guess copies
    nothing, one counting copies takes the next absent pick, so it prefetches more; the tokens are a cache's without
    prefetch either way."""
    from tests.test_gpu_verifier import _no_drafts, _run
    from tests.test_offload import _core, tiny_cache_gb

    gb = tiny_cache_gb(_core(tiny, "qwen3_moe", 1.0), "device")
    prompt = list(range(3, 40))
    want = _run(_core(tiny, "qwen3_moe", gb, prefetch="none"), prompt, _no_drafts)
    prefetched = {}
    for misses in (False, True):
        core = _core(tiny, "qwen3_moe", gb, prefetch="layer")
        cache = core.target.expert_cache
        cache.guess_width, cache.guess_misses = 1, misses
        assert _run(core, prompt, _no_drafts) == want
        prefetched[misses] = cache.stats.prefetched
    assert 0 < prefetched[False] < prefetched[True]


def test_the_layer_gate_keeps_the_layers_whose_guesses_are_used_and_probes_the_others():
    """LayerGate: a layer whose guesses are used (layer 0) keeps guessing, one whose guesses go unused (layer 1) stops
    once it has enough prefetches to judge, a layer that prefetches nothing is never judged (layer 2); every
    `probe_every`-th forward guesses on every layer, and a switched-off layer's counts decay until it is measured again."""
    from verifier_svc.guess_gate import LayerGate

    g = LayerGate(3, min_precision=0.5, min_prefetched=6.0, probe_every=10, decay=0.9)
    assert g.on == [True, True, True] and g.precision(0) is None
    on = g.observe([4, 4, 0], [4, 0, 0])  # 4 prefetches each: too few to judge
    assert on == [True, True, True]
    on = g.observe([4, 4, 0], [3, 1, 0])
    assert on == [True, False, True] and g.precision(0) > 0.8 and g.precision(1) < 0.2
    seen = [g.observe([4, 4 if g.on[1] else 0, 0], [4, 0, 0]) for _ in range(40)]
    assert all(s[0] and s[2] for s in seen)  # the good layer and the unjudged one never stop
    back = [i for i, s in enumerate(seen) if s[1]]
    assert back and len(back) <= 8  # the bad one only on probes and when its decayed counts fall below the minimum
    assert seen[7][1]  # the 10th observation since the start is a probe: every layer on
    with pytest.raises(ValueError, match="3 layers"):
        g.observe([1, 2], [1, 2])
    g.reset()
    assert g.on == [True, True, True] and g.precision(1) is None


def test_the_device_cache_applies_the_layer_gate_per_layer_and_no_token_changes(tiny, monkeypatch):
    """The device-managed cache on the CPU with its guess judged (the time gate fed equal timings, so it stays on): with
    a layer gate no layer can fail (precision >= 0) the guessed layer keeps its flag; with one every judged layer fails
    (>= 1.01) its flag goes to 0 and it prefetches a fraction of what it did (probes, 1 in 5 guessing forwards). The
    tokens equal a cache without prefetch either way."""
    import tests.test_gpu_verifier as drive
    from tests.test_gpu_verifier import _no_drafts, _run
    from tests.test_offload import _core, tiny_cache_gb
    from verifier_svc.guess_gate import LayerGate

    monkeypatch.setattr(drive, "NEW", 256)  # (its counts are for 256 new tokens, whatever another module set)
    gb = tiny_cache_gb(_core(tiny, "qwen3_moe", 1.0), "device")
    prompt = list(range(3, 40))
    want = _run(_core(tiny, "qwen3_moe", gb, prefetch="none"), prompt, _no_drafts)
    prefetched, flags = {}, {}
    for min_precision, opted in ((0.0, True), (1.01, True), (1.01, False)):
        core = _core(tiny, "qwen3_moe", gb, prefetch="layer")
        cache = core.target.expert_cache
        assert cache.layer_gate_on  # the default (PDFLASH_EXPERT_GUESS_LAYERS=0 turns it off)
        cache.judge_guess, cache.layer_gate_on = True, opted
        cache.layer_gate = LayerGate(cache.layer_gate.layers, min_precision=min_precision, min_prefetched=0.0, probe_every=5)
        collect = cache.collect
        cache.collect = lambda ms=None, tokens=0, collect=collect: collect(None if ms is None else 1.0 * tokens, tokens)
        assert _run(core, prompt, _no_drafts) == want
        prefetched[min_precision, opted] = cache.stats.prefetched
        flags[min_precision, opted] = (cache.guess_on.tolist(), cache.layer_gate._since_probe)
    assert flags[0.0, True][0] == [1, 1]  # (layer 0 has no layer before it: never guessed, never judged)
    off, since = flags[1.01, True]
    assert off[1] == 0 or since == 0  # off but on a probe's forward
    assert 0 < prefetched[1.01, True] < prefetched[0.0, True] / 2
    assert flags[1.01, False][0] == [1, 1] and prefetched[1.01, False] == prefetched[0.0, True]  # turned off: unjudged


def test_layer_gate_is_on_by_default_and_the_variable_turns_it_off(tiny, monkeypatch):
    """PDFLASH_EXPERT_GUESS_LAYERS: unset on (stop 35's H200 A/B), 0 off, anything else refused with the name."""
    from tests.test_offload import _core, tiny_cache_gb

    gb = tiny_cache_gb(_core(tiny, "qwen3_moe", 1.0), "device")
    monkeypatch.setenv("PDFLASH_EXPERT_GUESS_LAYERS", "0")
    assert not _core(tiny, "qwen3_moe", gb, prefetch="layer").target.expert_cache.layer_gate_on
    monkeypatch.setenv("PDFLASH_EXPERT_GUESS_LAYERS", "yes")
    with pytest.raises(ValueError, match="PDFLASH_EXPERT_GUESS_LAYERS"):
        _core(tiny, "qwen3_moe", gb, prefetch="layer")
