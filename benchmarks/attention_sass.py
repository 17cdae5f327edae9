"""The attention kernels compiled for sm_90a without a GPU (Triton and the ptxas it ships): whether each form compiles,
its registers, spills and shared memory against an H100/H200 SM's 227 KiB. A check before device time is spent, above
all on forms no GPU has run yet (multi-head latent attention's 512-wide latent); not a timing.

    python benchmarks/attention_sass.py [--out DIR] [--against REV]

Rows: the GQA forms every served model runs (head 64 and 128, paged, split over programs or not, ragged waves) and the
MLA forms (latent 512 + rotary 64, 128 query heads on one latent, values = keys) at 1 and 2 pipeline stages, plus
`mla.head_matmul` at DeepSeek-V3's widths and the paged KV write. `--against REV`: the GQA forms' SASS compared
instruction by instruction with REV's source of the kernel. Writes attention_sass.json / .md under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
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

SMEM_LIMIT = 227 * 1024  # an sm_90 SM's shared memory a block may take


def _tool(name: str) -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _cuobjdump(kern, flag: str) -> str:
    """cuobjdump `flag`'s output for the compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kern.asm["cubin"])
    try:
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def usage(kern) -> dict:
    """Registers and spill bytes from the cubin (cuobjdump), shared memory from Triton's metadata."""
    res = _cuobjdump(kern, "-res-usage")
    reg = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return {"registers": int(reg.group(1)) if reg else -1, "stack_bytes": int(spill.group(1)) if spill else -1,
            "shared_bytes": int(kern.metadata.shared)}


