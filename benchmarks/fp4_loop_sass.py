"""Alternative forms of the MXFP4 K loop, compiled for sm_90a without a GPU (Triton and the ptxas it ships), and the
SASS of each loop counted per weight value, as benchmarks/kernels_sass.py counts pdflash_kernels.moe's own GEMMs.

    python benchmarks/fp4_loop_sass.py

One dense GEMM y[16, N] = a[16, K] @ w[N, K]^T (w MXFP4, a 16-row bf16 activation tile: pdflash_kernels.moe's routing block)
at gpt-oss-20b's down shape (N = K = 2880), in four forms:
  base      pdflash_kernels.moe's loop: bytes -> bf16 pairs by two multiply tricks (decode 3), scaled, joined into K order
  shifts    the same with shifts and masks instead of the multiplies
  swizzled  an arena whose 32-byte chunks hold each MMA thread's 8 bytes contiguously, un-permuted by reshape/trans
            before the decode (whether Triton then loads straight into the MMA's operand registers)
  dot3d     K split over warps through a batched 3-D dot (two K halves a step; whether Triton gives each its warps)
and several tile sizes (rows x K step, warps). Prints a table: registers, loop instructions a step, warp-instructions a
weight value, and the instruction mix. A static view (issue slots), not a timing: benchmarks/fp4_probe.py times.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels_sass import k_loop, sass_of  # noqa: E402


@triton.jit
def _scaled(pair, e):
    """bf16x2 pair words times 2^(e-127) each (e: a biased exponent per element), as pdflash_kernels.moe's decode 3 does."""
    return tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
                                     "=r,r,r", [pair, (e << 7) | (e << 23)], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _decode(p, s, BN: tl.constexpr, BK: tl.constexpr, SHIFTS: tl.constexpr):
    """Packed bytes [BN, BK/2] (uint32) and scale bytes [BN, BK/32] -> bf16 [BN, BK] in K order."""
    if SHIFTS:
        pair = ((p << 6) & 0x1C0) | ((p << 12) & 0x8000) | ((p << 18) & 0x01C00000) | ((p << 24) & 0x80000000)
    else:
        pair = ((p * 0x00040040) & 0x01C001C0) | ((p * 0x01001000) & 0x80008000)
    e = tl.minimum(s, 128) + 126
    pair = _scaled(pair, tl.reshape(tl.broadcast_to(e[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2)))
    lo = pair.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@triton.jit
def loop2d(a_ptr, w_ptr, s_ptr, y_ptr, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           SHIFTS: tl.constexpr, SWIZZLED: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    acc = tl.zeros((16, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + m[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
        p = tl.load(w_ptr + rows[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :])
        if SWIZZLED:  # chunk byte t * 8 + j holds logical byte t + 4 j (t < 4 MMA threads of a row, j < 8)
            p = tl.reshape(tl.trans(tl.reshape(p, (BN, BK // 64, 4, 8)), (0, 1, 3, 2)), (BN, BK // 2))
        s = tl.load(s_ptr + rows[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BK // 32))[None, :])
        w = _decode(p.to(tl.uint32), s.to(tl.uint32), BN, BK, SHIFTS)
        acc += tl.dot(a, tl.trans(w))
    tl.store(y_ptr + m[:, None] * N + rows[None, :], acc)


@triton.jit
def loop3d(a_ptr, w_ptr, s_ptr, y_ptr, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           SHIFTS: tl.constexpr, SWIZZLED: tl.constexpr):
    """Each K step's two halves as the two batch entries of a 3-D dot, summed at the end."""
    KS: tl.constexpr = BK // 2
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    half = tl.arange(0, 2)
    acc = tl.zeros((2, 16, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + m[None, :, None] * K + (k0 + half[:, None, None] * KS + tl.arange(0, KS)[None, None, :]))
        p = tl.load(w_ptr + rows[None, :, None] * (K // 2)
                    + (k0 // 2 + half[:, None, None] * (KS // 2) + tl.arange(0, KS // 2)[None, None, :])).to(tl.uint32)
        s = tl.load(s_ptr + rows[None, :, None] * (K // 32)
                    + (k0 // 32 + half[:, None, None] * (KS // 32) + tl.arange(0, KS // 32)[None, None, :])).to(tl.uint32)
        pair = ((p * 0x00040040) & 0x01C001C0) | ((p * 0x01001000) & 0x80008000)
        e = tl.minimum(s, 128) + 126
        pair = _scaled(pair, tl.reshape(tl.broadcast_to(e[:, :, :, None], (2, BN, KS // 32, 16)), (2, BN, KS // 2)))
        lo = pair.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        w = tl.reshape(tl.join(lo, hi), (2, BN, KS))
        acc += tl.dot(a, tl.trans(w, (0, 2, 1)))
    tl.store(y_ptr + m[:, None] * N + rows[None, :], tl.sum(acc, 0))


FORMS = {"base": (loop2d, False, False), "shifts": (loop2d, True, False), "swizzled": (loop2d, False, True),
         "dot3d": (loop3d, False, False)}
TILES = ((32, 64, 4), (32, 64, 1), (64, 64, 2), (32, 128, 2), (128, 64, 4))  # (rows, K step, warps)


def count(form: str, bn: int, bk: int, warps: int, k: int = 2880, n: int = 2880) -> dict:
    fn, shifts, swizzled = FORMS[form]
    sig = dict(a_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", y_ptr="*fp32", K="constexpr", N="constexpr", BN="constexpr",
               BK="constexpr", SHIFTS="constexpr", SWIZZLED="constexpr")
    const = dict(K=k, N=n, BN=bn, BK=bk, SHIFTS=shifts, SWIZZLED=swizzled)
    kern = triton.compile(ASTSource(fn, sig, const, {(i,): [["tt.divisibility", 16]] for i in range(4)}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=4))
    sass, regs = sass_of(kern)
    loop = k_loop(sass)
    if loop is None:
        return dict(form=form, rows=bn, block_k=bk, warps=warps, regs=regs, per_step=None)
    n_instr, mix = loop
    return dict(form=form, rows=bn, block_k=bk, warps=warps, regs=regs, per_step=n_instr,
                per_value=round(n_instr * warps / (bn * bk), 3), mix=dict(mix.most_common(8)))


def main() -> None:
    print("| form | rows x K step, warps | regs | instr/step | warp-instr/value | mix |")
    print("|---|---|---|---|---|---|")
    for form in FORMS:
        for bn, bk, warps in TILES:
            if form == "dot3d" and warps < 2:
                continue
            r = count(form, bn, bk, warps)
            per = "no loop found" if r["per_step"] is None else f"{r['per_step']} | {r['per_value']}"
            print(f"| {form} | {bn} x {bk}, {warps} | {r['regs']} | {per} | {r.get('mix', '')} |", flush=True)


if __name__ == "__main__":
    main()
