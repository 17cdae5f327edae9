"""The MXFP4 MoE call (fragment words, as served) with one program a tile against a fixed grid of programs walking the
live tiles (pdflash_kernels.fragments.PERSIST_PER_SM, PDFLASH_FP4_PERSIST), in one process, on issue 12's cases.

    python benchmarks/persist_ab.py [--per-sm 0,2,4,8] [--models qwen3-30b-a3b,gpt-oss-20b] [--tokens 1,4,16,64]
        [--out DIR]

Per (model, active experts, tokens per expert; `kernel_bench.routing`): the served call (`moe_forward` on the served
fragment arena, `kernel_bench.as_served`) timed as `kernel_bench.gpu_time_us` (a CUDA graph replayed; the "us (graph)"
column of kernel_bench's table) at each programs-a-multiprocessor setting (0: one program a tile, today's default),
the settings interleaved round by round, and every setting's output checked bit-identical to setting 0's (the same
tile programs). Prints a table; writes persist_ab_<device>.json (`kernel_bench.device_tag`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_bench import MODELS, as_served, copy_rate, device_tag, gpu_time_us, hf_experts, routing  # noqa: E402


def run(per_sm: list[int], models: list[str], tokens: list[int], rounds: int) -> dict:
    from pdflash_kernels import fragments as F
    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.moe import moe_forward

    rate = copy_rate()
    rows = []
    F.PERSIST_PAIRS = 1 << 30  # (every case compared, whatever pairs bound is served)
    for model in models:
        e, k, h, i = MODELS[model]
        mod = hf_experts(model)
        w = as_served(expert_weights(mod, "mxfp4"))
        del mod
        if not isinstance(w, F.FragmentExperts):
            raise SystemExit(f"{model}: the served experts are not fragment words here (no Gluon?): nothing to compare")
        bias = (2 * i + h) * 2 if w.b1 is not None else 0
        per = 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32 + bias
        for active in (8, 32, 128):
            if active > e or active < k:
                continue
            for tpe in tokens:
                x, ids, wts = routing(e, k, h, active, tpe)
                outs, times = {}, {p: [] for p in per_sm}
                with torch.inference_mode():
                    for r in range(rounds):
                        for p in per_sm:
                            F.PERSIST_PER_SM = p
                            if r == 0:
                                outs[p] = moe_forward(x, ids, wts, w, e).clone()
                            times[p].append(gpu_time_us(lambda: moe_forward(x, ids, wts, w, e)))
                F.PERSIST_PER_SM = 0
                same = all(torch.equal(outs[p], outs[per_sm[0]]) for p in per_sm)
                nbytes = active * per
                us = {p: min(ts) for p, ts in times.items()}
                best = min(us, key=us.get)
                rows.append(dict(model=model, active_experts=active, tokens_per_expert=tpe, pairs=ids.numel(),
                                 weight_bytes=nbytes, us={str(p): round(v, 2) for p, v in us.items()},
                                 hbm_fraction={str(p): round(nbytes / (v * 1e-6) / rate, 3) for p, v in us.items()},
                                 best=best, bit_identical=same))
                r = rows[-1]
                print(f"{model:14s} A={active:3d} T={tpe:2d} " + "  ".join(f"p{p}: {us[p]:7.1f} us" for p in per_sm)
                      + f"  best p{best}  same {same}", flush=True)
        del w
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), copy_rate_bytes_per_s=rate, per_sm=per_sm, rounds=rounds,
                sm_count=torch.cuda.get_device_properties(0).multi_processor_count, rows=rows)


def table(res: dict) -> list[str]:
    ps = res["per_sm"]
    lines = [f"# MXFP4 MoE call, one program a tile (p0) against PERSIST_PER_SM programs a multiprocessor ({res['device']})",
             "", "`python benchmarks/persist_ab.py`; us = CUDA-graph replay, best of the rounds; % = of the copy rate "
             f"({res['copy_rate_bytes_per_s'] / 1e12:.2f} TB/s)", "",
             "| model | A | T | pairs | " + " | ".join(f"p{p} us" for p in ps) + " | best | best % | p0 % | same bits |",
             "|---|---|---|---|" + "---|" * len(ps) + "---|---|---|---|"]
    for r in res["rows"]:
        b = str(r["best"])
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['pairs']} | "
                     + " | ".join(str(r["us"][str(p)]) for p in ps)
                     + f" | p{b} | {r['hbm_fraction'][b]:.0%} | {r['hbm_fraction'][str(ps[0])]:.0%} | {r['bit_identical']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-sm", default="0,2,4,8", help="programs a multiprocessor to compare (0: one program a tile)")
    ap.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per active expert")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    per_sm = [int(p) for p in args.per_sm.split(",")]
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS] + [p for p in per_sm if not 0 <= p <= 16]
    if bad:
        ap.error(f"unknown models or settings out of 0..16: {bad}")
    if not torch.cuda.is_available():
        raise SystemExit("persist_ab.py times CUDA kernels: no CUDA device here")
    res = run(per_sm, models, [int(t) for t in args.tokens.split(",")], args.rounds)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"persist_ab_{device_tag()}"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    lines = table(res)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
