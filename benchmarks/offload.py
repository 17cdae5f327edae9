"""Offloaded MXFP4 experts on one GPU: the verifier serving a MoE model whose experts live in pinned host memory,
through a device expert cache of 10%, 25% and 100% of the expert bytes, next to transformers + accelerate
offloading the same experts to CPU memory (PEER: plain `generate`, what a Python user does today).

    python benchmarks/offload.py [--models gpt-oss-24l qwen3-48l] [--caches 0.1 0.25 1.0] [--new-tokens 64]
                                 [--prompts 2] [--peer-tokens 4] [--layer-scale 1.0] [--out benchmarks/results]
    python benchmarks/offload.py --merge RUN1/offload_h200.json RUN2/offload_h200.json ... [--out benchmarks/results]

Targets: gpt-oss-20b layer shapes (24 layers, 32 experts top-4, H = I = 2880) and Qwen3-30B-A3B layer shapes (48
layers, 128 experts top-8), random bf16 weights built on the GPU, experts quantized to MXFP4 into the host store.
In process (VerifierCore, no RPC: a checkpoint of these sizes is not written to disk here), one request at a time,
greedy, 128-token prompts (a random 32-token phrase said four times), `--new-tokens` each. Rows per cache size:
block 1 (no drafts); n-gram drafting at block 16; a replay drafter at block 16 that proposes the block-1
continuation with every 3rd draft wrong (tau ~3, labelled as such), and one whose drafts are each wrong with
probability 1/3 at fixed pseudo-random positions ("replay iid 2/3": geometric runs from any start). Verify forwards replay segmented CUDA graphs
(verifier_svc/runner.py: one graph per layer, the experts kernels inside; each layer syncs once to learn its experts).

Columns: output tok/s; expert bytes moved host->device per output token; the achieved H2D rate of the expert copies
(their GPU time) as a fraction of a plain pinned copy of same-size slices; the fraction of copy time hidden under
compute (1 - (forward time - the same run's forward time with every expert cached) / copy time); cache hit rate;
prefetch coverage (of the experts a forward needed that were not left resident by earlier forwards, the share a
prefetch brought in time); wasted bytes (prefetched, evicted unused); the PCIe bound (tok/s if moving the row's
non-resident union bytes (misses + used prefetches, not the wasted ones) at the pinned rate were the only cost) and tok/s as a fraction of it; `byte_bound`: that copy time is at least the
row's compute time (its 100%-cache run). `identical`: the row's tokens equal block 1 with every expert cached.
Writes offload_<device>.json / .md under --out (offload_h200.* on the H200, offload_cpu.* with --device cpu).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import re
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e_gpu import replay, replay_iid  # noqa: E402
from benchmarks.inprocess import core_run, ngram_propose  # noqa: E402

MODELS = {"gpt-oss-24l": ("gpt_oss", 24), "qwen3-48l": ("qwen3_moe", 48), "tiny-gpt-oss": ("tiny:gpt_oss", 2)}


def none_propose(i, prompt, out, k, state):
    return []


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, vocab) for _ in range(32)]
        out.append(phrase * 4)
    return out


def pinned_rate(store, slices: int = 64) -> float:
    """Bytes per second of a plain pinned host -> device copy, slice by slice (as the cache copies)."""
    n = min(slices, store.arena.shape[0])
    dst = torch.empty(n, store.slice_bytes, dtype=torch.uint8, device="cuda")
    src = store.arena[:n]
    for _ in range(2):
        for i in range(n):
            dst[i].copy_(src[i], non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        for i in range(n):
            dst[i].copy_(src[i], non_blocking=True)
    b.record()
    b.synchronize()
    return 3 * n * store.slice_bytes / (a.elapsed_time(b) * 1e-3)


def fill_rate(store, slices: int = 32) -> float:
    """Bytes per second of the device-managed cache's copies: the fill kernel (pdflash_kernels/offload.py) reading pinned host
    slices over PCIe into device slots, `slices` slices in one launch as a layer's misses would be."""
    from pdflash_kernels import offload as ko

    n = min(slices, store.arena.shape[0])
    pool = torch.empty(n, store.slice_bytes, dtype=torch.uint8, device="cuda")
    eff = torch.arange(n, dtype=torch.int32, device="cuda")
    flags = torch.ones(n, dtype=torch.int8, device="cuda")
    for _ in range(2):
        ko.fill(store.arena, pool, 0, eff, flags)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        ko.fill(store.arena, pool, 0, eff, flags)
    b.record()
    b.synchronize()
    return 3 * n * store.slice_bytes / (a.elapsed_time(b) * 1e-3)


