"""The batch-invariant linear's launch options at the verify forward's shapes: time per call with the weights cold in
L2 (as in a forward, where each layer's weights are read once), weight bandwidth, and the bits of each option.

    python benchmarks/linear_sweep.py --out OUT     (on the GPU machine: bash benchmarks/gpu.sh OUT linear)
    python benchmarks/linear_sweep.py --out OUT --splits --rows 1 16 64 [--m-tiles 4 2 1] [--wide-from 0 16] [--split-values 1 2]
        (the K split, row tiles and tile height against cuBLAS, whole calls)

The K split and BLOCK_K stay those of `pdflash_kernels.linear.linear_config` (they set what each output element adds, in which
order). Varied: num_warps and num_stages (the default's bits or not: `same_bits`), and the tile's height BLOCK_M and
width BLOCK_N (PDFLASH_LINEAR_BLOCK_M sets the height for every call). An option is usable where its rows are
invariant: each row alone, in a 7-row, a 16-row and a 100-row call gives the same bits (`rows_invariant`). Timing:
one CUDA graph calls the linear on enough copies of the weight to exceed twice the L2 (a single weight of 10-20 MB
would otherwise be read from the 50 MB L2 on every replay and look 2x faster than it is in a forward).
Writes OUT/linear_sweep_<device>.json (h200, h100, ...) and prints a table."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: (name, N, K): the decode forward's projections (Qwen3-30B-A3B: hidden 2048, 32 q + 4 kv heads of 128, 128 experts;
#: gpt-oss-20b: hidden 2880, 64 q + 8 kv heads of 64, 32 experts; Mixtral-8x7B: hidden 4096, 32 q + 8 kv heads of 128;
#: LM heads of the benchmarks' 4096-token vocabulary)
SHAPES = [("qwen3 qkv", 5120, 2048), ("qwen3 o", 2048, 4096), ("qwen3 router", 128, 2048), ("qwen3 lm_head", 4096, 2048),
          ("gpt-oss qkv", 5120, 2880), ("gpt-oss o", 2880, 4096), ("gpt-oss router", 32, 2880),
          ("mixtral qkv", 6144, 4096), ("mixtral o", 4096, 4096)]  # (q|k|v merged for every model since stop 33)
#: (block_m, block_n, num_warps, num_stages); the first is the default (16-row tiles since stop 25; 64 before)
OPTIONS = [(16, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 2), (64, 64, 8, 3), (32, 64, 4, 4), (32, 64, 4, 2), (16, 64, 4, 3),
           (16, 64, 4, 2), (16, 128, 4, 3), (16, 128, 8, 3), (16, 32, 4, 4)]
L2_BYTES = 50 * 2**20


def _cold_copies(n: int, k: int, dev, g):
    """A random [n, k] bf16 weight and enough copies of it to exceed twice the L2 (each timed call reads them all)."""
    import torch

    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    return w, [w] + [w.clone() for _ in range(max(0, -(-2 * L2_BYTES // (w.numel() * 2)) - 1))]


def _write(args, name: str, rows: list) -> None:
    import torch

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.kernel_bench import device_tag  # (main put the project root on the path)

    name = name.replace("_h200", f"_{device_tag()}")  # (the names given say H200; the file names the card that ran)
    (out / name).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), l2_cold=True, rows=rows), indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--m-tiles", type=int, nargs="+", default=[4],
                    help="with --splits: LinearConfig.max_m_tiles values to time (row tiles a program takes beyond 16 rows)")
    ap.add_argument("--wide-from", type=int, nargs="+", default=[0],
                    help="with --splits: pdflash_kernels.linear.WIDE_FROM values to time (0: 16-row tiles only; 16: 64-row tiles above 16 rows)")
    ap.add_argument("--split-values", type=int, nargs="+", default=None,
                    help="with --splits: only these K splits (default: the shape's default and 1, 2, 4, 8, 16)")
    ap.add_argument("--only", default="", help="only the shapes whose name starts with this (e.g. gpt-oss)")
    ap.add_argument("--splits", action="store_true",
                    help="instead: the whole linear (partials + their sum) at each K split, against cuBLAS, L2-cold")
    args = ap.parse_args()
    if args.splits:
        return split_sweep(args)
    sys.path.insert(0, str(ROOT))
    import torch
    import triton.testing

    from pdflash_kernels import linear

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        w, copies = _cold_copies(n, k, dev, g)
        base = linear.linear_config(n, k, 2)
        big = torch.randn(100, k, device=dev, generator=g).bfloat16()
        default = dataclasses.replace(base, block_m=OPTIONS[0][0], block_n=OPTIONS[0][1], num_warps=OPTIONS[0][2],
                                      num_stages=OPTIONS[0][3])
        ref = linear.partials(big, w.t(), default)
        for bm, bn, warps, stages in OPTIONS:
            cfg = dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            full = linear.partials(big, w.t(), cfg)
            inv = all(torch.equal(linear.partials(big[:r], w.t(), cfg), full[:, :r]) for r in (1, 7, 16)) and \
                torch.equal(linear.partials(big[50:51], w.t(), cfg), full[:, 50:51])
            same = torch.equal(full, ref)
            for m in args.rows:
                x = big[:m].contiguous()
                us = triton.testing.do_bench_cudagraph(lambda: [linear.partials(x, c.t(), cfg) for c in copies], rep=60)
                us = us * 1e3 / len(copies)
                rows.append(dict(shape=name, N=n, K=k, M=m, split=base.split, block_m=bm, block_n=bn, num_warps=warps,
                                 num_stages=stages, us=round(us, 2), weight_gbs=round(w.numel() * 2 / us / 1e3, 1),
                                 rows_invariant=inv, same_bits=same, weight_copies=len(copies)))
                print(f"{name:15s} M={m:3d} split {base.split:2d} tile {bm:3d}x{bn:3d} warps {warps} stages {stages}: "
                      f"{us:7.2f} us {w.numel() * 2 / us / 1e3:7.1f} GB/s  rows invariant {inv}  default bits {same}", flush=True)
        del copies
    _write(args, "linear_sweep_h200.json", rows)
    best = {}
    for r in rows:
        key = (r["shape"], r["M"])
        if r["rows_invariant"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\n| shape | M | default us | best us (block_m, block_n, warps, stages) | GB/s | default bits |\n|---|---|---|---|---|---|")
    for (shape, m), r in best.items():
        d = next(x for x in rows if x["shape"] == shape and x["M"] == m and
                 (x["block_m"], x["block_n"], x["num_warps"], x["num_stages"]) == OPTIONS[0])
        print(f"| {shape} | {m} | {d['us']} | {r['us']} ({r['block_m']}, {r['block_n']}, {r['num_warps']}, {r['num_stages']}) "
              f"| {r['weight_gbs']} | {r['same_bits']} |")


def split_sweep(args) -> None:
    """The K split trades programs at one row (a split gives a decode linear enough programs to fill the GPU) against
    the float32 partials a split writes and reads back (split x M x N x 8 bytes: at 64 rows and split 8 half the bytes
    of a 2048-wide bf16 weight). The split must not follow M (a row's sum order would change with the batch), so one
    split serves every M: this times the whole linear (`partials` + the split-order sum, as `matmul` runs it) at each
    split and M against torch.matmul (cuBLAS), both over L2-cold weight copies. Writes OUT/linear_splits_h200.json."""
    sys.path.insert(0, str(ROOT))
    import torch
    import triton.testing

    from pdflash_kernels import linear

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        if not name.startswith(args.only):
            continue
        w, copies = _cold_copies(n, k, dev, g)
        base = linear.linear_config(n, k, 2)
        k_steps = -(-k // base.block_k)
        big = torch.randn(100, k, device=dev, generator=g).bfloat16()
        splits = sorted({base.split, 1, 2, 4, 8, 16} - {s for s in (16,) if k_steps < 16})
        if args.split_values:
            splits = sorted(set(args.split_values) & set(splits) | {base.split})
        for split, mt, wf in itertools.product(splits, args.m_tiles, args.wide_from):
            kps = -(-k_steps // split) * base.block_k
            cfg = dataclasses.replace(base, split=-(-k // kps), k_per_split=kps, max_m_tiles=mt)
            linear.WIDE_FROM = wf  # (read by each launch: the 100-row call below takes 64-row tiles when wf > 0)
            full = linear.partials(big, w.t(), cfg)
            # the rows alone (16-row tiles) against the same rows of 64- and 100-row calls (64-row tiles above wf)
            inv = all(torch.equal(linear.partials(big[:r], w.t(), cfg), full[:, :r]) for r in (1, 7, 16, 64))
            for m in args.rows:
                x = big[:m].contiguous()

                def ours():
                    for c in copies:
                        out = torch.empty((m, n), dtype=x.dtype, device=dev)
                        ws = linear.partials(x, c.t(), cfg)
                        if cfg.split > 1:
                            linear._reduce(ws, None, out)

                us = triton.testing.do_bench_cudagraph(ours, rep=60) * 1e3 / len(copies)
                cub = triton.testing.do_bench_cudagraph(lambda: [x @ c.t() for c in copies], rep=60) * 1e3 / len(copies)
                rows.append(dict(shape=name, N=n, K=k, M=m, split=cfg.split, max_m_tiles=mt, wide_from=wf, default_split=base.split,
                                 us=round(us, 2), cublas_us=round(cub, 2), ratio=round(us / cub, 3), rows_invariant=inv))
                print(f"{name:15s} M={m:3d} split {cfg.split:2d} m_tiles <= {mt} wide > {wf:3d}{' (default)' if cfg.split == base.split and mt == 4 else '          '}: "
                      f"{us:7.2f} us, cuBLAS {cub:7.2f} us, ratio {us / cub:5.2f}, rows invariant {inv}", flush=True)
        del copies
    _write(args, "linear_splits_h200.json", rows)
    linear.WIDE_FROM = int(linear._WIDE_FROM)
    print("\n| shape | split | m_tiles <= | 64-row tiles above | " + " | ".join(f"M={m} ratio" for m in args.rows)
          + " | worst | rows invariant |\n|---|---|---|---|" + "---|" * (len(args.rows) + 2))
    for name in dict.fromkeys(r["shape"] for r in rows):
        for split, mt, wf in sorted({(r["split"], r["max_m_tiles"], r["wide_from"]) for r in rows if r["shape"] == name}):
            rs = [r for r in rows if r["shape"] == name and (r["split"], r["max_m_tiles"], r["wide_from"]) == (split, mt, wf)]
            mark = " (default)" if rs[0]["split"] == rs[0]["default_split"] and mt == 4 else ""
            print(f"| {name} | {split}{mark} | {mt} | {wf or 'never'} | " + " | ".join(str(r["ratio"]) for r in rs)
                  + f" | {max(r['ratio'] for r in rs)} | {all(r['rows_invariant'] for r in rs)} |")


if __name__ == "__main__":
    main()
