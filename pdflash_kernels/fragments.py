"""MXFP4 weights as tensor-core fragment words, and a grouped GEMM that decodes them straight into the MMA's registers.

Why: pdflash_kernels.moe's FP4 GEMMs decode weight tiles in K order and hand them to `tl.dot`, which moves them into the
MMA operand layout itself (registers -> shared memory -> registers, plus fragment packing): 0.18-0.31 warp instructions
per weight value in their K loops (benchmarks/kernels_sass.py), against ~0.22 for 60% of the H200's copy rate with
perfect overlap. Here the weights are stored so that the 32-bit word a thread loads already holds the 8 values of its
A fragment of one m16n8k16 MMA (`mma.sync`, bf16), and the kernel (Gluon: layouts are explicit) decodes a word into
the four bf16x2 operand registers with no data movement between threads (`convert_layout(..., assert_trivial=True)`
checks it when the kernel compiles).

Fragment words (`to_fragment_words`), for a weight matrix [N, K] (N rows of output features, K a multiple of 64, N a
multiple of 16): a 16 x 16 tile (rows r0 + 0..15, columns k0 + 0..15) is held by the 32 lanes of a warp, lane
4g + t holding rows r0 + g and r0 + g + 8 at columns k0 + 2t, 2t + 1, 2t + 8, 2t + 9 (PTX's A-fragment layout of
m16n8k16: registers a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)). Those 8
values are one word, in the pair-word bit order of pdflash_kernels/mxfp4.py (pairs a0, a1, a2, a3; the lower column in
the low half), so the decode is moe's decode 5: 9 integer instructions and 4 bf16x2 multiplies a word. Words are
stored [N / 16, K / 64, 8 (g), 4 (t), 4 (kr)]: the four 16-column tiles kr of a 64-column quad are a lane's 16
contiguous bytes (one 128-bit load), and the 32 lanes of one quad are 512 contiguous bytes. Scale words: [N / 16,
K / 64, 8 (g)] int32, bytes (row g, columns 0-31 of the quad), (g, 32-63), (g + 8, 0-31), (g + 8, 32-63). The same
bytes as the blocks and scales (a permutation): slice sizes and the byte map are unchanged.

The GEMM (`frag_gemm`): y[block row] = x[row] @ w[slot]^T over routing blocks (pdflash_kernels.moe.Routing), the
weights as the MMA's M side (16 output features a tile) and the block's BM rows as its N side (two n8 tiles). Batch
invariant: each row's sums run over K in one fixed order whatever the other rows (no split of K, no atomics). Scale
bytes above 128 are not supported (the fast decode's bound, as `pdflash_kernels.moe.FAST_DECODE_MAX_SCALE`): `frag_gemm`
refuses them.
Without a GPU: `to_fragment_words` / `from_fragment_words` and `frag_gemm_reference` (torch) run anywhere; the kernel
compiles for sm_90 on a CPU machine (tests/test_kernels.py) but runs only on CUDA.
"""

from __future__ import annotations

import torch

from pdflash_kernels import mxfp4
from pdflash_kernels.moe import FAST_DECODE_MAX_SCALE, Routing, triton_cdiv

try:  # Gluon (Triton >= 3.5): explicit layouts. Optional like Triton itself.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except Exception:  # pragma: no cover - depends on the install
    gluon = gl = mma_v2 = None

