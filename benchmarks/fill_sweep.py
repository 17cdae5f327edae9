"""The device-managed expert cache's fill kernel (pdflash_kernels/offload.py `fill`: SMs reading pinned host memory over PCIe)
against a copy-engine copy of the same bytes, over its launch shape: K-range per program (`chunk_words`), words per
load step (`block_words`) and warps. Rows: a layer's misses as the offload benchmark sees them (gpt-oss-20b slices of
13.2 MB, 1-3 a layer at block 1, 32 at a cold layer; Qwen3-30B-A3B slices of 2.5 MB, 1-8). GPU only.

    python benchmarks/fill_sweep.py --out OUT      -> OUT/fill_sweep_<device>.json (h200, h100, ...), a table on stdout
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the project root first

SLICES = {"gpt-oss-20b": 13_271_040, "qwen3-30b-a3b": 2_506_752}  # MXFP4 bytes of one expert (gate/up + down + scales)
VARIANTS = [(1 << 16, 2048, 4), (1 << 16, 4096, 4), (1 << 16, 4096, 8), (1 << 15, 2048, 4), (1 << 14, 2048, 4),
            (1 << 14, 1024, 4), (1 << 17, 4096, 8), (1 << 13, 2048, 4), (1 << 12, 2048, 4), (1 << 11, 2048, 4),
            (1 << 12, 1024, 4), (1 << 11, 1024, 4)]


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / reps


def main(argv=None) -> int:
    from pdflash_kernels import offload as ko

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    for model, sb in SLICES.items():
        sb = sb // 4 * 4
        n_rows = 48
        arena = torch.empty(n_rows, sb, dtype=torch.uint8).pin_memory()
        arena.view(torch.int32).random_()
        pool = torch.empty(n_rows, sb, dtype=torch.uint8, device="cuda")
        for n in ((1, 3, 32) if model == "gpt-oss-20b" else (1, 4, 8, 32)):
            # rows spread over the arena so consecutive reps read other host pages
            eff = torch.arange(n_rows, dtype=torch.int32, device="cuda")
            flags = torch.zeros(n_rows, dtype=torch.int8, device="cuda")
            flags[:n] = 1
            nbytes = n * sb
            ce = timed(lambda: [pool[i].copy_(arena[i], non_blocking=True) for i in range(n)], args.reps)
            ce_rate = nbytes / ce
            for chunk, block, warps in VARIANTS:
                t = timed(lambda: ko.fill(arena, pool, 0, eff, flags, chunk_words=chunk, block_words=block, num_warps=warps),
                          args.reps)
                ok = torch.equal(pool[:n].cpu(), arena[:n])
                rows.append(dict(model=model, experts=n, bytes=nbytes, chunk_words=chunk, block_words=block, num_warps=warps,
                                 us=round(t * 1e6, 1), gbps=round(nbytes / t / 1e9, 2), ce_gbps=round(ce_rate / 1e9, 2),
                                 of_copy_engine=round(ce / t, 3), correct=ok))
                pool.zero_()
        del arena, pool
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.kernel_bench import device_tag

    (out / f"fill_sweep_{device_tag()}.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print("| model | experts | chunk words | block words | warps | us | GB/s | copy engine GB/s | of CE | correct |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['experts']} | {r['chunk_words']} | {r['block_words']} | {r['num_warps']} | {r['us']} | "
              f"{r['gbps']} | {r['ce_gbps']} | {r['of_copy_engine']} | {r['correct']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
