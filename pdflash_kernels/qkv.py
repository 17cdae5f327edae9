"""An attention block's input side in two launches: the merged q/k/v projection, then one epilogue kernel.

transformers' attention modules (Qwen3-MoE, gpt-oss, Llama-like) compute, on the layer's normed input x,

    q = q_norm?(q_proj(x)), k = k_norm?(k_proj(x)), v = v_proj(x)     (each [T, heads, D]; the norms per head)
    q, k = apply_rotary_pos_emb(q, k, cos, sin);  cache.update(k, v)

which on the batch-invariant kernels is 3 projections of 2 launches each (the split-K partials, their sum), 2 norms,
the rotary and the paged KV write: 10 launches, most of them tiny. Here:

1. `pdflash_kernels.linear.partials` of x against the three weights stacked (their rows one tensor, `merged_weight`), with
   the merged projection's tiles and K split (`merge_config`: linear_config of the merged width), which the three
   projections then take when called one by one too (`pdflash_kernels.linear.share_config` on the merged tensor, whose views
   their weights become), so every output column is the same sum in the same order either way. (Before stop 33 each
   projection kept its own config and only those that split K alike merged: Mixtral-8x7B's q ran apart from k|v, and
   with the K split rule 1 Qwen3-30B-A3B's and gpt-oss-20b's would have too. `qkv_rope_write` still takes two parts.)
2. `qkv_rope_write`: one program per (token, head) of q, k and v adds the K partials in split order and the bias
   (the bits the projection would store), applies the per-head RMSNorm (`pdflash_kernels.fused._rms_norm_kernel`'s
   arithmetic), the rotary (`pdflash_kernels.fused._rotary_kernel`'s), and stores q, and k and v into the layer's page pools
   at the block's slots. (Under Triton's CPU interpreter a program takes every head of its token instead, as the rows
   of one tile: `heads_per_program`, the same values.)

Every value is rounded where the op-by-op path rounds it; `verifier_svc.attention` uses this only after a probe got
the module's own output and pool contents bit for bit.
"""

from __future__ import annotations

import os

import torch

from pdflash_kernels import linear, runtime
from pdflash_kernels.fused import _ROUNDED, LAUNCH_OPTIONS, _inv_rms, _normed, _round
from pdflash_kernels.reduce import _block

triton, tl = runtime.triton, runtime.tl


def plan(n_parts: list[int], k: int, esize: int) -> list[tuple[tuple[int, ...], linear.LinearConfig]]:
    """The q, k, v projections (out sizes n_parts) as linears, each group with its config: all three as one, with the
    merged projection's config (the parts take it too: `linear.share_config`)."""
    return [((0, 1, 2), merge_config(n_parts, k, esize))]


def merge_config(n_parts: list[int], k: int, esize: int) -> linear.LinearConfig:
    """The merged projection's config: linear_config of the parts' total width (tiles and K split by (N, K) only)."""
    return linear.linear_config(sum(n_parts), k, esize)