def _compile(fn, types: dict, const: dict, row: dict, sass: bool = False) -> dict:
    """`row` + whether `fn` compiles for sm_90a with `const` (pointer types from `types`, other arguments i32) at the
    row's warps and stages, and its registers, stack and shared memory; with `sass` its SASS instructions too (parameter
    offsets normalized), for comparing two sources of one kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {n: v for n, v in const.items() if n in fn.arg_names}  # (an older source: without its later constexprs)
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    t = time.time()
    try:
        kern = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=row["num_warps"], num_stages=row["num_stages"]))
    except Exception as e:  # noqa: BLE001 - a form that does not compile is the finding
        return {**row, "compiles": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    out = {**row, "compiles": True, "compile_s": round(time.time() - t, 1), **usage(kern)}
    if sass:
        out["sass"] = sass_of(kern)
    return out


def sass_of(kern) -> list[str]:
    text = _cuobjdump(kern, "-sass")
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", m.group(1).strip())
            for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]


ATTN_TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "pos_ptr": "*i64",
              "kmask_ptr": "*i64", "sink_ptr": "*bf16", "table_ptr": "*i32", "qr_ptr": "*bf16", "kr_ptr": "*bf16",
              "ws_ptr": "*fp32", "ml_ptr": "*fp32", "cnt_ptr": "*i32", "cu_ptr": "*i32", "scaling": "fp32"}


def compile_attention(name: str, d: int, group: int, dr: int, paged: bool, programs: int, ragged: bool,
                      num_warps: int, num_stages: int, module=None, sass: bool = False) -> dict:
    """`_attn_kernel` of pdflash_kernels.attention (or of `module`, another source of it)."""
    import triton

    from pdflash_kernels import attention as a

    const = dict(GROUP=group, D=d, HAS_SINK=False, HAS_KMASK=False, BLOCK_M=a.BLOCK_M, BLOCK_N=a.BLOCK_N,
                 SEG_CHUNKS=a.SEG_CHUNKS, PROGRAMS=programs, DIRECT_SEGS=a.DIRECT_SEGS, F32DOT=False, PAGED=paged,
                 DR=dr, BLOCK_DR=max(16, triton.next_power_of_2(dr)) if dr else 0, V_IS_K=dr > 0, RAGGED=ragged)
    row = {"kernel": name, "head": d, "rotary": dr, "group": group, "paged": paged, "programs": programs, "ragged": ragged,
           "num_warps": num_warps, "num_stages": num_stages}
    return _compile((module or a)._attn_kernel, ATTN_TYPES, const, row, sass)


def compile_head_matmul(k: int, n: int) -> dict:
    import triton

    from pdflash_kernels import mla

    const = dict(K=k, N=n, BLOCK_M=mla.BLOCK_M, BLOCK_N=max(16, min(64, triton.next_power_of_2(n))),
                 BLOCK_K=max(16, min(64, triton.next_power_of_2(k))), PRECISION="tf32", F32DOT=False)
    row = {"kernel": f"head_matmul K={k} N={n}", "head": k, "rotary": 0, "group": 0, "paged": False, "programs": 1,
           "ragged": False, "num_warps": 4, "num_stages": 3}
    return _compile(mla._head_mm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16"}, const, row)


def compile_kv_write(d: int, dv: int) -> dict:
    """The paged KV write (MLA: the 512-wide latent into one pool, its 64-wide rotary key into the other)."""
    import triton

    from pdflash_kernels import attention as a

    const = dict(D=d, BLOCK_D=triton.next_power_of_2(d), DV=dv, BLOCK_DV=triton.next_power_of_2(dv))
    types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "kp_ptr": "*bf16", "vp_ptr": "*bf16", "pages_ptr": "*i64", "offs_ptr": "*i64"}
    row = {"kernel": f"paged_write {d}/{dv}", "head": d, "rotary": dv, "group": 0, "paged": True, "programs": 1,
           "ragged": False, "num_warps": 4, "num_stages": 3}
    return _compile(a._kv_write_kernel, types, const, row)


GQA_FORMS = (("gqa prefill", 128, False, 1, False), ("gqa paged split", 128, True, 16, False),
             ("gqa paged wave", 64, True, 16, True))


def same_sass_as(rev: str) -> list[dict]:
    """The GQA forms compiled from this checkout's pdflash_kernels/attention.py and from `rev`'s (git show): their
    SASS instruction counts and how many instructions differ (0: the same kernel, so the same bits on the GPU)."""
    import importlib.util

    src = subprocess.run(["git", "show", f"{rev}:pdflash_kernels/attention.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "attention_at_rev.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("pdflash_kernels.attention_at_rev", path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)  # (triton.jit reads the source file: compile before the directory goes)
        out = []
        for name, d, paged, programs, ragged in GQA_FORMS:
            now = compile_attention(name, d, 8, 0, paged, programs, ragged, 4, 3, sass=True)["sass"]
            then = compile_attention(name, d, 8, 0, paged, programs, ragged, 4, 3, module=old, sass=True)["sass"]
            out.append({"kernel": name, "head": d, "instructions": len(now), f"instructions_at_{rev}": len(then),
                        "differing": sum(a != b for a, b in zip(now, then)) + abs(len(now) - len(then))})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--against", metavar="REV", help="also compare the GQA forms' SASS with a git revision's attention.py")
    args = ap.parse_args()
    from pdflash_kernels.attention import _launch_options

    rows = []
    for d, group in ((128, 8), (64, 8)):  # Qwen3 / Mixtral heads; gpt-oss's
        opts = _launch_options(d)
        w, s = opts.get("num_warps", 4), opts.get("num_stages", 3)
        rows.append(compile_attention("gqa prefill", d, group, 0, False, 1, False, w, s))
        rows.append(compile_attention("gqa paged split", d, group, 0, True, 16, False, w, s))
        rows.append(compile_attention("gqa paged wave", d, group, 0, True, 16, True, w, s))
    for stages in (1, 2):  # MLA: DeepSeek-V3 / Kimi K2's latent
        rows.append(compile_attention("mla paged", 512, 128, 64, True, 1, False, 8, stages))
        rows.append(compile_attention("mla paged split", 512, 128, 64, True, 16, False, 8, stages))
        rows.append(compile_attention("mla paged wave", 512, 128, 64, True, 16, True, 8, stages))
    rows.append(compile_head_matmul(128, 512))  # q_nope @ W_UK
    rows.append(compile_head_matmul(512, 128))  # o_latent @ W_UV^T
    rows.append(compile_kv_write(128, 128))  # every GQA model's
    rows.append(compile_kv_write(512, 64))  # MLA's latent and rotary key
    cols = ["kernel", "head", "rotary", "programs", "ragged", "num_warps", "num_stages", "compiles", "registers",
            "stack_bytes", "shared_bytes", "fits_smem", "compile_s", "error"]
    for r in rows:
        if r.get("compiles"):
            r["fits_smem"] = r["shared_bytes"] <= SMEM_LIMIT
    md = ["# Attention kernels compiled for sm_90a on a CPU machine (`python benchmarks/attention_sass.py`)", "",
          f"Shared memory limit a block: {SMEM_LIMIT} bytes. Registers and stack (spill) bytes from cuobjdump.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    same = same_sass_as(args.against) if args.against else []
    if same:
        md += ["", f"The GQA forms' SASS against {args.against}'s `pdflash_kernels/attention.py` (`--against "
               f"{args.against}`; parameter offsets aside):", "", "| kernel | head | instructions | at " + args.against
               + " | differing |", "|---|---|---|---|---|"]
        md += [f"| {r['kernel']} | {r['head']} | {r['instructions']} | {r[f'instructions_at_{args.against}']} | "
               f"{r['differing']} |" for r in same]
    text = "\n".join(md) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_sass.md").write_text(text)
    (out / "attention_sass.json").write_text(json.dumps({"forms": rows, "same_sass": same}, indent=1) + "\n")
    return 0 if all(r.get("compiles") and r.get("fits_smem") for r in rows) and not any(r["differing"] for r in same) else 1


if __name__ == "__main__":
    sys.exit(main())
