"""pdflash_kernels/fragments.py: MXFP4 weights as MMA fragment words and the Gluon GEMM that reads them.

CPU: the layout against PTX's m16n8k16 A-fragment rule (decoded word by word, independently of the inverse), round
trips, the reference against a dense matmul, and the kernel compiled for sm_90 (its operand layout change must move
no data: `convert_layout(..., assert_trivial=True)`; shared memory only for the activation tile and the gate/up
exchange). GPU (skipped without CUDA): the kernel against its reference for every tile form (K splits too), each row's
bits whatever the other rows of the call, and fragment_moe against the MoE reference, bit-identical for any batch."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from pdflash_kernels import fragments as F
from pdflash_kernels import mxfp4


def _mx(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return mxfp4.quantize(torch.randn(*shape, generator=g, device=device) * 0.05)


@pytest.mark.parametrize("shape", [(48, 192), (2, 16, 64), (3, 32, 320)])
def test_fragment_words_round_trip(shape):
    b, s = _mx(*shape)
    words, sw = F.to_fragment_words(b, s)
    n, k = shape[-2], shape[-1]
    assert words.shape == (*shape[:-2], n // 16, k // 64, 8, 4, 4) and words.dtype == torch.int32
    assert sw.shape == (*shape[:-2], n // 16, k // 64, 8)
    assert words.numel() * 4 == b.numel() and sw.numel() * 4 == s.numel()  # the same bytes, permuted
    b2, s2 = F.from_fragment_words(words, sw)
    assert torch.equal(b2, b) and torch.equal(s2, s)


def test_fragment_words_hold_each_lanes_mma_fragment():
    """Word (tile n, quad q, g, t, tile kr) decodes (pair-word decode, pairs a0..a3) to rows n*16 + g / + 8, columns
    q*64 + kr*16 + 2t (+1, +8, +9): PTX's A fragment of lane 4g + t; its scale word's byte 2h + kr // 2 is row
    g + 8h's scale of that 32-column group."""
    b, s = _mx(2, 32, 128, seed=1)
    words, sw = F.to_fragment_words(b, s)
    nw = words.numel()
    raw = words.contiguous().view(torch.uint8).reshape(nw // 4, 16)
    vals = mxfp4.decode_pair_words(raw, torch.full((nw // 4, 1), 127, dtype=torch.uint8), torch.float32)
    vals = vals.reshape(*words.shape, 4, 2)  # ..., pair p, element e
    ref = mxfp4.dequantize(b, torch.full_like(s, 127), torch.float32)
    swb = sw.contiguous().view(torch.uint8).reshape(*sw.shape, 4)
    nt, kq = words.shape[1], words.shape[2]
    for p, (h, j) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        for e in (0, 1):
            got = vals[..., p, e]  # [S, nt, kq, g, t, kr]
            n_idx = torch.arange(nt)[:, None, None, None, None] * 16 + h * 8 + torch.arange(8)[None, None, :, None, None]
            k_idx = (torch.arange(kq)[None, :, None, None, None] * 64 + torch.arange(4)[None, None, None, None, :] * 16
                     + j * 8 + 2 * torch.arange(4)[None, None, None, :, None] + e)
            n_idx, k_idx = torch.broadcast_tensors(n_idx, k_idx)
            assert torch.equal(got, ref[:, n_idx, k_idx])
    for h in (0, 1):
        for grp in (0, 1):
            rows = torch.arange(nt)[:, None, None] * 16 + h * 8 + torch.arange(8)[None, None, :]
            cols = torch.arange(kq)[None, :, None] * 2 + grp
            rows, cols = torch.broadcast_tensors(rows, cols)
            assert torch.equal(swb[..., 2 * h + grp], s[:, rows, cols])


def test_fragment_words_refuse_shapes_the_layout_cannot_hold():
    b, s = _mx(24, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        F.to_fragment_words(b, s)
    b, s = _mx(16, 96)
    with pytest.raises(ValueError, match="K of 64"):
        F.to_fragment_words(b, s)


def _routing(ids: torch.Tensor, e: int, bm: int = 16):
    from pdflash_kernels.moe import align

    return align(ids, e, bm)


def test_reference_is_the_dense_product_of_each_pair():
    torch.manual_seed(0)
    e, k, h, n = 4, 2, 128, 32
    b, s = _mx(e, n, h, seed=3)
    x = torch.randn(5, h).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]])
    r = _routing(ids, e)
    y = F.frag_gemm_reference(x, r, b, s, k)
    w = mxfp4.dequantize(b, s, torch.float32)
    bm = r.sorted_pairs.numel() // r.max_blocks
    seen = 0
    for blk in range(int(r.num_blocks)):
        for m in range(bm):
            pair = int(r.sorted_pairs[blk * bm + m])
            if pair >= r.num_pairs:
                continue
            tok, slot = divmod(pair, k)
            assert int(r.block_slot[blk]) == int(ids[tok, slot])
            torch.testing.assert_close(y[blk * bm + m], x[tok].float() @ w[ids[tok, slot]].T)
            seen += 1
    assert seen == ids.numel()


def test_fragment_experts_round_trip_the_gate_up_order():
    """from_weights puts w1's rows in gate_up_order (gpt-oss's interleaved rows too); to_weights restores them."""
    from pdflash_kernels.moe import ACT_GPTOSS, ExpertWeights

    s, i, h = 3, 64, 128
    b1, s1 = _mx(s, 2 * i, h, seed=4)
    b2, s2 = _mx(s, h, i, seed=5)
    for kw in ({}, dict(row_mul=2, up_off=1, act=ACT_GPTOSS)):
        w = ExpertWeights(b1, b2, s1, s2, **kw)
        fw = F.FragmentExperts.from_weights(w)
        assert fw.intermediate == i and fw.hidden == h
        back = fw.to_weights()
        assert torch.equal(back.w1, b1) and torch.equal(back.s1, s1) and torch.equal(back.w2, b2) and torch.equal(back.s2, s2)
        order = F.gate_up_order(i, w.row_mul, w.up_offset)
        gates, ups = F.from_fragment_words(fw.w1, fw.s1)[0].split(i, dim=1)
        assert torch.equal(gates, b1[:, order[:i]]) and torch.equal(ups, b1[:, order[i:]])
    w = ExpertWeights(mxfp4.to_pair_words(b1), mxfp4.to_pair_words(b2), s1, s2, pair_words=True)
    assert torch.equal(F.FragmentExperts.from_weights(w).to_weights().w1, b1)  # pair-word weights are read as such


def test_model_info_names_the_fragment_tiles(monkeypatch):
    """The installer's experts report says which tiles the fragment GEMMs run: one pair, each call-size class's
    (PDFLASH_FP4_SIZE_TILES), or PDFLASH_FP4_TILES's."""
    from pdflash_kernels.installer import _frag_tiles
    from pdflash_kernels.moe import ExpertWeights

    b1, s1 = _mx(2, 2 * 64, 128, seed=4)
    b2, s2 = _mx(2, 128, 64, seed=5)
    fw = F.FragmentExperts.from_weights(ExpertWeights(b1, b2, s1, s2))
    monkeypatch.setattr(F, "FRAG_TILES", None)
    monkeypatch.setattr(F, "SIZE_TILES", True)
    monkeypatch.setitem(F.FRAG_SHAPES, (128, 64), (F.FragTile(4, 2, 4, 1), F.FragTile(4, 4, 4)))
    assert _frag_tiles(fw) == "tiles 4x2w4p / 4x4w4"  # (no classes for this shape)
    monkeypatch.setitem(F.FRAG_BY_SIZE, (128, 64), ((16, F.FragTile(4, 2, 4, 1), F.FragTile(4, 2, 4, stages=3, xring=1)),
                                                    (None, F.FragTile(8, 2, 4, stages=3, xring=1), F.FragTile(4, 4, 4))))
    assert _frag_tiles(fw) == "tiles by call size: up to 16 pairs 4x2w4p / 4x2w4aa3, more pairs 8x2w4aa3 / 4x4w4"
    monkeypatch.setattr(F, "SIZE_TILES", False)
    assert _frag_tiles(fw) == "tiles 4x2w4p / 4x4w4"
    monkeypatch.setattr(F, "SIZE_TILES", True)
    monkeypatch.setattr(F, "FRAG_TILES", F.parse_tiles("4x4w4aa3,8x2w4a4"))
    assert _frag_tiles(fw) == "tiles 4x4w4aa3 / 8x2w4a4 from PDFLASH_FP4_TILES"
    monkeypatch.setitem(F.PERSIST_SHAPES, (128, 64), 512)  # and whether its routed calls run persistent GEMMs
    monkeypatch.setattr(F, "PERSIST_PER_SM", 8)
    want = "; persistent GEMMs on routed calls of up to 512 pairs, 8 programs a multiprocessor"
    assert _frag_tiles(fw) == "tiles 4x4w4aa3 / 8x2w4a4 from PDFLASH_FP4_TILES" + want
    monkeypatch.setattr(F, "PERSIST_PER_SM", 0)
    assert _frag_tiles(fw) == "tiles 4x4w4aa3 / 8x2w4a4 from PDFLASH_FP4_TILES"


def test_calls_take_their_size_class_tiles(monkeypatch):
    """With PDFLASH_FP4_SIZE_TILES a call takes the first class whose most pairs it fits (a big call, None pairs, the
    last class), without it FRAG_SHAPES' tiles; PDFLASH_FP4_TILES overrides both. A table where a tile would split K
    (and so change a row's bits with the call's size), or whose classes are out of order, is refused."""
    monkeypatch.setattr(F, "FRAG_TILES", None)
    monkeypatch.setattr(F, "SIZE_TILES", True)
    for (h, i), classes in F.FRAG_BY_SIZE.items():
        lo = 1
        for most, t1, t2 in classes:
            top = most if most is not None else lo + 1000
            for pairs in (lo, top):
                assert F.frag_config(h, i, pairs) == (t1, t2), (h, i, pairs)
            lo = top + 1
        assert F.frag_config(h, i) == classes[-1][1:]
    qwen = F.FRAG_BY_SIZE[(2048, 768)]
    assert [F.frag_config(2048, 768, p) for p in (8, 16, 17, 48, 49, 128)] == [qwen[0][1:]] * 2 + [qwen[1][1:]] * 2 + [qwen[2][1:]] * 2
    assert F.frag_config(64, 128, 4) == F.FRAG_DEFAULT  # a shape with no classes
    assert F.frag_config(4096, 14336, 4) == F.FRAG_SHAPES[(4096, 14336)]
    monkeypatch.setattr(F, "SIZE_TILES", False)  # off: every call FRAG_SHAPES' tiles
    for p in (None, 0, 4, 4096):
        assert F.frag_config(2880, 2880, p) == F.FRAG_SHAPES[(2880, 2880)]
    monkeypatch.setattr(F, "SIZE_TILES", True)
    monkeypatch.setattr(F, "FRAG_TILES", F.parse_tiles("4x4w4aa3,8x2w4a4"))
    assert F.frag_config(2880, 2880, 4) == F.FRAG_TILES and F.size_classes(2880, 2880) == ()
    for classes in F.FRAG_BY_SIZE.values():
        assert all(t.split == 1 for c in classes for t in c[1:])
    ok = (F.FragTile(), F.FragTile())
    with pytest.raises(ValueError, match="splits K"):
        F._check_by_size({(1, 2): (F.FragTile(), F.FragTile(split=2))}, {(1, 2): ((None, *ok),)})
    with pytest.raises(ValueError, match="splits K"):
        F._check_by_size({}, {(1, 2): ((8, F.FragTile(8, 2, 4, split=4), F.FragTile()), (None, *ok))})
    for bad in (((16, *ok),), ((16, *ok), (8, *ok), (None, *ok)), ((16, *ok), (16, *ok), (None, *ok)), ((0, *ok), (None, *ok)), ()):
        with pytest.raises(ValueError, match="ascend and end with None"):
            F._check_by_size({}, {(1, 2): bad})
    from tests.test_kernels import _import_refuses

    _import_refuses("PDFLASH_FP4_SIZE_TILES", "maybe", "pdflash_kernels.fragments")


@pytest.mark.parametrize("h,i,bias", [(2880, 2880, True), (2048, 768, False), (4096, 14336, False)])
def test_expert_arena_views_meet_the_staged_tiles_alignment(h, i, bias):
    """The served tiles copy 16-byte pieces (`_check_async`): FragmentExperts over an expert arena or slot pool (every
    slice and section 256-byte aligned) pass the check for the three served shapes, in any slot of the pool."""
    layout = mxfp4.ExpertLayout(h, i, bias)
    assert layout.nbytes % 256 == 0
    pool = torch.zeros(2, layout.nbytes, dtype=torch.uint8)
    fw = F.fragment_experts_over(pool, layout, 2 if bias else 1, int(bias), 0, 1.702, 7.0)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    for t in (*F.frag_config(h, i), *(t for c in F.FRAG_BY_SIZE.get((h, i), ()) for t in c[1:])):
        F._check_async(t, x, fw.w1, fw.w2, fw.s1, fw.s2)
        F._check_async(t, x, fw.w1[1:], fw.w2[1:])  # slot 1's slice


def test_fragment_experts_refuse_what_the_fast_decode_cannot_hold():
    from pdflash_kernels.moe import ExpertWeights

    b1, s1 = _mx(2, 32, 64)
    b2, s2 = _mx(2, 64, 16 * 4)
    s1[0, 0, 0] = 200
    with pytest.raises(ValueError, match="above 128"):
        F.FragmentExperts.from_weights(ExpertWeights(b1, b2[:, :, :16], s1, s2[:, :, :1]))
    with pytest.raises(ValueError, match="MXFP4"):
        F.FragmentExperts.from_weights(ExpertWeights(torch.zeros(2, 32, 64).bfloat16(), torch.zeros(2, 64, 16).bfloat16()))


needs_gluon = pytest.mark.skipif(F.gluon is None, reason="needs Triton's Gluon")
SIG = {"x_ptr": "*bf16", "stride_x": "i32", "out_ptr": "*fp32", "stride_o": "i32", "pairs_ptr": "*i32", "slot_ptr": "*i32",
       "nblocks_ptr": "*i32", "phase_ptr": "*i32", "w_ptr": "*i32", "stride_ws": "i32", "s_ptr": "*i32", "stride_ss": "i32",
       "b_ptr": "*bf16", "stride_b": "i32", "rw_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "R": "i32",
       "P": "i32", "alpha": "fp32", "limit": "fp32", "tab_ptr": "*i32"}


def _compile_gemm(const: dict, warps: int, out: str, direct: bool = False):
    """`_frag_gemm` compiled for sm_90 (no GPU needed) with these constexprs; `out` the output pointer's type, `direct`
    the routing-free call's int64 top-k ids and bool keep flags."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(SIG, out_ptr=out, **{c: "constexpr" for c in const})
    if direct:
        sig.update(pairs_ptr="*i64", phase_ptr="*i1")
    return triton.compile(GluonASTSource(F._frag_gemm, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})


@needs_gluon
@pytest.mark.parametrize("n,k,tile,epi", [(5760, 2880, "4x1w4", 0), (2880, 2880, "8x4w4p", 1), (2048, 768, "4x4w4", 2),
                                         (80, 320, "4x2w4p", 3), (2880, 2880, "8x4w4ps4", 1), (14336, 4096, "4x8w4s2", 2),
                                         (2880, 2880, "8x2w4pp", 1), (768, 2048, "4x4w4pps2", 2),
                                         (2880, 2880, "8x2w4aa4", 1), (2048, 768, "4x4w4aa3", 2), (768, 2048, "4x4w4a2s2", 2),
                                         (80, 320, "4x2w4a3", 3), (2880, 2880, "8x2w4a4", 1), (768, 2048, "4x4w4aa2s2", 2),
                                         # (gpu.sh deeptiles: 2-warp programs, deeper rings)
                                         (768, 2048, "2x4w2aa6", 1), (2048, 768, "4x4w4a8", 2),
                                         (2880, 2880, "4x2w4aa8", 1), (2048, 768, "2x2w2a8", 2)])
def test_kernel_compiles_for_sm90_with_no_operand_data_movement(n, k, tile, epi, monkeypatch):
    """The A operand's layout change is checked trivial at compile time (no shuffles; shared memory holds only the
    activation tile, read back with ldmatrix, and for gate/up the epilogue's exchange of the gate and up rows). Staged
    tiles (aS): S steps of words, scale words and activations in shared memory, filled by cp.async, the words and the
    activations 16 bytes a copy, nothing in local memory."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (compiling needs no GPU; the interpreter is not involved)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    nt, kqs, warps, pf, split, stages, xring = F.FragTile.parse(tile)
    split, ss = F.split_plan(k // 64, kqs, split)
    const = dict(N=n, K=k, TOPK=4, EPI=epi, ACT=1, HAS_BIAS=epi in (1, 2), ROW_MUL=2, UP_OFF=1, PHASE=1 if epi == 2 else 0,
                 BM=16, NT=nt, KQS=kqs, W=warps, PREFETCH=pf, SPLIT=split, SS=ss, STAGES=stages, XRING=xring)
    sig = dict(SIG, out_ptr="*bf16" if epi == 1 else "*fp32", **{c: "constexpr" for c in const})
    kern = triton.compile(GluonASTSource(F._frag_gemm, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "shfl" not in ptx and "ldmatrix" in ptx
    assert ".local" not in ptx
    epi_smem = nt * 16 * 16 * 4 if epi == 1 else 0
    if stages:
        step = nt * kqs * 512 + nt * kqs * 128  # words, a scale word a thread's 4 words
        xtile = 16 * kqs * 64 * 2  # the activations: a ring slot a stage (aaS), or one staging tile
        assert kern.metadata.shared <= stages * step + (stages if xring else 1) * xtile + epi_smem + 2 * 16 * 64 * 2
        assert re.search(r"cp\.async\.wait_group\s+\d+;\s*bar\.sync", ptx)  # the copies visible to every thread
        sizes = set(re.findall(r"cp\.async\.(c[ag])\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx))
        assert sizes == {("cg", "0x10"), ("ca", "0x4")}, sizes  # 16-byte words and activations, 4-byte scale words
    else:
        assert kern.metadata.shared <= 2 * 16 * kqs * 64 * 2 + epi_smem
        assert "cp.async" not in ptx
    assert ("atom.global" in ptx) == (split > 1)  # the split's counter


@needs_gluon
@pytest.mark.parametrize("n,k,tile,epi,has_slot,has_nvalid,dp", [(5760, 2880, "4x2w4aa4", 1, 1, 1, 16),
                                                                 (2880, 2880, "4x4w4aa3", 2, 0, 0, 128),
                                                                 (1536, 2048, "4x4w4", 1, 0, 1, 64),
                                                                 (2048, 768, "8x2w4aa3", 2, 1, 0, 32)])
def test_direct_pair_kernel_compiles_for_sm90(n, k, tile, epi, has_slot, has_nvalid, dp, monkeypatch):
    """The GEMM without the routing launch (DIRECT: block b led by pair b, each program grouping the <= DP pairs by
    expert itself, its slot read through the top-k ids) compiles for sm_90 with the same MMAs, nothing in local memory,
    no atomics; int64 top-k ids as the router gives them."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nt, kqs, warps, pf, split, stages, xring = F.FragTile.parse(tile)
    const = dict(N=n // 2 if epi == 1 else n, K=k, TOPK=8, EPI=epi, ACT=0, HAS_BIAS=False, ROW_MUL=1, UP_OFF=0, PHASE=0,
                 BM=16, NT=nt, KQS=kqs, W=warps, PREFETCH=pf, SPLIT=1, SS=k // 64 // kqs, STAGES=stages, XRING=xring,
                 DIRECT=1, E=128, HAS_SLOT=has_slot, HAS_NVALID=has_nvalid, DP=dp, GROUP=int(dp > 16),
                 TAB=int(dp > 16 and epi == 1))
    kern = _compile_gemm(const, warps, "*bf16" if epi == 1 else "*fp32", direct=True)
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and ".local" not in ptx and "atom.global" not in ptx


@needs_gluon
@pytest.mark.parametrize("n,k,tile,epi,direct", [(1536, 2048, "8x2w4aa3", 1, 0), (2048, 768, "8x2w4aa3", 2, 0),
                                                 (2880, 2880, "4x2w4aa4", 1, 1), (768, 2048, "4x4w4pps2", 2, 0),
                                                 (2048, 768, "4x4w4", 2, 1)])
def test_persistent_kernel_compiles_for_sm90(n, k, tile, epi, direct, monkeypatch):
    """PERSIST (a fixed grid, each program walking the live tiles) compiles for sm_90 with the tile's MMAs, a loop
    around them, nothing in local memory, and a barrier between tiles (the shared buffers reused)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nt, kqs, warps, pf, split, stages, xring = F.FragTile.parse(tile)
    split, ss = F.split_plan(k // 64, kqs, split)
    const = dict(N=n // 2 if epi == 1 else n, K=k, TOPK=8, EPI=epi, ACT=0, HAS_BIAS=False, ROW_MUL=1, UP_OFF=0, PHASE=0,
                 BM=16, NT=nt, KQS=kqs, W=warps, PREFETCH=pf, SPLIT=split, SS=ss, STAGES=stages, XRING=xring,
                 DIRECT=direct, E=128, HAS_SLOT=0, HAS_NVALID=0, PERSIST=1, DP=64, GROUP=1)
    kern = _compile_gemm(const, warps, "*bf16" if epi == 1 else "*fp32", direct=bool(direct))
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and ".local" not in ptx
    assert "%nctaid.x" in ptx  # the walk's stride: the grid's size
    assert ("atom.global" in ptx) == (split > 1)


@needs_gluon
@pytest.mark.parametrize("tile,bias,direct,persist,split", [("4x4w4", False, 0, 0, 1), ("8x2w4aa3", True, 0, 0, 1),
                                                            ("4x1w4", False, 1, 0, 1), ("4x2w4aa3", False, 1, 1, 1),
                                                            ("4x4w4ps2", True, 0, 1, 2)])
def test_up_only_first_gemm_compiles_for_sm90(tile, bias, direct, persist, split, monkeypatch):
    """The first GEMM of up-only experts (EPI 1, ACT 2: Nemotron 3 Nano's 1856 up rows over K 2688) compiles for sm_90
    with the tile's MMAs and a program's NT tiles all up tiles: its epilogue (relu(up)^2, bf16) needs no exchange
    through shared memory, so shared memory holds only the activations (and a staged tile's ring)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    n, k = 1856, 2688
    nt, kqs, warps, pf, _, stages, xring = F.FragTile.parse(tile)
    split, ss = F.split_plan(k // 64, kqs, split)
    const = dict(N=n, K=k, TOPK=6, EPI=1, ACT=2, HAS_BIAS=bias, ROW_MUL=1, UP_OFF=0, PHASE=0, BM=16, NT=nt, KQS=kqs,
                 W=warps, PREFETCH=pf, SPLIT=split, SS=ss, STAGES=stages, XRING=xring, PERSIST=persist)
    if direct:
        const.update(DIRECT=1, E=128, HAS_SLOT=1, HAS_NVALID=1, DP=64, GROUP=1, TAB=1)
    kern = _compile_gemm(const, warps, "*bf16", direct=bool(direct))
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and ".local" not in ptx
    assert direct or "shfl" not in ptx  # (a routing-free call's grouping reduces over the ids with shuffles)
    assert ptx.count("max.f32") + ptx.count("max.NaN.f32") >= 1  # (the relu)
    step = nt * kqs * 512 + nt * kqs * 128
    xtile = 16 * kqs * 64 * 2
    ring = stages * step + (stages if xring else 1) * xtile if stages else 2 * xtile
    assert kern.metadata.shared <= ring + 2 * 16 * 64 * 2  # (no gate/up exchange: nt * 16 * 16 * 4 bytes)
    assert ("atom.global" in ptx) == (split > 1)


def test_persist_setting_is_checked(monkeypatch):
    # the H100's A/B (stop 50, benchmarks/persist_ab.py): 8 programs a multiprocessor, calls of up to 512 pairs on the
    # shapes measured faster (Qwen3-30B-A3B, gpt-oss-20b), none elsewhere (Mixtral-8x7B measured slower)
    assert F.PERSIST_PER_SM == 8 and F.PERSIST_PAIRS is None
    assert F.persist_pairs(2048, 768) == F.persist_pairs(2880, 2880) == 512 and F.persist_pairs(4096, 14336) == 0
    # the served decision: routed calls of at most that many pairs; a persistent grid only where one a tile is larger
    assert F.uses_persist(16, 8, 2048, 768, direct=False) and F.uses_persist(128, 4, 2880, 2880, direct=False)
    assert not F.uses_persist(65, 8, 2048, 768, direct=False)  # 520 pairs
    assert not F.uses_persist(2, 8, 2048, 768, direct=True) and not F.uses_persist(4, 2, 4096, 14336, direct=False)
    monkeypatch.setattr(F, "PERSIST_DIRECT", True)  # (the routing-free calls on the persistent grid too: opt-in)
    assert F.uses_persist(16, 8, 2048, 768, direct=True)
    sms = F.runtime.sm_count()
    assert F.persist_grid(8 * sms + 1) == 8 * sms and F.persist_grid(8 * sms) == 0 and F.persist_grid(136 * 24) == 8 * sms
    monkeypatch.setattr(F, "PERSIST_PER_SM", 0)
    assert F.persist_grid(1 << 20) == 0
    monkeypatch.setattr(F, "PERSIST_PAIRS", 64)
    assert F.persist_pairs(4096, 14336) == F.persist_pairs(2048, 768) == 64
    from tests.test_kernels import _import_refuses

    for bad in ("17", "-1", "all"):
        _import_refuses("PDFLASH_FP4_PERSIST", bad, "pdflash_kernels.fragments")
    for bad in ("-1", "many"):
        _import_refuses("PDFLASH_FP4_PERSIST_PAIRS", bad, "pdflash_kernels.fragments")
    import os
    import subprocess
    import sys

    import yaml

    env = yaml.safe_load((pathlib.Path(__file__).parents[1] / "compose.gpu.yaml").read_text())["services"]["verifier"]["environment"]
    assert env["PDFLASH_FP4_PERSIST"] == "${PDFLASH_FP4_PERSIST:-8}"
    assert env["PDFLASH_FP4_PERSIST_PAIRS"] == "${PDFLASH_FP4_PERSIST_PAIRS:-}"
    r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.fragments as F; "
                        "print(F.PERSIST_PER_SM, F.persist_pairs(2048, 768), F.persist_pairs(4096, 14336))"],
                       capture_output=True, text=True, env={**os.environ, "PDFLASH_FP4_PERSIST": "8",
                                                            "PDFLASH_FP4_PERSIST_PAIRS": ""})
    assert r.stdout.split() == ["8", "512", "0"], r.stderr  # empty (compose.gpu.yaml's default) = unset: by shape


def test_direct_pairs_are_small_unsplit_calls_only(monkeypatch):
    q = (F.FragTile(4, 4, 4), F.FragTile(4, 4, 4))
    # on by default since its GPU test passed (stop 45): 16 pairs; 128 where DIRECT_SHAPES names the device and shape
    # (stop 54), which group their pairs above 16 on the persistent grid
    assert F.DIRECT_PAIRS is None and F.DIRECT_GROUP is None and F.PERSIST_DIRECT is None
    h100 = "NVIDIA H100 80GB HBM3"
    assert F.direct_pairs(2048, 768, "") == F.direct_pairs(2880, 2880, h100) == 16 and F.direct_pairs(2048, 768, h100) == 128
    assert F.direct_group(17, 2048, 768, h100) and not F.direct_group(16, 2048, 768, h100)
    assert not F.direct_group(17, 2880, 2880, h100) and not F.direct_group(17, 2048, 768, "NVIDIA A100-SXM4-80GB")
    assert F.direct_pairs(2048, 768, "NVIDIA H200") == 128 and F.direct_group(17, 2048, 768, "NVIDIA H200")
    monkeypatch.setattr(F, "device_name", lambda: h100)
    assert F.direct_refusal(16, 8, 2048, 768, *q) is None and "129 pairs" in F.direct_refusal(129, 1, 2048, 768, *q)
    assert F.uses_persist(4, 8, 2048, 768, direct=True) and not F.uses_persist(2, 8, 2048, 768, direct=True)
    monkeypatch.setattr(F, "DIRECT_GROUP", False)  # the overrides (PDFLASH_FP4_DIRECT_GROUP, _PERSIST_DIRECT)
    assert not F.direct_group(64, 2048, 768) and not F.uses_persist(4, 8, 2048, 768, direct=True)
    monkeypatch.setattr(F, "DIRECT_GROUP", True)
    assert F.direct_group(8, 2880, 2880) and F.uses_persist(1, 8, 2048, 768, direct=True)
    monkeypatch.setattr(F, "PERSIST_DIRECT", False)
    assert not F.uses_persist(4, 8, 2048, 768, direct=True)
    monkeypatch.setattr(F, "DIRECT_PAIRS", 0)
    assert "DIRECT_PAIRS" in F.direct_refusal(1, 8, 2048, 768, *q)
    monkeypatch.setattr(F, "DIRECT_PAIRS", 16)
    assert F.direct_refusal(2, 8, 2048, 768, *q) is None and F.direct_refusal(1, 4, 2880, 2880, *q) is None
    assert "17 pairs" in F.direct_refusal(17, 1, 2048, 768, *q)
    assert F.direct_refusal(0, 8, 2048, 768, *q) == "no pairs"
    assert "split K" in F.direct_refusal(1, 2, 4096, 14336, F.FragTile(4, 4, 4), F.FragTile(4, 4, 4, split=4))
    from tests.test_kernels import _import_refuses

    for bad in ("129", "-1", "some"):
        _import_refuses("PDFLASH_FP4_DIRECT_PAIRS", bad, "pdflash_kernels.fragments")
    for name in ("PDFLASH_FP4_DIRECT_GROUP", "PDFLASH_FP4_PERSIST_DIRECT"):
        _import_refuses(name, "yes", "pdflash_kernels.fragments")
    import os
    import subprocess
    import sys

    import yaml

    env = yaml.safe_load((pathlib.Path(__file__).parents[1] / "compose.gpu.yaml").read_text())["services"]["verifier"]["environment"]
    for name in ("PDFLASH_FP4_DIRECT_PAIRS", "PDFLASH_FP4_DIRECT_GROUP", "PDFLASH_FP4_PERSIST_DIRECT"):
        assert env[name] == "${%s:-}" % name  # empty = unset: by device and shape
    r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.fragments as F; h = 'NVIDIA H100 80GB HBM3'; "
                        "print(F.direct_pairs(2048, 768, h), F.direct_group(32, 2048, 768, h))"], capture_output=True,
                       text=True, env={**os.environ, "PDFLASH_FP4_DIRECT_PAIRS": "", "PDFLASH_FP4_DIRECT_GROUP": "",
                                       "PDFLASH_FP4_PERSIST_DIRECT": ""})
    assert r.stdout.split() == ["128", "True"], r.stderr


def test_call_path_names_the_launches_a_call_takes(monkeypatch):
    """fragments.call_path (fragment_moe's choice, and persist_ab's o0 rows): direct up to DIRECT_PAIRS, then the one
    launch in its pairs range, else the routed launches."""
    q = (F.FragTile(4, 4, 4), F.FragTile(4, 4, 4))
    monkeypatch.setattr(F, "DIRECT_PAIRS", 16)
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
    assert F.call_path(2, 8, 2048, 768, *q) == "direct"
    assert F.call_path(3, 8, 2048, 768, *q) == F.call_path(16, 8, 2048, 768, *q) == "one"
    assert F.call_path(17, 8, 2048, 768, *q) == "routed"
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 0)
    assert F.call_path(3, 8, 2048, 768, *q) == "routed"
    monkeypatch.setattr(F, "DIRECT_PAIRS", 0)
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
    assert F.call_path(1, 8, 2048, 768, *q) == "one"


@needs_gluon
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_kernel_waits_for_the_kernel_before_it_first_under_pdl(mode, monkeypatch):
    """PDL (F.PDL_MODE): 1 = griddepcontrol.wait, then launch_dependents, both before the program's first global load (the
    routing and the slots' copies are the previous kernels' writes); 2 = the other order; 0 = neither."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    const = dict(N=2048, K=768, TOPK=8, EPI=2, ACT=0, HAS_BIAS=False, ROW_MUL=1, UP_OFF=0, PHASE=0, BM=16, NT=4, KQS=4,
                 W=4, PREFETCH=0, SPLIT=1, SS=3, PDL=mode, STAGES=0)
    sig = dict(SIG, out_ptr="*fp32", **{c: "constexpr" for c in const})
    ptx = triton.compile(GluonASTSource(F._frag_gemm, sig, const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    if mode == 0:
        assert "griddepcontrol" not in body
        return
    wait, launch, load = body.index("griddepcontrol.wait"), body.index("griddepcontrol.launch_dependents"), body.index("ld.global")
    assert max(wait, launch) < load
    assert (wait < launch) == (mode == 1)


def test_the_gemms_pdl_is_opt_in_and_a_bad_value_is_refused():
    """PDFLASH_FP4_FRAGMENTS_PDL: off unless set to 1 (and runtime.PDL on); anything but 0/1 stops the import."""
    import os

    from tests.test_kernels import _import_refuses

    if "PDFLASH_FP4_FRAGMENTS_PDL" not in os.environ:
        assert F._PDL_ASKED is False and F.PDL_MODE == 0
    _import_refuses("PDFLASH_FP4_FRAGMENTS_PDL", "yes", "pdflash_kernels.fragments")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_case(e, k, h, n, tokens, seed=0):
    from pdflash_kernels.moe import align_fused

    b, s = _mx(e, n, h, seed=seed, device="cuda")
    words, sw = F.to_fragment_words(b, s)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(tokens)])
    return b, s, words, sw, x, ids, align_fused(ids, e, 16)


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("e,k,h,n,tokens,tile", [
    (32, 4, 2880, 5760, 3, "4x1w4"), (32, 4, 2880, 2880, 16, "8x4w4p"), (128, 8, 2048, 1536, 40, "4x4w4"),
    (8, 2, 320, 80, 33, "4x2w4p"), (8, 2, 320, 80, 7, "8x1w8"), (8, 2, 4096, 128, 21, "4x8w4"),
    (32, 4, 2880, 2880, 9, "8x4w4ps4"), (8, 2, 4096, 128, 21, "4x8w4s3"), (8, 2, 320, 80, 33, "4x1w4ps2"),
    (32, 4, 2880, 2880, 9, "8x2w4pp"), (8, 2, 320, 80, 33, "4x2w4pps2"), (8, 2, 320, 80, 7, "4x1w4pp"),
    (32, 4, 2880, 2880, 16, "8x4w4a3"), (8, 2, 320, 80, 33, "4x2w4a3"), (8, 2, 4096, 128, 21, "4x8w4a2s3"),
    (128, 8, 2048, 1536, 40, "4x4w4a4"), (8, 2, 320, 80, 7, "4x1w4a4"), (32, 4, 2880, 2880, 9, "8x2w4aa3"),
    (8, 2, 320, 80, 33, "4x2w4aa4s2")])
def test_kernel_matches_reference(e, k, h, n, tokens, tile):
    b, s, words, sw, x, ids, r = _gpu_case(e, k, h, n, tokens)
    ref = F.frag_gemm_reference(x, r, b, s, k)
    y = F.frag_gemm(x, r, words, sw, k, tile=tile)
    err = (y - ref).abs().max() / ref.abs().max()
    assert float(err) < 1e-4, float(err)  # float32 sums of exact weights, in another order
    hin = torch.randn(r.max_blocks * 16, h, device="cuda").bfloat16()  # the down GEMM's form: rows are block rows
    ref2 = F.frag_gemm_reference(hin, r, b, s, k, rows_from_pairs=False)
    y2 = F.frag_gemm(hin, r, words, sw, k, rows_from_pairs=False, tile=tile)
    assert float((y2 - ref2).abs().max() / ref2.abs().max()) < 1e-4


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["4x1w4", "8x4w4p", "8x4w4ps4", "4x2w4s3", "8x2w4pps3", "8x4w4a3", "4x4w4aa2s4"])
def test_kernel_rows_are_bit_identical_whatever_the_other_rows(tile):
    """Token 0 alone, then with 1..63 random other tokens (routed to the same and other experts): its pairs' output
    rows keep their bits."""
    from pdflash_kernels.moe import align_fused

    e, k, h, n = 32, 4, 2880, 2880
    b, s, words, sw, x, ids, r = _gpu_case(e, k, h, n, 1)

    def rows_of_token0(x, ids):
        r = align_fused(ids, e, 16)
        y = F.frag_gemm(x, r, words, sw, k, tile=tile)
        pos = {int(p): i for i, p in enumerate(r.sorted_pairs.tolist()) if int(p) < r.num_pairs}
        return torch.stack([y[pos[j]] for j in range(k)])  # pairs 0..k-1 are token 0's
    alone = rows_of_token0(x, ids)
    g = torch.Generator(device="cuda").manual_seed(7)
    for others in (1, 5, 15, 63):
        xo = torch.cat([x, torch.randn(others, h, generator=g, device="cuda").bfloat16()])
        io = torch.cat([ids, torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(others)])])
        assert torch.equal(rows_of_token0(xo, io), alone), others


MOE_SHAPES = {  # experts, top-k, hidden, expert width, form: "gptoss" (interleaved gate/up rows, biases, clamped
    # SwiGLU), "silu" (gate rows then up rows), "relu2" (up-only experts, Nemotron-H / Nemotron 3: relu(up)^2), "relu2_bias"
    "gpt-oss-20b": (32, 4, 2880, 2880, "gptoss"),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "small": (8, 2, 320, 192, "gptoss"),
    "nemotron-3-nano": (128, 6, 2688, 1856, "relu2"),
    "small-up": (8, 2, 320, 192, "relu2_bias"),
}
UP_ONLY = ("nemotron-3-nano", "small-up")


def _moe_case(model, tokens, seed=0):
    from pdflash_kernels.moe import ACT_GPTOSS, ACT_RELU2, ExpertWeights

    e, k, h, i, form = MOE_SHAPES[model]
    r1 = i if form.startswith("relu2") else 2 * i  # w1's rows (up-only experts: the I up rows alone)
    g = torch.Generator(device="cuda").manual_seed(seed)
    b1, s1 = mxfp4.quantize(torch.randn(e, r1, h, generator=g, device="cuda") * 0.02)
    b2, s2 = mxfp4.quantize(torch.randn(e, h, i, generator=g, device="cuda") * 0.02)
    kw = dict(row_mul=2, up_off=1, act=ACT_GPTOSS) if form == "gptoss" else dict(act=ACT_RELU2) if r1 == i else {}
    if form in ("gptoss", "relu2_bias"):
        kw.update(b1=(torch.randn(e, r1, generator=g, device="cuda") * 0.02).bfloat16(),
                  b2=(torch.randn(e, h, generator=g, device="cuda") * 0.02).bfloat16())
    w = ExpertWeights(b1, b2, s1, s2, **kw)
    x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, k, generator=g, device="cuda"), -1).bfloat16()
    return e, w, F.FragmentExperts.from_weights(w), x, ids, wts


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model,tokens,tiles", [("gpt-oss-20b", 5, None), ("qwen3-30b-a3b", 17, None), ("small", 40, None),
                                                ("gpt-oss-20b", 5, "8x4w4ps4,8x4w4ps4"), ("small", 40, "4x1w4s2,4x2w4ps3"),
                                                ("qwen3-30b-a3b", 17, "8x2w4,4x4w4s2"), ("nemotron-3-nano", 17, None),
                                                ("small-up", 40, None), ("small-up", 40, "4x1w4s2,4x2w4ps3"),
                                                ("nemotron-3-nano", 5, "4x2w4aa3s3,4x4w4ps2")])
