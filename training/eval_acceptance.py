"""Acceptance length tau of the DFlash, n-gram and hybrid drafters against the target, greedy.

    python -m training.eval_acceptance --target runs/demo/target --drafter runs/demo/drafter --out runs/demo/metrics_eval.json

tau = accepted drafts + 1, averaged over verify rounds, for blocks of 4, 8 and 16 (anchor + B-1 drafts),
on two prompt sets: held-out stdlib files, and Python code outside the stdlib (this repository's .py files).

Greedy verification is lossless: the committed text is exactly the target's greedy continuation. So
the default `--mode sim` first decodes that continuation once (batched, KV cache), runs one target
forward over prompt + continuation for the features, and gets the DFlash drafts for every possible
round start in one batched drafter forward; each drafter's rounds are then replayed exactly (accept
drafts while they equal the continuation, then one target token). `--mode loop` runs the real round
loop instead (target KV cache cropped to the committed length, drafter context K/V extended with the
committed rows, drafts checked against the target's argmax): slow, for checking the simulation.

Drafters: dflash; ngram = prompt lookup on the last 3 -> 2 -> 1 tokens (drafter_svc's NgramIndex);
hybrid = the n-gram continuation when a >= 3-gram matches, else DFlash.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch

from drafter_svc.dflash_model import ContextKV, load_dflash
from pdflash.hf_compat import cache_kwarg
from training.common import (device_name, dflash_blocks, draft_hidden, greedy_generate, load_target, pick_device,
                             seed_all, target_features, write_json)
from training.corpus import EOS, MASK, encode_docs, load_split, prompt_windows, read_text

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ngram_index_class():
    """drafter_svc's NgramIndex, the n-gram drafter the services run.

    The drafters package's __init__ imports the serving stack (structlog, grpc ...), which a bare GPU
    image may lack; ngram.py itself needs only numpy, so fall back to loading it (and base.py) alone.
    """
    try:
        from drafter_svc.drafters.ngram import NgramIndex
        return NgramIndex
    except ImportError:
        import importlib
        import sys
        import types

        name = "_pdflash_ngram_only"
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(REPO / "drafter_svc" / "drafters")]
            sys.modules[name] = pkg
        return importlib.import_module(f"{name}.ngram").NgramIndex


NgramIndex = _ngram_index_class()
DRAFTERS = ("dflash", "ngram", "hybrid")
HYBRID_MIN_N = 3


# ---- prompt sets -----------------------------------------------------------------------------------

def repo_code_files(root: pathlib.Path = REPO) -> list[pathlib.Path]:
    """This repository's own .py files, without generated protobuf modules and caches."""
    skip = {".git", ".cache", ".whl", "runs", "build", "dist", "__pycache__", ".gl"}
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(x in skip or x.startswith(".") for x in parts[:-1]) or p.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        out.append(p)
    return out


def prompt_sets(tok, n_prompts: int, prompt_len: int, n_new: int, seed: int, max_files: int | None = None) -> dict:
    split = load_split(max_files=max_files)
    held = split.heldout
    stdlib_docs = encode_docs(tok, split.texts("heldout"))
    files = repo_code_files()
    if max_files:  # smoke runs: the largest few
        files = sorted(files, key=lambda f: -f.stat().st_size)[:max_files]
    repo_docs = encode_docs(tok, [t for t in (read_text(p) for p in files) if t])
    # Prompts need text after them only so that they start inside a file, not at its very end.
    return {
        "heldout_stdlib": {"prompts": prompt_windows(stdlib_docs, prompt_len, 64, n_prompts, seed),
                           "files": len(held)},
        "repo_code": {"prompts": prompt_windows(repo_docs, prompt_len, 64, n_prompts, seed + 1),
                      "files": len(files)},
    }


# ---- simulation ------------------------------------------------------------------------------------

@torch.no_grad()
def dflash_drafts_all(target, drafter, seqs: torch.Tensor, start: int, count: int, block: int, mask_id: int,
                      batch: int = 8) -> np.ndarray:
    """Drafts [N, count, B-1] for rounds anchored at positions start .. start+count-1 of each sequence."""
    layer_ids = drafter.spec.target_layer_ids
    out = []
    for i in range(0, len(seqs), batch):
        ids = seqs[i : i + batch]
        feats, _ = target_features(target, ids, layer_ids)
        anchors = torch.arange(start, start + count, device=ids.device).expand(len(ids), -1)
        block_ids, block_pos, mask = dflash_blocks(ids, anchors, block, mask_id, ids.shape[1])
        hidden = draft_hidden(drafter, target, block_ids, block_pos, feats.to(drafter.fc.weight.dtype), mask)
        drafts = target.lm_head(hidden).argmax(-1).view(len(ids), count, block)[:, :, 1:]
        out.append(drafts.cpu().numpy())
    return np.concatenate(out)


