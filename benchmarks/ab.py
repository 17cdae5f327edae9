"""A/B of two stack configurations on the same machine at the same time, with transformers' prompt lookup.

Both stacks are up at once (idle between their requests); every prompt goes to A, then B (the order
alternates per prompt and pass), then to transformers' in-process `generate(prompt_lookup_num_tokens=10)`,
so machine drift hits all three alike. Reports per pass tok/s, B/A, and each against prompt lookup, and
the medians over passes. Used to decide this codebase's speed changes (benchmarks/README.md).

A side is described by environment settings (PDFLASH_* options or anything the services read),
`--X-tree DIR` (run that side's services from another checkout, e.g. `git worktree add /tmp/old HEAD~3`)
and `--X-no-pin` (no --cpus pinning by the stack; needed for checkouts older than --cpus).

    python benchmarks/ab.py --b-env PDFLASH_PREFILL_THREADS=2 [--passes 4] [--drafter ngram --block 32]
    python benchmarks/ab.py --a-tree /tmp/old --a-no-pin [--out benchmarks/results/ab_NAME.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdflash.client import Client  # noqa: E402
from pdflash.defaults import default_drafter_dir, default_target_dir  # noqa: E402
from pdflash.stack import Stack, StackSpec, free_ports  # noqa: E402


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep:
            raise SystemExit(f"--a-env/--b-env take KEY=VALUE, got {p!r}")
        out[k] = v
    return out


def _spec(env: dict[str, str], tree: str, pin: bool, log_dir: str, verifier_args: str = "") -> StackSpec:
    env = dict(env)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ports = free_ports(3)
    return StackSpec(model=str(default_target_dir()), drafter=str(default_drafter_dir() or ""), drafter_port=ports[0],
                     scheduler_port=ports[1], verifier_port=ports[2], metrics_ports=(-1, -1, -1), log_dir=log_dir,
                     verifier_args=["--device", "cpu", *verifier_args.split()], extra_env=env, pin=pin)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-env", nargs="*", default=[], metavar="KEY=VALUE")
        ap.add_argument(f"--{side}-tree", default="", help="run this side's services from that checkout")
        ap.add_argument(f"--{side}-no-pin", action="store_true")
        ap.add_argument(f"--{side}-verifier-args", default="", help="extra serve-verifier flags, e.g. '--cpus 0'")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--prompt-file", default=str(ROOT / "benchmarks" / "prompts_heldout.json"))
    ap.add_argument("--out", default="", help="write the result as JSON here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    # The services run `python -m pdflash.cli`, which puts the working directory first on sys.path: from a
    # neutral one, a side's --X-tree (PYTHONPATH) wins and the other side imports the installed package.
    args.out = str(pathlib.Path(args.out).resolve()) if args.out else ""
    args.prompt_file = str(pathlib.Path(args.prompt_file).resolve())
    args.a_tree = str(pathlib.Path(args.a_tree).resolve()) if args.a_tree else ""
    args.b_tree = str(pathlib.Path(args.b_tree).resolve()) if args.b_tree else ""
    os.chdir(tempfile.mkdtemp(prefix="pdflash-ab-"))
    prompts = json.loads(pathlib.Path(args.prompt_file).read_text())[: args.prompts]
    model = AutoModelForCausalLM.from_pretrained(str(default_target_dir()), dtype=torch.float32).eval()
    n = args.new_tokens

    def hf(p) -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=10)
            return time.perf_counter() - t0

    logs = ROOT / "benchmarks" / "results" / "logs"
    spec_a = _spec(_env(args.a_env), args.a_tree, not args.a_no_pin, str(logs / "ab_a"), args.a_verifier_args)
    spec_b = _spec(_env(args.b_env), args.b_tree, not args.b_no_pin, str(logs / "ab_b"), args.b_verifier_args)
    res: dict[str, list[float]] = {"a": [], "b": [], "hf": []}
    outputs: dict[str, list] = {"a": [], "b": []}
    with Stack(spec_a) as a, Stack(spec_b) as b:
        a.wait_ready(300)
        b.wait_ready(300)
        with Client(a.drafter) as ca, Client(b.drafter) as cb:
            clients = {"a": ca, "b": cb}
            for c in clients.values():  # warm-up
                c.generate(prompts[0], max_tokens=8, drafter=args.drafter, block_size=args.block)
            hf(prompts[0][:32])
            for rep in range(args.passes):
                wall = {"a": 0.0, "b": 0.0, "hf": 0.0}
                for i, p in enumerate(prompts):
                    for side in ("a", "b") if (i + rep) % 2 == 0 else ("b", "a"):
                        t0 = time.perf_counter()
                        out = clients[side].generate(p, max_tokens=n, drafter=args.drafter, block_size=args.block,
                                                     ignore_eos=True, timeout=600)
                        wall[side] += time.perf_counter() - t0
                        if rep == 0:
                            outputs[side].append(out.token_ids)
                    wall["hf"] += hf(p)
                for k in wall:
                    res[k].append(len(prompts) * n / wall[k])
                print(f"pass {rep + 1}/{args.passes}: A {res['a'][-1]:.0f} B {res['b'][-1]:.0f} prompt-lookup {res['hf'][-1]:.0f} tok/s; "
                      f"B/A {res['b'][-1] / res['a'][-1]:.3f}", file=sys.stderr, flush=True)
    if outputs["a"] != outputs["b"]:
        raise SystemExit("LOSSLESS CHECK FAILED: A and B emitted different tokens")

    def med_ratio(x, y):
        return round(statistics.median(u / v for u, v in zip(res[x], res[y])), 3)

    summary = dict(
        date=time.strftime("%Y-%m-%d"), command="python benchmarks/ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        machine=f"{os.cpu_count()} CPUs, torch {torch.__version__}", drafter=args.drafter, block=args.block,
        prompts=len(prompts), new_tokens=n, passes=args.passes,
        tok_per_s={k: [round(x, 1) for x in v] for k, v in res.items()},
        median_tok_per_s={k: round(statistics.median(v), 1) for k, v in res.items()},
        b_over_a=med_ratio("b", "a"), a_over_prompt_lookup=med_ratio("a", "hf"), b_over_prompt_lookup=med_ratio("b", "hf"),
    )
    print("| side | median tok/s | vs prompt lookup (paired median) |\n|---|---|---|")
    print(f"| A | {summary['median_tok_per_s']['a']} | {summary['a_over_prompt_lookup']}x |")
    print(f"| B | {summary['median_tok_per_s']['b']} | {summary['b_over_prompt_lookup']}x |")
    print(f"| prompt lookup | {summary['median_tok_per_s']['hf']} | 1.00x |")
    print(f"\nB/A (paired median over passes): {summary['b_over_a']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
