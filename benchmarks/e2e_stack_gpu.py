"""The whole stack through gRPC on one GPU: the three services as `pdflash up` starts them (verifier and drafter on
the same CUDA device), next to transformers' own decoding in process on that GPU.

    python benchmarks/e2e_stack_gpu.py [--targets demo qwen3-8l gptoss-24l] [--prompts 4] [--new-tokens 128]
                                       [--blocks 8 16 32] [--no-hf] [--out DIR] [--work-dir DIR] [--keep-checkpoints]
    python benchmarks/e2e_stack_gpu.py --device cpu --targets demo --new-tokens 16     # the CPU smoke run

Targets: `demo`, the embedded pair (trained target + DFlash drafter); `qwen3-<N>l`, Qwen3-30B-A3B layer shapes with N
layers, and `gptoss-<N>l`, gpt-oss-20b layer shapes with N layers served with `--experts mxfp4` (resident), both
random bf16 weights written once to --work-dir (`pdflash.tiny.make_real_shape_checkpoint`) and served n-gram only.
Prompts: the demo's held-out prompts (`benchmarks/prompts_heldout.json`); for the others the same held-out stdlib
files through their own tokenizer (`benchmarks.e2e.heldout_prompts`).

Rows: stack none (block 1) and n-gram / DFlash / hybrid (the last two with a DFlash drafter) at each of --blocks,
adaptive width; DFlash drafts at most its trained block (16 for the demo), so its rows stop there. Then
transformers' greedy `generate` and prompt lookup in this process on the same device (skipped with --no-hf).
Every mode runs every prompt, prompt by prompt (`benchmarks.e2e._stack_run`, as e2e.py does).

Columns: tok/s (client-observed, prefill included); tau (tokens per verify round); forward_ms (the verifier's forward
per round); byte_time_ms (the bytes that forward reads: every dense weight but the input embedding, plus the round's
routed experts as the verifier's byte map counts them, at --copy-rate); round_other_ms (the client-observed round,
(wall - prefill) / rounds, minus the forward); identical (the mode's tokens equal the stack's block-1 tokens on every
prompt); the per-round split of the rest as e2e.py measures it (draft, admit, RPC, verifier handler) in the JSON.
The script exits 1 when a stack mode is not identical.

Writes <out>/e2e_gpu_stack_<device>.json and .md on CUDA (_h200 on the H200) (e2e_stack_cpu.json / .md with --device cpu), and the
services' logs to <out>/stack_logs/<target>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pathlib
import platform
import random
import shutil
import signal
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e import HF_MODES, _hf_run, _stack_run, heldout_prompts  # noqa: E402
from benchmarks.kernel_bench import device_tag  # noqa: E402
from pdflash.client import Client  # noqa: E402
from pdflash.defaults import default_drafter_dir, default_target_dir  # noqa: E402
from pdflash.stack import Stack, StackSpec, free_ports  # noqa: E402

COPY_RATE = 4.2e12  # bytes/s, the H200's device-to-device copy rate (read + write) as benchmarks/kernel_bench.py measured it
ARCHS = {"qwen3": "qwen3_moe", "gptoss": "gpt_oss"}
EXPERTS = {"qwen3_moe": "native", "gpt_oss": "mxfp4"}  # gpt-oss as it ships: MXFP4 experts (resident)
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


@dataclasses.dataclass
class Target:
    name: str
    model: pathlib.Path
    drafter: pathlib.Path | None
    experts: str  # the verifier's --experts
    made: bool = False  # written by this run (removed afterwards unless --keep-checkpoints)


def prepare(name: str, device: str, work_dir: pathlib.Path) -> Target:
    """The checkpoint (and DFlash drafter) of a target name: demo, qwen3-<N>l, gptoss-<N>l."""
    if name == "demo":
        return Target(name, pathlib.Path(default_target_dir()), default_drafter_dir(), "native")
    family, _, layers = name.partition("-")
    if family not in ARCHS or not layers.endswith("l") or not layers[:-1].isdigit():
        raise SystemExit(f"unknown target {name!r}: use demo, qwen3-<N>l or gptoss-<N>l (e.g. qwen3-8l)")
    arch = ARCHS[family]
    out = work_dir / name
    made = False
    if not (out / "config.json").exists():
        from pdflash.tiny import make_real_shape_checkpoint

        t0 = time.perf_counter()
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_real_shape_checkpoint(tmp, arch, num_layers=int(layers[:-1]), device=device)
        tmp.rename(out)
        made = True
        _free()
        print(f"[{name}] checkpoint written in {time.perf_counter() - t0:.0f}s: {out}", file=sys.stderr, flush=True)
    # MXFP4 experts run on the kernels (CUDA); a CPU smoke run serves gpt-oss shapes in their own dtype.
    experts = EXPERTS[arch] if device.startswith("cuda") else "native"
    return Target(name, out, None, experts, made)


def prompts_for(target: Target, n: int, prompt_tokens: int) -> list[list[int]]:
    if target.name == "demo":
        prompts = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())
    else:
        from transformers import AutoTokenizer

        prompts = heldout_prompts(AutoTokenizer.from_pretrained(str(target.model)), n, prompt_tokens)
    prompts = [p[:prompt_tokens] for p in prompts[:n]]
    if len(prompts) < n:  # no stdlib sources on this machine: random ids, the same on every run
        rng = random.Random(0)
        prompts += [[rng.randrange(2, 4000) for _ in range(prompt_tokens)] for _ in range(n - len(prompts))]
    return prompts


def dense_bytes(model_dir: pathlib.Path, itemsize: int) -> int:
    """Bytes of the weights a forward reads whole, served at `itemsize` bytes a value: every tensor of the checkpoint
    but the routed experts (the byte map counts those per round) and an untied input embedding (a forward reads only
    its tokens' rows of it)."""
    from safetensors import safe_open

    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if ".experts." in name or (name.endswith("embed_tokens.weight") and not tied):
                    continue
                sl = st.get_slice(name)
                size = itemsize if sl.get_dtype() in ("F32", "BF16", "F16") else _ITEMSIZE.get(sl.get_dtype(), 1)
                total += math.prod(sl.get_shape()) * size
    return total


def stack_modes(blocks: list[int], dflash_block: int | None) -> list[tuple[str, str, int]]:
    """(row name, drafter kind, block): block 1 first (the identity reference)."""
    modes = [("stack none@1", "none", 1)]
    modes += [(f"stack ngram@{b}", "ngram", b) for b in blocks]
    if dflash_block:
        modes += [(f"stack dflash@{b}", "dflash", b) for b in blocks if b <= dflash_block]
        modes += [(f"stack hybrid@{b}", "hybrid", b) for b in blocks]
    return modes


def run_stack(target: Target, device: str, prompts, new_tokens: int, blocks: list[int], log_dir: pathlib.Path) -> tuple[dict, dict]:
    """{row name: per-prompt results} for every stack mode, and what the services say about themselves."""
    ports = free_ports(3)
    spec = StackSpec(
        model=str(target.model), drafter=str(target.drafter or ""), no_dflash=target.drafter is None,
        drafter_port=ports[0], scheduler_port=ports[1], verifier_port=ports[2], metrics_ports=(-1, -1, -1),
        log_dir=str(log_dir), verifier_args=["--device", device, "--experts", target.experts],
        drafter_args=["--device", device],
    )
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {}
    with Stack(spec) as stack:
        stack.wait_ready(900)
        print(f"[{target.name}] stack ready in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        with Client(stack.drafter) as c:
            info = _services_info(c, stack.verifier)
            trained = json.loads((target.drafter / "config.json").read_text())["block_size"] if target.drafter else None
            modes = stack_modes(blocks, trained)
            for _, kind, block in modes:  # warm-up: kernels compiled and graphs captured before anything is timed
                _stack_run(c, kind, block, False, prompts[:1], min(new_tokens, 32))
            for p in prompts:  # prompt by prompt, every mode in turn: drift hits all modes alike
                for name, kind, block in modes:
                    results.setdefault(name, []).extend(_stack_run(c, kind, block, False, [p], new_tokens))
    return results, info


def _services_info(c: Client, verifier: str) -> dict:
    import grpc

    from pdflash.server import CHANNEL_OPTIONS
    from pdflash.v1 import verifier_pb2, verifier_pb2_grpc

    d = c.model_info()
    with grpc.insecure_channel(verifier, options=CHANNEL_OPTIONS) as ch:
        v = verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=30)
    return {"drafter_device": d.drafter_device, "drafter_dtype": d.drafter_dtype, "verifier_device": v.device,
            "verifier_dtype": v.dtype, "batch_invariant": v.batch_invariant, "kernels": v.kernels,
            "experts_format": v.experts_format, "architecture": v.architecture}


def stack_row(target: str, mode: str, per: list[dict], reference: list[list[int]], dense: int, rate: float) -> dict:
    rounds = sum(r["rounds"] for r in per)
    tokens = sum(r["completion"] for r in per)
    wall = sum(r["wall_s"] for r in per)
    fwd = sum(r["verify_forward_ms"] for r in per) / rounds
    round_ms = sum(r["wall_s"] * 1e3 - r["prefill_ms"] for r in per) / rounds

    def per_round(key: str) -> float:
        return round(sum(r[key] for r in per) / rounds, 3)

    return {
        "target": target, "mode": mode, "tok_s": round(tokens / wall, 1),
        "tau": round(sum(r["tau"] * r["rounds"] for r in per) / rounds, 2),
        "forward_ms": round(fwd, 3),
        "byte_time_ms": round((dense + sum(r["routed_bytes"] for r in per) / rounds) / rate * 1e3, 4),
        "round_other_ms": round(round_ms - fwd, 3),
        "identical": [r["tokens"] for r in per] == reference,
        "tokens": tokens, "rounds": rounds, "routed_bytes_per_round": round(sum(r["routed_bytes"] for r in per) / rounds),
        "draft_ms": per_round("draft_ms"), "admit_ms": per_round("admit_ms"),
        "rpc_ms": round(sum(r["verify_ms"] - r["verify_server_ms"] for r in per) / rounds, 3),
        "verifier_other_ms": round(sum(r["verify_server_ms"] - r["verify_forward_ms"] for r in per) / rounds, 3),
        "prefill_ms": round(sum(r["prefill_ms"] for r in per) / len(per), 2),
    }


def hf_rows(target: Target, device: str, prompts, new_tokens: int, reference: list[list[int]]) -> list[dict]:
    """transformers' greedy and prompt-lookup `generate` in this process, stock kernels, the stack's dtype."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    m = AutoModelForCausalLM.from_pretrained(str(target.model), dtype=dtype).to(device).eval()
    rows = []
    try:
        for name, kw in HF_MODES:
            _hf_run(m, kw, prompts[:1], 8)  # warm-up
            per = _hf_run(m, kw, prompts, new_tokens)
            rows.append({"target": target.name, "mode": f"transformers {name.removeprefix('hf/').replace('_', ' ')}",
                         "tok_s": round(sum(r["completion"] for r in per) / sum(r["wall_s"] for r in per), 1),
                         "same_as_block1": [r["tokens"] for r in per] == reference})
            print(rows[-1], flush=True)
    finally:
        del m
        _free()
    return rows


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# The stack through gRPC, verifier and drafter on `{m['device']}` (`{m['command']}`)", "",
        f"{m['device_name']}, torch {m['torch']}; {m['prompts']} prompts x {m['new_tokens']} new tokens, greedy, `ignore_eos`; "
        f"byte time at {m['copy_rate'] / 1e12:.1f} TB/s; {m['seconds']} s in all; {m['date']}. transformers rows: their "
        "tokens against block 1 for information only (stock kernels, not batch-invariant).", "",
    ]
    for name, info in result["services"].items():
        lines.append(f"- {name}: verifier {info['verifier_device']} {info['verifier_dtype']}, kernels {info['kernels'] or 'off'}, "
                     f"batch-invariant {info['batch_invariant']}, experts {info['experts_format']}; DFlash drafter "
                     f"{(info['drafter_device'] + ' ' + info['drafter_dtype']) if info['drafter_device'] else 'none'}")
    lines += ["", "| target | mode | tok/s | tau | forward ms | byte time ms | other ms/round | identical to block 1 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        same = r["identical"] if "identical" in r else f"({'same' if r['same_as_block1'] else 'differs'})"
        lines.append(f"| {r['target']} | {r['mode']} | {r['tok_s']} | {r.get('tau', '')} | {r.get('forward_ms', '')} | "
                     f"{r.get('byte_time_ms', '')} | {r.get('round_other_ms', '')} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="the verifier's and the drafter's device (cpu: a smoke run)")
    ap.add_argument("--targets", nargs="+", default=["demo", "qwen3-8l", "gptoss-24l"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' rows")
    ap.add_argument("--copy-rate", type=float, default=COPY_RATE, help="bytes/s for the byte-time column")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work-dir", default="/tmp/pdflash-e2e-stack", help="where the real-shape checkpoints are written")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep the checkpoints this run wrote (gpt-oss shapes at 24 layers: ~38 GB) for the next run")
    args = ap.parse_args(argv)
    # `timeout` (benchmarks/gpu.sh) sends SIGTERM: unwind, so that the stack's services are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cuda = args.device.startswith("cuda")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_gpu_stack_{device_tag('cuda')}" if cuda else "e2e_stack_cpu"
    result = {"meta": {}, "services": {}, "rows": [], "not_identical": []}
    rows, failed = result["rows"], result["not_identical"]
    t_start = time.perf_counter()

    def save() -> None:  # after every step: a run cut short by a time limit still leaves what it measured
        result["meta"] = {
            "date": time.strftime("%Y-%m-%d"), "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU",
            "torch": torch.__version__, "copy_rate": args.copy_rate, "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "seconds": round(time.perf_counter() - t_start),
            "command": "python benchmarks/e2e_stack_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(markdown(result))

    for name in args.targets:
        t0 = time.perf_counter()
        target = prepare(name, args.device, work)
        try:
            prompts = prompts_for(target, args.prompts, args.prompt_tokens)
            results, result["services"][name] = run_stack(target, args.device, prompts, args.new_tokens, args.blocks,
                                                          out / "stack_logs" / name)
            reference = [r["tokens"] for r in results["stack none@1"]]
            dense = dense_bytes(target.model, 2 if cuda else 4)
            for mode, per in results.items():
                rows.append(stack_row(name, mode, per, reference, dense, args.copy_rate))
                print(rows[-1], flush=True)
                if not rows[-1]["identical"]:
                    failed.append(f"{name} {mode}")
            save()
            if not args.no_hf:
                rows += hf_rows(target, args.device, prompts, args.new_tokens, reference)
        finally:
            if target.made and not args.keep_checkpoints:
                shutil.rmtree(target.model, ignore_errors=True)
        print(f"[{name}] done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        save()
    print(markdown(result))
    if failed:
        print(f"IDENTITY CHECK FAILED: not equal to the stack's block-1 tokens: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
