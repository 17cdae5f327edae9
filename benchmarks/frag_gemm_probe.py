"""Where a fragment GEMM's time goes (a probe, not a benchmark): the served gate/up and down launches of
`pdflash_kernels.fragments` alone, in variants made by editing fragments.py's source (copies in /tmp), timed as a
forward pays them (`gpu_time_us_each` over 4 copies of the experts: no graph launch a call, weights not L2-hot).
base: as served; nox: the B operand a constant instead of the activation tile staged through shared memory (no barrier,
no ldmatrix; timing only); nodecode: the FP4 decode replaced by register moves (timing only); nox_nodecode: both (about
the weight loads and the MMAs alone). Fractions: weight bytes / time / the device-copy rate, as
benchmarks/kernel_bench.py (stop 41's results also timed a `clone` of the same bytes: not comparable, since removed). --tiles: other FragTile names timed on both GEMMs with the served source (e.g. the staged
tiles, "4x4w4a3"), each output first checked bit-identical to its register-path twin (the same name without "aS").

    python benchmarks/frag_gemm_probe.py [--variants base,nodecode] [--tiles 4x4w4a3,8x2w4a4]   (GPU; ~1-2 minutes)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.kernel_bench import MODELS, as_served, copy_rate, gpu_time_us_each, hf_experts, routing  # noqa: E402
from benchmarks.one_launch_probe import load  # noqa: E402  (a variant of fragments.py as a module)

BAR = "        gl.thread_barrier()\n        xs.store(xt)\n        gl.thread_barrier()\n"
ASM = '_FRAG_ASM = pair_word_decode_asm("$9", "$10")'
MOVS = '_FRAG_ASM = "{ mov.b32 {$0, $1}, $8; mov.b32 {$2, $3}, $9; mov.b32 {$4, $5}, $10; mov.b32 {$6, $7}, $8; }"'
NOX = "        return gl.full([xt.shape[1], xt.shape[0]], 1.0, gl.bfloat16, BL)\n"
VARIANTS = {
    "base": [],
    "nox": [(BAR + "        return xs.permute([1, 0]).load(BL)\n", NOX)],
    "nodecode": [(ASM, MOVS)],
    "nox_nodecode": [(BAR + "        return xs.permute([1, 0]).load(BL)\n", NOX), (ASM, MOVS)],
}
CASES = (("gpt-oss-20b", 8, 1), ("gpt-oss-20b", 32, 1), ("qwen3-30b-a3b", 8, 1), ("qwen3-30b-a3b", 32, 1),
         ("qwen3-30b-a3b", 128, 1), ("qwen3-30b-a3b", 128, 16))


def fragment_copies(model: str, n: int = 4) -> list:
    """n copies of a model's served experts as fragment words (random weights, `as_served`), each its own memory: the
    calls a timing graph runs back to back read several times L2, as a forward does."""
    from pdflash_kernels import fragments as F
    from pdflash_kernels.installer import expert_weights

    fw0 = F.FragmentExperts.from_weights(as_served(expert_weights(hf_experts(model), "mxfp4"), pair_words=True))
    return [fw0] + [dataclasses.replace(fw0, **{k: getattr(fw0, k).clone() for k in ("w1", "s1", "w2", "s2")})
                    for _ in range(n - 1)]


def main():
    import argparse

    from pdflash_kernels import fragments as F
    from pdflash_kernels.moe import align_fused

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="source variants (base, nox, nodecode, nox_nodecode)")
    ap.add_argument("--tiles", default="", help="FragTile names timed on both GEMMs as well")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    mods = {n: load(n, VARIANTS[n], prefix="fragg") for n in names}
    tiles = [F.FragTile.parse(t) for t in args.tiles.split(",") if t]
    rate = copy_rate()
    rows = []
    for model, active, tpe in CASES:
        e, k, h, i = MODELS[model]
        copies = fragment_copies(model)
        fw0 = copies[0]
        t1, t2 = F.frag_config(h, i)
        x, ids, wts = routing(e, k, h, active, tpe)
        with torch.inference_mode():
            r = align_fused(ids, e, 16)
            hbuf = torch.zeros((r.max_blocks * 16, i), dtype=torch.bfloat16, device="cuda")
            ybuf = torch.empty((r.num_pairs, h), dtype=torch.float32, device="cuda")
            rw = wts.reshape(-1).contiguous()
            b1 = active * (fw0.w1[0].numel() + fw0.s1[0].numel()) * 4  # int32 words
            b2 = active * (fw0.w2[0].numel() + fw0.s2[0].numel()) * 4
            row = dict(model=model, active_experts=active, tokens_per_expert=tpe, gate_up_tile=str(t1),
                       down_tile=str(t2), gate_up_mb=round(b1 / 1e6, 1), down_mb=round(b2 / 1e6, 1))
            def gate_up(mod, fw, t):
                return lambda: mod._launch(x, r, fw.w1, fw.s1, hbuf, i, k, 1, t, 0, fw.b1, fw.act, fw.row_mul, fw.up_off,
                                           alpha=fw.alpha, limit=fw.limit)

            def down(mod, fw, t):
                return lambda: mod._launch(hbuf, r, fw.w2, fw.s2, ybuf, h, k, 2, t, 0, fw.b2, rw=rw)

            for n, m in mods.items():
                row[f"{n}_gate_up_us"] = round(gpu_time_us_each([gate_up(m, fw, t1) for fw in copies]), 1)
                row[f"{n}_down_us"] = round(gpu_time_us_each([down(m, fw, t2) for fw in copies]), 1)
            for t in tiles:  # each first against its register-path twin's bits, then timed
                twin = t._replace(stages=0, xring=0)
                for key, call, buf in (("gate_up", gate_up, hbuf), ("down", down, ybuf)):
                    if key == "gate_up" and t.nt % 2:
                        continue  # (gate/up tiles are half gate, half up)
                    call(F, fw0, t)()
                    first = buf.clone()
                    call(F, fw0, twin)()
                    row[f"{t}_{key}_same_bits"] = bool(torch.equal(first, buf))
                    row[f"{t}_{key}_us"] = round(gpu_time_us_each([call(F, fw, t) for fw in copies]), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del copies, fw0
        torch.cuda.empty_cache()
    print(f"\ncopy rate {rate / 1e12:.2f} TB/s; us (fraction of the copy rate on the weight bytes)")
    cols = names + [str(t) for t in tiles]
    head = ["case", "GEMM", "tile", "MB"] + cols
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        for g, key in (("gate/up", "gate_up"), ("down", "down")):
            mb = r[f"{key}_mb"]
            cells = [f"{r['model']} A={r['active_experts']} T={r['tokens_per_expert']}", g, r[f"{key}_tile"], str(mb)]
            cells += [f"{r[f'{n}_{key}_us']} ({mb * 1e6 / (r[f'{n}_{key}_us'] * 1e-6) / rate:.2f})"
                      f"{'' if r.get(f'{n}_{key}_same_bits', True) else ' BITS DIFFER'}"
                      if f"{n}_{key}_us" in r else "-" for n in cols]
            print("| " + " | ".join(cells) + " |")
    out = pathlib.Path(os.environ.get("OUT", "/tmp"))
    (out / "frag_gemm_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                          "copy_rate": rate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