DEVICE = torch.device("cuda")  # --device cpu: a smoke run of the script's logic (no copy timing, no PEER)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# A layer's output projections: attention's o_proj, the experts' (and any dense MLP's) down projection, their biases
_LAYER_OUTPUTS = re.compile(r"\.(o_proj\.(weight|bias)|down_proj(_bias|\.weight|\.bias)?)$")


def build(arch: str, layers: int, layer_scale: float = 1.0):
    """The random model; `layer_scale` multiplies every layer's output projections (`_LAYER_OUTPUTS`), so each layer
    adds less to the residual stream: consecutive layers' hidden states stay close, as in trained models, and the next
    layer's router applied to this layer's input predicts its experts better than in a plain random model."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import real_shape_config, tiny_config

    torch.manual_seed(0)
    if arch.startswith("tiny:"):  # smoke runs of the script
        cfg = tiny_config(arch[5:], 512, 0, num_layers=layers)
    else:
        cfg = real_shape_config(arch, num_layers=layers)
    with DEVICE:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if layer_scale != 1.0:
        with torch.no_grad():
            scaled = [p.mul_(layer_scale) for name, p in model.named_parameters() if _LAYER_OUTPUTS.search(name)]
        if not scaled:
            raise ValueError(f"--layer-scale: no output projection found in {arch}")
    return model


def hidden_cos(model, prompt: list[int]) -> float:
    """Mean cosine similarity of each token's residual stream before and after each layer but the last (whose output
    transformers returns normed), a plain forward of `prompt`: how much one layer moves it (the layer guess's premise)."""
    with torch.no_grad():
        hs = model(torch.tensor([prompt], device=DEVICE), output_hidden_states=True).hidden_states
    sims = [torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean() for a, b in zip(hs[:-2], hs[1:-1])]
    return round(float(torch.stack(sims).mean()), 4)


def offloaded_core(model, name: str):
    """The model's experts into the host store (+ a first cache of every expert), the verifier core over it."""
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import offload_experts, wrap_model

    cache = offload_experts(model, DEVICE, 1e9, time_copies=True)
    kernels = "on" if DEVICE.type == "cuda" else "off"
    target = wrap_model(model, pathlib.Path(f"/tmp/{name}"), kernels=kernels, experts="native", byte_map=cache.store.byte_map())
    target.expert_cache, target.experts_format = cache, "mxfp4"
    return VerifierCore(target, max_block_size=16, max_tokens_limit=4096, paged_kv=PagedKVOptions(kv_cache_gb=4))


def use_cache(core, fraction: float, mode: str, prefetch: str = "union,layer", guess_width: int = 0, overlap: str = "async+abort"):
    """A fresh cache (`mode`: device- or host-managed) holding `fraction` of the experts (at least one layer's), the
    modules routed through it; its next-layer guess takes the router's top `guess_width` (0: auto, pdflash_kernels.installer.guess_k);
    `overlap` (device cache): "on", a layer's misses copy while its resident experts compute (--expert-fill-overlap), the
    next layer waiting for the guess's copies; "off"; or "+"-joined: "async" (the next layer waits only for the guess's
    admission, PDFLASH_EXPERT_GUESS_ASYNC: the server's default),
    "gN" (the misses in N copy groups, PDFLASH_EXPERT_FILL_GROUPS), "abort" (the guess's copies abortable by the next
    layer's admission, PDFLASH_EXPERT_GUESS_ABORT), "misses" (the guess's width counts copies: the router's picks best
    first until that many are not resident, PDFLASH_EXPERT_GUESS_MISSES), e.g. "async+g3", "async+abort+misses"."""
    from pdflash_kernels.installer import experts_modules
    from verifier_svc.expert_cache import min_slots, new_cache

    old = core.target.expert_cache
    store = old.store
    total = sum(store.num_experts.values())
    core.target.expert_cache = None
    del old
    if core.graphs is not None:
        core.graphs.reset()  # the graphs read the old cache's pool
    torch.cuda.empty_cache()
    slots = max(min_slots(store), round(fraction * total))
    if mode == "device":  # + its overflow range (one layer's experts) beyond the fraction
        slots = round(fraction * total) + min_slots(store)
    cache = new_cache(store, 0, DEVICE, prefetch, mode, time_copies=True, slots=slots)
    cache.guess_width = guess_width  # before the graphs capture the guess's top-k
    if mode == "device":
        parts = set(overlap.split("+"))
        cache.fill_overlap = "off" not in parts
        cache.guess_async = "async" in parts
        cache.guess_abort = "abort" in parts
        cache.guess_misses = "misses" in parts
        cache.fill_groups = next((int(p[1:]) for p in parts if p[:1] == "g" and p[1:].isdigit()), 1)
    for layer, module in experts_modules(core.target.model).items():  # a rebind: serving the model anew would reset
        module._pdflash_offload = (cache, layer)  # its experts implementation, dropping the seam's route capture
    core.target.expert_cache = cache
    if core.graphs is not None:
        core.graphs.capture(max_rows=core.max_block_size)  # now, not inside the first measured verify
    return cache


def measure(core, prompts, new: int, block: int, propose, cost_aware: bool = True) -> dict:
    """The decode alone: the prefills' time, copies and counters are left out (a 128-token prompt routes to most
    experts of every layer, so its prefill streams most of the model; `ttft_ms` reports it)."""
    cache = core.target.expert_cache
    cache.copy_ms()  # forget earlier copies
    sync()
    r = core_run(core, prompts, new, block, propose, on_prefill=cache.copy_ms, cost_aware=cost_aware)  # (after each prefill: forget its copies)
    r["stats"], r["copy_ms"] = r["decode_cache"], cache.copy_ms()
    return r


def peer(arch: str, layers: int, prompts, new: int) -> dict:
    """transformers + accelerate: the experts in CPU memory (bf16), moved to the GPU by accelerate's hooks at each
    forward; plain greedy generate."""
    from accelerate import dispatch_model

    from pdflash_kernels.installer import experts_modules

    model = build(arch, layers)
    experts = {id(m) for m in experts_modules(model).values()}
    holders = set()  # modules with an experts module somewhere below them
    for name, m in model.named_modules():
        if id(m) in experts:
            parts = name.split(".")
            holders.update(".".join(parts[:i]) for i in range(len(parts)))
    device_map = {}

    def place(prefix: str, module) -> None:  # a device map without overlaps: experts -> cpu, the rest -> GPU 0
        if id(module) in experts:
            module.to("cpu")
            device_map[prefix] = "cpu"
        elif prefix in holders:
            for child_name, child in module.named_children():
                place(f"{prefix}.{child_name}" if prefix else child_name, child)
            if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
                raise RuntimeError(f"{prefix} holds tensors of its own beside its experts: no clean device map")
        else:
            device_map[prefix] = 0

    place("", model)
    torch.cuda.empty_cache()
    model = dispatch_model(model, device_map=device_map, main_device=0)
    toks = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            toks += out.shape[1] - ids.shape[1]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"tok_s": toks / wall, "tokens": toks, "wall_s": wall}


