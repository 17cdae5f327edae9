"""Train the tiny Qwen3-MoE target on the target-train stdlib files.

    python -m training.train_target --dir runs/demo/target          # tokenizer.json must already be there

Saves config.json, generation_config.json and model.safetensors (bf16) into --dir with
`save_pretrained`, so plain `AutoModelForCausalLM.from_pretrained(dir)` loads it, and writes
metrics_target.json (held-out perplexity, the loss curve, timings) beside them.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import numpy as np
import torch

from training.common import (LossTable, autocast, cosine_lr, device_name, fit_steps, pick_device, seed_all,
                             use_fast_experts, write_json)
from training.corpus import EOS, concat, encode_docs, load_split


def make_config(vocab_size: int, eos_id: int, args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.moe_intermediate,  # unused: every layer is sparse
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        router_aux_loss_coef=args.aux_coef,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )


def windows(tokens: np.ndarray, seq_len: int, offset: int = 0) -> np.ndarray:
    n = (len(tokens) - offset) // seq_len
    return tokens[offset : offset + n * seq_len].reshape(n, seq_len)


@torch.no_grad()
def eval_loss(model, data: np.ndarray, device, batch: int) -> float:
    """Mean next-token cross-entropy over the windows (all tokens weigh the same)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        ids = torch.from_numpy(data[i : i + batch]).long().to(device)
        with autocast(device):
            logits = model(input_ids=ids, use_cache=False, output_router_logits=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += ids[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder with tokenizer.json; the model is written here")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=7.0, help="passes over the target-train tokens")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--evals", type=int, default=14, help="held-out evaluations over the run")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="safety net for device runs: if the first steps project past this, train fewer steps (logged)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-files", type=int, default=None, help="smoke runs: use at most this many files per part")
    ap.add_argument("--max-eval-windows", type=int, default=None, help="smoke runs: cap the evaluation windows")
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seed_all(args.seed)
    device = pick_device(args.device)
    out_dir = pathlib.Path(args.dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    eos_id = tok.convert_tokens_to_ids(EOS)

    t0 = time.time()
    split = load_split(max_files=args.max_files)
    train = concat(encode_docs(tok, split.texts("train")))
    heldout = windows(concat(encode_docs(tok, split.texts("heldout"))), args.seq_len)
    val = windows(concat(encode_docs(tok, split.texts("drafter"))), args.seq_len)  # never trained on by the target
    if args.max_eval_windows:
        heldout, val = heldout[: args.max_eval_windows], val[: args.max_eval_windows]
    t_data = time.time() - t0
    print(f"corpus ({split.root}): train {len(train):,} tokens from {len(split.train)} files; held-out "
          f"{heldout.size:,} tokens ({len(split.heldout)} files); drafter-only/val {val.size:,} ({len(split.drafter)} files); "
          f"tokenized in {t_data:.1f}s")

    cfg = make_config(len(tok), eos_id, args)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    model.config.output_router_logits = True
    impl = use_fast_experts(model, device, training=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: qwen3_moe {n_params / 1e6:.2f}M params, experts implementation {impl}, device {device_name(device)}")

    steps_per_epoch = len(windows(train, args.seq_len)) // args.batch
    total = max(1, int(args.epochs * steps_per_epoch))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    table = LossTable(f"target loss curve ({total} steps, {args.batch}x{args.seq_len} tokens/step)",
                      ["epoch", "train", "val", "heldout", "heldout_ppl", "lr"])
    eval_at = sorted({int(round(total * (i + 1) / args.evals)) for i in range(args.evals)})
    step, running, n_running, t_probe = 0, 0.0, 0, 0.0
    t_train = time.time()
    bar = tqdm(total=total, desc="target", mininterval=5.0)
    while step < total:
        batches = windows(train, args.seq_len, int(rng.integers(0, args.seq_len)))
        batches = batches[rng.permutation(len(batches))]
        for i in range(0, len(batches) - args.batch + 1, args.batch):
            if step >= total:
                break
            ids = torch.from_numpy(batches[i : i + args.batch]).long().to(device, non_blocking=True)
            lr = cosine_lr(step, total, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast(device):
                out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if step == 5:
                t_probe = time.time()
            if step == 25 and args.time_budget_s:
                total, note = fit_steps(total, step, (time.time() - t_probe) / 20, time.time() - t_train, args.time_budget_s)
                if note:
                    bar.write(note)
                    bar.total = total
                    eval_at = sorted({int(round(total * (i + 1) / args.evals)) for i in range(args.evals)})
            running += float(out.loss.detach()) - args.aux_coef * float(out.aux_loss.detach())
            n_running += 1
            if step in eval_at:
                v = eval_loss(model, val, device, args.batch * 2)
                h = eval_loss(model, heldout, device, args.batch * 2)
                row = table.add(step, epoch=round(step / steps_per_epoch, 2), train=running / n_running, val=v, heldout=h,
                                heldout_ppl=math.exp(h), lr=lr)
                bar.write(f"step {step}: train {row['train']:.4f} val {v:.4f} held-out {h:.4f} (ppl {math.exp(h):.2f})")
                running, n_running = 0.0, 0
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_train = time.time() - t_train
    print(table.render())

    model.config.output_router_logits = False
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    last = table.rows[-1]
    metrics = {
        "device": device_name(device),
        "params": n_params,
        "experts_implementation": impl,
        "corpus": {**split.summary(), "train_tokens": int(len(train)), "heldout_tokens": int(heldout.size),
                   "val_tokens": int(val.size)},
        "steps": total,
        "steps_requested": max(1, int(args.epochs * steps_per_epoch)),
        "tokens_per_step": args.batch * args.seq_len,
        "epochs": args.epochs,
        "train_seconds": round(t_train, 1),
        "tokens_per_second": round(total * args.batch * args.seq_len / t_train),
        "heldout_loss": last["heldout"],
        "heldout_ppl": last["heldout_ppl"],
        "val_loss": last["val"],
        "loss_curve": table.rows,
        "args": vars(args),
    }
    write_json(out_dir / "metrics_target.json", metrics)
    print(f"target: held-out ppl {last['heldout_ppl']:.3f} after {total} steps in {t_train:.0f}s "
          f"({metrics['tokens_per_second']:,} tokens/s) -> {out_dir}")
    return metrics


if __name__ == "__main__":
    main()
