"""Put the batch-invariant kernels under a loaded transformers model, without per-model code.

- experts: a function registered in transformers' `ALL_EXPERTS_FUNCTIONS` (the experts seam) runs every
  experts module on `pdflash_kernels.moe` (bf16 as loaded, or MXFP4 quantized at install);
- attention: a function registered in transformers' `AttentionInterface` runs on `pdflash_kernels.attention`;
- linears, norms, routers, LM head: the model's forward runs inside `pdflash_kernels.dispatch.InvariantMode`.

`install` probes one small forward and reports what is covered; a part it cannot cover (an experts
module with an activation it does not know, an aten reduction it does not take over) is named in the
report and logged, never silently left on a batch-dependent kernel. `Installation.uninstall` undoes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import warnings

import torch
from torch import nn

from pdflash_kernels import attention as attn_kernels
from pdflash_kernels import fused, linear, mla, mxfp4, runtime
from pdflash_kernels.dispatch import InvariantMode, Recorder
from pdflash_kernels.moe import ACT_GPTOSS, ACT_RELU2, ACT_SILU, ExpertWeights, moe_forward
from pdflash.hf_compat import cache_kwarg

EXPERTS_IMPL = "batch_invariant"
ATTN_IMPL = "batch_invariant"  # no "flash" in it: transformers would swap a *flash* name for its own kernels
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ---- finding the experts ---------------------------------------------------------------------------------
def experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its experts module (classes decorated with transformers' use_experts_implementation)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        fwd = getattr(type(module), "forward", None)
        if not (hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(fwd, "__wrapped__")):
            continue
        m = _LAYER_RE.search(name)
        if m is not None:
            found[int(m.group(1))] = module
    return dict(sorted(found.items()))


def num_experts_of(module: nn.Module) -> int:
    for attr in ("num_experts", "num_local_experts"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            return v
    for p in module.parameters(recurse=False):
        return int(p.shape[0])
    raise ValueError(f"cannot tell the number of experts of {type(module).__name__}")


def _activation(module: nn.Module, inter: int, row_mul: int, up_off: int) -> tuple[int, str]:
    """Which activation the module's gate applies, checked numerically against our formulas."""
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:
        return -1, "no _apply_gate"
    z = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(0)) * 4
    j = torch.arange(inter)
    g, u = z[:, j * row_mul], z[:, j * row_mul + up_off]
    try:
        with torch.no_grad():
            got = apply_gate(z)
    except Exception as e:  # noqa: BLE001 - any failure means "not ours"
        return -1, f"gate probe failed: {e}"
    silu = torch.nn.functional.silu(g) * u
    if got.shape == silu.shape and torch.allclose(got, silu, rtol=1e-4, atol=1e-5):
        return ACT_SILU, "silu"
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if alpha is not None and limit is not None:
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        ref = (uc + 1) * (gc * torch.sigmoid(gc * alpha))
        if got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-5):
            return ACT_GPTOSS, "clamped swiglu"
    return -1, "an activation the kernels do not implement"


def _up_only_activation(module: nn.Module) -> tuple[int, str]:
    """Which activation an up-only experts module (no gate: transformers' has_gate=False) applies to its up
    projection, checked numerically against the kernels' formulas."""
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None:
        return -1, "up-only experts without act_fn"
    z = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 4
    try:
        with torch.no_grad():
            got = act_fn(z)
    except Exception as e:  # noqa: BLE001 - any failure means "not ours"
        return -1, f"activation probe failed: {e}"
    if got.shape == z.shape and torch.allclose(got, torch.relu(z) ** 2, rtol=1e-4, atol=1e-5):
        return ACT_RELU2, "relu^2"
    return -1, f"up-only experts with an activation the kernels do not implement ({type(act_fn).__name__})"


def _k_major(module: nn.Module, name: str) -> torch.Tensor:
    """The [E, out, in] weight with `in` contiguous. A transposed parameter is re-laid once, and the module
    keeps a transposed view of the new storage, so its own forward (and other implementations) still work."""
    p = getattr(module, name)
    if not module.is_transposed:
        return p.data
    km = p.data.transpose(1, 2).contiguous()
    setattr(module, name, nn.Parameter(km.transpose(1, 2), requires_grad=False))
    return km


def expert_weights(module: nn.Module, experts_format: str = "native") -> ExpertWeights | str:
    """The module's weights as the kernels read them, or why it cannot run on them."""
    if experts_format == "mxfp4" and getattr(module, "_pdflash_mxfp4", None) is not None:
        return module._pdflash_mxfp4  # read from the checkpoint at load (verifier_svc.checkpoint)
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    gated = getattr(module, "has_gate", True)
    first = "gate_up_proj" if gated else "up_proj"
    if not hasattr(module, first) or not hasattr(module, "down_proj"):
        return f"no {first}/down_proj parameters"
    if gated:
        w1 = _k_major(module, "gate_up_proj")
        inter = w1.shape[1] // 2
        row_mul, up_off = (1, inter) if module.is_concatenated else (2, 1)
        act, why = _activation(module, inter, row_mul, up_off)
    else:  # up-only experts (Nemotron-H): w1 is the I up rows; the kernels run one row set (moe.ACT_RELU2)
        w1 = _k_major(module, "up_proj")
        row_mul, up_off = 1, 0
        act, why = _up_only_activation(module)
    if act < 0:
        return why
    w2 = _k_major(module, "down_proj")
    b1 = getattr(module, first + "_bias", None) if getattr(module, "has_bias", False) else None
    b2 = getattr(module, "down_proj_bias", None) if getattr(module, "has_bias", False) else None
    kw = dict(row_mul=row_mul, up_off=up_off, act=act, alpha=float(getattr(module, "alpha", 1.702)), limit=float(getattr(module, "limit", 7.0)))
    if experts_format == "mxfp4":
        w1b, w1s = mxfp4.quantize(w1)
        w2b, w2s = mxfp4.quantize(w2)
        bias = (lambda b: None if b is None else b.data.to(torch.bfloat16))
        return ExpertWeights(w1b, w2b, w1s, w2s, bias(b1), bias(b2), **kw, big_scales=mxfp4.big_scales(w1s, w2s))
    if experts_format != "native":
        raise ValueError(f"experts_format must be 'native' or 'mxfp4', got {experts_format!r}")
    return ExpertWeights(w1, w2, None, None, None if b1 is None else b1.data, None if b2 is None else b2.data, **kw)