def write(args, meta: dict, rows: list[dict]) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.kernel_bench import tag_of

    stem = f"offload_{tag_of(meta['device'])}"  # (offload_h200 on the H200, offload_cpu for a CPU smoke run)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Offloaded MXFP4 experts (`{meta['command']}`)", "",
          f"{meta['device']}; in process, one request at a time, {args.prompts} prompts x {args.new_tokens} new tokens, greedy. "
          "tok/s and every per-token column: the decode alone (verify rounds); TTFT: the 128-token prefill (eager, it streams most experts). "
          "Pinned H2D rate per model: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in meta["pinned_h2d_bytes_per_s"].items())
          + "; the device-managed cache's fill kernel (PCIe reads of pinned memory): "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in meta.get("fill_kernel_bytes_per_s", {}).items())
          + ". Device rows: copy time = bytes / the fill kernel's rate (its copies run inside the forward's kernels). "
          "Each cache is warmed by one short request before its rows (kernels compiled; the TTFT column is a warm server's). "
          "prefetch: what streams ahead (union: the verify's projected union; layer: layer l + 1's router on layer l's input). "
          "guess: how many of that router's top experts per row the layer guess fetches (auto: a quarter of its top_k, at least 1). "
          "overlap (device cache): on, a layer's misses copy while its resident experts compute; off, they copy before its GEMMs; "
          "async, on and the next layer waits only for the guess's admission, not its copies; +abort, the next layer stops "
          "the copies of guessed experts it does not route to (async+abort: the server's default since stop 38). "
          "width: the drafted rows' width rule (cost: the growth rule capped by measured round prices, as the stack does for "
          "offloaded experts; growth: the growth rule alone). "
          + (f"Layer outputs scaled x{meta['layer_scale']} at build (--layer-scale: each layer moves the residual stream "
             "less, as in trained models, so the next layer's routing is predictable from this layer's input; a modelling "
             "choice, not a checkpoint). " if meta.get("layer_scale", 1.0) != 1.0 else "")
          + "Consecutive layers' hidden-state cosine (a plain forward of one prompt): "
          + ", ".join(f"{k} {v}" for k, v in meta.get("hidden_cos", {}).items()) + ".", "",
          "| model | system | cache | prefetch | guess | overlap | block | drafter | width | tok/s | TTFT ms | tau | expert MB/token | H2D of pinned | hidden | hit rate | coverage | wasted MB | PCIe bound tok/s | of bound | byte-bound | identical |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["system"] != "OURS":
            md.append(f"| {r['model']} | {r['system']} | CPU | | | | 1 | none | | {r['output_tokens_per_second']} | | | | | | | | | | | | ({r['note']}) |")
            continue
        f = lambda v, scale=1.0, nd=2: "" if v is None else round(v * scale, nd)  # noqa: E731
        label = r["model"] + (f" (outputs x{r['layer_scale']})" if r.get("layer_scale", 1.0) != 1.0 else "")
        md.append(f"| {label} | OURS {r.get('mode', 'host')} | {int(r['cache_fraction'] * 100)}% | {r.get('prefetch', '')} | {r.get('guess_width', 0) or 'auto'} | {r.get('overlap') or ''} | {r['block']} | {r['drafter']} | {r.get('width', '') if r['block'] > 1 else ''} | {r['output_tokens_per_second']} | "
                  f"{r.get('ttft_ms', '')} | {r['tau']} | {f(r['expert_bytes_per_token'], 1e-6, 1)} | {f(r['h2d_fraction_of_pinned'])} | {f(r['hidden_fraction'])} | "
                  f"{f(r['cache_hit_rate'])} | {f(r['prefetch_coverage'])} | {f(r['wasted_bytes'], 1e-6, 1)} | {f(r['bound_tokens_per_second'], 1, 1)} | "
                  f"{f(r['fraction_of_bound'])} | {r['byte_bound']} | {r['identical']} |")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


