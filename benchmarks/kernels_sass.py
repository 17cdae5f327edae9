"""The MoE GEMM kernels seen without a GPU: each variant of pdflash_kernels.moe (SWEEP_VARIANTS, SWEEP_VARIANTS_BF16) compiled
for sm_90a by Triton and the ptxas it ships, and the SASS of its K loop counted per weight value.

    python benchmarks/kernels_sass.py [--models qwen3-30b-a3b,gpt-oss-20b] [--variants base,join_bf16] [--bf16] [--dump DIR]

One line per (model, GEMM, variant): registers, shared memory, compile time, the K loop's instructions per weight value
a warp decodes (`warp-instr/value`) and its instruction mix (HMMA/HGMMA = tensor-core MMAs, LDGSTS = async copies,
LDS/LDSM = shared-memory loads, HMUL2 = bf16x2 multiplies, IMAD/LOP3/PRMT/SHF = integer work), and the loop's global
loads split into synchronous ones (LDG: the step waits for a memory round trip at their first use) and streamed ones
(LDGSTS: cp.async, issued stages ahead). A decode-bound GEMM
takes about that many issue slots per weight: an H200 issues ~1.05e12 warp instructions per second (132 SMs x 4
schedulers x 1.98 GHz), and 60% of its ~4.2 TB/s copy rate on MXFP4 (0.53125 bytes per weight) is ~4.7e12 weights
per second: <= 0.22 warp-instr/value with perfect overlap, so aim well below that. It does not replace timing on the
GPU (`benchmarks/kernel_bench.py --sweep`): latency, occupancy and the memory system are not modelled.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {  # experts, top-k, hidden, expert width, gate/up row multiplier, up offset, bias, activation
    "gpt-oss-20b": (32, 4, 2880, 2880, 2, 1, True, 1),
    "qwen3-30b-a3b": (128, 8, 2048, 768, 1, None, False, 0),
    "mixtral-8x7b": (8, 2, 4096, 14336, 1, None, False, 0),
}
DIV16 = ("x_ptr", "h_ptr", "y_ptr", "w_ptr", "s_ptr", "b_ptr", "stride_xm", "stride_hm", "stride_ym", "stride_we", "stride_wn", "stride_se")


def compile_gemm(gemm: int, c, model: str, fp4: bool):
    """pdflash_kernels.moe's gemm 1 or 2 compiled for sm_90a with config c (pointer and stride args 16-aligned, as at run time)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdflash_kernels import moe

    e, k, h, i, row_mul, up_off, bias, act = MODELS[model]
    wt = "*u8" if fp4 else "*bf16"
    # (the launch options are not kernel arguments: launch_pdl too, on by default on sm_90+ hosts)
    flags = {n: v for n, v in moe._flags(c, fp4).items() if n not in ("num_warps", "num_stages", "launch_pdl")}
    flags["F32DOT"] = False
    if gemm == 1:
        fn = moe._moe_gemm1
        types = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr=wt, s_ptr=wt, b_ptr="*bf16", alpha="fp32", limit="fp32")
        const = dict(I=i, K=h, UP_OFF=i if up_off is None else up_off, ROW_MUL=row_mul, TOPK=k, FP4=fp4, HAS_BIAS=bias, ACT=act, **flags)
    else:
        fn = moe._moe_gemm2
        types = dict(h_ptr="*bf16", y_ptr="*fp32", rw_ptr="*bf16", w_ptr=wt, s_ptr=wt, b_ptr="*bf16",
                     out_ptr="*fp32", cnt_ptr="*i1", valid_ptr="*i1")  # (the separate combine: moe.launch_gemm2's dummies)
        const = dict(N=h, K=i, FP4=fp4, HAS_BIAS=bias, COMBINE=False, TOPK=1, TOPK_PAD=1, **flags)
    types.update(sorted_pairs_ptr="*i32", block_slot_ptr="*i32", num_blocks_ptr="*i32", ws_ptr="*fp32", cnt_ptr="*i32",
                 scnt_ptr="*i32", R="i32", block_phase_ptr="*i8")
    split, span = moe.split_span(h if gemm == 1 else i, c)  # split K (MoeConfig.split_k): the one-launch form
    const.update(SPLIT=split, SPAN=span, FIXUP=split > 1, PHASE=0)  # (one phase: every routing block)
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in fn.arg_names}
    t = time.time()
    kern = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    return kern, time.time() - t


def _tool(name: str) -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_of(kern) -> tuple[str, int]:
    """(SASS text, registers per thread) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kern.asm["cubin"])
    try:
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+)", res)
    return sass, int(m.group(1)) if m else -1


def k_loop(sass: str) -> tuple[int, collections.Counter] | None:
    """The instruction count and mix of the innermost large loop (a backward branch spanning >= 40 instructions)."""
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, ins in lines:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins)
        if not (m and m.group(1)) or int(m.group(1), 16) >= addr:
            continue
        body = [i for a, i in lines if int(m.group(1), 16) <= a <= addr]
        if len(body) >= 40 and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return None
    mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in best)
    return len(best), mix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all of the format's table)")
    ap.add_argument("--bf16", action="store_true", help="the bf16-weight variants (default: MXFP4)")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS into this folder")
    args = ap.parse_args()
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, variant_config

    fp4 = not args.bf16
    table = SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16
    names = args.variants.split(",") if args.variants else list(table)
    for model in args.models.split(","):
        e, k, h, i = MODELS[model][:4]
        for name in names:
            for gemm in (1, 2):
                n_, k_ = (i, h) if gemm == 1 else (h, i)
                c = variant_config(n_, k_, k, fp4, table[name])
                head = f"{model:14s} gemm{gemm} {name:22s} n{c.block_n:<3d} k{c.block_k:<3d} w{c.num_warps}"
                try:
                    kern, dt = compile_gemm(gemm, c, model, fp4)
                except Exception as ex:  # noqa: BLE001 - report and go on
                    why = str(ex) if os.environ.get("SASS_VERBOSE") else str(ex).splitlines()[0][:120]  # SASS_VERBOSE=1: all of it
                    print(f"{head} FAILED {type(ex).__name__}: {why}", flush=True)
                    continue
                sass, regs = sass_of(kern)
                if args.dump:
                    pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
                    (pathlib.Path(args.dump) / f"{model}_gemm{gemm}_{name}.sass").write_text(sass)
                loop = k_loop(sass)
                rows = c.block_n * (2 if gemm == 1 else 1)  # gate and up rows in gemm 1
                per_warp = rows * c.block_k / c.num_warps
                desc = "no K loop found (unrolled?)"
                if loop is not None:
                    n, mix = loop
                    desc = (f"{n:5d} instr/K step = {n / per_warp:.3f} warp-instr/value | synchronous loads LDG={mix['LDG']} "
                            f"streamed LDGSTS={mix['LDGSTS']} | " + " ".join(f"{a}={b}" for a, b in mix.most_common(10)))
                print(f"{head} regs {regs:3d} smem {kern.metadata.shared:6d} compile {dt:4.1f}s | {desc}", flush=True)


if __name__ == "__main__":
    main()
