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
invariant: each row's sums run over K in one fixed order whatever the other rows (a K split, `FragTile.split`, is
static by shape, and its partial sums are added in range order by whichever program of the tile comes last). Scale
bytes above 128 are not supported (the fast decode's bound, as `pdflash_kernels.moe.FAST_DECODE_MAX_SCALE`): `frag_gemm`
refuses them.
Without a GPU: `to_fragment_words` / `from_fragment_words` and `frag_gemm_reference` (torch) run anywhere; the kernel
compiles for sm_90 on a CPU machine (tests/test_fragments.py) but runs only on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing

import torch

from pdflash_kernels import mxfp4, runtime
from pdflash_kernels.moe import (ACT_RELU2, FAST_DECODE_MAX_SCALE, Routing, pair_word_decode_asm, triton_cdiv,
                                  triton_next_pow2)

try:  # Gluon (Triton >= 3.5): explicit layouts. Optional like Triton itself.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except Exception:  # pragma: no cover - depends on the install
    gluon = gl = mma_v2 = async_copy = None

_FRAG_ASM = pair_word_decode_asm("$9", "$10")  # decode 5, rows g ($9) and g + 8 ($10) with their own scales
QUAD = 64  # K values of one fragment quad (four 16-column tiles)
WORDS_PER_QUAD = 128  # words of one 16-row x 64-column quad (32 lanes x 4 tiles)
# Programmatic dependent launch for the two GEMMs, as the Triton kernels have it (pdflash_kernels.runtime.PDL, on by default
# on sm_90+): each program first waits for the kernel before it (griddepcontrol.wait: the routing, a copy group's fill
# or the gate/up GEMM wrote what it reads), then lets the next kernel launch (PDFLASH_PDL_TRIGGER's order), so a
# launch's latency hides under the previous kernel's tail. The arithmetic is untouched. Opt-in (PDFLASH_FP4_FRAGMENTS_PDL=1,
# where runtime.PDL is on): on the H200 the fragment tests (stop 38) and the offload identity tests (stop 39) pass with
# it, bit-identical, and the whole MoE call alone runs 1.4-2.1 us faster in 4 of 5 cases (stop 37,
# `benchmarks/fragment_bench.py --pdl-ab`), but end to end it did not pay: gpt-oss-24l resident, block 1, forward
# 2.394 / 2.298 ms with it against 2.311 / 2.168 ms without, two runs in each order (stop 39,
# benchmarks/results/gpu_runs_h200.md). (A down GEMM that asked L2 for its weights before its wait, stop 38, ran
# -0.5..+10.1 us slower than PDL alone and was removed.)
_PDL_ASKED = runtime.env_flag("PDFLASH_FP4_FRAGMENTS_PDL", default=False)  # (read everywhere: a bad value stops the import)
PDL_ON = 1 if runtime.PDL_TRIGGER == "after-wait" else 2  # `_pdl_begin`'s mode when on (benchmarks/fragment_bench.py --pdl-ab)
PDL_MODE = PDL_ON if runtime.PDL and _PDL_ASKED else 0
# The MoE call's gate/up GEMM, down GEMM and combine in one launch after the routing's (`fragment_moe_one`: programs take
# work tickets; down tiles wait for their block's gate/up tiles) for calls whose number of (token, expert) pairs lies
# in a shape's range on the device measured (ONE_LAUNCH_SHAPES, by the CUDA device's name, then (hidden, expert width):
# where that device measured it faster; other devices and shapes none); other calls, calls computed in copy groups (an
# expert cache still copying) and tiles with a K split take the four launches. Every output bit is the four launches'
# (the same tile programs), so the cut may depend on the token count and the device. Measured in a forward
# (`fragment_bench.py --in-forward 8 --one-launch-ab`), whole call one launch / four, on the H200: gpt-oss-20b 51.4 /
# 57.4 us (8 experts, 1 token each) to 84.8 / 94.5 us (16 experts) and 158.4 / 162.9 us (32 experts), but 50.0 / 40.8
# us at 4 pairs (one token's top-4, a block-1 forward: its 180 down tiles are resident beside the gate/up tiles and
# wait there), so gpt-oss takes 8 to 128 pairs there (stop 41, fragment_one_launch_h200.md; end to end gpt-oss-24l's
# block-1 forward was 0.19 ms slower with one launch at 4 pairs, its block-16 forward 0.24 ms faster:
# benchmarks/results/gpu_runs_h200.md). On the H100 (80GB HBM3) the one launch lost on gpt-oss-20b: 71.1 / 63.2 us at
# 8 experts x 1 token and 194.0 / 168.4 us at 32 (stop 45, `benchmarks/moe_call_breakdown.py`,
# benchmarks/results/stop45_gpu/call2), so the H100 took none (as vLLM's fused-MoE configs, tuned per device name).
# Since the staged tiles (stop 42) and the persistent four launches (stop 50) that changed: on the H100 at stop 56
# (`persist_ab.py --one-launch`, o1 = the one launch forced, against the served four launches, us) gpt-oss-20b ran
# 63.0 / 63.9 at 8 experts x 4 tokens, 164.2 / 171.6 at 32 x 1, and a verify's spread 8 / 16 / 32 tokens 101.9 / 115.8,
# 152.6 / 163.0, 167.6 / 174.0, every bit the same; end to end gpt-oss-24l's replay@16 forward took 4.55 / 4.59 ms
# against 4.86 / 4.86 (two runs each, alternating; block 1 unchanged), so the H100 takes 17-128 pairs (below 17 the
# routing-free call is served: DIRECT_PAIRS; stop56_gpu/call2-3). Mixtral-8x7B's experts likewise on the H100 (call 5,
# o1 against four launches, us): 8 experts x 4 / 16 tokens 264.5 / 271.2 and 269.8 / 276.7, a verify's spread 16 / 32 /
# 64 tokens 264.9 / 271.4, 267.8 / 278.3, 400.6 / 419.9, every bit the same; not measured on the H200, which keeps
# four launches for it. (A smaller gate/up tile in the one launch where the
# routing made few blocks, chosen on the device, ran slower there: 67.7 against 63.0 us at 8 x 4, more tickets; removed.)
# Qwen3-30B-A3B is slower in one launch, 29.1 / 25.1 us on the H200 (8 experts, 1 token each): the tickets (one atomic
# on one address a program, ~450 programs) delay the tiles ~5 us (`benchmarks/one_launch_probe.py`, stop 41: 22.8 us
# with roles by program id, which is not safe without a ticket).
# PDFLASH_FP4_ONE_LAUNCH_PAIRS=N: 1 to N pairs on every shape and device (0: off everywhere; N at most 128).
ONE_LAUNCH_SHAPES: dict[str, dict[tuple[int, int], tuple[int, int]]] = {"NVIDIA H200": {(2880, 2880): (8, 128)},
                                                                     "NVIDIA H100 80GB HBM3": {(2880, 2880): (17, 128),
                                                                                               (4096, 14336): (17, 128)}}
_ONE = os.environ.get("PDFLASH_FP4_ONE_LAUNCH_PAIRS") or None  # (empty, as compose.gpu.yaml passes it unset: by shape)
if _ONE is not None and not (_ONE.isdigit() and int(_ONE) <= 128):
    raise ValueError(f"PDFLASH_FP4_ONE_LAUNCH_PAIRS must be a number of pairs from 0 (off) to 128, got {_ONE!r}")
ONE_LAUNCH_PAIRS: int | None = int(_ONE) if _ONE is not None else None  # None: ONE_LAUNCH_SHAPES


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name() -> str:
    """The current CUDA device's name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"; "" without CUDA): the key of the tables
    tuned per device (ONE_LAUNCH_SHAPES)."""
    return _device_name(torch.cuda.current_device()) if torch.cuda.is_available() else ""


def one_launch_range(hidden: int, inter: int, device: str | None = None) -> tuple[int, int]:
    """(fewest, most) (token, expert) pairs a call of this expert shape takes in `fragment_moe_one` (most 0: none) on
    this device (a name as `device_name` gives it; None: the current one)."""
    if ONE_LAUNCH_PAIRS is not None:
        return (1, ONE_LAUNCH_PAIRS)
    shapes = ONE_LAUNCH_SHAPES.get(device_name() if device is None else device, {})
    return shapes.get((hidden, inter), (1, 0))


def one_launch_pairs(hidden: int, inter: int, device: str | None = None) -> int:
    """The most (token, expert) pairs a call of this expert shape takes in `fragment_moe_one` (0: none)."""
    return one_launch_range(hidden, inter, device)[1]


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


def check_scales(scales: torch.Tensor) -> None:
    """The fast decode's bound: every scale byte <= FAST_DECODE_MAX_SCALE (|w| <= 12 in its group)."""
    if scales.numel() and int(scales.max()) > FAST_DECODE_MAX_SCALE:
        raise ValueError(f"a scale byte is above {FAST_DECODE_MAX_SCALE}: fragment words take the fast decode only")


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
    _FRAG_ASM = gl.constexpr(_FRAG_ASM)  # (a jit function reads a global only as a constexpr)

    @gluon.jit
    def _decode_quads(q, sw, kk, AL: gl.constexpr, BN: gl.constexpr, KQS: gl.constexpr, NT: gl.constexpr):
        """Words [NT, KQS * 128] (and their scale words) -> the A operand [BN, KQS * 64] in the MMA's layout."""
        sh = ((kk % 4) // 2) * 8  # the quad's first or second 32 columns
        s0 = (sw >> sh[None, :]) & 0xFF  # row g's scale byte
        s1 = (sw >> (sh[None, :] + 16)) & 0xFF  # row g + 8's
        c0 = ((s0 + 126) << 7) | ((s0 + 126) << 23)  # bf16x2 2^(s - 1) in both halves
        c1 = ((s1 + 126) << 7) | ((s1 + 126) << 23)
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _FRAG_ASM,
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
    def _quads(w_rows, s_rows, n_ok, kk, q0, live=True):
        """The words and scale words of KQS quads from quad q0 (rows past N, and every row where not `live`, read as
        zero: no memory traffic)."""
        ok = n_ok[:, None] & live
        q = gl.load(w_rows[:, None] + (q0 * 128 + kk)[None, :], mask=ok, other=0)
        sw = gl.load(s_rows[:, None] + (q0 * 8 + (kk // 128) * 8 + (kk % 128) // 16)[None, :], mask=ok, other=0)
        return q, sw

    @gluon.jit
    def _x_tile(x_rows, x_ok, kx, q0, live=True, CG: gl.constexpr = False):
        """Activations [BM, KQS * 64] of the quads from q0, in a coalesced layout (16-byte loads along K). CG: from L2
        (rows another program of the same launch wrote)."""
        if CG:
            return gl.load(x_rows[:, None] + (q0 * 64 + kx)[None, :], mask=x_ok[:, None] & live, other=0.0,
                           cache_modifier=".cg")
        return gl.load(x_rows[:, None] + (q0 * 64 + kx)[None, :], mask=x_ok[:, None] & live, other=0.0)

    @gluon.jit
    def _b_operand(xs, xt, BL: gl.constexpr):
        """The B operand from a coalesced activation tile through shared memory (one copy for all warps, read back with
        ldmatrix): the barriers keep the previous step's reads before this store and this store before the reads."""
        gl.thread_barrier()
        xs.store(xt)
        gl.thread_barrier()
        return xs.permute([1, 0]).load(BL)

    @gluon.jit
    def _k_range(acc, w_rows, s_rows, n_ok, kk, xr, xok, kx, xs, q_lo, q_hi, AL: gl.constexpr, BL: gl.constexpr,
                 BN: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr, PREFETCH: gl.constexpr, CG: gl.constexpr = False):
        """Quads q_lo .. q_hi (at least one whole KQS-quad step, a whole number of them) into acc, one B operand a step.
        PREFETCH 1: each step's global loads issued before the previous step's decode and MMAs; 2: two steps ahead (the
        loads past q_hi masked off). The same MMAs in the same order either way."""
        if PREFETCH == 2:
            q, t = _quads(w_rows, s_rows, n_ok, kk, q_lo)
            xt = _x_tile(xr, xok, kx, q_lo, CG=CG)
            q1, t1 = _quads(w_rows, s_rows, n_ok, kk, q_lo + KQS, q_lo + KQS < q_hi)
            xt1 = _x_tile(xr, xok, kx, q_lo + KQS, q_lo + KQS < q_hi, CG=CG)
            for q0 in range(q_lo + 2 * KQS, q_hi + 2 * KQS, KQS):  # computes step q0 - 2 KQS
                qn, tn = _quads(w_rows, s_rows, n_ok, kk, q0, q0 < q_hi)
                xtn = _x_tile(xr, xok, kx, q0, q0 < q_hi, CG=CG)
                acc = mma_v2(_decode_quads(q, t, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)
                q, t, xt, q1, t1, xt1 = q1, t1, xt1, qn, tn, xtn
        elif PREFETCH:
            q, t = _quads(w_rows, s_rows, n_ok, kk, q_lo)
            xt = _x_tile(xr, xok, kx, q_lo, CG=CG)
            for q0 in range(q_lo + KQS, q_hi, KQS):
                qn, tn = _quads(w_rows, s_rows, n_ok, kk, q0)
                xtn = _x_tile(xr, xok, kx, q0, CG=CG)
                acc = mma_v2(_decode_quads(q, t, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)
                q, t, xt = qn, tn, xtn
            acc = mma_v2(_decode_quads(q, t, kk, AL, BN, KQS, NT), _b_operand(xs, xt, BL), acc)
        else:
            for q0 in range(q_lo, q_hi, KQS):
                q, t = _quads(w_rows, s_rows, n_ok, kk, q0)
                acc = mma_v2(_decode_quads(q, t, kk, AL, BN, KQS, NT), _b_operand(xs, _x_tile(xr, xok, kx, q0, CG=CG), BL),
                             acc)
        return acc

    @gluon.jit
    def _ring_copy(ring, sring, xring, slot, w_rows, s_rows, n_ok, n_ok_s, kk, ks, xr, xok, kx, q0, live,
                   KQS: gl.constexpr, CG: gl.constexpr, XRING: gl.constexpr):
        """Asynchronous copies of the KQS quads from quad q0 into ring slot `slot`: the words (each thread copies the
        16 bytes it later reads), a scale word for each thread's 4 words, the activation tile (XRING). Masked off
        (rows past N, padding rows, every row where not `live`): zero-filled, no memory traffic. One commit group."""
        ok = n_ok[:, None] & live
        # 16-byte copies: every row of words starts 512-byte aligned, every activation row 16-byte aligned (`_launch`
        # checks the stride), each thread's 4 words / 8 values contiguous
        wp = gl.max_contiguous(gl.multiple_of(w_rows[:, None] + (q0 * 128 + kk)[None, :], [16, 16]), [1, 4])
        async_copy.async_copy_global_to_shared(ring.index(slot), wp, mask=ok, cache_modifier=".cg")
        async_copy.async_copy_global_to_shared(
            sring.index(slot), s_rows[:, None] + (q0 * 8 + (ks // 32) * 8 + (ks % 32) // 4)[None, :],
            mask=n_ok_s[:, None] & live)
        if XRING:
            xp = gl.max_contiguous(gl.multiple_of(xr[:, None] + (q0 * 64 + kx)[None, :], [16, 16]), [1, 8])
            if CG:
                async_copy.async_copy_global_to_shared(xring.index(slot), xp, mask=xok[:, None] & live,
                                                       cache_modifier=".cg")
            else:
                async_copy.async_copy_global_to_shared(xring.index(slot), xp, mask=xok[:, None] & live)
        async_copy.commit_group()

    @gluon.jit
    def _k_range_async(acc, w_rows, s_rows, n_ok, kk, xr, xok, kx, q_lo, q_hi, AL: gl.constexpr, BL: gl.constexpr,
                       BN: gl.constexpr, BM: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr, STAGES: gl.constexpr,
                       XRING: gl.constexpr, W: gl.constexpr, CG: gl.constexpr = False):
        """`_k_range` with a ring of STAGES K steps in shared memory filled by cp.async (FragTile.stages): STAGES - 1
        steps' weights and scale words (and with XRING the activation tiles; else each step's activations are loaded a
        step ahead into registers and staged through shared memory as `_k_range` does) in flight while one step is
        decoded and multiplied, without the registers a register prefetch holds. The same MMAs in the same order as
        `_k_range` (the same bits)."""
        WL: gl.constexpr = _layout("w", W)
        S3: gl.constexpr = _layout("s3", W)  # [NT, KQS * 32, 4]: a thread's scale word, spread over its 4 words
        SWL: gl.constexpr = gl.SliceLayout(2, S3)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])  # (a slot's)
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, NT, KQS * 128], PLAIN)
        sring = gl.allocate_shared_memory(gl.int32, [STAGES, NT, KQS * 32], PLAIN)
        if XRING:
            xring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, KQS * 64], _layout("s", W))
        else:
            xring = gl.allocate_shared_memory(gl.bfloat16, [BM, KQS * 64], _layout("s", W))  # (one step's staging)
        ks = gl.arange(0, KQS * 32, layout=gl.SliceLayout(0, SWL))
        n_ok_s = gl.convert_layout(n_ok, gl.SliceLayout(1, SWL))
        s_rows_s = gl.convert_layout(s_rows, gl.SliceLayout(1, SWL))
        zero3 = gl.zeros([NT, KQS * 32, 4], gl.int32, S3)  # (a shape to broadcast to)
        steps = (q_hi - q_lo) // KQS
        for i in gl.static_range(STAGES - 1):  # the first STAGES - 1 steps in flight
            _ring_copy(ring, sring, xring, i, w_rows, s_rows_s, n_ok, n_ok_s, kk, ks, xr, xok, kx, q_lo + i * KQS,
                       i < steps, KQS, CG, XRING)
        if not XRING:
            xt = _x_tile(xr, xok, kx, q_lo, CG=CG)
        for i in range(steps):
            # step i's group is complete (STAGES - 2 committed after it); the compiler's barrier after the wait (its
            # shared-memory hazard pass; tests/test_fragments.py checks it is there) makes every thread's copies of
            # step i visible to all and puts every read of step i - 1 before the copies below
            async_copy.wait_group(STAGES - 2)
            nxt = i + STAGES - 1  # into the slot step i - 1 read
            _ring_copy(ring, sring, xring, nxt % STAGES, w_rows, s_rows_s, n_ok, n_ok_s, kk, ks, xr, xok, kx,
                       q_lo + nxt * KQS, nxt < steps, KQS, CG, XRING)
            cur = i % STAGES
            q = ring.index(cur).load(WL)
            sw = sring.index(cur).load(SWL)
            sw, _ = gl.broadcast(gl.expand_dims(sw, 2), zero3)
            sw = gl.convert_layout(gl.reshape(sw, [NT, KQS * 128]), WL, assert_trivial=True)
            if XRING:
                b = xring.index(cur).permute([1, 0]).load(BL)
            else:
                xtn = _x_tile(xr, xok, kx, q_lo + (i + 1) * KQS, i + 1 < steps, CG=CG)
                b = _b_operand(xring, xt, BL)
                xt = xtn
            acc = mma_v2(_decode_quads(q, sw, kk, AL, BN, KQS, NT), b, acc)
        async_copy.wait_group(0)  # the masked copies past the last step too: nothing lands after the ring is freed
        gl.thread_barrier()  # (every thread's, before shared memory the ring held is reused by the epilogue or K tail)
        return acc

    @gluon.constexpr_function
    def _layout(name, warps):
        """The fragment GEMMs' layouts for `warps` warps: "w" weight words, "mma" the MMA's accumulator, "a" / "b" its
        operands, "x" activation rows, "s" the activation tile's shared-memory swizzle."""
        warps = int(getattr(warps, "value", warps))
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        return {"w": lambda: gl.BlockedLayout([1, 4], [1, 32], [warps, 1], [1, 0]), "mma": lambda: mma,
                "a": lambda: gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                "b": lambda: gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                "x": lambda: gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0]),
                "s": lambda: gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]),
                "s3": lambda: gl.BlockedLayout([1, 1, 4], [1, 32, 1], [warps, 1, 1], [2, 1, 0])}[name]()

    @gluon.jit
    def _weight_tiles(w_ptr, stride_ws, s_ptr, stride_ss, slot, pid_n, N: gl.constexpr, QUADS: gl.constexpr,
                      NT: gl.constexpr, TWO: gl.constexpr, TPP: gl.constexpr, WL: gl.constexpr):
        """A program's NT weight tiles (the MMA's M side) in slot `slot`, tile group pid_n: each tile's first word and
        first scale word, and which tiles lie inside N. TWO (gate/up): NT / 2 gate tiles, then their up tiles N / 16
        tiles further."""
        ti = gl.arange(0, NT, layout=gl.SliceLayout(1, WL))
        if TWO:
            tiles = pid_n * TPP + ti % TPP
            n_ok = tiles < N // 16
            tiles = gl.where(n_ok, tiles, 0) + (ti // TPP) * (N // 16)
        else:
            tiles = pid_n * NT + ti
            n_ok = tiles < N // 16
            tiles = gl.where(n_ok, tiles, 0)
        tiles = tiles.to(gl.int64)
        w_rows = w_ptr + slot.to(gl.int64) * stride_ws + tiles * (QUADS * 128)
        s_rows = s_ptr + slot.to(gl.int64) * stride_ss + tiles * (QUADS * 8)
        return w_rows, s_rows, n_ok

    @gluon.jit
    def _tile_sums(xr, xok, w_rows, s_rows, n_ok, q_lo, q_main, last, BN: gl.constexpr, BM: gl.constexpr,
                   NT: gl.constexpr, KQS: gl.constexpr, QUADS: gl.constexpr, PREFETCH: gl.constexpr, W: gl.constexpr,
                   CG: gl.constexpr = False, STAGES: gl.constexpr = 0, XRING: gl.constexpr = 0):
        """acc [BN, BM] float32 (MMA layout) = the tiles' weights x the rows' activations over quads q_lo .. q_main in
        KQS-quad steps, then (where `last`) the quads past the last whole step one at a time: the same order for every
        row. xr / xok: the rows' activation pointers and mask (XL's row slice)."""
        WL: gl.constexpr = _layout("w", W)
        MMA: gl.constexpr = _layout("mma", W)
        AL: gl.constexpr = _layout("a", W)
        BL: gl.constexpr = _layout("b", W)
        XL: gl.constexpr = _layout("x", W)
        SL: gl.constexpr = _layout("s", W)
        QMAIN: gl.constexpr = QUADS // KQS * KQS
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        if QMAIN > 0:
            kk = gl.arange(0, KQS * 128, layout=gl.SliceLayout(0, WL))
            kx = gl.arange(0, KQS * 64, layout=gl.SliceLayout(0, XL))
            if STAGES > 0:
                acc = _k_range_async(acc, w_rows, s_rows, n_ok, kk, xr, xok, kx, q_lo, q_main, AL, BL, BN, BM, NT, KQS,
                                     STAGES, XRING, W, CG)
            else:
                xs = gl.allocate_shared_memory(gl.bfloat16, [BM, KQS * 64], SL)
                acc = _k_range(acc, w_rows, s_rows, n_ok, kk, xr, xok, kx, xs, q_lo, q_main, AL, BL, BN, NT, KQS,
                               PREFETCH, CG)
        if QMAIN < QUADS:  # the quads a whole step does not cover, one at a time (the same order for every row)
            kk1 = gl.arange(0, 128, layout=gl.SliceLayout(0, WL))
            kx1 = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
            xs1 = gl.allocate_shared_memory(gl.bfloat16, [BM, 64], SL)
            if last:
                acc = _k_range(acc, w_rows, s_rows, n_ok, kk1, xr, xok, kx1, xs1, QMAIN, QUADS, AL, BL, BN, NT, 1,
                               False, CG)
        return acc

    @gluon.jit
    def _pdl_begin(MODE: gl.constexpr):
        """A program's first statement: MODE 1 waits for the previous kernel, then lets the next launch; 2 the other
        order; 0 nothing (pdflash_kernels.runtime.pdl_begin for Gluon)."""
        if MODE == 1:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        elif MODE == 2:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _frag_gemm(x_ptr, stride_x, out_ptr, stride_o, pairs_ptr, slot_ptr, nblocks_ptr, phase_ptr,
                   w_ptr, stride_ws, s_ptr, stride_ss, b_ptr, stride_b, rw_ptr, ws_ptr, cnt_ptr, R, P, alpha, limit,
                   tab_ptr, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr, EPI: gl.constexpr, ACT: gl.constexpr,
                   HAS_BIAS: gl.constexpr, ROW_MUL: gl.constexpr, UP_OFF: gl.constexpr, PHASE: gl.constexpr,
                   BM: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr, W: gl.constexpr, PREFETCH: gl.constexpr,
                   SPLIT: gl.constexpr, SS: gl.constexpr, PDL: gl.constexpr = 0, STAGES: gl.constexpr = 0,
                   XRING: gl.constexpr = 0, DIRECT: gl.constexpr = 0, E: gl.constexpr = 0, HAS_SLOT: gl.constexpr = 0,
                   HAS_NVALID: gl.constexpr = 0, PERSIST: gl.constexpr = 0, DP: gl.constexpr = 16,
                   GROUP: gl.constexpr = 0, TAB: gl.constexpr = 0):
        """One program: routing block program_id(0) x NT 16-row weight tiles (program_id(1)) x K range program_id(2).
        EPI 0: y (float32) at the block's rows = x[pair // TOPK] @ w^T (EPI 3: x[block row] @ w^T); EPI 1 (gate/up,
        rows [gates; ups] as `gate_up_order` stores them, N = I): the program's tiles are NT / 2 gate tiles and the NT / 2
        up tiles I / 16 tiles further (one A operand), h (bf16) at the block's rows = act(gate (+ bias), up (+ bias)) of
        x[pair // TOPK]; up-only experts (ACT 2, N = I rows of up alone): NT up tiles, h = relu(up (+ bias))^2;
        EPI 2 (down): y (float32) at row `pair` = (h[block row] @ w^T (+ bias)) * routing weight.
        Rounded where moe's kernels round: bf16 after each projection and bias. SPLIT > 1: K's whole KQS-quad steps cut
        into ranges of SS steps (the quads past the last whole step in the last range), each program's float32 partial
        sums into ws [SPLIT, R, weight rows]; the tile's last program (a counter in cnt as a semaphore) adds them in
        range order from zero and runs the epilogue: the same bits whichever program is last.
        DIRECT (a small call without the routing launch, `fragment_moe`'s DIRECT_PAIRS): block program_id(0) is led
        by pair b, its expert read from the top-k ids (pairs_ptr: ids [P], P <= DP), its slot from slot_ptr's table
        (HAS_SLOT) or the id; a pair of an id outside [0, E) or of a token at or past n_valid (nblocks_ptr, HAS_NVALID)
        is dropped, and the gate/up programs of tile column 0 write each pair's keep flag to phase_ptr (the combine's
        pair_valid, as `moe.align` defines it). GROUP 0: each pair its own block (its row 0). GROUP 1
        (`DIRECT_GROUP`): each program groups the pairs itself (`_same_expert`, one load of
        the ids): b leads a block where it is its expert's 0th, 16th, ... kept pair, the block's rows that pair and
        its expert's next 15 (`_group_rows`), as a routed block holds them; the other blocks are empty, so an expert's
        weights are read once for its pairs, not once a pair. The same products in the same order as the routed
        blocks: the same bits.
        PERSIST: a fixed grid of programs (`_launch`'s PERSIST_PER_SM a multiprocessor), each walking the live tiles
        (a block's weight tiles and K ranges one after another, blocks in order) up to the routing's block count: no
        program for the unused block slots (a routed call's grid is its worst case, ~max(P, E) blocks, of which P / 16
        to E hold pairs). Each tile is the same program body: the same bits."""
        _pdl_begin(PDL)  # before any load: the routing and the slots' copies come from the kernels before
        TPP0: gl.constexpr = NT // 2 if (EPI == 1 and ACT != 2) else NT  # output tiles a program (up-only: ACT 2)
        NTL: gl.constexpr = (N // 16 + TPP0 - 1) // TPP0  # weight tiles a block (the grid's program_id(1) range)
        if PERSIST:
            if DIRECT:
                nb = P
            else:
                nb = gl.load(nblocks_ptr)
            tile = gl.program_id(0)
            while tile < nb * (NTL * SPLIT):
                _frag_tile(tile // (NTL * SPLIT), tile % (NTL * SPLIT) // SPLIT, tile % SPLIT, NTL,
                    x_ptr, stride_x, out_ptr, stride_o, pairs_ptr, slot_ptr, nblocks_ptr, phase_ptr, w_ptr, stride_ws,
                    s_ptr, stride_ss, b_ptr, stride_b, rw_ptr, ws_ptr, cnt_ptr, R, P, alpha, limit, tab_ptr, N,
                    K, TOPK, EPI, ACT, HAS_BIAS, ROW_MUL, UP_OFF, PHASE, BM, NT, KQS, W, PREFETCH,
                    SPLIT, SS, STAGES, XRING, DIRECT, E, HAS_SLOT, HAS_NVALID, DP, GROUP, TAB)
                gl.thread_barrier()  # (the next tile's stores into the shared buffers wait for every warp's reads)
                tile += gl.num_programs(0)
        else:
            pid_s = 0
            if SPLIT > 1:
                pid_s = gl.program_id(2)
            _frag_tile(gl.program_id(0), gl.program_id(1), pid_s, NTL,
                x_ptr, stride_x, out_ptr, stride_o, pairs_ptr, slot_ptr, nblocks_ptr, phase_ptr, w_ptr, stride_ws,
                s_ptr, stride_ss, b_ptr, stride_b, rw_ptr, ws_ptr, cnt_ptr, R, P, alpha, limit, tab_ptr, N,
                K, TOPK, EPI, ACT, HAS_BIAS, ROW_MUL, UP_OFF, PHASE, BM, NT, KQS, W, PREFETCH,
                SPLIT, SS, STAGES, XRING, DIRECT, E, HAS_SLOT, HAS_NVALID, DP, GROUP, TAB)

    @gluon.jit
    def _same_expert(pairs_ptr, b, eid, P, nv, TOPK: gl.constexpr, DP: gl.constexpr, W: gl.constexpr):
        """A routing-free call's grouping, in every program: `same` [DP] (the pairs routed to pair b's expert eid and
        kept: of a token below nv) and how many of them come before b."""
        GL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        q = gl.arange(0, DP, layout=GL)
        ids = gl.load(pairs_ptr + q, mask=q < P, other=-1).to(gl.int32)
        same = (ids == eid) & (q < P) & (q // TOPK < nv)
        before = _reduce_add(gl.where(same & (q < b), 1, 0), 0)
        alone = _reduce_add(same.to(gl.int32), 0) == 1  # (b's expert has no other pair: its block is b alone)
        return same, before, alone

    @gluon.jit
    def _group_rows(same, before, P, BM: gl.constexpr, DP: gl.constexpr, W: gl.constexpr):
        """The BM pairs of the block led by the `before`-th pair of `same` (in pair order; P where the expert has no
        more): the rows a routed block of that expert holds, in the same order (`moe.align`'s stable sort)."""
        GL2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, W], [1, 0])
        rank = gl.associative_scan(same.to(gl.int32), 0, _add) - 1  # (for the pairs of `same`: their place among them)
        rank = gl.convert_layout(rank, gl.SliceLayout(0, GL2))
        hit = gl.convert_layout(same, gl.SliceLayout(0, GL2))
        q = gl.arange(0, DP, layout=gl.SliceLayout(0, GL2))
        m = gl.arange(0, BM, layout=gl.SliceLayout(1, GL2))
        mine = hit[None, :] & (rank[None, :] == before + m[:, None])
        return gl.reduce(gl.where(mine, q[None, :], P), 1, _min)

    @gluon.jit
    def _frag_tile(b, pid_n, pid_s, NTL: gl.constexpr, x_ptr, stride_x, out_ptr, stride_o, pairs_ptr, slot_ptr,
                   nblocks_ptr, phase_ptr, w_ptr, stride_ws, s_ptr, stride_ss, b_ptr, stride_b, rw_ptr, ws_ptr, cnt_ptr, R, P, alpha, limit,
                   tab_ptr, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr, EPI: gl.constexpr, ACT: gl.constexpr,
                   HAS_BIAS: gl.constexpr, ROW_MUL: gl.constexpr, UP_OFF: gl.constexpr, PHASE: gl.constexpr,
                   BM: gl.constexpr, NT: gl.constexpr, KQS: gl.constexpr, W: gl.constexpr, PREFETCH: gl.constexpr,
                   SPLIT: gl.constexpr, SS: gl.constexpr, STAGES: gl.constexpr,
                   XRING: gl.constexpr, DIRECT: gl.constexpr, E: gl.constexpr, HAS_SLOT: gl.constexpr,
                   HAS_NVALID: gl.constexpr, DP: gl.constexpr = 16, GROUP: gl.constexpr = 0, TAB: gl.constexpr = 0):
        """One tile of `_frag_gemm`: routing block b x weight tiles pid_n x K range pid_s (NTL weight tiles a block)."""
        BN: gl.constexpr = NT * 16
        WL: gl.constexpr = _layout("w", W)
        MMA: gl.constexpr = _layout("mma", W)
        XL: gl.constexpr = _layout("x", W)
        QUADS: gl.constexpr = K // 64
        MAIN: gl.constexpr = QUADS // KQS * KQS
        TWO: gl.constexpr = EPI == 1 and ACT != 2  # gate and up tiles (ACT 2, up-only experts: the up tiles alone)
        TPP: gl.constexpr = NT // 2 if TWO else NT  # output tiles a program
        if DIRECT:
            eid = gl.load(pairs_ptr + b).to(gl.int32)
            kept = (eid >= 0) & (eid < E)
            nv = P // TOPK
            if HAS_NVALID:
                nv = gl.load(nblocks_ptr)
                kept = kept & (b // TOPK < nv)
            if EPI == 1:
                if pid_n == 0:
                    gl.store(phase_ptr + b, kept)
            # the kept pairs of b's expert (all DP <= 128 ids, one load): b leads a block where it is the 0th, 16th,
            # ... of them in pair order, the block's rows that one and the next BM - 1 (`_group_rows`)
            if GROUP:
                same, before, alone = _same_expert(pairs_ptr, b, eid, P, nv, TOPK, DP, W)
                live = kept & (before % BM == 0)
            else:  # (each pair its own block, row 0: the form before stop 52)
                live = kept
            if HAS_SLOT:
                slot = gl.load(slot_ptr + gl.where(kept, eid, 0))
            else:
                slot = eid
            if TAB:  # (gate/up, grouped) the grouping as a routing's tables for the down launch: block slots, count
                if pid_n == 0:
                    gl.store(tab_ptr + P * BM + b, gl.where(live, slot, -1))
                    if b == 0:
                        gl.store(tab_ptr + P * BM + P, P)
        else:
            live = b < gl.load(nblocks_ptr)
            if PHASE != 0:
                live = live & (gl.load(phase_ptr + b) == PHASE - 1)
            slot = gl.load(slot_ptr + b)
        if live & (slot >= 0):
            # the block's rows (the MMA's N side), loaded once a step for all warps through shared memory
            mx = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
            if DIRECT:
                if GROUP:
                    if alone:  # (a spread call's usual block: no scan, no reduction)
                        pair_x = gl.where(mx == 0, b, P)
                    else:
                        pair_x = gl.convert_layout(_group_rows(same, before, P, BM, DP, W), gl.SliceLayout(1, XL))
                    if TAB:  # (and the block's rows)
                        if pid_n == 0:
                            gl.store(tab_ptr + b * BM + mx, pair_x)
                else:
                    pair_x = gl.where(mx == 0, b, P)
            else:
                pair_x = gl.load(pairs_ptr + b * BM + mx)
            xok = pair_x < P
            if EPI >= 2:  # the down GEMM's input (and EPI 3's): the block's own rows
                xr = b * BM + mx
            else:
                xr = gl.where(xok, pair_x // TOPK, 0)
            xr = x_ptr + xr.to(gl.int64) * stride_x
            w_rows, s_rows, n_ok = _weight_tiles(w_ptr, stride_ws, s_ptr, stride_ss, slot, pid_n, N, QUADS, NT,
                                                 TWO, TPP, WL)
            if SPLIT == 1:
                q_lo = 0
                q_main = MAIN
                last = True
            else:
                q_lo = pid_s * (SS * KQS)
                q_main = gl.minimum(q_lo + SS * KQS, MAIN)
                last = pid_s == SPLIT - 1
            acc = _tile_sums(xr, xok, w_rows, s_rows, n_ok, q_lo, q_main, last, BN, BM, NT, KQS, QUADS, PREFETCH, W,
                             False, STAGES, XRING)
            # the program's output: acc [BN, BM], row = weight row (tile * 16 + r), column m = the block's row m
            mr = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
            if DIRECT:
                if GROUP:
                    pair = gl.convert_layout(pair_x, gl.SliceLayout(0, MMA))  # (the rows found before the K loop)
                else:
                    pair = gl.where(mr == 0, b, P)
            else:
                pair = gl.load(pairs_ptr + b * BM + mr)
            p_ok = pair < P
            rows = (b * BM + mr).to(gl.int64)
            go = True
            if SPLIT > 1:  # partial sums into ws; the tile's last program adds them in range order
                jr = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
                if TWO:
                    wrow = (pid_n * TPP * 16 + jr % (TPP * 16)) + (jr // (TPP * 16)) * N
                    wr_ok = (pid_n * TPP * 16 + jr % (TPP * 16)) < N
                    NW: gl.constexpr = 2 * N
                else:
                    wrow = pid_n * BN + jr
                    wr_ok = wrow < N
                    NW: gl.constexpr = N
                wmask = wr_ok[:, None] & p_ok[None, :]
                wofs = rows[None, :] * NW + wrow[:, None]
                gl.store(ws_ptr + pid_s.to(gl.int64) * R * NW + wofs, acc, mask=wmask)
                gl.thread_barrier()  # every thread's partial stored before the count is released
                tile = b * NTL + pid_n
                arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
                go = arrived == SPLIT - 1
                if go:
                    acc = gl.zeros([BN, BM], gl.float32, MMA)
                    for s in range(SPLIT):
                        acc += gl.load(ws_ptr + s * R * NW + wofs, mask=wmask, other=0.0, cache_modifier=".cg")
                    gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            if go:
                _epilogue(acc, out_ptr, stride_o, b_ptr, stride_b, rw_ptr, slot, pair, p_ok, rows, alpha, limit,
                          pid_n, N, EPI, ACT, HAS_BIAS, ROW_MUL, UP_OFF, BN, BM, TPP, W, MMA)

    @gluon.jit
    def _epilogue(acc, out_ptr, stride_o, b_ptr, stride_b, rw_ptr, slot, pair, p_ok, rows, alpha, limit, pid_n,
                  N: gl.constexpr, EPI: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, ROW_MUL: gl.constexpr,
                  UP_OFF: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, TPP: gl.constexpr, W: gl.constexpr,
                  MMA: gl.constexpr):
        if EPI == 1 and ACT == 2:  # up-only: h = relu(up (+ bias))^2, rounded as moe's ACT_RELU2 epilogue rounds
            j = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
            j_ok = j < N
            mask = j_ok[:, None] & p_ok[None, :]
            u = acc.to(gl.bfloat16).to(gl.float32)
            if HAS_BIAS:
                bu = gl.load(b_ptr + slot.to(gl.int64) * stride_b + j, mask=j_ok, other=0.0).to(gl.float32)
                u = (u + bu[:, None]).to(gl.bfloat16).to(gl.float32)
            r = gl.maximum(u, 0.0)
            gl.store(out_ptr + rows[None, :] * stride_o + j[:, None], (r * r).to(gl.bfloat16), mask=mask)
        elif EPI == 1:  # gate rows [0, BN / 2) and up rows [BN / 2, BN) of acc apart, through shared memory
            EL: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, W], [0, 1])
            ESL: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            es = gl.allocate_shared_memory(gl.float32, [BN, BM], ESL)
            es.store(acc)
            gl.thread_barrier()
            g = es.slice(0, TPP * 16).load(EL).to(gl.bfloat16).to(gl.float32)
            u = es.slice(TPP * 16, TPP * 16).load(EL).to(gl.bfloat16).to(gl.float32)
            j = pid_n * (TPP * 16) + gl.arange(0, TPP * 16, layout=gl.SliceLayout(1, EL))
            j_ok = j < N
            re = gl.convert_layout(rows, gl.SliceLayout(0, EL))
            mask = j_ok[:, None] & gl.convert_layout(p_ok, gl.SliceLayout(0, EL))[None, :]
            if HAS_BIAS:
                brow = b_ptr + slot.to(gl.int64) * stride_b  # (a slot pool's rows are whole slices apart: int64)
                bg = gl.load(brow + j * ROW_MUL, mask=j_ok, other=0.0).to(gl.float32)
                bu = gl.load(brow + j * ROW_MUL + UP_OFF, mask=j_ok, other=0.0).to(gl.float32)
                g = (g + bg[:, None]).to(gl.bfloat16).to(gl.float32)
                u = (u + bu[:, None]).to(gl.bfloat16).to(gl.float32)
            if ACT == 0:
                h = g / (1.0 + gl.exp(-g)) * u
            else:
                g = gl.minimum(g, limit)
                u = gl.minimum(gl.maximum(u, -limit), limit)
                h = (u + 1.0) * (g / (1.0 + gl.exp(-alpha * g)))
            gl.store(out_ptr + re[None, :] * stride_o + j[:, None], h.to(gl.bfloat16), mask=mask)
        else:
            j = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
            j_ok = j < N
            mask = j_ok[:, None] & p_ok[None, :]
            if EPI == 0 or EPI == 3:
                gl.store(out_ptr + rows[None, :] * stride_o + j[:, None], acc, mask=mask)
            else:
                y = acc.to(gl.bfloat16).to(gl.float32)
                if HAS_BIAS:
                    bb = gl.load(b_ptr + slot.to(gl.int64) * stride_b + j, mask=j_ok, other=0.0).to(gl.float32)
                    y = (y + bb[:, None]).to(gl.bfloat16).to(gl.float32)
                rw = gl.load(rw_ptr + pair, mask=p_ok, other=0.0).to(gl.float32)
                y = y * rw[None, :]
                gl.store(out_ptr + pair.to(gl.int64)[None, :] * stride_o + j[:, None], y, mask=mask)


    # ---- the whole MoE call in one launch (small calls: `fragment_moe_one`) ----------------------------------------------
    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _min(a, b):
        return gl.minimum(a, b)

    @gluon.jit
    def _reduce_add(x, axis: gl.constexpr):
        """gl.sum with a Gluon combine function (Triton's own is an interpreted function where TRITON_INTERPRET is set,
        as in the CPU tests that compile these kernels for sm_90)."""
        return gl.reduce(x, axis, _add)

    @gluon.jit
    def _combine_tile(y_ptr, stride_y, out_ptr, stride_out, valid_ptr, ctr_ptr, pair, p_ok, j, P, TOPK: gl.constexpr,
                      H: gl.constexpr, TB: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, W: gl.constexpr):
        """After a down tile's rows are stored: the last program to store one of a token's pairs in this column tile
        (a counter a token and tile, as pdflash_kernels.moe's fused combine) sums the token's rows in slot order from zero
        (`_moe_combine`'s arithmetic) into out (bf16). Rows along dim 0, 8 contiguous columns a thread; the slots' loads
        four at a time (all eight in flight took 224 registers on Qwen3's shapes and capped the kernel's occupancy)."""
        CL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        pair = gl.convert_layout(pair, gl.SliceLayout(1, CL))
        p_ok = gl.convert_layout(p_ok, gl.SliceLayout(1, CL))
        tok = gl.where(p_ok, pair // TOPK, 0)
        need = gl.zeros([BM], gl.int32, gl.SliceLayout(1, CL))
        for s in gl.static_range(TOPK):
            need += gl.load(valid_ptr + tok * TOPK + s, mask=p_ok, other=0).to(gl.int32)
        gl.thread_barrier()  # every thread's rows stored before the counts are released
        arrived = gl.atomic_add(ctr_ptr + tok * TB + j, gl.full([BM], 1, gl.int32, gl.SliceLayout(1, CL)), mask=p_ok,
                                sem="acq_rel", scope="gpu")
        fin = p_ok & (arrived == need - 1)
        gl.thread_barrier()
        n = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, CL))
        n_ok = n < H
        acc = gl.zeros([BM, BN], gl.float32, CL)
        G: gl.constexpr = 4 if TOPK % 4 == 0 else 1
        for g in range(TOPK // G):
            for s in gl.static_range(G):
                q = tok * TOPK + g * G + s
                vq = gl.load(valid_ptr + q, mask=fin, other=0) != 0
                acc += gl.load(y_ptr + (q * stride_y)[:, None] + n[None, :], mask=(fin & vq)[:, None] & n_ok[None, :],
                               other=0.0, cache_modifier=".cg")  # (from L2: other programs wrote them)
        gl.store(out_ptr + (tok * stride_out)[:, None] + n[None, :], acc.to(gl.bfloat16),
                 mask=fin[:, None] & n_ok[None, :])

    @gluon.jit
    def _frag_moe_one(x_ptr, stride_x, pairs_ptr, slot_ptr, nblocks_ptr, valid_ptr, rw_ptr,
                      w1_ptr, stride_w1, s1_ptr, stride_s1, b1_ptr, stride_b1,
                      w2_ptr, stride_w2, s2_ptr, stride_s2, b2_ptr, stride_b2,
                      h_ptr, stride_h, y_ptr, stride_y, out_ptr, stride_out, cnt_ptr, T, P, MB, alpha, limit,
                      H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ROW_MUL: gl.constexpr, UP_OFF: gl.constexpr, BM: gl.constexpr,
                      NT1: gl.constexpr, KQS1: gl.constexpr, PF1: gl.constexpr,
                      NT2: gl.constexpr, KQS2: gl.constexpr, PF2: gl.constexpr, W: gl.constexpr, ST1: gl.constexpr = 0,
                      ST2: gl.constexpr = 0, XR1: gl.constexpr = 0, XR2: gl.constexpr = 0):
        """`fragment_moe`'s gate/up, down and combine in one launch over `align`'s routing blocks: a program a tile,
        each taking a work ticket.

        Tickets (cnt[0], in the order programs start): [0, nA) are gate/up tiles (block-major, TA a block), [nA, nA + nB)
        down tiles (TB a block), the rest have nothing to do. A gate/up tile stores its h rows and counts itself in
        cnt[2 + block]; a down tile waits for its block's TA, runs, stores its pairs' rows of y, and the last arrival of
        each token sums it (cnt[2 + MB + token * TB + tile]). Every gate/up ticket is taken before any down ticket, by a
        program that has started, so a waiting program only waits for programs that run: no deadlock whatever the grid
        and the SMs' occupancy. Each tile is `_frag_gemm`'s program of the same FragTile (the same MMAs in the same
        order, the same roundings), so every output bit equals the four-launch call's. The last program to finish
        (cnt[1]) zeroes the counters for the next launch; program 0 zeroes the rows of tokens with no kept pair.
        One tile a program, not a loop over tickets: a loop kept both roles' invariants live (ptxas -v, an earlier form
        of this kernel on Qwen3's shapes: 128 registers with the loop, 93 without; now 88, a GEMM alone 80). (Grouping
        the pairs in every program instead of `align` cost ~5 us a call on the H200:
        benchmarks/results/stop40_gpu/one_launch_probe_call5.txt.)"""
        WL: gl.constexpr = _layout("w", W)
        MMA: gl.constexpr = _layout("mma", W)
        XL: gl.constexpr = _layout("x", W)
        TWO1: gl.constexpr = ACT != 2  # gate and up tiles (up-only experts, ACT 2: up tiles alone)
        TPP1: gl.constexpr = NT1 // 2 if TWO1 else NT1
        TA: gl.constexpr = (I // 16 + TPP1 - 1) // TPP1
        TB: gl.constexpr = (H // 16 + NT2 - 1) // NT2
        Q1: gl.constexpr = H // 64
        Q2: gl.constexpr = I // 64
        t = gl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")  # this program's ticket
        nblocks = gl.load(nblocks_ptr)
        na = nblocks * TA
        if t < na + nblocks * TB:
            down = t >= na
            u = gl.where(down, t - na, t)
            per = gl.where(down, TB, TA)
            b = u // per
            j = u % per
            slot = gl.load(slot_ptr + b)
            mx = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
            pair_x = gl.load(pairs_ptr + b * BM + mx)
            xok = pair_x < P
            mr = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
            pair_r = gl.load(pairs_ptr + b * BM + mr)
            p_ok = pair_r < P
            rows = (b * BM + mr).to(gl.int64)
            if down:
                ready = gl.atomic_add(cnt_ptr + 2 + b, 0, sem="acquire", scope="gpu")
                while ready < TA:  # the block's gate/up tiles (taken before this ticket, so running or done)
                    ready = gl.atomic_add(cnt_ptr + 2 + b, 0, sem="acquire", scope="gpu")
                gl.thread_barrier()
                xr2 = h_ptr + (b * BM + mx).to(gl.int64) * stride_h
                w_rows2, s_rows2, n_ok2 = _weight_tiles(w2_ptr, stride_w2, s2_ptr, stride_s2, slot, j, H, Q2, NT2, False,
                                                        NT2, WL)
                acc2 = _tile_sums(xr2, xok, w_rows2, s_rows2, n_ok2, 0, Q2 // KQS2 * KQS2, True, NT2 * 16, BM, NT2, KQS2,
                                  Q2, PF2, W, True, ST2, XR2)
                _epilogue(acc2, y_ptr, stride_y, b2_ptr, stride_b2, rw_ptr, slot, pair_r, p_ok, rows, alpha, limit, j, H,
                          2, ACT, HAS_BIAS, ROW_MUL, UP_OFF, NT2 * 16, BM, NT2, W, MMA)
                _combine_tile(y_ptr, stride_y, out_ptr, stride_out, valid_ptr, cnt_ptr + 2 + MB, pair_r, p_ok, j, P, TOPK,
                              H, TB, NT2 * 16, BM, W)
            else:
                xr1 = x_ptr + gl.where(xok, pair_x // TOPK, 0).to(gl.int64) * stride_x
                w_rows1, s_rows1, n_ok1 = _weight_tiles(w1_ptr, stride_w1, s1_ptr, stride_s1, slot, j, I, Q1, NT1, TWO1,
                                                        TPP1, WL)
                acc1 = _tile_sums(xr1, xok, w_rows1, s_rows1, n_ok1, 0, Q1 // KQS1 * KQS1, True, NT1 * 16, BM, NT1, KQS1,
                                  Q1, PF1, W, False, ST1, XR1)
                _epilogue(acc1, h_ptr, stride_h, b1_ptr, stride_b1, rw_ptr, slot, pair_r, p_ok, rows, alpha, limit, j, I,
                          1, ACT, HAS_BIAS, ROW_MUL, UP_OFF, NT1 * 16, BM, TPP1, W, MMA)
                gl.thread_barrier()  # every thread's h rows stored before the tile counts itself done
                gl.atomic_add(cnt_ptr + 2 + b, 1, sem="release", scope="gpu")
        ZL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        if gl.program_id(0) == 0:  # the rows of tokens with no kept pair (padding rows of a bucketed call): zeros
            KP: gl.constexpr = 16 if TOPK <= 16 else TOPK
            for t0 in range(0, T, 16):
                tk = t0 + gl.arange(0, 16, layout=gl.SliceLayout(1, ZL))
                kk = gl.arange(0, KP, layout=gl.SliceLayout(0, ZL))
                kept = gl.load(valid_ptr + tk[:, None] * TOPK + kk[None, :], mask=(tk < T)[:, None] & (kk < TOPK)[None, :],
                               other=0).to(gl.int32)
                none = (tk < T) & (_reduce_add(kept, 1) == 0)
                for c0 in range(0, H, 128):
                    cols = c0 + gl.arange(0, 128, layout=gl.SliceLayout(0, ZL))
                    gl.store(out_ptr + tk.to(gl.int64)[:, None] * stride_out + cols[None, :],
                             gl.zeros([16, 128], gl.bfloat16, ZL), mask=none[:, None] & (cols < H)[None, :])
        gl.thread_barrier()
        done = gl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == gl.num_programs(0) - 1:  # every other program has finished: the counters back to zero
            used = 2 + MB + T * TB
            for c0 in range(0, used, 128):
                ci = c0 + gl.arange(0, 128, layout=gl.SliceLayout(0, ZL))
                gl.store(cnt_ptr + ci, gl.zeros([128], gl.int32, gl.SliceLayout(0, ZL)), mask=ci < used)


class FragTile(typing.NamedTuple):
    """One fragment GEMM's tiling: `nt` 16-row weight tiles a program (a multiple of `warps`; gate/up: half gate tiles,
    half up tiles, so even), `kqs` 64-column quads a K step (a power of two), `prefetch` (each step's loads issued
    before the previous step's decode and MMAs; 2: two steps before), `split` (K's whole steps cut into that many
    ranges, one program each, their float32 partial sums added in range order by the tile's last program), `stages`
    (0: loads into registers as `prefetch` says; S >= 2: a ring of S K steps in shared memory filled by asynchronous
    copies (cp.async), S - 1 steps in flight while one is computed: the weights and scale words, and with `xring` the
    activation tiles too (else those a step ahead in registers); `prefetch` then unused). Written "NTxKQSwW" + "p" or
    "pp" (prefetch 1 or 2) or "aS" (S stages) or "aaS" (S stages, activations in the ring) + "sS" (split S), e.g.
    "8x4w4p", "4x8w4pps2", "4x4w4a4" or "8x2w4aa3s2"."""

    nt: int = 4
    kqs: int = 4
    warps: int = 4
    prefetch: int = 0
    split: int = 1
    stages: int = 0
    xring: int = 0

    @classmethod
    def parse(cls, text: str) -> "FragTile":
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)(?:(p{1,2})|(a{1,2})(\d+))?(?:s(\d+))?", text.strip())
        if m is None or (m[6] is not None and int(m[6]) < 2):
            raise ValueError(f"{text!r}: a fragment tile is NTxKQSwW with an optional p / pp (prefetch) or aS / aaS "
                             "(S >= 2 stages of asynchronous copies; aa: the activations too), and sS (split S)")
        return cls(int(m[1]), int(m[2]), int(m[3]), len(m[4] or ""), int(m[7] or 1), int(m[6] or 0),
                   int(len(m[5] or "") == 2))

    def __str__(self) -> str:
        pf = f"{'aa' if self.xring else 'a'}{self.stages}" if self.stages else "p" * int(self.prefetch)
        return f"{self.nt}x{self.kqs}w{self.warps}{pf}{f's{self.split}' if self.split > 1 else ''}"


def split_plan(quads: int, kqs: int, split: int) -> tuple[int, int]:
    """(ranges, whole KQS-quad steps a range) for K of `quads` quads: at most `split` ranges, every one non-empty (the
    quads past the last whole step go with the last range). From the static shape only."""
    steps = quads // kqs
    if split <= 1 or steps <= 1:
        return 1, max(steps, 1)
    per = triton_cdiv(steps, min(split, steps))
    return triton_cdiv(steps, per), per


def _check_async(tile: FragTile, *operands: torch.Tensor) -> None:
    """The asynchronous copies of a staged tile (`FragTile.stages`) move 16 bytes at a time: the activation rows and
    every slot's weight words must start 16-byte aligned (true of torch's allocations and of the expert arenas'
    slices; a view that is not is refused rather than faulting)."""
    for t in operands:
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"tile {tile} copies 16-byte pieces: a {tuple(t.shape)} operand starts or steps "
                             f"{t.data_ptr() % 16} / {(t.stride(0) * t.element_size()) % 16} bytes off 16")


class DirectPairs(typing.NamedTuple):
    """A small call's pairs as the GEMMs take them without a routing launch (`_frag_gemm`'s DIRECT): block b is led by
    pair b (its expert's pairs grouped in each program; the block empty unless b is its expert's 0th, 16th, ... pair).
    ids: the top-k ids [P] (flat); slot_of_expert / n_valid as `moe.align` takes them (None: identity / every token);
    pair_valid: bool [P], written by the gate/up launch (the combine's keep flags)."""

    ids: torch.Tensor
    slot_of_expert: torch.Tensor | None
    n_valid: torch.Tensor | None
    pair_valid: torch.Tensor
    num_experts: int
    num_pairs: int
    group: bool = False  # each program groups the pairs by expert (`direct_group`); False: each pair its own block


def grouped_routing(tab: torch.Tensor, r: DirectPairs) -> Routing:
    """The routing a grouped routing-free gate/up launch wrote into `tab` (P blocks of 16 rows, block b led by pair b;
    a block that leads none has slot -1): the down launch runs on it as on `align`'s, without grouping again."""
    p = r.num_pairs
    return Routing(tab[: p * 16], tab[p * 16 : p * 17], tab[p * 17 :], r.pair_valid, p, p)


def _launch(x, r: Routing | DirectPairs, words, swords, out, n: int, topk: int, epi: int, tile: FragTile,
            phase: int = 0, bias=None, act: int = 0, row_mul: int = 1, up_off: int = 0, rw=None, alpha: float = 1.702,
            limit: float = 7.0, persist: bool = False, tab=None):
    """One fragment GEMM launch. `tab` (a grouped routing-free gate/up launch): int32 [P * 16 + P + 1] that launch fills
    with its grouping as a routing's sorted pairs, block slots and block count (`grouped_routing`)."""
    if gluon is None:
        raise RuntimeError("the fragment GEMMs need Triton's Gluon (triton >= 3.5)")
    if x.device.type != "cuda":
        raise RuntimeError("the fragment GEMMs run on CUDA only; frag_gemm_reference / the moe reference are their CPU form")
    quads = words.shape[2]
    k = quads * QUAD
    if x.shape[1] != k or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"activations must be bf16 [rows, {k}] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    if words.dtype != torch.int32 or swords.dtype != torch.int32 or words.stride(-1) != 1:
        raise ValueError("words/swords must be to_fragment_words' int32 tensors")
    nt, kqs, num_warps, prefetch, split, stages, xring = tile
    two = epi == 1 and act != ACT_RELU2  # (gate and up tiles a program)
    if nt % num_warps or kqs & (kqs - 1) or (two and nt % 2):
        raise ValueError(f"tile {tile}: nt must be a multiple of the warps (and even for gate/up), kqs a power of two")
    if stages:
        _check_async(tile, x, words)
    direct = isinstance(r, DirectPairs)
    if direct:
        bm, mb = 16, r.num_pairs
        if phase or split_plan(quads, kqs, split)[0] > 1:
            raise ValueError(f"a call without the routing launch takes neither copy groups nor a K split (tile {tile})")
        args = (r.ids, r.slot_of_expert if r.slot_of_expert is not None else r.ids,
                r.n_valid if r.n_valid is not None else r.ids, r.pair_valid)
        if tab is not None and (epi != 1 or not r.group or tab.numel() != r.num_pairs * 17 + 1):
            raise ValueError("a routing table comes from a grouped routing-free gate/up launch, [P * 17 + 1] int32")
        dp = max(16, triton_next_pow2(r.num_pairs)) if r.group else 16  # (read only when grouping: one variant else)
        dkw = dict(DIRECT=1, E=r.num_experts, DP=dp, GROUP=int(r.group),
                   TAB=int(tab is not None),
                   HAS_SLOT=int(r.slot_of_expert is not None),
                   HAS_NVALID=int(r.n_valid is not None))
    else:
        bm, mb = r.sorted_pairs.numel() // r.max_blocks, r.max_blocks
        if phase and r.block_phase is None:
            raise ValueError(f"phase {phase}: a routing made with phase_of_expert")
        args = (r.sorted_pairs, r.block_slot, r.num_blocks, r.block_phase if phase else r.block_slot)
        dkw = {}
    per_program = nt // 2 if two else nt
    grid = (mb, triton_cdiv(n // 16, per_program))
    split, ss = split_plan(quads, kqs, split)
    ws, cnt, rows = x, args[1], 0  # (not read with one range)
    if split > 1:
        from pdflash_kernels import linear

        rows = mb * bm
        ws = torch.empty((split, rows, words.shape[1] * 16), dtype=torch.float32, device=x.device)
        tiles = grid[0] * grid[1]
        cnt = linear._counters(x.device, tiles)
        if cnt is None:  # more tiles than a counter region (or none made yet in a capture): zeroed counters of its own
            cnt = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        grid = (*grid, split)
    walk = persist_grid(grid[0] * grid[1] * split) if persist else 0
    if walk:
        grid = (walk,)
    b = bias if bias is not None else x
    _frag_gemm[grid](x, x.stride(0), out, out.stride(0), *args, words, words.stride(0), swords, swords.stride(0),
                     b, b.stride(0), rw if rw is not None else x, ws, cnt, rows, r.num_pairs, float(alpha), float(limit),
                     tab if tab is not None else args[1],
                     N=n, K=k, TOPK=topk, EPI=epi, ACT=act, HAS_BIAS=bias is not None, ROW_MUL=row_mul, UP_OFF=up_off,
                     PHASE=phase, BM=bm, NT=nt, KQS=kqs, W=num_warps, PREFETCH=int(prefetch), SPLIT=split, SS=ss,
                     PDL=PDL_MODE, STAGES=stages, XRING=xring, PERSIST=int(walk > 0), num_warps=num_warps, **dkw,
                     **({"launch_pdl": True} if PDL_MODE else {}))
    return out


def frag_gemm(x: torch.Tensor, r: Routing, words: torch.Tensor, swords: torch.Tensor, topk: int,
              rows_from_pairs: bool = True, y: torch.Tensor | None = None, tile: FragTile | str = FragTile()
              ) -> torch.Tensor:
    """y [max_blocks * BM, N] float32 (rows of unused block slots untouched) = `frag_gemm_reference` on CUDA: the GEMM
    core alone (no activation, no routing weight). words/swords: `to_fragment_words` of the slots' weights
    ([S, N/16, K/64, 8, 4, 4], [S, N/16, K/64, 8]). `rows_from_pairs` False: x's rows are the block rows (the down
    GEMM's input). `tile`: a `FragTile`. Every tile sums K in the same order for every row (one quad after another,
    each MMA's 16 columns in the hardware's fixed order; a split adds its ranges' partial sums in range order), and no
    choice depends on the routing: a row's bits do not depend on the other rows of the call."""
    tile = FragTile.parse(tile) if isinstance(tile, str) else tile
    n = words.shape[1] * 16
    bm = r.sorted_pairs.numel() // r.max_blocks
    if y is None:
        y = torch.zeros((r.max_blocks * bm, n), dtype=torch.float32, device=x.device)
    if not rows_from_pairs and x.shape[0] < r.max_blocks * bm:
        raise ValueError(f"block-row activations need {r.max_blocks * bm} rows, got {x.shape[0]}")
    return _launch(x, r, words, swords, y, n, topk, 0 if rows_from_pairs else 3, tile)


# ---- the MoE call on fragment words ----------------------------------------------------------------------------------
# (gate/up tile, down tile) of a layer, by its (hidden, expert width): the best summed time over 1/4/16 tokens per
# expert and 8-128 experts on the H200 (benchmarks/fragment_bench.py --fused-sweep,
# benchmarks/results/fragment_fused_sweep_h200.json).
# Stop 42 (benchmarks/results/stop42_gpu/call2, each GEMM launch alone): the staged tiles (weights and activations in a
# cp.async ring) won on every shape. Qwen3-30B-A3B 4x4w4 / 8x2w4aa3 and Mixtral-8x7B 8x2w4aa3 / 4x4w4aa3 are the sweep's
# winners (Mixtral's down GEMM no longer splits K: 83-86 us against 88-95 for 4x4w4s4). gpt-oss-20b's gate/up winner,
# 8x2w4aa4 (92.6-95.8 us at 32 experts), lost at 8 experts (38.2-38.7 us against 33.0-33.9 for the stop-36 8x2w4p),
# so gpt-oss takes 4x2w4aa4, faster than 8x2w4p in every case measured (31.9-32.6 against 33.0-33.9 us at 8 experts,
# 99.5-100.2 against 104.3-106.4 at 32); its down GEMM 4x4w4aa3 (20.8-21.1 against 21.1-23.1 us for the stop-36 4x4w4p
# at 8 experts, 50.4-52.4 against 56.7-61.4 at 32; each launch alone, fragment_fused_sweep_h200.json).
# Stop 36: gpt-oss-20b 8x2w4p / 4x4w4p, Qwen3-30B-A3B 4x4w4 / 4x4w4, Mixtral-8x7B 4x4w4 / 4x4w4s4.
FRAG_SHAPES: dict[tuple[int, int], tuple[FragTile, FragTile]] = {
    (2880, 2880): (FragTile.parse("4x2w4aa4"), FragTile.parse("4x4w4aa3")),
    (2048, 768): (FragTile.parse("4x4w4"), FragTile.parse("8x2w4aa3")),
    (4096, 14336): (FragTile.parse("8x2w4aa3"), FragTile.parse("4x4w4aa3")),
}
FRAG_DEFAULT = (FragTile(4, 4, 4), FragTile(4, 4, 4))
# Tiles by call size (PDFLASH_FP4_SIZE_TILES=1): the best tile follows the number of active experts, and in a verify
# forward those grow with the (token, expert) pairs of the call (expected under uniform random top-k, E (1 - (1 - k/E)^T):
# gpt-oss-20b 4 / 7.5 / 13.4 / 28 experts at 1 / 2 / 4 / 16 tokens, Qwen3-30B-A3B 8 / 15.5 / 30 / 81). From the stop-42 fused sweep (each launch alone,
# `stop42_gpu/call2/fragment_fused_sweep_h200.json`) and probe (as a forward pays it, `stop42_gpu/call1`):
# - gpt-oss-20b, 8 experts: gate/up 4x2w4aa4 31.9-32.6 us against 8x2w4aa3's 37.6-38.2; down 4x4w4aa4 17.3-18.7
#   against 4x4w4aa3's 20.8-21.1. 32 experts: gate/up 8x2w4aa3 91.2-93.6 against 4x2w4aa4's 99.5-100.2.
# - Qwen3-30B-A3B, 8 experts x 1 token: gate/up 4x4w4aa3 10.0 us in a forward against 4x4w4's 13.3. 32 experts: 4x4w4 /
#   4x4w4 within 1 us of the best. 128 experts: 8x2w4aa3 / 8x2w4aa3 71.1-72.1 / 38.9-42.1 against 4x4w4's
#   77.2-80.0 / 42.0-46.0.
# - Mixtral-8x7B: the same tiles won at every size (FRAG_SHAPES alone).
# A class is (most pairs, or None for every larger call; gate/up tile, down tile), ascending. A row's bits stay the same
# whichever class its call falls in only if every unsplit tile adds a row's K products in the same order (one 16-column
# MMA after another, `_k_range`), whatever its rows a program, quads a step, warps or staging:
# `tests/test_fragments.py::test_unsplit_tiles_give_the_same_bits` checks that on a GPU: it passed on the H200 (stop 44,
# gpt-oss-20b and Qwen3-30B-A3B) and the H100 (stop 45, those and a small shape). The import check below refuses a
# class with a K split, or thresholds out of order. On by default since stop 45: `fragment_bench.py --routed
# 1,2,4,6,8,16,32 --in-forward 8 --size-ab` on the H100 (benchmarks/results/stop45_gpu/call1), in a forward, classes /
# FRAG_SHAPES' alone: Qwen3-30B-A3B 22.9 / 26.0 us (8 experts) to 121.9 / 123.3 (110), faster at every size;
# gpt-oss-20b above 16 pairs 100.5 / 103.3 (18 experts) to 162.7 / 170.2 (31), but at 8 and 16 pairs its small class's
# down tile 4x4w4aa4 lost (56.5 / 54.1, 98.3 / 89.3 us), so gpt-oss's small class is FRAG_SHAPES' pair again. With
# that table on the H200 (stop45_gpu/call4): Qwen3 18.7 / 21.0 us (8 experts) to 100.9 / 106.2 (106), gpt-oss 102.3 /
# 119.7 (22) and 140.2 / 160.8 (31), equal at 16 pairs and fewer. End to end on the H200 (with DIRECT_PAIRS, call3):
# gpt-oss-24l's forward 1.92-1.98 ms against 2.10-2.15 at block 1, 4.10-4.23 against 4.58-4.70 at replay@16. They
# lose where 128-512 pairs fall on few experts (Qwen3 8 experts x 16 tokens: 44.3 against 36.8 us in stop 36's
# kernels table), a shape uniform random routing of a verify's tokens rarely makes (trained models route with skew;
# how concentrated their verify calls are is not measured).
FRAG_BY_SIZE: dict[tuple[int, int], tuple[tuple[int | None, FragTile, FragTile], ...]] = {
    (2880, 2880): ((16, FragTile.parse("4x2w4aa4"), FragTile.parse("4x4w4aa3")),
                   (None, FragTile.parse("8x2w4aa3"), FragTile.parse("4x4w4aa3"))),
    (2048, 768): ((16, FragTile.parse("4x4w4aa3"), FragTile.parse("4x4w4")),
                  (48, FragTile.parse("4x4w4"), FragTile.parse("4x4w4")),
                  (None, FragTile.parse("8x2w4aa3"), FragTile.parse("8x2w4aa3"))),
}
SIZE_TILES = runtime.env_flag("PDFLASH_FP4_SIZE_TILES", default=True)


# Calls of at most DIRECT_PAIRS pairs skip the routing launch (`moe.align_fused`, 2-7 us: 2.1 us for gpt-oss-20b's
# 4-32 pairs, 3.3-6.8 us for Qwen3-30B-A3B's 8-128, H100, `benchmarks/moe_call_breakdown.py`): each pair its own block
# (`DirectPairs`, `fragment_moe`'s `direct`), so three launches (gate/up, down, combine) instead of four. The same
# products in the same order, so the same bits (`tests/test_fragments.py::test_direct_pairs_give_the_routed_bits`,
# passed on the H100 at stop 45 for gpt-oss-20b, Qwen3-30B-A3B and a small shape). As a forward pays it (H100, stop 45,
# benchmarks/results/stop45_gpu/call2/moe_call_breakdown.json), direct / routed four launches: gpt-oss-20b 34.3 / 39.8
# us (4 pairs), 54.9 / 63.2 (8); Qwen3-30B-A3B 23.5 / 27.8 (8); Mixtral-8x7B 270.1 / 289.8 (8 pairs); on the H200
# (call4, the served call with DIRECT_PAIRS 16 / four launches) 30.8 / 38.4, 48.2 / 54.8, 18.9 / 22.7, 228.5 / 235.3: more
# than the routing launch's own time there (2.1-3.4 us; why is not measured). PDFLASH_FP4_DIRECT_PAIRS=N (0: off, at
# most DIRECT_MOST).
# Stop 52: each pair was its own block, so an expert's weights were read once a pair: on an H100 (stop52_gpu/call1,
# `persist_ab.py`, served / DIRECT_PAIRS 32) Qwen3-30B-A3B's 32-pair calls ran 26.6 / 33.3 us on 8 experts x 4 tokens,
# but 44.7 / 39.8 on 32 x 1 and 43.2 / 38.6 on a 4-token verify's 29 experts; gpt-oss-20b 8 x 4 63.4 / 131.6. With
# DIRECT_GROUP each program groups the pairs itself (`_same_expert` / `_group_rows`: one load of the <= 128 ids), so a block holds an
# expert's pairs as a routed block does and an expert's weights are read once for its pairs.
DIRECT_MOST = 128
# The grouping above: its bits test passed on the H100 at stop 52 (`test_direct_pairs_give_the_routed_bits`, both
# forms, persistent too), but the A/B was mixed, so it stayed opt-in (H100, stop52_gpu/call2 against call1,
# `persist_ab.py`, us, served / grouped / grouped + PERSIST_DIRECT at the call's pairs): it removed the per-pair reads where pairs share experts (gpt-oss 8 x 4: 63.7 / 61.5 / 60.3, where
# one-pair blocks took 131.6; Qwen3 8 x 16: 32.6 / 38.2 / 26.9; 32 x 4: 54.1 / 49.0 / 46.4) and helped a 16-token
# verify's 128 pairs on 81 experts without the persistent grid (99.6 / 95.7 / 101.8), but on calls of 32 pairs on
# ~30 experts every program's grouping cost more than the reads it saved (Qwen3 32 x 1: 46.4 / 48.9, one-pair blocks
# 39.8 in call 1; a 4-token verify: 44.5 / 45.7, one-pair blocks 38.6) and gpt-oss's 128-pair calls lost 2-6%.
# Stop 54 (branch group-once merged): the grouped gate/up launch writes its grouping as a routing's tables
# (`grouped_routing`) and the down launch runs routed on them, so only one launch groups. Its bits tests passed on an
# H100 (`test_direct_pairs_give_the_routed_bits`, 3 models; `test_grouped_direct_blocks_hold_an_experts_pairs`), and
# on Qwen3-30B-A3B's shape it beat the served call (one-pair blocks up to 16 pairs, routed above) on every row of more
# than 16 pairs measured, with the persistent grid (H100, stop54_gpu/call1, `persist_ab.py`, served / grouped on the
# persistent grid, us): 8 experts x 4 / 16 tokens 26.4 / 25.6 and 32.5 / 26.6; 32 x 1 / 4 46.2 / 42.5 and 54.7 /
# 48.5; 128 x 1 139.3 / 133.1; a verify's spread routing at 4 / 8 / 16 tokens (29 / 50 / 81 experts) 44.7 / 41.0,
# 68.8 / 64.2, 98.4 / 96.4. At 16 pairs and fewer the one-pair blocks stayed faster (8 x 1: 16.2 / 17.1). gpt-oss-20b
# was mixed (8 x 4: 63.6 / 60.8, a 16-token verify's 64 pairs: 162.3 / 190.8 on the grid, 159.1 off it; 32 x 4: 175.2
# / 179.5), so it keeps the served form. Hence DIRECT_SHAPES: by the CUDA device's name, then (hidden, expert width),
# the most pairs a call skips the routing launch with; there a call of more than DIRECT_BASE pairs groups its pairs
# on the persistent grid (`direct_group`, `uses_persist`). Elsewhere: calls of up to DIRECT_BASE pairs, one-pair blocks.
# On the H200 (stop54_gpu/call2, the same A/B, served / grouped on the grid, us) likewise on Qwen3's shape: 8 x 4 / 16
# 26.8 / 25.9 and 32.8 / 27.0; 32 x 1 / 4 43.8 / 40.3 and 53.2 / 46.7; 128 x 1 127.1 / 117.2; a verify's 4 / 8 / 16
# tokens 43.1 / 39.2, 61.2 / 55.8, 89.6 / 86.3; at 16 pairs and fewer slower (8 x 1 16.4 / 17.4). gpt-oss-20b lost on
# the H200 where its served call is the one launch (a verify's 8 / 16 tokens: 88.1 / 100.6, 133.0 / 174.6).
DIRECT_BASE = 16
# Up-only experts of Nemotron 3 Nano's shape (2688 x 1856, top-6; stop 64, H100, `persist_ab.py --models nemotron-3-nano`,
# stop64_gpu/call2, served one program a tile / grouped routing-free on the persistent grid, us): 8 experts x 4 tokens
# (30 pairs) 47.1 / 38.7, 32 x 1 (30) 81.5 / 76.0, a 4-token verify's 24 pairs on 23 experts 71.3 / 66.7, but an 8- or
# 16-token verify's 48 / 96 pairs on 41 / 71 experts 100.6 / 109.0 and 160.3 / 174.8 (and 128 x 1 261.0 / 275.4): up to
# 32 pairs there. Not measured on the H200.
DIRECT_SHAPES: dict[str, dict[tuple[int, int], int]] = {"NVIDIA H100 80GB HBM3": {(2048, 768): 128, (2688, 1856): 32},
                                                        "NVIDIA H200": {(2048, 768): 128}}


def _direct_shapes(device: str | None) -> dict[tuple[int, int], int]:
    """DIRECT_SHAPES' entry for a device (a name as `device_name` gives it; None: the current one)."""
    return DIRECT_SHAPES.get(device_name() if device is None else device, {})


def _env_choice(name: str) -> bool | None:
    """An on/off override from the environment: "1" / "0", None unset or empty (the per-shape choice)."""
    return runtime.env_flag(name) if os.environ.get(name) else None


# PDFLASH_FP4_DIRECT_GROUP=1 / 0: every routing-free call groups / none does (unset: `direct_group`'s table).
DIRECT_GROUP: bool | None = _env_choice("PDFLASH_FP4_DIRECT_GROUP")
_DIRECT = os.environ.get("PDFLASH_FP4_DIRECT_PAIRS") or None
if _DIRECT is not None and not (_DIRECT.isdigit() and int(_DIRECT) <= DIRECT_MOST):
    raise ValueError(f"PDFLASH_FP4_DIRECT_PAIRS must be a number of pairs from 0 (off) to {DIRECT_MOST}, got {_DIRECT!r}")
DIRECT_PAIRS: int | None = int(_DIRECT) if _DIRECT is not None else None  # None: DIRECT_SHAPES, else DIRECT_BASE


def direct_pairs(hidden: int, inter: int, device: str | None = None) -> int:
    """The most (token, expert) pairs a call on experts of this shape takes without the routing launch, on this device
    (a name as `device_name` gives it; None: the current one)."""
    if DIRECT_PAIRS is not None:
        return DIRECT_PAIRS
    return _direct_shapes(device).get((hidden, inter), DIRECT_BASE)


def direct_group(pairs: int, hidden: int, inter: int, device: str | None = None) -> bool:
    """Whether a routing-free call of `pairs` pairs groups them by expert (one block an expert's 16 pairs, the
    grouping written once by the gate/up launch) rather than giving each pair its own block."""
    if DIRECT_GROUP is not None:
        return DIRECT_GROUP
    return pairs > DIRECT_BASE and (hidden, inter) in _direct_shapes(device)

# Persistent GEMMs (PDFLASH_FP4_PERSIST=N programs a multiprocessor, 0: off, at most 16; default 8): a routed call of at
# most `persist_pairs` (token, expert) pairs on its expert shape launches each fragment GEMM as at most N programs a
# multiprocessor, each walking the live tiles (`_frag_gemm`'s PERSIST), where one program a tile would launch more. Why:
# a routed call's grid is its worst case, (min(P, E) + P / 16) blocks x weight tiles, so a call of P pairs on few
# experts launches mostly programs that find their block unused and exit (Qwen3-30B-A3B, 128 pairs on 8 experts: 136 x
# 24 gate/up programs for 8 x 24 live tiles); that call's gate/up and down GEMMs took 23.6 / 11.4 us against 10.2 / 6.2
# for the same 8 experts at one token each (H200, stop 50, benchmarks/moe_call_breakdown.py). Measured on an H100 (stop
# 50, `benchmarks/persist_ab.py`, benchmarks/results/persist_ab_h100.md; the served call, one program a tile / 8 a
# multiprocessor): Qwen3-30B-A3B 8 experts x 4 / 16 tokens 29.1 / 26.6 and 43.3 / 32.5 us, 32 x 4 59.0 / 54.1;
# gpt-oss-20b 8 x 4 / 16 69.9 / 63.5 and 72.9 / 66.5, 32 x 16 179.8 / 174.3; the rest up to 512 pairs
# faster by up to 4.9 us or at most 1.4 us slower (gpt-oss 8 x 64: 145.4 / 146.8).
# Larger calls lost (2048 pairs: Qwen3 32 x 64 133.8 / 141.0, gpt-oss 32 x 64 542.6 / 581.2: a walk over mostly live
# tiles schedules worse than the hardware does), and so did Mixtral-8x7B's calls in issue 12's table (8 experts x 1 / 4
# tokens 330.3 / 294.4 us against stop 49's 313.8 / 278.3, where nearly every block slot is live and a tile is long),
# hence bounds by shape: PERSIST_SHAPES (the shapes measured faster), other shapes none; PDFLASH_FP4_PERSIST_PAIRS=N
# bounds every shape at N pairs instead. Fewer programs helped the fewest experts more (Qwen3 8 x 16: 25.9 us at one a
# multiprocessor) but lost at 128 experts (194.2 against 135.9). Calls without the routing launch (DIRECT_PAIRS: every
# block live) keep one program a tile (8 pairs: 16.3 / 16.6 and 52.1 / 52.0 us). The same tile programs, so the same bits
# (tests/test_fragments.py::test_persistent_programs_give_the_same_bits, passed on the H100 at stop 50).
_PERSIST = os.environ.get("PDFLASH_FP4_PERSIST") or "8"
if not (_PERSIST.isdigit() and int(_PERSIST) <= 16):
    raise ValueError(f"PDFLASH_FP4_PERSIST must be a number of programs a multiprocessor from 0 (off) to 16, got {_PERSIST!r}")
PERSIST_PER_SM = int(_PERSIST)
PERSIST_SHAPES: dict[tuple[int, int], int] = {(2048, 768): 512, (2880, 2880): 512}  # (hidden, expert width): most pairs
_PERSIST_PAIRS = os.environ.get("PDFLASH_FP4_PERSIST_PAIRS") or None
if _PERSIST_PAIRS is not None and not _PERSIST_PAIRS.isdigit():
    raise ValueError(f"PDFLASH_FP4_PERSIST_PAIRS must be a number of (token, expert) pairs, got {_PERSIST_PAIRS!r}")
PERSIST_PAIRS: int | None = int(_PERSIST_PAIRS) if _PERSIST_PAIRS is not None else None  # None: PERSIST_SHAPES


def persist_grid(programs: int) -> int:
    """The persistent grid for a GEMM launch of `programs` programs of one tile each (0: launch those, one a tile): at
    most PERSIST_PER_SM programs a multiprocessor, only where one a tile would launch more."""
    most = PERSIST_PER_SM * runtime.sm_count()
    return most if PERSIST_PER_SM and programs > most else 0


# A routing-free call's grid is P blocks, of which (with the grouping, stop 52) only one an expert's 16 pairs is live:
# PDFLASH_FP4_PERSIST_DIRECT=1 walks those calls' tiles with the persistent grid too (as routed calls of up to
# `persist_pairs`); at stop 52 (each GEMM launch grouping) it won where 128 pairs share few experts (Qwen3 8 x 16 26.9
# against 32.6 us served) and lost on a verify's spread ones (101.8 against 99.6; H100, stop 52, persist_ab.py's dNq
# columns).
# Unset: a routing-free call takes the grid where it groups its pairs (`direct_group`; stop 54).
PERSIST_DIRECT: bool | None = _env_choice("PDFLASH_FP4_PERSIST_DIRECT")


def uses_persist(tokens: int, topk: int, hidden: int, inter: int, direct: bool) -> bool:
    """Whether `fragment_moe` asks for persistent GEMMs for this call: a routed call of at most `persist_pairs` pairs,
    or a routing-free one where PERSIST_DIRECT says so (unset: where it groups its pairs, `direct_group`). `_launch`
    then walks where `persist_grid` says."""
    if direct:
        return PERSIST_DIRECT if PERSIST_DIRECT is not None else direct_group(tokens * topk, hidden, inter)
    return tokens * topk <= persist_pairs(hidden, inter)


def persist_pairs(hidden: int, inter: int) -> int:
    """The most (token, expert) pairs a routed call on experts of this shape takes with persistent GEMMs (0: none)."""
    if PERSIST_PAIRS is not None:
        return PERSIST_PAIRS
    return PERSIST_SHAPES.get((hidden, inter), 0)


def _check_by_size(shapes: dict, by_size: dict) -> None:
    """Every class of a shape must give the other classes' bits (and FRAG_SHAPES' for it): all unsplit (a K split adds
    partial sums in another order); the classes' most pairs ascending, the last None (every larger call)."""
    for key, classes in by_size.items():
        most = [c[0] for c in classes]
        if not classes or most[-1] is not None or any(m is None or m < 1 for m in most[:-1]) or most[:-1] != sorted(set(most[:-1])):
            raise ValueError(f"FRAG_BY_SIZE {key}: classes' most pairs must ascend and end with None, got {most}")
        for t in (*(t for c in classes for t in c[1:]), *shapes.get(key, FRAG_DEFAULT)):
            if t.split > 1:
                raise ValueError(f"FRAG_BY_SIZE {key}: tile {t} splits K, so a row's bits would change with the call's "
                                 "size; the tiles of every class and their shape's FRAG_SHAPES tiles must all be unsplit")


_check_by_size(FRAG_SHAPES, FRAG_BY_SIZE)


def parse_tiles(text: str) -> tuple[FragTile, FragTile]:
    """"GATE_UP,DOWN" FragTile names (PDFLASH_FP4_TILES) -> the two tiles, checked as `_launch` would check them."""
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) != 2:
        raise ValueError(f"PDFLASH_FP4_TILES is two tile names, gate/up then down (e.g. 8x2w4p,4x4w4p), got {text!r}")
    t1, t2 = (FragTile.parse(p) for p in parts)
    for t, what in ((t1, "gate/up"), (t2, "down")):
        if t.nt % t.warps or t.kqs & (t.kqs - 1) or (what == "gate/up" and t.nt % 2):
            raise ValueError(f"PDFLASH_FP4_TILES: {what} tile {t}: 16-row tiles a program a multiple of the warps (and "
                             "even for gate/up), quads a K step a power of two")
    return t1, t2


# PDFLASH_FP4_TILES="GATE_UP,DOWN": these tiles on every expert shape and call size instead of FRAG_SHAPES / FRAG_BY_SIZE
# (for trying a tile end to end: benchmarks/e2e_gpu.py under it). Fixed for the process, so still batch-invariant.
_TILES = os.environ.get("PDFLASH_FP4_TILES") or None
FRAG_TILES: tuple[FragTile, FragTile] | None = parse_tiles(_TILES) if _TILES else None


def frag_config(hidden: int, inter: int, pairs: int | None = None) -> tuple[FragTile, FragTile]:
    """(gate/up tile, down tile) for a call of `pairs` (token, expert) pairs on experts of this shape (None: a big
    call's). The row bits are the same whichever this picks (`FRAG_BY_SIZE`)."""
    if FRAG_TILES:
        return FRAG_TILES
    for most, t1, t2 in size_classes(hidden, inter):
        if most is None or (pairs is not None and pairs <= most):
            return t1, t2
    return FRAG_SHAPES.get((hidden, inter), FRAG_DEFAULT)


def size_classes(hidden: int, inter: int) -> tuple[tuple[int | None, FragTile, FragTile], ...]:
    """The call-size classes served for experts of this shape (empty: one pair of tiles for every call)."""
    return FRAG_BY_SIZE.get((hidden, inter), ()) if SIZE_TILES and not FRAG_TILES else ()


def token_chunk(topk: int, hidden: int, inter: int, t1: FragTile, t2: FragTile) -> int:
    """The most tokens one fragment_moe launch sequence takes: unbounded without a K split; with one, as many as keep
    the split workspaces (ranges x rows x weight rows x 4 bytes, topk rows a token) under moe.SPLIT_WORKSPACE_BYTES
    (PDFLASH_MOE_SPLIT_WORKSPACE_MB), at least 16. From the static shape only."""
    from pdflash_kernels.moe import SPLIT_WORKSPACE_BYTES

    s1 = split_plan(hidden // QUAD, t1.kqs, t1.split)[0]
    s2 = split_plan(inter // QUAD, t2.kqs, t2.split)[0]
    per_token = topk * 4 * max(s1 * 2 * inter if s1 > 1 else 0, s2 * hidden if s2 > 1 else 0)
    return max(16, SPLIT_WORKSPACE_BYTES // per_token) if per_token else 1 << 62


def gate_up_order(inter: int, row_mul: int, up_off: int, gated: bool = True) -> torch.Tensor:
    """w1's rows as the fragment GEMM takes them: the I gate rows, then the I up rows (gpt-oss interleaves them: row_mul
    2, up_off 1), so a program's gate tiles and up tiles are I / 16 tiles apart and its activation needs no exchange.
    Up-only experts (`gated` False): their I up rows as they are."""
    j = torch.arange(inter)
    if not gated:
        return j
    return torch.cat([j * row_mul, j * row_mul + up_off])


def fragments_fit(hidden: int, inter: int, gated: bool = True) -> str | None:
    """Why experts of this shape cannot be held as fragment words (None: they can): both GEMMs' K (hidden, expert
    width) a multiple of 64. Gated experts (gate and up rows, `gate_up_order`) and up-only ones (`gated` False: the up
    rows alone, pdflash_kernels.moe.ACT_RELU2, whose first GEMM's programs hold up tiles only) both fit: `gated` does
    not change the answer since stop 64 (kept for the callers, which say what they hold)."""
    if hidden % QUAD or inter % QUAD:
        return f"hidden ({hidden}) and expert width ({inter}) must be multiples of {QUAD}"
    return None


@dataclasses.dataclass
class FragmentExperts:
    """One layer's MXFP4 experts as fragment words (first dimension = slot): w1 [S, 2I/16, H/64, 8, 4, 4] int32 in
    `gate_up_order`, s1 [S, 2I/16, H/64, 8] (up-only experts, act ACT_RELU2: I/16 for 2I/16, the up rows alone);
    w2 [S, H/16, I/64, 8, 4, 4], s2 [S, H/16, I/64, 8]; biases as pdflash_kernels.moe.ExpertWeights keeps them (b1 in
    w1's original row order, read at j * row_mul (+ up_off)).
    The served form on a GPU (verifier_svc.expert_store's "fragments" format): `pdflash_kernels.moe.moe_forward` runs
    `fragment_moe` on it, `pdflash_kernels.reference.moe_reference` reads it through `to_weights`."""

    w1: torch.Tensor
    s1: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    row_mul: int = 1
    up_off: int = 0
    act: int = 0
    alpha: float = 1.702
    limit: float = 7.0
    big_scales: bool = False  # (never true: scale bytes above 128 are refused; kept for the caches' bookkeeping)
    fragments: typing.ClassVar[bool] = True  # what moe_forward dispatches on
    fp4: typing.ClassVar[bool] = True
    pair_words: typing.ClassVar[bool] = False

    @property
    def up_offset(self) -> int:
        return self.up_off

    @property
    def gated(self) -> bool:
        """Whether w1 holds gate and up rows; False for up-only experts (ACT_RELU2: the up rows alone)."""
        return self.act != ACT_RELU2

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] * (8 if self.gated else 16)

    @property
    def hidden(self) -> int:
        return self.w2.shape[1] * 16

    @classmethod
    def from_weights(cls, w) -> "FragmentExperts":
        """From MXFP4 `pdflash_kernels.moe.ExpertWeights` (nibble order or pair words); refuses scale bytes above 128."""
        if not w.fp4:
            raise ValueError("fragment words hold MXFP4 experts; these are not")
        rows = gate_up_order(w.intermediate, w.row_mul, w.up_offset, w.gated).to(w.w1.device)
        b1 = mxfp4.nibble_blocks(w.w1.contiguous(), w.pair_words)[:, rows]
        s1 = w.s1.contiguous()[:, rows]
        b2 = mxfp4.nibble_blocks(w.w2.contiguous(), w.pair_words)
        s2 = w.s2.contiguous()
        check_scales(s1), check_scales(s2)
        why = fragments_fit(w.hidden, w.intermediate, w.gated)
        if why:
            raise ValueError(f"these experts cannot be held as fragment words: {why}")
        f1, t1 = to_fragment_words(b1, s1)
        f2, t2 = to_fragment_words(b2, s2)
        return cls(f1, t1, f2, t2, w.b1, w.b2, w.row_mul, w.up_offset, w.act, w.alpha, w.limit)

    def to_weights(self):
        """The same experts as nibble-order `ExpertWeights` (rows back in their original order): the reference's input."""
        from pdflash_kernels.moe import ExpertWeights

        b1, s1 = from_fragment_words(self.w1, self.s1)
        b2, s2 = from_fragment_words(self.w2, self.s2)
        rows = gate_up_order(self.intermediate, self.row_mul, self.up_off, self.gated).to(b1.device)
        ob1, os1 = torch.empty_like(b1), torch.empty_like(s1)
        ob1[:, rows], os1[:, rows] = b1, s1
        return ExpertWeights(ob1, b2, os1, s2, self.b1, self.b2, self.row_mul, self.up_off, self.act, self.alpha, self.limit)


def _splits_k(hidden: int, inter: int, t1: FragTile, t2: FragTile) -> bool:
    """Whether either GEMM of these tiles cuts K into ranges (the one launch and the routing-free call take neither)."""
    return split_plan(hidden // QUAD, t1.kqs, t1.split)[0] > 1 or split_plan(inter // QUAD, t2.kqs, t2.split)[0] > 1


def one_launch_refusal(tokens: int, topk: int, hidden: int, inter: int, t1: FragTile, t2: FragTile,
                       gated: bool = True) -> str | None:
    """Why a call of this shape takes the four launches rather than `fragment_moe_one` (None: it can take one).
    `gated` False (up-only experts): their gate/up tiles need not be even."""
    fewest, most = one_launch_range(hidden, inter)
    if tokens * topk == 0:
        return "no pairs"
    if tokens * topk > most:
        return (f"{tokens * topk} pairs (one launch takes at most {most} on experts of {hidden} x {inter}: "
                f"ONE_LAUNCH_SHAPES on {device_name() or 'this device'}, PDFLASH_FP4_ONE_LAUNCH_PAIRS)")
    if tokens * topk < fewest:
        return (f"{tokens * topk} pairs (one launch takes at least {fewest} on experts of {hidden} x {inter}, where "
                "fewer ran faster in four: ONE_LAUNCH_SHAPES)")
    if _splits_k(hidden, inter, t1, t2):
        return f"tiles {t1} / {t2} split K"
    if t1.warps != t2.warps:
        return f"tiles {t1} / {t2} have different warp counts"
    if gated and t1.nt % 2:
        return f"gate/up tile {t1} has an odd number of weight tiles (half gate, half up)"
    return None


def direct_refusal(tokens: int, topk: int, hidden: int, inter: int, t1: FragTile, t2: FragTile) -> str | None:
    """Why a call of this shape takes the routing launch rather than skipping it (`fragment_moe`'s `direct`; None: it
    can skip it)."""
    pairs = tokens * topk
    if pairs == 0:
        return "no pairs"
    most = direct_pairs(hidden, inter)
    if pairs > most:
        return f"{pairs} pairs (calls of at most {most} skip the routing launch: DIRECT_PAIRS, DIRECT_SHAPES)"
    if _splits_k(hidden, inter, t1, t2):
        return f"tiles {t1} / {t2} split K"
    return None


def call_path(tokens: int, topk: int, hidden: int, inter: int, t1: FragTile, t2: FragTile, gated: bool = True) -> str:
    """The launches `fragment_moe` gives a call of this shape on this device without copy groups: "direct" (no routing
    launch: `direct_refusal`), "one" (the routing, then `fragment_moe_one`: `one_launch_refusal`; experts with a bias
    on one GEMM only still take four) or "routed" (the routing and three launches)."""
    if direct_refusal(tokens, topk, hidden, inter, t1, t2) is None:
        return "direct"
    return "one" if one_launch_refusal(tokens, topk, hidden, inter, t1, t2, gated) is None else "routed"


def fragment_moe_one(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, fw: FragmentExperts,
                     num_experts: int, slot_of_expert: torch.Tensor | None = None, n_valid: torch.Tensor | None = None,
                     config: tuple[FragTile, FragTile] | None = None) -> torch.Tensor | None:
    """`fragment_moe` in two launches: the routing (`align_fused`), then `_frag_moe_one` (gate/up, down and combine).
    The same output bits. None where the call cannot take it (`one_launch_refusal`, or no counter region to be had:
    inside the first CUDA-graph capture on a device)."""
    from pdflash_kernels import linear
    from pdflash_kernels import moe as _moe

    if gluon is None or x.device.type != "cuda":
        raise RuntimeError("the one-launch MoE call runs on CUDA with Triton's Gluon; the moe reference is its CPU form")
    t, hdim = x.shape
    topk = topk_ids.shape[1]
    inter = fw.intermediate
    if hdim != fw.hidden:
        raise ValueError(f"x has {hdim} features; these experts take {fw.hidden}")
    t1, t2 = config or frag_config(hdim, inter, t * topk)
    if one_launch_refusal(t, topk, hdim, inter, t1, t2, fw.gated) is not None or (fw.b1 is None) != (fw.b2 is None):
        return None  # (one HAS_BIAS for both GEMMs)
    p = t * topk
    mb = _moe.max_blocks(p, num_experts, 16)
    ta, tb = triton_cdiv(inter // 16, t1.nt // 2 if fw.gated else t1.nt), triton_cdiv(hdim // 16, t2.nt)
    cnt = linear._counters(x.device, 2 + mb + t * tb)
    if cnt is None:
        return None
    x = x.contiguous()
    if t1.stages or t2.stages:
        _check_async(t1 if t1.stages else t2, x, fw.w1, fw.w2)
    r = _moe.align_fused(topk_ids, num_experts, 16, slot_of_expert, n_valid)
    dev = x.device
    h = torch.empty((mb * 16, inter), dtype=torch.bfloat16, device=dev)
    y = torch.empty((p, hdim), dtype=torch.float32, device=dev)
    out = torch.empty((t, hdim), dtype=x.dtype, device=dev)
    rw = topk_weights.reshape(-1).contiguous()
    b1 = fw.b1 if fw.b1 is not None else x
    b2 = fw.b2 if fw.b2 is not None else x
    grid = (mb * (ta + tb),)  # a program a ticket: as many as the most tiles a call of this size can have
    _frag_moe_one[grid](x, x.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, r.pair_valid, rw,
                        fw.w1, fw.w1.stride(0), fw.s1, fw.s1.stride(0), b1, b1.stride(0),
                        fw.w2, fw.w2.stride(0), fw.s2, fw.s2.stride(0), b2, b2.stride(0),
                        h, h.stride(0), y, y.stride(0), out, out.stride(0), cnt, t, p, mb, float(fw.alpha),
                        float(fw.limit), H=hdim, I=inter, TOPK=topk, ACT=fw.act, HAS_BIAS=fw.b1 is not None,
                        ROW_MUL=fw.row_mul, UP_OFF=fw.up_off, BM=16, NT1=t1.nt, KQS1=t1.kqs, PF1=int(t1.prefetch),
                        NT2=t2.nt, KQS2=t2.kqs, PF2=int(t2.prefetch), W=t1.warps, ST1=t1.stages, ST2=t2.stages,
                        XR1=t1.xring, XR2=t2.xring, num_warps=t1.warps)
    return out


def fragment_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, fw: FragmentExperts,
                 num_experts: int, slot_of_expert: torch.Tensor | None = None, n_valid: torch.Tensor | None = None,
                 phase_of_expert: torch.Tensor | None = None, between=None, groups: int = 1,
                 config: tuple[FragTile, FragTile] | None = None, direct: bool | None = None) -> torch.Tensor:
    """pdflash_kernels.moe.moe_forward on fragment words (CUDA): x [T, H] bf16, topk ids/weights [T, k] -> [T, H]. The
    same routing (`align_fused`, blocks of 16 pairs), phases (`phase_of_expert`, `between`, `groups`: copy groups of
    an expert cache computed as they arrive, bit-identical to one phase) and combine (a token's k slots summed in slot
    order); the two GEMMs are `_frag_gemm`'s gate/up (activation fused) and down (routing weight fused). `direct`: no
    routing launch, each pair its own block (`DirectPairs`; the gate/up launch writes the keep flags), the same bits;
    None: where `direct_refusal` allows it (small calls, DIRECT_PAIRS), True / False: always / never (tests, probes)."""
    from pdflash_kernels import moe as _moe

    t, hdim = x.shape
    topk = topk_ids.shape[1]
    inter = fw.intermediate
    if hdim != fw.hidden:
        raise ValueError(f"x has {hdim} features; these experts take {fw.hidden}")
    t1, t2 = config or frag_config(hdim, inter, t * topk)
    if direct is None:
        direct = phase_of_expert is None and call_path(t, topk, hdim, inter, t1, t2, fw.gated) == "direct"
    if not direct and phase_of_expert is None and x.device.type == "cuda":  # (copy groups: the four launches)
        out = fragment_moe_one(x, topk_ids, topk_weights, fw, num_experts, slot_of_expert, n_valid, (t1, t2))
        if out is not None:
            return out
    chunk = token_chunk(topk, hdim, inter, t1, t2)
    if t > chunk:  # a K split's workspace grows with the rows: token chunks, the same bits (batch invariance)
        outs = []
        for s0 in range(0, t, chunk):
            nv = None if n_valid is None else n_valid - s0
            outs.append(fragment_moe(x[s0:s0 + chunk], topk_ids[s0:s0 + chunk], topk_weights[s0:s0 + chunk], fw,
                                     num_experts, slot_of_expert, nv, phase_of_expert, between if s0 == 0 else None,
                                     groups, (t1, t2), direct))
        return torch.cat(outs)
    x = x.contiguous()
    dev = x.device
    if direct:  # (`_launch` refuses copy groups and split tiles here)
        p = t * topk
        r = DirectPairs(topk_ids.reshape(-1).contiguous(), slot_of_expert, n_valid,
                        torch.empty(p, dtype=torch.bool, device=dev), num_experts, p, direct_group(p, hdim, inter))
        blocks = p
    else:
        r = _moe.align_fused(topk_ids, num_experts, 16, slot_of_expert, n_valid, phase_of_expert)
        blocks = r.max_blocks
    phases = tuple(range(1, groups + 2)) if phase_of_expert is not None else (0,)
    persist = uses_persist(t, topk, hdim, inter, direct)
    h = torch.empty((blocks * 16, inter), dtype=torch.bfloat16, device=dev)
    y = torch.empty((r.num_pairs, hdim), dtype=torch.float32, device=dev)
    rw = topk_weights.reshape(-1).contiguous()
    out = torch.empty((t, hdim), dtype=x.dtype, device=dev)
    tab = None
    if direct and r.group:  # the gate/up launch groups the pairs once and hands the down launch a routing
        tab = torch.empty(r.num_pairs * 17 + 1, dtype=torch.int32, device=dev)
    for ph in phases:
        if ph >= 2 and between is not None:
            between(ph - 1)
        _launch(x, r, fw.w1, fw.s1, h, inter, topk, 1, t1, ph, fw.b1, fw.act, fw.row_mul, fw.up_off, alpha=fw.alpha,
                limit=fw.limit, persist=persist, tab=tab)
        r2 = r if tab is None else grouped_routing(tab, r)
        _launch(h, r2, fw.w2, fw.s2, y, hdim, topk, 2, t2, ph, fw.b2, rw=rw, persist=persist)
    block = min(1024, _moe.triton_next_pow2(hdim))
    _moe._moe_combine[(t, triton_cdiv(hdim, block))](y, r.pair_valid, out, hdim, TOPK=topk, BLOCK=block, EMULATE=False,
                                                      **_moe.runtime.pdl_launch())
    return out


# ---- fragment words in an expert arena (verifier_svc.expert_store's "fragments" format) ---------------------------------
# An expert's slice keeps mxfp4.ExpertLayout's sections and sizes: w1_blocks holds w1's fragment words (rows in
# gate_up_order), the first 2I * H / 32 bytes of w1_scales its scale words (the section's row padding is unused), the
# same for w2; biases as they are. So the byte map, the slot pool and every copy are unchanged.
_SECTIONS = (("w1_blocks", "w1_scales", True), ("w2_blocks", "w2_scales", False))


def _section_shapes(layout, first: bool) -> tuple[int, int]:
    h, i = layout.hidden, layout.intermediate
    return ((2 * i if getattr(layout, "gated", True) else i), h) if first else (h, i)


def to_fragment_parts(parts: dict[str, torch.Tensor], row_mul: int, up_off: int) -> dict[str, torch.Tensor]:
    """Nibble-order parts of experts (w1_blocks [.., 2I, H/2], w1_scales [.., 2I, H/32], w2_blocks, w2_scales; leading
    dimensions any; up-only experts' w1 [.., I, ..], told apart by w2's width) -> the bytes each section holds in the
    fragments format ([.., bytes] uint8). Refuses scale bytes above 128 (`check_scales`)."""
    out = {}
    inter = parts["w2_blocks"].shape[-1] * 2
    for bname, sname, first in _SECTIONS:
        b, sc = parts[bname], parts[sname]
        if first:
            if b.shape[-2] not in (inter, 2 * inter):
                raise ValueError(f"w1 has {b.shape[-2]} rows; experts of width {inter} have {2 * inter} or {inter}")
            order = gate_up_order(inter, row_mul, up_off, b.shape[-2] == 2 * inter).to(b.device)
            b, sc = b[..., order, :], sc[..., order, :]
        check_scales(sc)
        words, swords = to_fragment_words(b.contiguous(), sc.contiguous())
        lead = words.shape[:-5]
        out[bname] = words.view(torch.uint8).reshape(*lead, -1)
        out[sname] = swords.view(torch.uint8).reshape(*lead, -1)
    return out


def from_fragment_parts(raw: dict[str, torch.Tensor], layout, row_mul: int, up_off: int) -> dict[str, torch.Tensor]:
    """`to_fragment_parts`' inverse: the sections' bytes ([.., bytes] uint8) -> nibble-order parts."""
    out = {}
    for bname, sname, first in _SECTIONS:
        n, k = _section_shapes(layout, first)
        lead = raw[bname].shape[:-1]
        words = raw[bname].contiguous().view(torch.int32).reshape(*lead, n // 16, k // QUAD, 8, 4, 4)
        swords = raw[sname][..., : n * k // 32].contiguous().view(torch.int32).reshape(*lead, n // 16, k // QUAD, 8)
        b, sc = from_fragment_words(words, swords)
        if first:
            order = gate_up_order(layout.intermediate, row_mul, up_off, getattr(layout, "gated", True)).to(b.device)
            ob, osc = torch.empty_like(b), torch.empty_like(sc)
            ob[..., order, :], osc[..., order, :] = b, sc
            b, sc = ob, osc
        out[bname], out[sname] = b, sc
    return out


def section_bytes(pool: torch.Tensor, layout, name: str) -> torch.Tensor:
    """A section's fragment-format bytes in every row of an arena / slot pool [S, >= nbytes] (a view)."""
    first = name.startswith("w1")
    n, k = _section_shapes(layout, first)
    size = n * k // (32 if name.endswith("_scales") else 2)
    off = layout.offsets[name]
    return pool[:, off:off + size]


def fragment_experts_over(pool: torch.Tensor, layout, row_mul: int, up_off: int, act: int, alpha: float,
                          limit: float) -> FragmentExperts:
    """FragmentExperts viewing an arena or slot pool [S, >= nbytes] uint8 in the fragments format (no copy)."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.stride(1) != 1 or pool.stride(0) % 4:
        raise ValueError(f"a fragments arena is uint8 [S, bytes] with 4-byte aligned rows, got {pool.dtype} "
                         f"{tuple(pool.shape)} strides {pool.stride()}")
    t = {}
    for bname, sname, first in _SECTIONS:
        n, k = _section_shapes(layout, first)
        t[bname] = section_bytes(pool, layout, bname).view(torch.int32).unflatten(1, (n // 16, k // QUAD, 8, 4, 4))
        t[sname] = section_bytes(pool, layout, sname).view(torch.int32).unflatten(1, (n // 16, k // QUAD, 8))
    v = layout.views(pool)
    return FragmentExperts(t["w1_blocks"], t["w1_scales"], t["w2_blocks"], t["w2_scales"], v.get("b1"), v.get("b2"),
                           row_mul, up_off, act, alpha, limit)