# ---- the functions registered with transformers ----------------------------------------------------------
CALLS = {"experts": 0, "attention": 0, "fused": 0}  # kernel calls, counted by the install probe


@dataclasses.dataclass
class ForwardContext:
    """Set by a caller that runs the model's layers on a paged KV pool (verifier_svc.runner): the attention
    function then reads keys through `page_table` (the cache's update returned the layer's pools), and the
    experts skip rows >= `valid_rows` (padding rows of a bucketed forward)."""

    page_table: torch.Tensor | None = None  # [B, max_pages] int32
    valid_rows: torch.Tensor | None = None  # [1] int32 on the device
    # a multi-session wave (verifier_svc.runner `forward_wave`): the rows [1, R] are B sequences' one after the other,
    # sequence b's rows [seq_starts[b], seq_starts[b + 1]) ([B + 1] int32 on the device), at most `max_rows` each;
    # the attention reads sequence b's keys through page_table[b] (pdflash_kernels.attention's ragged form)
    seq_starts: torch.Tensor | None = None
    max_rows: int | None = None
    # offloaded experts inside a CUDA-graph capture: `split(module, offload, x, ids, weights) -> out` ends the
    # graph before the experts and starts the next one after them (verifier_svc.runner's segmented graphs)
    segments: object | None = None


