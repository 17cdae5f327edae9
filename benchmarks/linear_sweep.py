"""The batch-invariant linear's launch options at the verify forward's shapes: time per call, weight bandwidth, and
whether each option gives the default's bits (the K partials compared exactly) at several row counts.

    python benchmarks/linear_sweep.py --out OUT     (on the GPU machine: bash benchmarks/gpu.sh OUT linear)

The tiles and the K split stay those of `kernels.linear.linear_config` (they set what each output element adds, in
which order); only num_warps and num_stages vary. An option is usable only where its bits equal the default's
everywhere. Writes OUT/linear_sweep_h200.json and prints a table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: (name, N, K): the decode forward's projections (Qwen3-30B-A3B: hidden 2048, 32 q + 4 kv heads of 128, 128 experts;
#: gpt-oss-20b: hidden 2880, 64 q + 8 kv heads of 64, 32 experts; LM heads of the benchmarks' 4096-token vocabulary)
SHAPES = [("qwen3 qkv", 5120, 2048), ("qwen3 o", 2048, 4096), ("qwen3 router", 128, 2048), ("qwen3 lm_head", 4096, 2048),
          ("gpt-oss qkv", 5120, 2880), ("gpt-oss o", 2880, 4096), ("gpt-oss router", 32, 2880)]
OPTIONS = [(4, 4), (4, 3), (4, 2), (8, 4), (8, 3), (8, 2)]  # (num_warps, num_stages); the first is the default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    import triton.testing

    from kernels import linear

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
        base = linear.linear_config(n, k, 2)
        xs = {m: torch.randn(m, k, device=dev, generator=g).bfloat16() for m in sorted({*args.rows, 7, 100})}
        ref = {m: linear.partials(x, w.t(), dataclasses.replace(base, num_warps=4, num_stages=4)) for m, x in xs.items()}
        for warps, stages in OPTIONS:
            cfg = dataclasses.replace(base, num_warps=warps, num_stages=stages)
            same = all(torch.equal(linear.partials(x, w.t(), cfg), ref[m]) for m, x in xs.items())
            for m in args.rows:
                x = xs[m]
                us = triton.testing.do_bench_cudagraph(lambda: linear.partials(x, w.t(), cfg), rep=50) * 1e3
                rows.append(dict(shape=name, N=n, K=k, M=m, split=base.split, num_warps=warps, num_stages=stages,
                                 us=round(us, 2), weight_gbs=round(w.numel() * 2 / us / 1e3, 1), same_bits=same))
                print(f"{name:15s} M={m:3d} split {base.split:2d} warps {warps} stages {stages}: {us:7.2f} us "
                      f"{w.numel() * 2 / us / 1e3:7.1f} GB/s  same bits {same}", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_sweep_h200.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1) + "\n")
    best = {}
    for r in rows:
        key = (r["shape"], r["M"])
        if r["same_bits"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\n| shape | M | default us | best us (warps, stages) | GB/s |\n|---|---|---|---|---|")
    for (shape, m), r in best.items():
        d = next(x for x in rows if x["shape"] == shape and x["M"] == m and (x["num_warps"], x["num_stages"]) == OPTIONS[0])
        print(f"| {shape} | {m} | {d['us']} | {r['us']} ({r['num_warps']}, {r['num_stages']}) | {r['weight_gbs']} |")


if __name__ == "__main__":
    main()