QUAD = 64  # K values of one fragment quad (four 16-column tiles)
WORDS_PER_QUAD = 128  # words of one 16-row x 64-column quad (32 lanes x 4 tiles)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 (lower index in the low nibble) -> [..., K] E2M1 codes 0..15."""
    return torch.stack((blocks & 0xF, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], -1)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    n, k = blocks.shape[-2], 2 * blocks.shape[-1]
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"fragment words take uint8 blocks and scales, got {blocks.dtype}, {scales.dtype}")
    if n % 16 or k % QUAD:
        raise ValueError(f"fragment words need N a multiple of 16 and K of {QUAD}: got N {n}, K {k}")
    if tuple(scales.shape) != (*blocks.shape[:-1], k // mxfp4.GROUP):
        raise ValueError(f"scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}")
    return n, k


def to_fragment_words(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 rows (blocks [..., N, K/2] in pdflash_kernels.mxfp4's nibble order, scales [..., N, K/32]) -> (words int32
    [..., N/16, K/64, 8, 4, 4], scale words int32 [..., N/16, K/64, 8]): the layout in this module's docstring."""
    n, k = _check(blocks, scales)
    lead = blocks.shape[:-2]
    nt, kq = n // 16, k // QUAD
    c = _codes(blocks).reshape(*lead, nt, 2, 8, kq, 4, 2, 4, 2)  # nt h g kq kr j t e  (row nt*16+h*8+g, col kq*64+kr*16+j*8+t*2+e)
    d = len(lead)
    perm = list(range(d)) + [d + i for i in (0, 3, 2, 6, 4, 5, 1, 7)]  # nt kq g t kr j h e: nibble v = 4j + 2h + e
    c = c.permute(perm).reshape(*lead, nt, kq, 8, 4, 4, 4, 2)  # [... , pair (2j + h), e]
    nib = c.reshape(*lead, nt, kq, 8, 4, 4, 8).to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=blocks.device)
    word = (nib << shifts).sum(-1)  # natural nibble order: value v in bits 4v..4v+3
    raw = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)  # little-endian bytes
    words = mxfp4.to_pair_words(raw.reshape(*raw.shape[:-2], -1)).contiguous().view(torch.int32)
    s = scales.reshape(*lead, nt, 2, 8, kq, 2)  # nt h g kq grp
    s = s.permute(list(range(d)) + [d + i for i in (0, 3, 2, 1, 4)]).contiguous()  # nt kq g h grp: byte 2h + grp
    swords = s.reshape(*lead, nt, kq, 8, 4).view(torch.int32).reshape(*lead, nt, kq, 8)
    return words.reshape(*lead, nt, kq, 8, 4, 4), swords


