"""The device-managed expert cache's host work per verify, without a GPU: what `begin()` (the projected union into the
cache's projection row), `collect()` (the per-expert codes read back and counted, the guess's gate) and the verifier
core's counter bookkeeping (`CacheStats` before/after, the union's stored bytes) cost on the host each round.

On the H200 this work sat between forwards: stop 26 measured rounds 2.1 ms (gpt-oss-20b shapes, 24 layers) and 3.7 ms
(Qwen3-30B-A3B shapes, 48 layers) longer than their forwards with every expert cached, 0.7 and 1.4 ms after numpy took
over begin() and collect() (benchmarks/results/offload_h200.md, gpu_runs_h200.md "Stop 26").

    python benchmarks/cache_host.py [--layers 48] [--experts 128] [--projected 8 30] [--rounds 300]

Prints a table and writes benchmarks/results/cache_host_cpu.json. One CPU thread for torch; the CPU's own speed sets
the figures (the GPU host's cores are faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdflash_kernels.mxfp4 import ExpertLayout  # noqa: E402
from pdflash.types import union_bytes  # noqa: E402
from verifier_svc.device_cache import DeviceExpertCache  # noqa: E402
from verifier_svc.expert_store import GateLayout, HostExpertStore  # noqa: E402


def measure(layers: int, experts: int, projected: int, rounds: int) -> dict:
    """ms per round of each part, on a cache of `layers` x `experts` (tiny slices: only the bookkeeping is timed)."""
    store = HostExpertStore(ExpertLayout(64, 64, False), {layer: experts for layer in range(layers)},
                            GateLayout(1, 64, 0, 1.0, 7.0))
    cache = DeviceExpertCache(store, experts + layers * max(1, experts // 4), torch.device("cpu"), need=experts)
    rng = random.Random(0)
    union = {layer: frozenset(rng.sample(range(experts), projected)) for layer in range(layers)}
    byte_map = store.byte_map()
    parts = {"begin": 0.0, "collect": 0.0, "stats": 0.0}
    for i in range(rounds + rounds // 10):
        if i == rounds // 10:  # the first tenth warms up
            parts = dict.fromkeys(parts, 0.0)
        t0 = time.perf_counter()
        before = dataclasses.replace(cache.stats)
        cache.begin(union)
        t1 = time.perf_counter()
        cache.collect(3.0, 16)
        t2 = time.perf_counter()
        cache.stats.minus(before)
        union_bytes(union, byte_map)
        t3 = time.perf_counter()
        parts["begin"] += t1 - t0
        parts["collect"] += t2 - t1
        parts["stats"] += t3 - t2
    out = {k: round(v / rounds * 1e3, 4) for k, v in parts.items()}
    out["total"] = round(sum(out.values()), 4)
    return {"layers": layers, "experts": experts, "projected_per_layer": projected, "ms_per_round": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--projected", type=int, nargs="+", default=[8, 30], help="projected experts per layer")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache_host_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(layers, args.experts, p, args.rounds) for layers in args.layers for p in args.projected]
    print("| layers | experts | projected a layer | begin ms | collect ms | stats ms | total ms a round |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["ms_per_round"]
        print(f"| {r['layers']} | {r['experts']} | {r['projected_per_layer']} | {m['begin']} | {m['collect']} | {m['stats']} | {m['total']} |")
    pathlib.Path(args.out).write_text(json.dumps({"command": "python benchmarks/cache_host.py " + " ".join(argv or sys.argv[1:]),
                                                 "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