if triton is not None:

    @triton.jit
    def _value(ws_a, ws_b, bias_ptr, t, j, i, ok, M, HA: tl.constexpr, HT: tl.constexpr, D: tl.constexpr,
               SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, HAS_BIAS: tl.constexpr, XROUND: tl.constexpr,
               EMULATE: tl.constexpr):
        """Head j's projected values at i: its linear's partials summed (heads < HA from ws_a, the rest from ws_b),
        + bias (one vector over all heads), rounded to the activations' dtype."""
        if j < HA:
            x = linear.sum_partials(ws_a, t, j * D + i, ok, M, HA * D, SPLIT_A)
        else:
            x = linear.sum_partials(ws_b, t, (j - HA) * D + i, ok, M, (HT - HA) * D, SPLIT_B)
        if HAS_BIAS:
            x += tl.load(bias_ptr + j * D + i, mask=ok, other=0.0).to(tl.float32)
        return _round(x, XROUND, EMULATE)

    @triton.jit
    def _head_norm(x, p, w_ptr, i, ip, ok, eps, scale, BLOCK: tl.constexpr, CAST_FIRST: tl.constexpr,
                   XROUND: tl.constexpr, OROUND: tl.constexpr, EMULATE: tl.constexpr):
        """RMSNorm of one head's row x (and of its partner elements p, by the same row scale): _rms_norm_kernel's
        one-chunk steps, through the same helpers."""
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        acc += x * x
        inv = _inv_rms(acc, scale, eps)
        w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + ip, mask=ok, other=0.0).to(tl.float32)
        return (_normed(x, w, inv, CAST_FIRST, XROUND, OROUND, EMULATE),
                _normed(p, wp, inv, CAST_FIRST, XROUND, OROUND, EMULATE))

    @triton.jit
    def _qkv_rope_kernel(ws_a, ws_b, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, kp_ptr, vp_ptr, pages_ptr, offs_ptr,
                         kps_p, kps_h, kps_s, vps_p, vps_h, vps_s, sc_t, sc_d, M, q_eps, k_eps, scale,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HA: tl.constexpr,
                         SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, CAST_FIRST: tl.constexpr, XROUND: tl.constexpr,
                         NROUND: tl.constexpr, ROUND: tl.constexpr, HALF_TABLE: tl.constexpr, BLOCK: tl.constexpr,
                         EMULATE: tl.constexpr, HB: tl.constexpr = 1):
        """HB: heads a program (1: one program per (token, head), the GPU's form; > 1, a power of two: HB heads as the rows
        of one tile, `_qkv_rope_heads`, the CPU interpreter's form, whose cost grows with the programs it runs)."""
        runtime.pdl_begin()
        if HB > 1:
            _qkv_rope_heads(ws_a, ws_b, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, kp_ptr, vp_ptr, pages_ptr,
                            offs_ptr, kps_p, kps_h, kps_s, vps_p, vps_h, vps_s, sc_t, sc_d, M, q_eps, k_eps, scale, HQ, HK, D,
                            HA, SPLIT_A, SPLIT_B, HAS_BIAS, NORM, CAST_FIRST, XROUND, NROUND, ROUND, HALF_TABLE, BLOCK,
                            EMULATE, HB)
            return
        pid = tl.program_id(0)
        t = pid // (HQ + 2 * HK)
        j = pid % (HQ + 2 * HK)
        half = D // 2
        i = tl.arange(0, BLOCK)
        ok = i < D
        x = _value(ws_a, ws_b, bias_ptr, t, j, i, ok, M, HA, HQ + 2 * HK, D, SPLIT_A, SPLIT_B, HAS_BIAS, XROUND, EMULATE)
        page = tl.load(pages_ptr + t).to(tl.int64)
        off = tl.load(offs_ptr + t).to(tl.int64)
        if j < HQ + HK:  # q or k: norm, rotary
            ip = tl.where(i < half, i + half, i - half)
            p = _value(ws_a, ws_b, bias_ptr, t, j, ip, ok, M, HA, HQ + 2 * HK, D, SPLIT_A, SPLIT_B, HAS_BIAS, XROUND,
                       EMULATE)
            if NORM:
                if j < HQ:
                    x, p = _head_norm(x, p, qn_ptr, i, ip, ok, q_eps, scale, BLOCK, CAST_FIRST, XROUND, NROUND, EMULATE)
                else:
                    x, p = _head_norm(x, p, kn_ptr, i, ip, ok, k_eps, scale, BLOCK, CAST_FIRST, XROUND, NROUND, EMULATE)
            sign = tl.where(i < half, -1.0, 1.0)
            if HALF_TABLE:
                ci = i % half
            else:
                ci = i
            c = tl.load(cos_ptr + t * sc_t + ci * sc_d, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * sc_t + ci * sc_d, mask=ok, other=0.0).to(tl.float32)
            y = _round(_round(x * c, ROUND, EMULATE) + _round(sign * p * s, ROUND, EMULATE), ROUND, EMULATE)
            if j < HQ:
                tl.store(q_ptr + (t * HQ + j).to(tl.int64) * D + i, y.to(q_ptr.dtype.element_ty), mask=ok)
            else:
                h = (j - HQ).to(tl.int64)
                tl.store(kp_ptr + page * kps_p + h * kps_h + off * kps_s + i, y.to(kp_ptr.dtype.element_ty), mask=ok)
        else:  # v: the projection's value as it is
            h = (j - HQ - HK).to(tl.int64)
            tl.store(vp_ptr + page * vps_p + h * vps_h + off * vps_s + i, x.to(vp_ptr.dtype.element_ty), mask=ok)


    @triton.jit
    def _qkv_rope_heads(ws_a, ws_b, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, kp_ptr, vp_ptr, pages_ptr, offs_ptr,
                        kps_p, kps_h, kps_s, vps_p, vps_h, vps_s, sc_t, sc_d, M, q_eps, k_eps, scale,
                        HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HA: tl.constexpr,
                        SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                        CAST_FIRST: tl.constexpr, XROUND: tl.constexpr, NROUND: tl.constexpr, ROUND: tl.constexpr,
                        HALF_TABLE: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr, HB: tl.constexpr):
        """`_qkv_rope_kernel`'s steps for HB heads of one token at once, a head a row of [HB, BLOCK] tiles: each value
        the same elementwise ops on the same operands, each head's norm a sum over its own row."""
        HT: tl.constexpr = HQ + 2 * HK
        nb = (HT + HB - 1) // HB
        t = tl.program_id(0) // nb
        j = (tl.program_id(0) % nb) * HB + tl.arange(0, HB)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        ok = (i < D) & (j < HT)
        half = D // 2
        ip = tl.where(i < half, i + half, i - half)
        x = _heads_value(ws_a, ws_b, bias_ptr, t, j, i, ok, M, HA, HT, D, SPLIT_A, SPLIT_B, HAS_BIAS, XROUND, EMULATE)
        p = _heads_value(ws_a, ws_b, bias_ptr, t, j, ip, ok, M, HA, HT, D, SPLIT_A, SPLIT_B, HAS_BIAS, XROUND, EMULATE)
        is_q = j < HQ
        xr, pr = x, p
        if NORM:
            acc = tl.zeros((HB, BLOCK), dtype=tl.float32)
            acc += x * x
            inv = tl.math.rsqrt(tl.sum(acc, axis=1)[:, None] * scale + tl.where(is_q, q_eps, k_eps))
            w = tl.where(is_q, tl.load(qn_ptr + i + j * 0, mask=ok, other=0.0), tl.load(kn_ptr + i + j * 0, mask=ok, other=0.0))
            wp = tl.where(is_q, tl.load(qn_ptr + ip + j * 0, mask=ok, other=0.0),
                          tl.load(kn_ptr + ip + j * 0, mask=ok, other=0.0))
            xr = _normed(x, w.to(tl.float32), inv, CAST_FIRST, XROUND, NROUND, EMULATE)
            pr = _normed(p, wp.to(tl.float32), inv, CAST_FIRST, XROUND, NROUND, EMULATE)
        sign = tl.where(i < half, -1.0, 1.0)
        if HALF_TABLE:
            ci = i % half
        else:
            ci = i
        c = tl.load(cos_ptr + t * sc_t + ci * sc_d + j * 0, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sc_t + ci * sc_d + j * 0, mask=ok, other=0.0).to(tl.float32)
        y = _round(_round(xr * c, ROUND, EMULATE) + _round(sign * pr * s, ROUND, EMULATE), ROUND, EMULATE)
        page = tl.load(pages_ptr + t).to(tl.int64)
        off = tl.load(offs_ptr + t).to(tl.int64)
        tl.store(q_ptr + (t * HQ + j).to(tl.int64) * D + i, y.to(q_ptr.dtype.element_ty), mask=ok & is_q)
        hk = (j - HQ).to(tl.int64)
        is_k = (j >= HQ) & (j < HQ + HK)
        tl.store(kp_ptr + page * kps_p + hk * kps_h + off * kps_s + i, y.to(kp_ptr.dtype.element_ty), mask=ok & is_k)
        hv = (j - HQ - HK).to(tl.int64)
        tl.store(vp_ptr + page * vps_p + hv * vps_h + off * vps_s + i, x.to(vp_ptr.dtype.element_ty),
                 mask=ok & (j >= HQ + HK))

    @triton.jit
    def _heads_value(ws_a, ws_b, bias_ptr, t, j, i, ok, M, HA: tl.constexpr, HT: tl.constexpr, D: tl.constexpr,
                     SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, HAS_BIAS: tl.constexpr, XROUND: tl.constexpr,
                     EMULATE: tl.constexpr):
        """`_value` for a tile of heads j (rows) at i: heads < HA from ws_a, the rest from ws_b."""
        a = linear.sum_partials(ws_a, t, j * D + i, ok & (j < HA), M, HA * D, SPLIT_A)
        if HA < HT:
            b = linear.sum_partials(ws_b, t, (j - HA) * D + i, ok & (j >= HA), M, (HT - HA) * D, SPLIT_B)
            a = tl.where(j < HA, a, b)
        if HAS_BIAS:
            a += tl.load(bias_ptr + j * D + i, mask=ok, other=0.0).to(tl.float32)
        return _round(a, XROUND, EMULATE)


