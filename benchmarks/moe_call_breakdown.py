"""Where a whole fragment MoE call's time goes (a probe, not a benchmark): the served call on MXFP4 fragment words
(`pdflash_kernels.fragments.fragment_moe`) timed as a forward pays it (`gpu_time_us_each` over 4 copies of the experts:
no graph launch a call, weights not L2-hot), beside the same call with pieces left out: the routing computed once
outside the graph (so the gate/up, down and combine launches alone), without the combine, each launch alone. The
differences are what each launch adds in sequence, the gaps between launches included: the price of the routing launch
and of the combine launch on small calls, where the goal (60% of the copy rate) is furthest. direct: the same call
without the routing launch (`fragments.fragment_moe(direct=True)`, each pair its own block; calls of at most 16 pairs),
its bits checked equal to the served call's first.

    python benchmarks/moe_call_breakdown.py [--cases gpt-oss-20b:4:1,qwen3-30b-a3b:8:1] [--out DIR]   (GPU; ~1 minute)

Cases are model:active experts:tokens per expert. Output: a table (us, and the share of the whole call) and
moe_call_breakdown.json in --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.frag_gemm_probe import fragment_copies  # noqa: E402
from benchmarks.kernel_bench import MODELS, copy_rate, gpu_time_us_each, routing  # noqa: E402

CASES = "gpt-oss-20b:4:1,gpt-oss-20b:8:1,gpt-oss-20b:32:1,qwen3-30b-a3b:8:1,qwen3-30b-a3b:8:16,qwen3-30b-a3b:32:1," \
        "qwen3-30b-a3b:128:1,mixtral-8x7b:8:1"
PIECES = ("whole", "four_launches", "direct", "no_routing", "gemms", "gate_up", "down", "routing", "combine")
DIRECT_MOST = 16  # the calls the routing-free path (fragment_moe(direct=True)) is timed on


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    out = []
    for c in (c for c in text.split(",") if c.strip()):
        parts = c.strip().split(":")
        if len(parts) != 3 or parts[0] not in MODELS or not (parts[1].isdigit() and parts[2].isdigit()):
            raise ValueError(f"a case is model:active:tokens with model one of {sorted(MODELS)}, got {c!r}")
        e, k = MODELS[parts[0]][:2]
        active, tpe = int(parts[1]), int(parts[2])
        if not (k <= active <= e) or tpe < 1 or active * tpe % k:
            raise ValueError(f"{c!r}: active experts from top-k {k} to {e}, tokens per expert >= 1, active x tokens a "
                             f"multiple of {k}")
        out.append((parts[0], active, tpe))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    cases = parse_cases(args.cases)
    from pdflash_kernels import fragments as F
    from pdflash_kernels import moe as M

    rate = copy_rate()
    rows = []
    for model, active, tpe in cases:
        e, k, h, i = MODELS[model]
        copies = fragment_copies(model)
        fw0 = copies[0]
        x, ids, wts = routing(e, k, h, active, tpe)
        t = x.shape[0]
        t1, t2 = F.frag_config(h, i, t * k)
        with torch.inference_mode():
            r = M.align_fused(ids, e, 16)
            hbuf = torch.empty((r.max_blocks * 16, i), dtype=torch.bfloat16, device="cuda")
            ybuf = torch.empty((r.num_pairs, h), dtype=torch.float32, device="cuda")
            out = torch.empty((t, h), dtype=x.dtype, device="cuda")
            rw = wts.reshape(-1).contiguous()
            block = min(1024, M.triton_next_pow2(h))

            def gate_up(fw):
                F._launch(x, r, fw.w1, fw.s1, hbuf, i, k, 1, t1, 0, fw.b1, fw.act, fw.row_mul, fw.up_off,
                          alpha=fw.alpha, limit=fw.limit)

            def down(fw):
                F._launch(hbuf, r, fw.w2, fw.s2, ybuf, h, k, 2, t2, 0, fw.b2, rw=rw)

            def combine():
                M._moe_combine[(t, F.triton_cdiv(h, block))](ybuf, r.pair_valid, out, h, TOPK=k, BLOCK=block,
                                                              EMULATE=False, **M.runtime.pdl_launch())

            def four(fw):  # routed, four launches (neither the one launch nor the routing-free call)
                saved, F.ONE_LAUNCH_PAIRS = F.ONE_LAUNCH_PAIRS, 0
                try:
                    return F.fragment_moe(x, ids, wts, fw, e, direct=False)
                finally:
                    F.ONE_LAUNCH_PAIRS = saved

            # the pieces compute the served call's bits (routing from outside the graph: the same blocks)
            served = F.fragment_moe(x, ids, wts, fw0, e)
            gate_up(fw0), down(fw0), combine()
            if not torch.equal(out, served) or not torch.equal(four(fw0), served):
                raise AssertionError(f"{model} A={active} T={tpe}: the pieces do not give the served call's bits")
            direct = t * k <= DIRECT_MOST and t1.split == 1 and t2.split == 1
            if direct and not torch.equal(F.fragment_moe(x, ids, wts, fw0, e, config=(t1, t2), direct=True), served):
                raise AssertionError(f"{model} A={active} T={tpe}: the call without the routing launch changed the bits")
            calls = {
                "whole": [lambda fw=fw: F.fragment_moe(x, ids, wts, fw, e) for fw in copies],
                "four_launches": [lambda fw=fw: four(fw) for fw in copies],
                "direct": [lambda fw=fw: F.fragment_moe(x, ids, wts, fw, e, config=(t1, t2), direct=True) for fw in copies]
                if direct else None,
                "no_routing": [lambda fw=fw: (gate_up(fw), down(fw), combine()) for fw in copies],
                "gemms": [lambda fw=fw: (gate_up(fw), down(fw)) for fw in copies],
                "gate_up": [lambda fw=fw: gate_up(fw) for fw in copies],
                "down": [lambda fw=fw: down(fw) for fw in copies],
                "routing": [lambda: M.align_fused(ids, e, 16) for _ in copies],
                "combine": [combine for _ in copies],
            }
            nbytes = active * sum(getattr(fw0, n)[0].numel() * 4 for n in ("w1", "s1", "w2", "s2"))
            row = dict(model=model, active_experts=active, tokens_per_expert=tpe, pairs=t * k, tiles=f"{t1},{t2}",
                       one_launch=F.one_launch_refusal(t, k, h, i, t1, t2) is None, weight_bytes=nbytes)
            for name, fns in calls.items():
                row[f"{name}_us"] = round(gpu_time_us_each(fns), 2) if fns else None
            row["whole_fraction"] = round(nbytes / (row["whole_us"] * 1e-6) / rate, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del copies, fw0
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s. us as a forward pays them (4 copies of "
          "the experts back to back in one graph); whole = the served call (one launch where it takes it)")
    head = ["case", "pairs", "tiles", "one launch", "of copy"] + list(PIECES)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r['model']} A={r['active_experts']} T={r['tokens_per_expert']}", str(r["pairs"]), r["tiles"],
                 "yes" if r["one_launch"] else "no", f"{r['whole_fraction']:.2f}"] + [f"{r[f'{p}_us']}" for p in PIECES]
        print("| " + " | ".join(cells) + " |")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_call_breakdown.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "copy_rate": rate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
