"""Offloaded MXFP4 experts on a CUDA GPU (skipped without one): real layer shapes in bf16 (gpt-oss-20b and
Qwen3-30B-A3B, two layers, random weights), the experts in a pinned host store served through a device cache far
smaller than the experts (every forward evicts) give greedy output token for token equal to the same MXFP4 experts
all resident on the GPU, at block 1 and with drafts at block 16, with every prefetch mode (the projected union,
next-layer prediction, both, none), for the device-managed cache (every decision and copy inside one CUDA graph per
forward: verifier_svc.device_cache) and the host-managed one (one graph per layer: verifier_svc.expert_cache). The reference is the resident-MXFP4 verifier on the same GPU, bf16, with the
same kernels. Run on the GPU machine with `bash benchmarks/gpu.sh OUT tests`."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_verifier import _no_drafts, _prompts, _replay, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    from pdflash.tiny import make_real_shape_checkpoint

    return make_real_shape_checkpoint(tmp_path_factory.mktemp(request.param), request.param, device="cuda")


def _core(d, cache_gb: float, prefetch: str = "union,layer", mode: str = "device", overlap: bool = True,
          guess_async: bool = False, groups: int = 1, abort: bool = False):
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(d, "cuda", "bfloat16", kernels="on", experts="mxfp4", expert_cache_gb=cache_gb, expert_prefetch=prefetch,
                         expert_cache_mode=mode)
    if target.expert_cache is not None and mode == "device":
        target.expert_cache.fill_overlap = overlap  # (before the graphs capture)
        target.expert_cache.guess_async = guess_async
        target.expert_cache.fill_groups = groups
        target.expert_cache.guess_abort = bool(abort)
        if abort == "misses":  # the router's best absent pick a row (PDFLASH_EXPERT_GUESS_MISSES)
            target.expert_cache.guess_misses, target.expert_cache.guess_width = True, 1
        elif abort:  # every router pick guessed: many wrong guesses, each stopped by the next layer's admission
            target.expert_cache.guess_width = 64
    return VerifierCore(target, max_block_size=16, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=2))


# (prefetch, mode, overlap, guess_async, groups, abort). Device mode copies a layer's misses while its resident experts
# compute (--expert-fill-overlap; False: copies first); guess_async: the next layer waits only for the guess's admission
# (PDFLASH_EXPERT_GUESS_ASYNC); groups: the misses in that many copy groups (PDFLASH_EXPERT_FILL_GROUPS); abort: the
# guess's copies abortable (PDFLASH_EXPERT_GUESS_ABORT), with every router pick guessed so many guesses are wrong;
# "misses": abortable, one copy a row of the router's best absent pick (PDFLASH_EXPERT_GUESS_MISSES).
RUNS = [("union,layer", "device", True, False, 1, False), ("none", "device", True, False, 1, False),
        ("union", "device", True, False, 1, False), ("layer", "device", True, False, 1, False),
        ("union,layer", "host", True, False, 1, False), ("union,layer", "device", False, False, 1, False),
        ("none", "device", False, False, 1, False), ("union,layer", "device", True, True, 1, False),
        ("layer", "device", True, True, 3, False), ("none", "device", True, False, 3, False),
        ("union,layer", "device", True, True, 1, True), ("layer", "device", True, True, 3, True),
        ("union,layer", "device", True, True, 1, "misses")]


def _run_id(run) -> str:
    prefetch, mode, overlap, guess_async, groups, abort = run
    return "-".join([prefetch.replace(",", "+"), mode, "overlap" if overlap else "serial"] + (["async"] if guess_async else [])
                    + ([f"g{groups}"] if groups > 1 else []) + (["abort"] if abort else []) + (["misses"] if abort == "misses" else []))


@pytest.fixture(scope="module")
def resident(checkpoint):
    """The reference: greedy block-1 output of the same MXFP4 experts all resident, 2 prompts x 96 tokens; and the
    cache size that holds one layer's experts + 3 slots."""
    import tests.test_gpu_verifier as drive

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drive, "NEW", 96)
        core = _core(checkpoint, 0.0)
        assert core.target.expert_cache is None and core.target.experts_format == "mxfp4"
        vocab = core.target.vocab_size
        prompts = _prompts(vocab, 2)
        refs = [_run(core, p, _no_drafts) for p in prompts]
    del core
    torch.cuda.empty_cache()
    probe = _core(checkpoint, 100.0)
    store = probe.target.expert_cache.store
    per_layer = max(store.num_experts.values())
    small_gb = (per_layer + 3) * store.slice_bytes / 2**30  # one layer's experts + 3: every forward evicts
    del probe
    torch.cuda.empty_cache()
    return vocab, prompts, refs, store.slice_bytes, per_layer, small_gb


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_offloaded_equals_resident_mxfp4_for_every_prefetch_mode(checkpoint, resident, run, monkeypatch):
    import tests.test_gpu_verifier as drive

    monkeypatch.setattr(drive, "NEW", 96)
    vocab, prompts, refs, slice_bytes, per_layer, small_gb = resident
    prefetch, mode, overlap, guess_async, groups, abort = run
    # device mode: the overflow range (one layer's experts) + partitions of about half a layer each: still evicts
    core = _core(checkpoint, small_gb if mode == "host" else small_gb + per_layer * slice_bytes / 2**30, prefetch, mode,
                 overlap, guess_async, groups, abort)
    assert core.graphs is not None and getattr(core.target.expert_cache, "device_managed", False) == (mode == "device")
    cache = core.target.expert_cache
    store = cache.store
    kept = sum(cache.sizes) if mode == "device" else cache.num_slots  # (device: + an overflow range, not kept)
    assert kept < sum(store.num_experts.values())
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        if i == 0 or prefetch in ("union,layer", "none"):
            assert _run(core, p, _no_drafts) == ref, run
        assert _run(core, p, _replay(ref, 3, vocab), width=16) == ref, run
    st = cache.stats
    assert st.evictions > 0 and st.hits + st.misses == st.lookups
    if abort:  # an aborted guess moved part of its slice
        assert 0 < st.prefetch_aborted <= st.prefetched or (abort == "misses" and st.prefetch_aborted == 0)
        assert st.misses * store.slice_bytes < st.bytes_moved <= (st.misses + st.prefetched) * store.slice_bytes
    else:
        assert st.bytes_moved == (st.misses + st.prefetched) * store.slice_bytes
    if "layer" in prefetch:
        assert st.prefetched > 0
    if prefetch == "none" and overlap and groups == 1:  # the experts move to another cache (of the other kind): the graphs are captured anew
        from pdflash_kernels.installer import serve_offloaded_experts
        from verifier_svc.expert_cache import new_cache

        old = [g for g in core.graphs._graphs.values()]
        moved = new_cache(cache.store, 0, "cuda", "union,layer", "host", slots=cache.num_slots + 2)
        serve_offloaded_experts(core.target.model, moved, drop_native=False)
        core.target.expert_cache = moved
        assert _run(core, prompts[1], _replay(refs[1], 3, vocab), width=16) == refs[1]
        assert moved.stats.lookups > 0 and not any(g in old for g in core.graphs._graphs.values())
        del moved, old
    del core, cache
    torch.cuda.empty_cache()


