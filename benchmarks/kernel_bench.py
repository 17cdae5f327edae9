"""pdflash_kernels/ on the GPU: the grouped MoE kernel (MXFP4 and bf16) against transformers' default experts
implementation (`grouped_mm`, bf16), and the batch-invariant dense matmul against cuBLAS.

    python benchmarks/kernel_bench.py [--out DIR] [--sweep [--skip-main] [--sweep-variants a,b] [--sweep-models m] [--sweep-jobs N]]
                                 [--align-only] [--align-baseline OLD_MOE_PY]

Prints tables and writes kernels_<device>.json / .md (kernels_h200.* on the H200, kernels_h100.* on an H100: `device_tag`) to --out (default benchmarks/results). `us` is GPU time: the
whole call (routing, both GEMMs, the combine) captured in a CUDA graph and replayed back to back, as the
verifier's graphed forwards run it; `eager_us` is the same call issued from Python (launch overhead included). `hbm_fraction` = weight
bytes read / time / the measured device-copy rate (bytes read + written per second by a large device copy).
--sweep first times the MoE GEMM variants (pdflash_kernels.moe.SWEEP_VARIANTS for MXFP4, SWEEP_VARIANTS_BF16 for bf16) on
the decode shapes (gpt-oss A=8/32, Qwen3 A=8/32/128, Mixtral A=8 in MXFP4, Qwen3 A=8 in bf16; 1, 4, 16 tokens per
active expert): one line per (case, variant) with the whole call and each GEMM alone, then a summary that ends in
a block to paste into pdflash_kernels/moe.py (FP4_DEFAULT, BF16_DEFAULT, SHAPE_OVERRIDES). Written to --out as
kernels_sweep_h200.txt and .json.
The routing step (`align_fused`) is timed alone too, 1..1024 tokens per model (--align-only: that table alone, into
kernels_align_h200.json; --align-baseline FILE: against another version of pdflash_kernels/moe.py, with a check that both give
the same blocks).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {  # experts, top-k, hidden, expert width
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
# Up-only experts (no gate, relu^2: pdflash_kernels.moe.ACT_RELU2), timed with --up-only (not part of issue 12's table):
# Nemotron 3 Nano 30B-A3B's routed experts
UP_ONLY_MODELS = {"nemotron-3-nano": (128, 6, 2688, 1856)}


def gpu_time_us(fn, reps: int = 50) -> float:
    """GPU time of one call: the call captured in a CUDA graph, replayed back to back (host overhead excluded,
    as in the verifier's graphed forwards). Falls back to eager timing when the call cannot be captured."""
    return gpu_time_us_each([fn], reps)


def gpu_time_us_each(fns, reps: int = 20) -> float:
    """GPU time of one call inside a longer graph, as a verify forward runs it: the calls `fns` (the same call on
    different copies of its weights, together several times L2) captured back to back in one CUDA graph, replayed; the
    time over len(fns); eager timing where they cannot be captured. With more than one call, unlike `gpu_time_us`,
    no graph launch is paid per call and a call's weights are not L2-hot from its previous replay (a forward reads
    every other layer's weights between two calls of one layer)."""
    try:
        for fn in fns:
            fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                fn()
    except Exception as e:  # noqa: BLE001
        print("  (not capturable:", type(e).__name__, str(e)[:80], "- eager time)")
        return sum(cuda_time_us(fn) for fn in fns) / len(fns)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / len(fns)


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


def device_tag(device: torch.device | str | None = None) -> str:
    """The device part of a result file's name: h200 / h100 / a100 / b200 by the CUDA device's name (the GPU machines lend
    H100s as well as H200s: a table must not claim the other card), another GPU's name in lower case, or cpu."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return tag_of(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else dev.type


def tag_of(name: str) -> str:
    """`device_tag` of a device's name as a result's meta records it ("NVIDIA H200" -> h200, "cpu" -> cpu)."""
    name = name.lower()
    known = next((k for k in ("h200", "h100", "a100", "b200") if k in name), None)
    return known or re.sub(r"[^a-z0-9]+", "_", name).strip("_")


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


def verify_routing(e: int, k: int, h: int, n_tok: int, g: torch.Generator, device: str = "cuda"):
    """A verify's call: `n_tok` tokens, each routed to k distinct experts drawn uniformly (as an untrained router spreads
    them), with `g`'s draws on `device`."""
    ids = torch.stack([torch.randperm(e, generator=g, device=device)[:k] for _ in range(n_tok)])
    x = torch.randn(n_tok, h, generator=g, device=device).bfloat16()
    w = torch.softmax(torch.randn(n_tok, k, generator=g, device=device), -1).bfloat16()
    return x, ids, w


