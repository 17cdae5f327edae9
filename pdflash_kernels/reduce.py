"""Batch-invariant row reductions: sum / mean and softmax / log-softmax over the last dimension.

One program per row, a fixed chunk of the row at a time in a fixed order, so a row's result never
depends on how many rows share the call (torch's reduction kernels choose their thread layout, and so
their order of additions, from the whole tensor's shape).
"""

from __future__ import annotations

import torch

from pdflash_kernels import runtime

triton, tl = runtime.triton, runtime.tl
to_out = runtime.to_out if triton is not None else None

CHUNK = 2048  # elements of a row per step (a power of two)


def _block(d: int) -> int:
    return min(CHUNK, triton.next_power_of_2(max(d, 1)))


if triton is not None:

    @triton.jit
    def _row_sum(x_ptr, out_ptr, D: tl.constexpr, scale, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        runtime.pdl_begin()
        r = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, D, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0) * scale
        tl.store(out_ptr + r, to_out(total, out_ptr, EMULATE))

    @triton.jit
    def _row_softmax(x_ptr, out_ptr, D: tl.constexpr, LOG: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        runtime.pdl_begin()
        r = tl.program_id(0).to(tl.int64)
        m = tl.full((BLOCK,), -float("inf"), dtype=tl.float32)
        for c in range(0, D, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.load(x_ptr + r * D + cols, mask=cols < D, other=-float("inf")).to(tl.float32))
        mx = tl.max(m, axis=0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, D, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + r * D + cols, mask=cols < D, other=-float("inf")).to(tl.float32)
            acc += tl.where(cols < D, tl.exp(x - mx), 0.0)
        total = tl.sum(acc, axis=0)
        for c in range(0, D, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            if LOG:
                y = x - mx - tl.log(total)
            else:
                y = tl.exp(x - mx) / total
            tl.store(out_ptr + r * D + cols, to_out(y, out_ptr, EMULATE), mask=cols < D)


def _rows(x: torch.Tensor, dims: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Move `dims` to the end and flatten: -> ([R, D] contiguous, the kept shape)."""
    nd = x.dim()
    dims = sorted({d % nd for d in dims}) if dims else list(range(nd))
    keep = [d for d in range(nd) if d not in dims]
    xt = x.permute(*keep, *dims)
    kept_shape = [x.shape[d] for d in keep]
    d = 1
    for i in dims:
        d *= x.shape[i]
    return xt.reshape(-1, d).contiguous(), kept_shape


def row_sum(x: torch.Tensor, dims: list[int] | None, keepdim: bool = False, mean: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    nd = x.dim()
    dims_n = sorted({d % nd for d in dims}) if dims else list(range(nd))
    rows, kept = _rows(x, dims_n)
    r, d = rows.shape
    out_dtype = dtype or x.dtype
    out = torch.empty(r, dtype=out_dtype, device=x.device)
    if r:
        scale = 1.0 / d if mean else 1.0
        _row_sum[(r,)](rows, out, D=d, scale=scale, BLOCK=_block(d), EMULATE=runtime.interpreting(), **runtime.pdl_launch())
    out = out.reshape(kept)
    if keepdim:
        for i in dims_n:
            out = out.unsqueeze(i)
    return out


def softmax(x: torch.Tensor, dim: int, log: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    dim = dim % x.dim()
    xt = x.movedim(dim, -1)
    shape = xt.shape
    rows = xt.reshape(-1, shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    if rows.shape[0]:
        _row_softmax[(rows.shape[0],)](rows, out, D=rows.shape[1], LOG=log, BLOCK=_block(rows.shape[1]), EMULATE=runtime.interpreting(), **runtime.pdl_launch())
    return out.reshape(shape).movedim(-1, dim)