def test_an_abortable_fill_stops_mid_copy_when_another_stream_sets_its_flag():
    """The abortable fill reads its flag while it runs: a 256 MiB slice copying from pinned memory on one stream (64
    programs, all resident at once) is stopped by a flag another stream sets ~1 ms in. It stops part way, every word it
    wrote is the arena's, and `moved` counts exactly the words written. (Two explicit streams: the legacy default stream
    would wait for the copy.)"""
    from pdflash_kernels import offload as ko

    words = 64 << 20
    arena = torch.randint(1, 255, (1, words * 4), dtype=torch.uint8).pin_memory()  # no zero byte: written words show
    pool = torch.zeros(1, words * 4, dtype=torch.uint8, device="cuda")
    eff = torch.zeros(1, dtype=torch.int32, device="cuda")
    flags = torch.ones(1, dtype=torch.int8, device="cuda")
    stop = torch.zeros(1, dtype=torch.int8, device="cuda")
    moved = torch.zeros(1, dtype=torch.int32, device="cuda")
    stop.fill_(1)  # compiled before the timed copy (stopped at once: nothing copied)
    ko.fill(arena, pool, 0, eff, flags, chunk_words=1 << 20, stop=stop, moved=moved)
    torch.cuda.synchronize()
    assert int(moved[0]) == 0 and not pool.any()
    stop.zero_()
    copier, setter = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(setter):  # every kernel the timed part launches loaded first: a lazily loaded kernel's first
        torch.cuda._sleep(1)  # launch waits for the device to idle (CUDA_MODULE_LOADING=LAZY), i.e. for the whole copy
        stop.fill_(0)
    torch.cuda.synchronize()
    with torch.cuda.stream(copier):
        ko.fill(arena, pool, 0, eff, flags, chunk_words=1 << 20, stop=stop, moved=moved)
    with torch.cuda.stream(setter):
        torch.cuda._sleep(2_000_000)  # (~1 ms at H200 clocks; the whole copy takes ~5 ms)
        stop.fill_(1)
    torch.cuda.synchronize()
    written = pool.view(torch.int32)[0] != 0
    n = int(written.sum())
    assert 0 < n < words and n == int(moved[0]), f"written {n} of {words} words, moved {int(moved[0])}"
    assert torch.equal(pool.view(torch.int32)[0][written].cpu(), arena.view(torch.int32)[0][written.cpu()])


