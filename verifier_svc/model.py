"""Load a Hugging Face MoE checkpoint (local safetensors) through transformers."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pdflash.hf_compat import cache_kwarg
from pdflash.logging import get_logger
from verifier_svc.checkpoint import DirectLoad, fp8_blocks, native_mxfp4, plan
from verifier_svc.experts import ExpertsSeam, expert_byte_map, experts_modules

log = get_logger("pdflash.verifier.model")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class TargetModel:
    name: str
    directory: pathlib.Path
    model: torch.nn.Module
    seam: ExpertsSeam
    byte_map: dict[int, list[int]]  # layer -> exact stored bytes per expert
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    experts_per_token: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    cache_arg: str = "past_key_values"  # the forward's KV-cache keyword in this transformers (pdflash.hf_compat)
    kernels: dict = dataclasses.field(default_factory=dict)  # Installation.summary(), {} when not installed
    experts_format: str = "native"
    expert_cache: object | None = None  # verifier_svc.expert_cache.ExpertCache when the experts are offloaded

    @property
    def batch_invariant(self) -> bool:
        return bool(self.kernels.get("batch_invariant"))

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.byte_map)

    @property
    def experts_per_layer(self) -> int:
        return max((len(v) for v in self.byte_map.values()), default=0)

    @property
    def total_expert_bytes(self) -> int:
        return sum(sum(v) for v in self.byte_map.values())


def _eos_ids(directory: pathlib.Path, config) -> tuple[int, ...]:
    ids: list[int] = []
    gen = directory / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.exists() else []
    sources.append(getattr(config, "eos_token_id", None))
    for src in sources:
        if src is None:
            continue
        for i in src if isinstance(src, list) else [src]:
            if int(i) not in ids:
                ids.append(int(i))
        if ids:
            break
    return tuple(ids)


def model_name(directory: pathlib.Path) -> str:
    """The directory's name; for the embedded pair's generic "target" folder, say which pair it is."""
    from pdflash.defaults import ASSETS

    if directory.resolve() == (ASSETS / "target").resolve():
        return "pdflash-demo-qwen3moe"
    return directory.name


def expert_format_for(device: torch.device, layout=None) -> str:
    """The format of the MXFP4 stores of a verifier on `device` (`pdflash_kernels.moe.expert_format_for`); logs why
    where fragment words are enabled and available but these experts cannot be held so (widths off
    64: `pdflash_kernels.fragments.fragments_fit`)."""
    from pdflash_kernels import moe

    fmt = moe.expert_format_for(device, layout)
    if fmt != "fragments" and layout is not None and torch.device(device).type == "cuda" and moe.FRAGMENTS:
        from pdflash_kernels import fragments

        why = fragments.fragments_fit(layout.hidden, layout.intermediate, layout.gated)
        if fragments.gluon is not None and why:
            log.info("MXFP4 experts not stored as fragment words", expert_format=fmt, why=why)
    return fmt


def kernels_wanted(mode: str, device: torch.device) -> bool:
    """--kernels auto: on CUDA when triton imports; on: required (CUDA, or Triton's interpreter for tests)."""
    from pdflash_kernels import runtime

    if mode == "off":
        return False
    if mode == "auto":  # never the interpreter: it is for tests of the kernels, far too slow to serve
        return device.type == "cuda" and runtime.triton is not None
    usable = runtime.triton_usable(device)
    if not usable:
        raise ValueError(f"--kernels on: the batch-invariant kernels need CUDA and triton (device {device}, triton "
                         f"{'found' if runtime.triton is not None else 'not installed'})")
    return usable


def install_kernels(model, experts_format: str) -> dict:
    import pdflash_kernels

    inst = pdflash_kernels.install(model, experts_format=experts_format)
    summary = inst.summary()
    if summary["batch_invariant"]:
        log.info("batch-invariant kernels installed", **summary)
    else:
        log.warning("kernels installed, but parts of the forward are not batch-invariant: greedy output may differ "
                    "between block widths", **summary)
    return summary


def load_target(directory: str | pathlib.Path, device: str = "cpu", dtype: str = "auto", kernels: str = "off",
                experts: str = "native", expert_cache_gb: float = 0.0, expert_prefetch: str = "union,layer",
                expert_cache_mode: str = "device", expert_eviction: str = "lru") -> TargetModel:
    """expert_cache_gb > 0 (with experts="mxfp4"): the routed experts live in a host MXFP4 store and a device cache
    of that size serves them (they never reach the device whole); 0 = every expert resident. expert_prefetch: what
    the cache fetches ahead of need, expert_cache_mode: who decides what it holds, expert_eviction: which cached
    expert a miss replaces (host mode; verifier_svc.config).

    experts="mxfp4" reads the experts from the safetensors one layer at a time (`verifier_svc.checkpoint`): a
    gpt-oss checkpoint's native MXFP4 blocks/scales byte for byte, float experts quantized; no expert is ever held in
    bf16 whole. A checkpoint whose tensor names transformers renames at load goes through `from_pretrained` first."""
    directory = pathlib.Path(directory)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} is not a checkpoint directory (no config.json)")
    if not list(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    dev = torch.device(device)
    if dtype == "auto":
        torch_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    else:
        torch_dtype = _DTYPES[dtype]
    if expert_cache_gb > 0 and experts != "mxfp4":
        raise ValueError("--expert-cache-gb serves offloaded MXFP4 experts: add --experts mxfp4")
    if experts == "mxfp4" and expert_cache_gb <= 0 and not kernels_wanted(kernels, dev):
        raise ValueError(f"--experts {experts} needs the kernels (CUDA and triton)")
    config = AutoConfig.from_pretrained(directory)
    native = native_mxfp4(config)
    log.info("loading target", path=str(directory), architecture=config.model_type, dtype=str(torch_dtype), device=str(dev),
             experts="mxfp4 (checkpoint)" if native else experts)
    fp8 = fp8_blocks(config) is not None  # (transformers' own FP8 loader needs accelerate and a GPU: read it here)
    if experts == "mxfp4" or fp8:
        try:
            direct = plan(directory, config, torch_dtype)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - one line that names the checkpoint (pdflash.server.failure_reason)
            raise ValueError(f"cannot load the checkpoint in {directory}: {type(e).__name__}: {e}") from e
        if isinstance(direct, DirectLoad) and experts == "mxfp4":
            return load_direct(direct, directory, dev, kernels, expert_cache_gb, expert_prefetch, expert_cache_mode,
                               expert_eviction)
        if isinstance(direct, DirectLoad):  # FP8, --experts native: every weight dequantized to the model's dtype
            direct.load_rest()
            direct.load_float_experts()
            return wrap_model(direct.model.to(dev), directory, kernels, experts)
        if fp8:
            raise ValueError(f"cannot read the FP8 checkpoint in {directory}: {direct}")
        log.info("experts quantized after a transformers load (not read layer by layer)", reason=direct)
    kw = {}
    if native:  # transformers dequantizes them (its MXFP4 kernels need the hub's `kernels` package and a GPU)
        from transformers import Mxfp4Config

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
        log.warning(f"--experts native on MXFP4 experts: transformers dequantizes every expert to {torch_dtype}; "
                    "--experts mxfp4 keeps them as the checkpoint stores them")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, use_safetensors=True, **kw)
    except Exception as e:  # noqa: BLE001 - one line that names the checkpoint (pdflash.server.failure_reason)
        hint = "; its experts are MXFP4: use --experts mxfp4" if native else ""
        raise ValueError(f"cannot load the checkpoint in {directory}: {type(e).__name__}: {e}{hint}") from e
    if experts == "mxfp4" and expert_cache_gb > 0:
        cache = offload_experts(model, dev, expert_cache_gb, expert_prefetch, mode=expert_cache_mode,
                                eviction=expert_eviction)  # before the model moves to the device
        return wrap_offloaded(model.to(dev), directory, kernels, cache)
    return wrap_model(model.to(dev), directory, kernels, experts)