def replay(seq: list[int], prompt_len: int, n_new: int, block: int, kind: str, drafts: np.ndarray | None,
           eos_id: int) -> list[int]:
    """Accepted-draft counts per round when `seq` (prompt + greedy continuation) is generated with `kind`."""
    tail = seq[prompt_len:]
    eos_pos = prompt_len + tail.index(eos_id) if eos_id in tail else len(seq) - 1  # the session ends once EOS is out
    stop = min(prompt_len + n_new - 1, eos_pos)  # the anchor is emitted too: stop when n_new tokens are out
    index = NgramIndex(1, 3)
    index.extend(seq[:prompt_len])
    c, accepted = prompt_len, []  # c = tokens in the target's KV; seq[c] is this round's anchor
    while c < stop:
        anchor = seq[c]
        k = min(block - 1, prompt_len + n_new - 2 - c)  # never draft past n_new generated tokens
        if kind == "dflash":
            d = list(drafts[c - prompt_len][:k])
        else:
            n, d = index.lookup(anchor, k)
            if kind == "hybrid" and n < HYBRID_MIN_N:
                d = list(drafts[c - prompt_len][:k])
        a = 0
        while a < len(d) and c + 1 + a <= eos_pos and d[a] == seq[c + 1 + a]:
            a += 1
        accepted.append(a)
        index.extend(seq[c : c + a + 1])  # the anchor and the accepted drafts enter the target's KV
        c += a + 1
    return accepted


def summarize(accepted_lists: list[list[int]], block: int) -> dict:
    acc = np.concatenate([np.asarray(a) for a in accepted_lists])
    return {
        "tau": float(acc.mean() + 1),
        "rounds": int(len(acc)),
        "tokens": int((acc + 1).sum()),
        # Share of rounds whose k-th draft was accepted, k = 1 .. B-1.
        "accept_by_position": [round(float((acc >= k).mean()), 4) for k in range(1, block)],
    }


def evaluate_sim(target, drafter, prompts: torch.Tensor, n_new: int, blocks: list[int], mask_id: int, eos_id: int,
                 drafters=DRAFTERS) -> dict:
    prompt_len = prompts.shape[1]
    extra = max(blocks)
    cont = greedy_generate(target, prompts, n_new + extra, desc="greedy continuations")
    seqs = torch.cat([prompts, cont], dim=1)
    # The one-pass forward must agree with the KV-cached decode (it should, up to float ties).
    _, greedy = target_features(target, seqs, [0])
    agree = float((greedy[:, prompt_len - 1 : -1] == seqs[:, prompt_len:]).float().mean())
    seq_lists = seqs.cpu().tolist()
    out = {"greedy_consistency": round(agree, 5), "prompts": len(prompts), "prompt_len": prompt_len, "new_tokens": n_new}
    for b in blocks:
        drafts = dflash_drafts_all(target, drafter, seqs, prompt_len, n_new, b, mask_id) if drafter is not None else None
        for kind in drafters:
            if kind != "ngram" and drafts is None:
                continue
            acc = [replay(s, prompt_len, n_new, b, kind, None if drafts is None else drafts[i], eos_id)
                   for i, s in enumerate(seq_lists)]
            out[f"{kind}@{b}"] = summarize(acc, b)
    return out


# ---- the real round loop ---------------------------------------------------------------------------

@torch.no_grad()
def run_loop(target, drafter, prompt: list[int], n_new: int, block: int, kind: str, mask_id: int, eos_id: int):
    """(generated tokens, accepted-draft counts) from the real draft/verify loop on one prompt."""
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    layer_ids = drafter.spec.target_layer_ids if drafter is not None else []

    def feats_of(out, rows):
        return torch.cat([out.hidden_states[l + 1][:, :rows] for l in layer_ids], dim=-1)

    kv = cache_kwarg(target)
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([prompt], device=dev), **{kv: cache}, use_cache=True,
                 output_hidden_states=drafter is not None)
    ctx = None
    if drafter is not None:
        ctx = ContextKV(len(drafter.layers))
        drafter.extend_context(ctx, feats_of(out, len(prompt)), torch.arange(len(prompt), device=dev)[None])
    index = NgramIndex(1, 3)
    index.extend(prompt)
    c = len(prompt)
    anchor = int(out.logits[0, -1].argmax())
    generated, accepted = [anchor], []
    while len(generated) < n_new and anchor != eos_id:
        k = min(block - 1, n_new - len(generated) - 1)  # never draft past n_new generated tokens
        n, d = index.lookup(anchor, k) if kind != "dflash" else (0, [])
        if kind == "dflash" or (kind == "hybrid" and n < HYBRID_MIN_N):
            ids = torch.tensor([[anchor] + [mask_id] * (block - 1)], device=dev)
            pos = torch.arange(c, c + block, device=dev)[None]
            h = drafter(target.get_input_embeddings()(ids).to(drafter.fc.weight.dtype), pos, cache=ctx)
            d = target.lm_head(h[:, 1:].to(target.lm_head.weight.dtype))[0].argmax(-1).tolist()[:k]
        blk = [anchor] + list(d)
        out = target(input_ids=torch.tensor([blk], device=dev), **{kv: cache}, use_cache=True,
                     output_hidden_states=drafter is not None)
        g = out.logits[0].argmax(-1).tolist()  # g[i]: the target's token after blk[:i + 1]
        a = 0
        while a < len(d) and d[a] == g[a]:
            a += 1
        removed = cache.get_seq_length() - (c + a + 1)
        if removed > 0:
            cache.crop(-removed)  # negative = tokens to drop (a positive value means an absolute length in old transformers)
        if drafter is not None:
            drafter.extend_context(ctx, feats_of(out, a + 1), torch.arange(c, c + a + 1, device=dev)[None])
        index.extend(blk[: a + 1])
        accepted.append(a)
        c += a + 1
        anchor = g[a]
        new = list(d[:a]) + [anchor]
        if eos_id in new:  # the session finishes once EOS is emitted
            generated += new[: new.index(eos_id) + 1]
            break
        generated += new
    return generated[:n_new], accepted


