"""CPU end-to-end benchmark through the full gRPC stack, with transformers in-process as the peer.

Same prompts and lengths for every mode:
  stack/none      block 1: plain autoregressive verification through the three services
  stack/ngram     n-gram prompt lookup drafting (block 16; stack/ngram@32: block 32)
  stack/dflash    DFlash block drafting
  stack/hybrid    n-gram when the context matches, DFlash otherwise
  hf/greedy       transformers `generate(do_sample=False)` in-process
  hf/prompt_lookup  transformers `generate(prompt_lookup_num_tokens=10)` in-process
Per-round time is split into draft, admission (Admit + Release), verify forward, verifier handler
overhead and RPC overhead (client-observed Verify minus the verifier's own handler time).

    python benchmarks/e2e.py [--model DIR --drafter DIR] [--prompts 8 --prompt-tokens 128 --new-tokens 128]

Prints a table and writes benchmarks/results/e2e_cpu.json and .md. All stack modes must emit the
same tokens (greedy is lossless); the script checks that and fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import sysconfig
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdflash.client import Client  # noqa: E402
from pdflash.defaults import default_drafter_dir, default_target_dir  # noqa: E402
from pdflash.stack import Stack, StackSpec, free_port  # noqa: E402

STACK_MODES = [("none", 1), ("ngram", 16), ("ngram", 32), ("dflash", 16), ("hybrid", 16)]


def heldout_prompts(tok, n: int, prompt_tokens: int) -> list[list[int]]:
    """Windows of held-out stdlib files (training/heldout_files.txt), fixed across machines."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = [l.strip() for l in (ROOT / "training" / "heldout_files.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]
    prompts = []
    for name in names:
        path = stdlib / name
        if not path.exists():
            continue
        ids = tok(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) < 3 * prompt_tokens:
            continue
        start = len(ids) // 3  # past the module docstring and imports: code
        prompts.append(ids[start : start + prompt_tokens])
        if len(prompts) == n:
            break
    return prompts


def run_stack_modes(model: str, drafter: str, prompts, new_tokens: int, log_dir: str) -> dict:
    spec = StackSpec(
        model=model, drafter=drafter, drafter_port=free_port(), scheduler_port=free_port(), verifier_port=free_port(),
        metrics_ports=(-1, -1, -1), log_dir=log_dir,
    )
    results = {}
    with Stack(spec) as stack:
        stack.wait_ready(300)
        with Client(stack.drafter) as c:
            c.generate(prompts[0], max_tokens=8, drafter="none")  # warm-up
            for kind, block in STACK_MODES:
                name = kind if block in (1, 16) else f"{kind}@{block}"
                per = []
                for p in prompts:
                    t0 = time.perf_counter()
                    out = c.generate(p, max_tokens=new_tokens, drafter=kind, block_size=block, ignore_eos=True, timeout=600)
                    wall = time.perf_counter() - t0
                    u, t = out.usage, out.timings
                    per.append(dict(
                        tokens=out.token_ids, wall_s=wall, completion=u.completion_tokens, rounds=u.rounds,
                        tau=u.mean_acceptance_length, prefill_ms=t.prefill_ms, draft_ms=t.draft_ms, admit_ms=t.admit_ms,
                        verify_ms=t.verify_ms, verify_server_ms=t.verify_server_ms, verify_forward_ms=t.verify_forward_ms,
                    ))
                results[f"stack/{name}"] = per
                print(f"  stack/{name}: done", file=sys.stderr, flush=True)
    return results


def run_hf(model: str, prompts, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    results = {}
    for name, kw in (("hf/greedy", {}), ("hf/prompt_lookup", {"prompt_lookup_num_tokens": 10})):
        per = []
        with torch.no_grad():
            m.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False, **kw)  # warm-up
            for p in prompts:
                t0 = time.perf_counter()
                out = m.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
                wall = time.perf_counter() - t0
                per.append(dict(tokens=out[0, len(p):].tolist(), wall_s=wall, completion=out.shape[1] - len(p)))
        results[name] = per
        print(f"  {name}: done", file=sys.stderr, flush=True)
    return results


def summarize(results: dict) -> dict:
    rows = {}
    for mode, per in results.items():
        toks = sum(r["completion"] for r in per)
        wall = sum(r["wall_s"] for r in per)
        row = {"tokens": toks, "wall_s": round(wall, 3), "tok_per_s": round(toks / wall, 2)}
        if mode.startswith("stack/"):
            rounds = sum(r["rounds"] for r in per)
            row.update(
                rounds=rounds,
                tau=round(statistics.mean(r["tau"] for r in per), 3),
                draft_ms_per_round=round(sum(r["draft_ms"] for r in per) / rounds, 3),
                admit_ms_per_round=round(sum(r["admit_ms"] for r in per) / rounds, 3),
                verify_forward_ms_per_round=round(sum(r["verify_forward_ms"] for r in per) / rounds, 3),
                verifier_overhead_ms_per_round=round(sum(r["verify_server_ms"] - r["verify_forward_ms"] for r in per) / rounds, 3),
                rpc_overhead_ms_per_round=round(sum(r["verify_ms"] - r["verify_server_ms"] for r in per) / rounds, 3),
                prefill_ms_mean=round(statistics.mean(r["prefill_ms"] for r in per), 3),
            )
        rows[mode] = row
    return rows


def markdown(rows: dict, meta: dict) -> str:
    base = rows["stack/none"]["tok_per_s"]
    pl = rows["hf/prompt_lookup"]["tok_per_s"]
    lines = [
        f"# CPU end-to-end benchmark ({meta['date']})",
        "",
        f"Model `{meta['model']}`, drafter `{meta['drafter']}`; {meta['prompts']} held-out stdlib prompts of "
        f"{meta['prompt_tokens']} tokens, {meta['new_tokens']} new tokens each, greedy; {meta['machine']}.",
        f"Command: `{meta['command']}`",
        "",
        "| mode | tok/s | vs block-1 | vs HF prompt-lookup | tau | draft ms/round | admit ms/round | verify fwd ms/round | verifier other ms/round | RPC ms/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['tok_per_s']} | {r['tok_per_s'] / base:.2f}x | {r['tok_per_s'] / pl:.2f}x | {r.get('tau', '')} | "
            f"{r.get('draft_ms_per_round', '')} | {r.get('admit_ms_per_round', '')} | {r.get('verify_forward_ms_per_round', '')} | "
            f"{r.get('verifier_overhead_ms_per_round', '')} | {r.get('rpc_overhead_ms_per_round', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--drafter", default="")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_cpu"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model or str(default_target_dir())
    drafter = args.drafter or str(default_drafter_dir() or "")
    if not drafter:
        ap.error("a DFlash drafter is needed (--drafter DIR, or the embedded demo pair)")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens)
    print(f"{len(prompts)} prompts; running the stack modes", file=sys.stderr)
    results = run_stack_modes(model, drafter, prompts, args.new_tokens, str(pathlib.Path(args.out).parent / "logs"))
    ref = [r["tokens"] for r in results["stack/none"]]
    for mode, per in results.items():
        if [r["tokens"] for r in per] != ref:
            raise SystemExit(f"LOSSLESS CHECK FAILED: {mode} emitted different tokens than block-1 decoding")
    results.update(run_hf(model, prompts, args.new_tokens))
    rows = summarize(results)
    meta = dict(
        date=time.strftime("%Y-%m-%d"), model=pathlib.Path(model).name, drafter=pathlib.Path(drafter).name,
        prompts=len(prompts), prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
        machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        command="python benchmarks/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    md = markdown(rows, meta)
    print(md)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
