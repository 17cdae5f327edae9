"""How well the offloaded experts' layer guess predicts, layer by layer: layer l + 1's router applied to layer l's MoE
input (what `DeviceExpertCache` prefetches while layer l computes) against layer l + 1's own top-k, on the offload
benchmark's random model (benchmarks/offload.py `build`, the same `--layer-scale`), one plain forward of its prompt.

    python benchmarks/guess_layers.py [--model qwen3-48l] [--layers 10] [--layer-scale 0.1] [--device cpu] [--out DIR]

Per layer l + 1 and guess width w (the router's best w per row): precision (the share of guessed experts that the layer
routes to) and coverage (the share of its routed experts the guess holds); the same coverage of the experts new to a
token (routed by none of the 1 / 4 tokens before it: what a cache holding recent experts misses, the copies a
prefetch would have to hide); the cosine of the two layers' MoE inputs;
how many of a token's experts the previous token also routed to (same layer). No timing: any device. Writes
guess_layers_<model>_<device>.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTHS = (1, 2, 4, 8, 16)
LOOKBACKS = (1, 4)  # "new" experts: not routed by the previous 1 / 4 tokens at the same layer (what a small cache misses)


def study(model, prompt: list[int]) -> list[dict]:
    """One forward; per guessed layer: {layer, input_cos, prev_token_overlap, by_width: {w: [precision, coverage]},
    new_share: {back: share}, copies: {back: {"topW"/"skipW": [copies a row, precision, new experts held]}}}."""
    from pdflash_kernels.installer import _predict_experts, routers

    rt = routers(model)
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            inputs[i] = x.detach().reshape(-1, x.shape[-1])
        hooks.append(layer.mlp.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model(torch.tensor([prompt], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for l in range(len(model.model.layers) - 1):
        nxt = rt[l + 1]
        true = _predict_experts(inputs[l + 1], nxt, None)  # layer l + 1's own routing (its router on its real input)
        logits = (inputs[l].to(nxt.weight.dtype) @ nxt.weight.t()).float()
        if isinstance(getattr(nxt, "bias", None), torch.Tensor):
            logits = logits + nxt.bias.float()
        by_width = {}
        for w in WIDTHS:
            if w > logits.shape[-1]:
                continue
            g = torch.topk(logits, w, dim=-1).indices
            precision = (g[:, :, None] == true[:, None, :]).any(-1).float().mean().item()
            coverage = (true[:, :, None] == g[:, None, :]).any(-1).float().mean().item()
            by_width[w] = [round(precision, 3), round(coverage, 3)]
        prev = (true[1:, :, None] == true[:-1, None, :]).any(-1).float().mean().item()
        cos = torch.nn.functional.cosine_similarity(inputs[l].float(), inputs[l + 1].float(), dim=-1).mean().item()
        # The experts new to a token (routed by none of the `back` tokens before it: what a cache of recent experts
        # misses) and the guess's copies (its experts not seen): the router's best w (topW), or the best w of the experts
        # not seen (skipW: every one a copy). Per guess: copies per row, the share of them routed, the share of the new
        # experts they hold (for topW also the share of all new experts the guess holds: a held new expert is a copy).
        new_share, copies = {}, {}
        for back in LOOKBACKS:
            seen = _seen(true, back, logits.shape[-1])
            new = ~seen.gather(1, true)
            new_share[back] = round(new.float().mean().item(), 3)
            unseen = logits.masked_fill(seen, float("-inf"))
            for kind, scores, budgets in (("top", logits, WIDTHS), ("skip", unseen, (1, 2, 4, 8))):
                for b in budgets:
                    if b > logits.shape[-1]:
                        continue
                    g = torch.topk(scores, b, dim=-1).indices
                    copy = ~seen.gather(1, g)
                    routed = (g[:, :, None] == true[:, None, :]).any(-1)
                    held = (true[:, :, None] == torch.where(copy, g, -1)[:, None, :]).any(-1) & new
                    copies.setdefault(back, {})[f"{kind}{b}"] = [
                        round(copy.float().sum(-1).mean().item(), 2),
                        round((routed & copy).sum().item() / max(1, copy.sum().item()), 3),
                        round(held.sum().item() / max(1, new.sum().item()), 3)]
        rows.append(dict(layer=l + 1, input_cos=round(cos, 3), prev_token_overlap=round(prev, 3), top_k=true.shape[1],
                         by_width=by_width, new_share=new_share, copies=copies))
    return rows


def _seen(true: torch.Tensor, back: int, n: int) -> torch.Tensor:
    """[rows, n] bool: the experts any of the `back` rows before each row routed to (the "resident" proxy)."""
    seen = torch.zeros(true.shape[0], n, dtype=torch.bool, device=true.device)
    for d in range(1, back + 1):
        seen[d:].scatter_(1, true[:-d], True)
    return seen


def main() -> None:
    import benchmarks.offload as ob

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-48l", choices=[m for m in ob.MODELS if not m.startswith("tiny")])
    ap.add_argument("--layers", type=int, default=10, help="layers built (the model's own count is 24 / 48: memory)")
    ap.add_argument("--layer-scale", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.layers < 2 or not args.layer_scale > 0:
        raise SystemExit("--layers must be >= 2 and --layer-scale > 0")
    ob.DEVICE = torch.device(args.device)
    arch, _ = ob.MODELS[args.model]
    model = ob.build(arch, args.layers, args.layer_scale)
    prompt = ob.prompts_for(1, model.config.vocab_size)[0]
    rows = study(model, prompt)
    print(f"# {args.model}, {args.layers} layers, outputs x{args.layer_scale}, {len(prompt)}-token prompt "
          f"(top-{rows[0]['top_k']}): layer l+1's router on layer l's MoE input")
    print("| layer | input cos | prev-token overlap | " + " | ".join(f"w{w} precision / coverage" for w in rows[0]["by_width"]) + " |")
    print("|---|---|---|" + "---|" * len(rows[0]["by_width"]))
    for r in rows:
        cells = " | ".join(f"{p} / {c}" for p, c in r["by_width"].values())
        print(f"| {r['layer']} | {r['input_cos']} | {r['prev_token_overlap']} | {cells} |")
    for back in LOOKBACKS:
        keys = list(rows[0]["copies"][back])
        print(f"\n# experts new to a token (routed by none of the {back} token(s) before it, same layer) and the guess's "
              f"copies (its experts not seen): topW = the router's best W, skipW = the best W of the experts not seen; "
              f"cells: copies per row / their precision / share of the new experts held")
        print("| layer | new share | " + " | ".join(keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for r in rows:
            print(f"| {r['layer']} | {r['new_share'][back]} | "
                  + " | ".join(" / ".join(str(x) for x in r["copies"][back][k]) for k in keys) + " |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"guess_layers_{args.model}_{args.device}.json"
    meta = dict(model=args.model, layers=args.layers, layer_scale=args.layer_scale, device=args.device,
                prompt_tokens=len(prompt), command=" ".join(["python", "benchmarks/guess_layers.py", *sys.argv[1:]]))
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
