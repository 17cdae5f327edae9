"""How well the next-layer guess predicts routing on the benchmarks' random-weight models (CPU, no GPU needed).

The offloaded cache's `layer` prefetch applies layer l + 1's router to layer l's MoE input and streams the experts it
picks while layer l computes (pdflash_kernels.installer._predict_experts). Its use depends on how often those picks are the
experts layer l + 1 then routes. This runs one forward of a random real-shape model (pdflash.tiny.real_shape_config,
the weights benchmarks/offload.py builds, bf16) over random tokens and reports, per layer transition, the precision
of a top-g guess: the share of guessed experts that layer l + 1 routes for the same token. The guess is g = 1, a
quarter of top-k (the cache's default) or all of top-k. It also reports the residual stream's norm after each layer:
where a layer's update dwarfs the stream, the next layer's routing decorrelates. `late`: the same guess made one step
later, from layer l + 1's own input before its attention (its post-attention norm applied to the residual stream after
layer l: what a guess issued when layer l ends would see), to tell whether waiting for it would pay. `new recall`: of
the experts a token routes at l + 1 that the token before it did not (roughly what an LRU cache misses), the share the
guess holds.

    python benchmarks/guess_precision.py [--archs gpt_oss qwen3_moe] [--layers 4] [--tokens 64]
        -> table; results/guess_precision_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(arch: str, layers: int, tokens: int, seed: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    from pdflash_kernels.installer import routers
    from pdflash.tiny import real_shape_config

    torch.manual_seed(seed)
    cfg = real_shape_config(arch, num_layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    rts = routers(model)
    names = {id(m): n for n, m in model.named_modules()}
    moe_in: dict[int, torch.Tensor] = {}
    hooks = []
    for layer, router in rts.items():  # the MoE block's input: what its router (and the guess) sees
        block = model.get_submodule(names[id(router)].rpartition(".")[0])
        hooks.append(block.register_forward_pre_hook(
            lambda m, a, layer=layer: moe_in.__setitem__(layer, a[0].detach().reshape(-1, a[0].shape[-1]))))
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    k = rts[0].top_k

    def top(layer: int, x: torch.Tensor, g: int) -> torch.Tensor:
        w, b = rts[layer].weight, getattr(rts[layer], "bias", None)
        logits = x.float() @ w.float().t()
        if isinstance(b, torch.Tensor):
            logits = logits + b.float()
        return torch.topk(logits, g, dim=-1).indices

    guesses = sorted({1, max(1, k // 4), k})
    res: dict[str, dict[int, list]] = {name: {g: [] for g in guesses} for name in ("precision", "late", "new", "late_new")}
    decoder = model.model.layers
    for layer in range(layers - 1):
        routed = top(layer + 1, moe_in[layer + 1], k)
        new = [set(t.tolist()) - set(p.tolist()) for t, p in zip(routed[1:], routed[:-1])]
        with torch.inference_mode():
            late_x = decoder[layer + 1].post_attention_layernorm(out.hidden_states[layer + 1].reshape(routed.shape[0], -1))
        for g in guesses:
            for kind, x in (("", moe_in[layer]), ("late", late_x)):
                guess = top(layer + 1, x, g)
                hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(routed, guess))
                fresh = sum(len(set(a.tolist()) & n) for a, n in zip(guess[1:], new))
                res[kind or "precision"][g].append(round(hits / guess.numel(), 3))
                res["late_new" if kind else "new"][g].append(round(fresh / max(1, sum(map(len, new))), 3))
    return {"arch": arch, "layers": layers, "tokens": tokens, "top_k": k, "num_experts": int(rts[0].weight.shape[0]),
            "forward_s": round(time.perf_counter() - t0, 2),
            "residual_norms": [round(float(h.float().norm(dim=-1).mean()), 1) for h in out.hidden_states],
            "precision_by_guess": {str(g): p for g, p in res["precision"].items()},
            "late_precision_by_guess": {str(g): p for g, p in res["late"].items()},
            "new_recall_by_guess": {str(g): p for g, p in res["new"].items()},
            "late_new_recall_by_guess": {str(g): p for g, p in res["late_new"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=["gpt_oss", "qwen3_moe"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    rows = [measure(a, args.layers, args.tokens) for a in args.archs]
    print("| model | top-k of E | guess | precision per layer transition (l -> l+1) | late | new recall | late new recall | residual norm after each layer |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for g, p in r["precision_by_guess"].items():
            print(f"| {r['arch']} ({r['layers']} layers) | {r['top_k']} of {r['num_experts']} | top-{g} | {p} | "
                  f"{r['late_precision_by_guess'][g]} | {r['new_recall_by_guess'][g]} | {r['late_new_recall_by_guess'][g]} | "
                  f"{r['residual_norms']} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "guess_precision_cpu.json").write_text(json.dumps(
        {"command": "python benchmarks/guess_precision.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
