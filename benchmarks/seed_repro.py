"""Does a seeded sampled request reproduce through the stack? The same request (seed 7) several times per drafter and
sampling setting, on a tiny qwen3_moe target with a random DFlash drafter (as tests/test_sampling.py's stack), the
verifier under each `--verifier-args` variant in turn.

    python benchmarks/seed_repro.py [--device cpu] [--variants "" "--torch-threads 1"] [--repeats 3] [--out DIR]

Why: stop 48's and stop 49's GPU-host runs of tests/test_sampling.py::test_stack_sampling_is_seeded_and_matches_target_
distribution (the stack on the CPU, float32, on a 16-core H100 host) gave two different outputs for one seeded DFlash
request (n-gram ones reproduced); on 2-core CPU machines (CI) it passes. Prints a row per variant and setting, writes
seed_repro.json; exit 1 when any setting gave different outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {  # label -> generate() keywords
    "dflash t=1 top-k 4": dict(drafter="dflash", temperature=1.0, top_k=4),
    "dflash t=1 top-k 4 fixed width": dict(drafter="dflash", temperature=1.0, top_k=4, fixed_width=True),
    "dflash greedy": dict(drafter="dflash", temperature=0.0),
    "ngram t=1 top-k 4": dict(drafter="ngram", temperature=1.0, top_k=4),
}


def cpu_op_repeats(threads: tuple[int, ...] = (1, 2, 16), repeats: int = 20) -> list[dict]:
    """The host's CPU kernels alone: float32 ops the CPU stack runs (a linear, a vocabulary-wide sum and softmax,
    masked SDPA), each repeated at each thread count: identical bits every time? (and the same across counts?)"""
    import torch

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 2048, generator=g), torch.randn(4096, 2048, generator=g)
    v = torch.randn(4, 151936, generator=g)
    q, k, val = (torch.randn(1, 8, n, 64, generator=g) for n in (16, 2080, 2080))
    mask = torch.full((16, 2080), float("-inf"))
    mask[:, :1000] = 0.0
    ops = {"linear 16x2048x4096": lambda: torch.nn.functional.linear(x, w),
           "sum over 151936": lambda: v.sum(-1), "softmax over 151936": lambda: v.softmax(-1),
           "sdpa 16 x 2080 keys, masked": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, val, attn_mask=mask)}
    before, rows = torch.get_num_threads(), []
    try:
        firsts = {}
        for t in threads:
            torch.set_num_threads(t)
            for name, op in ops.items():
                outs = [op() for _ in range(repeats)]
                same = all(torch.equal(o, outs[0]) for o in outs)
                firsts.setdefault(name, outs[0])
                rows.append({"op": name, "threads": t, "repeats_identical": same,
                             "equals_first_thread_count": bool(torch.equal(outs[0], firsts[name]))})
    finally:
        torch.set_num_threads(before)
    return rows


def run_variant(model: pathlib.Path, drafter: pathlib.Path, logs: pathlib.Path, device: str, vargs: list[str],
                repeats: int, prompt: str, max_tokens: int) -> list[dict]:
    from pdflash.client import Client
    from tests.conftest import start_stack

    dtype = "float32" if device == "cpu" else "bfloat16"
    stack = start_stack(model, drafter, logs, device=device, dtype=dtype, verifier_args=vargs)
    rows = []
    try:
        with Client(stack.drafter) as client:
            for label, kw in SETTINGS.items():
                outs = [client.generate(prompt, max_tokens=max_tokens, seed=7, **kw) for _ in range(repeats)]
                ids = [list(o.token_ids) for o in outs]
                first_diff = next((i for i in range(max(map(len, ids)))
                                   if len({tuple(x[i:i + 1]) for x in ids}) > 1), None)
                rows.append({"verifier_args": " ".join(vargs), "setting": label, "same": all(x == ids[0] for x in ids),
                             "first_difference_at": first_diff, "lengths": [len(x) for x in ids],
                             "rounds": [o.usage.rounds for o in outs], "draft_tokens": [o.usage.draft_tokens for o in outs],
                             "outputs": ids})
    finally:
        stack.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="the verifier's and drafter's device (the test's stack: cpu)")
    ap.add_argument("--variants", nargs="+", default=["", "--torch-threads 1"], help="verifier argument strings")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-cpu-ops", action="store_true", help="skip the CPU kernels' repeat check")
    args = ap.parse_args()
    ops = [] if args.no_cpu_ops else cpu_op_repeats()
    for r in ops:
        print(f"cpu op {r['op']:<30} threads {r['threads']:>2}: repeats identical {r['repeats_identical']}, "
              f"same as at {ops[0]['threads']} thread(s) {r['equals_first_thread_count']}", flush=True)
    from tests.conftest import TinyModels

    root = pathlib.Path(tempfile.mkdtemp(prefix="seed-repro-"))
    (root / "tiny").mkdir()
    tiny = TinyModels(root / "tiny")
    model, drafter = tiny.target("qwen3_moe"), tiny.drafter("qwen3_moe")
    rows = []
    for i, v in enumerate(args.variants):
        rows += run_variant(model, drafter, root / f"logs{i}", args.device, shlex.split(v), args.repeats,
                            "def fibonacci(n):\n", args.max_tokens)
    print(f"{'verifier args':<22} {'setting':<32} {'same':<5} {'first diff':<10} lengths / rounds / drafts")
    for r in rows:
        print(f"{r['verifier_args'] or '(default)':<22} {r['setting']:<32} {str(r['same']):<5} "
              f"{str(r['first_difference_at']):<10} {r['lengths']} / {r['rounds']} / {r['draft_tokens']}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed_repro.json").write_text(json.dumps({"cpus": len(os.sched_getaffinity(0)), "device": args.device,
                                                    "cpu_ops": ops, "rows": rows}, indent=1))
    return 0 if all(r["same"] for r in rows) and all(r["repeats_identical"] for r in ops) else 1


if __name__ == "__main__":
    sys.exit(main())
