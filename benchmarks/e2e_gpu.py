"""The verify loop on the GPU, in process (VerifierCore + the stack's drafters, no RPC): the ceiling the stack can reach
on one GPU, next to transformers' own greedy and prompt-lookup decoding in the same process on the same GPU.

    python benchmarks/e2e_gpu.py [--targets demo qwen3-8l gptoss-24l] [--prompts N] [--new-tokens N] [--repeat N]
                                 [--prompt-tokens 128] [--blocks 8 16 32] [--layers N] [--kernels auto|on|off]
                                 [--no-hf] [--mxfp4-experts] [--out DIR]
    python benchmarks/e2e_gpu.py --device cpu --tiny --targets demo qwen3-2l gptoss-2l --prompts 2 --new-tokens 16
                                                                                   # the CPU smoke run (tests/test_bench_gptoss.py)

Targets:
- `demo`: the embedded pair (trained qwen3_moe target + its DFlash drafter, 25 MB), the held-out prompts.
- `qwen3-<N>l`: Qwen3-30B-A3B layer shapes, N layers (hidden 2048, 128 experts top-8, expert width 768, 32/4 heads of
  128), random bf16 weights built on the GPU, experts bf16 (native).
- `gptoss-<N>l`: gpt-oss-20b layer shapes, N layers (hidden 2880, 32 experts top-4, intermediate 2880, 64/8 heads of
  64, sliding-window (128) and full attention alternating, attention sinks, biased experts), random bf16 weights built
  on the GPU, then the experts quantized to MXFP4 on the GPU and served resident: every expert in device memory as
  MXFP4 in one arena, read by the grouped MXFP4 kernel (`verifier_svc.model.serve_mxfp4`, the path `--experts mxfp4`
  without an expert cache serves). transformers' rows run the same model: the MXFP4 experts dequantized to bf16 (biases
  as the kernels hold them, bf16) in the modules' own layout (`verifier_svc.model.quantize_experts`).
- `dsv3-<N>l`: DeepSeek-V3 / Kimi K2 layer shapes, N layers (hidden 7168, multi-head latent attention: 128 heads, q
  rank 1536, latent 512 + rotary 64; a dense first layer of 18432, then 32 of the 256 routed experts (width 2048) top-8
  in 8 groups (4 chosen) and a shared expert), random bf16 weights built on the GPU, experts bf16 (native); the paged KV
  holds one latent a position and attention runs in the absorbed form (pdflash_kernels.mla).
- `qnext-<N>l`: Qwen3-Next-80B-A3B layer shapes, N >= 4 layers (hidden 2048; three Gated DeltaNet layers of 16 key / 32
  value heads of 128 for each full-attention layer of 16 heads of 256 on 2 KV heads; 64 of the 512 experts (width 512)
  top-10 and a shared expert), random bf16; the linear-attention layers on pdflash_kernels.gdn, on the paged forward (a
  recurrent-state slot per session).
- `nano-<N>l`: Nemotron 3 Nano 30B-A3B block shapes, N >= 4 blocks (hidden 2688; Mamba-2 of 64 heads of 64, 8 groups,
  state 128; MoE blocks of 128 up-only relu^2 experts of width 1856, top 6, and a shared expert; attention of 32 heads on
  2 KV heads without positions, the 4th block), random bf16 (`--mxfp4-experts`: MXFP4 as the GPU serves them, fragment words since stop 64;
  `PDFLASH_FP4_FRAGMENTS=0`: pair words).
- `jamba-<N>l`: Jamba-1.5-Mini layer shapes, N >= 4 layers (hidden 4096; Mamba v1 of 8192 channels, state 16, dt rank
  256, three for each attention layer of 32 heads on 8 KV heads without positions; 16 experts of width 14336, top 2, every
  2nd layer), random bf16; the Mamba layers on pdflash_kernels.gdn (`mamba1_forward`), on the paged forward.
Random targets use a 4096-token vocabulary and random prompt ids (the same on every run). `--layers N` overrides the
layer count of every random target; `--tiny` builds them with tiny shapes instead (pdflash.tiny.tiny_config: hidden 64,
8 experts top-2; gpt-oss's sliding window 64) for CPU smoke runs.
Defaults: 4 prompts x 128 new tokens (demo, qwen3), 2 prompts x 64 new tokens for gptoss (its build, two transformers
runs at ~10-20 tok/s and the captures fit ~4 minutes of an H200 that way); --prompts / --new-tokens set all targets.

Rows: the verifier at block 1 (no drafts: the identity reference), n-gram drafting at each of --blocks, DFlash (at the
blocks up to its trained 16) and hybrid at each of --blocks for the demo (the targets with a DFlash drafter), and a replay
drafter at block 16 that proposes block 1's continuation with every 4th draft wrong (tau ~ 4, labelled as such: random
weights give n-gram drafting little to match); widths adapt as in the stack (drafter_svc/width.py). Then transformers'
greedy and prompt-lookup `generate` on the same model and device (stock kernels; --no-hf skips them). Every mode runs
once over all prompts after a short warm-up (kernels compiled, graphs of its bucket and feature layers captured).

Columns: tok/s (every token of the run over its wall time, prefills included); tau (tokens per verify round);
forward_ms (the verify forward per round: CUDA-graph replays on the paged KV, as served); byte_time_ms (the bytes that
forward reads at the measured device copy rate: every dense weight but the input embedding (its rows are gathered,
unless tied to the LM head), as the verifier holds them, plus the round's routed experts at their stored bytes from the
verifier's byte map (MXFP4 slices for gptoss; KV cache and activations not counted); of_byte_time = byte_time / forward;
round_other_ms (the decode's wall time per round minus the forward: acceptance, drafting, host work); identical (the
mode's tokens equal block 1's on every prompt; the script exits 1 otherwise). transformers rows: `same_as_block1`, for
information (stock kernels are not batch-invariant; on the CPU in float32 they agree).

Writes e2e_gpu_<device>.json / .md (e2e_gpu_h200.* on the H200) to --out (default benchmarks/results); with --device cpu, e2e_gpu_cpu.json / .md. The JSON
is rewritten after each target, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import pathlib
import platform
import random
import resource
import signal
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.inprocess import core_run, drafter_propose, ngram_propose  # noqa: E402
from benchmarks.kernel_bench import device_tag  # noqa: E402
from verifier_svc.engine import PagedKVOptions, VerifierCore  # noqa: E402

FAMILIES = {"qwen3": "qwen3_moe", "gptoss": "gpt_oss", "dsv3": "deepseek_v3", "qnext": "qwen3_next", "nano": "nemotron_h",
            "jamba": "jamba"}
MXFP4_ARCHS = {"gpt_oss"}  # served as the model ships: MXFP4 experts, resident
DEFAULTS = {"demo": (4, 128), "qwen3": (4, 128), "gptoss": (2, 64), "dsv3": (2, 64), "qnext": (2, 64), "nano": (2, 64),
            "jamba": (2, 64)}  # prompts, new tokens
REPLAY_BLOCK = 16
TINY_VOCAB = 512


@dataclasses.dataclass
class Target:
    name: str
    family: str  # demo, qwen3, gptoss
    model: torch.nn.Module
    directory: pathlib.Path
    prompts: list[list[int]]
    new_tokens: int
    drafter_dir: pathlib.Path | None = None
    info: dict = dataclasses.field(default_factory=dict)


def mxfp4_served(arch: str | None, args) -> bool:
    """Whether a target's experts are served in MXFP4: gpt-oss as it ships; every random target with --mxfp4-experts
    (Qwen3's quantized from its random bf16 weights, as `--experts mxfp4` serves a checkpoint). (getattr: waves.py,
    forward_profile.py and prefill_profile.py build and serve through these helpers with arguments of their own.)"""
    return arch in MXFP4_ARCHS or (arch is not None and getattr(args, "mxfp4_experts", False))


def parse_target(name: str, layers: int = 0) -> tuple[str, str | None, int]:
    """(family, architecture, layers) of a target name: demo, qwen3-<N>l, gptoss-<N>l; `layers` > 0 overrides N."""
    if name == "demo":
        return "demo", None, 0
    family, _, n = name.partition("-")
    if family not in FAMILIES or not n.endswith("l") or not n[:-1].isdigit() or int(n[:-1]) < 1:
        raise SystemExit(f"unknown target {name!r}: use demo, qwen3-<N>l, gptoss-<N>l, dsv3-<N>l, qnext-<N>l, nano-<N>l or jamba-<N>l (e.g. gptoss-24l)")
    return family, FAMILIES[family], layers or int(n[:-1])


def target_config(arch: str, layers: int, tiny: bool):
    from pdflash.tiny import ARCHITECTURES, generic_config, real_shape_config, tiny_config

    if not tiny:
        return real_shape_config(arch, num_layers=layers)
    if arch not in ARCHITECTURES:  # (dsv3: DeepSeek-V3's attention and routing at tiny widths)
        return generic_config(arch, TINY_VOCAB, 0, num_layers=layers)
    cfg = tiny_config(arch, TINY_VOCAB, 0, num_layers=layers)
    if arch == "gpt_oss":
        cfg.sliding_window = 64  # crossed by the default 128-token prompts, as the real 128 is
    return cfg


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set (Linux: KiB)


def estimate(cfg, arch: str, dtype: torch.dtype, mxfp4: bool) -> dict:
    """Bytes of the model to build (exact: built on the meta device) and, for MXFP4 targets, of its experts in MXFP4,
    with the peak they imply: the float model + its MXFP4 experts + the larger of a second copy of them (on their
    modules, then the served arena) and one layer's (de)quantization temporaries (~8 float32 copies of its largest
    experts tensor)."""
    from transformers import AutoModelForCausalLM

    from pdflash_kernels.installer import experts_modules
    from pdflash_kernels.mxfp4 import BYTES_PER_WEIGHT

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(p.numel() for p in m.parameters()) * size
    out = {"model_bytes": total}
    if mxfp4:
        mods = list(experts_modules(m).values())
        weights = sum(p.numel() for mod in mods for n, p in mod.named_parameters() if not n.endswith("bias"))
        biases = sum(p.numel() for mod in mods for n, p in mod.named_parameters() if n.endswith("bias"))
        largest = max(p.numel() for mod in mods for p in mod.parameters())
        out["mxfp4_expert_bytes"] = int(weights * BYTES_PER_WEIGHT + biases * 2)
        out["peak_bytes"] = total + out["mxfp4_expert_bytes"] + max(out["mxfp4_expert_bytes"], 8 * 4 * largest)
    else:
        out["peak_bytes"] = total
    return out


def build(name: str, args, device: torch.device, dtype: torch.dtype) -> Target:
    """The model on `device` (random targets built there), its prompts, and what building it cost."""
    from transformers import AutoModelForCausalLM

    from pdflash.defaults import default_drafter_dir, default_target_dir

    family, arch, layers = parse_target(name, args.layers)
    n_prompts, new = DEFAULTS[family]
    n_prompts, new = args.prompts or n_prompts, args.new_tokens or new
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if family == "demo":
        d = pathlib.Path(default_target_dir())
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
        prompts = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())
        prompts = [p[: args.prompt_tokens] for p in prompts[:n_prompts]]
        return Target(name, family, model, d, prompts, new, pathlib.Path(default_drafter_dir()),
                      {"build_s": round(time.perf_counter() - t0, 2), "weights": "trained (pdflash/assets/demo)"})
    cfg = target_config(arch, layers, args.tiny)
    est = estimate(cfg, arch, dtype, mxfp4_served(arch, args))
    print(f"[{name}] building {layers} layers of {arch} shapes{' (tiny)' if args.tiny else ''} on {device}: "
          f"{_size(est['model_bytes'])} of {str(dtype).removeprefix('torch.')} weights"
          + (f", {_size(est['mxfp4_expert_bytes'])} of MXFP4 experts" if "mxfp4_expert_bytes" in est else "")
          + f"; estimated peak {_size(est['peak_bytes'])}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: nothing stops a run early (the verifier ignores eos)
    _sync(device)
    info = {"layers": layers, "build_s": round(time.perf_counter() - t0, 2), "estimate": est,
            "weights": f"random {str(dtype).removeprefix('torch.')}, seed 0, built on {device.type}"}
    if mxfp4_served(arch, args):
        from verifier_svc.model import quantize_experts

        t1 = time.perf_counter()
        info["mxfp4_expert_bytes"] = quantize_experts(model)
        _sync(device)
        info["quantize_s"] = round(time.perf_counter() - t1, 2)
        info["weights"] += "; experts quantized to MXFP4 (transformers runs their dequantization)"
    info["peak_after_build_gib"] = _gib(peak_bytes(device))
    print(f"[{name}] built in {info['build_s']} s" + (f", experts quantized in {info['quantize_s']} s" if "quantize_s" in info else "")
          + f"; peak memory so far {info['peak_after_build_gib']} GiB", file=sys.stderr, flush=True)
    rng = random.Random(0)
    vocab = cfg.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)] for _ in range(n_prompts)]
    return Target(name, family, model, pathlib.Path(f"/tmp/pdflash-e2e-gpu/{name}"), prompts, new, None, info)


def linear_one_launch() -> bool:
    from pdflash_kernels import linear

    return linear.ONE_LAUNCH


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompts, new: int, **kw) -> list[dict]:
    """transformers' `generate`, greedy, exactly `new` tokens (no eos: the verifier runs with ignore_eos)."""
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id, gen.max_new_tokens, gen.do_sample = None, new, False
    if gen.pad_token_id is None:
        gen.pad_token_id = 0
    for k, v in kw.items():
        setattr(gen, k, v)
    dev = next(model.parameters()).device
    per = []
    with torch.inference_mode():
        for p in prompts:
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([p], device=dev), generation_config=gen)
            toks = out[0, len(p):].tolist()  # (a device->host copy: the generation has finished)
            per.append({"tokens": toks, "wall_s": time.perf_counter() - t0})
    return per