ROW_KEY = ("model", "system", "layer_scale", "mode", "cache_fraction", "prefetch", "guess_width", "overlap", "width", "block",
           "drafter")


def merge(paths: list[str]) -> tuple[dict, list[dict]]:
    """Several runs' offload_h200.json (e.g. one model or cache size per device call) -> one table's (meta, rows): a
    model's rows together, larger caches first (file order among equals), PEER last; a row whose key (ROW_KEY) an
    earlier file already has left out (each run repeats its 100% rows); meta's per-model maps joined, the commands
    listed. Runs with different prompts, new tokens, layer scale or device are refused: one table states one setting."""
    meta: dict = {}
    rows: list[dict] = []
    seen = set()
    commands = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        m = data["meta"]
        for k in ("new_tokens", "prompts", "layer_scale", "device"):
            if k in meta and m.get(k) != meta[k]:
                raise SystemExit(f"--merge: {path} has {k} {m.get(k)!r}, an earlier file {meta[k]!r}: one table, one setting")
        for k, v in m.items():
            if isinstance(v, dict):
                meta.setdefault(k, {}).update(v)
            elif k != "command":
                meta.setdefault(k, v)
        commands.append(m.get("command", path))
        for r in data["rows"]:
            key = tuple(r.get(k) for k in ROW_KEY)
            if key not in seen:
                seen.add(key)
                rows.append(r)
    meta["command"] = " ; ".join(commands)
    models = list(dict.fromkeys(r["model"] for r in rows))  # a model's rows together: larger caches first, PEER last
    rows.sort(key=lambda r: (models.index(r["model"]), r["system"] != "OURS", -(r.get("cache_fraction") or 0.0)))
    return meta, rows


