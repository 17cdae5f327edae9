"""The MXFP4 MoE call (fragment words, as served) with one program a tile against a fixed grid of programs walking the
live tiles (pdflash_kernels.fragments.PERSIST_PER_SM, PDFLASH_FP4_PERSIST), in one process, on issue 12's cases; and,
with --direct-pairs, small calls with and without the routing launch (fragments.DIRECT_PAIRS) at the served persistent
setting; and where the served call is the one launch (fragments.ONE_LAUNCH_SHAPES), the served four launches ("o0").

    python benchmarks/persist_ab.py [--per-sm 0,2,4,8] [--direct-pairs 16,32,64,128] [--direct-persist] [--one-launch]
        [--models qwen3-30b-a3b,gpt-oss-20b]
        [--tokens 1,4,16,64] [--verify-tokens 1,2,4,8,16] [--out DIR]

Per (model, active experts, tokens per expert; `kernel_bench.routing`): the served call (`moe_forward` on the served
fragment arena, `kernel_bench.as_served`) timed as `kernel_bench.gpu_time_us` (a CUDA graph replayed; the "us (graph)"
column of kernel_bench's table) at each setting: "pN", N programs a multiprocessor (p0: one program a tile), and "dN",
calls of at most N pairs without the routing launch (each program grouping the pairs by expert itself, DIRECT_GROUP,
since stop 52; --ungrouped: each pair its own block) with the served persistent GEMMs, only on rows of at most max(N)
pairs; with --direct-persist also "dNq" (those calls on the persistent grid too, fragments.PERSIST_DIRECT); and "o0",
the served settings without the one launch, on rows whose served call takes it; with --direct-pairs also "u16" (the
served form before stop 54's fragments.DIRECT_SHAPES: one-pair blocks up to 16 pairs, routed above). With --verify-tokens, also
verify-shaped calls (A = "rand": T tokens, each routed to k distinct experts drawn uniformly, as an untrained router
spreads a verify's tokens; the distinct experts in "experts"). The settings interleaved round by round, every setting's
output checked bit-identical to the first's (the same tile programs, the same sums). Prints a table; writes
persist_ab_<device>.json (`kernel_bench.device_tag`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_bench import (MODELS, UP_ONLY_MODELS, as_served, copy_rate, device_tag, gpu_time_us,  # noqa: E402
                                     hf_experts, routing, verify_routing)

SHAPES = {**MODELS, **UP_ONLY_MODELS}  # (up-only experts, Nemotron 3 Nano: fragment words since stop 64)


def row_settings(settings: dict, pairs: int, direct: tuple[int, ...], one_launch: bool) -> dict:
    """The settings a row of `pairs` pairs runs: every pN; dN where the row has at most max(direct) pairs (the dN
    columns time the routing launch's skip); o0 where the served call takes the one launch; o1 (the one launch forced)
    on rows of 17 to 128 pairs (the one launch's most; below, the routing-free call is served)."""
    return {n: c for n, c in settings.items()
            if n[0] in "pu" or (n[0] == "d" and direct and pairs <= max(direct)) or (n == "o0" and one_launch)
            or (n == "o1" and 16 < pairs <= 128)}


def run(per_sm: list[int], models: list[str], tokens: list[int], rounds: int, direct: tuple[int, ...] = (),
        verify_tokens: tuple[int, ...] = (), direct_persist: bool = False, group: bool = True,
        one_launch: bool = False) -> dict:
    from pdflash_kernels import fragments as F
    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.moe import moe_forward

    rate = copy_rate()
    rows = []
    served = dict(PERSIST_PER_SM=F.PERSIST_PER_SM, PERSIST_PAIRS=F.PERSIST_PAIRS, DIRECT_PAIRS=F.DIRECT_PAIRS,
                  PERSIST_DIRECT=F.PERSIST_DIRECT, DIRECT_GROUP=F.DIRECT_GROUP,
                  ONE_LAUNCH_PAIRS=F.ONE_LAUNCH_PAIRS)
    settings = {f"p{p}": dict(PERSIST_PER_SM=p) for p in per_sm}
    settings.update({f"d{d}": dict(PERSIST_PER_SM=served["PERSIST_PER_SM"], DIRECT_PAIRS=d, DIRECT_GROUP=group)
                     for d in direct})
    if direct_persist:  # dNq: the routing-free calls on the persistent grid too (fragments.PERSIST_DIRECT)
        settings.update({f"d{d}q": dict(PERSIST_PER_SM=served["PERSIST_PER_SM"], DIRECT_PAIRS=d, PERSIST_DIRECT=True,
                                        DIRECT_GROUP=group) for d in direct})
    # o0: the served settings without the one launch (fragments.ONE_LAUNCH_SHAPES: gpt-oss-20b's 8-128 pairs on the H200),
    # on the rows whose served call takes it (there every pN column times the one launch, which has no persistent form)
    settings["o0"] = dict(PERSIST_PER_SM=served["PERSIST_PER_SM"], ONE_LAUNCH_PAIRS=0)
    if one_launch:  # o1: the one launch on every call of 17-128 pairs (routing-free calls only up to DIRECT_BASE pairs,
        # so Qwen3's 17-128 pair calls, served routing-free by DIRECT_SHAPES, take it too)
        settings["o1"] = dict(PERSIST_PER_SM=served["PERSIST_PER_SM"], ONE_LAUNCH_PAIRS=128, DIRECT_PAIRS=F.DIRECT_BASE)
    if direct:  # u16: the served form before stop 54's DIRECT_SHAPES (one-pair blocks up to 16 pairs, routed above)
        settings["u16"] = dict(PERSIST_PER_SM=served["PERSIST_PER_SM"], DIRECT_PAIRS=F.DIRECT_BASE, DIRECT_GROUP=False,
                               PERSIST_DIRECT=False)
    for model in models:
        e, k, h, i = SHAPES[model]
        mod = hf_experts(model)
        w = as_served(expert_weights(mod, "mxfp4"))
        del mod
        if not isinstance(w, F.FragmentExperts):
            raise SystemExit(f"{model}: the served experts are not fragment words here (no Gluon?): nothing to compare")
        r1 = 2 * i if w.gated else i  # w1's rows (up-only experts: the I up rows alone)
        bias = (r1 + h) * 2 if w.b1 is not None else 0
        per = r1 * h // 2 + r1 * h // 32 + h * i // 2 + h * i // 32 + bias
        cases = [(a, t) for a in (8, 32, 128) if k <= a <= e for t in tokens] + [("rand", t) for t in verify_tokens]
        for active, tpe in cases:
            if active == "rand":
                x, ids, wts = verify_routing(e, k, h, tpe, torch.Generator(device="cuda").manual_seed(tpe))
            else:
                x, ids, wts = routing(e, k, h, active, tpe)
            one = F.call_path(ids.shape[0], k, h, i, *F.frag_config(h, i, ids.numel()), w.gated) == "one"  # (as served)
            here = row_settings(settings, ids.numel(), direct, one)
            outs, times = {}, {n: [] for n in here}
            with torch.inference_mode():
                for r in range(rounds):
                    for n, c in here.items():
                        for attr, v in {**served, **c}.items():  # (each setting from the served ones, not the last's)
                            setattr(F, attr, v)
                        # pN: every case persistent, whatever pairs bound is served; dN: the served bounds
                        F.PERSIST_PAIRS = 1 << 30 if n[0] == "p" else served["PERSIST_PAIRS"]
                        if r == 0:
                            outs[n] = moe_forward(x, ids, wts, w, e).clone()
                        times[n].append(gpu_time_us(lambda: moe_forward(x, ids, wts, w, e)))
            for attr, v in served.items():
                setattr(F, attr, v)
            first = next(iter(here))
            same = all(torch.equal(outs[n], outs[first]) for n in here)
            experts = int(ids.unique().numel())
            nbytes = experts * per
            us = {n: min(ts) for n, ts in times.items()}
            best = min(us, key=us.get)
            rows.append(dict(model=model, active_experts=active, tokens_per_expert=tpe, pairs=ids.numel(), experts=experts,
                             weight_bytes=nbytes, us={n: round(v, 2) for n, v in us.items()},
                             hbm_fraction={n: round(nbytes / (v * 1e-6) / rate, 3) for n, v in us.items()},
                             best=best, bit_identical=same, one_launch_served=one))
            print(f"{model:14s} A={active!s:>4} T={tpe:2d} E={experts:3d} " + "  ".join(f"{n}: {v:7.1f} us" for n, v in us.items())
                  + f"  best {best}  same {same}", flush=True)
        del w
        torch.cuda.empty_cache()
    for attr, v in served.items():
        setattr(F, attr, v)
    return dict(device=torch.cuda.get_device_name(), copy_rate_bytes_per_s=rate, per_sm=per_sm, rounds=rounds,
                direct_pairs=list(direct), verify_tokens=list(verify_tokens), settings=list(settings), served=served,
                sm_count=torch.cuda.get_device_properties(0).multi_processor_count, rows=rows)


def table(res: dict) -> list[str]:
    names = res.get("settings") or [f"p{p}" for p in res["per_sm"]]
    first = names[0]
    lines = [f"# MXFP4 MoE call: one program a tile (p0), N programs a multiprocessor (pN), calls of up to N pairs without "
             f"the routing launch (dN), the served call without the one launch (o0) ({res['device']})",
             "", "`python benchmarks/persist_ab.py`; us = CUDA-graph replay, best of the rounds; % = of the copy rate "
             f"({res['copy_rate_bytes_per_s'] / 1e12:.2f} TB/s) on the distinct experts' bytes; - = not run at that size; "
             "A = rand: T tokens, each one's top-k drawn uniformly (a verify under an untrained router)", "",
             "| model | A | T | pairs | experts | " + " | ".join(f"{n} us" for n in names) + f" | best | best % | {first} % | same bits |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|"]
    for r in res["rows"]:
        fix = (lambda d: d) if "settings" in res else (lambda d: {f"p{n}": v for n, v in d.items()})  # (stop 50's file)
        us, frac, b = fix(r["us"]), fix(r["hbm_fraction"]), str(r["best"])
        b = b if "settings" in res else f"p{b}"
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['pairs']} | "
                     + f"{r.get('experts', r['active_experts'])} | "
                     + " | ".join(str(us.get(n, "-")) for n in names)
                     + f" | {b} | {frac[b]:.0%} | {frac[first]:.0%} | {r['bit_identical']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-sm", default="0,2,4,8", help="programs a multiprocessor to compare (0: one program a tile)")
    ap.add_argument("--direct-pairs", default="", help="DIRECT_PAIRS values to compare on calls of at most the largest "
                    "(e.g. 16,32,64; empty: none)")
    ap.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per active expert")
    ap.add_argument("--verify-tokens", default="", help="verify-shaped rows: token counts, each token's top-k drawn "
                    "uniformly (A = rand; e.g. 1,2,4,8,16; empty: none)")
    ap.add_argument("--direct-persist", action="store_true", help="also dNq: the routing-free calls on the persistent "
                    "grid (PDFLASH_FP4_PERSIST_DIRECT)")
    ap.add_argument("--ungrouped", action="store_true", help="dN: each pair its own block (DIRECT_GROUP off; "
                    "default: on, each program grouping the pairs by expert)")
    ap.add_argument("--one-launch", action="store_true", help="also o1: the one launch forced on calls of 17-128 pairs "
                    "(PDFLASH_FP4_ONE_LAUNCH_PAIRS=128, routing-free calls only up to 16 pairs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    per_sm = [int(p) for p in args.per_sm.split(",")]
    models = [m for m in args.models.split(",") if m]
    direct = tuple(int(d) for d in args.direct_pairs.split(",") if d)
    bad = [m for m in models if m not in SHAPES] + [p for p in per_sm if not 0 <= p <= 16] + [d for d in direct if not 0 <= d <= 128]
    if bad:
        ap.error(f"unknown models, --per-sm outside 0..16 or --direct-pairs outside 0..128: {bad}")
    if not torch.cuda.is_available():
        raise SystemExit("persist_ab.py times CUDA kernels: no CUDA device here")
    verify = tuple(int(t) for t in args.verify_tokens.split(",") if t)
    res = run(per_sm, models, [int(t) for t in args.tokens.split(",")], args.rounds, direct, verify, args.direct_persist,
              not args.ungrouped, args.one_launch)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"persist_ab_{device_tag()}"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    lines = table(res)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