def load_direct(direct: DirectLoad, directory: pathlib.Path, device: torch.device, kernels: str, cache_gb: float,
                prefetch: str = "union,layer", mode: str = "device", eviction: str = "lru") -> TargetModel:
    """The model of a `verifier_svc.checkpoint.plan`: non-expert weights read by name, the experts read layer by layer
    into a host MXFP4 store, then served offloaded through a device cache of `cache_gb` GiB (> 0) or copied to the
    device whole for the kernels (0)."""
    from pdflash_kernels.installer import serve_offloaded_experts
    from tqdm import tqdm

    from verifier_svc.expert_cache import new_cache
    from verifier_svc.expert_store import GateLayout, HostExpertStore

    t0 = time.perf_counter()
    with tqdm(total=len(direct.rest), desc="reading weights (all but the experts)", unit="tensor", leave=False) as bar:
        direct.load_rest(progress=bar.update)
    t_rest = time.perf_counter()
    first = next(iter(direct.forms.values()))
    gate = GateLayout(first.row_mul, first.up_off, first.act, first.alpha, first.limit)
    offload = cache_gb > 0
    store = HostExpertStore(first.layout, direct.num_experts, gate, pin=offload and device.type == "cuda",
                            fmt=expert_format_for(device, first.layout), convert_on=device)
    cache = None
    if offload:  # sized (and refused when too small) before the experts are read
        cache = new_cache(store, cache_gb, device, prefetch, mode, eviction=eviction)
    t_alloc = time.perf_counter()
    as_is = all(f.kind == "mxfp4" for f in direct.forms.values())
    source = "checkpoint MXFP4 bytes" if as_is else "quantized from the checkpoint"
    desc = "reading MXFP4 experts" if as_is else "quantizing experts to MXFP4"
    with tqdm(total=len(direct.forms), desc=f"{desc} (host store)", unit="layer", leave=False) as bar:
        for layer, experts in direct.experts(quantize_on=device if device.type == "cuda" else None):
            for e, parts in experts:
                store.put_expert(layer, e, parts)
            bar.update()
    t_experts = time.perf_counter()
    model, byte_map, store_format = direct.model, store.byte_map(), store.format
    _warn_demoted(store)
    if offload:
        serve_offloaded_experts(model, cache)
        target = wrap_offloaded(model.to(device), directory, kernels, cache)
    else:  # resident: one copy of the arena on the device; the kernels read each layer's rows of it
        resident_experts(model, store, device)
        del store
        target = wrap_model(model.to(device), directory, kernels, "mxfp4", byte_map=byte_map)
    log.info("experts loaded", source=source, expert_format=store_format, experts=sum(direct.num_experts.values()), layers=len(direct.forms),
             store_bytes=sum(sum(v) for v in byte_map.values()), slice_bytes=first.layout.nbytes,
             resident="offloaded" if offload else str(device), cache_slots=cache.num_slots if cache else None,
             seconds_weights=round(t_rest - t0, 2), seconds_store_alloc=round(t_alloc - t_rest, 2),
             seconds_experts=round(t_experts - t_alloc, 2), seconds=round(time.perf_counter() - t0, 2))
    return target


