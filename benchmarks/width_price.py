"""The verify width's cost cap (drafter_svc.width) against modelled offloaded round times: no GPU, no model.

A round's time is modelled as an offloaded gpt-oss-20b-shaped verify on the H200 (benchmarks/results/offload_h200.md):
3.9 ms of compute + 0.1 ms per verified token, plus the PCIe copy (54 GB/s) of the non-resident part (60%, a 25%
cache's measured block-1 hit rate of 0.4) of the union of the experts the n verified tokens route, at random (32
experts top-4: 4, 7.5, 10.6, ... of a layer's experts for n = 1, 2, 3; 24 layers, 13.2 MB a slice), +-3% noise.
Cache effects of wider rounds (evictions) are not modelled: the GPU rows of benchmarks/offload.py measure those.

Drafters: `replay3` proposes the reference continuation with every 3rd output position wrong (benchmarks/offload.py's
replay drafter: tau ~3), `geo A` accepts each draft with probability A. Requests share one RoundCost per run, as a
drafter kind's sessions do in the stack; `offloaded` is known up front (the verifier's model info).

    python benchmarks/width_price.py   # prints a table, writes benchmarks/results/width_price_model.{json,md}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_svc.width import RoundCost, VerifyWidth  # noqa: E402

EXPERTS, TOP_K, LAYERS, SLICE, RATE, COMPUTE_MS, PER_TOKEN_MS, MISS = 32, 4, 24, 13.2e6, 54e9, 3.9, 0.1, 0.6


def union(n: int) -> float:
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** n)


def round_bytes(n: int) -> float:
    return LAYERS * union(n) * MISS * SLICE


def round_ms(n: int, rng: random.Random) -> float:
    return (COMPUTE_MS + PER_TOKEN_MS * n + round_bytes(n) / RATE * 1e3) * rng.uniform(0.97, 1.03)


def run(drafter: str, block: int, requests: int, new_tokens: int, seed: int, cost_aware: bool = True) -> dict:
    rng = random.Random(seed)
    cost = RoundCost(offloaded=True)
    tokens = ms = moved = rounds = 0
    for _ in range(requests):
        w = VerifyWidth(block, cost=cost, cost_aware=cost_aware)
        out = 0
        while out < new_tokens:
            k = min(w.drafts(), new_tokens - out - 1)
            run_ = 0
            if drafter == "replay3":
                while run_ < k and (out + run_) % 3 != 2:
                    run_ += 1
            else:
                a = float(drafter.split()[1])
                while run_ < k and rng.random() < a:
                    run_ += 1
            t = round_ms(k + 1, rng)
            w.observe(run_, k, t, True)
            out += run_ + 1
            ms += t
            moved += round_bytes(k + 1)
            rounds += 1
        tokens += out
    return {"tok_per_s": tokens / ms * 1e3, "mb_per_token": moved / tokens / 1e6, "tau": tokens / rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    rows = []
    for drafter in ("replay3", "geo 0.5", "geo 0.7", "geo 0.85", "geo 0.95"):
        for requests, new_tokens in ((2, 32), (4, 128)):
            def mean(block, cost_aware=True):
                rs = [run(drafter, block, requests, new_tokens, s, cost_aware) for s in range(args.seeds)]
                return {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]}

            one, capped, growth = mean(1), mean(16), mean(16, cost_aware=False)
            rows.append({"drafter": drafter, "requests": requests, "new_tokens": new_tokens, "block1": one,
                         "cost_cap": capped, "growth_only": growth,
                         "cost_cap_vs_block1": capped["tok_per_s"] / one["tok_per_s"],
                         "growth_only_vs_block1": growth["tok_per_s"] / one["tok_per_s"]})
    head = ("| drafter | requests x tokens | block 1 tok/s | MB/token | block 16, cost cap: tok/s (x block 1) | MB/token | tau "
            "| block 16, growth rule alone: tok/s (x block 1) | MB/token |")
    lines = ["# The verify width against modelled offloaded round times (`python benchmarks/width_price.py`)", "",
             "Round times are a model (gpt-oss-20b shapes, 25% cache, H200 PCIe; see the script's docstring), not a "
             "measurement; benchmarks/offload.py measures the same rule on the GPU.", "", head,
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, c, g = r["block1"], r["cost_cap"], r["growth_only"]
        lines.append(f"| {r['drafter']} | {r['requests']} x {r['new_tokens']} | {o['tok_per_s']:.1f} | {o['mb_per_token']:.0f} | "
                     f"{c['tok_per_s']:.1f} ({r['cost_cap_vs_block1']:.2f}) | {c['mb_per_token']:.0f} | {c['tau']:.2f} | "
                     f"{g['tok_per_s']:.1f} ({r['growth_only_vs_block1']:.2f}) | {g['mb_per_token']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "width_price_model.json").write_text(json.dumps({"rows": rows}, indent=1))
    (out / "width_price_model.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