def test_fragment_moe_matches_the_moe_reference(model, tokens, tiles):
    from pdflash_kernels.reference import moe_reference

    e, w, fw, x, ids, wts = _moe_case(model, tokens)
    ref = moe_reference(x, ids, wts, w, e).float()
    config = tuple(F.FragTile.parse(t) for t in tiles.split(",")) if tiles else None
    out = F.fragment_moe(x, ids, wts, fw, e, config=config).float()
    assert float((out - ref).abs().max()) <= 0.02 * float(ref.abs().max())  # tests/test_kernels_gpu.py's bound


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model,tiles", [("gpt-oss-20b", None), ("qwen3-30b-a3b", None),
                                         ("gpt-oss-20b", "8x4w4ps4,8x2w4ps4"), ("qwen3-30b-a3b", "4x4w4s2,4x4w4ps2"),
                                         ("nemotron-3-nano", None), ("small-up", "4x4w4s2,4x4w4ps2")])
def test_fragment_moe_rows_are_bit_identical_for_any_batch_and_phases(model, tiles):
    """A token's output row keeps its bits with 0..63 other tokens in the call, and when the experts are computed in
    copy groups (phases) as an expert cache brings them; with K split too."""
    e, w, fw, x, ids, wts = _moe_case(model, 64, seed=3)
    config = tuple(F.FragTile.parse(t) for t in tiles.split(",")) if tiles else None
    full = F.fragment_moe(x, ids, wts, fw, e, config=config)
    for n in (1, 2, 7, 16, 33):
        assert torch.equal(F.fragment_moe(x[:n], ids[:n], wts[:n], fw, e, config=config), full[:n]), n
    phase = torch.randint(0, 3, (e,), device="cuda", dtype=torch.int8)
    assert torch.equal(F.fragment_moe(x, ids, wts, fw, e, phase_of_expert=phase, groups=2, config=config), full)


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model,tiles", [("gpt-oss-20b", "8x2w4a4,4x4w4aa4"), ("gpt-oss-20b", "8x4w4aa3s4,4x4w4a2"),
                                         ("qwen3-30b-a3b", "4x4w4a3,4x4w4aa3"), ("qwen3-30b-a3b", "4x8w4aa2,8x4w4a4s2"),
                                         ("small", "4x2w4aa3,4x2w4a4")])
