"""A torch dispatch mode that runs a model's dense matmuls and reductions on the batch-invariant kernels.

Inside `InvariantMode`, every aten call that would pick its algorithm from the whole tensor's shape
(linear/matmul/mm/addmm/bmm, sum/mean over a dimension, softmax/log-softmax) runs on `pdflash_kernels.linear` / `pdflash_kernels.reduce`
instead; everything else (elementwise ops, views, gathers, topk) is invariant already and runs as it
is. (Under inference mode composite ops such as aten.linear reach the mode whole: they are taken over
here, or they would run torch's kernels below the mode.) This covers linears, norms, routers and LM heads of any transformers model without per-model code.

`Recorder` lists the aten ops a forward runs that could still depend on the batch (reductions and
matmuls the mode does not take over), for the installer's coverage report.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdflash_kernels import linear, reduce, runtime

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _ok(*tensors: torch.Tensor) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in _FLOATS and runtime.triton_usable(t.device) for t in tensors)


def _mm(a, b):
    if not _ok(a, b) or a.dtype != b.dtype:
        return NotImplemented
    return linear.matmul(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not _ok(bias, a, b) or beta != 1 or alpha != 1 or bias.dim() != 1 or a.dtype != b.dtype:
        return NotImplemented
    return linear.matmul(a, b, bias=bias.to(a.dtype))


def _linear(x, weight, bias=None):
    if not _ok(x, weight) or x.dtype != weight.dtype or weight.dim() != 2 or (bias is not None and not _ok(bias)):
        return NotImplemented
    k = x.shape[-1]
    out = linear.matmul(x.reshape(-1, k), weight.t(), bias=None if bias is None else bias.to(x.dtype))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _matmul(a, b):
    if not _ok(a, b) or a.dtype != b.dtype or b.dim() != 2 or a.dim() < 2:
        return NotImplemented
    out = linear.matmul(a.reshape(-1, a.shape[-1]), b)
    return out.reshape(*a.shape[:-1], b.shape[1])


def _bmm(a, b):
    if not _ok(a, b) or a.dtype != b.dtype:
        return NotImplemented
    if a.shape[-1] == 1:  # an outer product (rotary tables): one rounding per element, invariant as it is
        return NotImplemented
    return torch.stack([linear.matmul(a[i], b[i]) for i in range(a.shape[0])])


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    if not _ok(x):
        return NotImplemented
    return reduce.row_sum(x, list(dim) if dim else None, keepdim=keepdim, dtype=dtype)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    if not _ok(x):
        return NotImplemented
    return reduce.row_sum(x, list(dim) if dim else None, keepdim=keepdim, mean=True, dtype=dtype)


def _softmax(x, dim, half_to_float):
    if not _ok(x):
        return NotImplemented
    return reduce.softmax(x, dim, dtype=torch.float32 if half_to_float else None)


def _softmax_int(x, dim, dtype=None):
    if not _ok(x):
        return NotImplemented
    return reduce.softmax(x.to(dtype) if dtype is not None else x, dim)


def _log_softmax_int(x, dim, dtype=None):
    if not _ok(x):
        return NotImplemented
    return reduce.softmax(x.to(dtype) if dtype is not None else x, dim, log=True)


def _log_softmax(x, dim, half_to_float):
    if not _ok(x):
        return NotImplemented
    return reduce.softmax(x, dim, log=True, dtype=torch.float32 if half_to_float else None)


def _layer_norm_parts(x, normalized_shape, weight, bias, eps):
    """LayerNorm over the last dimension from the invariant row reductions, in float32 (its mean, then the variance of
    the centred row): a row's result depends on that row alone. -> (output in x's dtype, mean, rstd)."""
    xf = x.float()
    mean = reduce.row_sum(xf, [-1], keepdim=True, mean=True)
    centred = xf - mean
    rstd = torch.rsqrt(reduce.row_sum(centred * centred, [-1], keepdim=True, mean=True) + eps)
    y = centred * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    if not _ok(x) or len(normalized_shape) != 1:  # (Phi-3.5-MoE, Granite hybrids: LayerNorm where others have RMSNorm)
        return NotImplemented
    return _layer_norm_parts(x, normalized_shape, weight, bias, eps)[0]


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    if not _ok(x) or len(normalized_shape) != 1:
        return NotImplemented
    return _layer_norm_parts(x, normalized_shape, weight, bias, eps)


TABLE = {
    aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.sum.dim_IntList: _sum,
    aten.mean.dim: _mean,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _log_softmax,
    aten.softmax.int: _softmax_int,
    aten.log_softmax.int: _log_softmax_int,
    aten.layer_norm.default: _layer_norm,
    aten.native_layer_norm.default: _native_layer_norm,
}

# Ops whose result for one row can depend on the other rows (reductions, matmuls, atomics) when run by
# torch's own kernels. An op listed here and met in a forward, but not taken over, is reported.
_RISKY = (
    "mm", "matmul", "bmm", "baddbmm", "addmv", "mv", "conv", "sum", "mean", "var", "std", "norm", "softmax",
    "logsumexp", "cumsum", "cumprod", "prod", "index_add", "scatter_add", "scatter_reduce", "embedding_bag",
    "attention", "grouped_mm", "histc", "nansum", "dot", "linear", "einsum", "tensordot",
)


def is_risky(func) -> bool:
    name = func._schema.name.split("::")[-1]
    return any(r in name for r in _RISKY)


class InvariantMode(TorchDispatchMode):
    def __init__(self, recorder: "Recorder | None" = None):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = TABLE.get(func)
        if impl is not None:
            out = impl(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if self.recorder is not None:
            self.recorder.seen(func, args, handled=False)
        return func(*args, **kwargs)


class Recorder:
    """Counts the risky aten ops a forward ran on torch's own kernels."""

    def __init__(self) -> None:
        self.uncovered: collections.Counter[str] = collections.Counter()

    def seen(self, func, args, handled: bool) -> None:
        if handled or not is_risky(func):
            return
        if func in (aten.bmm.default, aten.matmul.default, aten.mm.default) and args and args[0].shape[-1] == 1:
            return  # outer products (rotary tables: inv_freq @ positions) round once per element: exact
        if not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
            return  # integer reductions are exact in any order
        self.uncovered[str(func)] += 1
