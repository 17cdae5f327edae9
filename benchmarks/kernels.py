"""kernels/ on the GPU: the grouped MoE kernel (MXFP4 and bf16) against transformers' default experts
implementation (`grouped_mm`, bf16), and the batch-invariant dense matmul against cuBLAS.

    python benchmarks/kernels.py [--out DIR] [--sweep]

Prints tables and writes kernels_h200.json / .md to --out (default benchmarks/results). `us` is GPU time: the
whole call (routing, both GEMMs, the combine) captured in a CUDA graph and replayed back to back, as the
verifier's graphed forwards run it; `eager_us` is the same call issued from Python (launch overhead included). `hbm_fraction` = weight
bytes read / time / the measured device-copy rate (bytes read + written per second by a large device copy).
--sweep also times tile variants of the MXFP4 kernel on decode shapes (to choose default_config).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {  # experts, top-k, hidden, expert width
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def gpu_time_us(fn, reps: int = 50) -> float:
    """GPU time of one call: the call captured in a CUDA graph, replayed back to back (host overhead excluded,
    as in the verifier's graphed forwards). Falls back to eager timing when the call cannot be captured."""
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001
        print("  (not capturable:", type(e).__name__, str(e)[:80], "- eager time)")
        return cuda_time_us(fn)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def cuda_time_us(fn, reps: int = 30, warmup: int = 5) -> float:
    """Wall time of one call as the host issues it (launch overhead included): CUDA-event median."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_rate() -> float:
    """Bytes moved (read + write) per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / (us * 1e-6)


def routing(e: int, k: int, h: int, active: int, per_expert: int):
    """`active` experts, each routed exactly `per_expert` tokens (token i -> experts (i*k + j) mod active)."""
    n_tok = active * per_expert // k
    ids = torch.tensor([[(i * k + j) % active for j in range(k)] for i in range(n_tok)], device="cuda")
    perm = torch.randperm(e, device="cuda")[:active]  # which experts are the active ones
    ids = perm[ids]
    x = torch.randn(n_tok, h, device="cuda").bfloat16()
    w = torch.softmax(torch.randn(n_tok, k, device="cuda"), -1).bfloat16()
    return x, ids, w


def hf_experts(model: str):
    """A transformers experts module with the model's expert shapes, on transformers' default implementation."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, k, h, i = MODELS[model]
    if model == "gpt-oss-20b":
        cfg, cls = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k), GptOssExperts
    elif model == "qwen3-30b-a3b":
        cfg, cls = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k), Qwen3MoeExperts
    else:
        cfg, cls = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k), MixtralExperts
    cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        mod = cls(cfg).to(torch.bfloat16)
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mod.requires_grad_(False)
    return mod


def bench_moe(rate: float) -> list[dict]:
    from kernels.installer import expert_weights
    from kernels.moe import moe_forward

    rows = []
    for model, (e, k, h, i) in MODELS.items():
        mod = hf_experts(model)
        cases = []
        with torch.inference_mode():  # transformers first: expert_weights re-lays gpt-oss's transposed weights
            for active in (8, 32, 128):
                if active > e or active < k:
                    continue
                for tpe in (1, 4, 16, 64):
                    x, ids, wts = routing(e, k, h, active, tpe)
                    cases.append((active, tpe, x, ids, wts, gpu_time_us(lambda: mod(x, ids, wts))))
        w_bf16 = expert_weights(mod, "native")
        w_fp4 = expert_weights(mod, "mxfp4")
        bias = (2 * i + h) * 2 if w_bf16.b1 is not None else 0
        per = {"mxfp4": 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32 + bias, "bf16": 3 * h * i * 2 + bias}
        for active, tpe, x, ids, wts, t_hf in cases:
            for name, w in (("mxfp4", w_fp4), ("bf16", w_bf16)):
                with torch.inference_mode():
                    us = gpu_time_us(lambda: moe_forward(x, ids, wts, w, e))
                    eager = cuda_time_us(lambda: moe_forward(x, ids, wts, w, e), reps=10)
                nbytes = active * per[name]
                rows.append(dict(model=model, weights=name, tokens_per_expert=tpe, active_experts=active, us=round(us, 1), eager_us=round(eager, 1),
                                 torch_bf16_us=round(t_hf, 1), speedup=round(t_hf / us, 2), weight_bytes=nbytes,
                                 gbps=round(nbytes / us / 1e3, 1), hbm_fraction=round(nbytes / (us * 1e-6) / rate, 3)))
                r = rows[-1]
                print(f"{model:14s} {name:5s} A={active:3d} T={tpe:2d}  {us:8.1f} us  hf {t_hf:8.1f} us  x{t_hf / us:5.2f}  {r['gbps']:7.1f} GB/s  {r['hbm_fraction']:.2f}", flush=True)
        del mod, w_bf16, w_fp4, cases
        torch.cuda.empty_cache()
    return rows


def bench_linear() -> list[dict]:
    from kernels.linear import matmul

    rows = []
    shapes = sorted({(4096, 2048), (512, 2048), (2048, 4096), (128, 2048), (4096, 2880), (512, 2880), (2880, 4096), (32, 2880), (4096, 4096), (1024, 4096), (8, 4096)})
    for n, k in shapes:
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        for m in (1, 4, 16, 64):
            a = torch.randn(m, k, device="cuda").bfloat16()
            us = gpu_time_us(lambda: matmul(a, w.t()))
            cub = gpu_time_us(lambda: torch.matmul(a, w.t()))
            rows.append(dict(M=m, N=n, K=k, us=round(us, 2), cublas_us=round(cub, 2), ratio=round(us / cub, 3)))
            print(f"linear M={m:3d} N={n:5d} K={k:5d}  {us:7.2f} us  cublas {cub:7.2f} us  ratio {us / cub:5.2f}", flush=True)
    return rows


def invariance_check() -> dict:
    """Row 0 alone vs inside calls of 2..256 rows, for the MoE kernel (both formats) and the matmul."""
    from kernels.installer import expert_weights
    from kernels.linear import matmul
    from kernels.moe import moe_forward

    checked, ok = 0, True
    mod = hf_experts("qwen3-30b-a3b")
    for fmt in ("native", "mxfp4"):
        w = expert_weights(mod, fmt)
        x, ids, wts = routing(128, 8, 2048, 128, 16)  # 256 tokens
        alone = moe_forward(x[:1], ids[:1], wts[:1], w, 128)
        for t in (2, 5, 16, 64, 256):
            ok &= torch.equal(moe_forward(x[:t], ids[:t], wts[:t], w, 128)[0], alone[0])
            checked += 1
    wl = (torch.randn(4096, 2048, device="cuda") * 0.02).bfloat16()
    a = torch.randn(256, 2048, device="cuda").bfloat16()
    alone = matmul(a[:1], wl.t())
    for t in range(2, 257):
        ok &= torch.equal(matmul(a[:t], wl.t())[0], alone[0])
        checked += 1
    return {"bit_identical": bool(ok), "rows_checked": checked}


def sweep() -> list[dict]:
    from kernels.installer import expert_weights
    from kernels.moe import MoeConfig, moe_forward

    rows = []
    for model, active, tpe in (("qwen3-30b-a3b", 8, 1), ("gpt-oss-20b", 4, 1), ("qwen3-30b-a3b", 128, 16)):
        e, k, h, i = MODELS[model]
        mod = hf_experts(model)
        w = expert_weights(mod, "mxfp4")
        x, ids, wts = routing(e, k, h, active, tpe)
        for decode in (0, 1, 2):
            for bn in (32, 64, 128):
                for bm in (16, 64):
                    for stages in (3, 4):
                        for warps in (4,):
                            c = MoeConfig(bm, bn, 128, warps, stages, decode)
                            try:
                                us = gpu_time_us(lambda: moe_forward(x, ids, wts, w, e, config=c, config2=c), reps=20)
                            except Exception as ex:  # noqa: BLE001 - a config that does not compile is skipped
                                print("skip", c, type(ex).__name__)
                                continue
                            rows.append(dict(model=model, active=active, tpe=tpe, **c.__dict__, us=round(us, 1)))
                            print(f"sweep {model} A={active} T={tpe} {c} {us:.1f} us", flush=True)
        del mod, w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-main", action="store_true", help="only the sweep")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.sweep:
        result["sweep"] = sweep()
        (out / "kernels_sweep_h200.json").write_text(json.dumps(result, indent=1))
        if args.skip_main:
            return
    rate = copy_rate()
    result["copy_rate_bytes_per_s"] = rate
    print(f"device copy: {rate / 1e12:.2f} TB/s (read + write)")
    result["invariance"] = invariance_check()
    print("invariance:", result["invariance"])
    result["linear"] = bench_linear()
    result["moe"] = bench_moe(rate)
    (out / "kernels_h200.json").write_text(json.dumps(result, indent=1))
    md = [f"# kernels on {result['device']} (`python benchmarks/kernels.py`)", "",
          f"Device copy {rate / 1e12:.2f} TB/s (read + write). Invariance: {result['invariance']}.", "",
          "| model | weights | tokens/expert | active experts | us (graph) | eager us | transformers grouped_mm bf16 us (graph) | speedup | weight MB | GB/s | of copy rate |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["moe"]:
        md.append(f"| {r['model']} | {r['weights']} | {r['tokens_per_expert']} | {r['active_experts']} | {r['us']} | {r['eager_us']} | {r['torch_bf16_us']} | {r['speedup']}x | {r['weight_bytes'] / 1e6:.1f} | {r['gbps']} | {r['hbm_fraction']:.0%} |")
    md += ["", "| M | N | K | invariant us (graph) | cuBLAS us (graph) | ratio |", "|---|---|---|---|---|---|"]
    md += [f"| {r['M']} | {r['N']} | {r['K']} | {r['us']} | {r['cublas_us']} | {r['ratio']} |" for r in result["linear"]]
    (out / "kernels_h200.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
