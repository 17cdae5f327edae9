"""CPU end-to-end benchmark through the full gRPC stack, with transformers in-process as the peer.

Same prompts and lengths for every mode:
  stack/none      block 1: plain autoregressive verification through the three services
  stack/ngram     n-gram prompt lookup drafting (block 16; stack/ngram@32: block 32), adaptive width
  stack/ngram@32/fixed  the same with every round drafting 31 tokens (the width adaptation switched off)
  stack/dflash    DFlash block drafting (block 16)
  stack/hybrid    n-gram when the context matches (block 32), DFlash otherwise (its block 16)
The stack runs as `pdflash up` runs it: the verifier's forwards on every core but one (--verifier-threads to
change), the drafter and scheduler pinned to the spare core;
transformers in-process uses torch's default (all cores; --threads to change).
  hf/greedy       transformers `generate(do_sample=False)` in-process
  hf/prompt_lookup  transformers `generate(prompt_lookup_num_tokens=10)` in-process
Per-round time is split into draft, admission (Admit + Release), verify forward, verifier handler
overhead and RPC overhead (client-observed Verify minus the verifier's own handler time).
Every pass runs every mode on every prompt, prompt by prompt (stack and transformers alternate every few
hundred milliseconds, so drift on a shared machine hits all of them alike); the median pass per mode is reported, with all passes in the JSON, and the median
over passes of each mode's ratio to transformers' prompt lookup within the same pass.

    python benchmarks/e2e.py [--model DIR --drafter DIR] [--prompts 8 --prompt-tokens 128 --new-tokens 128] [--repeats 3]

Prints a table and writes benchmarks/results/e2e_cpu.json and .md. All stack modes must emit the
same tokens (greedy is lossless); the script checks that and fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import sysconfig
import time

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdflash.client import Client  # noqa: E402
from pdflash.defaults import default_drafter_dir, default_target_dir  # noqa: E402
from pdflash.stack import Stack, StackSpec, free_ports  # noqa: E402
from pdflash.torch_thread import usable_cores  # noqa: E402
from verifier_svc.config import VerifierConfig  # noqa: E402

# (row name, drafter, block, fixed width): every round drafts block - 1 with a fixed width, else the width adapts
# (drafter_svc.width). DFlash drafts at most its trained block (16); hybrid n-gram rounds may use 32.
STACK_MODES = [
    ("none", "none", 1, False), ("ngram", "ngram", 16, False), ("ngram@32", "ngram", 32, False),
    ("ngram@32/fixed", "ngram", 32, True), ("dflash", "dflash", 16, False), ("hybrid", "hybrid", 32, False),
]


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


def _stack_run(c: Client, kind: str, block: int, fixed: bool, prompts, new_tokens: int) -> list[dict]:
    per = []
    for p in prompts:
        t0 = time.perf_counter()
        out = c.generate(p, max_tokens=new_tokens, drafter=kind, block_size=block, fixed_width=fixed, ignore_eos=True,
                         timeout=600)
        wall = time.perf_counter() - t0
        u, t = out.usage, out.timings
        per.append(dict(
            tokens=out.token_ids, wall_s=wall, completion=u.completion_tokens, rounds=u.rounds,
            tau=u.mean_acceptance_length, prefill_ms=t.prefill_ms, draft_ms=t.draft_ms, admit_ms=t.admit_ms,
            verify_ms=t.verify_ms, verify_server_ms=t.verify_server_ms, verify_forward_ms=t.verify_forward_ms,
            routed_bytes=u.routed_expert_bytes,
        ))
    return per


def _hf_run(m, kw: dict, prompts, new_tokens: int) -> list[dict]:
    per = []
    with torch.no_grad():
        for p in prompts:
            t0 = time.perf_counter()
            out = m.generate(torch.tensor([p], device=m.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
            wall = time.perf_counter() - t0
            per.append(dict(tokens=out[0, len(p):].tolist(), wall_s=wall, completion=out.shape[1] - len(p)))
    return per


HF_MODES = [("hf/greedy", {}), ("hf/prompt_lookup", {"prompt_lookup_num_tokens": 10})]


def run_all(model: str, drafter: str, prompts, new_tokens: int, repeats: int, log_dir: str, threads: int = 0,
            verifier_threads: int | None = None) -> list[dict]:
    """Every mode on every prompt once per pass (modes interleaved prompt by prompt), passes repeated: machine
    drift hits all modes alike (medians are reported)."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    ports = free_ports(3)
    spec = StackSpec(
        model=model, drafter=drafter, drafter_port=ports[0], scheduler_port=ports[1], verifier_port=ports[2],
        metrics_ports=(-1, -1, -1), log_dir=log_dir,
        verifier_args=["--device", "cpu"] + ([] if verifier_threads is None else ["--torch-threads", str(verifier_threads)]),
    )
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    passes = []
    with Stack(spec) as stack:
        stack.wait_ready(300)
        with Client(stack.drafter) as c:
            c.generate(prompts[0], max_tokens=8, drafter="none")  # warm-up
            with torch.no_grad():
                for _, kw in HF_MODES:
                    m.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False, **kw)
            for rep in range(repeats):
                results: dict[str, list[dict]] = {}
                # Prompt by prompt, every mode in turn: modes compared are measured seconds apart.
                for p in prompts:
                    for name, kind, block, fixed in STACK_MODES:
                        results.setdefault(f"stack/{name}", []).extend(_stack_run(c, kind, block, fixed, [p], new_tokens))
                    for name, kw in HF_MODES:
                        results.setdefault(name, []).extend(_hf_run(m, kw, [p], new_tokens))
                passes.append(results)
                line = ", ".join(f"{k} {sum(r['completion'] for r in v) / sum(r['wall_s'] for r in v):.0f}" for k, v in results.items())
                print(f"  pass {rep + 1}/{repeats} (tok/s): {line}", file=sys.stderr, flush=True)
    return passes


