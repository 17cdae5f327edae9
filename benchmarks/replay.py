"""Offline replay of drafting policies over greedy reference outputs: how many rounds and verified tokens.

Speculative decoding is lossless, so every policy emits the target's greedy output; what differs is how
many verify rounds it takes and how wide they are. This replays the round loop exactly (the n-gram index,
DFlash proposals conditioned on the target's features of the committed tokens, acceptance = longest common
prefix with the reference) without any timing noise, then prices each round with the measured one-thread
forward cost of the demo target (a steady-state loop, measured here first), the measured one-thread DFlash
proposal and context-update costs, plus a fixed hop cost.

    python benchmarks/replay.py [--new-tokens 128] [--hop-ms 1.2]

Prompt sets: `bench` (benchmarks/prompts_heldout.json, the e2e prompts), `val` (16 other held-out stdlib
windows, two thirds into each file), `proj` (8 windows of this project's own source, as of 2026-11-30);
each is kept as token ids in benchmarks/prompts_*.json so every run replays the same prompts. Prints verify time
relative to a fixed 32-token n-gram block per set; writes benchmarks/results/replay.json.
"""

from __future__ import annotations

import argparse
import bisect
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_svc.drafters.dflash import DFlashFactory  # noqa: E402
from drafter_svc.drafters.ngram import NgramIndex  # noqa: E402
from drafter_svc.width import VerifyWidth  # noqa: E402
from pdflash.defaults import default_drafter_dir, default_target_dir  # noqa: E402

PROJECT_FILES = ["drafter_svc/loop.py", "scheduler_svc/policy.py", "verifier_svc/engine.py", "pdflash/stack.py",
                 "scheduler_svc/core.py", "drafter_svc/servicer.py", "pdflash/cli.py", "training/train_dflash.py"]


def prompt_sets(tok, n_tokens: int = 128) -> dict[str, list[list[int]]]:
    """The three prompt sets, read from benchmarks/prompts_{heldout,replay_val,replay_proj}.json (written from
    the files on first use, so later runs and other machines replay the same prompts)."""
    out = {}
    for name, path, make in (("bench", "prompts_heldout.json", None), ("val", "prompts_replay_val.json", _val_prompts),
                             ("proj", "prompts_replay_proj.json", _project_prompts)):
        f = ROOT / "benchmarks" / path
        if not f.exists() and make is not None:
            f.write_text(json.dumps(make(tok, n_tokens)))
        out[name] = json.loads(f.read_text())
    return out


