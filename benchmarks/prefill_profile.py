"""Where a prefill forward's GPU time goes, whole and in chunks (`--prefill-chunk`): the kernels by family, for the
one-go prefill of a prompt and for its chunked prefill's last chunk (the chunk with the longest context), on the paged
KV as the server runs them.

    python benchmarks/prefill_profile.py [--targets qwen3-8l gptoss-24l] [--tokens 2048] [--chunk 256] [--out DIR]

Targets as benchmarks/e2e_gpu.py builds and serves them. Each prefill runs once untimed (compiles), then once under
torch.profiler (CUDA activity). Writes prefill_profile_<device>.json / .md to --out: per target and form (whole,
chunk k of n), the forward's wall ms, the kernel time and the families by GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    os.environ.setdefault("PDFLASH_PDL", "0")  # plain launches: the profiler's kernel times are their own (forward_profile.py)

from benchmarks.e2e_gpu import build, serve  # noqa: E402
from benchmarks.forward_profile import families, kernel_table  # noqa: E402
from benchmarks.kernel_bench import device_tag  # noqa: E402
from pdflash.types import SamplingParams  # noqa: E402
from verifier_svc.engine import PagedKVOptions, PrefillInput, VerifierCore  # noqa: E402
from verifier_svc.runner import prefill_graphs_enabled  # noqa: E402


def profiled_steps(core: VerifierCore, prompt: tuple[int, ...], chunk: int) -> list[dict]:
    """The prefill's forwards (one, or one a chunk), each profiled on its own: wall ms, kernel us, families."""
    core.prefill_chunk = chunk
    try:
        for timed in (False, True):
            job = core.start_prefill(PrefillInput("prefill", prompt, SamplingParams(), 1, ignore_eos=True))
            rows = []
            try:
                done = False
                while not done:
                    if timed:
                        start, n = job.done, min(job.chunk, len(prompt) - job.done)
                        cuda = core.target.device.type == "cuda"  # (a CPU run on a GPU host profiles the CPU's ops)
                        acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
                        with torch.profiler.profile(activities=acts) as prof:
                            t0 = time.perf_counter()
                            done = job.step()
                            ms = (time.perf_counter() - t0) * 1e3
                        table, total = kernel_table(prof, 1)
                        rows.append({"start": start, "rows": n,
                                     "wall_ms": round(ms, 3), "kernel_us": round(total, 1), "families": families(table)[:12],
                                     "kernels": table[:12]})
                    else:
                        done = job.step()
                job.finish()
            finally:
                job.close()
        return rows
    finally:
        core.prefill_chunk = 0


def host_profile(core: VerifierCore, prompt: tuple[int, ...], chunk: int, top: int = 30) -> dict:
    """Where the host's time goes in one prefill step (the first chunk, or the whole prompt), by cProfile: the
    functions by their own time (ms), with their calls; the step's wall ms under the profiler beside it."""
    import cProfile
    import pstats

    core.prefill_chunk = chunk
    try:
        job = core.start_prefill(PrefillInput("prefill", prompt, SamplingParams(), 1, ignore_eos=True))
        rows = min(job.chunk, len(prompt))  # (on transformers' cache a prompt is one step whatever the chunk)
        try:
            pr = cProfile.Profile()
            t0 = time.perf_counter()
            pr.enable()
            job.step()
            pr.disable()
            wall = (time.perf_counter() - t0) * 1e3
        finally:
            job.close()
    finally:
        core.prefill_chunk = 0
    stats = pstats.Stats(pr).stats
    funcs = sorted(((tt, nc, ct, f"{pathlib.Path(fn).name}:{line}({name})") for (fn, line, name), (_, nc, tt, ct, _) in
                    stats.items()), reverse=True)
    return {"rows": rows, "wall_ms": round(wall, 2),
            "functions": [{"function": f, "self_ms": round(tt * 1e3, 3), "cum_ms": round(ct * 1e3, 3), "calls": nc}
                          for tt, nc, ct, f in funcs[:top]]}


def markdown(result: dict) -> str:
    lines = [f"# Prefill forwards by kernel family ({result['meta']['device_name']}, {result['meta']['date']})", "",
             ("`" if result["meta"].get("prefill_graphs") or result["meta"]["device"] == "cpu" else "`PDFLASH_PREFILL_GRAPHS=0 ") + f"{result['meta']['command']}`", ""]
    for r in result["rows"]:
        lines += [f"## {r['target']}: {r['form']} (rows {r['rows']} at start {r['start']}): wall {r['wall_ms']:.2f} ms, "
                  f"kernels {r['kernel_us'] / 1e3:.2f} ms", "", "| family | us | launches |", "|---|---|---|"]
        lines += [f"| {f['family']} | {f['us_per_forward']:.0f} | {f['launches_per_forward']:.0f} |" for f in r["families"]]
        lines += [""]
    for h in result.get("host", []):
        lines += [f"## {h['target']}: host time of one prefill step ({h['rows']} rows; cProfile, wall {h['wall_ms']:.1f} ms "
                  "under it)", "", "| function | self ms | cumulative ms | calls |", "|---|---|---|---|"]
        lines += [f"| `{f['function']}` | {f['self_ms']:.2f} | {f['cum_ms']:.2f} | {f['calls']} |" for f in h["functions"]]
        lines += [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["qwen3-8l", "gptoss-24l"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile one prefill step (a chunk's rows) on the host: where an eager forward's host time goes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bargs = argparse.Namespace(layers=args.layers, tiny=args.tiny, prompt_tokens=16, prompts=1, new_tokens=8, kernels="auto")
    result = {"meta": {"date": time.strftime("%Y-%m-%d"), "device": str(device),
                             "prefill_graphs": device.type == "cuda" and prefill_graphs_enabled(),
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                       "command": "python benchmarks/prefill_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])},
              "rows": [], "host": []}
    for name in args.targets:
        t = build(name, bargs, device, dtype)
        target, _ = serve(t, bargs, device)
        core = VerifierCore(target, max_block_size=32, max_tokens_limit=args.tokens + 64,
                            paged_kv=PagedKVOptions(kv_cache_gb=4.0 if device.type == "cuda" else 0.0))
        vocab = t.model.config.get_text_config().vocab_size
        rng = random.Random(1)
        prompt = tuple(rng.randrange(2, vocab) for _ in range(args.tokens))
        whole = profiled_steps(core, prompt, 0)
        chunked = profiled_steps(core, prompt, args.chunk)
        forms = [("whole", whole[-1:]), (f"chunk {len(chunked)} of {len(chunked)}", chunked[-1:])]
        if len(chunked) > 1:
            forms.append((f"chunk 1 of {len(chunked)}", chunked[:1]))
        for form, rows in forms:
            for r in rows:
                result["rows"].append({"target": t.name, "form": form, **r})
                print(f"{t.name} {form}: wall {r['wall_ms']:.2f} ms, kernels {r['kernel_us'] / 1e3:.2f} ms; "
                      + ", ".join(f"{f['family'][:40]} {f['us_per_forward']:.0f}" for f in r["families"][:5]), flush=True)
        if args.host_profile:
            h = host_profile(core, prompt, args.chunk)
            result["host"].append({"target": t.name, **h})
            print(f"{t.name} host ({h['rows']} rows, wall {h['wall_ms']:.1f} ms): "
                  + ", ".join(f"{f['function']} {f['self_ms']:.2f}" for f in h["functions"][:5]), flush=True)
        del core, target, t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"prefill_profile_{device_tag(device)}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
