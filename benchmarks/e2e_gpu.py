"""The verify loop on the GPU, in process (VerifierCore + drafters, no RPC): the ceiling the stack can reach on
one GPU, next to transformers' own greedy decoding on the same GPU.

    python benchmarks/e2e_gpu.py [--out DIR] [--new-tokens 128] [--targets demo qwen3-8l]

Targets: the embedded demo pair (trained, 25 MB) and Qwen3-30B-A3B layer shapes with 8 layers (random bf16 weights,
built on the GPU). Rows: transformers greedy `generate` (stock kernels); the verifier with the batch-invariant
kernels at block 1 (plain decoding), with n-gram drafting (block 16, adaptive width), and with a replay drafter
that proposes the block-1 continuation with every 4th draft wrong (tau ~ 4, labelled as such). `identical`: the
mode's tokens equal block 1's. `forward_ms`: the verify forward per round; `byte_time_ms`: the bytes that forward
reads (dense weights + the round's routed experts) at the measured device-copy rate; `round_other_ms`: the rest
of a round (acceptance, drafting, host work). Verify forwards replay CUDA graphs on the paged KV (as served).
Writes e2e_gpu_h200.json / .md to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels import copy_rate  # noqa: E402
from benchmarks.inprocess import core_run, ngram_propose  # noqa: E402
from verifier_svc.engine import PagedKVOptions, VerifierCore  # noqa: E402


def build(target: str):
    """(stock transformers model, prompts, directory) for a target."""
    from transformers import AutoModelForCausalLM

    from pdflash.defaults import default_target_dir
    from pdflash.tiny import real_shape_config

    if target == "demo":
        d = pathlib.Path(default_target_dir())
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
        prompts = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[:4]
        return model, [p[:128] for p in prompts], d
    layers = int(target.split("-")[1].rstrip("l"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(real_shape_config("qwen3_moe", num_layers=layers), dtype=torch.bfloat16)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(128)] for _ in range(4)]
    return model, prompts, pathlib.Path(f"/tmp/{target}")


def hf_greedy(model, prompts, new: int) -> dict:
    toks, t0 = 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        toks += out.shape[1] - ids.shape[1]
    torch.cuda.synchronize()
    return {"tok_s": toks / (time.perf_counter() - t0)}


def replay(reference, every=4):
    def propose(i, prompt, out, k, state):
        n = len(out)
        drafts = list(reference[i][n : n + k])
        return [(t - 1 if t > 2 else t + 1) if (n + j) % every == every - 1 else t for j, t in enumerate(drafts)]

    return propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["demo", "qwen3-8l"])
    args = ap.parse_args()
    rate = copy_rate()
    rows = []
    from verifier_svc.model import wrap_model

    for target in args.targets:
        model, prompts, d = build(target)
        model.eval()
        with torch.inference_mode():
            hf = hf_greedy(model, prompts, args.new_tokens)
        rows.append({"target": target, "mode": "transformers greedy (stock kernels)", "tok_s": round(hf["tok_s"], 1)})
        print(rows[-1], flush=True)
        t = wrap_model(model, d, kernels="on")
        core = VerifierCore(t, max_block_size=32, max_tokens_limit=4096, paged_kv=PagedKVOptions(kv_cache_gb=8))  # as served: paged KV, CUDA graphs
        dense = sum(p.numel() * p.element_size() for p in model.parameters()) - t.total_expert_bytes
        base = core_run(core, prompts, args.new_tokens, 1)
        modes = [("verifier block 1", base)]
        modes.append(("verifier ngram@16", core_run(core, prompts, args.new_tokens, 16, ngram_propose)))
        modes.append(("verifier replay@16 (block-1 output, every 4th draft wrong)", core_run(core, prompts, args.new_tokens, 16, replay(base["outputs"]))))
        for name, r in modes:
            n = r["rounds"]
            fwd, per_forward = r["forward_ms"] / n, dense + r["routed_bytes"] / n
            row = {"target": target, "mode": name, "tok_s": round(r["tok_per_s"], 1), "tau": round(r["tokens"] / n, 2),
                   "forward_ms": round(fwd, 3), "byte_time_ms": round(per_forward / rate * 1e3, 4),
                   "round_other_ms": round(r["wall_s"] * 1e3 / n - fwd, 3), "identical": r["outputs"] == base["outputs"],
                   "batch_invariant": t.batch_invariant}
            rows.append(row)
            print(row, flush=True)
        del core, t, model
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "copy_rate_bytes_per_s": rate, "new_tokens": args.new_tokens, "rows": rows}
    (out / "e2e_gpu_h200.json").write_text(json.dumps(result, indent=1))
    md = ["# The verify loop on the GPU, in process (`python benchmarks/e2e_gpu.py`)", "",
          f"{result['device']}; 4 prompts x {args.new_tokens} new tokens, greedy; verify forwards replayed from CUDA graphs (paged KV).", "",
          "| target | mode | tok/s | tau | forward ms | byte time ms | other ms/round | identical to block 1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['target']} | {r['mode']} | {r['tok_s']} | {r.get('tau', '')} | {r.get('forward_ms', '')} | {r.get('byte_time_ms', '')} | {r.get('round_other_ms', '')} | {r.get('identical', '')} |")
    (out / "e2e_gpu_h200.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