# Heads a program of `_qkv_rope_kernel`: 1 on a GPU; under Triton's CPU interpreter, whose cost is per program and per
# op whatever the tile's size, every head of a token in one program (the paged-forward tests' prefills spent most of
# their time in this kernel's (token, head) programs). PDFLASH_QKV_HEADS_PER_PROGRAM=N sets it under the interpreter
# (1: the GPU's form there too); a GPU always runs one head a program, the form its tests check.
def heads_setting(text: str | None) -> int | None:
    """PDFLASH_QKV_HEADS_PER_PROGRAM's value: None unset or empty, else a power of two (a ValueError otherwise)."""
    if not text:
        return None
    if not (text.isdigit() and int(text) >= 1 and int(text) & (int(text) - 1) == 0):
        raise ValueError(f"PDFLASH_QKV_HEADS_PER_PROGRAM must be a power of two (heads a program), got {text!r}")
    return int(text)


_HB = heads_setting(os.environ.get("PDFLASH_QKV_HEADS_PER_PROGRAM"))


def heads_per_program(heads: int) -> int:
    """`_qkv_rope_kernel`'s HB for `heads` q, k and v heads: 1 (one program per (token, head)) on a GPU; under the
    interpreter all of them (a power of two) unless PDFLASH_QKV_HEADS_PER_PROGRAM says."""
    if not runtime.interpreting():
        return 1
    return _HB if _HB is not None else triton.next_power_of_2(heads)


