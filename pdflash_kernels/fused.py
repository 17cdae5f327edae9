"""Fused batch-invariant kernels for a decoder layer's small per-row steps: RMSNorm, rotary embedding, MoE routing.

Run op by op, each of these is a chain of tiny kernels (an RMSNorm: cast, square, mean, add, rsqrt, multiply, cast,
multiply = 8 launches; rotary: 5 per tensor; softmax-top-k routing: 6). In a CUDA-graphed decode forward, where a
launch costs ~2 us whatever it does, those chains are most of a layer's time. Here each is one launch, one program
per row, with the rounding points of the transformers formula it replaces:

- `rms_norm`: x -> float32, mean of squares (the same chunked order as `pdflash_kernels.reduce.row_sum`), + eps, rsqrt,
  then either `weight * y.to(x.dtype)` (Llama, Qwen3, Mixtral: `CAST_FIRST`) or `(weight * y).to(x.dtype)` (gpt-oss).
- `rotary`: `x * cos + rotate_half(x) * sin` for q and k in one launch, each product rounded to the result dtype
  before the sum, as torch's elementwise ops round (also gpt-oss's half-width table: `first*cos - second*sin`,
  `second*cos + first*sin`, the same arithmetic).
- `route`: a router's logits -> (scores, expert ids): softmax (float32) -> top-k -> optional renormalisation
  (Qwen3-MoE, Mixtral), or top-k of the logits -> softmax over them (gpt-oss). Ties go to the lower expert id.

A row's result never depends on the other rows (no reduction across rows, fixed chunks per row), so these keep the
forward batch-invariant. `pdflash_kernels.installer` puts them under a model after a probe has shown which formula each
module computes (`rms_norm_variant`, `rotary_matches`, `route_variant`); a module that matches none keeps its own
ops (which `pdflash_kernels.dispatch` already makes invariant), and the install report says so.
"""

from __future__ import annotations

import torch

from pdflash_kernels import linear, runtime
from pdflash_kernels.reduce import _block  # the chunk a row reduction steps by: RMSNorm's mean must add as row_sum does

triton, tl = runtime.triton, runtime.tl

_ROUNDED = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}  # the ROUND code of a result dtype
# every launch: no contraction of a product into a sum (fma), so each product is rounded before it is added, as
# torch's op-by-op kernels round (tests/test_fused_kernels.py checks the PTX)
LAUNCH_OPTIONS = dict(enable_fp_fusion=False, **runtime.pdl_launch())


