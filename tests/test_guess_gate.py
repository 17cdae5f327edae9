"""The next-layer guess's gate (verifier_svc/guess_gate.py): pure policy, then the device-managed cache on the CPU
turning a guess that never pays off, without a token changing."""

from __future__ import annotations

import pytest

from verifier_svc.guess_gate import GuessGate


def test_a_precise_guess_stays_on():
    g = GuessGate(min_prefetches=10)
    for _ in range(50):
        assert g.observe(True, 8, 7) is True
    assert not g.losing and g.precision == pytest.approx(7 / 8)


def test_an_imprecise_guess_turns_off_but_for_probes_and_comes_back_when_it_pays():
    g = GuessGate(min_prefetches=10, probe_every=4)
    decisions = [g.observe(True, 8, 2) for _ in range(3)]
    assert decisions[0] is True  # too few prefetches measured to judge
    assert g.losing and decisions[-1] is False
    ran = []
    for _ in range(12):  # off: only every 4th forward runs the guess (a probe), still imprecise
        on = g.on
        ran.append(on)
        g.observe(on, 8 if on else 0, 2 if on else 0)
    assert ran.count(True) == 3 and g.losing
    for _ in range(40):  # the routing became predictable: the probes see it and the guess comes back
        on = g.on
        g.observe(on, 8 if on else 0, 8 if on else 0)
    assert g.on and not g.losing


def test_forwards_without_the_guess_do_not_count_and_reset_forgets():
    g = GuessGate(min_prefetches=10)
    for _ in range(5):
        g.observe(True, 8, 1)
    before = (g.prefetched, g.used)
    g.observe(False, 8, 1)  # projection prefetches of a forward that ran no guess: not the guess's record
    assert (g.prefetched, g.used) == pytest.approx(before)
    g.reset()
    assert g.on and not g.losing and g.precision is None


def test_the_device_cache_turns_off_a_guess_that_never_pays_and_no_token_changes(tiny, monkeypatch):
    """Every guess shifted to experts the next layer does not pick: the cache measures it, switches the guess off
    (its device flag: the rows count as none) and the forwards after stop prefetching; tokens equal a cache with no
    prefetch at all."""
    import kernels.installer as inst
    from tests.test_gpu_verifier import _no_drafts, _run
    from tests.test_offload import _core, tiny_cache_gb

    full = _core(tiny, "qwen3_moe", 1.0)
    gb = tiny_cache_gb(full, "device")
    want = _run(_core(tiny, "qwen3_moe", gb, prefetch="none"), list(range(3, 40)), _no_drafts)
    real = inst._predict_experts

    def wrong(x, router):  # the experts the router ranks last: the next layer never routes them (top-2 of 8)
        return real(-x, router)

    monkeypatch.setattr(inst, "_predict_experts", wrong)
    core = _core(tiny, "qwen3_moe", gb, prefetch="layer")
    cache = core.target.expert_cache
    cache.gate = GuessGate(min_prefetches=4, probe_every=1000)
    calls = []
    verify = core.verify
    core.verify = lambda *a, **k: calls.append(verify(*a, **k)) or calls[-1]
    assert _run(core, list(range(3, 40)), _no_drafts) == want
    assert cache.gate.losing and not cache.gate.on and int(cache.guess_on) == 0
    assert calls[0].expert_cache.prefetched > 0 or cache.stats.prefetched > 0  # it guessed before it judged
    assert all(c.expert_cache.prefetched == 0 for c in calls[-5:])  # and stopped once it had
    cache.reset_stats()
    assert cache.gate.on and int(cache.guess_on) == 1
