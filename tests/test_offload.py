"""Offloaded MXFP4 experts on the CPU (a host store, a host "slot pool" as the device cache, the torch reference
kernel): greedy output with a cache far smaller than the experts (evicting every round) equals the same MXFP4 model
with every expert cached, in process for three architectures and through the whole stack for one; the byte map is
the store's slices; a cache too small for one layer's routed experts fails at load and says the minimum."""

from __future__ import annotations

import grpc
import pytest

from pdflash.client import Client
from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
from tests.conftest import start_stack
from tests.test_gpu_verifier import Session, _no_drafts, _replay, _run

pytestmark = pytest.mark.slow
BIG = 1.0  # GiB: every expert of a tiny model fits


def tiny_cache_gb(core) -> float:
    """Room for 9 experts: one layer's 8 (the minimum) + 1, of the 16 of two layers: every forward evicts."""
    return 9.5 * core.target.expert_cache.store.slice_bytes / 2**30


def _core(tiny, arch, cache_gb):
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    return VerifierCore(load_target(tiny.target(arch), "cpu", "auto", experts="mxfp4", expert_cache_gb=cache_gb),
                        max_block_size=8)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_offloaded_equals_every_expert_cached(tiny, arch):
    import tests.test_gpu_verifier as drive

    drive.NEW = 24
    full = _core(tiny, arch, BIG)
    small = _core(tiny, arch, tiny_cache_gb(full))
    cache = small.target.expert_cache
    assert cache.num_slots < sum(cache.store.num_experts.values()) < full.target.expert_cache.num_slots + 1
    assert small.target.byte_map == cache.store.byte_map() and small.target.experts_format == "mxfp4"
    prompt = list(range(3, 40))
    want = _run(full, prompt, _no_drafts)
    assert _run(small, prompt, _no_drafts) == want
    assert _run(small, prompt, _replay(want, 3, small.target.vocab_size), width=8) == want
    st = cache.stats
    assert st.evictions > 0 and st.hits + st.misses == st.lookups
    assert st.bytes_moved == (st.misses + st.prefetched) * cache.store.slice_bytes


def test_prefetch_of_a_wrong_projection_changes_nothing(tiny):
    from pdflash.types import DraftResult, union_bytes

    core = _core(tiny, "qwen3_moe", tiny_cache_gb(_core(tiny, "qwen3_moe", BIG)))
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


def test_a_cache_below_one_layer_fails_at_load_with_the_minimum(tiny):
    from verifier_svc.model import load_target

    with pytest.raises(ValueError, match=r"at least \d+ slots"):
        load_target(tiny.target("qwen3_moe"), "cpu", "auto", experts="mxfp4", expert_cache_gb=1e-7)


def test_the_stack_serves_offloaded_experts_as_it_serves_them_cached(tiny, tmp_path):
    outs = []
    for gb in (BIG, tiny_cache_gb(_core(tiny, "gpt_oss", BIG))):
        stack = start_stack(tiny.target("gpt_oss"), None, tmp_path / f"logs-{gb}",
                            verifier_args=["--experts", "mxfp4", "--expert-cache-gb", str(gb)])
        try:
            with Client(stack.drafter) as c:
                outs.append([c.generate("def f(x):\n", max_tokens=24, drafter=d).token_ids for d in ("none", "ngram")])
            with grpc.insecure_channel(stack.verifier) as ch:
                vi = verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
            assert vi.experts_format == "mxfp4"
            sizes = {b for layer in vi.expert_bytes for b in layer.expert_bytes}
            assert len(sizes) == 1 and sizes.pop() % 256 == 0  # every expert is one arena slice
        finally:
            stack.stop()
    assert outs[0] == outs[1] and outs[0][0] == outs[0][1]