def hf_experts(model: str):
    """A transformers experts module with the model's expert shapes, on transformers' default implementation."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, k, h, i = {**MODELS, **UP_ONLY_MODELS}[model]
    if model in UP_ONLY_MODELS:
        from transformers import AutoConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = AutoConfig.for_model("nemotron_h", hidden_size=h, moe_intermediate_size=i, n_routed_experts=e,
                                   num_experts_per_tok=k)
        cls = NemotronHExperts
    elif model == "gpt-oss-20b":
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


def as_served(w, pair_words: bool | None = None):
    """MXFP4 experts moved into one device arena of pdflash_kernels.mxfp4.ExpertLayout slices, the form the verifier serves
    (and the kernels read): scale rows padded to 4 bytes, so MoeConfig.s_words streams them on every model."""
    import dataclasses

    from pdflash_kernels.mxfp4 import MXFP4Experts

    if not w.fp4:
        return w
    from pdflash_kernels.moe import expert_format_for, pair_words_for

    q = MXFP4Experts(w.w1, w.s1, w.w2, w.s2, w.b1, w.b2)
    layout = q.layout()
    arena = q.to_arena(device=w.w1.device)
    if pair_words is None and expert_format_for(w.w1.device, layout) == "fragments":
        # the verifier's default on a GPU with Gluon (verifier_svc.expert_store's fragments format): the same arena's
        # weight and scale sections rewritten as fragment words, read by pdflash_kernels.fragments.fragment_moe
        from pdflash_kernels import fragments as F

        nib = {k: v for k, v in layout.views(arena).items() if not k.startswith("b")}
        for name, b in F.to_fragment_parts(nib, w.row_mul, w.up_offset).items():
            F.section_bytes(arena, layout, name).copy_(b)
        return F.fragment_experts_over(arena, layout, w.row_mul, w.up_offset, w.act, w.alpha, w.limit)
    views = layout.views(arena)
    served = dataclasses.replace(w, w1=views["w1_blocks"], s1=views["w1_scales"], w2=views["w2_blocks"], s2=views["w2_scales"],
                                 b1=views.get("b1"), b2=views.get("b2"))
    return as_pair_words(served) if (pair_words_for(w.w1.device) if pair_words is None else pair_words) else served


def _pair_words_served() -> bool:
    from pdflash_kernels.moe import pair_words_for

    return pair_words_for("cuda")


def _served_format_note() -> str:
    from pdflash_kernels.moe import expert_format_for

    fmt = expert_format_for("cuda")
    if fmt == "fragments":
        return ("as fragment words (pdflash_kernels/fragments.py, the Gluon kernel; PDFLASH_FP4_FRAGMENTS=0: pair words) "
                "where the shape fits")
    return ("as pair words (decode 5; PDFLASH_FP4_PAIR_WORDS=0: the nibble order)" if _pair_words_served()
            else "in nibble order (PDFLASH_FP4_PAIR_WORDS=0)")


def as_pair_words(w):
    """The same served experts with their blocks rewritten as pair words in place (pdflash_kernels/mxfp4.py to_pair_words)."""
    import dataclasses

    from pdflash_kernels.mxfp4 import to_pair_words

    if w.pair_words:
        return w
    w.w1.copy_(to_pair_words(w.w1))
    w.w2.copy_(to_pair_words(w.w2))
    return dataclasses.replace(w, pair_words=True)



@functools.lru_cache(maxsize=None)
def copy_same_bytes_us(nbytes: int) -> float:
    """GPU time (as `gpu_time_us` times the kernels: a CUDA graph replayed back to back) of a device copy that moves
    `nbytes` in all (nbytes / 2 read, nbytes / 2 written): what the copy the goal's rate comes from achieves at the
    size of one MoE call's weights. At tens of MB a copy too pays the launch, the ramp and the tail (stop 41: a clone
    of gpt-oss-20b's 8-expert gate/up bytes ran at 0.59 of the large copy's rate), so `copy_fraction` is the ceiling a
    weight-streaming kernel of that size meets in practice. Like the kernels' rows (`gpu_time_us`: one call replayed
    back to back), a copy whose bytes fit the L2 cache (~50 MB on an H100 / H200) reads them partly from it on replays,
    as the kernel then reads its weights: the two columns are comparable, and below that size neither is HBM alone."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return gpu_time_us(lambda: dst.copy_(src))


