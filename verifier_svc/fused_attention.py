"""A decoder layer's attention with its input side fused (pdflash_kernels.qkv): merged q/k/v projection, one epilogue
(per-head norms, rotary, the paged K/V write), the paged attention kernel, the output projection.

The module's own forward, on the batch-invariant kernels, runs the three projections (two launches each), the two
per-head norms, the rotary and the KV write: 10 launches before the attention kernel. `FusedAttention` runs 2. After
the attention, the output projection's K partials are returned unsummed: the chain's residual add + norm adds them
(`pdflash_kernels.fused.add_rms_norm_partials`), one launch fewer again. It
reads the module's parts (projections, norms, scaling, sliding window, sinks) and is used only when `probe` has run
the module and the fused form on the same input, through the runner's own paged KV pool (a past of 5 positions,
then 3 more), and got the same output and the same keys and values in the pool, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from pdflash_kernels import attention as attn_kernels
from pdflash_kernels import linear, qkv
from pdflash_kernels.installer import ForwardContext, _eps_of, _forward_ctx, forward_context, fused_norm_variant

PROBE_ROWS = (5, 3)  # the probe's two steps: a past, then a block that attends to it


class FusedAttention:
    def __init__(self, module: nn.Module, cache_kw: str, parts, b, hq: int, hk: int, d: int, norms, sliding_window):
        self.module, self.cache_kw = module, cache_kw
        self.parts, self.b = parts, b  # [(weight, its linear config)]: q|k|v merged (pdflash_kernels.qkv.plan)
        self.hq, self.hk, self.d, self.norms = hq, hk, d, norms
        self.sliding_window = sliding_window
        self.sinks = getattr(module, "sinks", None)

    @classmethod
    def build(cls, module: nn.Module, config, cache_kw: str) -> "FusedAttention | str":
        """The fused form of `module` (its weights merged in place: the projections become views of one tensor), or
        why its structure does not allow one. Not yet probed."""
        parts = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not all(isinstance(p, nn.Linear) for p in parts):
            return "no q_proj/k_proj/v_proj/o_proj linears"
        q, k, v, _ = parts
        d = int(getattr(module, "head_dim", 0) or 0)
        if not d or q.out_features % d or k.out_features % d or k.out_features != v.out_features:
            return f"projections {q.out_features}/{k.out_features}/{v.out_features} are not whole heads of {d}"
        if len({q.weight.dtype, k.weight.dtype, v.weight.dtype}) != 1 or len({q.in_features, k.in_features, v.in_features}) != 1:
            return "the projections differ in dtype or input size"
        if len({isinstance(getattr(m, "bias", None), torch.Tensor) for m in (q, k, v)}) != 1:
            return "some projections have a bias, some not"
        qn, kn = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        norms = None
        if qn is not None or kn is not None:
            variants = {fused_norm_variant(qn) if qn is not None else None, fused_norm_variant(kn) if kn is not None else None}
            if None in variants or len(variants) != 1 or qn.weight.shape[0] != d or kn.weight.shape[0] != d:
                return "q_norm/k_norm are not both per-head RMSNorms on the fused kernel"
            norms = (qn.weight, kn.weight, _eps_of(qn), _eps_of(kn), variants.pop())
        sizes = [q.out_features, k.out_features, v.out_features]
        groups = qkv.plan(sizes, q.in_features, q.weight.element_size())
        sliding = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window", None)
        ws, b = qkv.merged_weight([q, k, v], [g for g, _ in groups])
        parts = [(w, cfg) for w, (_, cfg) in zip(ws, groups)]
        for (w, cfg), (g, _) in zip(parts, groups):  # the projections, now views of w, run with the merged config when
            linear.share_config(w, cfg, owners=[(q, k, v)[i] for i in g])  # called alone too, while they live
        return cls(module, cache_kw, parts, b, q.out_features // d, k.out_features // d, d, norms, sliding)

    def __call__(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """What `module(hidden_states=x, **kwargs)[0]` returns, as the output projection's K partials (its sum is left
        to the residual add + norm after it: pdflash_kernels.fused.add_rms_norm_partials), on the runner's paged cache
        (kwargs as the runner passes a layer: positions, cos/sin, the PagedLayerCache under its keyword), inside its
        forward context."""
        cache = kwargs[self.cache_kw]
        kp, vp = cache.pool.k[self.module.layer_idx], cache.pool.v[self.module.layer_idx]
        cos, sin = kwargs["position_embeddings"]
        pos = kwargs["position_ids"]
        t = x.shape[1]
        q = qkv.qkv_rope_write(x.reshape(t, -1), self.parts, self.b, self.hq, self.hk, self.d, self.norms,
                               cos, sin, kp, vp, cache.pages, cache.offsets)
        ctx = _forward_ctx.get()
        out = attn_kernels.paged_attention(q, kp, vp, ctx.page_table, pos, self.module.scaling, self.sliding_window,
                                           self.sinks, seq_starts=ctx.seq_starts, max_rows=ctx.max_rows)
        o = self.module.o_proj
        ws = linear.partials(out.reshape(t, -1), o.weight.t())
        bias = o.bias.to(x.dtype) if isinstance(getattr(o, "bias", None), torch.Tensor) else None
        return linear.Partials(ws, bias, (1, t, o.out_features), x.dtype)


def probe(fused: FusedAttention, pool, layer_kwargs, make_cache) -> str | None:
    """None when `fused` gives its module's output and pool writes bit for bit on one page of `pool` (borrowed, zeroed
    and given back), else why not. `layer_kwargs(h, pos, cache)` and `make_cache(pool, pages, offsets)`: the
    runner's. Call inside the runner's InvariantMode."""
    module = fused.module
    li = module.layer_idx
    p = fused.parts[0][0]
    g = torch.Generator().manual_seed(5)
    n = sum(PROBE_ROWS)
    x = torch.randn(1, n, p.shape[1], generator=g).to(device=p.device, dtype=p.dtype)
    page = pool.alloc(1)[0]
    table = torch.full((1, 1), page, dtype=torch.int32, device=p.device)
    results = []
    try:
        for run in ("module", "fused"):
            pool.k[li][page].zero_()
            pool.v[li][page].zero_()
            outs, start = [], 0
            for rows in PROBE_ROWS:
                pos = torch.arange(start, start + rows, device=p.device).unsqueeze(0)
                cache = make_cache(pool, torch.full((rows,), page, dtype=torch.long, device=p.device), pos[0].clone())
                kwargs = layer_kwargs(x[:, start : start + rows], pos, cache)
                with forward_context(ForwardContext(page_table=table)):
                    if run == "module":
                        out = module(hidden_states=x[:, start : start + rows], **kwargs)
                        outs.append(out[0] if isinstance(out, tuple) else out)
                    else:
                        outs.append(fused(x[:, start : start + rows], kwargs).value())
                start += rows
            results.append((outs, pool.k[li][page].clone(), pool.v[li][page].clone()))
    except Exception as e:  # noqa: BLE001 - a module the fused form cannot drive keeps its own forward
        return f"probe failed: {type(e).__name__}: {e}"
    finally:
        pool.k[li][page].zero_()
        pool.v[li][page].zero_()
        pool.release([page])
    (mo, mk, mv), (fo, fk, fv) = results
    if not torch.equal(mk, fk) or not torch.equal(mv, fv):
        return "the fused form writes other keys/values than the module"
    if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(mo, fo)):
        return "the fused form's output differs from the module's"
    return None