def out_dtypes(x: torch.dtype, norm_w: torch.dtype | None, cast_first: bool, cos: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(the per-head norm's result dtype, the rotary's) as transformers' ops promote them."""
    n = (torch.promote_types(norm_w, x) if cast_first else x) if norm_w is not None else x
    return n, torch.promote_types(n, cos)


def _stack(tensors: list[torch.Tensor], owners: list[torch.nn.Module], attr: str) -> torch.Tensor:
    """The tensors as one, each owner's `attr` made a view of its rows (no second copy kept). Owners merged before (a
    second runner on the same model) get their merged tensor back: no copy, their views unchanged."""
    if len(tensors) == 1:
        return tensors[0].detach()
    key = f"_pdflash_merged_{attr}"
    prev = owners[0].__dict__.get(key)
    if prev is not None and _rows_of(prev, tensors) and all(m.__dict__.get(key) is prev for m in owners):
        return prev
    whole = torch.cat([x.detach() for x in tensors], dim=0)
    row = 0
    for m, x in zip(owners, tensors):
        getattr(m, attr).data = whole[row : row + x.shape[0]]
        m.__dict__[key] = whole  # (a plain attribute: not a buffer, not in the state dict)
        row += x.shape[0]
    return whole


def _rows_of(whole: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are `whole`'s rows in order, back to back (views of it, as `_stack` made them)."""
    if sum(x.shape[0] for x in tensors) != whole.shape[0]:
        return False
    row = 0
    for x in tensors:
        if (x.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or x.shape[1:] != whole.shape[1:]
                or x.stride() != whole.stride() or x.storage_offset() != whole.storage_offset() + row * whole.stride(0)):
            return False
        row += x.shape[0]
    return True


def merged_weight(modules: list[torch.nn.Module], groups: list[tuple[int, ...]] | None = None
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The projections' weights stacked per group of `plan` (all in one by default) and their biases as one vector
    over all heads (or None); each module's weight and bias become views of these: no second copy is kept."""
    groups = groups or [tuple(range(len(modules)))]
    ws = [_stack([modules[i].weight for i in g], [modules[i] for i in g], "weight") for g in groups]
    biases = [getattr(m, "bias", None) for m in modules]
    b = _stack(biases, modules, "bias") if all(isinstance(x, torch.Tensor) for x in biases) else None
    return ws, b


def qkv_rope_write(x: torch.Tensor, parts: list[tuple[torch.Tensor, linear.LinearConfig]], bias: torch.Tensor | None,
                   hq: int, hk: int, d: int, norms: tuple | None, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] (the normed input); parts: the projections' weights as one or two linears, in head order, each
    with its config (`plan`: [(q|k|v merged, cfg)], or [(q, cfg_q), (k|v merged, cfg_kv)]); bias [(hq + 2 hk) d] or
    None; norms (q_norm weight, k_norm weight, q eps, k eps, cast_first) or None; cos/sin [1, T, d or d/2] (any
    strides); pools [pages, hk, PAGE, d] -> q [1, hq, T, d] (a view of [1, T, hq, d], as the modules lay it); k and v
    written to their slots."""
    t = x.shape[0]
    _, rdtype = out_dtypes(x.dtype, norms[0].dtype if norms is not None else None,
                                norms[4] if norms is not None else True, cos.dtype)
    if k_pool.dtype != rdtype or v_pool.dtype != x.dtype:
        raise ValueError(f"qkv_rope_write: pools {k_pool.dtype}/{v_pool.dtype} for k {rdtype} and v {x.dtype}")
    if len(parts) not in (1, 2):
        raise ValueError(f"qkv_rope_write: {len(parts)} projections (1 or 2)")
    ws = [linear.partials(x, w.t(), cfg) for w, cfg in parts]
    ha = parts[0][0].shape[0] // d
    q = torch.empty((1, t, hq, d), dtype=rdtype, device=x.device)
    if t:
        qn, kn, q_eps, k_eps, cast_first = norms if norms is not None else (x, x, 0.0, 0.0, True)
        nround = _ROUNDED[torch.promote_types(qn.dtype, x.dtype)] if cast_first else _ROUNDED[x.dtype]
        hb = heads_per_program(hq + 2 * hk)
        _qkv_rope_kernel[(t * triton.cdiv(hq + 2 * hk, hb),)](
            ws[0], ws[-1], bias if bias is not None else ws[0], qn, kn, cos, sin, q, k_pool, v_pool, pages, offsets,
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
            cos.stride(1), cos.stride(2), t, float(q_eps), float(k_eps), 1.0 / d,
            HQ=hq, HK=hk, D=d, HA=ha, SPLIT_A=parts[0][1].split, SPLIT_B=parts[-1][1].split,
            HAS_BIAS=bias is not None, NORM=norms is not None,
            CAST_FIRST=cast_first, XROUND=_ROUNDED[x.dtype], NROUND=nround, ROUND=_ROUNDED[rdtype],
            HALF_TABLE=cos.shape[-1] != d, BLOCK=_block(d), EMULATE=runtime.interpreting(), HB=hb, **LAUNCH_OPTIONS)
    return q.transpose(1, 2)
