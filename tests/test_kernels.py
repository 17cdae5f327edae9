"""pdflash_kernels/ on the CPU: the MXFP4 format, the torch references against plain torch math, and the Triton
kernels' logic under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py on machines without
CUDA). The same kernels compiled for the GPU are tested in tests/test_kernels_gpu.py."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from pdflash_kernels import mxfp4, runtime
from pdflash_kernels.moe import ACT_GPTOSS, ACT_RELU2, ACT_SILU, ExpertWeights, MoeConfig, align
from pdflash_kernels.reference import attention_reference, moe_reference

LUT = torch.tensor(mxfp4.E2M1_VALUES)
from tests.conftest import needs_triton  # noqa: E402


# ---- MXFP4 --------------------------------------------------------------------------------------------
def test_quantize_known_values():
    # one group: each midpoint goes to the even code; amax 6 -> scale 2^0 (byte 127)
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, -6.0, 0.1, -0.3] + [0.0] * 20)
    blocks, scales = mxfp4.quantize(row[None])
    assert scales.tolist() == [[127]]
    codes = mxfp4.decode_codes(blocks)[0].tolist()
    assert codes[:12] == [0, 2, 2, 4, 4, 6, 6, 7, 9, 15, 0, 9]
    assert blocks[0, 0].item() == 0x20  # 0.25 -> code 0 in the low nibble, 0.75 -> code 2 in the high nibble
    back = mxfp4.dequantize(blocks, scales, torch.float32)[0]
    assert back[:12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.5]


def test_scale_is_the_smallest_power_of_two_without_clipping():
    for amax, byte in [(6.0, 127), (6.5, 128), (12.0, 128), (3.0, 126), (0.75, 124), (1e-3, 127 - 12), (0.0, 0)]:
        _, s = mxfp4.quantize(torch.tensor([[amax] + [0.0] * 31]))
        assert s.item() == byte, (amax, s.item())


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 7, 96), generator=g)
    exps = torch.randint(-20, 20, (5, 7, 3, 1), generator=g).float()
    w = (LUT[codes].reshape(5, 7, 3, 32) * torch.ldexp(torch.ones(5, 7, 3, 1), exps)).reshape(5, 7, 96)
    for dtype in (torch.float32, torch.bfloat16):
        b, s = mxfp4.quantize(w.to(dtype))
        assert torch.equal(mxfp4.dequantize(b, s, torch.float32), w)


def test_quantization_error_is_bounded():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    b, s = mxfp4.quantize(w)
    err = (mxfp4.dequantize(b, s, torch.float32) - w).abs()
    # within a group of scale 2^j, the spacing of E2M1 values is at most 2 * 2^j: error <= 2^j
    scale = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.float() - 127).repeat_interleave(32, dim=-1)
    assert (err <= scale + 1e-12).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.ones(2, 40))
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4.quantize(torch.tensor([[float("inf")] * 32]))
    with pytest.raises(ValueError, match="one MXFP4 tensor"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_gpt_oss_layout_is_read_as_is():
    w = torch.randn(2, 6, 64)
    b, s = mxfp4.quantize(w)
    gb, gs = b.reshape(2, 6, 2, 16), s  # how gpt-oss checkpoints store the same bytes
    b2, s2 = mxfp4.from_gpt_oss(gb, gs)
    assert torch.equal(b2, b) and b2.data_ptr() == gb.data_ptr()


@pytest.mark.parametrize("bias", [False, True])
def test_arena_layout_round_trip(bias):
    e, h, i = 3, 64, 96
    w1, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    b1, b2 = (torch.randn(e, 2 * i), torch.randn(e, h)) if bias else (None, None)
    q = mxfp4.MXFP4Experts.quantize(w1, w2, b1, b2)
    lay = q.layout()
    arena = q.to_arena()
    assert arena.shape == (e, lay.nbytes) and lay.nbytes % mxfp4.ALIGN == 0
    assert all(off % mxfp4.ALIGN == 0 for off in lay.offsets.values())
    views = lay.views(arena)
    for name, v in views.items():
        assert torch.equal(v, getattr(q, name)), name
    # one expert packed alone into a row equals its row of the arena
    row = torch.zeros(lay.nbytes, dtype=torch.uint8)
    lay.pack(row, q.parts(1))
    assert torch.equal(row, arena[1])
    expected = 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32 + ((2 * i + h) * 2 if bias else 0)
    assert expected <= lay.nbytes < expected + 6 * mxfp4.ALIGN


# ---- references against plain torch -------------------------------------------------------------------
def _experts(e=6, h=64, i=32, act=ACT_SILU, bias=False, fp4=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r1 = i if act == ACT_RELU2 else 2 * i  # (up-only experts: the I up rows alone)
    w1 = (torch.randn(e, r1, h, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).bfloat16()
    b1 = (torch.randn(e, r1, generator=g) * 0.2).bfloat16() if bias else None
    b2 = (torch.randn(e, h, generator=g) * 0.2).bfloat16() if bias else None
    if fp4:
        q = mxfp4.MXFP4Experts.quantize(w1, w2, b1, b2)
        return ExpertWeights(q.w1_blocks, q.w2_blocks, q.w1_scales, q.w2_scales, q.b1, q.b2, act=act)
    return ExpertWeights(w1, w2, b1=b1, b2=b2, act=act)


def _routing(t, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    x = torch.randn(t, 64, generator=g).bfloat16()
    return x, ids, wts


def test_moe_reference_equals_a_plain_loop_over_experts():
    w = _experts()
    x, ids, wts = _routing(5, 6, 2)
    out = moe_reference(x, ids, wts, w, 6)
    want = torch.zeros(5, 64)
    for t in range(5):
        for s in range(2):
            e = int(ids[t, s])
            gu = x[t].float() @ w.w1[e].float().T
            h = torch.nn.functional.silu(gu[:32]) * gu[32:]
            want[t] += wts[t, s] * (h @ w.w2[e].float().T)
    assert torch.allclose(out.float(), want, atol=0.05, rtol=0.02)


def test_up_only_reference_equals_a_plain_loop_over_experts():
    """Up-only experts (Nemotron-H: no gate, relu(up)^2): w1 holds the I up rows alone."""
    w = _experts(act=ACT_RELU2, bias=True)
    assert not w.gated and w.intermediate == 32 and w.up_offset == 0
    x, ids, wts = _routing(5, 6, 2)
    out = moe_reference(x, ids, wts, w, 6)
    want = torch.zeros(5, 64)
    for t in range(5):
        for s in range(2):
            e = int(ids[t, s])
            u = x[t].float() @ w.w1[e].float().T + w.b1[e].float()
            want[t] += wts[t, s] * (torch.relu(u) ** 2 @ w.w2[e].float().T + w.b2[e].float())
    assert torch.allclose(out.float(), want, atol=0.05, rtol=0.02)


@needs_triton
@pytest.mark.parametrize("fp4,fields", [
    pytest.param(False, {}, id="bf16-base"),
    pytest.param(False, dict(swap_ab=True, block_n=64), id="bf16-swap64"),
    pytest.param(True, dict(decode=0), id="fp4-select"),
    pytest.param(True, dict(a_load=2, decode=3, raster=1), id="fp4-join_bf16_raster"),
    pytest.param(True, dict(a_load=2, decode=5, persist=4), id="fp4-pair-words-persist"),
])
def test_up_only_experts_match_the_reference_and_rows_stay_invariant(fp4, fields, monkeypatch):
    """Up-only relu^2 experts on the kernels (one row set in the gate/up GEMM): close to the reference, a token's row
    alone equals its row among others, and a split K (in one launch or two) gives each row the same value in any
    company."""
    from pdflash_kernels import linear, moe

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    e, h, i, t, k = 6, 128, 64, 9, 2
    w = _experts(e=e, h=h, i=i, act=ACT_RELU2, bias=not fp4, fp4=fp4)
    if fields.get("decode") == 5:
        w = _pair_weights(w)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    x = torch.randn(t, h, generator=g).bfloat16()
    c = dataclasses.replace(MoeConfig(block_m=16, block_n=32, block_k=32, num_stages=1, decode=1), **fields)
    out = moe.moe_forward(x, ids, wts, w, e, config=c, config2=c)
    ref = moe_reference(x, ids, wts, w, e)
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3
    alone = moe.moe_forward(x[4:5], ids[4:5], wts[4:5], w, e, config=c, config2=c)
    assert torch.equal(alone[0], out[4])
    split = dataclasses.replace(c, split_k=2)
    one = moe.moe_forward(x, ids, wts, w, e, config=split, config2=split)
    with monkeypatch.context() as m:
        m.setattr(linear, "_counters", lambda device, tiles: None)  # no counters: the two-launch path
        two = moe.moe_forward(x, ids, wts, w, e, config=split, config2=split)
    assert torch.equal(one, two)
    assert torch.equal(moe.moe_forward(x[4:5], ids[4:5], wts[4:5], w, e, config=split, config2=split)[0], one[4])
    assert (one.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3


def test_attention_reference_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=g) for _ in range(3))
    k, v = k[:, :2].repeat(1, 1, 4, 1)[:, :, :9], v[:, :2].repeat(1, 1, 4, 1)[:, :, :9]
    out = attention_reference(q, k, v, torch.arange(4, 9), 0, 0.25)
    mask = torch.arange(9)[None, :] <= torch.arange(4, 9)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-5)


def test_align_groups_pairs_by_expert_and_drops_padding():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 3]])
    r = align(ids, num_experts=4, block_m=2, n_valid=torch.tensor([3]))
    used = int(r.num_blocks)
    pairs = r.sorted_pairs.view(-1, 2)[:used]
    seen = {}
    for b in range(used):
        for p in pairs[b].tolist():
            if p < r.num_pairs:
                seen[p] = int(r.block_slot[b])
    flat = ids.reshape(-1).tolist()
    assert seen == {p: flat[p] for p in range(6)}  # rows 0..2 only, each pair in its expert's block
    assert (r.block_slot[used:] == -1).all() and not r.pair_valid[6:].any()


# ---- the Triton kernels under the interpreter ---------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("t,k,e,bm,nv,slots", [(4, 2, 4, 2, 3, False), (37, 8, 128, 16, None, True), (5, 4, 32, 16, 2, True), (300, 2, 8, 16, None, False),
                                               (16, 4, 60, 16, 11, True), (300, 8, 128, 16, 290, True), (260, 4, 32, 16, None, False)])
def test_fused_align_equals_torch_align(t, k, e, bm, nv, slots):
    from pdflash_kernels.moe import align_fused

    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[t // 2, 0] = -1  # a dropped pair (an expert-parallel sentinel)
    so = torch.randperm(e, generator=g).int() if slots else None
    n = torch.tensor([nv]) if nv is not None else None
    a = align(ids, e, bm, so, n)
    # one pass or 64-pair steps; ranked by a pairwise compare (the interpreter's default) or by tl.sort (the GPU's)
    # and a program a chunk (ALIGN_PROGRAMS: each program counts every pair, ranks its own chunk, pads its own blocks)
    for b in (align_fused(ids, e, bm, so, n), align_fused(ids, e, bm, so, n, chunk=64), align_fused(ids, e, bm, so, n, chunk=64, sort=True),
              align_fused(ids, e, bm, so, n, chunk=64, programs=True), align_fused(ids, e, bm, so, n, chunk=64, sort=True, programs=True)):
        assert torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_slot, b.block_slot)
        assert int(a.num_blocks) == int(b.num_blocks) and torch.equal(a.pair_valid, b.pair_valid)
    phase = torch.randint(-1, 3, (e,), generator=g).to(torch.int8)  # (copy groups; -1: in flight from a prefetch)
    one, many = (align_fused(ids, e, bm, so, n, phase_of_expert=phase, chunk=64, programs=pr) for pr in (False, True))
    assert torch.equal(one.block_phase, many.block_phase) and torch.equal(one.sorted_pairs, many.sorted_pairs)

def test_align_programs_option_is_checked():
    """PDFLASH_ALIGN_PROGRAMS (a program a chunk for the routing step): 0 / 1; anything else stops the import."""
    _import_refuses("PDFLASH_ALIGN_PROGRAMS", "fast", "pdflash_kernels.moe")


# The GEMM variants (pdflash_kernels.moe.SWEEP_VARIANTS*) on small shapes: tiles shrunk to the shapes (several K steps).
_TEST_BASE = MoeConfig(block_m=16, block_n=32, block_k=32, num_stages=1, decode=1)


def _variant_configs(fields: dict, k1: int = 64, k2: int = 32) -> tuple[MoeConfig, MoeConfig]:
    import dataclasses

    c = dataclasses.replace(_TEST_BASE, **fields)
    low = 16 * c.num_warps if c.a_load in (3, 4) else 32  # (K over the warps: >= 16 K values a warp, the rest masked)
    return (dataclasses.replace(c, block_k=max(min(c.block_k, k1), low)),
            dataclasses.replace(c, block_k=max(min(c.block_k, k2), low)))


def _cpu_variants(table: dict, fp4: bool) -> list:
    from pdflash_kernels.moe import GPU_ONLY_VARIANTS

    return [pytest.param(fp4, name, table[name], id=f"{'fp4' if fp4 else 'bf16'}-{name}") for name in table if name not in GPU_ONLY_VARIANTS]


def _all_cpu_variants() -> list:
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16

    return _cpu_variants(SWEEP_VARIANTS, True) + _cpu_variants(SWEEP_VARIANTS_BF16, False)


@needs_triton
@pytest.mark.parametrize("fp4,name,fields", [pytest.param(False, "select", {}, id="bf16-select"), pytest.param(True, "select", dict(decode=0), id="fp4-select")] + _all_cpu_variants())
def test_moe_kernel_matches_reference(fp4, name, fields, monkeypatch):
    from pdflash_kernels import runtime
    from pdflash_kernels.moe import moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)  # persistent variants: few programs, each looping
    # every variant with both activations would double the time: the epilogue is shared, alternate them instead
    act, bias = (ACT_GPTOSS, True) if sum(map(ord, name)) % 2 else (ACT_SILU, False)
    w = _experts(act=act, bias=bias, fp4=fp4)
    if fields.get("decode") in (5, 6):  # pair-word variants run on pair-word weights
        w = _pair_weights(w)
    x, ids, wts = _routing(5, 6, 2)
    c1, c2 = _variant_configs(fields)
    out = moe_forward(x, ids, wts, w, 6, config=c1, config2=c2)
    ref = moe_reference(x, ids, wts, w, 6)
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3


@needs_triton
@pytest.mark.parametrize("fp4,fields", [
    pytest.param(True, dict(a_load=2, decode=3, raster=1), id="fp4-join_bf16_raster"),
    pytest.param(True, dict(a_load=2, decode=3, swap_ab=True, block_n=64, s_ahead=1), id="fp4-swap64-s1"),
    pytest.param(False, dict(persist=4), id="bf16-persist"),
    pytest.param(False, {}, id="bf16-base"),
])
def test_split_k_sums_in_order_in_one_launch_or_two_and_rows_stay_invariant(fp4, fields, monkeypatch):
    """MoeConfig.split_k: both GEMMs' K ranges (gate/up 4 K steps, down 2) summed in range order by each tile's last
    program, or, without free counters, by a second launch: the same bits; a token's row alone equals its row among
    others (and across the rows' padding); every counter back at zero; close to the reference."""
    import dataclasses

    from pdflash_kernels import linear, moe

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    e, h, i, t, k = 6, 128, 64, 7, 2
    w = _experts(e=e, h=h, i=i, act=ACT_GPTOSS, bias=True, fp4=fp4)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    x = torch.randn(t, h, generator=g).bfloat16()
    c = dataclasses.replace(MoeConfig(block_m=16, block_n=32, block_k=32, num_stages=1, decode=1), **fields, split_k=2)
    assert moe.split_span(h, c) == (2, 64) and moe.split_span(i, c) == (2, 32)
    assert moe.split_span(i, dataclasses.replace(c, split_k=8)) == (2, 32)  # never more ranges than K steps
    linear._COUNTERS.clear()
    one = moe.moe_forward(x, ids, wts, w, e, config=c, config2=c)
    assert int(linear._COUNTERS[("cpu", None)][0].abs().sum()) == 0  # ready for the next launch
    alone = moe.moe_forward(x[3:4], ids[3:4], wts[3:4], w, e, config=c, config2=c)
    with monkeypatch.context() as m:
        m.setattr(linear, "_counters", lambda device, tiles: None)  # no counters: the two-launch path
        two = moe.moe_forward(x, ids, wts, w, e, config=c, config2=c)
    assert torch.equal(one, two) and torch.equal(alone[0], one[3])
    ref = moe_reference(x, ids, wts, w, e)
    assert (one.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3
    unsplit = moe.moe_forward(x, ids, wts, w, e, config=dataclasses.replace(c, split_k=1),
                              config2=dataclasses.replace(c, split_k=1))
    assert (one.float() - unsplit.float()).abs().max() <= 0.01 * unsplit.float().abs().max() + 1e-3


@needs_triton
@pytest.mark.parametrize("fp4,name", [(False, None), (True, "join_bf16"), (True, "join_bf16_persist"), (False, "swap64"),
                                      (True, "join_bf16_raster")])
def test_fused_combine_gives_the_separate_combines_bits(fp4, name, monkeypatch):
    """PDFLASH_MOE_FUSED_COMBINE: the down GEMM's last program per (token, n tile) sums the token's rows in slot order:
    the separate combine's bits, padding rows (no valid pair) zero, a dropped pair skipped, every counter back at zero;
    persistent, rastered and swapped grids alike."""
    from pdflash_kernels import linear, moe, runtime

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(act=ACT_GPTOSS if fp4 else ACT_SILU, bias=fp4, fp4=fp4)
    x, ids, wts = _routing(7, 6, 2)
    ids[2, 1] = -1  # a dropped pair: row 2 has one valid pair
    c1, c2 = _variant_configs({} if name is None else (moe.SWEEP_VARIANTS if fp4 else moe.SWEEP_VARIANTS_BF16)[name])
    nv = torch.tensor([5])
    monkeypatch.setattr(moe, "FUSED_COMBINE", False)
    want = moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2)
    monkeypatch.setattr(moe, "FUSED_COMBINE", True)
    linear._COUNTERS.clear()
    got = moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2)
    assert torch.equal(got, want) and torch.equal(got[5:], torch.zeros_like(got[5:]))
    assert int(linear._COUNTERS[("cpu", None)][0].abs().sum()) == 0  # ready for the next launch
    assert torch.equal(moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2), want)  # and again