def _overlap(text: str) -> str:
    parts = text.split("+")
    if text in ("on", "off") or all(p in ("async", "abort", "misses") or (p[:1] == "g" and p[1:].isdigit() and 1 <= int(p[1:]) <= 8)
                                     for p in parts):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: on, off, or +-joined async / abort / misses / g1..g8 (e.g. async+g3, "
                                     "async+abort+misses)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt-oss-24l", "qwen3-48l"], choices=list(MODELS))
    ap.add_argument("--caches", nargs="+", type=float, default=[1.0, 0.25, 0.1], help="cache sizes as fractions of the expert bytes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--peer-tokens", type=int, default=4, help="new tokens per prompt for the transformers + accelerate rows (0 = skip); gpt-oss only")
    ap.add_argument("--peer-prompt-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--modes", nargs="+", default=["device", "host"], choices=["device", "host"],
                    help="who decides what the expert cache holds (verifier_svc.device_cache / expert_cache)")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (smoke runs)")
    ap.add_argument("--prefetch", nargs="+", default=["union,layer"],
                    help="prefetch kinds to compare at each cache size below 100%% (each a comma list: union, layer, or none)")
    ap.add_argument("--guess-widths", nargs="+", type=int, default=[0],
                    help="with layer prefetch, how many of the next router's top experts the guess fetches (0 = auto: a quarter of "
                         "its top_k, at least 1; the cache's guess_width, --expert-guess-width), compared at each cache size below 100%%")
    ap.add_argument("--overlaps", nargs="+", default=["async+abort"], type=_overlap,
                    help="device cache: copy a layer's misses while its resident experts compute (on, --expert-fill-overlap) "
                         "or before its GEMMs (off); with it, +-joined: async (the next-layer guess does not hold up the "
                         "next layer, PDFLASH_EXPERT_GUESS_ASYNC), gN (the "
                         "misses in N copy groups, PDFLASH_EXPERT_FILL_GROUPS=N), abort (the guess's copies stopped by the "
                         "next layer's admission where it did not route to them, PDFLASH_EXPERT_GUESS_ABORT), misses (the guess's width "
                         "counts copies: the router's picks best first until that many are not resident, "
                         "PDFLASH_EXPERT_GUESS_MISSES), e.g. "
                         "async+g3, async+abort (the server's default and this option's); compared at each cache "
                         "size below 100%%")
    ap.add_argument("--widths", nargs="+", default=["cost"], choices=["cost", "growth"],
                    help="the drafted rows' width rule: cost (the growth rule capped by round time, what the stack does "
                         "for offloaded experts) and/or growth (the growth rule alone)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the logic (no copy timing, no PEER)")
    ap.add_argument("--layer-scale", type=float, default=1.0,
                    help="multiply every layer's output projections by this (build): consecutive hidden states stay close, "
                         "as in trained models, so the layer guess can predict routing; the rows say so")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="write one table (offload_h200.json/.md under --out) from several runs' offload_h200.json instead of "
                         "running: each row once, a model's rows together (larger caches first, PEER last)")
    args = ap.parse_args(argv)
    if args.merge:
        meta, rows = merge(args.merge)
        args.prompts, args.new_tokens = meta["prompts"], meta["new_tokens"]
        write(args, meta, rows)
        return 0
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type != "cuda":
        args.peer_tokens = 0
    caches = sorted(set(args.caches), reverse=True)
    if caches[0] != 1.0:
        caches.insert(0, 1.0)  # the compute-only reference of every row
    rows = []
    if not args.layer_scale > 0:
        raise SystemExit("--layer-scale: a positive factor")
    meta = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "new_tokens": args.new_tokens, "prompts": args.prompts,
            "layer_scale": args.layer_scale,
            "command": "python benchmarks/offload.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for name in args.models:
        arch, layers = MODELS[name]
        layers = args.layers or layers
        t0 = time.perf_counter()
        model = build(arch, layers, args.layer_scale)
        meta.setdefault("hidden_cos", {})[name] = hidden_cos(model, prompts_for(1, model.config.vocab_size)[0])
        core = offloaded_core(model, name)
        store = core.target.expert_cache.store
        rate = pinned_rate(store) if DEVICE.type == "cuda" else 25e9
        frate = fill_rate(store) if DEVICE.type == "cuda" else 25e9
        meta.setdefault("pinned_h2d_bytes_per_s", {})[name] = rate
        meta.setdefault("fill_kernel_bytes_per_s", {})[name] = frate
        meta.setdefault("store_bytes", {})[name] = store.total_bytes
        meta.setdefault("slice_bytes", {})[name] = store.slice_bytes
        print(f"{name}: built + quantized in {time.perf_counter() - t0:.1f} s; store {store.total_bytes / 2**30:.2f} GiB, "
              f"slice {store.slice_bytes / 2**20:.2f} MiB; pinned H2D {rate / 1e9:.1f} GB/s, fill kernel {frate / 1e9:.1f} GB/s", flush=True)
        prompts = prompts_for(args.prompts, core.target.vocab_size)
        core_run(core, prompts[:1], 4, 4)  # compile the kernels
        reference = None
        runs = [(m, f, pf, gw, ov) for m in args.modes for f in caches for pf in (["union,layer"] if f == 1.0 else args.prefetch)
                for gw in ([0] if f == 1.0 else args.guess_widths)
                for ov in (["on"] if f == 1.0 or m != "device" else args.overlaps)]
        for mode, fraction, prefetch, guess_width, overlap in runs:
            if fraction == 1.0:
                compute = {}
            cache = use_cache(core, fraction, mode, "" if prefetch == "none" else prefetch, guess_width, overlap)
            # warm: every kernel of this cache compiled and (at 100%) every expert resident before the timed runs
            core_run(core, prompts if fraction == 1.0 else prompts[:1], 4, 1)
            modes = [("none", 1, none_propose, "growth")]
            modes += [(d, 16, pr, w) for w in args.widths
                      for d, pr in (("ngram", ngram_propose), ("replay tau~3", None), ("replay iid 2/3", None))]
            for drafter, block, propose, wrule in modes:
                if fraction == 1.0 and (drafter, wrule) in compute:
                    continue
                if propose is None:
                    propose = (replay(reference["outputs"], every=3) if drafter == "replay tau~3"
                               else replay_iid(reference["outputs"], p_error=1 / 3))
                r = measure(core, prompts, args.new_tokens, block, propose, cost_aware=wrule == "cost")
                if reference is None:
                    reference = r
                st, toks, wall = r["stats"], r["decode_tokens"], r["decode_s"]
                if fraction == 1.0:
                    compute[drafter] = r
                    compute[(drafter, wrule)] = r
                base = compute[drafter]
                copy_s = r["copy_ms"] * 1e-3 if r["copy_ms"] is not None else st.bytes_moved / frate  # device: inside kernels
                needed = (st.misses + st.prefetch_used) * store.slice_bytes  # the non-resident union bytes
                bound_s = needed / rate
                exposed_s = max(0.0, (r["forward_ms"] - base["forward_ms"]) * 1e-3)
                row = {
                    "model": name, "layer_scale": args.layer_scale, "cache_fraction": fraction, "cache_slots": cache.num_slots, "block": block,
                    "drafter": drafter, "system": "OURS", "mode": mode, "prefetch": prefetch, "width": wrule,
                    "guess_width": guess_width, "overlap": overlap if mode == "device" else None,
                    "output_tokens_per_second": round(toks / wall, 2),
                    "ttft_ms": round(1e3 * r["prefill_s"] / len(prompts), 1),
                    "tau": round(toks / r["rounds"], 2),
                    "expert_bytes_per_token": round(st.bytes_moved / toks),
                    "h2d_gbps": round(st.bytes_moved / copy_s / 1e9, 2) if copy_s > 0 else None,
                    "h2d_fraction_of_pinned": round(st.bytes_moved / copy_s / rate, 3) if copy_s > 0 else None,
                    "hidden_fraction": round(min(1.0, max(0.0, 1 - exposed_s / copy_s)), 3) if copy_s > 0 else None,
                    "cache_hit_rate": round(st.hits / st.lookups, 4) if st.lookups else None,
                    "prefetch_coverage": round(st.coverage, 4) if st.coverage is not None else None,
                    "wasted_bytes": st.wasted_bytes,
                    "bound_tokens_per_second": round(toks / bound_s, 2) if bound_s > 0 else None,
                    "fraction_of_bound": round((toks / wall) / (toks / bound_s), 3) if bound_s > 0 else None,
                    "byte_bound": bool(bound_s >= base["decode_s"]),
                    "forward_ms_per_round": round(r["forward_ms"] / r["rounds"], 3),
                    "drafts_per_round": r.get("drafts_per_round"),
                    "round_log": r.get("round_log"),  # (drafts, accepted, ms) per verify round
                    "copy_ms_per_round": round(copy_s * 1e3 / r["rounds"], 3),
                    "identical": r["outputs"] == reference["outputs"],
                    "stats": dataclasses.asdict(st),
                    "guesses_aborted": st.prefetch_aborted,
                }
                rows.append(row)
                print({k: v for k, v in row.items() if k != "stats"}, flush=True)
        del core, model
        torch.cuda.empty_cache()
        write(args, meta, rows)  # a run cut by its time limit keeps the models done
        if args.peer_tokens and arch == "gpt_oss":
            pp = [p[: args.peer_prompt_tokens] for p in prompts[:1]]
            try:
                r = peer(arch, layers, pp, args.peer_tokens)
            except Exception as e:  # noqa: BLE001 - the OURS rows are still worth writing
                print(f"PEER failed: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"model": name, "cache_fraction": 0.0, "block": 1, "drafter": "none",
                         "system": "PEER (transformers + accelerate, experts in CPU memory)",
                         "output_tokens_per_second": round(r["tok_s"], 3), "tokens": r["tokens"],
                         "note": f"1 prompt x {args.peer_tokens} new tokens after {args.peer_prompt_tokens}-token prompts"})
            print(rows[-1], flush=True)
    write(args, meta, rows)
    bad = [r for r in rows if r["system"] == "OURS" and not r["identical"]]
    if bad:
        print(f"NOT IDENTICAL: {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