def from_fragment_words(words: torch.Tensor, swords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_fragment_words`: (blocks [..., N, K/2], scales [..., N, K/32])."""
    lead = words.shape[:-5]
    nt, kq = words.shape[-5], words.shape[-4]
    d = len(lead)
    raw = mxfp4.from_pair_words(words.contiguous().view(torch.uint8).reshape(*words.shape, 4).reshape(*lead, -1))
    word = raw.reshape(*words.shape, 4).to(torch.int64)
    word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | (word[..., 3] << 24)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    nib = ((word.unsqueeze(-1) >> shifts) & 0xF).reshape(*lead, nt, kq, 8, 4, 4, 2, 2, 2)  # nt kq g t kr j h e
    inv = list(range(d)) + [d + i for i in (0, 6, 2, 1, 4, 5, 3, 7)]  # -> nt h g kq kr j t e
    codes = nib.permute(inv).reshape(*lead, nt * 16, kq * QUAD).to(torch.uint8)
    pairs = codes.reshape(*lead, nt * 16, kq * QUAD // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    s = swords.contiguous().view(torch.uint8).reshape(*lead, nt, kq, 8, 2, 2)  # nt kq g h grp
    scales = s.permute(list(range(d)) + [d + i for i in (0, 3, 2, 1, 4)]).reshape(*lead, nt * 16, kq * 2).contiguous()
    return blocks, scales


def frag_gemm_reference(x: torch.Tensor, r: Routing, blocks: torch.Tensor, scales: torch.Tensor, topk: int,
                        rows_from_pairs: bool = True) -> torch.Tensor:
    """What `frag_gemm` computes, in torch (float32 sums of the exactly decoded weights): y [max_blocks * BM, N] float32,
    row b * BM + m = x[row] @ w[slot of block b]^T for each real pair of the block (row = pair // topk where
    `rows_from_pairs`, else the block row itself), zero elsewhere."""
    bm = r.sorted_pairs.numel() // r.max_blocks
    n = blocks.shape[-2]
    y = torch.zeros((r.max_blocks * bm, n), dtype=torch.float32, device=x.device)
    for b in range(int(r.num_blocks.item())):
        slot = int(r.block_slot[b])
        pairs = r.sorted_pairs[b * bm : (b + 1) * bm].long()
        ok = pairs < r.num_pairs
        if slot < 0 or not bool(ok.any()):
            continue
        w = mxfp4.dequantize(blocks[slot], scales[slot], torch.float32)
        idx = pairs[ok] // topk if rows_from_pairs else (b * bm + torch.nonzero(ok).flatten())
        out = x[idx].float() @ w.T
        y[b * bm + torch.nonzero(ok).flatten()] = out
    return y


if gluon is not None:

    @gluon.jit
    def _decode_quads(q, sw, kk, AL: gl.constexpr, BN: gl.constexpr, KQS: gl.constexpr, NT: gl.constexpr):
        """Words [NT, KQS * 128] (and their scale words) -> the A operand [BN, KQS * 64] in the MMA's layout."""
        sh = ((kk % 4) // 2) * 8  # the quad's first or second 32 columns
        s0 = (sw >> sh[None, :]) & 0xFF  # row g's scale byte
        s1 = (sw >> (sh[None, :] + 16)) & 0xFF  # row g + 8's
        c0 = ((s0 + 126) << 7) | ((s0 + 126) << 23)  # bf16x2 2^(s - 1) in both halves
        c1 = ((s1 + 126) << 7) | ((s1 + 126) << 23)
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            """{
            .reg .b32 r, t, u, z;
            mov.b32 z, 0x80008000;
            and.b32 r, $8, 0x81C081C0; fma.rn.bf16x2 r, r, $9, z; mov.b32 {$0, $1}, r;
            shf.l.wrap.b32 t, $8, $8, 4; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, $10, z; mov.b32 {$2, $3}, r;
            shf.l.wrap.b32 t, $8, $8, 10; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, $9, z; mov.b32 {$4, $5}, r;
            shf.l.wrap.b32 t, $8, $8, 6; and.b32 r, t, 0x80C080C0; shf.l.wrap.b32 u, $8, $8, 14; and.b32 u, u, 0x01000100;
            or.b32 r, r, u; fma.rn.bf16x2 r, r, $10, z; mov.b32 {$6, $7}, r;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [q, c0, c1], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # pairs: a0 = (row g, cols 2t..) v0 v1; a1 = (g + 8) v2 v3; a2 = (g, 2t + 8..) v4 v5; a3 = (g + 8, 2t + 8..) v6 v7
        h0 = gl.join(gl.join(v0, v1), gl.join(v4, v5))  # [..., e, j]
        h1 = gl.join(gl.join(v2, v3), gl.join(v6, v7))
        a = gl.join(h0, h1)  # [NT, KQS * 128, e, j, h]
        a = gl.reshape(a, [NT, KQS, 8, 4, 4, 2, 2, 2])  # nt kq g t kr e j h
        a = gl.permute(a, [0, 7, 2, 1, 4, 6, 3, 5])  # nt h g kq kr j t e: row nt*16 + h*8 + g, col kq*64 + kr*16 + j*8 + 2t + e
        a = gl.reshape(a, [BN, KQS * 64])
        return gl.convert_layout(a, AL, assert_trivial=True)

    @gluon.jit
    def _frag_load(w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, q0):
        """The words, scale words and activations of the KQS quads from quad q0."""
        q = gl.load(w_rows[:, None] + (q0 * 128 + kk)[None, :], mask=n_ok[:, None], other=0)
        sw = gl.load(s_rows[:, None] + (q0 * 8 + (kk // 128) * 8 + (kk % 128) // 16)[None, :], mask=n_ok[:, None], other=0)
        b = gl.load(x_rows[None, :] + (q0 * 64 + kb)[:, None], mask=x_ok[None, :], other=0.0)
        return q, sw, b

    @gluon.jit
    def _frag_step(acc, w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, q0, AL: gl.constexpr, BN: gl.constexpr,
                   NT: gl.constexpr, KQS: gl.constexpr):
        """One step of KQS quads starting at quad q0: load, decode, multiply-add into acc."""
        q, sw, b = _frag_load(w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, q0)
        return mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), b, acc)

    @gluon.jit
    def _x_tile(x_rows, x_ok, kx, q0):
        """Activations [BM, KQS * 64] of the quads from q0, in a coalesced layout (16-byte loads along K)."""
        return gl.load(x_rows[:, None] + (q0 * 64 + kx)[None, :], mask=x_ok[:, None], other=0.0)

    @gluon.jit
    def _b_operand(xs, xt, BL: gl.constexpr):
        """The B operand from a coalesced activation tile through shared memory (one copy for all warps, read back with
        ldmatrix): the barriers keep the previous step's reads before this store and this store before the reads."""
        gl.thread_barrier()
        xs.store(xt)
        gl.thread_barrier()
        return xs.permute([1, 0]).load(BL)

    @gluon.jit
    def _frag_step_smem(acc, w_rows, s_rows, n_ok, kk, xr_s, xok_s, kx, xs, q0, AL: gl.constexpr, BL: gl.constexpr,
                        BN: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr):
        q = gl.load(w_rows[:, None] + (q0 * 128 + kk)[None, :], mask=n_ok[:, None], other=0)
        sw = gl.load(s_rows[:, None] + (q0 * 8 + (kk // 128) * 8 + (kk % 128) // 16)[None, :], mask=n_ok[:, None], other=0)
        xt = _x_tile(xr_s, xok_s, kx, q0)
        return mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)

    @gluon.jit
    def _frag_gemm(x_ptr, stride_x, y_ptr, stride_y, pairs_ptr, slot_ptr, nblocks_ptr, w_ptr, stride_ws, s_ptr, stride_ss,
                   P, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr, ROWS_FROM_PAIRS: gl.constexpr,
                   BM: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr, W: gl.constexpr,
                   PREFETCH: gl.constexpr, B_SMEM: gl.constexpr):
        BN: gl.constexpr = NT * 16
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        QUADS: gl.constexpr = K // 64
        b = gl.program_id(0)
        if b >= gl.load(nblocks_ptr):
            return
        slot = gl.load(slot_ptr + b)
        if slot < 0:
            return
        # rows of this routing block (the MMA's N side)
        mb = gl.arange(0, BM, layout=gl.SliceLayout(0, BL))
        pair = gl.load(pairs_ptr + b * BM + mb)
        x_ok = pair < P
        if ROWS_FROM_PAIRS:
            xr = gl.where(x_ok, pair // TOPK, 0)
        else:
            xr = b * BM + mb
        x_rows = x_ptr + xr.to(gl.int64) * stride_x
        kb = gl.arange(0, KQS * 64, layout=gl.SliceLayout(1, BL))
        # weight tiles of this program (the MMA's M side): NT 16-row tiles
        tiles = gl.program_id(1) * NT + gl.arange(0, NT, layout=gl.SliceLayout(1, WL))
        n_ok = tiles < N // 16
        tiles = gl.where(n_ok, tiles, 0)
        w_rows = w_ptr + slot.to(gl.int64) * stride_ws + tiles.to(gl.int64) * (QUADS * 128)
        s_rows = s_ptr + slot.to(gl.int64) * stride_ss + tiles.to(gl.int64) * (QUADS * 8)
        kk = gl.arange(0, KQS * 128, layout=gl.SliceLayout(0, WL))
        kk1 = gl.arange(0, 128, layout=gl.SliceLayout(0, WL))
        kb1 = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        MAIN: gl.constexpr = QUADS // KQS * KQS
        if B_SMEM:  # activations loaded once for all warps: coalesced, through shared memory
            XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
            SL: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
            mx = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
            pair_s = gl.load(pairs_ptr + b * BM + mx)
            xok_s = pair_s < P
            if ROWS_FROM_PAIRS:
                xr_s = gl.where(xok_s, pair_s // TOPK, 0)
            else:
                xr_s = b * BM + mx
            xr_s = x_ptr + xr_s.to(gl.int64) * stride_x
            kx = gl.arange(0, KQS * 64, layout=gl.SliceLayout(0, XL))
            xs = gl.allocate_shared_memory(gl.bfloat16, [BM, KQS * 64], SL)
            if PREFETCH and MAIN >= 2 * KQS:
                q = gl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None], other=0)
                sw = gl.load(s_rows[:, None] + ((kk // 128) * 8 + (kk % 128) // 16)[None, :], mask=n_ok[:, None], other=0)
                xt = _x_tile(xr_s, xok_s, kx, 0)
                for q0 in range(KQS, MAIN, KQS):
                    qn = gl.load(w_rows[:, None] + (q0 * 128 + kk)[None, :], mask=n_ok[:, None], other=0)
                    swn = gl.load(s_rows[:, None] + (q0 * 8 + (kk // 128) * 8 + (kk % 128) // 16)[None, :],
                                  mask=n_ok[:, None], other=0)
                    xtn = _x_tile(xr_s, xok_s, kx, q0)
                    acc = mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)
                    q, sw, xt = qn, swn, xtn
                acc = mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)
            else:
                for q0 in range(0, MAIN, KQS):
                    acc = _frag_step_smem(acc, w_rows, s_rows, n_ok, kk, xr_s, xok_s, kx, xs, q0, AL, BL, BN, NT, KQS)
            if MAIN < QUADS:
                kx1 = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
                xs1 = gl.allocate_shared_memory(gl.bfloat16, [BM, 64], SL)
                for q0 in range(MAIN, QUADS):
                    acc = _frag_step_smem(acc, w_rows, s_rows, n_ok, kk1, xr_s, xok_s, kx1, xs1, q0, AL, BL, BN, NT, 1)
        elif PREFETCH and MAIN >= 2 * KQS:  # each step's loads issued before the step before it decodes and multiplies
            q, sw, xb = _frag_load(w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, 0)
            for q0 in range(KQS, MAIN, KQS):
                qn, swn, xbn = _frag_load(w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, q0)
                acc = mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), xb, acc)
                q, sw, xb = qn, swn, xbn
            acc = mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), xb, acc)
        else:
            for q0 in range(0, MAIN, KQS):
                acc = _frag_step(acc, w_rows, s_rows, n_ok, kk, x_rows, x_ok, kb, q0, AL, BN, NT, KQS)
        if not B_SMEM:
            for q0 in range(MAIN, QUADS):  # the quads a whole step does not cover, one at a time (same order for every row)
                acc = _frag_step(acc, w_rows, s_rows, n_ok, kk1, x_rows, x_ok, kb1, q0, AL, BN, NT, 1)
        nr = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        mr = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
        pr = gl.load(pairs_ptr + b * BM + mr)
        out = y_ptr + (b * BM + mr).to(gl.int64)[None, :] * stride_y + nr[:, None]
        gl.store(out, acc, mask=(pr < P)[None, :] & (nr < N)[:, None])


def frag_gemm(x: torch.Tensor, r: Routing, words: torch.Tensor, swords: torch.Tensor, topk: int,
              rows_from_pairs: bool = True, y: torch.Tensor | None = None, nt: int = 4, kqs: int = 1,
              num_warps: int = 4, prefetch: bool = False, b_smem: bool = False) -> torch.Tensor:
    """y [max_blocks * BM, N] float32 (rows of unused block slots untouched) = `frag_gemm_reference` on CUDA.
    words/swords: `to_fragment_words` of the slots' weights ([S, N/16, K/64, 8, 4, 4], [S, N/16, K/64, 8]). Tiles: `nt`
    16-row tiles a program (a multiple of num_warps), `kqs` 64-column quads a K step (a power of two); `prefetch`: each
    step's loads issued before the previous step's decode and MMAs (registers double-buffered); `b_smem`: the
    activations loaded once a step for all warps (coalesced) and read as the B operand from shared memory, instead of
    each warp loading its own B fragments from global memory (32-bit loads, 8 rows each). Every choice sums
    K in the same order (one quad after another, each MMA's 16 columns in the hardware's fixed order), and no choice
    depends on the routing: a row's bits do not depend on the other rows of the call."""
    if gluon is None:
        raise RuntimeError("frag_gemm needs Triton's Gluon (triton >= 3.5)")
    if x.device.type != "cuda":
        raise RuntimeError("frag_gemm runs on CUDA only; frag_gemm_reference is its CPU form")
    s, ntiles, quads = words.shape[0], words.shape[1], words.shape[2]
    n, k = ntiles * 16, quads * QUAD
    if x.shape[1] != k or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 [rows, {k}] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    if words.dtype != torch.int32 or not words.is_contiguous() or swords.shape != (s, ntiles, quads, 8):
        raise ValueError("words/swords must be to_fragment_words' contiguous int32 tensors")
    if nt % num_warps:
        raise ValueError(f"nt ({nt}) must be a multiple of num_warps ({num_warps})")
    bm = r.sorted_pairs.numel() // r.max_blocks
    if y is None:
        y = torch.zeros((r.max_blocks * bm, n), dtype=torch.float32, device=x.device)
    grid = (r.max_blocks, triton_cdiv(ntiles, nt))
    _frag_gemm[grid](x, x.stride(0), y, y.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, words, words.stride(0),
                     swords, swords.stride(0), r.num_pairs, N=n, K=k, TOPK=topk, ROWS_FROM_PAIRS=rows_from_pairs, BM=bm,
                     NT=nt, KQS=kqs, W=num_warps, PREFETCH=prefetch, B_SMEM=b_smem,
                     num_warps=num_warps)
    return y


def check_scales(scales: torch.Tensor) -> None:
    """The fast decode's bound: every scale byte <= FAST_DECODE_MAX_SCALE (|w| <= 12 in its group)."""
    if int(scales.max()) > FAST_DECODE_MAX_SCALE:
        raise ValueError(f"a scale byte is above {FAST_DECODE_MAX_SCALE}: fragment words take the fast decode only")