HF_MODES = [("transformers greedy", {}), ("transformers prompt lookup", {"prompt_lookup_num_tokens": 10})]


def hf_runs(t: Target) -> dict[str, list[dict]]:
    out = {}
    for name, kw in HF_MODES:
        try:
            hf_generate(t.model, t.prompts[:1], 8, **kw)  # warm-up
        except ValueError as e:  # (a stateful model, e.g. Qwen3-Next: transformers has no assisted generation for it)
            print(f"[{t.name}] {name}: not run ({e})", file=sys.stderr, flush=True)
            continue
        out[name] = hf_generate(t.model, t.prompts, t.new_tokens, **kw)
        print(f"[{t.name}] {name}: {sum(len(r['tokens']) for r in out[name]) / sum(r['wall_s'] for r in out[name]):.1f} tok/s",
              file=sys.stderr, flush=True)
    return out


def serve(t: Target, args, device: torch.device):
    """The verifier's target (kernels installed; gpt-oss's experts MXFP4 resident) and how it serves its experts."""
    from verifier_svc.model import serve_mxfp4, wrap_model

    arch = t.model.config.model_type
    if mxfp4_served(arch, args):
        target = serve_mxfp4(t.model, t.directory, kernels=args.kernels)
        how = ("MXFP4 resident (one arena on the device, the grouped MXFP4 kernel)" if target.expert_cache is None else
               "MXFP4, an expert cache holding every expert (no kernels: the torch reference)")
    else:
        target = wrap_model(t.model, t.directory, kernels=args.kernels)
        how = f"{target.experts_format} {str(target.dtype).removeprefix('torch.')}"
    return target, how


