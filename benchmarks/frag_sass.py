"""The fragment GEMM's K loop in SASS, per tile, compiled for sm_90a without a GPU (Triton and the cuobjdump it ships):
registers, instructions a K step a warp, warp-instructions a weight value and the instruction mix, as
benchmarks/kernels_sass.py counts pdflash_kernels.moe's GEMMs. A static view (issue slots, spills), not a timing:
benchmarks/frag_gemm_probe.py times on the GPU. Compiled as a launch specializes it: pointers 16-byte aligned, the
activation, output, word and scale strides multiples of 16 (true of every served shape).

    python benchmarks/frag_sass.py [N,K,TILE,EPI ...]   (EPI 1: gate/up with N = expert width, 2: down)
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT = ("2880,2880,8x2w4p,1", "2880,2880,8x2w4a4,1", "2880,2880,8x2w4aa4,1", "2880,2880,4x4w4p,2",
           "2880,2880,4x4w4aa4,2", "768,2048,4x4w4,1", "768,2048,4x4w4a4,1", "768,2048,4x4w4aa4,1", "2048,768,4x4w4,2",
           "2048,768,4x4w4a3,2", "2048,768,4x4w4aa3,2")
SIG = {"x_ptr": "*bf16", "stride_x": "i32", "out_ptr": "*fp32", "stride_o": "i32", "pairs_ptr": "*i32", "slot_ptr": "*i32",
       "nblocks_ptr": "*i32", "phase_ptr": "*i32", "w_ptr": "*i32", "stride_ws": "i32", "s_ptr": "*i32", "stride_ss": "i32",
       "b_ptr": "*bf16", "stride_b": "i32", "rw_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "R": "i32",
       "P": "i32", "alpha": "fp32", "limit": "fp32"}


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels_sass import k_loop, sass_of
    from pdflash_kernels import fragments as F

    print("| N | K | tile | GEMM | registers | loop instructions a step a warp | warp-instructions a weight | spills in the loop | "
          "mix |\n|---|---|---|---|---|---|---|---|---|")
    for case in sys.argv[1:] or DEFAULT:
        n, k, tile, epi = case.split(",")
        n, k, epi = int(n), int(k), int(epi)
        t = F.FragTile.parse(tile)
        split, ss = F.split_plan(k // 64, t.kqs, t.split)
        const = dict(N=n, K=k, TOPK=4, EPI=epi, ACT=1, HAS_BIAS=True, ROW_MUL=2, UP_OFF=1, PHASE=0, BM=16, NT=t.nt,
                     KQS=t.kqs, W=t.warps, PREFETCH=t.prefetch, SPLIT=split, SS=ss, STAGES=t.stages, XRING=t.xring)
        sig = dict(SIG, out_ptr="*bf16" if epi == 1 else "*fp32", **{c: "constexpr" for c in const})
        # what a launch specializes on (Triton's "D"): every pointer 16-byte aligned, the strides multiples of 16
        aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(F._frag_gemm.arg_names)
                   if a in SIG and (SIG[a].startswith("*") or a in ("stride_x", "stride_o", "stride_ws", "stride_ss"))}
        kern = triton.compile(GluonASTSource(F._frag_gemm, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": t.warps})
        sass, regs = sass_of(kern)
        loop = k_loop(sass)
        if loop is None:
            print(f"| {n} | {k} | {tile} | {'gate/up' if epi == 1 else 'down'} | {regs} | no loop found | | | |")
            continue
        count, mix = loop
        per_warp = t.nt * 16 * t.kqs * 64 / t.warps  # weight values a warp's K step
        spills = mix.get("LDL", 0) + mix.get("STL", 0)
        print(f"| {n} | {k} | {tile} | {'gate/up' if epi == 1 else 'down'} | {regs} | {count} | {count / per_warp:.3f} | "
              f"{spills} | {' '.join(f'{op}:{c}' for op, c in mix.most_common(10))} |", flush=True)


if __name__ == "__main__":
    main()