_forward_ctx: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("pdflash_forward_ctx", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    token = _forward_ctx.set(ctx)
    try:
        yield ctx
    finally:
        _forward_ctx.reset(token)


_STUB_EXPERTS: contextvars.ContextVar[bool] = contextvars.ContextVar("pdflash_stub_experts", default=False)


@contextlib.contextmanager
def experts_stubbed():
    """Inside: every experts module served by the installed kernels returns zeros and touches nothing (no expert
    cache lookup, copy or counter): for probes of a layer's dataflow (verifier_svc.prenorm), not for serving."""
    token = _STUB_EXPERTS.set(True)
    try:
        yield
    finally:
        _STUB_EXPERTS.reset(token)


def _experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs):
    if _STUB_EXPERTS.get():
        return torch.zeros_like(hidden_states)
    offload = getattr(module, "_pdflash_offload", None)
    if offload is not None:
        ctx = _forward_ctx.get()
        if getattr(offload[0], "device_managed", False):  # every decision on the device: no split, no host step
            return offload[0].forward_experts(module, offload[1], hidden_states, top_k_index, top_k_weights,
                                              ctx.valid_rows if ctx is not None else None)
        if ctx is not None and ctx.segments is not None:
            return ctx.segments.split(module, offload, hidden_states, top_k_index, top_k_weights)
        return offloaded_experts(module, offload, hidden_states, top_k_index, top_k_weights)
    w = getattr(module, "_pdflash_weights", None)
    if w is None or not runtime.triton_usable(hidden_states.device):
        return module._pdflash_fallback(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    CALLS["experts"] += 1
    ctx = _forward_ctx.get()
    valid = ctx.valid_rows if ctx is not None else None
    return moe_forward(hidden_states, top_k_index, top_k_weights, w, module._pdflash_num_experts, n_valid=valid)


def routing_mask(module, cache, x, top_k_index, valid: int | None = None, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Device bool mask of the experts this layer routes to ([E]), followed with `cache.layer_ahead` by the experts the
    next layer's router picks for this layer's input ([E] more). Rows >= `valid` (a host int: sliced off) or >=
    `valid_rows` (a device tensor: masked, no sync, so a CUDA graph can capture it) are padding and count for nothing."""
    n = module._pdflash_num_experts
    nxt = getattr(module, "_pdflash_next_router", None) if cache.layer_ahead else None
    width = 2 * n if nxt is not None else n
    mask = torch.zeros(width + 1, dtype=torch.bool, device=x.device)  # the last entry: where padding rows point
    ids, rows = top_k_index, x.reshape(-1, x.shape[-1])
    if valid is not None:
        ids, rows = ids[:valid], rows[:valid]
    pad = None
    if valid is None and valid_rows is not None:
        pad = (torch.arange(ids.shape[0], device=ids.device) >= valid_rows)[:, None]
        ids = ids.masked_fill(pad, width)
    mask.index_fill_(0, ids.reshape(-1), True)  # (no host scalar copied in: capturable)
    if nxt is not None:
        guess = _predict_experts(rows, nxt, getattr(cache, "guess_width", 0)) + n
        mask.index_fill_(0, (guess if pad is None else guess.masked_fill(pad, width)).reshape(-1), True)
    return mask[:width]


def admit_layer(cache, layer: int, n: int, flags: list[bool]) -> tuple[torch.Tensor, list[int]]:
    """The host side of one layer, given its routing mask read back: make the routed experts resident and pinned
    (the current stream waits for their copies; the layer's slot table is refreshed on it). Returns the slot table
    and the next layer's predicted experts (for `after_layer`)."""
    mine = [e for e in range(n) if flags[e]]
    guess = [e - n for e in range(n, len(flags)) if flags[e]]
    return cache.lookup(layer, mine), guess


def after_layer(cache, layer: int, guess: list[int]) -> None:
    """Once the layer's kernels are queued: prefetch the next layer's predicted experts (needed soonest), then the
    projection's window one layer further."""
    if guess:
        cache.prefetch({layer + 1: guess})
    cache.advance(layer)


def offloaded_experts(module, offload, x, top_k_index, top_k_weights, valid: int | None = None,
                      valid_rows: torch.Tensor | None = None):
    """Experts served from an expert cache (duck-typed: `lookup(layer, ids) -> slot table`, `release()`,
    `prefetch(union)`, `advance(layer)`, `weights`, `layer_ahead`), eagerly: the routed experts of this layer are made
    resident (one host sync per layer: `routing_mask` read back), then the grouped kernel reads them through the slot
    table (the torch reference without a usable Triton). With `layer_ahead`, the next layer's router applied to this
    layer's input picks the experts to prefetch for it (read in the same sync), so their copies run while this layer
    and the next one's attention compute. A prediction only moves bytes early; what a layer computes depends on its
    own routing alone. `valid` / `valid_rows`: the real rows as a host int and as the kernel's device tensor (both
    None: the forward context's, else all rows). The segmented CUDA graphs (verifier_svc.runner) run the same steps
    with the kernels inside their graphs."""
    cache, layer = offload
    if valid is None:
        ctx = _forward_ctx.get()
        if ctx is not None and ctx.valid_rows is not None:
            valid_rows = ctx.valid_rows
            valid = int(valid_rows)
    n = module._pdflash_num_experts
    flags = routing_mask(module, cache, x, top_k_index, valid=valid).tolist()  # the one host sync of the layer
    table, guess = admit_layer(cache, layer, n, flags)
    try:
        out = offloaded_kernel(x, top_k_index, top_k_weights, cache, n, table, valid, valid_rows)
    finally:
        cache.release()
    after_layer(cache, layer, guess)
    return out


def offloaded_kernel(x, top_k_index, top_k_weights, cache, n: int, table: torch.Tensor, valid: int | None,
                     valid_rows: torch.Tensor | None, phase: torch.Tensor | None = None, between=None,
                     groups: int = 1) -> torch.Tensor:
    """The grouped kernel over the cache's slot pool through a layer's slot table (the torch reference without a
    usable Triton). Pure device work: a CUDA graph can capture it. `phase`/`between`/`groups`: the experts still being
    copied in (their copy group per expert) and the wait for a group's copies, run before that group's GEMMs
    (`moe_forward`'s phases; the same bits)."""
    if x.device.type == "cuda" and runtime.triton is not None:
        CALLS["experts"] += 1
        return moe_forward(x, top_k_index, top_k_weights, cache.weights, n, slot_of_expert=table, n_valid=valid_rows,
                           phase_of_expert=phase, between=between, groups=groups)
    from pdflash_kernels.reference import moe_reference

    if between is not None:
        for g in range(1, groups + 1):
            between(g)
    return moe_reference(x, top_k_index, top_k_weights, cache.weights, n, slot_of_expert=table, n_valid=valid).to(x.dtype)


def guess_k(top_k: int, width: int) -> int:
    """How many of a router's top_k picks the next-layer guess fetches per row (the cache's `guess_width`): width >= 1
    that many (at most top_k); 0 = auto, a quarter of top_k and at least one. Fewer, surer guesses spend fewer PCIe bytes
    on wrong experts: on the H200 (benchmarks/results/offload_h200.md, stop 26) gpt-oss-20b shapes (top-4) ran 6-9% more
    tok/s at block 1 with 1 than with all 4 (byte-bound, 10% and 25% caches), Qwen3-30B-A3B shapes (top-8) within +-3%
    with 2."""
    return min(width, top_k) if width > 0 else max(1, top_k // 4)


def _predict_experts(x: torch.Tensor, router: nn.Module, width: int | None = None,
                     table: torch.Tensor | None = None) -> torch.Tensor:
    """The experts a router (weight [E, H], optional bias, top_k) would pick for rows x: the top-k of its logits
    (softmax and the renormalisation keep the order), [rows, k]. width (the cache's `guess_width`, `guess_k`): only
    that many of the best per row; None: all top_k.

    `table` (the next layer's slot table row [E]: slot, or -1 when not resident; the device cache's
    `guess_misses`): width counts copies, not picks. Each row takes its picks best first until `guess_k` of them
    are not resident, so the guess spends its copies on experts the layer lacks rather than on ones it already holds
    (a resident pick on the way stays in: the guess's admission keeps it from being evicted). The rest of the row
    repeats its best pick ([rows, k], graph-safe: no host sync)."""
    w, b = router.weight, getattr(router, "bias", None)
    logits = x.reshape(-1, x.shape[-1]).to(w.dtype) @ w.t()
    if isinstance(b, torch.Tensor):
        logits = logits + b
    k = min(router.top_k, logits.shape[-1])
    if width is None:
        return torch.topk(logits.float(), k, dim=-1).indices
    if table is None:
        return torch.topk(logits.float(), guess_k(k, width), dim=-1).indices
    ranked = torch.topk(logits.float(), k, dim=-1).indices  # best first
    absent = (table[ranked] < 0).to(torch.int32)
    keep = (torch.cumsum(absent, dim=-1) - absent) < guess_k(k, width)  # the absent picks before this one, < width
    return torch.where(keep, ranked, ranked[:, :1])


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its router: the sibling of the layer's experts module that carries a `top_k` and an
    [E, H] weight (qwen3_moe/mixtral `mlp.gate`, gpt_oss `mlp.router`)."""
    names = {id(m): n for n, m in model.named_modules()}
    found = {}
    for layer, experts in experts_modules(model).items():
        parent = model.get_submodule(names[id(experts)].rpartition(".")[0])
        e = num_experts_of(experts)
        for child in parent.children():
            w = getattr(child, "weight", None)
            k = getattr(child, "top_k", None)
            if child is not experts and isinstance(k, int) and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == e:
                found[layer] = child
                break
    return found


def serve_offloaded_experts(model: nn.Module, cache, drop_native: bool = True) -> None:
    """Route every experts module of `model` through `cache` (verifier_svc.expert_cache). Without the rest of the
    kernels (a CPU verifier) this alone sets the experts implementation; `install` keeps the offload. Each layer
    also gets the next layer's router (for `cache.layer_ahead`)."""
    _register()
    found = routers(model)
    for layer, module in experts_modules(model).items():
        module._pdflash_offload = (cache, layer)
        module._pdflash_num_experts = num_experts_of(module)
        module.__dict__["_pdflash_next_router"] = found.get(layer + 1)  # not a submodule: no second registration
        if drop_native:  # the host store holds them now; nothing of the experts stays on the device
            for name in (*_first_projection(module), "down_proj", "down_proj_bias"):
                p = getattr(module, name, None)
                if isinstance(p, torch.Tensor):
                    setattr(module, name, nn.Parameter(torch.empty(p.shape[0], 0, dtype=p.dtype, device=p.device), requires_grad=False))
    model.set_experts_implementation(EXPERTS_IMPL)


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, s_aux=None, **kwargs):
    key_mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, s_aux, **kwargs)
        key_mask = attention_mask
    if not runtime.triton_usable(query.device):
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, s_aux, **kwargs)
    t, s = query.shape[2], key.shape[2]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(s - t, s, device=query.device).unsqueeze(0)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    CALLS["attention"] += 1
    ctx = _forward_ctx.get()
    if ctx is not None and ctx.page_table is not None and mla.is_latent_attention(module):  # latent and rotary pools
        return mla.latent_attention(module, query, key, value, ctx.page_table, positions, scaling, ctx.seq_starts,
                                    ctx.max_rows), None
    if ctx is not None and ctx.page_table is not None:  # key/value are the layer's page pools
        return attn_kernels.paged_attention(query, key, value, ctx.page_table, positions, scaling, sliding_window, sinks,
                                            seq_starts=ctx.seq_starts, max_rows=ctx.max_rows), None
    out = attn_kernels.attention(query, key, value, positions, scaling, sliding_window, sinks, key_mask)
    return out, None


def _latent_expand_kv(expand_kv):
    """An MLA module's `expand_kv` (latents -> per-head keys and values through kv_b_proj) that, in a paged forward,
    hands the layer's latent and rotary pools through as they are: the attention then runs in the absorbed form over
    them (pdflash_kernels.mla) and nothing is expanded. On transformers' cache the module's own."""

    @functools.wraps(expand_kv)
    def wrapped(kv_nope, k_rot):
        ctx = _forward_ctx.get()
        if ctx is not None and ctx.page_table is not None:
            return kv_nope, k_rot
        return expand_kv(kv_nope, k_rot)

    return wrapped


def _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, s_aux, **kwargs):
    fn = module._pdflash_attn_fallback if hasattr(module, "_pdflash_attn_fallback") else None
    if fn is None:
        raise RuntimeError("invariant attention: no fallback attention for this module")
    kw = dict(kwargs)
    if s_aux is not None:
        kw["s_aux"] = s_aux
    return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, sliding_window=sliding_window, **kw)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, _experts_forward)
    AttentionInterface.register(ATTN_IMPL, _attention_forward)


