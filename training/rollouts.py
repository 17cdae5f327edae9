"""Greedy rollouts of the frozen target from prompts out of the drafter-only files: DFlash training data
that looks like what the drafter meets when serving (the target's own greedy text after a prompt).

    python -m training.rollouts --target runs/demo/target --out runs/demo/rollouts.npy

Writes an int32 array [count, seq_len]: a real-text prompt, then the target's greedy continuation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from training.common import device_name, load_target, pick_device, seed_all, greedy_generate
from training.corpus import encode_docs, load_split, prompt_windows


def make_rollouts(target, tok, count: int, prompt_lens: list[int], seq_len: int, device, seed: int,
                  chunk: int = 4096, max_files: int | None = None) -> np.ndarray:
    split = load_split(max_files=max_files)
    docs = encode_docs(tok, split.texts("drafter"))
    out = []
    per = [count // len(prompt_lens) + (i < count % len(prompt_lens)) for i in range(len(prompt_lens))]
    for i, (plen, n) in enumerate(zip(prompt_lens, per)):
        if n == 0:
            continue
        prompts = torch.from_numpy(prompt_windows(docs, plen, 0, n, seed + i)).to(device)
        cont = greedy_generate(target, prompts, seq_len - plen, chunk=chunk, desc=f"rollouts p{plen}")
        out.append(torch.cat([prompts, cont], dim=1).cpu().numpy().astype(np.int32))
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=12288)
    ap.add_argument("--prompt-lens", default="128,256", help="comma-separated; the count is shared among them")
    ap.add_argument("--seq-len", type=int, default=768)
    ap.add_argument("--chunk", type=int, default=8192, help="sequences decoded together")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-files", type=int, default=None, help="smoke runs: use at most this many files per part")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    seed_all(args.seed)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(args.target, device, dtype)
    tok = AutoTokenizer.from_pretrained(args.target)
    t0 = time.time()
    data = make_rollouts(target, tok, args.count, [int(x) for x in args.prompt_lens.split(",")], args.seq_len, device,
                         args.seed, args.chunk, args.max_files)
    np.save(args.out, data)
    print(f"rollouts: {data.shape[0]} x {data.shape[1]} tokens in {time.time() - t0:.1f}s on {device_name(device)} -> {args.out}")


if __name__ == "__main__":
    main()