def bench_moe(rate: float, models: dict | None = None) -> list[dict]:
    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.moe import moe_forward

    rows = []
    for model, (e, k, h, i) in (models or MODELS).items():
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
        w_fp4 = as_served(expert_weights(mod, "mxfp4"))
        r1 = 2 * i if w_bf16.gated else i  # w1's rows (up-only experts: the I up rows alone)
        bias = (r1 + h) * 2 if w_bf16.b1 is not None else 0
        per = {"mxfp4": r1 * h // 2 + r1 * h // 32 + h * i // 2 + h * i // 32 + bias, "bf16": (r1 + i) * h * 2 + bias}
        for active, tpe, x, ids, wts, t_hf in cases:
            for name, w in (("mxfp4", w_fp4), ("bf16", w_bf16)):
                with torch.inference_mode():
                    us = gpu_time_us(lambda: moe_forward(x, ids, wts, w, e))
                    eager = cuda_time_us(lambda: moe_forward(x, ids, wts, w, e), reps=10)
                nbytes = active * per[name]
                t_copy = copy_same_bytes_us(nbytes)
                rows.append(dict(model=model, weights=name, tokens_per_expert=tpe, active_experts=active, us=round(us, 1), eager_us=round(eager, 1),
                                 torch_bf16_us=round(t_hf, 1), speedup=round(t_hf / us, 2), weight_bytes=nbytes,
                                 gbps=round(nbytes / us / 1e3, 1), hbm_fraction=round(nbytes / (us * 1e-6) / rate, 3),
                                 copy_us=round(t_copy, 1), copy_fraction=round(nbytes / (t_copy * 1e-6) / rate, 3),
                                 of_same_size_copy=round(t_copy / us, 3)))
                r = rows[-1]
                print(f"{model:14s} {name:5s} A={active:3d} T={tpe:2d}  {us:8.1f} us  hf {t_hf:8.1f} us  x{t_hf / us:5.2f}  {r['gbps']:7.1f} GB/s  {r['hbm_fraction']:.2f}", flush=True)
        del mod, w_bf16, w_fp4, cases
        torch.cuda.empty_cache()
    return rows


def bench_linear() -> list[dict]:
    from pdflash_kernels.linear import matmul

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


ALIGN_TOKENS = (1, 4, 16, 64, 256, 1024)
ALIGN_CHUNKS = (64, 256, 1024)
ALIGN_PROGRAM_CHUNKS = (128, 256, 512)  # moe.align_fused(programs=True): the pairs a program ranks


def bench_align(baseline: str | None = None) -> list[dict]:
    """The MoE call's routing step alone (`align_fused`: the pairs grouped by expert into the GEMMs' row blocks, one
    program), per model's experts and top-k, 1..1024 tokens of random routing. `baseline`: a path to another version of
    pdflash_kernels/moe.py (e.g. `git show REV:pdflash_kernels/moe.py > /tmp/moe_old.py`), timed on the same ids."""
    import importlib.util

    from pdflash_kernels.moe import align_fused

    old = None
    if baseline:
        spec = importlib.util.spec_from_file_location("moe_baseline", baseline)
        old = importlib.util.module_from_spec(spec)
        sys.modules["moe_baseline"] = old  # (its dataclasses look their module up there)
        spec.loader.exec_module(old)
    rows = []
    for model, (e, k, _, _) in MODELS.items():
        for t in ALIGN_TOKENS:
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
            slots = torch.randperm(e, device="cuda").int()
            new = align_fused(ids, e, 16, slots, programs=False)
            row = dict(model=model, tokens=t, pairs=t * k, us=round(gpu_time_us(lambda: align_fused(ids, e, 16, slots)), 2))
            for ch in ALIGN_CHUNKS:  # the pairs one step sorts, against the default rule's
                row[f"chunk{ch}_us"] = round(gpu_time_us(lambda: align_fused(ids, e, 16, slots, chunk=ch, programs=False)), 2)
            for ch in ALIGN_PROGRAM_CHUNKS:  # a program a chunk (moe.ALIGN_PROGRAMS): the same routing, checked
                many = align_fused(ids, e, 16, slots, chunk=ch, programs=True)
                row[f"prog{ch}_same"] = bool(torch.equal(many.sorted_pairs, new.sorted_pairs)
                                            and torch.equal(many.block_slot, new.block_slot)
                                            and torch.equal(many.num_blocks, new.num_blocks))
                row[f"prog{ch}_us"] = round(gpu_time_us(lambda: align_fused(ids, e, 16, slots, chunk=ch, programs=True)), 2)
            if old is not None:
                ref = old.align_fused(ids, e, 16, slots)
                row["baseline_us"] = round(gpu_time_us(lambda: old.align_fused(ids, e, 16, slots)), 2)
                row["same_blocks"] = bool(torch.equal(ref.sorted_pairs, new.sorted_pairs) and torch.equal(ref.block_slot, new.block_slot))
            rows.append(row)
            print(f"align {model:14s} {t:5d} tokens {t * k:6d} pairs {row['us']:8.2f} us (chunk "
                  + ", ".join(f"{ch}: {row[f'chunk{ch}_us']}" for ch in ALIGN_CHUNKS) + "; a program a chunk of "
                  + ", ".join(f"{ch}: {row[f'prog{ch}_us']}{'' if row[f'prog{ch}_same'] else ' NOT THE SAME'}"
                              for ch in ALIGN_PROGRAM_CHUNKS) + ")"
                  + (f"  (baseline {row['baseline_us']:8.2f} us, same blocks {row['same_blocks']})" if old is not None else ""), flush=True)
    return rows


def invariance_check() -> dict:
    """Row 0 alone vs inside calls of 2..256 rows, for the MoE kernel (bf16, MXFP4 in nibble order, and MXFP4 as the
    verifier serves it: `as_served`) and the matmul."""
    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.linear import matmul
    from pdflash_kernels.moe import moe_forward

    checked, ok = 0, True
    mod = hf_experts("qwen3-30b-a3b")
    for fmt in ("native", "mxfp4", "served"):
        w = as_served(expert_weights(mod, "mxfp4")) if fmt == "served" else expert_weights(mod, fmt)
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


SWEEP_CASES = (  # (model, weights, active experts): each at 1, 4 and 16 tokens per active expert (A = top-k at 1 token:
    # the block-1 decode itself, the fewest programs; split_k is for it)
    ("gpt-oss-20b", "mxfp4", (4, 8, 32)),
    ("qwen3-30b-a3b", "mxfp4", (8, 32, 128)),
    ("mixtral-8x7b", "mxfp4", (2, 8)),
    ("qwen3-30b-a3b", "bf16", (8,)),
)
SWEEP_TOKENS = (1, 4, 16)


def _sweep_configs(model: str, fmt: str, names: list[str] | None) -> list[tuple[str, object, object]]:
    """(variant name, gemm1 config, gemm2 config) of every named variant for one model, the current default first."""
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, default_config, variant_config

    e, k, h, i = MODELS[model]
    fp4 = fmt == "mxfp4"
    out = [("default", default_config(i, h, k, fp4, gemm=1), default_config(h, i, k, fp4, gemm=2))]
    for name, fields in (SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16).items():
        if names is None or name in names:
            out.append((name, variant_config(i, h, k, fp4, fields), variant_config(h, i, k, fp4, fields)))
    return out


def _compile_all(jobs: list, workers: int) -> None:
    """Compile every (weights, configs) of `jobs` without running them, `workers` compiles at a time (Triton's
    AsyncCompileMode); failures are left for the timed call to report."""
    from pdflash_kernels.moe import moe_forward

    def warm():
        for x, ids, wts, w, e, c1, c2 in jobs:
            try:
                moe_forward(x, ids, wts, w, e, config=c1, config2=c2, warmup=True)
            except Exception:  # noqa: BLE001 - reported when timed
                pass

    if workers > 1:
        try:
            from concurrent.futures import ThreadPoolExecutor

            from triton import AsyncCompileMode

            with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
                warm()
            return
        except ImportError:
            pass
    warm()


def sweep(rate: float, names: list[str] | None = None, models: list[str] | None = None, workers: int = 8, log=print) -> list[dict]:
    """Time the named GEMM variants (pdflash_kernels.moe.SWEEP_VARIANTS / SWEEP_VARIANTS_BF16) on the decode shapes: the whole
    call and each GEMM alone (CUDA graphs), against transformers' grouped_mm. One line per (case, variant)."""
    import time

    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.moe import align_fused, launch_gemm1, launch_gemm2, moe_forward

    rows, t0 = [], time.time()
    for model in dict.fromkeys(m for m, _, _ in SWEEP_CASES):
        if models is not None and model not in models:
            continue
        e, k, h, i = MODELS[model]
        mod = hf_experts(model)
        cases = [(fmt, active, tpe) for m, fmt, acts in SWEEP_CASES if m == model for active in acts for tpe in SWEEP_TOKENS]
        with torch.inference_mode():
            inputs = {(a, t): routing(e, k, h, a, t) for _, a, t in cases}
            hf_us = {key: gpu_time_us(lambda: mod(*val), reps=20) for key, val in inputs.items()}
        # each variant on the stored format its decode reads: nibble order, or pair words for decodes 5/6
        weights = {fmt: as_served(expert_weights(mod, "native" if fmt == "bf16" else fmt), pair_words=False)
                   for fmt in dict.fromkeys(f for f, _, _ in cases)}
        if "mxfp4" in weights:
            import dataclasses as _dc

            nib = weights["mxfp4"]
            pair_w = as_pair_words(_dc.replace(nib, w1=nib.w1.clone(), w2=nib.w2.clone()))
        from pdflash_kernels.moe import PAIR_DECODES

        def stored(fmt, c):
            return pair_w if fmt == "mxfp4" and c.decode in PAIR_DECODES else weights[fmt]
        bias = (2 * i + h) * 2 if weights[cases[0][0]].b1 is not None else 0
        per = {"mxfp4": 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32 + bias, "bf16": 3 * h * i * 2 + bias}
        configs = {fmt: _sweep_configs(model, fmt, names) for fmt in weights}
        x1, ids1, w1 = inputs[(cases[0][1], 1)]
        jobs = [(x1, ids1, w1, stored(fmt, c1), e, c1, c2) for fmt, cl in configs.items() for _, c1, c2 in cl]
        _compile_all(jobs, workers)
        log(f"# {model}: {len(jobs)} configs compiled, {time.time() - t0:.0f} s since the sweep began", flush=True)
        for fmt, active, tpe in cases:
            x, ids, wts = inputs[(active, tpe)]
            nbytes = active * per[fmt]
            seen: dict = {}
            for name, c1, c2 in configs[fmt]:
                w = stored(fmt, c1)
                if (c1, c2) in seen:  # the same kernels as an earlier name (e.g. block_k 128 where it is the base)
                    same = seen[(c1, c2)]
                    log(f"sweep {model:14s} {fmt:5s} A={active:3d} T={tpe:2d} {name:22s} = {same['variant']}", flush=True)
                    rows.append({**same, "variant": name, "same_as": same["variant"]})
                    continue
                try:
                    with torch.inference_mode():
                        us = gpu_time_us(lambda: moe_forward(x, ids, wts, w, e, config=c1, config2=c2), reps=20)
                        r = align_fused(ids, e, c1.block_m)
                        hbuf = torch.zeros((r.max_blocks * c1.block_m, i), dtype=torch.bfloat16, device=x.device)
                        ybuf = torch.empty((r.num_pairs, h), dtype=torch.float32, device=x.device)
                        rw = wts.reshape(-1).contiguous()
                        g1 = gpu_time_us(lambda: launch_gemm1(x, r, w, hbuf, c1, k), reps=20)
                        g2 = gpu_time_us(lambda: launch_gemm2(hbuf, r, w, ybuf, rw, c2), reps=20)
                except Exception as ex:  # noqa: BLE001 - a config that does not compile or run is reported and skipped
                    log(f"sweep {model:14s} {fmt:5s} A={active:3d} T={tpe:2d} {name:22s} FAILED {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                t_hf = hf_us[(active, tpe)]
                row = dict(model=model, weights=fmt, active=active, tpe=tpe, variant=name, config1=c1.__dict__, config2=c2.__dict__,
                           us=round(us, 1), gemm1_us=round(g1, 1), gemm2_us=round(g2, 1), torch_bf16_us=round(t_hf, 1),
                           speedup=round(t_hf / us, 2), weight_bytes=nbytes, hbm_fraction=round(nbytes / (us * 1e-6) / rate, 3))
                rows.append(row)
                seen[(c1, c2)] = row
                log(f"sweep {model:14s} {fmt:5s} A={active:3d} T={tpe:2d} {name:22s} {us:8.1f} us (gemm1 {g1:7.1f}, gemm2 {g2:7.1f})"
                    f"  x{t_hf / us:5.2f} vs grouped_mm  {row['hbm_fraction']:5.0%} of copy  | {_short(c1)} / {_short(c2)}", flush=True)
        del mod, weights, inputs
        torch.cuda.empty_cache()
    log(f"# sweep done in {time.time() - t0:.0f} s", flush=True)
    return rows


def _short(c) -> str:
    s = f"n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages} d{c.decode} a{c.a_load}"
    return s + ("" if not c.swap_ab else " swap") + ("" if not c.raster else " raster") + ("" if not c.persist else f" persist{c.persist}")


def _stored(r: dict) -> str:
    """A sweep row's stored weight format: bf16, mxfp4 (nibble order) or "mxfp4 pair" (pair words: decodes 5/6)."""
    from pdflash_kernels.moe import PAIR_DECODES

    return "mxfp4 pair" if r["weights"] == "mxfp4" and r["config1"].get("decode") in PAIR_DECODES else r["weights"]


def sweep_summary(rows: list[dict]) -> list[str]:
    """The winners, as a block to paste into pdflash_kernels/moe.py. Per stored format (bf16, MXFP4 in nibble order, MXFP4 as pair
    words) the variant with the least whole-call time over every case is the format's default; per model the variant with
    the least whole-call time over that model's cases overrides both its GEMMs where it differs (block_k written out: an
    override merges over the format's default). The per-GEMM sums (each GEMM timed alone) are listed too, but they can
    disagree with the whole call (stop 31: Mixtral's down GEMM alone favoured a tile whose whole call took 2x), so they
    only inform."""
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16

    out = ["", "# ---- sweep summary (sums over every case timed) ----"]
    best_fmt: dict = {}
    fmts = list(dict.fromkeys(_stored(r) for r in rows if r["variant"] != "default"))
    for fmt in fmts:
        fr = [r for r in rows if _stored(r) == fmt or (r["variant"] == "default" and r["weights"] == fmt.split()[0])]
        cases = {(r["model"], r["active"], r["tpe"]) for r in fr}
        tot: dict = {}
        for r in fr:
            tot.setdefault(r["variant"], {})[(r["model"], r["active"], r["tpe"])] = r["us"]
        full = {v: sum(t.values()) for v, t in tot.items() if len(t) == len(cases)}  # timed on every case
        for v, t in sorted(full.items(), key=lambda kv: kv[1]):
            worst = min(r["speedup"] for r in fr if r["variant"] == v)
            frac = min(r["hbm_fraction"] for r in fr if r["variant"] == v)
            out.append(f"#   {fmt:10s} {v:24s} total {t:9.1f} us   worst speedup x{worst:5.2f}   worst copy fraction {frac:5.0%}")
        named = {v: t for v, t in full.items() if v != "default"}
        if named:
            best_fmt[fmt] = min(named, key=named.get)
    out.append("# per model, by the whole call (what the overrides below follow):")
    overrides: dict = {fmt: [] for fmt in best_fmt}
    for fmt, base in best_fmt.items():
        fr = [r for r in rows if _stored(r) == fmt and r["variant"] != "default"]
        for model in dict.fromkeys(r["model"] for r in fr):
            mr = [r for r in fr if r["model"] == model]
            ncase = len({(r["active"], r["tpe"]) for r in mr})
            tot: dict = {}
            for r in mr:
                tot.setdefault(r["variant"], []).append(r)
            full = {v: sum(r["us"] for r in rs) for v, rs in tot.items() if len(rs) == ncase}
            win = min(full, key=full.get)
            out.append(f"#   {model:14s} {fmt:10s} {win} {full[win]:.1f} us" + (f" ({base}: {full[base]:.1f} us)" if base in full else ""))
            if win == base:
                continue
            e, k, h, i = MODELS[model]
            table = "SWEEP_VARIANTS" if fmt != "bf16" else "SWEEP_VARIANTS_BF16"
            variants = SWEEP_VARIANTS if fmt != "bf16" else SWEEP_VARIANTS_BF16
            for g, (n_, k_) in ((1, (i, h)), (2, (h, i))):
                cfg = tot[win][0][f"config{g}"]
                # an override merges over the format's default: write out block_k and every field the default sets
                # that the winner does not (else e.g. the default's split_k would ride along, untimed)
                extra = {"block_k": cfg["block_k"]}
                extra.update({f: cfg[f] for f in variants.get(base, {}) if f not in variants.get(win, {}) and f in cfg})
                fields = ", ".join(f"{f}={v!r}" for f, v in extra.items())
                key = f"({g}, {n_}, {k_})" if fmt == "mxfp4 pair" else f"({g}, {n_}, {k_}, {fmt != 'bf16'})"
                overrides[fmt].append(f"    {key}: dict({table}[{win!r}], {fields}),  # {model}")
    shapes: dict = {}
    for r in rows:
        if r["variant"] == "default":
            continue
        for g in (1, 2):
            key = (r["model"], _stored(r), g)
            shapes.setdefault(key, {}).setdefault(r["variant"], [0.0, 0])
            shapes[key][r["variant"]][0] += r[f"gemm{g}_us"]
            shapes[key][r["variant"]][1] += 1
    out.append("# per GEMM shape, each GEMM timed alone (informative only; gemm1: n = I, k = H; gemm2: n = H, k = I):")
    for (model, fmt, g), vs in sorted(shapes.items()):
        ncase = max(v[1] for v in vs.values())
        full = {v: t for v, (t, n) in vs.items() if n == ncase}
        win = min(full, key=full.get)
        e, k, h, i = MODELS[model]
        n_, k_ = (i, h) if g == 1 else (h, i)
        base = best_fmt.get(fmt)
        out.append(f"#   {model:14s} {fmt:10s} gemm{g} (n={n_}, k={k_}): {win} {full[win]:.1f} us" + (f" (format default {base}: {full[base]:.1f} us)" if base in full else ""))
    out.append("# ---- paste into pdflash_kernels/moe.py (THE ONE PLACE TO SET THE SWEEP'S WINNERS) ----")
    names = {"mxfp4": ("FP4_DEFAULT", "SWEEP_VARIANTS", "SHAPE_OVERRIDES: dict[tuple[int, int, int, bool], dict] = {"),
             "bf16": ("BF16_DEFAULT", "SWEEP_VARIANTS_BF16", None),
             "mxfp4 pair": ("PAIR_DEFAULT", "SWEEP_VARIANTS", "PAIR_SHAPE_OVERRIDES: dict[tuple[int, int, int], dict] = {  # (gemm, n, k)")}
    for fmt in ("mxfp4", "bf16", "mxfp4 pair"):
        if fmt in best_fmt:
            out.append(f"{names[fmt][0]}: dict = dict({names[fmt][1]}[{best_fmt[fmt]!r}])")
    for fmt in ("mxfp4", "mxfp4 pair"):
        bf16 = overrides.get("bf16", []) if fmt == "mxfp4" else []  # bf16 overrides share SHAPE_OVERRIDES (fp4 False)
        if fmt in best_fmt or bf16:
            out.append(names[fmt][2])
            out += overrides.get(fmt, []) + bf16
            out.append("}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--sweep", action="store_true", help="time the MoE GEMM variants on the decode shapes first")
    ap.add_argument("--skip-main", action="store_true", help="only the sweep")
    ap.add_argument("--sweep-variants", default=None, help="comma-separated variant names (default: all of pdflash_kernels.moe.SWEEP_VARIANTS*)")
    ap.add_argument("--sweep-models", default=None, help="comma-separated models (default: " + ",".join(MODELS) + ")")
    ap.add_argument("--sweep-jobs", type=int, default=8, help="parallel compiles before the sweep times (1: one at a time)")
    ap.add_argument("--align-only", action="store_true", help="only the routing step's table (bench_align)")
    ap.add_argument("--align-baseline", default=None, help="another pdflash_kernels/moe.py to time the routing step against")
    ap.add_argument("--up-only", action="store_true", help="only the up-only experts' table (UP_ONLY_MODELS: Nemotron 3 "
                    "Nano), to kernels_up_only_<device>.json / .md")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rate = copy_rate()
    result["copy_rate_bytes_per_s"] = rate
    print(f"device copy: {rate / 1e12:.2f} TB/s (read + write)")
    if args.up_only:
        result["moe"] = bench_moe(rate, UP_ONLY_MODELS)
        up_out = out / f"kernels_up_only_{device_tag()}"
        up_out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        md = [f"# up-only (relu^2) experts on {result['device']} (`python benchmarks/kernel_bench.py --up-only`)", "",
              f"Device copy {rate / 1e12:.2f} TB/s (read + write). MXFP4 stored {_served_format_note()}; transformers' "
              "NemotronHExperts on grouped_mm in bf16 as the baseline.", "",
              "| model | weights | tokens/expert | active experts | us (graph) | transformers grouped_mm bf16 us (graph) | "
              "speedup | weight MB | GB/s | of copy rate |", "|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['weights']} | {r['tokens_per_expert']} | {r['active_experts']} | {r['us']} | "
               f"{r['torch_bf16_us']} | {r['speedup']}x | {r['weight_bytes'] / 1e6:.1f} | {r['gbps']} | {r['hbm_fraction']:.0%} |"
               for r in result["moe"]]
        up_out.with_suffix(".md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        return
    if args.sweep:
        lines = []

        def log(msg: str, flush: bool = True) -> None:
            print(msg, flush=flush)
            lines.append(msg)

        split = (lambda v: None if v is None else [x.strip() for x in v.split(",") if x.strip()])
        result["sweep"] = sweep(rate, split(args.sweep_variants), split(args.sweep_models), args.sweep_jobs, log)
        for line in sweep_summary(result["sweep"]):
            log(line)
        sweep_out = out / f"kernels_sweep_{device_tag()}"
        sweep_out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        sweep_out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(f"sweep written to {sweep_out}.txt and .json")
        if args.skip_main:
            return
    result["align"] = bench_align(args.align_baseline)
    if args.align_only:
        (out / f"kernels_align_{device_tag()}.json").write_text(json.dumps(result, indent=1))
        return
    result["invariance"] = invariance_check()
    print("invariance:", result["invariance"])
    result["linear"] = bench_linear()
    result["moe"] = bench_moe(rate)
    main_out = out / f"kernels_{device_tag()}"
    main_out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = [f"# kernels on {result['device']} (`python benchmarks/kernel_bench.py`)", "",
          f"Device copy {rate / 1e12:.2f} TB/s (read + write). Invariance: {result['invariance']}. MXFP4 experts stored "
          f"{_served_format_note()}.", "",
          "`copy us`: a device copy moving the call's weight bytes (half read, half written), timed the same way; `copy "
          "of rate`: its fraction of the large copy's rate (the ceiling at this size); `of copy`: copy us / us.", "",
          "| model | weights | tokens/expert | active experts | us (graph) | eager us | transformers grouped_mm bf16 us (graph) | speedup | weight MB | GB/s | of copy rate | copy us | copy of rate | of copy |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["moe"]:
        md.append(f"| {r['model']} | {r['weights']} | {r['tokens_per_expert']} | {r['active_experts']} | {r['us']} | {r['eager_us']} | {r['torch_bf16_us']} | {r['speedup']}x | {r['weight_bytes'] / 1e6:.1f} | {r['gbps']} | {r['hbm_fraction']:.0%} | {r['copy_us']} | {r['copy_fraction']:.0%} | {r['of_same_size_copy']:.0%} |")
    base = any("baseline_us" in r for r in result["align"])
    md += ["", "The routing step alone (`align_fused`, CUDA graph)" + (f", against `{args.align_baseline}`" if base else "") + ":", "",
           "| model | tokens | pairs | us |" + (" baseline us | same blocks |" if base else "")
           + "".join(f" a program a {ch} pairs us |" for ch in ALIGN_PROGRAM_CHUNKS),
           "|---|---|---|---|" + ("---|---|" if base else "") + "---|" * len(ALIGN_PROGRAM_CHUNKS)]
    md += [f"| {r['model']} | {r['tokens']} | {r['pairs']} | {r['us']} |" + (f" {r['baseline_us']} | {r['same_blocks']} |" if base else "")
           + "".join(f" {r.get(f'prog{ch}_us', '-')}{'' if r.get(f'prog{ch}_same', True) else ' (NOT THE SAME)'} |"
                     for ch in ALIGN_PROGRAM_CHUNKS)
           for r in result["align"]]
    md += ["", "| M | N | K | invariant us (graph) | cuBLAS us (graph) | ratio |", "|---|---|---|---|---|---|"]
    md += [f"| {r['M']} | {r['N']} | {r['K']} | {r['us']} | {r['cublas_us']} | {r['ratio']} |" for r in result["linear"]]
    main_out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