# ---- fused per-row steps (pdflash_kernels.fused): RMSNorm modules, the rotary function, routers -------------------
def _eps_of(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(module, attr, None)
        if isinstance(v, float):
            return v
    return None


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every RMSNorm-like module: a class named *RMSNorm with a 1-D weight and an epsilon."""
    out = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1 and _eps_of(m) is not None:
            out[name] = m
    return out


def rms_norm_variant(module: nn.Module) -> bool | None:
    """Which formula the module computes, told by exact agreement on a probe (plain torch ops, as the module runs them):
    True `weight * y.to(x.dtype)`, False `(weight * y).to(x.dtype)` (y = x * rsqrt(mean(x^2) + eps) in float32), None
    neither (e.g. Gemma's 1 + weight): the module then keeps its own ops."""
    w, eps = module.weight, _eps_of(module)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, w.shape[0], generator=g) * 3).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            got = type(module).forward(module, x)
        except Exception:  # noqa: BLE001 - a module that cannot take a plain [rows, D] input is not ours
            return None
        xf = x.to(torch.float32)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        for cast_first, ref in ((True, w * y.to(x.dtype)), (False, (w * y).to(x.dtype))):
            if isinstance(got, torch.Tensor) and got.dtype == ref.dtype and torch.equal(got, ref):
                return cast_first
    return None


def _fused_norm_forward(module: nn.Module, cast_first: bool, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype not in fused._ROUNDED or not runtime.triton_usable(hidden_states.device):
        return type(module).forward(module, hidden_states)
    CALLS["fused"] += 1
    return fused.rms_norm(hidden_states, module.weight, _eps_of(module), cast_first)


def fused_norm_variant(module: nn.Module) -> bool | None:
    """The `cast_first` variant of an RMSNorm module the installer fused, None if it did not fuse it."""
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, functools.partial) and fwd.func is _fused_norm_forward:
        return fwd.args[1]
    return None


_ROTARY_PATCHES: dict[str, list] = {}  # modeling module name -> [original function, installations using it, contiguous]