if triton is not None:

    @triton.jit
    def _round(x, ROUND: tl.constexpr, EMULATE: tl.constexpr):
        """float32 -> the value a torch op with a ROUND-typed result stores (0 float32, 1 bf16, 2 fp16), as float32."""
        if ROUND == 1:
            x = runtime.to_bf16(x, EMULATE).to(tl.float32)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def _load_x(x_ptr, bias_ptr, r, cols, M, D: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                XROUND: tl.constexpr, EMULATE: tl.constexpr):
        """Row r of x, or with SPLIT > 0 the row of a linear's output from its K partials (pdflash_kernels.linear.partials at
        x_ptr, + bias, rounded as the linear stores it)."""
        if SPLIT == 0:
            x = tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        else:
            x = linear.sum_partials(x_ptr, r, cols, cols < D, M, D, SPLIT)
            if HAS_BIAS:
                x += tl.load(bias_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            x = _round(x, XROUND, EMULATE)
        return x

    @triton.jit
    def _row_in(x_ptr, bias_ptr, res_ptr, sum_ptr, r, cols, M, D: tl.constexpr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STORE: tl.constexpr, XROUND: tl.constexpr,
                EMULATE: tl.constexpr):
        """A chunk of the norm's input: x, or x + res rounded to x's dtype (stored to sum_ptr when STORE)."""
        x = _load_x(x_ptr, bias_ptr, r, cols, M, D, SPLIT, HAS_BIAS, XROUND, EMULATE)
        if HAS_RES:
            x = _round(x + tl.load(res_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32), XROUND, EMULATE)
            if STORE:
                tl.store(sum_ptr + r * D + cols, x.to(sum_ptr.dtype.element_ty), mask=cols < D)
        return x

    @triton.jit
    def _inv_rms(acc, scale, eps):
        """1 / sqrt(mean of squares + eps) from the per-lane sums of squares."""
        return tl.math.rsqrt(tl.sum(acc, axis=0) * scale + eps)

    @triton.jit
    def _normed(x, w, inv, CAST_FIRST: tl.constexpr, XROUND: tl.constexpr, OROUND: tl.constexpr, EMULATE: tl.constexpr):
        """weight * (x * inv), rounded where the module's formula rounds (see the module doc)."""
        y = x * inv
        if CAST_FIRST:
            y = _round(y, XROUND, EMULATE)
        return _round(w * y, OROUND, EMULATE)

    @triton.jit
    def _row_out(x, w_ptr, out_ptr, r, cols, inv, D: tl.constexpr, CAST_FIRST: tl.constexpr, XROUND: tl.constexpr,
                 OROUND: tl.constexpr, EMULATE: tl.constexpr):
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = _normed(x, w, inv, CAST_FIRST, XROUND, OROUND, EMULATE)
        tl.store(out_ptr + r * D + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr, D: tl.constexpr, eps, scale, CAST_FIRST: tl.constexpr,
                         XROUND: tl.constexpr, OROUND: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
                         HAS_RES: tl.constexpr = False, bias_ptr=None, M=0, SPLIT: tl.constexpr = 0,
                         HAS_BIAS: tl.constexpr = False):
        """out = RMSNorm(x), or with HAS_RES: sum = x + res (rounded to x's dtype, stored) and out = RMSNorm(sum). x: a
        tensor, or with SPLIT > 0 a linear's K partials (_load_x). A row of one chunk (D <= BLOCK) is read once and
        kept in registers; a longer one is read again for the scaling (recomputed, not read back: another thread of
        the program may have stored the sum). Either way the sum of squares adds as pdflash_kernels.reduce._row_sum does."""
        runtime.pdl_begin()
        r = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        if D <= BLOCK:
            cols = tl.arange(0, BLOCK)
            x = _row_in(x_ptr, bias_ptr, res_ptr, sum_ptr, r, cols, M, D, SPLIT, HAS_BIAS, HAS_RES, True, XROUND, EMULATE)
            acc += x * x
            inv = _inv_rms(acc, scale, eps)
            _row_out(x, w_ptr, out_ptr, r, cols, inv, D, CAST_FIRST, XROUND, OROUND, EMULATE)
        else:
            for c in range(0, D, BLOCK):  # the order of pdflash_kernels.reduce._row_sum over x.float().pow(2)
                cols = c + tl.arange(0, BLOCK)
                x = _row_in(x_ptr, bias_ptr, res_ptr, sum_ptr, r, cols, M, D, SPLIT, HAS_BIAS, HAS_RES, True, XROUND,
                            EMULATE)
                acc += x * x
            inv = _inv_rms(acc, scale, eps)
            for c in range(0, D, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                x = _row_in(x_ptr, bias_ptr, res_ptr, sum_ptr, r, cols, M, D, SPLIT, HAS_BIAS, HAS_RES, False, XROUND,
                            EMULATE)
                _row_out(x, w_ptr, out_ptr, r, cols, inv, D, CAST_FIRST, XROUND, OROUND, EMULATE)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                       sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t, sc_b, sc_t, sc_d,
                       HQ, HK, T, D: tl.constexpr, HALF_TABLE: tl.constexpr, ROUND: tl.constexpr,
                       BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        """One program per (batch, head, position) row of q, then of k."""
        runtime.pdl_begin()
        pid = tl.program_id(0)
        nq = HQ * T
        b = pid // (nq + HK * T)
        j = pid % (nq + HK * T)
        is_q = j < nq
        j = tl.where(is_q, j, j - nq)
        h = j // T
        t = j % T
        half = D // 2
        i = tl.arange(0, BLOCK)
        ok = i < D
        partner = tl.where(i < half, i + half, i - half)
        sign = tl.where(i < half, -1.0, 1.0)
        if HALF_TABLE:
            ci = i % half
        else:
            ci = i
        c = tl.load(cos_ptr + b * sc_b + t * sc_t + ci * sc_d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * sc_b + t * sc_t + ci * sc_d, mask=ok, other=0.0).to(tl.float32)
        if is_q:
            src = q_ptr + b * sq_b + h * sq_h + t * sq_t
            dst = qo_ptr + b * sqo_b + h * sqo_h + t * sqo_t
        else:
            src = k_ptr + b * sk_b + h * sk_h + t * sk_t
            dst = ko_ptr + b * sko_b + h * sko_h + t * sko_t
        x = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
        p = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
        y = _round(_round(x * c, ROUND, EMULATE) + _round(sign * p * s, ROUND, EMULATE), ROUND, EMULATE)
        tl.store(dst + i, y.to(qo_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _route_kernel(logits_ptr, scores_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
                      ws_ptr=None, bias_ptr=None, M=0, SPLIT: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
                      XROUND: tl.constexpr = 0):
        """One row of logits -> its top-k; with SPLIT > 0 the logits are first made from the router linear's K
        partials (ws_ptr, + bias, rounded as the linear stores them) and stored to logits_ptr."""
        runtime.pdl_begin()
        r = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        if SPLIT == 0:
            x = tl.load(logits_ptr + r * E + e, mask=ok, other=-float("inf")).to(tl.float32)
        else:
            x = _load_x(ws_ptr, bias_ptr, r, e, M, E, SPLIT, HAS_BIAS, XROUND, EMULATE)
            tl.store(logits_ptr + r * E + e, x.to(logits_ptr.dtype.element_ty), mask=ok)
            x = tl.where(ok, x, -float("inf"))
        if SOFTMAX_FIRST:  # pdflash_kernels.reduce._row_softmax's steps over one chunk
            mx = tl.max(tl.where(ok, x, -float("inf")), axis=0)
            ex = tl.where(ok, tl.exp(x - mx), 0.0)
            total = tl.sum(ex, axis=0)
            x = tl.where(ok, tl.exp(x - mx) / total, -float("inf"))
        kk = tl.arange(0, BLOCK_K)
        vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in range(K):  # top-k, largest first, ties to the lower id
            v = tl.max(x, axis=0)
            pick = tl.min(tl.where(x == v, e, BLOCK_E), axis=0)
            vals = tl.where(kk == j, v, vals)
            ids = tl.where(kk == j, pick.to(tl.int64), ids)
            x = tl.where(e == pick, -float("inf"), x)
        kok = kk < K
        if SOFTMAX_FIRST:
            if NORM:  # /= sum (pdflash_kernels.reduce._row_sum's order over K values)
                vals = vals / tl.sum(tl.where(kok, vals, 0.0), axis=0)
        else:  # softmax over the top-k logits
            mx = tl.max(tl.where(kok, vals, -float("inf")), axis=0)
            ex = tl.where(kok, tl.exp(vals - mx), 0.0)
            total = tl.sum(ex, axis=0)
            vals = tl.exp(vals - mx) / total
        tl.store(scores_ptr + r * K + kk, runtime.to_out(vals, scores_ptr, EMULATE), mask=kok)
        tl.store(ids_ptr + r * K + kk, ids, mask=kok)

    @triton.jit
    def _group_route_kernel(logits_ptr, bias_ptr, scores_ptr, ids_ptr, scale, E: tl.constexpr, K: tl.constexpr,
                            G: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, ws_ptr=None, M=0,
                            SPLIT: tl.constexpr = 0):
        """One row of float32 logits -> its top-k by DeepSeek-V3's group routing (Nemotron-H, GLM-4.5, dots1, ...):
        s = sigmoid(logits); choice = s + the correction bias; each of G groups scored by its two largest choices; the
        TOPK_GROUP best groups kept; the top k choices of those (largest first, ties to the lower id); their s,
        / (sum + 1e-20) when NORM, * scale. With SPLIT > 0 the logits are first made from the router linear's K
        partials (ws_ptr; the bits `matmul` stores) and stored to logits_ptr."""
        runtime.pdl_begin()
        r = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        if SPLIT == 0:
            x = tl.load(logits_ptr + r * E + e, mask=ok, other=0.0).to(tl.float32)
        else:
            x = _load_x(ws_ptr, ws_ptr, r, e, M, E, SPLIT, False, 0, EMULATE)
            tl.store(logits_ptr + r * E + e, x.to(logits_ptr.dtype.element_ty), mask=ok)
        s = 1.0 / (1.0 + tl.exp(-x))
        c = tl.where(ok, s + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32), -float("inf"))
        if G > 1:
            grp = e // (E // G)
            gg = tl.arange(0, BLOCK_G)
            gsc = tl.full((BLOCK_G,), -float("inf"), tl.float32)
            for g in tl.static_range(G):  # a group's score: its largest choice + its second (a tie counts twice)
                cg = tl.where(grp == g, c, -float("inf"))
                m1 = tl.max(cg, axis=0)
                p1 = tl.min(tl.where(cg == m1, e, BLOCK_E), axis=0)
                m2 = tl.max(tl.where(e == p1, -float("inf"), cg), axis=0)
                gsc = tl.where(gg == g, m1 + m2, gsc)
            keep = e < 0
            for j in tl.static_range(TOPK_GROUP):  # the best groups, ties to the lower group
                v = tl.max(gsc, axis=0)
                pick = tl.min(tl.where(gsc == v, gg, BLOCK_G), axis=0)
                keep = keep | (grp == pick)
                gsc = tl.where(gg == pick, -float("inf"), gsc)
            c = tl.where(keep & ok, c, -float("inf"))
        kk = tl.arange(0, BLOCK_K)
        vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in range(K):  # top-k of the choices, largest first, ties to the lower id; the weight is s (no bias)
            v = tl.max(c, axis=0)
            pick = tl.min(tl.where(c == v, e, BLOCK_E), axis=0)
            vals = tl.where(kk == j, tl.sum(tl.where(e == pick, s, 0.0), axis=0), vals)
            ids = tl.where(kk == j, pick.to(tl.int64), ids)
            c = tl.where(e == pick, -float("inf"), c)
        kok = kk < K
        if NORM:
            vals = vals / (tl.sum(tl.where(kok, vals, 0.0), axis=0) + 1e-20)
        vals = vals * scale
        tl.store(scores_ptr + r * K + kk, runtime.to_out(vals, scores_ptr, EMULATE), mask=kok)
        tl.store(ids_ptr + r * K + kk, ids, mask=kok)


# ---- the Python entry points ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool) -> torch.Tensor:
    """RMSNorm over the last dimension of x, as transformers' RMSNorm modules compute it (see the module doc)."""
    return _rms_norm(x, None, weight, eps, cast_first)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + residual in x's dtype: a pre-norm decoder's residual add and the next norm in one
    launch, the same bits as the add and `rms_norm` one after the other."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}")
    out, total = _rms_norm(x, residual, weight, eps, cast_first)
    return total, out


def add_rms_norm_partials(ws: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` whose x is a linear's output given as its K partials (pdflash_kernels.linear.partials: ws [S, rows, D],
    and the linear's bias): the linear's split-K sum, its bias and rounding (to residual's dtype, as the linear stores
    its output) done here, the same bits as `matmul` then `add_rms_norm`, one launch fewer."""
    if ws.shape[1:] != (residual.numel() // residual.shape[-1], residual.shape[-1]) or ws.dtype != torch.float32:
        raise ValueError(f"add_rms_norm_partials: partials {tuple(ws.shape)} {ws.dtype} for rows of {tuple(residual.shape)}")
    out, total = _rms_norm(residual, residual, weight, eps, cast_first, partials=(ws, bias))
    return total, out


def _rms_norm(x, residual, weight, eps, cast_first, partials=None):
    d = x.shape[-1]
    xc = x.contiguous()
    rc = residual.contiguous() if residual is not None else None
    rows = xc.numel() // d if d else 0
    extra = {}
    if partials is not None:  # x is a linear's K partials (its shape and dtype: the residual's)
        ws, bias = partials
        xc = ws
        extra = dict(bias_ptr=bias if bias is not None else ws, M=rows, SPLIT=ws.shape[0], HAS_BIAS=bias is not None)
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if cast_first else x.dtype
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if rows:
        oround = _ROUNDED[torch.promote_types(weight.dtype, x.dtype)] if cast_first else _ROUNDED[out_dtype]
        _rms_norm_kernel[(rows,)](xc, weight, out, rc if rc is not None else xc, total if total is not None else out,
                                  D=d, eps=float(eps), scale=1.0 / d, CAST_FIRST=cast_first, XROUND=_ROUNDED[x.dtype],
                                  OROUND=oround, BLOCK=_block(d), EMULATE=runtime.interpreting(), HAS_RES=rc is not None,
                                  **extra, **LAUNCH_OPTIONS)
    return out, total


def _like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output laid out like x (torch's elementwise ops keep a dense permuted layout, as empty_like does), of `dtype`."""
    return torch.empty_like(x, dtype=dtype)


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> bool:
    """The layout `rotary` takes: q/k [B, H, T, D] (any strides, D unit-stride), cos/sin [B or 1, T, D or D/2] with
    any strides (equal for the two: transformers builds gpt-oss's by a transpose, its last stride T), unsqueeze_dim 1,
    and a result dtype it rounds to."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    if cos.shape[0] not in (1, b) or cos.shape[1] != t or cos.shape[2] not in (d, d // 2):
        return False
    if cos.stride() != sin.stride() or q.dtype != k.dtype or cos.dtype != sin.dtype:
        return False
    return torch.promote_types(q.dtype, cos.dtype) in _ROUNDED and q.device == cos.device


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * cos + rotate_half(q) * sin, the same for k): q [B, HQ, T, D], k [B, HK, T, D], cos/sin [B or 1, T, D or D/2]
    (a half-width table is gpt-oss's form). One launch for both. The results are laid out like q and k (as torch's
    elementwise ops lay them), or `contiguous` (as a formula ending in torch.cat does)."""
    b, hq, t, d = q.shape
    hk = k.shape[1]
    dtype = torch.promote_types(q.dtype, cos.dtype)
    if contiguous:
        qo = torch.empty(q.shape, dtype=dtype, device=q.device)
        ko = torch.empty(k.shape, dtype=dtype, device=k.device)
    else:
        qo, ko = _like(q, dtype), _like(k, dtype)
    if b * t:
        sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
        _rotary_kernel[(b * (hq + hk) * t,)](
            q, k, cos, sin, qo, ko, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), sc_b, cos.stride(1), cos.stride(2),
            hq, hk, t, D=d, HALF_TABLE=cos.shape[-1] != d, ROUND=_ROUNDED[dtype], BLOCK=triton.next_power_of_2(d),
            EMULATE=runtime.interpreting(), **LAUNCH_OPTIONS)
    return qo, ko


def route_partials(ws: torch.Tensor, bias: torch.Tensor | None, logits_dtype: torch.dtype, top_k: int, softmax_first: bool,
                   norm: bool, score_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` of a router linear's output given as its K partials (pdflash_kernels.linear.partials: ws [S, T, E], and the
    linear's bias): -> (logits [T, E] of logits_dtype, the bits `matmul` stores; scores; ids), one launch."""
    _, t, e = ws.shape
    logits = torch.empty((t, e), dtype=logits_dtype, device=ws.device)
    scores = torch.empty((t, top_k), dtype=score_dtype, device=ws.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=ws.device)
    if t:
        _route_kernel[(t,)](logits, scores, ids, E=e, K=top_k, SOFTMAX_FIRST=softmax_first, NORM=norm,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                            EMULATE=runtime.interpreting(), ws_ptr=ws, bias_ptr=bias if bias is not None else ws, M=t,
                            SPLIT=ws.shape[0], HAS_BIAS=bias is not None, XROUND=_ROUNDED[logits_dtype], **LAUNCH_OPTIONS)
    return logits, scores, ids


def route(logits: torch.Tensor, top_k: int, softmax_first: bool, norm: bool, score_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (scores [T, k] of score_dtype, expert ids [T, k] int64), largest first."""
    t, e = logits.shape
    lc = logits.contiguous()
    scores = torch.empty((t, top_k), dtype=score_dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](lc, scores, ids, E=e, K=top_k, SOFTMAX_FIRST=softmax_first, NORM=norm,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                            EMULATE=runtime.interpreting(), **LAUNCH_OPTIONS)
    return scores, ids


def group_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
                scale: float, score_dtype: torch.dtype = torch.float32,
                ws: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group routing of float32 router logits [T, E] (or, `ws`, of the router linear's K partials [S, T, E]
    from pdflash_kernels.linear.partials, summed here: the logits `matmul` would store, written to `logits`): ->
    (logits, weights [T, k] of score_dtype, expert ids [T, k] int64, largest choice first), one launch."""
    if ws is not None:
        _, t, e = ws.shape
        logits = torch.empty((t, e), dtype=torch.float32, device=ws.device)
    else:
        logits = logits.contiguous()
        t, e = logits.shape
    if e % n_group:
        raise ValueError(f"{e} experts do not split into {n_group} groups")
    scores = torch.empty((t, top_k), dtype=score_dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _group_route_kernel[(t,)](logits, bias, scores, ids, float(scale), E=e, K=top_k, G=n_group,
                                  TOPK_GROUP=topk_group, NORM=norm, BLOCK_E=triton.next_power_of_2(e),
                                  BLOCK_G=max(2, triton.next_power_of_2(n_group)),
                                  BLOCK_K=triton.next_power_of_2(top_k), EMULATE=runtime.interpreting(),
                                  ws_ptr=ws if ws is not None else logits, M=t, SPLIT=0 if ws is None else ws.shape[0],
                                  **LAUNCH_OPTIONS)
    return logits, scores, ids

