"""A stack of pre-norm decoder layers run with each residual add fused into the RMSNorm that follows it.

transformers' Llama-family decoder layers (Qwen3-MoE, Mixtral, gpt-oss, ...) all compute

    h = h + self_attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h))

so between two layers the residual add and the next norm are two launches over the same rows. `PreNormChain` runs
the same modules in the same order but calls `pdflash_kernels.fused.add_rms_norm` for "add, then norm" (the next layer's
input norm, or the model's final norm after the last layer): the same bits, 2 launches fewer per layer. It is used
only when a probe has traced one real layer's forward and seen exactly that dataflow (which parts it calls, in which
order, on which tensors), has run the chain's own step on the same input with keys already in the cache and got the
layer's output bit for bit, and every norm involved runs on the fused RMSNorm kernel; otherwise the runner calls
the layers as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from pdflash_kernels import fused, linear
from pdflash_kernels.installer import _eps_of, fused_norm_variant

_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
PROBE_PAST = 5  # keys in the probe's cache before its 3 rows: a step that did not pass the cache on would differ


class _ProbeCache:
    """The probe's cache: PROBE_PAST random keys/values (seeded) before the block's own."""

    def update(self, key, value, layer_idx, *args, **kwargs):
        g = torch.Generator().manual_seed(4)
        shape = (*key.shape[:2], PROBE_PAST)
        pk = torch.randn(shape + key.shape[3:], generator=g).to(device=key.device, dtype=key.dtype)
        pv = torch.randn(shape + value.shape[3:], generator=g).to(device=value.device, dtype=value.dtype)  # (MLA: widths differ)
        return torch.cat([pk, key], 2), torch.cat([pv, value], 2)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _norm(module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its norm) in one launch, or (x, norm(x)) without a residual."""
    cast_first, eps = fused_norm_variant(module), _eps_of(module)
    if isinstance(x, linear.Partials):  # a fused attention's output projection, not yet summed
        return fused.add_rms_norm_partials(x.ws, x.bias, residual, module.weight, eps, cast_first)
    if residual is None:
        return x, fused.rms_norm(x, module.weight, eps, cast_first)
    return fused.add_rms_norm(x, residual, module.weight, eps, cast_first)


def _step(layer: nn.Module, h: torch.Tensor, x: torch.Tensor, kwargs: dict, after: nn.Module, attn=None):
    """One layer from h (its input) and x = its input norm: -> (the layer's output, `after`'s norm of it). `attn`:
    the layer's attention in a fused form (verifier_svc.fused_attention), else the module runs."""
    a = attn(x, kwargs) if attn is not None else _first(layer.self_attn(hidden_states=x, **kwargs))
    h, x = _norm(layer.post_attention_layernorm, a, h)
    m = _first(layer.mlp(x))
    return _norm(after, m, h)


def _trace(layer: nn.Module, h: torch.Tensor, kwargs: dict) -> tuple[list, torch.Tensor]:
    """layer(h, **kwargs), recording (part, input, output) for each of _PARTS it calls."""
    calls, saved = [], {}
    for name in _PARTS:
        m = getattr(layer, name)
        saved[name] = m.__dict__.get("forward")

        def rec(*args, _name=name, _inner=m.forward, **kw):
            out = _inner(*args, **kw)
            calls.append((_name, args[0] if args else kw.get("hidden_states"), out))
            return out

        m.forward = rec
    try:
        out = layer(h, **kwargs)
    finally:
        for name in _PARTS:
            m = getattr(layer, name)
            if saved[name] is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = saved[name]
    return calls, _first(out)


class PreNormChain:
    def __init__(self, layers, final_norm: nn.Module):
        self.layers = list(layers)
        self.final_norm = final_norm
        self.attn: list = [None] * len(self.layers)  # per layer: a probed fused attention (set by the runner) or None

    @classmethod
    def probe(cls, model: nn.Module, layers, final_norm: nn.Module, layer_kwargs) -> "PreNormChain | str":
        """The chain, or why the layers must run as they are. `layer_kwargs(h, positions, cache)`: what the runner
        passes a layer besides h (positions, rotary tables, the cache under its keyword). Call inside the runner's
        InvariantMode (the kernels the chain will run with)."""
        for i, layer in enumerate(layers):
            missing = [p for p in _PARTS if not isinstance(getattr(layer, p, None), nn.Module)]
            if missing:
                return f"layer {i} has no {', '.join(missing)}"
            for p in ("input_layernorm", "post_attention_layernorm"):
                if fused_norm_variant(getattr(layer, p)) is None:
                    return f"layer {i}'s {p} does not run on the fused RMSNorm"
        if fused_norm_variant(final_norm) is None:
            return "the final norm does not run on the fused RMSNorm"
        layer = layers[0]
        p = next(model.parameters())
        g = torch.Generator().manual_seed(3)
        h = torch.randn(1, 3, layer.input_layernorm.weight.shape[0], generator=g).to(device=p.device, dtype=p.dtype)
        pos = torch.arange(PROBE_PAST, PROBE_PAST + 3, device=p.device).unsqueeze(0)
        try:
            with torch.no_grad():
                calls, out = _trace(layer, h, layer_kwargs(h, pos, _ProbeCache()))
                if [c[0] for c in calls] != list(_PARTS):
                    return f"layer 0 calls {[c[0] for c in calls]}, not {list(_PARTS)}"
                (_, x0, n0), (_, a_in, a_out), (_, x1, n1), (_, m_in, m_out) = calls
                mid = h + _first(a_out)
                if not (x0 is h and a_in is n0 and torch.equal(x1, mid) and m_in is n1 and torch.equal(out, mid + _first(m_out))):
                    return "layer 0's dataflow is not h + attn(norm(h)), then + mlp(norm(.))"
                _, x = _norm(layer.input_layernorm, h, None)
                mine, _ = _step(layer, h, x, layer_kwargs(h, pos, _ProbeCache()), final_norm)
        except Exception as e:  # noqa: BLE001 - a layer the probe cannot drive is not one the chain may replace
            return f"probe forward failed: {type(e).__name__}: {e}"
        if not torch.equal(mine, out):
            return "the chain's step does not give layer 0's output bit for bit"
        return cls(layers, final_norm)

    def run(self, h: torch.Tensor, kwargs: dict, feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, list]:
        """h (the embeddings) through every layer and the final norm -> (normed output, [(layer, its output)] for
        `feature_layers`). `kwargs`: what each layer's self_attn gets besides its input."""
        feats = []
        h, x = _norm(self.layers[0].input_layernorm, h, None)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.final_norm
            h, x = _step(layer, h, x, kwargs, nxt, self.attn[i])
            if i in feature_layers:
                feats.append((i, h))
        return x, feats