def summarize(passes: list[dict]) -> dict:
    """Per mode: the median pass's tok/s (and its wall time); per-round splits over all passes."""
    rows = {}

    def speed(p: dict, mode: str) -> float:
        return sum(r["completion"] for r in p[mode]) / sum(r["wall_s"] for r in p[mode])

    for mode in passes[0]:
        speeds = sorted(speed(p, mode) for p in passes)
        # Each pass runs every mode back to back: the ratio within a pass cancels most of a shared machine's drift.
        paired = [speed(p, mode) / speed(p, "hf/prompt_lookup") for p in passes]
        per = [r for p in passes for r in p[mode]]
        toks = sum(r["completion"] for r in passes[0][mode])
        median = statistics.median(speeds)
        row = {"tokens": toks, "wall_s": round(toks / median, 3), "tok_per_s": round(median, 2),
               "tok_per_s_passes": [round(x, 2) for x in speeds],
               "vs_hf_prompt_lookup_per_pass": [round(x, 3) for x in paired],
               "vs_hf_prompt_lookup_paired": round(statistics.median(paired), 3)}
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
        f"{meta['prompt_tokens']} tokens, {meta['new_tokens']} new tokens each, greedy; {meta['machine']}; "
        f"median of {meta['repeats']} passes (tok/s of every pass in the JSON). Stack output == transformers greedy: "
        f"{meta['matches_hf_greedy']}.",
        f"Command: `{meta['command']}`",
        "",
        "| mode | tok/s | vs block-1 | vs HF prompt-lookup | same pass vs HF prompt-lookup (median) | tau | draft ms/round | admit ms/round | verify fwd ms/round | verifier other ms/round | RPC ms/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['tok_per_s']} | {r['tok_per_s'] / base:.2f}x | {r['tok_per_s'] / pl:.2f}x | "
            f"{r['vs_hf_prompt_lookup_paired']:.2f}x | {r.get('tau', '')} | "
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
    ap.add_argument("--repeats", type=int, default=3, help="passes over all modes; the median pass is reported")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads of transformers in-process (0 = torch's default: all cores)")
    ap.add_argument("--verifier-threads", type=int, default=None,
                    help="the verifier's torch threads (default: the stack's own choice, every core but one)")
    ap.add_argument("--prompt-file", default=str(ROOT / "benchmarks" / "prompts_heldout.json"),
                    help="JSON list of token-id prompts (written from the held-out stdlib files when missing)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_cpu"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model or str(default_target_dir())
    drafter = args.drafter or str(default_drafter_dir() or "")
    if not drafter:
        ap.error("a DFlash drafter is needed (--drafter DIR, or the embedded demo pair)")
    pfile = pathlib.Path(args.prompt_file)
    prompts = json.loads(pfile.read_text()) if pfile.exists() else []
    if len(prompts) < args.prompts or any(len(p) < args.prompt_tokens for p in prompts):
        # The same prompts on every machine (stdlib files differ between Python versions): made once, then read.
        prompts = heldout_prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.prompt_tokens)
        pfile.write_text(json.dumps(prompts))
    prompts = [p[: args.prompt_tokens] for p in prompts[: args.prompts]]
    print(f"{len(prompts)} prompts; running the stack modes", file=sys.stderr)
    passes = run_all(model, drafter, prompts, args.new_tokens, args.repeats, str(pathlib.Path(args.out).parent / "logs"), args.threads,
                     args.verifier_threads)
    ref = [r["tokens"] for r in passes[0]["stack/none"]]
    for results in passes:
        for mode, per in results.items():
            if mode.startswith("stack/") and [r["tokens"] for r in per] != ref:
                raise SystemExit(f"LOSSLESS CHECK FAILED: {mode} emitted different tokens than block-1 decoding")
    rows = summarize(passes)
    hf_ref = [r["tokens"] for r in passes[0]["hf/greedy"]]
    matches = sum(a == b for a, b in zip(ref, hf_ref))
    meta = dict(
        date=time.strftime("%Y-%m-%d"), model=pathlib.Path(model).name, drafter=pathlib.Path(drafter).name,
        prompts=len(prompts), prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
        matches_hf_greedy=f"{matches}/{len(ref)} prompts",
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads in-process, "
                f"verifier {VerifierConfig(colocated=True).thread_counts(usable_cores())[0] if args.verifier_threads is None else args.verifier_threads}, drafter 1, "
                f"torch {torch.__version__}, transformers {transformers.__version__}",
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
