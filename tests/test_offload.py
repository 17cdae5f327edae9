"""Offloaded MXFP4 experts on the CPU (a host store, a host "slot pool" as the device cache, the torch reference
kernel): greedy output with a cache far smaller than the experts (evicting every round) equals the same MXFP4 model
with every expert cached, in process for three architectures and through the whole stack for one; the byte map is
the store's slices; a cache too small for one layer's routed experts fails at load and says the minimum."""

from __future__ import annotations

import dataclasses
import functools

import grpc
import pytest

from pdflash.client import Client
from pdflash.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import DEVICE, DTYPE, start_stack
from tests.test_gpu_verifier import Session, _no_drafts, _replay, _run

pytestmark = pytest.mark.slow
BIG = 1.0  # GiB: every expert of a tiny model fits


MODES = ["device", "host"]  # who decides what the cache holds (verifier_svc.device_cache / expert_cache)


@pytest.fixture(autouse=True)
def _short_runs(monkeypatch):
    """24 new tokens a request in this module's runs (`tests.test_gpu_verifier.NEW`), restored after each test: a
    module that set it for good changed the runs of every test after it (tests/test_guess_gate.py's counts)."""
    import tests.test_gpu_verifier as drive

    monkeypatch.setattr(drive, "NEW", 24)


def tiny_cache_gb(core, mode: str = "host") -> float:
    """Of the 16 experts of two layers: every forward evicts. host: room for 9 (one layer's 8, the minimum, + 1);
    device: 12 (the overflow range of 8 + a partition of 2 per layer)."""
    return (9.5 if mode == "host" else 12.5) * core.target.expert_cache.store.slice_bytes / 2**30


def _core(tiny, arch, cache_gb, prefetch="union,layer", mode="device", eviction="lru"):
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    return VerifierCore(load_target(tiny.target(arch), DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=cache_gb,
                                    expert_prefetch=prefetch, expert_cache_mode=mode, expert_eviction=eviction),
                        max_block_size=8)


@pytest.mark.parametrize("mode,wide", [("device", False), ("host", False), ("device", True), ("device", "misses")])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_offloaded_equals_every_expert_cached(tiny, arch, mode, wide):
    """wide: the device cache's next-layer guess takes every router pick, so many guesses are wrong and the next layer
    aborts them (PDFLASH_EXPERT_GUESS_ABORT, the default; on a CPU its admission rule runs as on the GPU: the layer
    frees the slots of this forward's guesses it did not route to); "misses": one copy a row, the router's best absent
    pick (PDFLASH_EXPERT_GUESS_MISSES)."""
    full = _core(tiny, arch, BIG, mode=mode)
    small = _core(tiny, arch, tiny_cache_gb(full, mode), mode=mode)
    cache = small.target.expert_cache
    assert cache.num_slots < sum(cache.store.num_experts.values()) < full.target.expert_cache.num_slots + 1
    assert small.target.byte_map == cache.store.byte_map() and small.target.experts_format == "mxfp4"
    if wide:
        assert cache.guess_abort
        cache.guess_misses = wide == "misses"
        cache.guess_width = 1 if cache.guess_misses else 8  # (the tiny models route top-2: width 1 walks past residents)
    prompt = list(range(3, 40))
    want = _run(full, prompt, _no_drafts)
    assert _run(small, prompt, _no_drafts) == want
    assert _run(small, prompt, _replay(want, 3, small.target.vocab_size), width=8) == want
    st = cache.stats
    assert st.evictions > 0 and st.hits + st.misses == st.lookups
    # (a host copy is whole before any abort: every prefetch moved its slice, an aborted one's counts as wasted)
    assert st.bytes_moved == (st.misses + st.prefetched) * cache.store.slice_bytes
    if wide:
        assert 0 < st.prefetch_aborted <= st.prefetched
        assert st.wasted_bytes >= st.prefetch_aborted * cache.store.slice_bytes


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_fragment_word_store_serves_the_same_tokens(tiny, arch, monkeypatch):
    """A store in the fragments format (what a GPU verifier with Gluon holds): through the device cache far smaller than
    the experts, the same greedy tokens as the nibble-order store with every expert cached, at block 1 and with drafts."""
    import tests.test_gpu_verifier as drive
    from pdflash_kernels import moe

    full = _core(tiny, arch, BIG)
    prompt = list(range(3, 40))
    want = _run(full, prompt, _no_drafts)
    assert full.target.expert_cache.store.format == "nibbles"
    monkeypatch.setattr(moe, "expert_format_for", lambda device, layout=None: "fragments")
    small = _core(tiny, arch, tiny_cache_gb(full, "device"))
    cache = small.target.expert_cache
    assert cache.store.format == "fragments" and cache.store.byte_map() == full.target.expert_cache.store.byte_map()
    assert _run(small, prompt, _no_drafts) == want
    assert _run(small, prompt, _replay(want, 3, small.target.vocab_size), width=8) == want
    assert cache.stats.evictions > 0