@needs_triton
@pytest.mark.parametrize("name", ["base", "join_bf16_raster", "word"])
def test_scales_loaded_a_step_ahead_give_the_same_bits(name, monkeypatch):
    """MoeConfig.s_ahead: the next K step's scale bytes loaded at the top of each step (registers carried by the loop)
    change when a load is issued, never a value: the gate/up and down GEMMs over several K steps (the last step's load
    ahead falls past K, masked off) give the same bits as scales loaded in their own step."""
    import dataclasses

    from pdflash_kernels import runtime
    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(h=96, i=64, act=ACT_GPTOSS, bias=True, fp4=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(7)])
    wts = torch.softmax(torch.randn(7, 2, generator=g), -1)
    c = dataclasses.replace(_TEST_BASE, **SWEEP_VARIANTS[name])
    c = dataclasses.replace(c, block_k=32)  # 3 K steps of the gate/up GEMM, 2 of the down GEMM
    want = moe_forward(x, ids, wts, w, 6, config=c, config2=c)
    ahead = dataclasses.replace(c, s_ahead=1)
    assert torch.equal(moe_forward(x, ids, wts, w, 6, config=ahead, config2=ahead), want)
    ref = moe_reference(x, ids, wts, w, 6).float()
    assert (want.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3


def _padded_scales(s: torch.Tensor) -> torch.Tensor:
    """The same scales in rows padded to a multiple of 4 bytes (as pdflash_kernels.mxfp4.ExpertLayout stores them), the padding
    255: a scale byte no weight of these tests uses (2^128), which would turn a product into inf or NaN if read."""
    e, r, g = s.shape
    buf = torch.full((e, r, -(-g // 4) * 4), 255, dtype=torch.uint8)
    buf[..., :g] = s
    return buf[..., :g]


@needs_triton
@pytest.mark.parametrize("decode", [0, 3, 4])
def test_scales_read_as_words_give_the_same_bits(decode, monkeypatch):
    """MoeConfig.s_words: the scales read as 32-bit words (4 bytes each, streamed ahead by the compiled kernel) give the
    byte loads' bits. The gate/up GEMM's K = 160 (5 scale bytes a row: the last word runs into the padding, which must
    read as nothing) over two K steps, the down GEMM's K = 128; rows that are not 4-byte aligned read bytes instead."""
    import dataclasses

    from pdflash_kernels import moe, runtime
    from pdflash_kernels.moe import A_JOIN, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(h=160, i=128, act=ACT_GPTOSS, bias=True, fp4=True)
    padded = dataclasses.replace(w, s1=_padded_scales(w.s1), s2=_padded_scales(w.s2))
    assert moe._scale_words_ok(padded.s1) and moe._scale_words_ok(padded.s2) and not moe._scale_words_ok(w.s1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 160, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(7)])
    wts = torch.softmax(torch.randn(7, 2, generator=g), -1)
    c = dataclasses.replace(_TEST_BASE, decode=decode, a_load=A_JOIN, block_k=128)
    want = moe_forward(x, ids, wts, w, 6, config=c, config2=c)
    words = dataclasses.replace(c, s_words=True)
    assert torch.equal(moe_forward(x, ids, wts, padded, 6, config=words, config2=words), want)
    assert torch.equal(moe_forward(x, ids, wts, w, 6, config=words, config2=words), want)  # (read as bytes)
    ref = moe_reference(x, ids, wts, w, 6).float()
    assert torch.isfinite(want.float()).all() and (want.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3
    with pytest.raises(ValueError, match="block_k must be >= 128"):
        moe_forward(x, ids, wts, padded, 6, config=dataclasses.replace(words, block_k=64), config2=words)


def test_the_kernel_benchmark_times_mxfp4_experts_in_the_served_arena():
    """benchmarks/kernel_bench.py's `as_served`: the same MXFP4 experts moved into one arena of ExpertLayout slices, as the
    verifier serves them: the same values, gpt-oss-20b's 90-byte scale rows stored in 92 (readable as words)."""
    from benchmarks.kernel_bench import as_served
    from pdflash_kernels import moe

    w1 = torch.randn(3, 2 * 64, 2880)
    w2 = torch.randn(3, 2880, 64)
    (b1, s1), (b2, s2) = mxfp4.quantize(w1), mxfp4.quantize(w2)
    w = ExpertWeights(b1, b2, s1, s2, torch.ones(3, 128).bfloat16(), torch.ones(3, 2880).bfloat16(), row_mul=2, up_off=1,
                      act=ACT_GPTOSS)
    served = as_served(w)
    assert not moe._scale_words_ok(w.s1) and moe._scale_words_ok(served.s1) and served.s1.stride(-2) == 92
    for name in ("w1", "s1", "w2", "s2", "b1", "b2"):
        assert torch.equal(getattr(served, name), getattr(w, name)), name
    assert (served.row_mul, served.up_off, served.act) == (2, 1, ACT_GPTOSS)
    assert served.w1.untyped_storage().data_ptr() == served.s2.untyped_storage().data_ptr()  # one arena


@needs_triton
def test_word_decode_gives_the_exact_bf16_weights():
    """Decode 4 (32-bit word loads, 8 values a word) gives mxfp4.dequantize's bf16 bits at every byte value and every
    scale byte it covers (0..FAST_DECODE_MAX_SCALE), subnormals included, at every K tile (the interpreter runs its
    emulated branch: the same pair words; tests/test_kernels_gpu.py checks the PTX branch)."""
    from pdflash_kernels.moe import DECODE_WORD, FAST_DECODE_MAX_SCALE, decode_fp4

    n, k = 16, 256
    blocks = torch.stack([torch.arange(256, dtype=torch.uint8).roll(37 * r)[: k // 2] for r in range(n)])
    scales = (torch.arange(n * k // 32) % (FAST_DECODE_MAX_SCALE + 1)).to(torch.uint8).reshape(n, k // 32)
    ref = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    for block_k in (32, 128, 256):
        out = decode_fp4(blocks, scales, DECODE_WORD, block_k=block_k)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), block_k
    arena = torch.zeros(blocks.numel() + 1, dtype=torch.uint8)
    arena[1:] = blocks.reshape(-1)
    with pytest.raises(ValueError, match="4-byte aligned"):
        decode_fp4(arena[1:].view(blocks.shape), scales, DECODE_WORD)


@needs_triton
def test_word_decode_falls_back_on_unaligned_weights():
    """Packed rows that are not 4-byte aligned (an odd offset into a byte arena) run decode 3 instead of decode 4, with
    the same result: the choice depends on the weight tensors only, never on the tokens."""
    import dataclasses

    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    w = _experts(fp4=True)
    arena = torch.zeros(w.w1.numel() + 1, dtype=torch.uint8)
    arena[1:] = w.w1.reshape(-1)
    odd = dataclasses.replace(w, w1=arena[1:].view(w.w1.shape))
    assert odd.w1.data_ptr() % 4 != 0
    x, ids, wts = _routing(5, 6, 2)
    c1, c2 = _variant_configs(SWEEP_VARIANTS["word"])
    out = moe_forward(x, ids, wts, odd, 6, config=c1, config2=c2)
    same = moe_forward(x, ids, wts, w, 6, config=c1, config2=c2)
    c3, c4 = _variant_configs(SWEEP_VARIANTS["join_bf16"])
    assert torch.equal(out, moe_forward(x, ids, wts, w, 6, config=c3, config2=c4))
    assert (same.float() - out.float()).abs().max() <= 0.02 * out.float().abs().max() + 1e-3


@needs_triton
@pytest.mark.parametrize("name", ["base", "join_bf16"])
def test_fp4_weights_with_scales_above_two_are_decoded_exactly(name):
    """A block with |w| > 12 needs a scale byte > 128, which the bit-placing decoders cannot fold into one power of
    two: the weights say so (big_scales) and the kernel decodes them by exact selects, whatever the config asks."""
    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    w = _experts(fp4=True)
    w1 = w.w1.clone()
    s1 = w.s1.clone()
    s1[0, 0, 0] = 140  # 2^13: that block's values are now up to 6 * 8192
    big = ExpertWeights(w1, w.w2, s1, w.s2, act=w.act)
    assert not big.big_scales and mxfp4.big_scales(s1)
    big = ExpertWeights(w1, w.w2, s1, w.s2, act=w.act, big_scales=True)
    x, ids, wts = _routing(5, 6, 2)
    ids[:, 0] = 0  # every token uses expert 0, whose first gate row holds the big block
    c1, c2 = _variant_configs(SWEEP_VARIANTS[name])
    out = moe_forward(x * 1e-4, ids, wts, big, 6, config=c1, config2=c2).float()
    ref = moe_reference(x * 1e-4, ids, wts, big, 6).float()
    assert ref.abs().max() > 0 and (out - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3


@needs_triton
@pytest.mark.parametrize("fp4,name", [(False, None), (False, "swap64"), (True, "join_bf16_swap64"), (True, "join_bf16_persist")])
def test_moe_kernel_slots_padding_and_interleaved_rows(fp4, name, monkeypatch):
    from pdflash_kernels import runtime
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(act=ACT_GPTOSS, bias=True, fp4=fp4)
    x, ids, wts = _routing(5, 6, 2)
    # the same experts stored gpt-oss style (gate/up rows interleaved) in shuffled slots
    perm = torch.tensor([4, 0, 5, 2, 1, 3])  # slot s holds expert perm[s]
    slot_of = torch.argsort(perm).to(torch.int32)
    inter = w.intermediate
    order = torch.stack([torch.arange(inter), torch.arange(inter) + inter], 1).reshape(-1)  # g0 u0 g1 u1 ...
    s1 = None if not fp4 else w.s1[perm][:, order]
    s2 = None if not fp4 else w.s2[perm]
    wi = ExpertWeights(w.w1[perm][:, order], w.w2[perm], s1, s2, b1=w.b1[perm][:, order], b2=w.b2[perm], row_mul=2, up_off=1, act=ACT_GPTOSS)
    c1, c2 = _variant_configs({} if name is None else (SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16)[name])
    out = moe_forward(x, ids, wts, wi, 6, slot_of_expert=slot_of, n_valid=torch.tensor([3]), config=c1, config2=c2)
    ref = moe_reference(x, ids, wts, w, 6, n_valid=3)
    assert (out[:3].float() - ref[:3].float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@needs_triton
@pytest.mark.parametrize("name", ["join_bf16", "split_bf16", "join"])
def test_moe_kernel_reduction_with_a_partial_last_k_step(name):
    """K = 96 with 64-wide K steps (as gpt-oss's K = 2880 with 128): the last step is half masked."""
    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    g = torch.Generator().manual_seed(5)
    w1, w2 = (torch.randn(4, 64, 96, generator=g) * 0.2).bfloat16(), (torch.randn(4, 96, 32, generator=g) * 0.2).bfloat16()
    q = mxfp4.MXFP4Experts.quantize(w1, w2)
    w = ExpertWeights(q.w1_blocks, q.w2_blocks, q.w1_scales, q.w2_scales)
    x = torch.randn(6, 96, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    wts = torch.softmax(torch.randn(6, 2, generator=g), -1)
    c1, c2 = _variant_configs({**SWEEP_VARIANTS[name], "block_k": 64}, k1=64, k2=32)
    out = moe_forward(x, ids, wts, w, 4, config=c1, config2=c2)
    ref = moe_reference(x, ids, wts, w, 4)
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3


@needs_triton
@pytest.mark.parametrize("fp4,fields", [
    pytest.param(False, {}, id="bf16-base"),
    pytest.param(True, dict(a_load=2, decode=3, raster=1), id="fp4-join_bf16_raster"),
    pytest.param(False, dict(persist=4), id="bf16-persist"),
    pytest.param(True, dict(a_load=2, decode=3, split_k=2), id="fp4-split2"),
    pytest.param(True, dict(a_load=2, decode=3, fused_combine=True), id="fp4-fused-combine"),
])
def test_phases_give_the_one_phase_bits_and_wait_for_each_copy_group(fp4, fields, monkeypatch):
    """moe_forward's phases (an offloaded cache copying some experts in while the resident ones compute): the blocks
    of resident experts first, then per copy group `between(g)` and that group's blocks; every row bit-identical to one
    phase, whatever the flags (none, some, all; 1-3 groups; in flight), with padding rows and shuffled slots; align and
    align_fused give the same block phases."""
    import dataclasses

    from pdflash_kernels import linear, moe
    from pdflash_kernels.moe import align_fused, launch_gemm1, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    fields = dict(fields)
    monkeypatch.setattr(moe, "FUSED_COMBINE", fields.pop("fused_combine", False))
    e, t, k = 6, 9, 2
    w = _experts(e=e, act=ACT_GPTOSS, bias=True, fp4=fp4)
    x, ids, wts = _routing(t, e, k, seed=4)
    c = dataclasses.replace(_TEST_BASE, **fields)
    c1, c2 = dataclasses.replace(c, block_k=min(c.block_k, 64)), dataclasses.replace(c, block_k=min(c.block_k, 32))
    slot_of = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    perm = torch.argsort(slot_of.long())  # slot s holds expert perm[s]
    ws = ExpertWeights(w.w1[perm], w.w2[perm], None if not fp4 else w.s1[perm], None if not fp4 else w.s2[perm],
                       b1=w.b1[perm], b2=w.b2[perm], act=ACT_GPTOSS)
    nv = torch.tensor([7])
    one = moe_forward(x, ids, wts, ws, e, slot_of_expert=slot_of, n_valid=nv, config=c1, config2=c2)
    ref = moe_reference(x, ids, wts, w, e, n_valid=7)
    assert (one[:7].float() - ref[:7].float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3
    # flags: 0 resident, g copy group g, -1 in flight from a prefetch (group 1); groups: how many copy groups
    for flags, groups in (([0, 1, 0, 0, 1, 1], 1), ([0] * e, 1), ([1] * e, 1), ([1, 0, 0, 0, 0, 0], 1),
                          ([0, 1, 0, 2, 3, 3], 3), ([-1, 2, 0, 1, 0, 2], 2)):
        phase = torch.tensor(flags, dtype=torch.int8)
        group = [1 if f < 0 else f for f in flags]
        # a group's experts' slots hold garbage until between(g) "copies them in": a block of theirs computed before
        # it would change the output
        late = ExpertWeights(*(None if v is None else v.clone() for v in (ws.w1, ws.w2, ws.s1, ws.s2)),
                             b1=ws.b1.clone(), b2=ws.b2.clone(), act=ACT_GPTOSS)
        tensors = [n for n in ("w1", "w2", "s1", "s2", "b1", "b2") if getattr(ws, n) is not None]

        def slots(g):
            return [int(slot_of[j]) for j in range(e) if group[j] == g]

        for n in tensors:
            getattr(late, n)[slots(1) + slots(2) + slots(3)] = getattr(ws, n)[slots(1) + slots(2) + slots(3)].flip(-1)
        calls = []

        def between(g):
            calls.append(g)
            for n in tensors:
                getattr(late, n)[slots(g)] = getattr(ws, n)[slots(g)]

        two = moe_forward(x, ids, wts, late, e, slot_of_expert=slot_of, n_valid=nv, config=c1, config2=c2,
                          phase_of_expert=phase, between=between, groups=groups)
        assert calls == list(range(1, groups + 1)), flags
        assert torch.equal(two, one), flags
        a, b = align(ids, e, 16, slot_of, nv, phase), align_fused(ids, e, 16, slot_of, nv, phase)
        assert torch.equal(a.block_phase, b.block_phase) and torch.equal(a.block_slot, b.block_slot)
        used = int(a.num_blocks)
        assert not a.block_phase[used:].any()
        for blk in range(used):  # each used block's phase is its expert's copy group
            expert = int(perm[int(a.block_slot[blk])])
            assert int(a.block_phase[blk]) == group[expert]
        for ph in range(1, groups + 2):  # a phase's launch writes its own blocks' rows and no other
            h = torch.full((b.max_blocks * 16, ws.intermediate), float("nan"), dtype=torch.bfloat16)
            launch_gemm1(x, b, ws, h, dataclasses.replace(c1, block_m=16, split_k=1), k, phase=ph)
            for blk in range(used):
                rows = b.sorted_pairs[blk * 16: (blk + 1) * 16] < b.num_pairs
                mine = int(b.block_phase[blk]) == ph - 1
                assert bool(h[blk * 16: (blk + 1) * 16][rows].isnan().any()) != mine, (flags, ph, blk)
    assert all(int(v[0].abs().sum()) == 0 for v in linear._COUNTERS.values())  # every counter back at zero


@needs_triton
@pytest.mark.parametrize("decode,a_load", [(0, 0), (0, 2), (1, 0), (1, 2), (3, 0), (3, 2)])
def test_fp4_decodes_give_the_exact_bf16_weights(decode, a_load):
    """Every byte value at every scale byte the fast decodes cover (0..128; decode 0 reads scale 0 as 0) decodes to
    mxfp4.dequantize's bf16 value (bit for bit, but for decode 0's +0 where E2M1 code 8 means -0). Under the interpreter, fp32 -> bf16 casts flush subnormals (the GPU
    keeps them): decodes 0/1 are checked there on values of at least 2^-126 (tests/test_kernels_gpu.py: all)."""
    from pdflash_kernels.moe import FAST_DECODE_MAX_SCALE, decode_fp4

    n, k = 16, 512
    blocks = torch.stack([torch.arange(256, dtype=torch.uint8).roll(17 * i) for i in range(n)])
    scales = (torch.arange(n * k // 32) % (FAST_DECODE_MAX_SCALE + 1)).to(torch.uint8).reshape(n, k // 32)
    ref = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    out = decode_fp4(blocks, scales, decode, a_load)
    check = scales.repeat_interleave(32, 1) >= (1 if decode == 0 else 0)
    if decode != 3 and runtime.interpreting():
        check &= (ref == 0) | (ref.float().abs() >= 2.0**-126)
    assert check.sum() > n * k // 2
    assert torch.equal(out[check].float(), ref[check].float())  # exact bf16 values (== compares +0 and -0 equal)
    if decode != 0:
        assert torch.equal(out.view(torch.int16)[check], ref.view(torch.int16)[check])


@needs_triton
@pytest.mark.parametrize("fp4,name", [(True, "base"), (True, "join_bf16"), (True, "join_bf16_swap64"), (True, "join_bf16_persist"), (False, "swap64")])
def test_moe_kernel_rows_do_not_depend_on_other_rows(fp4, name, monkeypatch):
    from pdflash_kernels import runtime
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(fp4=fp4)
    c1, c2 = _variant_configs((SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16)[name])
    x, ids, wts = _routing(20, 6, 2, seed=3)
    alone = moe_forward(x[:1], ids[:1], wts[:1], w, 6, config=c1, config2=c2)
    for t in (2, 7, 20):
        perm = torch.randperm(t, generator=torch.Generator().manual_seed(t))
        where = int((perm == 0).nonzero())
        out = moe_forward(x[:t][perm], ids[:t][perm], wts[:t][perm], w, 6, config=c1, config2=c2)
        assert torch.equal(out[where], alone[0])


def test_default_config_takes_the_sweep_winners(monkeypatch):
    import dataclasses

    from pdflash_kernels import moe

    base1, base2 = moe.base_config(768, 2048, 8, True), moe.base_config(2048, 768, 8, True)
    assert moe.default_config(768, 2048, 8, True, gemm=1) == moe.variant_config(768, 2048, 8, True, moe.FP4_DEFAULT)
    monkeypatch.setattr(moe, "FP4_DEFAULT", dict(a_load=moe.A_JOIN, decode=moe.DECODE_BF16_BITS))
    monkeypatch.setattr(moe, "SHAPE_OVERRIDES", {(2, 2048, 768, True): dict(swap_ab=True, block_n=64)})
    fp4_default = dict(a_load=moe.A_JOIN, decode=moe.DECODE_BF16_BITS)
    assert moe.default_config(768, 2048, 8, True, gemm=1) == dataclasses.replace(base1, **fp4_default)
    assert moe.default_config(2048, 768, 8, True, gemm=2) == dataclasses.replace(base2, **fp4_default, swap_ab=True, block_n=64)
    assert moe.default_config(2048, 768, 8, True, gemm=1) == dataclasses.replace(base2, **fp4_default)  # keyed by GEMM too
    # bf16: BF16_DEFAULT only (the patched overrides are FP4's)
    assert moe.default_config(768, 2048, 8, False) == moe.variant_config(768, 2048, 8, False, moe.BF16_DEFAULT)
    for table in (moe.SWEEP_VARIANTS, moe.SWEEP_VARIANTS_BF16):  # every named variant is a valid config
        for fields in table.values():
            assert moe.variant_config(768, 2048, 8, True, fields).block_m == 16


@needs_triton
def test_linear_reduce_softmax_kernels():
    from pdflash_kernels.linear import matmul
    from pdflash_kernels.reduce import row_sum, softmax

    g = torch.Generator().manual_seed(0)
    a, w, b = torch.randn(9, 300, generator=g).bfloat16(), torch.randn(70, 300, generator=g).bfloat16(), torch.randn(70, generator=g).bfloat16()
    out = matmul(a, w.t(), b)
    assert torch.allclose(out.float(), a.float() @ w.float().t() + b.float(), rtol=1e-2, atol=0.3)
    for m in (1, 4):  # rows are independent of the others
        assert torch.equal(matmul(a[:m], w.t(), b), out[:m])
    x = torch.randn(4, 3, 100, generator=g)
    assert torch.allclose(row_sum(x, [-1]), x.sum(-1), atol=1e-5)
    assert torch.allclose(row_sum(x, [1], keepdim=True, mean=True), x.mean(1, keepdim=True), atol=1e-6)
    assert torch.allclose(softmax(x, -1), x.softmax(-1), atol=1e-6)
    assert torch.allclose(softmax(x, 1, log=True), x.log_softmax(1), atol=1e-5)
    assert torch.equal(softmax(x[:1], -1), softmax(x, -1)[:1])


@needs_triton
def test_layer_norm_under_the_mode_is_torchs_to_rounding_and_row_invariant():
    """LayerNorm (Phi-3.5-MoE's norms) runs on the invariant row reductions under InvariantMode: torch's values to float
    rounding, and a row's bits whatever rows share the call; the mode's recorder no longer lists it as uncovered."""
    from pdflash_kernels.dispatch import InvariantMode, Recorder

    g = torch.Generator().manual_seed(4)
    ln = torch.nn.LayerNorm(96).bfloat16()
    with torch.no_grad():
        ln.weight.copy_(torch.randn(96, generator=g))
        ln.bias.copy_(torch.randn(96, generator=g))
    x = (torch.randn(9, 96, generator=g) * 3 + 1).bfloat16()
    rec = Recorder()
    with torch.inference_mode(), InvariantMode(rec):
        out = ln(x)
        alone = [ln(x[i : i + 1]) for i in (0, 5)]
    ref = torch.nn.functional.layer_norm(x.float(), (96,), ln.weight.float(), ln.bias.float(), 1e-5)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 0.05
    assert torch.equal(alone[0], out[0:1]) and torch.equal(alone[1], out[5:6])
    assert not rec.uncovered


@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 512, 2048), (3, 300, 700), (70, 130, 1024)])
def test_linear_in_one_launch_gives_the_two_launch_bits(m, n, k, monkeypatch):
    """PDFLASH_LINEAR_ONE_LAUNCH: the last program of a tile adds the K splits' partials in split order, as the second
    launch does: the same bits, and every tile counter back at zero afterwards (the next launch's precondition)."""
    from pdflash_kernels import linear

    g = torch.Generator().manual_seed(m + n)
    a, w, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    assert linear.linear_config(n, k).split > 1
    monkeypatch.setattr(linear, "ONE_LAUNCH", False)
    two = [linear.matmul(a, w.t(), b), linear.matmul(a, w.t())]
    monkeypatch.setattr(linear, "ONE_LAUNCH", True)
    one = [linear.matmul(a, w.t(), b), linear.matmul(a, w.t())]
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    assert int(linear._COUNTERS[("cpu", None)][0].abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("window,sinks", [(None, False), (7, True)])
def test_attention_kernel(window, sinks):
    from pdflash_kernels.attention import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 40, 16, generator=g).bfloat16(), torch.randn(1, 2, 40, 16, generator=g).bfloat16()
    pos = torch.arange(35, 40).reshape(1, 5) + 100  # the cache tensor starts at absolute position 100
    sk = torch.randn(4, generator=g) if sinks else None
    out = attention(q, k, v, pos, 0.25, window, sk)
    ref = attention_reference(q, k, v, pos[0], 100, 0.25, window, sk)
    assert (out.float() - ref.float()).abs().max() < 0.02
    # the last query alone, with the cache's first key at a different absolute chunk offset
    alone = attention(q[:, :, 4:], k[:, :, 3:], v[:, :, 3:], pos[:, 4:], 0.25, window, sk)
    assert torch.equal(alone[:, 0], out[:, 4]) if window else True


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_installed_tiny_model_is_block_invariant_on_cpu(arch, tiny):
    """The installer end to end under the interpreter: logits of every position equal whether computed in one
    forward or in blocks of 1 or 5 on a KV cache (the GPU test also covers real-shaped bf16 layers)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    import pdflash_kernels
    from pdflash.hf_compat import cache_kwarg

    model = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=torch.bfloat16).eval()
    inst = pdflash_kernels.install(model)
    try:
        assert inst.exact, inst.summary()
        ids = torch.randint(0, 400, (1, 14), generator=torch.Generator().manual_seed(0))
        kw = cache_kwarg(model)
        with torch.inference_mode():
            full = model(input_ids=ids).logits
            for block in (1, 5):
                cache = DynamicCache(config=model.config)
                outs = [model(input_ids=ids[:, :4], use_cache=True, **{kw: cache}).logits]
                for p in range(4, 14, block):
                    outs.append(model(input_ids=ids[:, p : p + block], use_cache=True, **{kw: cache}).logits)
                assert torch.equal(torch.cat(outs, 1), full), block
    finally:
        inst.uninstall()
    assert model.config._experts_implementation != "batch_invariant"


def test_kernels_on_without_cuda_is_refused_in_one_line(monkeypatch):
    from verifier_svc.model import kernels_wanted

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert kernels_wanted("auto", cpu) is False and kernels_wanted("off", cpu) is False
    with pytest.raises(ValueError, match="need CUDA and triton"):
        kernels_wanted("on", cpu)


def test_linear_stages_option_is_checked_and_auto_follows_the_k_steps(monkeypatch):
    """PDFLASH_LINEAR_STAGES: 'auto' gives a split of 2 K steps 3 stages and a longer one 4 (pipeline depth only, never
    the tiles or the split); a bad value stops the import with a message naming the variable."""
    from pdflash_kernels import linear

    monkeypatch.setattr(linear, "STAGES", "auto")
    linear.linear_config.cache_clear()
    try:
        short, long_ = linear.linear_config(128, 2048), linear.linear_config(151936, 2048)
        assert short.k_per_split // short.block_k == 2 and short.num_stages == 3
        assert long_.split == 1 and long_.num_stages == 4
    finally:
        linear.linear_config.cache_clear()
    _import_refuses("PDFLASH_LINEAR_STAGES", "fast")


def _import_refuses(var: str, value: str, module: str = "pdflash_kernels.linear") -> None:
    """Importing `module` with `var`=`value` stops with a message that names the variable."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", f"import {module}"], env={**os.environ, var: value}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and f"{var} must be" in r.stderr


def test_pdl_is_on_by_default_only_where_every_cuda_device_is_sm90(monkeypatch):
    """Programmatic dependent launch (griddepcontrol: sm_90+) defaults to on where every CUDA device has it, off on a
    CPU or a mixed host; PDFLASH_PDL=0/1 overrides the default either way."""
    from pdflash_kernels import runtime

    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.delenv("PDFLASH_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert runtime._pdl_default() is False  # an sm_80 device beside the sm_90 one
    caps[1] = (10, 0)
    assert runtime._pdl_default() is True
    monkeypatch.setenv("PDFLASH_PDL", "0")
    assert runtime._pdl_default() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime._pdl_default() is False
    monkeypatch.setenv("PDFLASH_PDL", "1")
    assert runtime._pdl_default() is True
    monkeypatch.delenv("PDFLASH_PDL")
    assert runtime._pdl_default() is False  # no CUDA


@needs_triton
def test_linear_split_fill_option_sets_fewer_splits_and_keeps_rows_invariant(monkeypatch):
    """PDFLASH_LINEAR_SPLIT_FILL: 4 keeps the splits every build before stop 33 used; 1 (the default) splits K only while
    the programs stay within the SMs (the decode shapes benchmarks/linear_sweep.py --splits timed faster). Either way one
    split serves every M: rows alone and in a 40-row call are the same bits. A bad value stops the import."""
    from pdflash_kernels import linear

    shapes = ((5120, 2048), (2048, 4096), (128, 2048), (4096, 2048), (5120, 2880), (2880, 4096), (32, 2880))
    linear.linear_config.cache_clear()
    try:
        monkeypatch.setattr(linear, "SPLIT_FILL", 4)
        linear.linear_config.cache_clear()
        assert [linear.linear_config(n, k).split for n, k in shapes] == [4, 16, 8, 8, 4, 8, 8]
        monkeypatch.setattr(linear, "SPLIT_FILL", 1)
        linear.linear_config.cache_clear()
        assert [linear.linear_config(n, k).split for n, k in shapes] == [1, 4, 8, 2, 1, 2, 8]
        g = torch.Generator().manual_seed(6)
        a, w = torch.randn(40, 1024, generator=g).bfloat16(), torch.randn(256, 1024, generator=g).bfloat16()
        assert linear.linear_config(256, 1024).split > 1
        full = linear.matmul(a, w.t())
        assert all(torch.equal(linear.matmul(a[i : i + 1], w.t()), full[i : i + 1]) for i in (0, 17, 39))
    finally:
        linear.linear_config.cache_clear()
    _import_refuses("PDFLASH_LINEAR_SPLIT_FILL", "3")


@needs_triton
def test_linear_wide_tiles_above_the_threshold_give_the_16_row_tiles_bits(monkeypatch):
    """PDFLASH_LINEAR_WIDE_FROM: calls of more rows take 64-row tiles (one dot a weight tile) instead of 16-row tiles; a
    row's bits are the same in every call of one tile height (1-, 7-, 16-row calls: 16-row tiles; 17- to 80-row calls:
    64-row tiles), with and without a K split, and its values the same across the two heights; 16 is the default, 0
    never widens; a bad value stops the import. (Across heights the bits are the GPU's property, asserted in
    tests/test_kernels_gpu.py: interpreted, `tl.dot` is numpy's sgemm, whose rounding changes with M on some CPUs; an
    AMD EPYC's OpenBLAS gives 64x128 @ 128x64 and 16x128 @ 128x64 rows 4e-6 apart.)"""
    from pdflash_kernels import linear

    g = torch.Generator().manual_seed(7)
    a, w = torch.randn(80, 256, generator=g).bfloat16(), torch.randn(96, 256, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    cfg = linear.linear_config(96, 256)
    assert linear.WIDE_FROM == 16
    monkeypatch.setattr(linear, "WIDE_FROM", 0)
    assert linear.wide(80, cfg) is cfg
    narrow = linear.matmul(a, w.t(), b)
    monkeypatch.setattr(linear, "WIDE_FROM", 16)
    assert linear.wide(16, cfg) is cfg and linear.wide(17, cfg).block_m == 64
    full = linear.matmul(a, w.t(), b)
    torch.testing.assert_close(full, narrow)  # (bf16: at most one rounding step apart on a CPU)
    for m in (1, 7, 16):
        assert torch.equal(linear.matmul(a[:m], w.t(), b), narrow[:m]), m
    for m in (17, 33, 64):
        assert torch.equal(linear.matmul(a[:m], w.t(), b), full[:m]), m
    split = dataclasses.replace(cfg, split=2, k_per_split=128)
    wide_parts = linear.partials(a, w.t(), split)
    assert torch.equal(wide_parts[:, :17], linear.partials(a[:17], w.t(), split))
    narrow_parts = linear.partials(a[:5], w.t(), split)
    torch.testing.assert_close(wide_parts[:, :5], narrow_parts, rtol=1e-6, atol=1e-4)
    assert not torch.equal(wide_parts[0, :5], narrow_parts[1])  # (the two K halves are different sums)
    _import_refuses("PDFLASH_LINEAR_WIDE_FROM", "8")
    _import_refuses("PDFLASH_LINEAR_WIDE_FROM", "yes")


@needs_triton  # (CPU tensors through the kernels: interpreted; on a CUDA machine tests/test_kernels_gpu.py covers it)
def test_linear_block_m_option_keeps_rows_invariant(monkeypatch):
    """PDFLASH_LINEAR_BLOCK_M: the tile height is one value for every call, so a row's bits never depend on M (here a
    16-row tile: rows alone, in a 7-row call and in a 40-row call, whose programs take four row tiles each, are the same
    bits; a 17-row call takes two); a bad value stops the import."""
    from pdflash_kernels import linear

    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(40, 256, generator=g).bfloat16(), torch.randn(96, 256, generator=g).bfloat16()
    monkeypatch.setattr(linear, "BLOCK_M", 16)
    linear.linear_config.cache_clear()
    try:
        cfg = linear.linear_config(96, 256)
        assert cfg.block_m == 16
        # 1, 2 or 4 row tiles a program against each weight tile it loads: the 40-row call runs 4, the 7-row one 1
        assert [linear.m_tiles(m, cfg) for m in (1, 16, 17, 32, 33, 64, 4096)] == [1, 1, 2, 2, 4, 4, 4]
        assert linear.m_tiles(40, cfg, fixup=True) == 1
        import dataclasses

        for cap in (1, 2):  # LinearConfig.max_m_tiles caps them: more programs, each reading the weight tile again
            capped = dataclasses.replace(cfg, max_m_tiles=cap)
            assert [linear.m_tiles(m, capped) for m in (17, 33, 64)] == [min(2, cap), cap, cap]
            assert torch.equal(linear.partials(a, w.t(), capped), linear.partials(a, w.t(), cfg))
        full = linear.matmul(a, w.t())
        assert torch.equal(linear.matmul(a[:7], w.t()), full[:7])
        assert torch.equal(linear.matmul(a[:17], w.t()), full[:17])
        assert all(torch.equal(linear.matmul(a[i : i + 1], w.t()), full[i : i + 1]) for i in (0, 17, 39))
    finally:
        linear.linear_config.cache_clear()
    _import_refuses("PDFLASH_LINEAR_BLOCK_M", "48")
    _import_refuses("PDFLASH_LINEAR_BLOCK_M", "big")
    _import_refuses("PDFLASH_PDL", "true")  # the on/off options (pdflash_kernels.runtime.env_flag) take 0 or 1 only
    _import_refuses("PDFLASH_PDL_TRIGGER", "end")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PDFLASH_PDL_TRIGGER"}  # the default: trigger after the wait
    r = subprocess.run([sys.executable, "-c", "from pdflash_kernels import runtime; print(runtime.PDL_TRIGGER)"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "after-wait", r.stderr[-2000:]
    _import_refuses("PDFLASH_MOE_FUSED_COMBINE", "yes", "pdflash_kernels.moe")
    _import_refuses("PDFLASH_FP4_PAIR_WORDS", "on", "pdflash_kernels.moe")


@needs_triton
@pytest.mark.parametrize("window,sinks", [(None, False), (300, True)])
def test_split_kv_attention_gives_the_same_bits_for_any_program_count(window, sinks):
    """The paged attention over a long context (3 KV segments): one program walking every segment, or several taking
    every P-th segment with the last one merging them in order, give the same bits; so do the non-paged layout, a
    query alone, and the query in a block; and all are close to the plain torch reference."""
    from pdflash_kernels.attention import PAGE, SEG, attention, paged_attention

    g = torch.Generator().manual_seed(1)
    hq, hkv, d, s, t = 4, 2, 16, 2 * SEG + 40, 5
    k, v = torch.randn(1, hkv, s, d, generator=g).bfloat16(), torch.randn(1, hkv, s, d, generator=g).bfloat16()
    q = torch.randn(1, hq, t, d, generator=g).bfloat16()
    sk = torch.randn(hq, generator=g) if sinks else None
    pos = torch.arange(s - t, s).reshape(1, t)
    n_pages = -(-s // PAGE)
    order = torch.randperm(n_pages, generator=g)  # the pool's pages in another order than the positions'
    kp = torch.zeros(n_pages, hkv, PAGE, d, dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    for i in range(n_pages):
        kp[order[i], :, : min(PAGE, s - i * PAGE)] = k[0, :, i * PAGE : (i + 1) * PAGE]
        vp[order[i], :, : min(PAGE, s - i * PAGE)] = v[0, :, i * PAGE : (i + 1) * PAGE]
    table = torch.cat([order, torch.zeros(4, dtype=torch.long)]).to(torch.int32).reshape(1, -1)  # room to spare
    outs = [paged_attention(q, kp, vp, table, pos, 0.25, window, sk, programs=n) for n in (1, 2, 3, 16)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    from pdflash_kernels import attention as attn_mod

    made = len(attn_mod._WORKSPACE[("cpu", None)])  # the split form's states: one buffer shared by later calls
    paged_attention(q[:, :, :1], kp, vp, table, pos[:, :1], 0.25, window, sk, programs=4)
    assert len(attn_mod._WORKSPACE[("cpu", None)]) == made
    assert torch.equal(attention(q, k, v, pos, 0.25, window, sk), outs[0])
    ref = attention_reference(q, k, v, pos[0], 0, 0.25, window, sk)
    assert (outs[0].float() - ref.float()).abs().max() < 0.02
    _import_refuses("PDFLASH_ATTENTION_PROGRAMS", "many", "pdflash_kernels.attention")
    short = pos - (s - 105)  # a context of one segment: program 0 holds it, the others have none
    one = paged_attention(q, kp, vp, table, short, 0.25, window, sk, programs=1)
    assert torch.equal(paged_attention(q, kp, vp, table, short, 0.25, window, sk, programs=4), one)
    assert torch.equal(attention(q, k[:, :, :105], v[:, :, :105], short, 0.25, window, sk), one)
    for n in (1, 3):  # the last query alone (what 1-token decoding does) and the first, on keys up to their position
        assert torch.equal(paged_attention(q[:, :, 4:], kp, vp, table, pos[:, 4:], 0.25, window, sk, programs=n)[:, 0], outs[0][:, 4])
        k0, v0 = k[:, :, : s - 4], v[:, :, : s - 4]
        assert torch.equal(attention(q[:, :, :1], k0, v0, pos[:, :1], 0.25, window, sk)[:, 0], outs[0][:, 0])


def test_moe_split_k_option_sets_every_default_config_and_refuses_other_values():
    """PDFLASH_MOE_SPLIT_K (read at import): split_k of every default MoE GEMM config, 1 included; unset, each shape's
    default (pair-word MXFP4 on gpt-oss's shape: 4 ranges); other values stop the import with the variable's name."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("from pdflash_kernels import moe; print(moe.default_config(2880, 2880, 4, True).split_k, moe.default_config(768, 2048, 8, False, 2).split_k,"
            " moe.default_config(2880, 2880, 4, True, 1, pair_words=True).split_k,"
            " moe.default_config(768, 2048, 8, True, 1, pair_words=True).split_k)")  # gpt-oss's shape, then Qwen3's
    for value, want in (("2", "2 2 2 2"), ("1", "1 1 1 1"), (None, "1 1 4 1")):
        env = {k: v for k, v in os.environ.items() if k != "PDFLASH_MOE_SPLIT_K"}
        if value is not None:
            env["PDFLASH_MOE_SPLIT_K"] = value
        r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == want.split(), (value, r.stderr[-800:])
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PDFLASH_MOE_SPLIT_K": "3"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "PDFLASH_MOE_SPLIT_K must be 1, 2 or 4" in r.stderr
    for bad in ("0", "lots"):  # the token chunks' workspace cap
        r = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PDFLASH_MOE_SPLIT_WORKSPACE_MB": bad},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "PDFLASH_MOE_SPLIT_WORKSPACE_MB must be a whole number" in r.stderr, bad


# ---- pair words (pdflash_kernels/mxfp4.py to_pair_words; decodes 5 and 6) ----------------------------------------------------
def test_pair_words_round_trip_and_decode_to_the_mxfp4_values():
    """to_pair_words permutes the bits inside each 4-byte word (a bijection: from_pair_words undoes it, the byte count is
    the same), and the kernels' rotate-and-mask decode of it (decode_pair_words, in torch) gives mxfp4.dequantize's
    values at every code and every scale byte 0..128; above 128 the fast form reads 128, as the other fast decodes."""
    g = torch.Generator().manual_seed(3)
    b = torch.randint(0, 256, (8, 96), dtype=torch.uint8, generator=g)
    pw = mxfp4.to_pair_words(b)
    assert pw.shape == b.shape and not torch.equal(pw, b)
    assert torch.equal(mxfp4.from_pair_words(pw), b)
    assert torch.equal(mxfp4.from_pair_words(mxfp4.to_pair_words(b[:, 4:])), b[:, 4:])  # a strided view
    assert sorted(mxfp4.PAIR_WORD_SOURCES) == list(range(32))
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 2)  # every byte value, 4 rows of K = 1024
    scales = (torch.arange(4 * 32) % 129).to(torch.uint8).reshape(4, 32)
    got = mxfp4.decode_pair_words(mxfp4.to_pair_words(codes), scales, torch.float32)
    assert torch.equal(got, mxfp4.dequantize(codes, scales, torch.float32))
    with pytest.raises(ValueError, match="whole 4-byte words"):
        mxfp4.to_pair_words(torch.zeros(2, 6, dtype=torch.uint8))


@needs_triton
@pytest.mark.parametrize("decode", [5, 6])
def test_pair_word_decodes_give_the_exact_bf16_weights(decode):
    """Decode 5 (one multiply by 2^(s-1): scale bytes 0..128) and decode 6 (two multiplies: 1..254, 0 reads as 0) of pair
    words give mxfp4.dequantize's bf16 bits at every byte value, at every K tile (the interpreter runs their emulated
    branch: the same rotations and masks; tests/test_kernels_gpu.py checks the PTX)."""
    from pdflash_kernels.moe import FAST_DECODE_MAX_SCALE, decode_fp4

    n, k = 16, 256
    blocks = torch.stack([torch.arange(256, dtype=torch.uint8).roll(37 * r)[: k // 2] for r in range(n)])
    top, lo = (FAST_DECODE_MAX_SCALE, 0) if decode == 5 else (254, 1)
    scales = (lo + torch.arange(n * k // 32) % (top - lo + 1)).to(torch.uint8).reshape(n, k // 32)
    ref = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    for block_k in (32, 128, 256):
        out = decode_fp4(mxfp4.to_pair_words(blocks), scales, decode, block_k=block_k)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), block_k


def _pair_weights(w: ExpertWeights) -> ExpertWeights:
    import dataclasses

    return dataclasses.replace(w, w1=mxfp4.to_pair_words(w.w1), w2=mxfp4.to_pair_words(w.w2), pair_words=True)


@needs_triton
@pytest.mark.parametrize("big", [False, True])
def test_pair_word_weights_give_the_nibble_order_bits(big):
    """Experts stored as pair words run decode 5 (6 with big scales) whatever the config asks, and give bit for bit what
    the same experts in nibble order give through the same tiles (decode 4; decode 0 with big scales): the decodes are
    exact and the K order is the same. The torch reference reads pair words too."""
    import dataclasses

    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward, resolve_decodes

    w = dataclasses.replace(_experts(fp4=True, bias=True, act=ACT_GPTOSS), big_scales=big)
    pw = _pair_weights(w)
    x, ids, wts = _routing(7, 6, 2, seed=4)
    c1, c2 = _variant_configs(SWEEP_VARIANTS["join_bf16"])
    p1, p2 = resolve_decodes(pw, c1, c2)
    assert (p1.decode, p2.decode) == ((6, 6) if big else (5, 5))
    n1, n2 = resolve_decodes(w, dataclasses.replace(c1, decode=5), dataclasses.replace(c2, decode=5))
    assert (n1.decode, n2.decode) == ((0, 0) if big else (4, 4))  # a pair config on nibble-order weights
    got = moe_forward(x, ids, wts, pw, 6, config=c1, config2=c2)
    want = moe_forward(x, ids, wts, w, 6, config=dataclasses.replace(c1, decode=0 if big else 4),
                       config2=dataclasses.replace(c2, decode=0 if big else 4))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(moe_reference(x, ids, wts, pw, 6), moe_reference(x, ids, wts, w, 6))


@needs_triton
def test_pair_word_weights_must_be_word_aligned():
    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    pw = _pair_weights(_experts(fp4=True))
    arena = torch.zeros(pw.w1.numel() + 1, dtype=torch.uint8)
    arena[1:] = pw.w1.reshape(-1)
    import dataclasses

    odd = dataclasses.replace(pw, w1=arena[1:].view(pw.w1.shape))
    x, ids, wts = _routing(3, 6, 2)
    c1, c2 = _variant_configs(SWEEP_VARIANTS["join_bf16"])
    with pytest.raises(ValueError, match="4-byte aligned"):
        moe_forward(x, ids, wts, odd, 6, config=c1, config2=c2)


def test_pair_words_default_config_comes_from_its_own_table(monkeypatch):
    from pdflash_kernels import moe

    monkeypatch.setattr(moe, "PAIR_SHAPE_OVERRIDES", {(2, 64, 32): {"block_k": 32}})
    c = moe.default_config(64, 32, 2, True, gemm=2, pair_words=True)
    assert c.decode == moe.DECODE_PAIR_WORDS and c.swap_ab == moe.PAIR_DEFAULT.get("swap_ab", False) and c.block_k == 32
    assert moe.default_config(64, 32, 2, True, gemm=2).decode != moe.DECODE_PAIR_WORDS
    monkeypatch.setattr(moe, "PAIR_WORDS", True)  # the default: on a GPU only
    assert moe.pair_words_for("cuda") and not moe.pair_words_for("cpu")
    monkeypatch.setattr(moe, "PAIR_WORDS", False)  # PDFLASH_FP4_PAIR_WORDS=0
    assert not moe.pair_words_for("cuda")
    import os
    import subprocess
    import sys

    for env, want in (({}, "True"), ({"PDFLASH_FP4_PAIR_WORDS": "0"}, "False")):  # on unless told otherwise
        base = {k: v for k, v in os.environ.items() if k != "PDFLASH_FP4_PAIR_WORDS"}
        r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.moe as m; print(m.PAIR_WORDS)"], env={**base, **env},
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == want, r.stderr[-2000:]


def test_env_flags_take_0_or_1_and_fall_back_to_their_default(monkeypatch):
    monkeypatch.delenv("PDFLASH_TEST_FLAG", raising=False)
    assert runtime.env_flag("PDFLASH_TEST_FLAG") is False and runtime.env_flag("PDFLASH_TEST_FLAG", default=True) is True
    monkeypatch.setenv("PDFLASH_TEST_FLAG", "0")
    assert runtime.env_flag("PDFLASH_TEST_FLAG", default=True) is False
    monkeypatch.setenv("PDFLASH_TEST_FLAG", "1")
    assert runtime.env_flag("PDFLASH_TEST_FLAG") is True
    monkeypatch.setenv("PDFLASH_TEST_FLAG", "yes")
    with pytest.raises(ValueError, match="PDFLASH_TEST_FLAG must be 0 or 1"):
        runtime.env_flag("PDFLASH_TEST_FLAG", default=True)


def test_the_sweep_summary_picks_each_stored_format_by_the_whole_call():
    """benchmarks/kernel_bench.py `sweep_summary`: the pair-word variants form their own format (PAIR_DEFAULT and its
    overrides), defaults and per-model overrides follow the whole call's time even where the GEMMs timed alone say
    otherwise, and an override writes its block_k out (it merges over the format's default)."""
    from benchmarks.kernel_bench import sweep_summary

    def row(model, variant, decode, us, g1, g2, active=8, block_k=128):
        cfg = dict(decode=decode, block_k=block_k)
        return dict(model=model, weights="mxfp4", active=active, tpe=1, variant=variant, config1=cfg, config2=cfg, us=us,
                    gemm1_us=g1, gemm2_us=g2, speedup=2.0, hbm_fraction=0.3)

    rows = [row(m, "default", 3, 100.0, 40, 40) for m in ("qwen3-30b-a3b", "mixtral-8x7b")]
    rows += [row("qwen3-30b-a3b", "pair_k256_raster", 5, 80.0, 30, 30, block_k=256),
             row("qwen3-30b-a3b", "pair_swap64_w2_raster", 5, 70.0, 35, 35),  # the whole call wins for Qwen3
             row("mixtral-8x7b", "pair_k256_raster", 5, 60.0, 30, 30, block_k=256),
             row("mixtral-8x7b", "pair_swap64_w2_raster", 5, 120.0, 20, 20)]  # alone faster, whole call slower
    text = "\n".join(sweep_summary(rows))
    assert "PAIR_DEFAULT: dict = dict(SWEEP_VARIANTS['pair_k256_raster'])" in text
    assert "(1, 768, 2048): dict(SWEEP_VARIANTS['pair_swap64_w2_raster'], block_k=128),  # qwen3-30b-a3b" in text
    assert "(2, 2048, 768): dict(SWEEP_VARIANTS['pair_swap64_w2_raster'], block_k=128),  # qwen3-30b-a3b" in text
    assert "# mixtral" not in text.split("PAIR_SHAPE_OVERRIDES")[1]  # pair_k256_raster stays Mixtral's


def test_with_sweep_winners_puts_the_printed_block_in_place(monkeypatch):
    """benchmarks/with_sweep_winners.py: the block the sweep prints is executed over pdflash_kernels.moe, so the winners' configs
    are what `variant_config` gives in that process (a GPU call can check them before they are pasted); a sweep output
    without the block is refused with a message."""
    from benchmarks import with_sweep_winners as w
    from benchmarks.kernel_bench import sweep_summary
    from pdflash_kernels import moe

    def row(model, variant, us, block_k=128, split_k=1):
        cfg = dict(decode=5, block_k=block_k, split_k=split_k)
        return dict(model=model, weights="mxfp4", active=8, tpe=1, variant=variant, config1=cfg, config2=cfg, us=us,
                    gemm1_us=us / 2, gemm2_us=us / 2, speedup=2.0, hbm_fraction=0.3)

    # the split form wins overall (the format's default), Qwen3 keeps its unsplit tile: its override must say split_k=1
    rows = [row("qwen3-30b-a3b", "pair_swap64_w2_raster", 60.0), row("qwen3-30b-a3b", "pair_swap64_w2_raster_split4", 80.0, split_k=4),
            row("mixtral-8x7b", "pair_swap64_w2_raster", 200.0), row("mixtral-8x7b", "pair_swap64_w2_raster_split4", 90.0, split_k=4)]
    text = "sweep gpt-oss ...\n" + "\n".join(sweep_summary(rows)) + "\nsweep written to /x/kernels_sweep_h200.txt and .json\n"
    assert "(1, 768, 2048): dict(SWEEP_VARIANTS['pair_swap64_w2_raster'], block_k=128, split_k=1),  # qwen3-30b-a3b" in text
    for name in w.NAMES:  # restored after the test
        monkeypatch.setattr(moe, name, dict(getattr(moe, name)))
    monkeypatch.setattr(moe, "PAIR_DEFAULT", dict(moe.SWEEP_VARIANTS["pair_k256_raster"]))  # whatever the tree's is
    monkeypatch.setattr(moe, "PAIR_SHAPE_OVERRIDES", {})
    changed = w.apply(w.winners_block(text))
    assert set(changed) == {"PAIR_DEFAULT", "PAIR_SHAPE_OVERRIDES"}
    assert moe.PAIR_DEFAULT["split_k"] == 4
    assert moe.default_config(768, 2048, 8, True, 1, pair_words=True).split_k == 1  # Qwen3: its override, unsplit
    assert moe.default_config(768, 2048, 8, True, 1, pair_words=True).swap_ab
    assert moe.default_config(14336, 4096, 2, True, 1, pair_words=True).split_k == 4  # Mixtral: the new default
    with pytest.raises(SystemExit, match="did the sweep finish"):
        w.winners_block("sweep mixtral ... (cut by the time limit)")


@needs_triton
@pytest.mark.parametrize("name", ["pair_k256_wk4_raster", "pair_k256_n64_wk2_raster", "pair_swap64_wk2_raster"])
def test_k_split_over_the_warps_keeps_rows_invariant(name, monkeypatch):
    """MoeConfig.a_load 3/4 (each K step's values split over the warps, the partial tiles summed after the K loop): a
    token's output is the same bits alone and among 9 others, and near the one-dot form's (another summation order)."""
    from pdflash_kernels import runtime
    from pdflash_kernels.moe import SWEEP_VARIANTS, moe_forward

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _pair_weights(_experts(h=128, i=64, act=ACT_GPTOSS, bias=True, fp4=True))
    x, ids, wts = _routing(10, 6, 2, seed=4)
    x = torch.randn(10, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    c1, c2 = _variant_configs(SWEEP_VARIANTS[name], k1=128, k2=64)
    assert c1.a_load in (3, 4) and c1.block_k // c1.num_warps >= 16
    full = moe_forward(x, ids, wts, w, 6, config=c1, config2=c2)
    for r in (0, 7):
        assert torch.equal(moe_forward(x[r : r + 1], ids[r : r + 1], wts[r : r + 1], w, 6, config=c1, config2=c2), full[r : r + 1])
    j1, j2 = _variant_configs(SWEEP_VARIANTS["pair_k256_raster"], k1=128, k2=64)
    join = moe_forward(x, ids, wts, w, 6, config=j1, config2=j2)
    assert (full.float() - join.float()).abs().max() <= 0.02 * join.float().abs().max() + 1e-3
    with pytest.raises(ValueError, match="K over the warps"):  # a warp count the split does not fit
        moe_forward(x, ids, wts, w, 6, config=dataclasses.replace(c1, num_warps=c1.num_warps * 2), config2=c2)


@needs_triton
def test_a_long_call_with_split_k_runs_in_token_chunks_with_the_one_calls_bits(monkeypatch):
    """pdflash_kernels.moe.token_chunk: with a K split, a call longer than the workspace cap allows runs as token chunks (its
    split-K workspaces stay bounded); batch invariance makes the chunks' output the one call's, bit for bit, padding
    rows (n_valid) included. Without a split there is no chunking."""
    from pdflash_kernels import moe, runtime

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _pair_weights(_experts(h=64, i=32, act=ACT_GPTOSS, bias=True, fp4=True))
    x, ids, wts = _routing(40, 6, 2, seed=8)
    c1, c2 = _variant_configs(moe.SWEEP_VARIANTS["pair_swap64_w2_raster_split4"], k1=64, k2=32)
    c1, c2 = (dataclasses.replace(c, block_k=32) for c in (c1, c2))  # 2 and 1 K steps: gate/up splits in 2
    assert moe.split_span(64, c1)[0] == 2
    nv = torch.tensor([37])
    one = moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2)
    per_token = 2 * 4 * 2 * (2 * 32)  # topk x 4 bytes x 2 ranges x the gate/up columns
    monkeypatch.setattr(moe, "SPLIT_WORKSPACE_BYTES", 16 * per_token)
    assert moe.token_chunk(2, 32, 64, c1, c2) == 16
    calls = []
    real = moe.align_fused
    monkeypatch.setattr(moe, "align_fused", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    chunked = moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2)
    assert calls == [16, 16, 8]
    assert torch.equal(chunked.view(torch.int16), one.view(torch.int16))
    # an expert cache still copying (phases): the first chunk waits for each copy group, the later chunks find them in
    waits = []
    phase = torch.tensor([0, 1, 0, 2, 0, 1], dtype=torch.int8)
    calls.clear()
    phased = moe.moe_forward(x, ids, wts, w, 6, n_valid=nv, config=c1, config2=c2, phase_of_expert=phase,
                             between=waits.append, groups=2)
    assert waits == [1, 2] and calls == [16, 16, 8]
    assert torch.equal(phased.view(torch.int16), one.view(torch.int16))
    plain = dataclasses.replace(c1, split_k=1), dataclasses.replace(c2, split_k=1)
    assert moe.token_chunk(2, 32, 64, *plain) > 1 << 40


def test_a_bf16_only_sweep_still_prints_its_shape_overrides():
    """benchmarks/kernel_bench.py `sweep_summary` with bf16 variants alone: a model whose winner differs from the bf16 default
    gets its SHAPE_OVERRIDES entries (fp4 False), with the default's fields it lacks written out."""
    from benchmarks.kernel_bench import sweep_summary

    def row(model, variant, us, split_k=1):
        cfg = dict(block_k=128, split_k=split_k, persist=4 if variant.startswith("persist") else 0)
        return dict(model=model, weights="bf16", active=8, tpe=1, variant=variant, config1=cfg, config2=cfg, us=us,
                    gemm1_us=us / 2, gemm2_us=us / 2, speedup=2.0, hbm_fraction=0.5)

    rows = [row("mixtral-8x7b", "persist", 100.0), row("mixtral-8x7b", "swap64_split4", 300.0, 4),
            row("qwen3-30b-a3b", "persist", 40.0), row("qwen3-30b-a3b", "swap64_split4", 30.0, 4)]
    text = "\n".join(sweep_summary(rows))
    assert "BF16_DEFAULT: dict = dict(SWEEP_VARIANTS_BF16['persist'])" in text
    block = text.split("SHAPE_OVERRIDES: dict[tuple[int, int, int, bool], dict] = {")[1]
    assert "(1, 768, 2048, False): dict(SWEEP_VARIANTS_BF16['swap64_split4'], block_k=128, persist=0),  # qwen3-30b-a3b" in block
    assert "mixtral" not in block


@needs_triton
@pytest.mark.parametrize("block_k,split", [(64, 2), (64, 4), (32, 4), (128, 4)])
def test_split_k_over_a_reduction_with_a_masked_last_step_matches_the_reference(block_k, split, monkeypatch):
    """The swapped pair-word tile with K in ranges where the reduction is not a whole number of K steps (gpt-oss-20b's
    2880 against 128- or 256-wide steps): the last range's masked tail adds nothing, every range's partial is added."""
    from pdflash_kernels import moe, runtime
    from pdflash_kernels.reference import moe_reference

    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 1)
    w = _experts(h=96, i=32, act=ACT_GPTOSS, bias=True, fp4=True)
    x, ids, wts = _routing(5, 6, 2, seed=3)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    c = MoeConfig(block_m=16, block_n=32, block_k=block_k, num_warps=2, num_stages=1, decode=5, a_load=2, swap_ab=True,
                  raster=1, split_k=split)
    n, span = moe.split_span(96, c)
    assert (n - 1) * span < 96 <= n * span and span % block_k == 0  # every range non-empty, whole K steps, K covered
    out = moe.moe_forward(x, ids, wts, _pair_weights(w), 6, config=c, config2=c)
    ref = moe_reference(x, ids, wts, w, 6)
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3


def test_result_files_are_named_for_the_card_that_ran(monkeypatch):
    """benchmarks/kernel_bench.py `device_tag`: the GPU machines lend H100s as well as H200s, and a table written on one
    must not carry the other's name (stop 45's first calls wrote fragment_h200.* on an H100)."""
    from benchmarks.kernel_bench import device_tag

    assert device_tag("cpu") == "cpu"
    for name, tag in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, _n=name: _n)
        assert device_tag("cuda") == tag, name


@needs_triton
@pytest.mark.parametrize("window,sinks", [(None, False), (70, True)])
def test_ragged_attention_gives_each_sequence_the_bits_of_a_call_of_its_own(window, sinks):
    """A multi-session verify wave's attention: the rows of several sequences one after the other (each its own page
    table row, positions and length, one empty), in one launch, give each sequence's rows the bits of a paged call of
    that sequence alone, for any program count; the rows past the last sequence (a padded wave's tail) stay zero."""
    from pdflash_kernels.attention import PAGE, SEG, paged_attention

    g = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 16
    lengths = [2 * SEG + 40, 7, 130, 300]  # each sequence's context (keys up to its last query)
    rows = [5, 1, 0, 3]  # its queries in the wave (the third sequence has none)
    n_pages = sum(-(-s // PAGE) for s in lengths) + 2
    kp = torch.randn(n_pages, hkv, PAGE, d, generator=g).bfloat16()
    vp = torch.randn(n_pages, hkv, PAGE, d, generator=g).bfloat16()
    order = torch.randperm(n_pages, generator=g).tolist()
    width = max(-(-s // PAGE) for s in lengths) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, s in enumerate(lengths):
        for i in range(-(-s // PAGE)):
            table[b, i] = order.pop()
    q_all = torch.randn(1, hq, sum(rows) + 3, d, generator=g).bfloat16()  # 3 rows of tail
    pos_all = torch.zeros(1, sum(rows) + 3, dtype=torch.long)
    starts = [0]
    for s, n in zip(lengths, rows):
        pos_all[0, starts[-1] : starts[-1] + n] = torch.arange(s - n, s)
        starts.append(starts[-1] + n)
    seq_starts = torch.tensor(starts, dtype=torch.int32)
    sk = torch.randn(hq, generator=g) if sinks else None
    outs = [paged_attention(q_all, kp, vp, table, pos_all, 0.25, window, sk, programs=n, seq_starts=seq_starts,
                            max_rows=max(rows)) for n in (1, 2, 16)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    out = outs[0]
    assert out.shape == (1, sum(rows) + 3, hq, d)
    for b, n in enumerate(rows):
        if not n:
            continue
        a, e = starts[b], starts[b + 1]
        alone = paged_attention(q_all[:, :, a:e], kp, vp, table[b : b + 1], pos_all[:, a:e], 0.25, window, sk)
        assert torch.equal(out[:, a:e], alone), f"sequence {b}"
    assert not out[:, starts[-1]:].any()
    from pdflash_kernels import attention as attn_mod

    budget = attn_mod.WORKSPACE_MAX_BYTES
    made = attn_mod._WORKSPACE.pop(("cpu", None), None)
    try:  # split states over the workspace budget: one program a tile (a long-context wave), the same bits, none made
        attn_mod.WORKSPACE_MAX_BYTES = 1
        assert torch.equal(paged_attention(q_all, kp, vp, table, pos_all, 0.25, window, sk, programs=16,
                                           seq_starts=seq_starts, max_rows=max(rows)), out)
        assert not attn_mod._WORKSPACE.get(("cpu", None))
    finally:
        attn_mod.WORKSPACE_MAX_BYTES = budget
        if made is not None:
            attn_mod._WORKSPACE[("cpu", None)] = made
    _import_refuses("PDFLASH_ATTENTION_WORKSPACE_MB", "0", "pdflash_kernels.attention")
    with pytest.raises(ValueError, match="max_rows"):
        paged_attention(q_all, kp, vp, table, pos_all, 0.25, window, sk, seq_starts=seq_starts)
    with pytest.raises(ValueError, match="page table of 2 rows for 4 sequences"):
        paged_attention(q_all, kp, vp, table[:2], pos_all, 0.25, window, sk, seq_starts=seq_starts, max_rows=5)


def test_gpu_sh_names_every_step_it_runs():
    """benchmarks/gpu.sh's usage line lists exactly the steps its body runs (`has STEP` or a `" STEP "` match), so a
    step added to one and not the other is caught on the CPU, not on the GPU machine's clock."""
    src = (pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu.sh").read_text()
    usage = re.search(r"gpu\.sh OUT \[([a-z0-9|]+)\]", src)
    assert usage, "gpu.sh's usage line"
    named = set(usage.group(1).split("|"))
    ran = set(re.findall(r"\bhas ([a-z0-9]+);", src)) | set(re.findall(r'== \*" ([a-z0-9]+) "\*', src))
    assert named - {"all"} == ran - {"all"}, (sorted(named - ran), sorted(ran - named))


@needs_triton
@pytest.mark.parametrize("kernel", ["_align_kernel", "_align_programs_kernel"])
def test_align_kernels_compile_for_sm90(kernel):
    """Both forms of the routing step compile for sm_90 with tl.sort (the GPU's ranking; the interpreter tests above
    rank by a compare), on Qwen3-30B-A3B's 128 experts with slots and copy groups. In a process without
    TRITON_INTERPRET (under it the kernels are interpreted functions, which do not compile)."""
    import os
    import subprocess
    import sys

    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pdflash_kernels import moe
sig = {{"ids_ptr": "*i32", "nvalid_ptr": "*i32", "slot_ptr": "*i32", "sorted_ptr": "*i32", "block_slot_ptr": "*i32",
       "num_blocks_ptr": "*i32", "valid_ptr": "*i1", "P": "i32", "MB": "i32", "phase_ptr": "*i8", "block_phase_ptr": "*i8"}}
const = dict(E=128, NB=128, TOPK=8, BM=16, HAS_NVALID=True, HAS_SLOT=True, CH=256, C=64, HAS_PHASE=True, SORT=True)
if "{kernel}" == "_align_programs_kernel":
    sig["BPP"] = "i32"
else:
    const["PAD_C"] = 1024
sig.update({{c: "constexpr" for c in const}})
kern = triton.compile(ASTSource(moe.{kernel}, sig, const), target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
print("st.global" in kern.asm["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