def evaluate_loop(target, drafter, prompts: torch.Tensor, n_new: int, blocks: list[int], mask_id: int, eos_id: int,
                  drafters=DRAFTERS) -> dict:
    plist = prompts.cpu().tolist()
    ref = greedy_generate(target, prompts, n_new, desc="greedy reference").cpu().tolist()
    out = {"prompts": len(plist), "prompt_len": prompts.shape[1], "new_tokens": n_new}
    for b in blocks:
        for kind in drafters:
            if kind != "ngram" and drafter is None:
                continue
            accs, same = [], 0
            for p, r in zip(plist, ref):
                gen, acc = run_loop(target, drafter, p, n_new, b, kind, mask_id, eos_id)
                accs.append(acc)
                same += gen == r[: len(gen)]
            out[f"{kind}@{b}"] = {**summarize(accs, b), "lossless": same / len(plist)}
    return out


# ---- main ------------------------------------------------------------------------------------------

def table(results: dict, blocks: list[int]) -> str:
    lines = []
    for set_name, res in results.items():
        lines.append(f"{set_name} ({res['prompts']} prompts of {res['prompt_len']} tokens, {res['new_tokens']} new):")
        lines.append("  drafter   " + "".join(f"  tau@{b:<4}" for b in blocks))
        for kind in DRAFTERS:
            cells = [f"{res[f'{kind}@{b}']['tau']:>8.3f}" if f"{kind}@{b}" in res else f"{'-':>8}" for b in blocks]
            lines.append(f"  {kind:<8}  " + "  ".join(cells))
        if f"dflash@{max(blocks)}" in res:
            pos = res[f"dflash@{max(blocks)}"]["accept_by_position"][:8]
            lines.append(f"  dflash@{max(blocks)} accepted by position: " + " ".join(f"{x:.2f}" for x in pos))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", default=None, help="DFlash drafter folder (without it only the n-gram drafter runs)")
    ap.add_argument("--out", default=None, help="metrics JSON")
    ap.add_argument("--mode", choices=("sim", "loop"), default="sim")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per set")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-files", type=int, default=None, help="smoke runs: use at most this many files per set")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    seed_all(args.seed)
    device = pick_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 throughout, as the CPU verifier runs
    torch.backends.cudnn.allow_tf32 = False
    target = load_target(args.target, device, torch.float32)
    drafter = load_dflash(args.drafter, dtype=torch.float32, device=str(device)) if args.drafter else None
    tok = AutoTokenizer.from_pretrained(args.target)
    mask_id, eos_id = tok.convert_tokens_to_ids(MASK), tok.convert_tokens_to_ids(EOS)
    if drafter is not None and drafter.spec.mask_token_id != mask_id:
        raise ValueError(f"drafter mask token {drafter.spec.mask_token_id} != tokenizer's {mask_id}")
    blocks = [int(b) for b in args.blocks.split(",")]
    kinds = tuple(k for k in args.drafters.split(",") if k)

    t0 = time.time()
    sets = prompt_sets(tok, args.prompts, args.prompt_len, args.new_tokens, args.seed, args.max_files)
    results = {}
    for name, s in sets.items():
        prompts = torch.from_numpy(s["prompts"]).to(device)
        fn = evaluate_sim if args.mode == "sim" else evaluate_loop
        results[name] = {**fn(target, drafter, prompts, args.new_tokens, blocks, mask_id, eos_id, kinds),
                         "files": s["files"]}
    elapsed = time.time() - t0
    print(table(results, blocks))
    metrics = {"mode": args.mode, "device": device_name(device), "seconds": round(elapsed, 1), "blocks": blocks,
               "results": results, "args": vars(args)}
    if args.out:
        write_json(args.out, metrics)
    print(f"eval ({args.mode}) in {elapsed:.0f}s on {device_name(device)}")
    return metrics


if __name__ == "__main__":
    main()
