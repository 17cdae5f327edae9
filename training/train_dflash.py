"""Train a DFlash block drafter against the frozen target (the DFlash recipe).

    python -m training.train_dflash --target runs/demo/target --rollouts runs/demo/rollouts.npy --out runs/demo/drafter

Each step: a batch of token sequences (half corpus text, half target greedy rollouts); one frozen target
forward gives the features (hidden_states[l + 1] of the chosen target layers, concatenated) and the
target's greedy predictions (the labels). Random anchors per sequence; each block `[anchor, MASK x (B-1)]`
sees the target context strictly before its anchor and its own rows (no causal mask inside the block).
Block embeddings come from the target's frozen embed_tokens, logits from its frozen lm_head. The loss of
block position k (k >= 1) is weighted exp(-(k-1)/gamma). Saved with drafter_svc.dflash_model's
`.save(dir)` (z-lab layout: config.json + model.safetensors, bf16).
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F

from drafter_svc.dflash_model import DFlashDraftModel, DFlashSpec
from training.common import (LossTable, autocast, cosine_lr, device_name, dflash_blocks, draft_hidden, fit_steps,
                             load_target, pick_device, seed_all, target_features, write_json)
from training.corpus import MASK, concat, encode_docs, load_split


def make_drafter(target_config, args, mask_id: int) -> DFlashDraftModel:
    from transformers import Qwen3Config

    t = target_config
    cfg = Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=dict(t.rope_parameters),
        rms_norm_eps=t.rms_norm_eps,
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    layer_ids = [int(x) for x in args.target_layers.split(",")]
    spec = DFlashSpec(block_size=args.block, mask_token_id=mask_id, target_layer_ids=layer_ids,
                      num_target_layers=t.num_hidden_layers)
    model = DFlashDraftModel(cfg, spec)
    for m in model.modules():  # the module leaves nn.Linear at torch's default init: use the usual normal(0, 0.02)
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=cfg.initializer_range)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    return model


class Batches:
    """Training sequences: corpus windows (target-train + drafter-only text) and target rollouts."""

    def __init__(self, corpus: np.ndarray, rollouts: np.ndarray | None, seq_len: int, rollout_frac: float, seed: int):
        self.corpus, self.rollouts, self.seq_len = corpus, rollouts, seq_len
        self.rollout_frac = rollout_frac if rollouts is not None and len(rollouts) else 0.0
        self.rng = np.random.default_rng(seed)

    def next(self, batch: int) -> np.ndarray:
        n_roll = int(round(batch * self.rollout_frac))
        starts = self.rng.integers(0, len(self.corpus) - self.seq_len, size=batch - n_roll)
        rows = [self.corpus[s : s + self.seq_len] for s in starts]
        if n_roll:
            idx = self.rng.integers(0, len(self.rollouts), size=n_roll)
            rows += [self.rollouts[i, : self.seq_len] for i in idx]
        return np.stack(rows).astype(np.int64)


def block_loss(drafter, target, ids, layer_ids, block, anchors_per_seq, gamma, mask_id, gen):
    """(weighted loss, per-position accuracy [B-1], in-block tau estimate) for one batch of sequences [S, L]."""
    s, seq_len = ids.shape
    feats, greedy = target_features(target, ids, layer_ids)
    # A distinct anchors per row in [1, L - B + 1]: every label position p + k - 1 (k < B) is inside the row.
    n_pos = seq_len - block + 1
    anchors = torch.rand(s, n_pos, device=ids.device, generator=gen).argsort(dim=1)[:, :anchors_per_seq] + 1
    block_ids, block_pos, mask = dflash_blocks(ids, anchors, block, mask_id, seq_len)
    hidden = draft_hidden(drafter, target, block_ids, block_pos, feats, mask)
    logits = target.lm_head(hidden).float().view(s, anchors_per_seq, block, -1)[:, :, 1:]
    k = torch.arange(1, block, device=ids.device)
    labels = greedy.gather(1, (anchors[:, :, None] + k - 1).reshape(s, -1)).view(s, anchors_per_seq, block - 1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(labels)
    w = torch.exp(-(k - 1).float() / gamma)
    loss = (ce * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
        # Accepted-prefix length inside the block (what greedy verification would accept), + 1 for the bonus.
        run = torch.cumprod((logits.argmax(-1) == labels).float(), dim=-1).sum(-1)
        tau = float(run.mean()) + 1
    return loss, acc, tau


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rollouts", default=None, help=".npy from training.rollouts (optional)")
    ap.add_argument("--rollout-frac", type=float, default=0.5, help="share of each batch taken from the rollouts")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--target-layers", default="1,3,5", help="target layer ids whose outputs are the features")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=10.0)
    ap.add_argument("--anchors", type=int, default=48, help="blocks per sequence")
    ap.add_argument("--seq-len", type=int, default=768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6476, help="the shipped drafter: 6476 (what 300 s fit on the H200)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="fit the run to this wall time: after 25 steps, --steps becomes what fits (logged; the cosine "
                         "schedule follows); reproduce a run with the --steps it reports")
    ap.add_argument("--deadline", type=float, default=None,
                    help="unix time by which training must end (with --time-budget-s, the tighter one wins)")
    ap.add_argument("--init", default=None, help="start from this saved drafter (same sizes) instead of scratch")
    ap.add_argument("--log-every", type=int, default=None, help="steps between loss-table rows (default: steps / 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-files", type=int, default=None, help="smoke runs: use at most this many files per part")
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    seed_all(args.seed)
    device = pick_device(args.device)
    tdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(args.target, device, tdtype)
    tok = AutoTokenizer.from_pretrained(args.target)
    mask_id = tok.convert_tokens_to_ids(MASK)

    t0 = time.time()
    split = load_split(max_files=args.max_files)
    corpus = concat(encode_docs(tok, split.texts("train") + split.texts("drafter")))
    rollouts = np.load(args.rollouts) if args.rollouts else None
    if rollouts is not None and rollouts.shape[1] < args.seq_len:
        raise ValueError(f"rollouts are {rollouts.shape[1]} tokens long, --seq-len is {args.seq_len}")
    batches = Batches(corpus, rollouts, args.seq_len, args.rollout_frac, args.seed)
    print(f"drafter data: corpus {len(corpus):,} tokens, rollouts {0 if rollouts is None else rollouts.shape}, "
          f"prepared in {time.time() - t0:.1f}s")

    torch.manual_seed(args.seed)
    drafter = make_drafter(target.config, args, mask_id)
    if args.init:
        from drafter_svc.dflash_model import load_dflash

        drafter.load_state_dict(load_dflash(args.init).state_dict())
    drafter.to(device)
    layer_ids = drafter.spec.target_layer_ids
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {args.layers} layers, MLP {args.intermediate}, target layers {layer_ids}, block {args.block}, "
          f"gamma {args.gamma}: {n_params / 1e6:.2f}M params on {device_name(device)}")

    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    total = args.steps
    log_every = args.log_every or max(1, total // 12)
    table = LossTable(f"drafter loss curve ({args.batch} seqs x {args.anchors} blocks of {args.block} per step)",
                      ["loss", "acc1", "acc2", "acc4", "acc8", "est_tau", "lr"])
    sums = {"loss": 0.0, "tau": 0.0, "n": 0}
    acc_sum = torch.zeros(args.block - 1, device=device)
    t_train = t_probe = time.time()
    bar = tqdm(total=total, desc="drafter", mininterval=5.0)
    step = 0
    while step < total:
        step += 1
        ids = torch.from_numpy(batches.next(args.batch)).to(device, non_blocking=True)
        lr = cosine_lr(step - 1, total, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast(device):
            loss, acc, tau = block_loss(drafter, target, ids, layer_ids, args.block, args.anchors, args.gamma, mask_id, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.update(1)
        sums["loss"] += float(loss.detach())
        sums["tau"] += tau
        sums["n"] += 1
        acc_sum += acc
        if step == 5:
            t_probe = time.time()
        if step == 25 and (args.time_budget_s or args.deadline):
            budget = min(args.time_budget_s or float("inf"), (args.deadline or float("inf")) - t_train)
            fit, _ = fit_steps(10**9, step, (time.time() - t_probe) / 20, time.time() - t_train, budget)
            total = min(fit, args.steps)
            bar.total = total
            if args.log_every is None:
                log_every = max(1, total // 12)
            bar.write(f"time budget {budget:.0f}s at {(time.time() - t_probe) / 20 * 1000:.0f} ms/step: "
                      f"{total} steps")
        if step % log_every == 0 or step == total:
            a = (acc_sum / sums["n"]).tolist()
            pick = {f"acc{k}": a[k - 1] for k in (1, 2, 4, 8) if k <= len(a)}
            row = table.add(step, loss=sums["loss"] / sums["n"], est_tau=sums["tau"] / sums["n"], lr=lr, **pick)
            bar.write(f"step {step}: loss {row['loss']:.4f} est. tau@{args.block} {row['est_tau']:.3f} acc1 {a[0]:.3f}")
            sums = {"loss": 0.0, "tau": 0.0, "n": 0}
            acc_sum.zero_()
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_train = time.time() - t_train
    print(table.render())

    out = pathlib.Path(args.out)
    drafter.to(torch.bfloat16).save(out)
    metrics = {
        "device": device_name(device),
        "params": n_params,
        "steps": step,
        "train_seconds": round(t_train, 1),
        "seconds_per_step": round(t_train / max(step, 1), 4),
        "final_loss": table.rows[-1]["loss"],
        "final_est_tau": table.rows[-1]["est_tau"],
        "loss_curve": table.rows,
        "args": vars(args),
    }
    write_json(out / "metrics_drafter.json", metrics)
    print(f"drafter: {step} steps in {t_train:.0f}s ({metrics['seconds_per_step'] * 1000:.0f} ms/step) -> {out}")
    return metrics


if __name__ == "__main__":
    main()