def _val_prompts(tok, n_tokens: int) -> list[list[int]]:
    from training.corpus import HELDOUT_LIST, read_list, stdlib_root

    val = []
    for rel in read_list(HELDOUT_LIST):
        path = stdlib_root() / rel
        if not path.exists():
            continue
        ids = tok(path.read_text(errors="replace"))["input_ids"]
        if len(ids) >= 3 * n_tokens + 300:
            val.append(ids[2 * len(ids) // 3:][:n_tokens])
        if len(val) == 16:
            break
    return val


def _project_prompts(tok, n_tokens: int) -> list[list[int]]:
    out = []
    for rel in PROJECT_FILES:
        ids = tok((ROOT / rel).read_text())["input_ids"]
        out.append(ids[len(ids) // 3:][:n_tokens])
    return out


def forward_cost(model, widths=(1, 2, 4, 8, 16, 32)) -> dict[int, float]:
    """Median ms of a verify forward of w tokens on a 140-token KV cache, one CPU thread, steady state."""
    from transformers import DynamicCache

    from pdflash.hf_compat import cache_kwarg

    kv = cache_kwarg(model)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ids = torch.randint(5, 4000, (1, 200))
    out = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :140], **{kv: cache}, use_cache=True)
        for w in widths:
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                model(input_ids=ids[:, 140:140 + w], **{kv: cache}, use_cache=True)
                times.append((time.perf_counter() - t0) * 1e3)
                cache.crop(-w)
            out[w] = sorted(times)[len(times) // 2]
    torch.set_num_threads(before)
    return out


def dflash_cost(dflash: DFlashFactory) -> tuple[float, float]:
    """Median ms of a 15-draft DFlash proposal and of committing 6 tokens' features, one CPU thread."""
    import numpy as np

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    d = dflash.new_session()
    d.start(list(range(10, 150)), rng.standard_normal((140, dflash.feature_dim)).astype(np.float32))
    prop, com = [], []
    for _ in range(25):
        t0 = time.perf_counter()
        d.propose(5, 15)
        t1 = time.perf_counter()
        d.commit([5] * 6, rng.standard_normal((6, dflash.feature_dim)).astype(np.float32))
        prop.append((t1 - t0) * 1e3)
        com.append((time.perf_counter() - t1) * 1e3)
    torch.set_num_threads(before)
    return sorted(prop)[len(prop) // 2], sorted(com)[len(com) // 2]


def positions(model, dflash: DFlashFactory, prompt: list[int], ref: list[int]) -> list[tuple[int, list[int], list[int]]]:
    """Per emitted count i >= 1: (n-gram match length, n-gram proposal of 31, DFlash proposal of 15)."""
    with torch.no_grad():
        hs = model(torch.tensor([prompt + ref]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in dflash.feature_layer_ids], -1).numpy()
    seq = prompt + ref
    d = dflash.new_session()
    d.start(prompt, feats[:len(prompt)])
    idx = NgramIndex(1, 3)
    idx.extend(prompt)
    committed, rows = len(prompt), []
    for i in range(1, len(ref)):
        while committed < len(prompt) + i - 1:  # committed = prompt + ref[:i-1]; the anchor is ref[i-1]
            d.commit([seq[committed]], feats[committed:committed + 1])
            idx.extend([seq[committed]])
            committed += 1
        n, ng = idx.lookup(ref[i - 1], 31)
        rows.append((n, ng, d.propose(ref[i - 1], 15)))
    return rows


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(rows, ref, source: str, block: int, adaptive: bool, weak_cap: bool, cost, hop_ms: float,
           dflash_ms: tuple[float, float]) -> tuple[int, int, float]:
    """(rounds, verified tokens, priced ms) of one request under one policy. DFlash and hybrid sessions pay
    the drafter's context update every round and a DFlash proposal on the rounds it drafts."""
    width = VerifyWidth(block, adaptive=adaptive)
    i, rounds, tokens, ms = 1, 0, 0, 0.0
    while i < len(ref):
        n, ng, df = rows[i - 1]
        k = min(width.drafts(), len(ref) - i - 1)
        ngram = ng[:k][:3] if weak_cap and n < 3 else ng[:k]
        dflash = df[:min(k, 15)]
        if source == "branches":  # both proposals verified at once, as two branches of one forward
            branches, drafted = [ngram, dflash], True
        elif source == "ngram" or (source == "hybrid" and n >= 3 and ng):
            branches, drafted = [ngram], False
        else:
            branches, drafted = [dflash], True
        acc = max(lcp(b, ref[i:]) for b in branches)
        width_tokens = 1 + sum(len(b) for b in branches)
        rounds, tokens = rounds + 1, tokens + width_tokens
        ms += cost(width_tokens) + hop_ms + (dflash_ms[0] if drafted else 0.0) + (dflash_ms[1] if source != "ngram" else 0.0)
        width.observe(acc)
        i += acc + 1
    return rounds, tokens, ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hop-ms", type=float, default=1.2, help="per-round cost beyond the forward (RPC, handlers)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replay.json"))
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = str(default_target_dir())
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    dflash = DFlashFactory(target, str(default_drafter_dir()))
    table = forward_cost(model)
    dms = dflash_cost(dflash)
    ks = sorted(table)

    def cost(w: int) -> float:
        j = min(bisect.bisect_left(ks, w), len(ks) - 1)
        if ks[j] == w or j == 0:
            return table[ks[j]]
        a, b = ks[j - 1], ks[j]
        return table[a] + (table[b] - table[a]) * (w - a) / (b - a)

    policies = {  # name: (source, block, adaptive width, n-gram weak-match cap)
        "ngram@32 fixed, no cap": ("ngram", 32, False, False),
        "ngram@16 fixed, no cap": ("ngram", 16, False, False),
        "ngram@32 fixed, weak cap": ("ngram", 32, False, True),
        "ngram@32 adaptive, no cap": ("ngram", 32, True, False),
        "ngram@32 adaptive, weak cap": ("ngram", 32, True, True),
        "dflash fixed": ("dflash", 16, False, False),
        "dflash adaptive": ("dflash", 16, True, False),
        "hybrid@32 fixed": ("hybrid", 32, False, True),
        "hybrid@32 adaptive": ("hybrid", 32, True, True),
        "n-gram + DFlash as two branches, adaptive": ("branches", 32, True, True),
    }
    results: dict[str, dict] = {}
    for name, prompts in prompt_sets(tok).items():
        with torch.no_grad():
            refs = [model.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False)[0, len(p):].tolist() for p in prompts]
        rows = [positions(model, dflash, p, r) for p, r in zip(prompts, refs)]
        for pol, spec in policies.items():
            tot = [replay(rw, r, *spec, cost, args.hop_ms, dms) for rw, r in zip(rows, refs)]
            results.setdefault(pol, {})[name] = {
                "rounds": sum(t[0] for t in tot), "verified_tokens": sum(t[1] for t in tot), "ms": round(sum(t[2] for t in tot), 1)}
        print(f"  {name}: {len(prompts)} prompts replayed", file=sys.stderr)
    sets = list(next(iter(results.values())))
    base = results["ngram@32 fixed, no cap"]
    widths = ", ".join(f"{w}: {t:.2f}" for w, t in table.items())
    print(f"# replay: time relative to a fixed 32-token n-gram block (one-thread forward ms by width {widths}; "
          f"hop {args.hop_ms} ms; DFlash proposal {dms[0]:.2f} ms, context update {dms[1]:.2f} ms)\n")
    print("| policy | " + " | ".join(f"{s} time | {s} rounds" for s in sets) + " |")
    print("|---|" + "---|---|" * len(sets))
    for pol, r in results.items():
        print(f"| {pol} | " + " | ".join(f"{r[s]['ms'] / base[s]['ms']:.3f} | {r[s]['rounds']}" for s in sets) + " |")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"forward_ms_by_width": table, "hop_ms": args.hop_ms,
                                                  "dflash_propose_ms": dms[0], "dflash_commit_ms": dms[1],
                                                  "new_tokens": args.new_tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
