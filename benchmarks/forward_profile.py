"""Where a verify forward's GPU time goes: the kernels of the served forward (CUDA-graph replays on the paged KV), by
name, with their count and time per forward, next to the forward's wall time and its byte time.

    python benchmarks/forward_profile.py [--targets qwen3-8l gptoss-24l] [--blocks 1 16] [--rounds 16] [--out DIR]

Each target is built and served as `benchmarks/e2e_gpu.py` builds and serves it (kernels installed, graphs captured),
one prompt is prefilled, and `--rounds` verify rounds of each block width (the replay drafter: the target's own
greedy continuation, so every row of a block is accepted and the width stays put) run under torch.profiler (CUDA
activity: the kernels a graph replay launches are recorded one by one). Writes forward_profile_<device>.json / .md to
--out: per target and block, the kernels sorted by GPU time (us per forward, launches per forward, share), grouped
also by family (the leading part of the kernel's name), the sum of kernel time per forward, the forward's wall time
(`forward_ms` as the verifier reports it) and the gaps between them (launch latency the graph cannot hide).

Run as a script, it profiles plain launches (PDFLASH_PDL=0) unless PDFLASH_PDL is set: with programmatic dependent launch a
kernel's programs start early and wait for the kernel before it, and the profiler counts that wait as the kernel's time
(on the H200, gptoss-24l's kernel times added up to 8.5 ms a round against a 3.7 ms forward).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":  # a profile run: plain launches unless PDFLASH_PDL says otherwise (the module doc; read when
    os.environ.setdefault("PDFLASH_PDL", "0")  # pdflash_kernels.runtime is imported, below)

from benchmarks.e2e_gpu import build, copy_rate_bytes, dense_bytes, serve  # noqa: E402
from benchmarks.inprocess import core_run  # noqa: E402
from verifier_svc.engine import PagedKVOptions, VerifierCore  # noqa: E402


def family(name: str) -> str:
    """A kernel's family: Triton kernels by their function name, others by the leading template/function name."""
    n = re.sub(r"^void ", "", name)
    n = re.split(r"[<(]", n)[0]
    n = n.split("::")[-1] if "::" in n and not n.startswith("at::native") else n
    return re.sub(r"_\d+$", "", n)[:80]


def kernel_table(prof, forwards: int) -> tuple[list[dict], float]:
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            if "Memcpy" in e.name or "Memset" in e.name:
                per[f"[{e.name}]"].append(e.device_time_total)
            else:
                per[e.name].append(e.device_time_total)
    if not per:  # no CUDA activity (a CPU run): the aten ops the rounds ran, by CPU self time
        for e in prof.events():
            if e.name.startswith("aten::") and e.self_cpu_time_total > 0:
                per[e.name].append(e.self_cpu_time_total)
    rows = [{"kernel": k[:160], "family": family(k), "launches_per_forward": round(len(v) / forwards, 2),
             "us_per_forward": round(sum(v) / forwards, 2)} for k, v in per.items()]
    rows.sort(key=lambda r: -r["us_per_forward"])
    total = sum(r["us_per_forward"] for r in rows)
    for r in rows:
        r["share"] = round(r["us_per_forward"] / total, 3) if total else 0.0
    return rows, total


def families(rows: list[dict]) -> list[dict]:
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        agg[r["family"]][0] += r["us_per_forward"]
        agg[r["family"]][1] += r["launches_per_forward"]
    out = [{"family": k, "us_per_forward": round(v[0], 2), "launches_per_forward": round(v[1], 2)} for k, v in agg.items()]
    return sorted(out, key=lambda r: -r["us_per_forward"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["qwen3-8l", "gptoss-24l"])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--kernels", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run: no CUDA kernels to list)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.prompts, args.new_tokens = 1, 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rate = copy_rate_bytes(device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "copy_rate_bytes_per_s": rate, "targets": {}}
    from pdflash_kernels import runtime

    result["pdl"] = runtime.PDL
    lines = [f"# Verify forward kernels on {result['device']} (`python benchmarks/forward_profile.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`)", "",
             f"Launches: {'programmatic dependent launch (kernel times include each wait for the kernel before)' if runtime.PDL else 'plain (PDFLASH_PDL=0)'}.", ""]
    for name in args.targets:
        t = build(name, args, device, dtype)
        target, how = serve(t, args, device)
        core = VerifierCore(target, max_block_size=max(args.blocks), max_tokens_limit=4096,
                            paged_kv=PagedKVOptions(kv_cache_gb=4.0 if device.type == "cuda" else 0.0))
        dense = dense_bytes(target.model)
        prompt = t.prompts[:1]
        n_ref = max(args.blocks) * (args.rounds + 2) + 8
        ref = core_run(core, prompt, n_ref, 1, lambda *a: [])["outputs"][0]
        res_t = result["targets"][name] = {"experts": how, "cuda_graphs": core.graphs is not None, "blocks": {}}
        lines += [f"## {name}: experts {how}; CUDA graphs {core.graphs is not None}", ""]
        for block in args.blocks:
            def propose(i, p, out, k, state):
                n = len(out)
                return list(ref[n: n + k])
            new = block * args.rounds
            core_run(core, prompt, new, block, propose)  # warm: this bucket's graph captured
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts)

            def start():  # after the prefill: only the verify rounds are profiled
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                prof.start()

            t0 = time.perf_counter()
            r = core_run(core, prompt, new, block, propose, on_prefill=start)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.stop()
            wall = time.perf_counter() - t0
            rows, total = kernel_table(prof, r["rounds"])
            fwd_ms = r["forward_ms"] / r["rounds"]
            byte_ms = (dense + r["routed_bytes"] / r["rounds"]) / rate * 1e3
            res_t["blocks"][block] = {
                "rounds": r["rounds"], "tau": round(r["decode_tokens"] / r["rounds"], 2), "forward_ms": round(fwd_ms, 3),
                "byte_time_ms": round(byte_ms, 4), "kernel_us_per_round": round(total, 1),
                "wall_s": round(wall, 3), "kernels": rows[:60], "families": families(rows)[:30]}
            lines += [f"### block {block}: {r['rounds']} rounds, tau {r['decode_tokens'] / r['rounds']:.2f}; forward "
                      f"{fwd_ms:.3f} ms (wall, as reported), byte time {byte_ms:.4f} ms; kernel time {total / 1e3:.3f} ms a "
                      f"round (everything the rounds ran, the forward and the round around it)", "",
                      "| family | us / round | launches / round |", "|---|---|---|"]
            lines += [f"| `{f['family']}` | {f['us_per_forward']} | {f['launches_per_forward']} |" for f in families(rows)[:25]]
            lines += ["", "| kernel | us / round | launches / round | share |", "|---|---|---|---|"]
            lines += [f"| `{k['kernel'][:110]}` | {k['us_per_forward']} | {k['launches_per_forward']} | {k['share']} |" for k in rows[:30]]
            lines.append("")
            print(f"[{name}] block {block}: forward {fwd_ms:.3f} ms, byte {byte_ms:.4f} ms, kernels {total / 1e3:.3f} ms/round, "
                  f"{sum(k['launches_per_forward'] for k in rows):.0f} launches/round", flush=True)
            for f in families(rows)[:12]:
                print(f"    {f['us_per_forward']:9.1f} us  {f['launches_per_forward']:7.1f}x  {f['family']}", flush=True)
        del core, target, t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in result["device"] else device.type
    (out / f"forward_profile_{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"forward_profile_{tag}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