def _rotary_probe(model: nn.Module, orig) -> tuple[bool | None, str]:
    """(contiguous, "") when the fused rotary equals `orig` bit for bit on the model's own cos/sin tables (contiguous:
    whether orig's results are, e.g. built by torch.cat), else (None, why not)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inner = getattr(model, "model", None)
    rot = getattr(inner, "rotary_emb", None)
    attn = next((m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "scaling")), None)
    if rot is None or attn is None:
        return None, "no rotary_emb / attention module found"
    p = next(model.parameters())
    hd = int(getattr(attn, "head_dim", 0) or getattr(cfg, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
    hq, hk = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, hq, hd, generator=g).to(device=p.device, dtype=p.dtype).transpose(1, 2)  # as the modules lay it
    k = torch.randn(1, 3, hk, hd, generator=g).to(device=p.device, dtype=p.dtype).transpose(1, 2)
    pos = torch.tensor([[0, 5, 77]], device=p.device)
    try:
        with torch.no_grad():
            cos, sin = rot(q.transpose(1, 2), pos)
            if not fused.rotary_supported(q, k, cos, sin):
                return None, f"cos/sin {tuple(cos.shape)} {cos.dtype}: a layout the fused rotary does not take"
            want = orig(q, k, cos, sin)
            contiguous = all(w.is_contiguous() for w in want)
            got = fused.rotary(q, k, cos, sin, contiguous)
    except Exception as e:  # noqa: BLE001 - any failure means "not ours"
        return None, f"probe failed: {e}"
    if not all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(want, got)):
        return None, "a different formula (the probe's results differ)"
    return contiguous, ""


_ROTARY_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("pdflash_fused_rotary", default=False)


def _patch_rotary(model: nn.Module) -> tuple[str, object | None]:
    """Route the modeling module's `apply_rotary_pos_emb` through pdflash_kernels.fused.rotary when an attention module of
    this model calls it (its forward is wrapped to say so); any other caller (another model of the architecture in
    the process, installed op by op or not at all) gets the original. -> (report, undo)."""
    import sys

    attns = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "scaling")]
    if not attns:
        return "no attention module found", None
    modname = type(attns[0]).__module__
    mod = sys.modules.get(modname)
    current = getattr(mod, "apply_rotary_pos_emb", None)
    if current is None:
        return f"{modname} has no apply_rotary_pos_emb", None
    entry = _ROTARY_PATCHES.get(modname)
    orig = entry[0] if entry else current
    contiguous, why = _rotary_probe(model, orig)
    if contiguous is None:
        return f"transformers ({why})", None
    if entry is None:
        @functools.wraps(orig)
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
            if (_ROTARY_ON.get() and len(args) + len(kwargs) <= 1 and set(kwargs) <= {"unsqueeze_dim"}
                    and runtime.triton_usable(q.device) and fused.rotary_supported(q, k, cos, sin, unsqueeze)):
                CALLS["fused"] += 1
                return fused.rotary(q, k, cos, sin, entry[2])
            return orig(q, k, cos, sin, *args, **kwargs)

        entry = _ROTARY_PATCHES[modname] = [orig, 0, contiguous]
        mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    entry[1] += 1
    for m in attns:
        m.forward = _with_fused_rotary(m.forward)

    def undo():
        for m in attns:
            m.__dict__.pop("forward", None)
        entry[1] -= 1
        if entry[1] == 0:
            mod.apply_rotary_pos_emb = entry[0]
            _ROTARY_PATCHES.pop(modname, None)

    return "triton (q and k in one launch)", undo


def _with_fused_rotary(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        token = _ROTARY_ON.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _ROTARY_ON.reset(token)

    return wrapped


def _route_reference(logits: torch.Tensor, k: int, softmax_first: bool, norm: bool, dtype: torch.dtype):
    if softmax_first:
        v, i = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        if norm:
            v = v / v.sum(dim=-1, keepdim=True)
        return v.to(dtype), i
    v, i = torch.topk(logits, k, dim=-1)
    return torch.softmax(v, dim=1, dtype=v.dtype).to(dtype), i


ROUTE_VARIANTS = ((True, True), (True, False), (False, False))  # (softmax_first, norm): pdflash_kernels.fused.route's


def route_variant(router: nn.Module) -> tuple[bool, bool, torch.dtype] | None:
    """(softmax_first, norm, score dtype) of a router whose forward returns (logits, scores, ids), told by agreement
    with one of pdflash_kernels.fused.route's formulas on a probe (plain torch; the same expert ids, scores within bf16
    rounding), or None. "Softmax over all, top-k, renormalize" (Qwen3, Mixtral) and "top-k, softmax over those"
    (gpt-oss) are the same function and agree on a random probe almost everywhere: between them the router's own
    output on rows where the two round differently decides (`_rounding_probe`). The formula is the router class's:
    probed once per class, shape and dtype, the answer kept for its other layers."""
    w, b = router.weight, getattr(router, "bias", None)
    key = (type(router), tuple(w.shape), w.dtype, str(w.device), int(getattr(router, "top_k", 0)), isinstance(b, torch.Tensor))
    if key not in _ROUTE_VARIANTS_SEEN:
        _ROUTE_VARIANTS_SEEN[key] = _route_variant(router)
    return _ROUTE_VARIANTS_SEEN[key]


_ROUTE_VARIANTS_SEEN: dict = {}


def _probe_router(router: nn.Module, rows: int):
    """(x, the router's own (logits, scores, ids) for x): random probe rows of the weight's dtype put through its
    forward; None when it fails or returns something else."""
    w = router.weight
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(2)).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            out = type(router).forward(router, x)
        except Exception:  # noqa: BLE001
            return None
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    return x, out


def _route_variant(router: nn.Module) -> tuple[bool, bool, torch.dtype] | None:
    w, b = router.weight, getattr(router, "bias", None)
    probe = _probe_router(router, 5)
    if probe is None:
        return None
    x, out = probe
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, w, b if isinstance(b, torch.Tensor) else None)
        if not torch.equal(out[0], logits):
            return None
        found = []
        for softmax_first, norm in ROUTE_VARIANTS:
            v, i = _route_reference(logits, int(router.top_k), softmax_first, norm, out[1].dtype)
            if v.dtype == out[1].dtype and torch.equal(i, out[2]) and torch.allclose(v.float(), out[1].float(), rtol=1e-2, atol=1e-4):
                found.append((softmax_first, norm))
        if len(found) > 1:
            found = _rounding_probe(router, found, out[1].dtype) or found
    return (*found[0], out[1].dtype) if found else None


def _rounding_probe(router: nn.Module, variants: list, score_dtype: torch.dtype) -> list:
    """Of `variants` (formulas that agreed on a random probe), those that give the router's own scores bit for bit on
    logit rows where they round differently from one another. The rows are found by search (random logits of the
    router's dtype: 11-18 of 200,000 rows differ) and put through the router's forward exactly, with a weight that
    picks logit e from input column e and no bias (`torch.func.functional_call`: the router itself is not touched),
    so its logits are the rows themselves. [] when the router cannot be run that way or no row tells them apart."""
    w = router.weight
    e, h = w.shape
    k = int(router.top_k)
    if h < e:
        return []
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(200_000, e, generator=g) * 2).to(device=w.device, dtype=w.dtype)
    refs = [_route_reference(rows, k, sf, norm, score_dtype) for sf, norm in variants]
    same_ids = torch.stack([(i == refs[0][1]).all(-1) for _, i in refs]).all(0)
    differ = torch.stack([(v != refs[0][0]).any(-1) for v, _ in refs]).any(0)
    pick = (same_ids & differ).nonzero()[:, 0][:64]
    if pick.numel() == 0:
        return []
    params = {"weight": torch.eye(e, h, device=w.device, dtype=w.dtype)}  # (the router itself is not touched)
    b = getattr(router, "bias", None)
    if isinstance(b, torch.Tensor):
        params["bias"] = torch.zeros_like(b)
    x = torch.zeros(pick.numel(), h, device=w.device, dtype=w.dtype)
    x[:, :e] = rows[pick]
    with torch.no_grad():
        try:
            logits, scores, ids = torch.func.functional_call(router, params, (x,))
        except Exception:  # noqa: BLE001
            return []
    if not torch.equal(logits.to(rows.dtype), rows[pick]):
        return []
    return [vt for vt, (v, i) in zip(variants, refs) if torch.equal(v[pick], scores) and torch.equal(i[pick], ids)]


@dataclasses.dataclass(frozen=True)
class GroupRoute:
    """DeepSeek-V3's group routing as a router module holds it (`num_group`, `topk_group`, `norm_topk_prob`,
    `routed_scaling_factor`, `e_score_correction_bias`; DeepSeek-V3 / Kimi K2, Nemotron-H, GLM-4.5, GLM-4.7-Flash, dots1,
    EXAONE MoE, Kimi Linear): pdflash_kernels.fused.group_route's parameters."""

    top_k: int
    n_group: int
    topk_group: int
    norm: bool
    scale: float
    score_dtype: torch.dtype


def _group_route_reference(logits: torch.Tensor, bias: torch.Tensor, g: GroupRoute):
    """transformers' formula (DeepseekV3TopkRouter.forward after its linear) in plain torch: (weights, ids)."""
    e = logits.shape[1]
    s = logits.float().sigmoid()
    c = s + bias.float()
    gs = c.view(-1, g.n_group, e // g.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    mask = torch.zeros_like(gs).scatter_(1, torch.topk(gs, g.topk_group, dim=-1)[1], 1)
    c = c.masked_fill(~mask.bool().repeat_interleave(e // g.n_group, dim=1), float("-inf"))
    ids = torch.topk(c, g.top_k, dim=-1)[1]
    w = s.gather(1, ids)
    if g.norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return (w * g.scale).to(g.score_dtype), ids


def _same_routes(w: torch.Tensor, ids: torch.Tensor, w_ref: torch.Tensor, ids_ref: torch.Tensor) -> bool:
    """The same experts a row (in any order: transformers' topk is unsorted) with weights within float32 rounding."""
    a, b = ids.sort(dim=-1), ids_ref.sort(dim=-1)
    return (w.dtype == w_ref.dtype and torch.equal(a.values, b.values)
            and torch.allclose(w.gather(1, a.indices).float(), w_ref.gather(1, b.indices).float(), rtol=1e-4, atol=1e-6))


def group_route_variant(router: nn.Module) -> "GroupRoute | str | None":
    """The router's GroupRoute when its forward returns (logits, weights, ids) that agree with transformers' group
    routing formula on a probe (and, where Triton runs, with the fused kernel itself: a kernel that fails to build or
    disagrees is said, not used); None for a router of another form; probed once per class, shape and dtype."""
    parts = ("e_score_correction_bias", "num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "top_k")
    w = getattr(router, "weight", None)
    if not all(hasattr(router, p) for p in parts) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    key = ("group", type(router), tuple(w.shape), w.dtype, str(w.device), int(router.top_k), int(router.num_group),
           int(router.topk_group), bool(router.norm_topk_prob), float(router.routed_scaling_factor))  # (the parameters
    # GroupRoute takes: a model of the same class with other ones gets its own probe)
    if key not in _ROUTE_VARIANTS_SEEN:
        _ROUTE_VARIANTS_SEEN[key] = _group_route_variant(router)
    return _ROUTE_VARIANTS_SEEN[key]


def _group_route_variant(router: nn.Module) -> "GroupRoute | str | None":
    w, bias = router.weight, router.e_score_correction_bias
    e = w.shape[0]
    if not (isinstance(bias, torch.Tensor) and bias.shape == (e,)) or e % int(router.num_group):
        return None
    probe = _probe_router(router, 6)
    if probe is None:
        return None
    x, out = probe
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.float(), w.float())
        g = GroupRoute(int(router.top_k), int(router.num_group), int(router.topk_group), bool(router.norm_topk_prob),
                       float(router.routed_scaling_factor), out[1].dtype)
        if not torch.allclose(out[0].float(), logits, rtol=1e-4, atol=1e-5) or not _same_routes(
                out[1], out[2], *_group_route_reference(out[0].float(), bias, g)):
            return None
        if runtime.triton_usable(w.device):
            try:
                _, fw, fi = fused.group_route(out[0].float(), bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale,
                                              g.score_dtype)
            except Exception as exc:  # noqa: BLE001 - said in the report, the router keeps its own ops
                return f"the group-routing kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
            if not _same_routes(fw, fi, out[1], out[2]):
                return "the group-routing kernel disagreed with the router on a probe"
    return g


def _fused_group_router_forward(router: nn.Module, g: GroupRoute, hidden_states: torch.Tensor):
    """The router's linear in float32 (its K partials) and group routing in one more launch (pdflash_kernels.fused
    .group_route): 2 launches for transformers' dozen."""
    if not runtime.triton_usable(hidden_states.device):
        return type(router).forward(router, hidden_states)
    w = router.weight
    if w.dtype != torch.float32:  # (transformers < 5.25 keeps it in the model's dtype and casts it every forward)
        key = (w.data_ptr(), w._version)
        got = router.__dict__.get("_pdflash_w32")
        if got is None or got[0] != key:
            got = router.__dict__["_pdflash_w32"] = (key, w.detach().float())
        w = got[1]
    x = hidden_states.reshape(-1, w.shape[1]).float()
    CALLS["fused"] += 1
    return fused.group_route(None, router.e_score_correction_bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale,
                             g.score_dtype, ws=linear.partials(x, w.t()))


#: PDFLASH_GROUP_ROUTE=0: group routers keep transformers' ops (the A/B of the fused group routing; default on)
GROUP_ROUTE = runtime.env_flag("PDFLASH_GROUP_ROUTE", default=True)


def router_variant(router: nn.Module):
    """What fused routing a router takes: ("softmax", route_variant) or ("group", GroupRoute), a reason it cannot
    (a string), or None (a formula the kernels do not know)."""
    v = route_variant(router)
    if v is not None:
        return ("softmax", v)
    g = group_route_variant(router)
    if isinstance(g, GroupRoute) and not GROUP_ROUTE:
        return "PDFLASH_GROUP_ROUTE=0"
    return ("group", g) if isinstance(g, GroupRoute) else g


def _fused_any_router_forward(router: nn.Module, variant: tuple, hidden_states: torch.Tensor):
    kind, v = variant
    if kind == "group":
        return _fused_group_router_forward(router, v, hidden_states)
    return _fused_router_forward(router, v, hidden_states)


def _fused_router_forward(router: nn.Module, variant: tuple, hidden_states: torch.Tensor):
    if not runtime.triton_usable(hidden_states.device):
        return type(router).forward(router, hidden_states)
    w, b = router.weight, getattr(router, "bias", None)
    b = b if isinstance(b, torch.Tensor) else None
    x = hidden_states.reshape(-1, w.shape[1])
    if x.dtype != w.dtype:  # a router kept in float32 (ERNIE 4.5, DeepSeek-V2): its linear runs in the weight's dtype,
        x = x.to(w.dtype)   # as its own forward casts (the variant was probed on inputs of that dtype)
    CALLS["fused"] += 1
    if x.dtype == w.dtype and (b is None or b.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        # the router linear's K partials summed by the routing kernel itself: the bits of linear + route, one launch fewer
        return fused.route_partials(linear.partials(x, w.t()), None if b is None else b.to(x.dtype), x.dtype,
                                    int(router.top_k), *variant)
    logits = torch.nn.functional.linear(x, w, b)
    scores, ids = fused.route(logits, int(router.top_k), *variant)
    return logits, scores, ids


def _fuse_each(modules: list, variant_of, forward, unit: str, undo: list) -> str:
    """Give each module `forward` bound to its probed variant (modules without one keep their own); -> the report line."""
    done, skipped = 0, set()
    for m in modules:
        variant = variant_of(m)
        if variant is None or isinstance(variant, str):
            skipped.add(f"{type(m).__name__} ({variant or 'an unrecognised formula'})")
            continue
        m.forward = functools.partial(forward, m, variant)
        undo.append(lambda m=m: m.__dict__.pop("forward", None))
        done += 1
    return (f"triton ({done} of {len(modules)} {unit})" if done else "transformers") + (
        f"; not fused: {', '.join(sorted(skipped))}" if skipped else "")


def install_fused(model: nn.Module) -> tuple[dict[str, str], list]:
    """Put pdflash_kernels.fused under the model's RMSNorms, rotary function and routers, each after its probe.
    -> (report: part -> how it runs, undo callables)."""
    report, undo = {}, []
    norms = list(norm_modules(model).values())
    if norms:
        report["rms_norm"] = _fuse_each(norms, rms_norm_variant, _fused_norm_forward, "modules", undo)
    how, u = _patch_rotary(model)
    report["rotary"] = how
    if u is not None:
        undo.append(u)
    found = list(routers(model).values())
    if found:
        report["router"] = _fuse_each(found, router_variant, _fused_any_router_forward, "routers", undo)
    return report, undo


# ---- install / uninstall ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Installation:
    model: nn.Module
    experts: dict[int, str]  # layer -> "triton bf16" / "triton mxfp4" [(pair words)] / why not
    attention: str
    dense: str
    uncovered: dict[str, int]  # risky aten ops the probe forward still ran on torch's kernels
    experts_format: str
    _undo: list = dataclasses.field(default_factory=list, repr=False)
    fused: dict[str, str] = dataclasses.field(default_factory=dict)  # rms_norm / rotary / router -> how it runs
    linear_attention: str = ""  # how a hybrid's linear-attention layers run ("" for a model without them)

    @property
    def exact(self) -> bool:
        """Every part of a forward runs on batch-invariant kernels."""
        return (
            all(v.startswith("triton") for v in self.experts.values())
            and self.attention.startswith("triton")
            and self.dense.startswith("triton")
            and not self.uncovered
        )

    def summary(self) -> dict:
        kinds = sorted(set(self.experts.values()))
        return {
            "batch_invariant": self.exact,
            "experts": kinds[0] if len(kinds) == 1 else "; ".join(f"{k}: layers {[l for l, v in self.experts.items() if v == k]}" for k in kinds),
            "attention": self.attention,
            "dense": self.dense,
            "uncovered_ops": dict(self.uncovered),
            "fused": dict(self.fused),
            **({"linear_attention": self.linear_attention} if self.linear_attention else {}),
        }

    def uninstall(self) -> None:
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()


def _set_attn_impl(model: nn.Module, name: str) -> str:
    prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
    try:
        model.set_attn_implementation(name)
    except Exception:  # noqa: BLE001 - older transformers: set the config attribute directly
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = name
    return prev


def _frag_tiles(w) -> str:
    """The tiles the fragment GEMMs run these experts with (model info names them; PDFLASH_FP4_TILES's are marked, and
    with PDFLASH_FP4_SIZE_TILES each call-size class's)."""
    from pdflash_kernels import fragments

    t1, t2 = fragments.frag_config(w.hidden, w.intermediate)
    most = fragments.persist_pairs(w.hidden, w.intermediate)
    persist = (f"; persistent GEMMs on routed calls of up to {most} pairs, {fragments.PERSIST_PER_SM} programs a "
               "multiprocessor" if most and fragments.PERSIST_PER_SM else "")
    if fragments.FRAG_TILES:
        return f"tiles {t1} / {t2} from PDFLASH_FP4_TILES{persist}"
    classes = fragments.size_classes(w.hidden, w.intermediate)
    if not classes:
        return f"tiles {t1} / {t2}{persist}"
    return "tiles by call size: " + ", ".join(
        f"{'more pairs' if most is None else f'up to {most} pairs'} {a} / {b}" for most, a, b in classes) + persist


def install(model: nn.Module, experts_format: str = "native", probe: bool = True, fuse: bool = True) -> Installation:
    """Install the kernels under `model` (on CUDA; on CPU only under TRITON_INTERPRET, for tests). `fuse`: also the
    fused RMSNorm / rotary / routing kernels (pdflash_kernels.fused; off only to compare against the op-by-op path)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if runtime.triton is None:
        raise RuntimeError("triton is not installed: the batch-invariant kernels need it")
    _register()
    undo: list = []
    report: dict[int, str] = {}
    prev_experts = getattr(model.config, "_experts_implementation", None) or "eager"
    offloaded = any(getattr(m, "_pdflash_offload", None) is not None for m in experts_modules(model).values())
    if prev_experts == EXPERTS_IMPL and not offloaded:
        raise RuntimeError("the kernels are already installed on this model")
    if offloaded:
        prev_experts = "eager"
    for layer, module in experts_modules(model).items():
        module._pdflash_fallback = ALL_EXPERTS_FUNCTIONS.get_interface(prev_experts, type(module).forward.__wrapped__)
        module._pdflash_num_experts = num_experts_of(module)
        if getattr(module, "_pdflash_offload", None) is not None:
            store = getattr(module._pdflash_offload[0], "store", None)  # (cache, layer)
            fmt = {"pair_words": ", pair words", "fragments": ", fragment words"}.get(getattr(store, "format", ""), "")
            report[layer] = f"triton mxfp4 (offloaded: expert cache{fmt})"
            continue
        w = expert_weights(module, experts_format)
        if isinstance(w, str):
            report[layer] = f"transformers {prev_experts} ({w})"
            continue
        module._pdflash_weights = w
        report[layer] = (f"triton {'mxfp4' if w.fp4 else str(w.w1.dtype).removeprefix('torch.')}"
                         + (" (pair words)" if w.fp4 and w.pair_words else "")
                         + (f" (fragment words, {_frag_tiles(w)})" if getattr(w, "fragments", False) else ""))
        if w.fp4:
            _drop_native(module, w)
    if report:
        model.set_experts_implementation(EXPERTS_IMPL)
        undo.append(lambda: model.set_experts_implementation(prev_experts))

    prev_attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    fallback = ALL_ATTENTION_FUNCTIONS[prev_attn] if prev_attn in ALL_ATTENTION_FUNCTIONS else ALL_ATTENTION_FUNCTIONS["sdpa"]
    for m in model.modules():
        if hasattr(m, "num_key_value_groups") and hasattr(m, "scaling"):
            m._pdflash_attn_fallback = fallback
        if mla.is_latent_attention(m):
            m.expand_kv = _latent_expand_kv(m.expand_kv)
            undo.append(functools.partial(m.__dict__.pop, "expand_kv", None))
    linear_layers = _install_linear_attention(model, undo)
    _set_attn_impl(model, ATTN_IMPL)
    undo.append(lambda: _set_attn_impl(model, prev_attn))

    orig_forward = model.forward

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        with InvariantMode():
            return orig_forward(*args, **kwargs)

    fused_report, fused_undo = install_fused(model) if fuse else ({}, [])
    undo.extend(fused_undo)
    model.forward = forward
    undo.append(lambda: model.__dict__.pop("forward", None))
    for module in experts_modules(model).values():
        undo.append(lambda module=module: _forget(module))

    inst = Installation(model, report, f"triton ({ATTN_IMPL}, absolute-position KV chunks)", "triton (linear/matmul/mm/addmm/bmm, sum/mean, softmax)", {}, experts_format, undo, fused_report)
    if linear_layers:
        inst.linear_attention = ("triton gated delta rule / Mamba and Mamba-2 scans / short convolution, token by token "
                                 f"({len(linear_layers)} layers: pdflash_kernels.gdn; rejected tokens rolled back by "
                                 "replaying the accepted ones)")
    if probe:
        before = dict(CALLS)
        inst.uncovered = probe_uncovered(model, orig_forward)
        if CALLS["attention"] == before["attention"]:
            inst.attention = "not reached by the probe forward (the model does not call transformers' attention interface)"
        if any(v.startswith("triton") for v in report.values()) and CALLS["experts"] == before["experts"]:
            inst.experts = {layer: "not reached by the probe forward" for layer in report}
    return inst


def _install_linear_attention(model: nn.Module, undo: list) -> list[int]:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5), Kimi Delta Attention layers (Kimi Linear), Mamba-2 mixers
    (Granite-4.0-H, Nemotron-H), Mamba v1 mixers (Jamba) and LFM2's short convolutions onto pdflash_kernels.gdn's forwards (`gdn.layer_forward`), whose state lives on the session's
    cache layer and rolls back itself; the layers' indices. Other linear-attention / state-space layers keep
    transformers' forward (the probe lists their ops as uncovered, and the model is reported not batch-invariant)."""
    from pdflash_kernels import gdn

    layers = []
    for m in model.modules():
        fwd = gdn.layer_forward(m)
        if fwd is not None:
            m.forward = functools.partial(fwd, m)
            undo.append(functools.partial(m.__dict__.pop, "forward", None))
            layers.append(int(m.layer_idx))
    return layers


def _first_projection(module: nn.Module) -> tuple[str, str]:
    """The names of an experts module's first projection and its bias: gate_up_proj (gate and up rows), or up_proj on
    up-only experts (transformers' has_gate=False: Nemotron-H)."""
    return ("gate_up_proj", "gate_up_proj_bias") if getattr(module, "has_gate", True) else ("up_proj", "up_proj_bias")


def _drop_native(module: nn.Module, w: ExpertWeights) -> None:
    """MXFP4 resident: free the bf16 experts; the packed tensors become the module's buffers (so the byte map
    and `.to()` see them)."""
    for name in (_first_projection(module)[0], "down_proj"):
        p = getattr(module, name)
        setattr(module, name, nn.Parameter(torch.empty(p.shape[0], 0, dtype=p.dtype, device=p.device), requires_grad=False))
    module.register_buffer("pdflash_w1_blocks", w.w1)
    module.register_buffer("pdflash_w1_scales", w.s1)
    module.register_buffer("pdflash_w2_blocks", w.w2)
    module.register_buffer("pdflash_w2_scales", w.s2)


def set_float_experts(module: nn.Module, w: ExpertWeights, dtype: torch.dtype, biases: bool = False) -> None:
    """Give an experts module float weights of `dtype` dequantized from MXFP4 ExpertWeights, in the module's own layout
    (contiguous, transposed where the module stores [E, in, out]; w1 into gate_up_proj, or up_proj on up-only experts);
    `biases`: its biases become w's (the bf16 the kernels read) cast to `dtype`. Its own forward then computes with
    exactly the weights the MXFP4 kernels read."""
    first, first_bias = _first_projection(module)
    if w.gated != getattr(module, "has_gate", True):
        raise ValueError(f"{'gated' if w.gated else 'up-only'} MXFP4 experts cannot become the float weights of "
                         f"{type(module).__name__} ({first})")
    w1 = mxfp4.dequantize(mxfp4.nibble_blocks(w.w1, w.pair_words), w.s1, dtype)
    w2 = mxfp4.dequantize(mxfp4.nibble_blocks(w.w2, w.pair_words), w.s2, dtype)
    if getattr(module, "is_transposed", False):
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    setattr(module, first, nn.Parameter(w1, requires_grad=False))
    module.down_proj = nn.Parameter(w2, requires_grad=False)
    if biases:
        for name, b in ((first_bias, w.b1), ("down_proj_bias", w.b2)):
            if b is not None and isinstance(getattr(module, name, None), torch.Tensor):
                setattr(module, name, nn.Parameter(b.to(dtype), requires_grad=False))


def _forget(module: nn.Module) -> None:
    w = module.__dict__.pop("_pdflash_weights", None)
    if getattr(w, "fragments", False):
        w = w.to_weights()
    if w is not None and w.fp4:  # give the module float weights back (dequantized: MXFP4 is lossy)
        set_float_experts(module, w, module.down_proj.dtype)
        for name in ("pdflash_w1_blocks", "pdflash_w1_scales", "pdflash_w2_blocks", "pdflash_w2_scales"):
            module._buffers.pop(name, None)


def probe_uncovered(model: nn.Module, forward) -> dict[str, int]:
    """Run 3 + 2 + 1 tokens through the model under the mode and list risky ops left on torch's kernels."""
    from transformers import DynamicCache

    rec = Recorder()
    dev = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3]], device=dev)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {cache_kwarg(model): cache}
        with InvariantMode(rec):
            forward(input_ids=ids, use_cache=True, **kw)
            forward(input_ids=torch.tensor([[4, 5]], device=dev), use_cache=True, **kw)
            forward(input_ids=torch.tensor([[6]], device=dev), use_cache=True, **kw)
    return dict(rec.uncovered)