def _warn_demoted(store) -> None:
    if store.demoted:
        log.warning("MXFP4 experts stored as pair words, not fragment words",
                    why="a scale byte above 128 (a weight group beyond +-12), which fragment words cannot decode")


def offload_experts(model, device: torch.device, cache_gb: float, prefetch: str = "union,layer", time_copies: bool = False,
                    mode: str = "device", eviction: str = "lru"):
    """Quantize the routed experts into a host store (pinned for a GPU), route the model's experts through a device
    cache of `cache_gb` GiB, and drop the experts' original weights."""
    from pdflash_kernels.installer import serve_offloaded_experts
    from verifier_svc.expert_cache import new_cache
    from verifier_svc.expert_store import HostExpertStore

    from tqdm import tqdm

    t0 = time.perf_counter()
    layers = len(experts_modules(model))
    with tqdm(total=layers, desc="quantizing experts to MXFP4 (host store)", unit="layer", leave=False) as bar:
        store = HostExpertStore.from_model(model, pin=device.type == "cuda", progress=lambda _layer: bar.update(),
                                           fmt=lambda layout: expert_format_for(device, layout), convert_on=device)
    _warn_demoted(store)
    cache = new_cache(store, cache_gb, device, prefetch, mode, time_copies=time_copies, eviction=eviction)
    serve_offloaded_experts(model, cache)
    log.info("experts offloaded", expert_format=store.format, experts=sum(store.num_experts.values()), store_bytes=store.total_bytes,
             slice_bytes=store.slice_bytes, cache_slots=cache.num_slots, cache_bytes=cache.pool.numel(),
             seconds=round(time.perf_counter() - t0, 2))
    return cache


def resident_experts(model, store, device: torch.device) -> None:
    """Every expert of a `HostExpertStore` resident on `device` in one arena (the store's own when it lies there
    already), each experts module given its layer's rows of it: `wrap_model(..., experts="mxfp4")` then installs them
    for the grouped MXFP4 kernel as they are (`pdflash_kernels.installer.expert_weights` reads `_pdflash_mxfp4`)."""
    arena = store.arena if store.arena.device == torch.device(device) else store.arena.to(device)
    for layer, module in experts_modules(model).items():
        module._pdflash_mxfp4 = store.layer_weights(layer, arena)