def dense_bytes(model) -> int:
    """Bytes of the tensors a forward reads whole, as held: every parameter and buffer but the experts modules' (the
    byte map counts the routed ones per round) and an untied input embedding (a forward gathers its tokens' rows)."""
    from pdflash_kernels.installer import experts_modules

    skip = {id(t) for m in experts_modules(model).values() for t in [*m.parameters(), *m.buffers()]}
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb.data_ptr() != head.data_ptr():
        skip.add(id(emb))
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in skip or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def copy_rate_bytes(device: torch.device) -> float:
    """Bytes moved (read + write) per second by a large copy on the device (benchmarks.kernel_bench.copy_rate on CUDA)."""
    if device.type == "cuda":
        from benchmarks.kernel_bench import copy_rate

        return copy_rate()
    src = torch.empty(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * src.numel() / (time.perf_counter() - t0)


def replay(reference, every=4):
    """propose(...) for core_run: the reference continuation (block 1's tokens) with every `every`-th draft wrong."""

    def propose(i, prompt, out, k, state):
        n = len(out)
        drafts = list(reference[i][n : n + k])
        return [(t - 1 if t > 2 else t + 1) if (n + j) % every == every - 1 else t for j, t in enumerate(drafts)]

    return propose


def replay_iid(reference, p_error: float = 1 / 3, seed: int = 0):
    """propose(...) for core_run: the reference continuation with each output position's draft wrong independently with
    probability p_error (a fixed pseudo-random mask per prompt and position, the same on every run): a run of accepted
    drafts is geometric from any start, unlike `replay`'s fixed period (p 1/3: a per-draft rate of 2/3, tau ~3 on long
    blocks)."""
    import random

    def wrong(i: int, pos: int) -> bool:
        return random.Random(f"{seed}:{i}:{pos}").random() < p_error

    def propose(i, prompt, out, k, state):
        n = len(out)
        drafts = list(reference[i][n : n + k])
        return [(t - 1 if t > 2 else t + 1) if wrong(i, n + j) else t for j, t in enumerate(drafts)]

    return propose


def none_propose(i, prompt, out, k, state):
    return []


def verifier_modes(t: Target, blocks: list[int], device: torch.device, dtype: torch.dtype) -> list[tuple[str, int, object]]:
    """(row name, block, propose) for every drafter mode of a target; block 1 first (the identity reference); the
    replay row's propose is None (made from block 1's tokens)."""
    modes = [("verifier none@1", 1, none_propose)]
    modes += [(f"verifier ngram@{b}", b, ngram_propose) for b in blocks]
    if t.drafter_dir is not None:
        from drafter_svc.drafters.dflash import DFlashFactory
        from drafter_svc.drafters.hybrid import HybridFactory

        dflash = DFlashFactory(t.directory, t.drafter_dir, dtype=dtype, device=device)
        hybrid = HybridFactory(dflash)
        modes += [(f"verifier dflash@{b}", b, drafter_propose(dflash)) for b in blocks if b <= dflash.max_block_size]
        modes += [(f"verifier hybrid@{b}", b, drafter_propose(hybrid)) for b in blocks]
    replay_block = min(REPLAY_BLOCK, max(blocks))
    modes.append((f"verifier replay@{replay_block} (block-1 output, every 4th draft wrong)", replay_block, None))
    return modes


def verifier_row(t: Target, mode: str, block: int, r: dict, base: dict, dense: int, rate: float) -> dict:
    n = r["rounds"]
    fwd = r["forward_ms"] / n
    byte_ms = (dense + r["routed_bytes"] / n) / rate * 1e3
    return {
        "target": t.name, "mode": mode, "block": block, "tok_s": round(r["tok_per_s"], 1),
        "decode_tok_s": round(r["decode_tokens"] / r["decode_s"], 1), "tau": round(r["decode_tokens"] / n, 2),
        "forward_ms": round(fwd, 3), "byte_time_ms": round(byte_ms, 4), "of_byte_time": round(byte_ms / fwd, 3) if fwd else None,
        "round_other_ms": round(r["decode_s"] * 1e3 / n - fwd, 3),
        "identical": r["outputs"] == base["outputs"],
        "tokens": r["tokens"], "rounds": n, "routed_bytes_per_round": round(r["routed_bytes"] / n),
        "prefill_ms": round(r["prefill_s"] * 1e3 / len(t.prompts), 2),
    }


def run_target(name: str, args, device: torch.device, dtype: torch.dtype, rate: float, result: dict) -> list[str]:
    """Every row of one target into `result`; returns the modes not identical to block 1."""
    t0 = time.perf_counter()
    t = build(name, args, device, dtype)
    info = result["targets"][name] = {**t.info, "prompts": len(t.prompts), "prompt_tokens": len(t.prompts[0]),
                                      "new_tokens": t.new_tokens, "prompt_ids": t.prompts}
    rows, failed = result["rows"], []
    hf = hf_runs(t) if not args.no_hf else {}
    if device.type == "cuda":
        info["peak_after_hf_gib"] = _gib(peak_bytes(device))
    t1 = time.perf_counter()
    target, how = serve(t, args, device)
    blocks = sorted(set(args.blocks))
    core = VerifierCore(target, max_block_size=max(blocks + [min(REPLAY_BLOCK, max(blocks))]), max_tokens_limit=4096,
                        paged_kv=PagedKVOptions(kv_cache_gb=args.kv_cache_gb if device.type == "cuda" else 0.0))
    _sync(device)
    dense = dense_bytes(target.model)
    info.update({"experts": how, "kernels": target.kernels or "off", "batch_invariant": target.batch_invariant,
                 "paged_kv": core.pool is not None, "cuda_graphs": core.graphs is not None,
                 "serve_s": round(time.perf_counter() - t1, 2), "dense_bytes": dense,
                 "expert_bytes": target.total_expert_bytes, "expert_slice_bytes": target.byte_map[target.moe_layers[0]][0],
                 "experts_per_token": target.experts_per_token, "peak_after_serve_gib": _gib(peak_bytes(device))})
    print(f"[{name}] served in {info['serve_s']} s: experts {how}; dense {_size(dense)}, experts "
          f"{_size(target.total_expert_bytes)}; peak memory so far {info['peak_after_serve_gib']} GiB",
          file=sys.stderr, flush=True)
    modes = verifier_modes(t, blocks, device, dtype)
    base = None
    # resident weights: widths are not priced (the CPU's stand-in, a cache holding every expert, runs the same way)
    price = target.expert_cache is None
    for mode, block, propose in modes:
        if propose is None:
            propose = replay(base["outputs"])
        core_run(core, t.prompts[:1], min(t.new_tokens, 16), block, propose, cost_aware=price)  # warm-up: compiles
        runs = [core_run(core, t.prompts, t.new_tokens, block, propose, cost_aware=price) for _ in range(args.repeat)]
        # --repeat: the row is the run of median forward time (its tok/s and other columns with it), the spread beside it
        order = sorted(range(len(runs)), key=lambda i: runs[i]["forward_ms"] / runs[i]["rounds"])
        r = runs[order[len(order) // 2]]
        if base is None:
            base = r
            info["reference_tokens"] = r["outputs"]
        rows.append(verifier_row(t, mode, block, r, base, dense, rate))
        if len(runs) > 1:
            rows[-1]["runs"] = len(runs)
            rows[-1]["forward_ms_runs"] = [round(x["forward_ms"] / x["rounds"], 3) for x in runs]
            rows[-1]["tok_s_runs"] = [round(x["tok_per_s"], 1) for x in runs]
            rows[-1]["identical"] = all(x["outputs"] == base["outputs"] for x in runs)
        print(rows[-1], flush=True)
        if not rows[-1]["identical"]:
            failed.append(f"{name} {mode}")
    for mode, per in hf.items():
        tokens = sum(len(p["tokens"]) for p in per)
        rows.append({"target": name, "mode": mode, "tok_s": round(tokens / sum(p["wall_s"] for p in per), 1),
                     "tokens": tokens, "same_as_block1": [p["tokens"] for p in per] == base["outputs"]})
        print(rows[-1], flush=True)
    info["peak_gib"] = _gib(peak_bytes(device))
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] done in {info['seconds']} s; peak memory {info['peak_gib']} GiB", file=sys.stderr, flush=True)
    del core, target, t, modes
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return failed


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# The verify loop in process on `{m['device']}` (`{m['command']}`)", "",
        f"{m['device_name']}, torch {m['torch']}; linear split-K in one launch: {m.get('linear_one_launch', False)}; greedy, "
        "`ignore_eos`; byte time at the measured copy rate "
        f"{m['copy_rate_bytes_per_s'] / 1e12:.2f} TB/s (read + write); {m['seconds']} s in all; {m['date']}.", "",
        "byte time: every dense weight but an untied input embedding, as the verifier holds it, plus the round's routed "
        "experts at their stored bytes (the verifier's byte map: MXFP4 slices for gptoss); KV cache and activations not "
        "counted. tok/s includes the prefills; other ms/round = decode wall time per round - forward. transformers rows: "
        "stock kernels, their tokens against block 1 for information; for gptoss they run the same model, the MXFP4 "
        "experts dequantized to bf16 (biases bf16, as the kernels read them).", "",
    ]
    for name, i in result["targets"].items():
        est = i.get("estimate", {})
        lines.append(
            f"- {name}: {i.get('weights', '')}; {i['prompts']} prompts x {i['prompt_tokens']} tokens, {i['new_tokens']} new; "
            f"experts {i.get('experts', '?')}; batch-invariant {i.get('batch_invariant', '?')}, paged KV "
            f"{i.get('paged_kv', '?')}, CUDA graphs {i.get('cuda_graphs', '?')}; dense {_size(i.get('dense_bytes', 0))}, "
            f"experts {_size(i.get('expert_bytes', 0))}; built in {i.get('build_s', '?')} s"
            + (f" + quantized in {i['quantize_s']} s" if "quantize_s" in i else "")
            + f", served in {i.get('serve_s', '?')} s; peak memory {i.get('peak_gib', '?')} GiB"
            + (f" (estimated {_size(est['peak_bytes'])})" if "peak_bytes" in est else "")
            + f"; {i.get('seconds', '?')} s")
    spread = any("runs" in r for r in result["rows"])
    lines += ["", "| target | mode | tok/s | tau | forward ms | byte time ms | of byte time | other ms/round | identical to block 1 |"
              + (" forward ms, every run |" if spread else ""), "|---|---|---|---|---|---|---|---|---|" + ("---|" if spread else "")]
    for r in result["rows"]:
        same = r["identical"] if "identical" in r else f"({'same' if r['same_as_block1'] else 'differs'})"
        lines.append(f"| {r['target']} | {r['mode']} | {r['tok_s']} | {r.get('tau', '')} | {r.get('forward_ms', '')} | "
                     f"{r.get('byte_time_ms', '')} | {'' if r.get('of_byte_time') is None else r['of_byte_time']} | "
                     f"{r.get('round_other_ms', '')} | {same} |"
                     + (f" {', '.join(map(str, r.get('forward_ms_runs', [])))} |" if spread else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["demo", "qwen3-8l", "gptoss-24l"])
    ap.add_argument("--prompts", type=int, default=0, help="prompts per target (0: 4, gptoss 2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=0, help="new tokens per prompt (0: 128, gptoss 64)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--layers", type=int, default=0, help="layer count of every random target (0: as named)")
    ap.add_argument("--tiny", action="store_true", help="random targets with tiny shapes (CPU smoke runs)")
    ap.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (float32) for a smoke run")
    ap.add_argument("--kernels", default="auto", choices=["auto", "on", "off"],
                    help="the verifier's batch-invariant kernels (auto: with CUDA and triton). Off: transformers' kernels "
                         "and KV cache; gptoss's MXFP4 experts then go through an expert cache holding them all")
    ap.add_argument("--kv-cache-gb", type=float, default=8.0, help="the paged KV pool on CUDA")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' rows")
    ap.add_argument("--mxfp4-experts", action="store_true",
                    help="serve every random target's experts in MXFP4, resident (default: gptoss only, as it ships); "
                         "qwen3's then take the fragment MoE kernels' small-call paths (fragments.DIRECT_SHAPES)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="appended to the output files' names (an A/B run next to the default one)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per mode (the row: the run of median forward time; the spread in forward_ms_runs / tok_s_runs)")
    args = ap.parse_args(argv)
    if min(args.blocks) < 2:
        raise SystemExit("--blocks: widths of 2 or more (block 1 always runs)")
    if args.repeat < 1:
        raise SystemExit("--repeat: at least one timed run per mode")
    names = []  # as built: --layers renames the random targets (gptoss-24l --layers 4 -> gptoss-4l)
    for name in args.targets:
        family, _, layers = parse_target(name, args.layers)
        names.append(name if family == "demo" else f"{family}-{layers}l")
    # `timeout` (benchmarks/gpu.sh) sends SIGTERM: unwind, so that what was measured is written
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_gpu_{device_tag(device)}" + (f"_{args.tag}" if args.tag else "")
    t_start = time.perf_counter()
    rate = copy_rate_bytes(device)
    result: dict = {"meta": {}, "targets": {}, "rows": [], "not_identical": []}

    def save() -> None:
        result["meta"] = {
            "date": time.strftime("%Y-%m-%d"), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU",
            "torch": torch.__version__, "copy_rate_bytes_per_s": rate, "blocks": args.blocks, "tiny": args.tiny,
            "linear_one_launch": linear_one_launch(),
            "seconds": round(time.perf_counter() - t_start),
            "command": "python benchmarks/e2e_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(markdown(result))

    try:
        for name in names:
            result["not_identical"] += run_target(name, args, device, dtype, rate, result)
            save()
    finally:
        save()
        signal.signal(signal.SIGTERM, previous)  # (main called in process, e.g. by a test)
    print(markdown(result))
    if result["not_identical"]:
        print(f"IDENTITY CHECK FAILED: not equal to block 1: {', '.join(result['not_identical'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
