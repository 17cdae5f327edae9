"""The verifier's paged KV pool (verifier_svc/kv.py) and its layer-by-layer forward (verifier_svc/runner.py).

On the CPU the batch-invariant kernels run under Triton's interpreter (slow: tiny model, few tokens); the same
path on CUDA, replayed from CUDA graphs, is tested in tests/test_gpu_verifier.py."""

from __future__ import annotations

import pytest
import torch

from pdflash_kernels import runtime
from pdflash_kernels.attention import PAGE
from pdflash.errors import ResourceExhausted
from tests.conftest import DEVICE, DTYPE
from verifier_svc.kv import KVPool, SequenceKV


def test_pool_pages_are_handed_out_and_back():
    pool = KVPool(num_layers=2, kv_heads=2, head_dim=16, num_pages=4, dtype=torch.float32, device=torch.device("cpu"))
    seq = SequenceKV(pool, max_positions=10 * PAGE)
    seq.reserve(PAGE + 1)
    assert len(seq.pages) == 2 and pool.free_pages == 2
    pages, offs = seq.slots(PAGE - 1, 2)
    assert pages.tolist() == [seq.pages[0], seq.pages[1]] and offs.tolist() == [PAGE - 1, 0]
    assert seq.slot_lists(PAGE - 1, 2) == (pages.tolist(), offs.tolist())  # the graph runner's host-side form
    assert seq.table[:2].tolist() == seq.pages
    seq.reserve(PAGE)  # already covered: nothing more
    assert pool.free_pages == 2
    other = SequenceKV(pool, max_positions=10 * PAGE)
    assert other.uid != seq.uid  # what a graph's page table is keyed by (with the page count)
    with pytest.raises(ResourceExhausted, match="KV cache is full"):
        other.reserve(3 * PAGE)
    seq.free()
    assert pool.free_pages == 4 and seq.pages == []
    with pytest.raises(ValueError, match="exceed the context"):
        SequenceKV(pool, max_positions=PAGE).reserve(PAGE + 1)
    assert KVPool.pages_for(2, 16, 2, torch.float32, budget_bytes=2 * 2 * 2 * PAGE * 16 * 4 * 3) == 3


@pytest.mark.slow
@pytest.mark.timeout(1200)  # interpreted Triton, five prefills of a page-crossing prompt: ~600 s on a 2-core CPU
@pytest.mark.skipif(not runtime.triton_usable("cpu"), reason="needs triton (interpreted on CPU)")
def test_paged_verifier_equals_the_dynamic_cache_one_and_returns_its_pages(tiny, monkeypatch):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import test_gpu_verifier as drive

    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    monkeypatch.setattr(drive, "NEW", 10)  # (every forward runs under Triton's interpreter: 16 new tokens took ~600 s on a 2-core CPU)
    target = load_target(tiny.target("qwen3_moe"), "cpu", "bfloat16", kernels="on")
    dynamic = VerifierCore(target, max_block_size=32)
    paged = VerifierCore(target, max_block_size=32, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01))
    assert paged.pool is not None and dynamic.pool is None
    assert dynamic.forward_info == {}
    info = paged.forward_info  # what model info's kernels JSON says under "forward"
    assert info["kv"].startswith("paged: ") and info["cuda_graphs"] == "off" and "segments of" in info["attention_kv_split"]
    assert info["attention"] == paged.runner.attention and info["layers"] == paged.runner.prenorm
    assert info["launches"] == "plain"  # programmatic dependent launch is a CUDA (sm_90+) launch option
    from pdflash_kernels import moe

    want = {None: "K split per shape", 1: "K in one range"}.get(moe.SPLIT_K, f"K split {moe.SPLIT_K} ways")
    assert info["moe_gemms"].startswith(want)
    free = paged.pool.free_pages
    prompt = list(range(5, 5 + PAGE + 6))  # the prompt crosses a page boundary
    want = drive._run(dynamic, prompt, drive._no_drafts)
    assert drive._run(paged, prompt, drive._no_drafts) == want
    assert drive._run(paged, prompt, drive._replay(want, 3, target.vocab_size), width=8) == want
    assert paged.pool.free_pages == free  # finished sessions gave their pages back
    s = drive.Session(paged, prompt, drive._no_drafts, 1, False)
    assert paged.pool.free_pages < free
    paged.end(s.sid)
    assert paged.pool.free_pages == free


def test_the_paged_kv_needs_the_kernels_and_says_so(tiny):
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(tiny.target("qwen3_moe"), DEVICE, DTYPE)  # --kernels off (a CPU default)
    assert VerifierCore(target, paged_kv=PagedKVOptions()).pool is None  # auto: transformers' DynamicCache
    with pytest.raises(ValueError, match="needs the batch-invariant kernels"):
        VerifierCore(target, paged_kv=PagedKVOptions(mode="on"))


def test_model_info_kernels_json_says_how_the_forward_runs():
    import json

    from verifier_svc.servicer import model_kernels_json

    assert model_kernels_json({}, {}) == ""  # transformers' own path: nothing installed, nothing to say
    assert json.loads(model_kernels_json({"batch_invariant": True}, {})) == {"batch_invariant": True}
    both = json.loads(model_kernels_json({"batch_invariant": True}, {"attention": "fused"}))
    assert both == {"batch_invariant": True, "forward": {"attention": "fused"}}


def test_an_asked_kv_pool_must_fit_the_free_device_memory(monkeypatch):
    """`--kv-cache-gb` larger than the GPU has free: one line saying how much there is (it was the allocator's
    out-of-memory error, 'Tried to allocate 416.67 GiB', at load); automatic sizing takes a quarter of the free memory."""
    from verifier_svc.engine import KV_FREE_SHARE, PagedKVOptions

    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)  # 1 GiB of it unused, counted free
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * 2**30)
    cuda = torch.device("cuda", 0)
    assert PagedKVOptions(kv_cache_gb=0).budget_bytes(cuda) == free / 4
    assert PagedKVOptions(kv_cache_gb=8).budget_bytes(cuda) == 8 * 2**30
    assert PagedKVOptions(kv_cache_gb=9.5).budget_bytes(cuda) == 9.5 * 2**30  # within 90% of 10 + 1 GiB
    with pytest.raises(ValueError, match=r"^--kv-cache-gb 5000: cuda:0 has 11.0 GiB free after loading the model, .*"
                                         r"at most 90% of it \(9.9 GiB; .*ask for less, or 0 for a quarter"):
        PagedKVOptions(kv_cache_gb=5000).budget_bytes(cuda)
    assert KV_FREE_SHARE == 0.9
    assert PagedKVOptions(kv_cache_gb=5000).budget_bytes(torch.device("cpu")) == 5000 * 2**30  # host memory: as asked
    assert PagedKVOptions().budget_bytes(torch.device("cpu")) == 0.25 * 2**30