def wrap_offloaded(model, directory: pathlib.Path, kernels: str, cache) -> TargetModel:
    """wrap_model for a model whose experts an expert cache serves (`serve_offloaded_experts` done): the byte map is
    the store's slices."""
    target = wrap_model(model, directory, kernels, "native", byte_map=cache.store.byte_map())
    target.expert_cache, target.experts_format = cache, "mxfp4"
    return target


def quantize_experts(model) -> int:
    """Quantize a loaded model's routed experts to MXFP4 where they lie, as the store and the installer quantize them
    (`pdflash_kernels.installer.expert_weights`), and keep them on each experts module (`_pdflash_mxfp4`, which both MXFP4
    serving paths then take as they are); the module's own float weights become their dequantization, its biases the
    bf16 the kernels read, in the model's dtype. So transformers' own forward of the model computes with exactly the
    weights an MXFP4 verifier of it reads (benchmarks' baselines on the same model). Returns the MXFP4 bytes held."""
    from pdflash_kernels.installer import expert_weights, set_float_experts

    total = 0
    for layer, module in experts_modules(model).items():
        dtype = module.down_proj.dtype  # (gate_up_proj's, or up_proj's on up-only experts: one dtype)
        w = expert_weights(module, "mxfp4")
        if isinstance(w, str):
            raise ValueError(f"layer {layer}: experts MXFP4 cannot hold ({w})")
        set_float_experts(module, w, dtype, biases=True)
        module._pdflash_mxfp4 = w
        total += sum(t.numel() * t.element_size() for t in (w.w1, w.s1, w.w2, w.s2, w.b1, w.b2) if t is not None)
    return total


def serve_mxfp4(model, directory: pathlib.Path, kernels: str = "auto") -> TargetModel:
    """A loaded model (on its device) served with its routed experts in MXFP4, every expert resident, through the paths
    a checkpoint's `--experts mxfp4` takes: the experts quantized into a `HostExpertStore` (`from_model`; those a
    `quantize_experts` call quantized already are taken as they are), then
    - with the kernels (CUDA): the store's arena built on the device and read there by the grouped MXFP4 kernel
      (`resident_experts`, as `load_target(..., experts="mxfp4")` without a cache serves);
    - without them (a CPU verifier): an expert cache holding every expert, no prefetch, served through the torch
      reference (`offload_experts`, as `--expert-cache-gb` serves on a CPU).
    The byte map is the store's slices either way."""
    from verifier_svc.expert_store import HostExpertStore

    dev = next(model.parameters()).device
    if kernels_wanted(kernels, dev):
        store = HostExpertStore.from_model(model, device=dev, fmt=lambda layout: expert_format_for(dev, layout))
        _warn_demoted(store)
        resident_experts(model, store, dev)
        return wrap_model(model, directory, kernels, "mxfp4", byte_map=store.byte_map())
    cache = offload_experts(model, dev, 1e9, prefetch="")  # 1e9 GiB: a slot for every expert
    for module in experts_modules(model).values():
        module.__dict__.pop("_pdflash_mxfp4", None)  # the store holds them now
    return wrap_offloaded(model, directory, kernels, cache)


def wrap_model(model, directory: pathlib.Path, kernels: str = "off", experts: str = "native", byte_map: dict | None = None) -> TargetModel:
    """A loaded transformers model (on its device) -> TargetModel: kernels installed, the experts seam, the byte map.
    (`load_target` reads the checkpoint first; benchmarks that build a model in memory call this directly.)"""
    model = model.eval()
    model.requires_grad_(False)
    param = next(model.parameters())
    dev, torch_dtype = param.device, param.dtype
    config = model.config
    summary = {}
    if kernels_wanted(kernels, dev):
        summary = install_kernels(model, experts)  # before the seam: it wraps the experts implementation in force
    elif experts != "native":
        raise ValueError(f"--experts {experts} needs the kernels (CUDA and triton)")
    seam = ExpertsSeam(model)
    byte_map = byte_map or expert_byte_map(model)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetModel(
        name=model_name(directory),
        directory=directory,
        model=model,
        seam=seam,
        byte_map=byte_map,
        architecture=config.model_type,
        num_layers=int(text_cfg.num_hidden_layers),
        hidden_size=int(text_cfg.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context=int(getattr(text_cfg, "max_position_embeddings", 4096) or 4096),
        experts_per_token=int(getattr(text_cfg, "num_experts_per_tok", 0) or 0),
        eos_token_ids=_eos_ids(directory, config),
        device=dev,
        dtype=torch_dtype,
        cache_arg=cache_kwarg(model),
        kernels=summary,
        experts_format=experts if summary else "native",
    )