def test_arrivals_from_another_thread_change_no_token_on_the_device_cache(checkpoint):
    """The servicer's arriving() (a Verify arriving, or the scheduler's Prefetch hint) from its own thread while
    verifies run: the device-managed cache holds what arrives during a forward and issues it after; the tokens equal
    the resident-MXFP4 reference and the arrivals are counted as prefetches."""
    import random
    import threading

    resident = _core(checkpoint, 0.0)
    vocab = resident.target.vocab_size
    prompt = _prompts(vocab, 1)[0]
    ref = _run(resident, prompt, _no_drafts)
    del resident
    torch.cuda.empty_cache()
    probe = _core(checkpoint, 100.0)
    store = probe.target.expert_cache.store
    per_layer = max(store.num_experts.values())
    del probe
    core = _core(checkpoint, (2 * per_layer + 3) * store.slice_bytes / 2**30, "union", "device")
    cache = core.target.expert_cache
    layers = sorted(store.num_experts)
    stop = threading.Event()
    sent = []

    def hammer():
        rng = random.Random(0)
        while not stop.is_set():
            union = {l: set(rng.sample(range(store.num_experts[l]), 4)) for l in layers[:2]}
            sent.append(cache.arriving(union))
            stop.wait(0.0005)

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    try:
        assert _run(core, prompt, _no_drafts) == ref
        assert _run(core, prompt, _replay(ref, 3, vocab), width=16) == ref
    finally:
        stop.set()
        t.join(timeout=30)
    st = cache.stats
    assert sent and st.hits + st.misses == st.lookups and st.prefetched > 0


@pytest.mark.parametrize("mode", ["device", "host"])
def test_prefill_waves_on_offloaded_experts_equal_resident_mxfp4(checkpoint, resident, mode):
    """Prompts prefilled in one wave (VerifierCore.prefill_wave: one eager ragged forward, one expert-cache bracket) over
    an evicting expert cache, device- or host-managed: each session then decodes exactly the resident MXFP4 block-1
    reference, and the wave's counters are one forward's (every prompt's answer carries the same)."""
    from pdflash.types import SamplingParams
    from verifier_svc.engine import PrefillInput

    vocab, prompts, refs, slice_bytes, per_layer, small_gb = resident
    core = _core(checkpoint, small_gb if mode == "host" else small_gb + per_layer * slice_bytes / 2**30, mode=mode)
    jobs = [core.start_prefill(PrefillInput(f"pw{i}", tuple(p), SamplingParams(), len(r), ignore_eos=True))
            for i, (p, r) in enumerate(zip(prompts, refs))]
    assert core.prefill_wave(jobs) == [True] * len(jobs)
    outs = [j.finish() for j in jobs]
    assert all(o.wave_sessions == len(jobs) for o in outs)
    assert len({id(o.expert_cache) for o in outs}) == 1 and outs[0].expert_cache.lookups > 0
    from pdflash.types import DraftResult

    for o, ref in zip(outs, refs):  # the rest of each output, a token a round (block 1), on the KV the wave left
        got, anchor = list(o.tokens), o.tokens[-1]
        for rnd in range(1, len(ref)):
            if len(got) >= len(ref):
                break
            v = core.verify(DraftResult(o.session_id, rnd, (anchor,), {}, 0), return_features=False)
            got += v.tokens
            anchor = v.tokens[-1]
        core.end(o.session_id)
        assert got[: len(ref)] == ref
    assert core.target.expert_cache.stats.evictions > 0
    del core
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", ["device", "host"])
def test_waves_on_offloaded_experts_equal_resident_mxfp4(checkpoint, resident, mode, monkeypatch):
    """Multi-session verify waves over an evicting expert cache (device-managed: the wave graphs; host-managed: the
    eager ragged forward): every session's output is the resident MXFP4 block-1 reference."""
    import tests.test_gpu_verifier as drive

    monkeypatch.setattr(drive, "NEW", 96)
    vocab, prompts, refs, slice_bytes, per_layer, small_gb = resident
    core = _core(checkpoint, small_gb if mode == "host" else small_gb + per_layer * slice_bytes / 2**30, mode=mode)
    core.max_wave_sessions = core.graphs.wave_sessions = 4
    sessions = [drive.Session(core, p, _replay(ref, 3 + i, vocab), 16, True) for i, (p, ref) in enumerate(zip(prompts, refs))]
    sessions.append(drive.Session(core, prompts[0], _no_drafts, 1, False))
    drive.run_in_waves(core, sessions)
    assert [s.out for s in sessions] == [*refs, refs[0]]
    assert core.target.expert_cache.stats.evictions > 0
    del core
    torch.cuda.empty_cache()