def test_staged_tiles_give_the_register_paths_bits(model, tiles, monkeypatch):
    """A staged tile (cp.async ring, FragTile.stages) runs the same MMAs in the same order as the same tile loading
    into registers: every output bit equal, in four launches, in copy groups, and in one launch."""
    e, w, fw, x, ids, wts = _moe_case(model, 40, seed=17)
    staged = tuple(F.FragTile.parse(t) for t in tiles.split(","))
    plain = tuple(t._replace(stages=0, xring=0) for t in staged)
    for n in (1, 3, 16, 40):
        assert torch.equal(_four_launches(x[:n], ids[:n], wts[:n], fw, e, config=staged),
                           _four_launches(x[:n], ids[:n], wts[:n], fw, e, config=plain)), n
    phase = torch.randint(0, 3, (e,), device="cuda", dtype=torch.int8)
    assert torch.equal(F.fragment_moe(x, ids, wts, fw, e, phase_of_expert=phase, groups=2, config=staged),
                       _four_launches(x, ids, wts, fw, e, config=plain))
    if all(t.split == 1 for t in staged):
        monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
        k = ids.shape[1]
        for n in (1, 128 // k):
            one = F.fragment_moe_one(x[:n], ids[:n], wts[:n], fw, e, config=staged)
            assert one is not None and torch.equal(one, _four_launches(x[:n], ids[:n], wts[:n], fw, e, config=plain)), n


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b", "small", "nemotron-3-nano"])
def test_unsplit_tiles_give_the_same_bits(model, monkeypatch):
    """Every unsplit tile (rows a program, quads a K step, warps, prefetch, staging) adds a row's K products in one
    order, so every one gives the same output bits: what lets FRAG_BY_SIZE pick tiles by the call's size. Four launches
    and the one launch; and the served choice with the size classes on, across every class boundary (calls of 1 to 7
    tokens, and a call of 40)."""
    e, w, fw, x, ids, wts = _moe_case(model, 40, seed=23)
    k = ids.shape[1]
    # (the stop-36 tiles; the served ones; every size class's; 8 warps; one quad a step)
    tiles = [("4x4w4", "4x4w4"), ("8x2w4p", "4x4w4p"), ("8x2w4aa3", "4x4w4aa3"), ("4x2w4aa4", "4x4w4aa4"),
             ("4x4w4aa3", "8x2w4aa3"), ("8x2w4aa4", "4x4w4aa3"), ("8x4w8", "8x2w8pp"), ("4x2w4a3", "4x1w4aa6")]
    for n in (1, 2, 40):
        outs = [_four_launches(x[:n], ids[:n], wts[:n], fw, e, config=tuple(map(F.FragTile.parse, c))) for c in tiles]
        for c, o in zip(tiles[1:], outs[1:]):
            assert torch.equal(o, outs[0]), (n, c)
        if n * k <= 128:
            saved, F.ONE_LAUNCH_PAIRS = F.ONE_LAUNCH_PAIRS, 128
            try:
                for c in tiles[2:4]:
                    one = F.fragment_moe_one(x[:n], ids[:n], wts[:n], fw, e, config=tuple(map(F.FragTile.parse, c)))
                    assert one is not None and torch.equal(one, outs[0]), (n, c, "one launch")
            finally:
                F.ONE_LAUNCH_PAIRS = saved
    monkeypatch.setattr(F, "SIZE_TILES", True)  # (the size classes on, as they would be served)
    monkeypatch.setattr(F, "FRAG_TILES", None)
    full = F.fragment_moe(x, ids, wts, fw, e)  # 40 tokens: the last class
    for n in range(1, 8):  # every class of gpt-oss (top-4: 16 pairs = 4 tokens) and Qwen3 (top-8: 16, 48 = 2, 6 tokens)
        assert torch.equal(F.fragment_moe(x[:n], ids[:n], wts[:n], fw, e), full[:n]), n


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b", "small", "small-up"])
def test_persistent_programs_give_the_same_bits(model, monkeypatch):
    """PDFLASH_FP4_PERSIST (a fixed grid of programs walking the live tiles) gives every bit of one program a tile:
    routed calls of 1 to 64 tokens (few experts holding many pairs, and many experts), the routing-free small call,
    split-K tiles, copy groups (phases), 1 to 16 programs a multiprocessor of a 4-multiprocessor grid (so every shape's
    calls walk many tiles a program), and a CUDA graph replay; the persistent grid is checked to have been launched."""
    e, w, fw, x, ids, wts = _moe_case(model, 64, seed=31)
    k = ids.shape[1]
    few = ids.clone()
    few[:] = ids[0]  # every token on the first token's k experts: 64 x k pairs on k experts (most block slots unused)
    cases = [(n, i) for n in (1, 3, 16, 64) for i in (ids, few)]
    configs = [None, tuple(map(F.FragTile.parse, ("8x2w4aa3s2", "4x4w4ps2")))]
    phase = torch.randint(0, 3, (e,), device="cuda", dtype=torch.int8)
    monkeypatch.setattr(F, "PERSIST_PER_SM", 0)
    want = {}
    for n, i in cases:
        for c, config in enumerate(configs):
            want[(n, int(i is few), c)] = _four_launches(x[:n], i[:n], wts[:n], fw, e, config=config)
    small = F.fragment_moe(x[:2], ids[:2], wts[:2], fw, e, direct=True)
    grouped = F.fragment_moe(x, few, wts, fw, e, phase_of_expert=phase, groups=2)
    monkeypatch.setattr(F, "PERSIST_PAIRS", 1 << 20)  # (every call of the case, whatever the served bound)
    monkeypatch.setattr(F.runtime, "sm_count", lambda device=None: 4)  # (a small grid: every shape's calls walk, long)
    walks = []
    grid_of = F.persist_grid
    monkeypatch.setattr(F, "persist_grid", lambda programs: walks.append(grid_of(programs)) or walks[-1])
    for per_sm in (1, 4, 16):
        monkeypatch.setattr(F, "PERSIST_PER_SM", per_sm)
        for n, i in cases:
            for c, config in enumerate(configs):
                got = _four_launches(x[:n], i[:n], wts[:n], fw, e, config=config)
                assert torch.equal(got, want[(n, int(i is few), c)]), (per_sm, n, int(i is few), c)
        assert torch.equal(F.fragment_moe(x[:2], ids[:2], wts[:2], fw, e, direct=True), small), per_sm
        assert torch.equal(F.fragment_moe(x, few, wts, fw, e, phase_of_expert=phase, groups=2), grouped), per_sm
    assert sum(w > 0 for w in walks) >= 3 * len(cases), walks  # (the persistent grid was launched, not skipped)
    monkeypatch.setattr(F, "PERSIST_PER_SM", 1)  # (so 64 tokens on k experts walk many tiles a program)
    xs = x.clone()
    _four_launches(xs, few, wts, fw, e)  # (compiled before the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = _four_launches(xs, few, wts, fw, e)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want[(64, 1, 0)])


@cuda
@needs_gluon
@pytest.mark.gpu
def test_grouped_direct_blocks_hold_an_experts_pairs(monkeypatch):
    """DIRECT_GROUP is in effect, not only bit-compatible: with every token on the same k experts, the grouped gate/up
    launch writes h rows only in the blocks its experts' first pairs lead (all their tokens' rows there), and leaves
    the other blocks untouched; one-pair blocks write row 0 of every block."""
    e, w, fw, x, ids, wts = _moe_case("qwen3-30b-a3b", 4, seed=41)
    k, i = ids.shape[1], fw.intermediate
    few = ids.clone()
    few[:] = ids[0]  # 4 tokens x 8 pairs on 8 experts: pair b of token 0 leads expert b's block of 4 rows
    p = few.numel()
    for group in (False, True):
        monkeypatch.setattr(F, "DIRECT_GROUP", group)
        r = F.DirectPairs(few.reshape(-1).contiguous(), None, None, torch.empty(p, dtype=torch.bool, device="cuda"), e, p,
                          group)
        h = torch.full((p * 16, i), float("nan"), dtype=torch.bfloat16, device="cuda")
        t1 = F.frag_config(fw.hidden, i, p)[0]
        F._launch(x, r, fw.w1, fw.s1, h, i, k, 1, t1, 0, fw.b1, fw.act, fw.row_mul, fw.up_off)
        written = ~h.view(p, 16, i).isnan().all(-1)  # [block, row]
        if group:
            assert written[:k, :4].all() and not written[:k, 4:].any() and not written[k:].any()
        else:
            assert written[:, 0].all() and not written[:, 1:].any()
        assert r.pair_valid.all()


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b", "small", "nemotron-3-nano"])
def test_direct_pairs_give_the_routed_bits(model, monkeypatch):
    """A small call without the routing launch (each program grouping the pairs itself) gives the routed call's bits:
    alone and as the served path (DIRECT_PAIRS), 1 to 128 pairs, spread over experts or all on a token's k experts (an
    expert's pairs over one block or several: 17-32 pairs an expert), with a slot table, with padding tokens past n_valid
    and ids out of range dropped (zero rows, as the routed call gives them, also inside a shared expert's group), and
    captured in a CUDA graph."""
    e, w, fw, x, ids, wts = _moe_case(model, 64, seed=29)
    k = ids.shape[1]
    routed = lambda *a, **kw: _four_launches(*a, **kw)  # noqa: E731 (the routing launch, then the GEMMs and combine)
    few = ids.clone()
    few[:] = ids[0]  # every token on the first token's k experts
    half = ids.clone()
    half[1::2] = ids[0]  # every other token on them
    for group in (False, True):  # each pair its own block / each program grouping the pairs by expert
        monkeypatch.setattr(F, "DIRECT_GROUP", group)
        for n in (1, 2, 3, 4, 8, 16, 128 // k):
            for i in (ids, few, half):
                want = routed(x[:n], i[:n], wts[:n], fw, e)
                got = F.fragment_moe(x[:n], i[:n], wts[:n], fw, e, direct=True)
                assert torch.equal(got, want), (group, n, int(i is few))
    monkeypatch.setattr(F, "PERSIST_DIRECT", True)  # the persistent grid walking a routing-free call's blocks
    monkeypatch.setattr(F.runtime, "sm_count", lambda device=None: 4)
    for per_sm in (1, 8):
        monkeypatch.setattr(F, "PERSIST_PER_SM", per_sm)
        for n in (2, 128 // k):
            for i in (ids, few, half):
                want = routed(x[:n], i[:n], wts[:n], fw, e)
                got = F.fragment_moe(x[:n], i[:n], wts[:n], fw, e, direct=True)
                assert torch.equal(got, want), (per_sm, n, int(i is few))
    monkeypatch.undo()
    monkeypatch.setattr(F, "DIRECT_GROUP", True)
    n = 128 // k
    for i in (few, half):
        dropped = i[:n].clone()
        dropped[1, 0] = -1  # a dropped pair inside a shared expert's group (its block's rows move up one)
        dropped[5 % n, 1] = e
        nv5 = torch.tensor([n - 3], dtype=torch.int32, device="cuda")
        want = routed(x[:n], dropped, wts[:n], fw, e, n_valid=nv5)
        assert torch.equal(F.fragment_moe(x[:n], dropped, wts[:n], fw, e, n_valid=nv5, direct=True), want)
    perm = torch.randperm(e, device="cuda").to(torch.int32)  # experts in other slots of a pool
    import dataclasses

    moved = dataclasses.replace(fw, **{nm: torch.empty_like(getattr(fw, nm)) for nm in ("w1", "s1", "w2", "s2")},
                                b1=None if fw.b1 is None else torch.empty_like(fw.b1),
                                b2=None if fw.b2 is None else torch.empty_like(fw.b2))
    for nm in ("w1", "s1", "w2", "s2", "b1", "b2"):
        if getattr(fw, nm) is not None:
            getattr(moved, nm)[perm.long()] = getattr(fw, nm)
    nv = torch.tensor([2], dtype=torch.int32, device="cuda")
    bad = ids[:3].clone()
    bad[0, 0] = e  # out of range: dropped
    for args in ((x[:3], bad, wts[:3]), (x[:3], ids[:3], wts[:3])):
        want = routed(*args, fw, e, n_valid=nv)
        assert torch.equal(F.fragment_moe(*args, fw, e, n_valid=nv, direct=True), want)
        assert torch.equal(F.fragment_moe(*args, moved, e, slot_of_expert=perm, n_valid=nv, direct=True), want)
        assert not want[2:].any()  # the padding token's row
    with pytest.raises(ValueError, match="neither copy groups nor a K split"):
        F.fragment_moe(x[:1], ids[:1], wts[:1], fw, e, config=(F.FragTile(4, 2, 4, split=2), F.FragTile()), direct=True)
    monkeypatch.setattr(F, "DIRECT_PAIRS", 64)
    n = 64 // k
    assert F.direct_refusal(n, k, fw.hidden, fw.intermediate, *F.frag_config(fw.hidden, fw.intermediate, n * k)) is None
    want = routed(x[:n], half[:n], wts[:n], fw, e)
    assert torch.equal(F.fragment_moe(x[:n], half[:n], wts[:n], fw, e), want)
    xs, hs, got = x[:n].clone(), half[:n].clone(), None
    F.fragment_moe(xs, hs, wts[:n], fw, e)  # (compiled before the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = F.fragment_moe(xs, hs, wts[:n], fw, e)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    hs.copy_(ids[:n])  # (other routing, the same graph)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, routed(x[:n], ids[:n], wts[:n], fw, e))


@cuda
@needs_gluon
@pytest.mark.gpu
def test_up_only_first_gemm_stores_relu_up_squared(monkeypatch):
    """Up-only experts (relu(up)^2): the one launch takes them and gives the four launches' bits; the first GEMM's h
    rows are relu(up)^2 of the up rows as moe's Triton kernels round them (bf16 after the projection and the bias)."""
    from pdflash_kernels import moe

    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
    e, w, fw, x, ids, wts = _moe_case("small-up", 16, seed=43)
    assert not fw.gated and fw.b1 is not None
    for tiles in (F.parse_tiles("4x1w4,4x2w4"), F.parse_tiles("4x2w4aa3,4x4w4aa3")):
        one = F.fragment_moe_one(x, ids, wts, fw, e, config=tiles)
        assert one is not None and torch.equal(one, _four_launches(x, ids, wts, fw, e, config=tiles)), tiles
    r = moe.align_fused(ids, e, 16)
    h = torch.zeros((r.max_blocks * 16, fw.intermediate), dtype=torch.bfloat16, device="cuda")
    F._launch(x, r, fw.w1, fw.s1, h, fw.intermediate, ids.shape[1], 1, F.FragTile(4, 1, 4), 0, fw.b1, fw.act)
    up = F.frag_gemm(x, r, fw.w1, fw.s1, ids.shape[1], tile=F.FragTile(4, 1, 4))  # (the same sums, no epilogue)
    u = up.bfloat16().float()
    slots = r.block_slot.repeat_interleave(16)[: up.shape[0]].long().clamp(min=0)
    u = (u + fw.b1[slots].float()).bfloat16().float()
    live = r.sorted_pairs[: up.shape[0]] < r.num_pairs
    live[int(r.num_blocks.item()) * 16:] = False  # (block slots past the routing's count hold no pairs)
    relu = u.clamp(min=0)
    want = (relu * relu).bfloat16()
    assert bool(live.any()) and torch.equal(h[live], want[live])


@cuda
@needs_gluon
@pytest.mark.gpu
def test_staged_tiles_refuse_operands_off_16_bytes():
    e, w, fw, x, ids, wts = _moe_case("small", 4)
    from pdflash_kernels.moe import align_fused

    r = align_fused(ids, e, 16)
    xs = torch.zeros(x.shape[0], x.shape[1] + 4, dtype=x.dtype, device="cuda")[:, 4:]  # rows 8 bytes off 16
    xs.copy_(x)
    out = torch.empty((r.max_blocks * 16, fw.w1.shape[1] * 16), dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="16-byte"):
        F._launch(xs, r, fw.w1, fw.s1, out, fw.w1.shape[1] * 16, ids.shape[1], 0, F.FragTile.parse("4x2w4a3"))
    F._launch(x, r, fw.w1, fw.s1, out, fw.w1.shape[1] * 16, ids.shape[1], 0, F.FragTile.parse("4x2w4a3"))  # aligned: runs


@cuda
@needs_gluon
@pytest.mark.gpu
def test_fragment_moe_reads_slots_past_two_gib_of_a_pool():
    """An expert cache's slot pool: one row per slot, a whole expert slice long, so a bias row lies slot x slice bytes
    in (a 10 GB pool of gpt-oss-20b slices at 100%). Experts in the last slots of a pool whose bias rows are 2 MiB
    apart (offsets past 2**31 elements) give the bits of the same experts at slots 0..E-1."""
    import dataclasses

    e, w, fw, x, ids, wts = _moe_case("small", 9, seed=5)
    slots, row = 2100, 1 << 20  # bias element offsets up to 2100 * 2**20 > 2**31
    first = slots - e
    far = {}
    for name in ("w1", "s1", "w2", "s2"):
        t = getattr(fw, name)
        far[name] = torch.zeros(slots, *t.shape[1:], dtype=t.dtype, device="cuda")
        far[name][first:] = t
    rows = torch.zeros(slots, row, dtype=torch.bfloat16, device="cuda")
    far["b1"], far["b2"] = rows[:, : fw.b1.shape[1]], rows[:, fw.b1.shape[1] : fw.b1.shape[1] + fw.b2.shape[1]]
    far["b1"][first:], far["b2"][first:] = fw.b1, fw.b2
    at = torch.arange(first, slots, dtype=torch.int32, device="cuda")
    out = F.fragment_moe(x, ids, wts, dataclasses.replace(fw, **far), e, slot_of_expert=at)
    assert torch.equal(out, F.fragment_moe(x, ids, wts, fw, e))


def test_frag_tile_names_and_split_plans():
    t = F.FragTile.parse("8x4w4ps4")
    assert t == F.FragTile(8, 4, 4, 1, 4) and str(t) == "8x4w4ps4"
    assert F.FragTile.parse("8x2w4pps2") == F.FragTile(8, 2, 4, 2, 2) and str(F.FragTile(8, 2, 4, 2, 2)) == "8x2w4pps2"
    assert str(F.FragTile.parse("4x8w4")) == "4x8w4" and F.FragTile.parse("4x8w4s2").split == 2
    assert F.FragTile.parse("4x4w4a3") == F.FragTile(4, 4, 4, 0, 1, 3) and str(F.FragTile(4, 4, 4, 0, 2, 4)) == "4x4w4a4s2"
    assert F.FragTile.parse("8x2w4aa3s2") == F.FragTile(8, 2, 4, 0, 2, 3, 1) and str(F.FragTile(8, 2, 4, 0, 2, 3, 1)) == "8x2w4aa3s2"
    for bad in ("8x4", "4x4w4pa3", "4x4w4a1", "4x4w4a", "4x4w4aaa3"):
        with pytest.raises(ValueError, match="NTxKQSwW"):
            F.FragTile.parse(bad)
    # (ranges, whole steps a range): every range non-empty, ranges x steps covers every whole step
    for quads in range(1, 240):
        for kqs in (1, 2, 4, 8):
            for split in (1, 2, 3, 4, 8):
                n, per = F.split_plan(quads, kqs, split)
                steps = quads // kqs
                assert 1 <= n <= max(1, split)
                if n > 1:
                    assert (n - 1) * per < steps <= n * per
    assert F.split_plan(45, 4, 4) == (4, 3)  # gpt-oss: 11 whole steps of 4 quads (+ 1 quad) in 3 + 3 + 3 + 2 (+ 1)


# ---- the whole call in one launch (fragments.fragment_moe_one) ---------------------------------------------------------
ONE_SIG = {"x_ptr": "*bf16", "stride_x": "i32", "pairs_ptr": "*i32", "slot_ptr": "*i32", "nblocks_ptr": "*i32",
           "valid_ptr": "*i1", "rw_ptr": "*bf16", "w1_ptr": "*i32", "stride_w1": "i32", "s1_ptr": "*i32", "stride_s1": "i32",
           "b1_ptr": "*bf16", "stride_b1": "i32", "w2_ptr": "*i32", "stride_w2": "i32", "s2_ptr": "*i32", "stride_s2": "i32",
           "b2_ptr": "*bf16", "stride_b2": "i32", "h_ptr": "*bf16", "stride_h": "i32", "y_ptr": "*fp32", "stride_y": "i32",
           "out_ptr": "*bf16", "stride_out": "i32", "cnt_ptr": "*i32", "T": "i32", "P": "i32", "MB": "i32",
           "alpha": "fp32", "limit": "fp32"}


@needs_gluon
@pytest.mark.parametrize("h,i,k,tiles,act", [(2048, 768, 8, "4x4w4,4x4w4", 0), (2880, 2880, 4, "8x2w4p,4x4w4p", 1),
                                              (320, 192, 2, "4x4w4,4x4w4", 1), (2048, 768, 8, "4x4w4a3,4x4w4aa3", 0),
                                              (2880, 2880, 4, "4x2w4aa4,4x4w4aa3", 1),  # (gpt-oss's served tiles)
                                              (2880, 2880, 4, "8x2w4aa3,4x4w4aa3", 1),  # (its big-call size class)
                                              (2688, 1856, 6, "4x4w4,4x4w4", 2),  # (up-only: Nemotron 3 Nano's)
                                              (2688, 1856, 6, "4x2w4aa3,4x4w4aa3", 2)])
def test_one_launch_kernel_compiles_for_sm90(h, i, k, tiles, act, monkeypatch):
    """The gate/up, down and combine launch compiles for sm_90 with both tiles' MMAs, its ticket / block / combine
    counters as GPU-scope atomics (acquire on the down tiles' wait), nothing spilled to local memory and at most 25%
    more registers than the larger of its two GEMMs alone (a cap on the SMs' occupancy: ptxas -v)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import os
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gptoss = act == 1
    t1, t2 = (F.FragTile.parse(t) for t in tiles.split(","))
    const = dict(H=h, I=i, TOPK=k, ACT=act, HAS_BIAS=gptoss, ROW_MUL=2 if gptoss else 1, UP_OFF=int(gptoss), BM=16,
                 NT1=t1.nt, KQS1=t1.kqs, PF1=t1.prefetch, NT2=t2.nt, KQS2=t2.kqs, PF2=t2.prefetch, W=t1.warps,
                 ST1=t1.stages, ST2=t2.stages, XR1=t1.xring, XR2=t2.xring)
    sig = dict(ONE_SIG, **{c: "constexpr" for c in const})
    kern = triton.compile(GluonASTSource(F._frag_moe_one, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": t1.warps})
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "atom.global.gpu.acq_rel" in ptx and "atom.global.gpu.release" in ptx
    assert "ld.global.gpu.acquire" in ptx or "atom.global.gpu.acquire" in ptx  # the down tiles' wait (an add of 0: a load)
    assert "st.local" not in ptx and "ld.local" not in ptx
    gemms = []
    for t, epi, n, kk, out in ((t1, 1, i, h, "*bf16"), (t2, 2, h, i, "*fp32")):  # each GEMM alone, as four launches run it
        gconst = dict(N=n, K=kk, TOPK=k, EPI=epi, ACT=act, HAS_BIAS=gptoss, ROW_MUL=2 if gptoss else 1,
                      UP_OFF=int(gptoss), PHASE=0, BM=16, NT=t.nt, KQS=t.kqs, W=t.warps, PREFETCH=t.prefetch, SPLIT=1, SS=1,
                      STAGES=t.stages, XRING=t.xring)
        gemms.append(triton.compile(GluonASTSource(F._frag_gemm, dict(SIG, out_ptr=out, **{c: "constexpr" for c in gconst}),
                                                   gconst), target=GPUTarget("cuda", 90, 32), options={"num_warps": t.warps}))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return
    regs = []
    for code in (ptx, *(g.asm["ptx"] for g in gemms)):
        path = f"/tmp/pdflash_one_{os.getpid()}.ptx"
        with open(path, "w") as f:
            f.write(code)
        out = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True).stderr
        regs.append(int(re.search(r"Used (\d+) registers", out)[1]))
    assert regs[0] <= 1.25 * max(regs[1:]), regs  # (the larger GEMM's registers: the one launch runs both roles)


def test_one_launch_takes_small_unsplit_calls(monkeypatch):
    q = (F.FragTile(4, 4, 4), F.FragTile(4, 4, 4))
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
    assert F.one_launch_refusal(16, 8, 2048, 768, *q) is None
    assert "129 pairs" in F.one_launch_refusal(43, 3, 2048, 768, *q)
    assert F.one_launch_refusal(0, 8, 2048, 768, *q) == "no pairs"
    assert "split K" in F.one_launch_refusal(1, 2, 4096, 14336, F.FragTile(4, 4, 4), F.FragTile(4, 4, 4, split=4))
    assert "warp" in F.one_launch_refusal(1, 8, 2048, 768, F.FragTile(4, 4, 4), F.FragTile(8, 4, 8))
    odd = (F.FragTile(1, 4, 1), F.FragTile(4, 4, 1))  # (one weight tile a gate/up program: up-only experts only)
    assert "odd" in F.one_launch_refusal(3, 6, 2688, 1856, *odd)
    assert F.one_launch_refusal(3, 6, 2688, 1856, *odd, gated=False) is None
    monkeypatch.setattr(F, "DIRECT_PAIRS", 16)  # (18 pairs: routed on every device, whatever DIRECT_SHAPES says)
    assert F.call_path(3, 6, 2688, 1856, *odd, gated=False) == "one" and F.call_path(3, 6, 2688, 1856, *odd) == "routed"
    monkeypatch.setattr(F, "DIRECT_PAIRS", None)
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 0)
    assert "PDFLASH_FP4_ONE_LAUNCH_PAIRS" in F.one_launch_refusal(1, 8, 2048, 768, *q)
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", None)  # unset: by device and shape, where it was measured faster
    monkeypatch.setattr(F, "device_name", lambda: "NVIDIA H200")
    gptoss = F.frag_config(2880, 2880)
    assert F.one_launch_refusal(32, 4, 2880, 2880, *gptoss) is None and "129 pairs" in F.one_launch_refusal(43, 3, 2880, 2880, *gptoss)
    assert F.one_launch_refusal(2, 4, 2880, 2880, *gptoss) is None  # 8 pairs
    assert "at least 8" in F.one_launch_refusal(1, 4, 2880, 2880, *gptoss)  # one token's top-4: four launches ran faster
    assert "at most 0" in F.one_launch_refusal(1, 8, 2048, 768, *F.frag_config(2048, 768))
    monkeypatch.setattr(F, "device_name", lambda: "NVIDIA H100 80GB HBM3")  # (stop 56: measured faster there from 32 pairs)
    assert F.one_launch_refusal(8, 4, 2880, 2880, *gptoss) is None and "at least 17" in F.one_launch_refusal(4, 4, 2880, 2880, *gptoss)
    assert "at most 0" in F.one_launch_refusal(8, 8, 2048, 768, *F.frag_config(2048, 768))  # (Qwen3: none)
    assert F.one_launch_range(2880, 2880, "") == (1, 0)  # (an unknown device: none)
    assert F.one_launch_range(2880, 2880, "NVIDIA H200") == (8, 128)
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)  # set: 1 to 128 pairs on every shape and device
    assert F.one_launch_refusal(1, 4, 2880, 2880, *gptoss) is None and F.one_launch_range(2048, 768) == (1, 128)


def test_one_launch_pairs_setting_is_checked():
    import os
    import subprocess
    import sys

    for bad in ("129", "-1", "many"):
        r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.fragments"], capture_output=True, text=True,
                           env={**os.environ, "PDFLASH_FP4_ONE_LAUNCH_PAIRS": bad})
        assert r.returncode != 0 and "PDFLASH_FP4_ONE_LAUNCH_PAIRS" in r.stderr, bad
    r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.fragments as F; print(F.one_launch_pairs(2048, 768))"],
                       capture_output=True, text=True, env={**os.environ, "PDFLASH_FP4_ONE_LAUNCH_PAIRS": "64"})
    assert r.stdout.strip() == "64", r.stderr
    r = subprocess.run([sys.executable, "-c",
                        "import pdflash_kernels.fragments as F; print(F.one_launch_pairs(2880, 2880, 'NVIDIA H200'))"],
                       capture_output=True, text=True, env={**os.environ, "PDFLASH_FP4_ONE_LAUNCH_PAIRS": ""})
    assert r.stdout.strip() == "128", r.stderr  # empty (compose.gpu.yaml's default) = unset: by device and shape


def test_tiles_setting_is_checked():
    """PDFLASH_FP4_TILES="GATE_UP,DOWN": those tiles on every shape; a malformed value stops the import with the rule."""
    import os
    import subprocess
    import sys

    for bad, says in (("4x4w4", "two tile names"), ("3x4w4,4x4w4", "gate/up tile 3x4w4"), ("4x4w4,4x3w4", "down tile"),
                      ("4x4w4,fast", "NTxKQSwW")):
        r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.fragments"], capture_output=True, text=True,
                           env={**os.environ, "PDFLASH_FP4_TILES": bad})
        assert r.returncode != 0 and says in r.stderr, (bad, r.stderr[-300:])
    code = "import pdflash_kernels.fragments as F; print(*map(str, F.frag_config(2880, 2880) + F.frag_config(64, 128)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PDFLASH_FP4_TILES": "4x4w4aa3,8x2w4a4s2"})
    assert r.stdout.split() == ["4x4w4aa3", "8x2w4a4s2"] * 2, r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PDFLASH_FP4_TILES": ""})
    table = (F.size_classes(2880, 2880)[-1][1:] if F.SIZE_TILES else F.FRAG_SHAPES[(2880, 2880)]) + F.FRAG_DEFAULT
    assert r.stdout.split() == [str(t) for t in table], r.stderr  # empty: the tables' (a big call: the last size class)


def _four_launches(*args, **kw):
    """fragment_moe routed and in four launches (routing, gate/up, down, combine): neither the one launch nor the
    routing-free small call."""
    saved, F.ONE_LAUNCH_PAIRS = F.ONE_LAUNCH_PAIRS, 0
    try:
        return F.fragment_moe(*args, direct=False, **kw)
    finally:
        F.ONE_LAUNCH_PAIRS = saved


@cuda
@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b", "small", "nemotron-3-nano", "small-up"])
def test_one_launch_is_bit_identical_to_the_four_launches(model, monkeypatch):
    """Every output bit of the one-launch call equals the four launches' (routing, gate/up, down, combine): 1 to 128
    pairs, tokens sharing experts (a block full, an expert over several blocks), dropped ids, padding rows (n_valid),
    experts at other slots, and again and again (its counters are back at zero after each call)."""
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)  # every shape (by default only those measured faster)
    e, w, fw, x, ids, wts = _moe_case(model, 64, seed=11)
    k = ids.shape[1]
    for n in sorted({1, 2, 3, 5, 128 // k // 2, 128 // k}):
        one = F.fragment_moe_one(x[:n], ids[:n], wts[:n], fw, e)
        assert one is not None
        assert torch.equal(one, _four_launches(x[:n], ids[:n], wts[:n], fw, e)), n
    n = 128 // k
    crowd = ids[:1].expand(n, k).contiguous()  # every token to the same k experts: n pairs an expert, ceil(n / 16) blocks
    assert torch.equal(F.fragment_moe_one(x[:n], crowd, wts[:n], fw, e), _four_launches(x[:n], crowd, wts[:n], fw, e))
    dropped = ids[:9].clone()
    dropped[2, 0] = -1
    dropped[4, :] = e  # a token with no kept pair: zeros
    nv = torch.tensor([7], dtype=torch.int32, device="cuda")  # rows 7, 8: padding
    one = F.fragment_moe_one(x[:9], dropped, wts[:9], fw, e, n_valid=nv)
    assert torch.equal(one, _four_launches(x[:9], dropped, wts[:9], fw, e, n_valid=nv))
    assert not one[4].any() and not one[7:].any()
    perm = torch.randperm(e, device="cuda")
    moved = {name: torch.empty_like(getattr(fw, name)) for name in ("w1", "s1", "w2", "s2", "b1", "b2")
             if getattr(fw, name) is not None}
    for name, t in moved.items():
        t[perm] = getattr(fw, name)
    import dataclasses

    fw2 = dataclasses.replace(fw, **moved)
    at = perm.to(torch.int32)
    again = [F.fragment_moe_one(x[:5], ids[:5], wts[:5], fw2, e, slot_of_expert=at) for _ in range(3)]
    first = _four_launches(x[:5], ids[:5], wts[:5], fw, e)
    assert all(torch.equal(a, first) for a in again)


@cuda
@needs_gluon
@pytest.mark.gpu
def test_one_launch_replays_in_a_cuda_graph(monkeypatch):
    """Captured once (as the verifier captures its forward) and replayed on new tokens: the eager call's bits (and
    the four launches'). On every card: by default one launch serves only where ONE_LAUNCH_SHAPES names the card
    (the H200; stop 49's H100 run refused it here)."""
    monkeypatch.setattr(F, "ONE_LAUNCH_PAIRS", 128)
    e, w, fw, x, ids, wts = _moe_case("gpt-oss-20b", 32, seed=13)
    assert F.one_launch_refusal(4, 4, 2880, 2880, *F.frag_config(2880, 2880)) is None  # (taken)
    xs, is_, ws = x[:4].clone(), ids[:4].clone(), wts[:4].clone()
    F.fragment_moe(xs, is_, ws, fw, e)  # warm: compiled, counters made
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = F.fragment_moe(xs, is_, ws, fw, e)
    for s0 in (4, 12, 20):
        xs.copy_(x[s0:s0 + 4]), is_.copy_(ids[s0:s0 + 4]), ws.copy_(wts[s0:s0 + 4])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, F.fragment_moe_one(x[s0:s0 + 4], ids[s0:s0 + 4], wts[s0:s0 + 4], fw, e)), s0
        assert torch.equal(out, _four_launches(x[s0:s0 + 4], ids[s0:s0 + 4], wts[s0:s0 + 4], fw, e)), s0


def test_breakdown_probe_takes_whole_token_cases_only():
    """benchmarks/moe_call_breakdown.py's cases (model:active experts:tokens per expert) are checked before any GPU work:
    a known model, from top-k to all experts, whole tokens."""
    from benchmarks.moe_call_breakdown import CASES, parse_cases

    assert ("gpt-oss-20b", 4, 1) in parse_cases(CASES) and ("qwen3-30b-a3b", 8, 16) in parse_cases(CASES)
    for bad, says in (("gpt-oss-20b:2:1", "from top-k 4"), ("llama:8:1", "model one of"), ("qwen3-30b-a3b:8", "model:active"),
                      ("qwen3-30b-a3b:9:1", "multiple of 8"), ("mixtral-8x7b:16:1", "to 8")):
        with pytest.raises(ValueError, match=says):
            parse_cases(bad)


def test_persist_ab_table_names_every_setting_and_the_best():
    """benchmarks/persist_ab.py's table: a column per setting (pN, dN; "-" where a setting did not run at that size), the
    best and its share of the copy rate; stop 50's file (keys without the p) still reads."""
    from benchmarks.persist_ab import table

    row = dict(model="qwen3-30b-a3b", active_experts=8, tokens_per_expert=16, pairs=128, us={"p0": 43.3, "p8": 32.5},
               hbm_fraction={"p0": 0.154, "p8": 0.205}, best="p8", bit_identical=True)
    small = dict(row, tokens_per_expert=1, pairs=8, us={"p0": 16.3, "p8": 16.6, "d32": 16.0},
                 hbm_fraction={"p0": 0.41, "p8": 0.40, "d32": 0.42}, best="d32")
    res = dict(device="NVIDIA H100 80GB HBM3", copy_rate_bytes_per_s=3.0e12, per_sm=[0, 8], settings=["p0", "p8", "d32"],
               rows=[row, small])
    lines = table(res)
    assert "| experts | p0 us | p8 us | d32 us | best | best % | p0 % | same bits |" in lines[4]
    assert lines[6] == "| qwen3-30b-a3b | 8 | 16 | 128 | 8 | 43.3 | 32.5 | - | p8 | 20% | 15% | True |"
    assert lines[7] == "| qwen3-30b-a3b | 8 | 1 | 8 | 8 | 16.3 | 16.6 | 16.0 | d32 | 42% | 41% | True |"
    rand = dict(small, active_experts="rand", tokens_per_expert=4, pairs=32, experts=29)  # (a verify-shaped row)
    assert table(dict(res, rows=[rand]))[-1] == "| qwen3-30b-a3b | rand | 4 | 32 | 29 | 16.3 | 16.6 | 16.0 | d32 | 42% | 41% | True |"
    old = dict(device="d", copy_rate_bytes_per_s=3.0e12, per_sm=[0, 8],
               rows=[dict(row, us={"0": 43.3, "8": 32.5}, hbm_fraction={"0": 0.154, "8": 0.205}, best=8)])
    assert table(old)[-1] == "| qwen3-30b-a3b | 8 | 16 | 128 | 8 | 43.3 | 32.5 | p8 | 20% | 15% | True |"


def test_grouped_routing_views_the_gate_up_launchs_table():
    """A grouped routing-free gate/up launch's table [P * 16 rows | P block slots | the block count] read as the
    routing the down launch runs on: P blocks of 16 rows, the keep flags the gate/up launch wrote."""
    p = 5
    tab = torch.arange(p * 17 + 1, dtype=torch.int32)
    r = F.DirectPairs(torch.zeros(p, dtype=torch.long), None, None, torch.ones(p, dtype=torch.bool), 8, p)
    g = F.grouped_routing(tab, r)
    assert g.max_blocks == g.num_pairs == p and g.sorted_pairs.numel() == 16 * p and g.pair_valid is r.pair_valid
    assert g.block_slot.tolist() == list(range(16 * p, 17 * p)) and g.num_blocks.tolist() == [17 * p]
    assert g.sorted_pairs.data_ptr() == tab.data_ptr()  # (views: the down launch reads what the gate/up launch wrote)


def test_persist_ab_rows_run_the_settings_that_apply_to_them():
    """persist_ab.py: every row runs each pN; dN only up to max(direct) pairs; o0 (the served call without the one
    launch) only where the served call takes the one launch."""
    from benchmarks.persist_ab import row_settings

    s = {"p0": {}, "p8": {}, "d16": {}, "d32": {}, "o0": {}, "u16": {}}  # (u16: the pre-stop-54 served form, every row)
    assert list(row_settings(s, 32, (16, 32), True)) == ["p0", "p8", "d16", "d32", "o0", "u16"]
    assert list(row_settings(s, 128, (16, 32), True)) == ["p0", "p8", "o0", "u16"]
    assert list(row_settings(s, 8, (16, 32), False)) == ["p0", "p8", "d16", "d32", "u16"]
    assert list(row_settings({"p0": {}, "o0": {}}, 8, (), False)) == ["p0"]
    one = {"p8": {}, "o1": {}}  # (--one-launch: the one launch forced on 17-128 pairs)
    assert list(row_settings(one, 32, (), False)) == ["p8", "o1"] == list(row_settings(one, 128, (), True))
    assert list(row_settings(one, 16, (), False)) == ["p8"] == list(row_settings(one, 129, (), False))


def test_bench_routed_cases_route_like_a_verify_forward():
    """fragment_bench.py --routed N: calls of N tokens, each routed to top-k distinct experts at random; the rows'
    active experts are the distinct ids, tokens per expert their mean (the size classes' A/B runs on these)."""
    import argparse

    from benchmarks.fragment_bench import _inputs

    args = argparse.Namespace(routed="1,2,16", tokens="1", active="8")
    cases = list(_inputs(128, 8, 64, args, device="cpu"))
    assert [c[2].shape[0] for c in cases] == [1, 2, 16]
    for active, tpe, x, ids, w in cases:
        assert ids.shape == (x.shape[0], 8) and all(len(set(r.tolist())) == 8 for r in ids)
        assert active == ids.unique().numel() and tpe == round(ids.numel() / active, 2)
        assert w.shape == ids.shape and torch.allclose(w.float().sum(-1), torch.ones(x.shape[0]), atol=1e-2)
    assert cases[0][0] == 8 and 8 < cases[2][0] <= 128


def test_the_probes_source_edits_still_apply():
    """benchmarks/one_launch_probe.py and frag_gemm_probe.py time variants of fragments.py made by replacing pieces of
    its source: every piece they replace is still there (else a probe fails only on the GPU machine)."""
    from benchmarks import frag_gemm_probe, one_launch_probe

    for variants in (one_launch_probe.VARIANTS, frag_gemm_probe.VARIANTS):
        for name, edits in variants.items():
            for a, _ in edits:
                assert a in one_launch_probe.SRC, (name, a[:80])


def test_launch_fit_recovers_a_launchs_fixed_cost_and_rate():
    """benchmarks/launch_fit.py: a sweep whose best times are exactly 5 us + MB / 3 TB/s gives back 5 us and 3 TB/s,
    and a call's allowed fixed cost is the goal's time less the streaming time."""
    from benchmarks import launch_fit as L

    assert L.fit_line([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        L.fit_line([(1.0, 3.0), (1.0, 4.0)])
    per = L.launch_bytes("qwen3-30b-a3b")
    rows = [dict(model="qwen3-30b-a3b", active_experts=a, tokens_per_expert=1,
                 gate_up={"t": 5.0 + a * per["gate_up"] / 3e6, "u": 99.0}, down={"t": 4.0 + a * per["down"] / 3e6})
            for a in (8, 32, 128)]
    rate = 4e12
    fits = L.fits({"rows": rows}, rate)
    gu = next(f for f in fits if f["launch"] == "gate_up")
    assert gu["fixed_us"] == pytest.approx(5.0) and gu["rate_tb_s"] == pytest.approx(3.0) and gu["rate_fraction"] == 0.75
    wb = 32 * (per["gate_up"] + per["down"])
    align = [{"model": "qwen3-30b-a3b", "pairs": p, "us": u} for p, u in ((8, 3.0), (128, 7.0))]
    kern = {"copy_rate_bytes_per_s": rate, "align": align,
            "moe": [dict(model="qwen3-30b-a3b", weights="mxfp4", active_experts=32, tokens_per_expert=1, us=50.0,
                         weight_bytes=wb),  # 32 pairs: routed, the routing measured at 8 (none at 32)
                    dict(model="qwen3-30b-a3b", weights="mxfp4", active_experts=8, tokens_per_expert=1, us=20.0,
                         weight_bytes=wb // 4)]}  # 8 pairs: no routing launch (DIRECT_PAIRS)
    f, g = L.floors(fits, kern)
    assert not f["direct"] and f["routing_us"] == 3.0 and f["fixed_us"] == pytest.approx(12.0)
    assert g["direct"] and g["routing_us"] == 0.0 and g["fixed_us"] == pytest.approx(9.0)
    assert f["goal_us"] == pytest.approx(wb / (0.6 * rate) * 1e6, abs=0.05)
    assert f["stream_us"] == pytest.approx(wb / 3e12 * 1e6, abs=0.05)
    assert f["fixed_allowed_us"] == pytest.approx(f["goal_us"] - f["stream_us"], abs=0.11)


def test_fused_sweep_winners_leave_out_rejected_tiles():
    """fragment_bench.py --fused-sweep: a tile rejected in a later case (wrong or failed) has a smaller, partial sum; it
    must not win, and a sweep whose every tile was rejected has no winner."""
    from benchmarks.fragment_bench import sweep_winners

    sums = {1: {"4x4w4": 30.0, "2x4w2aa6": 12.0}, 2: {"4x4w4": 20.0, "2x4w2aa6": 9.0}}
    assert sweep_winners(sums, {}) == ("2x4w2aa6", "2x4w2aa6")
    assert sweep_winners(sums, {"2x4w2aa6": "qwen3 A=32 T=1: 0.5 off the reference"}) == ("4x4w4", "4x4w4")
    assert sweep_winners(sums, {"4x4w4": "x", "2x4w2aa6": "y"}) is None