@pytest.mark.parametrize("mode", MODES)
def test_prefetch_of_a_wrong_projection_changes_nothing(tiny, mode):
    from pdflash.types import DraftResult, union_bytes

    core = _core(tiny, "qwen3_moe", tiny_cache_gb(_core(tiny, "qwen3_moe", BIG), mode), mode=mode)
    prompt = list(range(3, 30))
    want = _run(core, prompt, _no_drafts)
    s = Session(core, prompt, _no_drafts, 1, False)
    layers = core.target.moe_layers
    while not s.done:  # every round projects the experts the last round did NOT route
        s.round += 1
        wrong = {l: frozenset(range(8)) - s.union.get(l, frozenset()) for l in layers}
        res = core.verify(DraftResult(s.sid, s.round, (s.anchor,), wrong, union_bytes(wrong, core.target.byte_map)))
        s.out += res.tokens
        s.anchor, s.union, s.done = res.tokens[-1], res.routed_union, res.finished is not None
    assert s.out == want and core.target.expert_cache.stats.prefetched > 0


@functools.cache
def _gpt_oss_reference(tiny, mode: str = "host"):
    full = _core(tiny, "gpt_oss", BIG)
    return _run(full, list(range(3, 40)), _no_drafts), tiny_cache_gb(full, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", ["none", "union", "layer", "union,layer"])
def test_prefetch_modes_change_no_token_and_each_call_reports_its_own_counters(tiny, prefetch, mode):
    """Union prefetch, next-layer prediction (the next layer's router on this layer's input), both, neither: the
    same tokens. The counters each prefill/verify returns add up to the cache's totals."""
    from verifier_svc.expert_cache import CacheStats

    ref, gb = _gpt_oss_reference(tiny, mode)
    core = _core(tiny, "gpt_oss", gb, prefetch, mode)
    cache = core.target.expert_cache
    assert (cache.prefetch_union, cache.layer_ahead) == ("union" in prefetch, "layer" in prefetch)
    import tests.test_gpu_verifier as drive

    s = Session(core, list(range(3, 40)), _replay(ref, 3, core.target.vocab_size), 4, False)
    calls = []
    verify = core.verify
    core.verify = lambda *a, **k: calls.append(verify(*a, **k)) or calls[-1]
    while not s.done:
        s.step()
    assert s.out == ref[: len(s.out)] and len(s.out) == drive.NEW
    total = cache.stats
    rounds = [c.expert_cache for c in calls]
    prefill = total.minus(functools.reduce(CacheStats.plus, rounds))  # what the prefill did: the cache's totals less the verifies'
    assert prefill.lookups > 0 and min(dataclasses.astuple(prefill)) >= 0
    for r in rounds:
        assert r.hits + r.misses == r.lookups > 0
        assert r.bytes_moved == (r.misses + r.prefetched) * cache.store.slice_bytes
    if prefetch == "none":
        assert total.prefetched == 0
    if "layer" in prefetch:  # predictions were made and some were used, in the verify rounds too (where a projected
        # union exists: it once marked every resident expert needed and left the prediction no slot)
        decode = functools.reduce(CacheStats.plus, rounds)
        assert total.prefetched > 0 and total.prefetch_used > 0 and total.coverage > 0
        assert decode.prefetched > 0 and decode.prefetch_used > 0


@pytest.mark.parametrize("prefetch", ["none", "union,layer"])
def test_cyclic_eviction_changes_no_token_and_its_counters_add_up(tiny, prefetch):
    """--expert-eviction cyclic with a cache that evicts every forward: block 1 and drafted blocks give the tokens of
    every expert cached; each verify's counters add up."""
    ref, gb = _gpt_oss_reference(tiny)
    core = _core(tiny, "gpt_oss", gb, prefetch, mode="host", eviction="cyclic")
    cache = core.target.expert_cache
    assert cache.eviction == "cyclic"
    calls = []
    verify = core.verify
    core.verify = lambda *a, **k: calls.append(verify(*a, **k)) or calls[-1]
    assert _run(core, list(range(3, 40)), _no_drafts) == ref
    assert _run(core, list(range(3, 40)), _replay(ref, 3, core.target.vocab_size), width=8) == ref
    st = cache.stats
    assert st.evictions > 0 and st.hits + st.misses == st.lookups
    assert st.bytes_moved == (st.misses + st.prefetched) * cache.store.slice_bytes
    for r in (c.expert_cache for c in calls):
        assert r.hits + r.misses == r.lookups > 0
        assert r.bytes_moved == (r.misses + r.prefetched) * cache.store.slice_bytes


def test_a_cache_below_one_layer_fails_at_load_with_the_minimum(tiny):
    from verifier_svc.model import load_target

    with pytest.raises(ValueError, match=r"at least \d+ slots"):
        load_target(tiny.target("qwen3_moe"), DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=1e-7)


def test_the_stack_serves_offloaded_experts_as_it_serves_them_cached(tiny, tmp_path):
    outs = []
    for gb in (BIG, tiny_cache_gb(_core(tiny, "gpt_oss", BIG))):
        stack = start_stack(tiny.target("gpt_oss"), None, tmp_path / f"logs-{gb}",
                            verifier_args=["--experts", "mxfp4", "--expert-cache-gb", str(gb)])
        try:
            with Client(stack.drafter) as c:
                outs.append([c.generate("def f(x):\n", max_tokens=24, drafter=d).token_ids for d in ("none", "ngram")])
            with grpc.insecure_channel(stack.verifier) as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                vi = stub.GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
                pre = stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7, 8], max_tokens=8, ignore_eos=True), timeout=30)
                res = stub.Verify(verifier_pb2.VerifyRequest(draft=common_pb2.DraftResult(
                    session_id=pre.session_id, round=1, tokens=[pre.first_token, 9, 10])), timeout=30)
            c = res.expert_cache  # each verify says what its forward did to the cache
            assert c.lookups > 0 and c.hits + c.misses == c.lookups and c.prefetch_aborted <= c.prefetched
            assert c.bytes_moved == (c.misses + c.prefetched) * next(iter(vi.expert_bytes)).expert_bytes[0]
            assert vi.experts_format == "mxfp4"
            slice_bytes = next(iter(vi.expert_bytes)).expert_bytes[0]
            assert vi.expert_cache_bytes > 0 and vi.expert_cache_bytes % slice_bytes == 0  # the experts it can keep
            # the big cache keeps every expert (the drafter then has nothing to price up front), the tiny one not
            assert (vi.expert_cache_bytes == vi.total_expert_bytes) == (gb == BIG)
            sizes = {b for layer in vi.expert_bytes for b in layer.expert_bytes}
            assert len(sizes) == 1 and sizes.pop() % 256 == 0  # every expert is one arena slice
        finally:
            stack.stop()
    assert outs[0] == outs[1] and outs[0][0] == outs[0][1]


