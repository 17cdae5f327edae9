"""Which MoE architectures of transformers pdflash serves, and how: one small random-weight checkpoint per model type
(`pdflash.tiny.generic_config`), loaded as `pdflash serve-verifier` loads it and decoded greedily through `VerifierCore`
(the verifier's core, no RPC) three ways: at block 1, at block 16 with n-gram drafts, and at block 16 with drafts that
replay block 1's output with every 4th one wrong (`e2e_gpu.replay`); the three outputs are compared token for token.

On CUDA (bf16, the batch-invariant kernels, the paged KV and CUDA graphs where they apply, as the server's defaults do)
each row also says what the kernels installer covered and how the forward runs; `--mxfp4` adds a row with the experts
as MXFP4 offloaded to a small expert cache. On the CPU (float32) the reference is transformers' greedy `generate`.

    python benchmarks/arch_matrix.py [--device cuda] [--archs deepseek_v3 qwen3_next ...] [--mxfp4] [--out DIR]

Prints a table and writes arch_matrix_<device>.json / .md under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pdflash.tiny import ARCHITECTURES, EOS, MORE_ARCHITECTURES, _save, generic_config, make_tokenizer, tiny_config  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib",
           "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self."]


def make(arch: str, out: pathlib.Path, tok, hidden: int, device: str) -> pathlib.Path:
    from transformers import AutoModelForCausalLM

    eos = tok.convert_tokens_to_ids(EOS)
    if arch in ARCHITECTURES:
        cfg = tiny_config(arch, len(tok), eos)
        if hidden != 64:
            cfg.hidden_size, cfg.head_dim = hidden, hidden // cfg.num_attention_heads
            for k in ("intermediate_size", "moe_intermediate_size"):
                if hasattr(cfg, k):
                    setattr(cfg, k, hidden)
    else:
        cfg = generic_config(arch, len(tok), eos, hidden=hidden, heads=4, expert_width=hidden // 2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return _save(model, out, False)


def hf_greedy(d: pathlib.Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy decoding without an end-of-sequence stop (the core runs with ignore_eos)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            o = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        outs.append(o[0, ids.shape[1]:].tolist())
    return outs


def run_arch(arch: str, d: pathlib.Path, prompts, new: int, device: str, experts: str, cache_gb: float) -> dict:
    from e2e_gpu import replay
    from inprocess import core_run
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    row = {"arch": arch, "experts": experts if cache_gb <= 0 else f"{experts}, offloaded ({cache_gb * 2**20:.0f} KiB cache)"}
    t0 = time.perf_counter()
    try:
        target = load_target(d, device, "bfloat16" if device == "cuda" else "float32", kernels="auto", experts=experts,
                             expert_cache_gb=cache_gb)
        core = VerifierCore(target, max_block_size=32, max_tokens_limit=1024,
                            paged_kv=PagedKVOptions(kv_cache_gb=1 if device == "cuda" else 0.0))
    except Exception as e:  # noqa: BLE001 - a row says why
        row.update(status="refused at load", why=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return row
    row["load_s"] = round(time.perf_counter() - t0, 1)
    k = target.kernels or {}
    row.update(batch_invariant=target.batch_invariant, paged_kv=core.pool is not None, cuda_graphs=core.graphs is not None,
               attention=k.get("attention", "-"), experts_kernel=k.get("experts", "-"),
               uncovered=k.get("uncovered_ops", {}), forward=core.forward_info.get("attention", "-"))
    try:
        b1 = core_run(core, prompts, new, 1)
        b16 = core_run(core, prompts, new, 16)
        replayed = core_run(core, prompts, new, 16, propose=replay(b1["outputs"]))
    except Exception as e:  # noqa: BLE001
        row.update(status="failed serving", why=f"{type(e).__name__}: {e}".splitlines()[0][:300],
                   trace=traceback.format_exc()[-1500:])
        return row
    o1, o16, orp = ([o[:new] for o in r["outputs"]] for r in (b1, b16, replayed))
    row.update(ngram16_equals_block1=o1 == o16, replay16_equals_block1=o1 == orp, tokens=sum(map(len, o1)),
               ngram16_rounds=b16["rounds"], replay16_rounds=replayed["rounds"], block1_tok_s=round(b1["tok_per_s"], 1),
               replay16_tok_s=round(replayed["tok_per_s"], 1), outputs=o1)
    row["status"] = "ok" if o1 == o16 == orp else "MISMATCH"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--archs", nargs="*", default=list(MORE_ARCHITECTURES) + list(ARCHITECTURES))
    ap.add_argument("--hidden", type=int, default=0, help="hidden size (default 512 on CUDA, 64 on the CPU)")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--mxfp4", action="store_true", help="also the experts as MXFP4, offloaded to a small cache")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new architectures after this long")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    hidden = args.hidden or (512 if args.device == "cuda" else 64)
    work = pathlib.Path(tempfile.mkdtemp(prefix="arch-matrix-"))
    tok = make_tokenizer(work / "tok")
    prompts = [tok.encode(p) for p in PROMPTS]
    rows, t0 = [], time.perf_counter()
    for arch in args.archs:
        if time.perf_counter() - t0 > args.budget_s:
            rows.append({"arch": arch, "status": "not run (time budget)"})
            continue
        try:
            d = make(arch, work / arch, tok, hidden, args.device)
        except Exception as e:  # noqa: BLE001
            rows.append({"arch": arch, "status": "no config", "why": f"{type(e).__name__}: {e}"[:200]})
            continue
        row = run_arch(arch, d, prompts, args.new, args.device, "native", 0.0)
        if args.device == "cpu" and row.get("status") in ("ok", "MISMATCH"):
            row["equals_transformers"] = row["outputs"] == hf_greedy(d, prompts, args.new)
            if not row["equals_transformers"]:
                row["status"] = "MISMATCH (transformers)"
        rows.append(row)
        if args.mxfp4 and row.get("status") == "ok":
            from verifier_svc.model import load_target

            store = load_target(d, args.device, "bfloat16" if args.device == "cuda" else "float32",
                                experts="mxfp4", expert_cache_gb=1.0).expert_cache.store
            # one layer's experts and 4 more: every verify evicts (the smallest cache a load accepts is one layer's)
            gb = (max(store.num_experts.values()) + 4) * store.slice_bytes / 2**30
            rows.append(run_arch(arch, d, prompts, args.new, args.device, "mxfp4", gb))
        r = rows[-1]
        print(f"{arch:18} {r.get('experts', ''):32} {r['status']:16} {r.get('why', '')[:120]}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    cols = ["arch", "experts", "status", "batch_invariant", "paged_kv", "cuda_graphs", "ngram16_rounds", "replay16_rounds",
            "block1_tok_s", "replay16_tok_s", "attention", "forward", "why"]
    md = [f"# MoE architectures on {dev} (`python benchmarks/arch_matrix.py --device {args.device}"
          f"{' --mxfp4' if args.mxfp4 else ''}`)", "",
          f"Random weights, hidden {hidden}, 8 experts top-2, {args.new} new tokens on {len(PROMPTS)} prompts; `ok` = greedy "
          "output at block 16 (n-gram drafts; replayed block-1 output with every 4th draft wrong) identical to block 1"
          + (" and, native rows, to transformers' `generate`" if args.device == "cpu" else "") + ".", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in cols) + " |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if args.device == "cpu" else "gpu"
    (out / f"arch_matrix_{tag}.json").write_text(json.dumps({"device": dev, "hidden": hidden, "rows": [
        {k: v for k, v in r.items() if k != "outputs"} for r in rows]}, indent=1))
    (out / f"arch_matrix_{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