def test_pdflash_up_passes_the_expert_options_to_the_verifier():
    from pdflash.cli import _spec, build_parser
    from pdflash.stack import Stack

    from pdflash.config import ConfigError
    from verifier_svc.config import VerifierConfig

    s = _spec(build_parser().parse_args(["up", "--experts", "mxfp4", "--expert-cache-gb", "2", "--expert-prefetch", "layer",
                                         "--expert-eviction", "cyclic"]))
    assert s.verifier_args == ["--experts", "mxfp4", "--expert-cache-gb", "2", "--expert-prefetch", "layer", "--expert-eviction", "cyclic"]
    cmd = Stack(s)._cmd("verifier")
    assert cmd[cmd.index("--expert-prefetch") + 1] == "layer" and cmd[cmd.index("--expert-eviction") + 1] == "cyclic"
    assert _spec(build_parser().parse_args(["up"])).verifier_args == []
    mode = _spec(build_parser().parse_args(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-cache-mode", "host"]))
    assert mode.verifier_args[-2:] == ["--expert-cache-mode", "host"]
    for bad in (["--expert-prefetch", "everything"], ["--expert-eviction", "mru"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["up", *bad])
        assert e.value.code == 2
    assert VerifierConfig().expert_eviction == "lru"
    with pytest.raises(ConfigError, match="--expert-eviction 'mru'"):
        VerifierConfig(expert_eviction="mru").validate()
    with pytest.raises(ConfigError, match="host"):  # a host-cache policy asked of the device-managed cache
        VerifierConfig(experts="mxfp4", expert_cache_gb=1.0, expert_eviction="cyclic").validate()
    share = _spec(build_parser().parse_args(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-arrival-share", "0"]))
    assert share.verifier_args[-2:] == ["--expert-arrival-share", "0"]
    guess = _spec(build_parser().parse_args(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-guess-width", "2"]))
    assert guess.verifier_args[-2:] == ["--expert-guess-width", "2"]
    assert VerifierConfig().expert_guess_width == 0
    overlap = _spec(build_parser().parse_args(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--no-expert-fill-overlap"]))
    assert overlap.verifier_args[-1:] == ["--no-expert-fill-overlap"]
    assert VerifierConfig().expert_fill_overlap is True
    import argparse

    from pdflash.config import add_arguments, from_sources

    parser = argparse.ArgumentParser()
    add_arguments(parser, VerifierConfig)
    args = parser.parse_args(["--no-expert-fill-overlap"])
    assert from_sources(VerifierConfig, args, env={}).expert_fill_overlap is False
    assert from_sources(VerifierConfig, None, env={"PDFLASH_EXPERT_FILL_OVERLAP": "off"}).expert_fill_overlap is False
    with pytest.raises(ConfigError, match=r"--expert-guess-width -1: must be >= 0"):
        VerifierConfig(expert_guess_width=-1).validate()


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_up_refuses_a_guess_width_that_is_not_a_count(value, capsys):
    from pdflash import cli

    assert cli.main(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-guess-width", value]) == 2
    assert f"--expert-guess-width: must be a count >= 0 (0 = auto: a quarter of the router's top_k), got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("value,why", [("1.5", "in [0, 1]"), ("nan", "in [0, 1]"), ("half", "in [0, 1]")])
def test_up_refuses_an_arrival_share_out_of_range(value, why, capsys):
    from pdflash import cli

    assert cli.main(["up", "--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-arrival-share", value]) == 2
    assert why in capsys.readouterr().err



@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_refuses_offload_options_that_cannot_apply_before_anything_starts(command, capsys, monkeypatch):
    """--expert-prefetch / --expert-cache-mode / --expert-eviction without an expert cache were ignored silently, and
    docs/gpu.md's `--expert-eviction cyclic` line (no --expert-cache-mode host) started the stack only for the verifier to
    refuse it: one line and exit code 2 before anything starts. The verifier's own PDFLASH_ variables count."""
    from pdflash import cli

    for name in ("PDFLASH_EXPERT_CACHE_GB", "PDFLASH_EXPERT_CACHE_MODE", "PDFLASH_EXPERT_EVICTION"):
        monkeypatch.delenv(name, raising=False)
    cases = (
        (["--expert-prefetch", "layer"], "--expert-prefetch layer: only for offloaded experts; add --experts mxfp4 --expert-cache-gb"),
        (["--expert-cache-mode", "host", "--expert-eviction", "cyclic"],
         "--expert-cache-mode host, --expert-eviction cyclic: only for offloaded experts"),
        (["--no-expert-fill-overlap"], "--no-expert-fill-overlap: only for offloaded experts"),
        (["--experts", "mxfp4", "--expert-cache-gb", "1", "--expert-eviction", "cyclic"],
         "--expert-eviction cyclic is a policy of --expert-cache-mode host"),
    )
    for argv, words in cases:
        assert cli.main([command, "--model", "/nonexistent", *argv]) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"pdflash {command}: ") and words in err[0], err
    # docs/gpu.md's line, and the same through the verifier's environment, pass these checks (then no model there)
    assert cli.main([command, "--model", "/nonexistent", "--experts", "mxfp4", "--expert-cache-gb", "4",
                     "--expert-cache-mode", "host", "--expert-eviction", "cyclic"]) == 2
    assert "--model '/nonexistent': no config.json" in capsys.readouterr().err
    monkeypatch.setenv("PDFLASH_EXPERT_CACHE_GB", "4")
    monkeypatch.setenv("PDFLASH_EXPERT_CACHE_MODE", "host")
    assert cli.main([command, "--model", "/nonexistent", "--expert-eviction", "cyclic"]) == 2
    assert "--model '/nonexistent': no config.json" in capsys.readouterr().err

@pytest.mark.parametrize("mode", MODES)
def test_a_projection_streamed_in_from_another_thread_mid_forward_changes_nothing(tiny, mode):
    """The servicer calls cache.arriving() the moment a Verify arrives (and for the scheduler's Prefetch hints), from
    its own thread, while another verify's forward may be running: with a thread hammering the cache that way during
    every forward, the tokens stay the same and the forwards' pinned slots are never taken (host mode: the lock;
    device mode: an arrival during a forward waits for its collect())."""
    import random
    import threading

    ref, gb = _gpt_oss_reference(tiny, mode)
    core = _core(tiny, "gpt_oss", gb, mode=mode)
    cache = core.target.expert_cache
    n = cache.store.num_experts
    assert cache.arriving({99: {0}, min(n): {-1, 10**6}}) == 0  # unknown layers and out-of-range experts are ignored
    stop = threading.Event()
    rng = random.Random(0)

    def hammer():
        while not stop.is_set():
            cache.arriving({l: {rng.randrange(e) for _ in range(3)} for l, e in n.items()})

    t = threading.Thread(target=hammer)
    t.start()
    try:
        got = _run(core, list(range(3, 40)), _no_drafts)
    finally:
        stop.set()
        t.join()
    assert got == ref and cache.stats.prefetched > 0
