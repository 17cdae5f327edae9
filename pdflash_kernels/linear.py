"""Batch-invariant dense matmul: out[M, N] = a[M, K] @ b[K, N] (+ bias), each row independent of M.

Tiles, K order and the split of K (a fixed number of K ranges, summed in order) are chosen from (N, K) and
the device alone, never from M: a row of the output is bit-identical whether it is computed alone or with up
to thousands of other rows (cuBLAS picks its algorithm by M, which is what makes a 1-token and a 16-token
forward disagree in the last bits). Only how many row tiles one program takes against each weight tile it loads
follows M (`m_tiles`), and each row tile is its own dot of the same form, so that changes no bit.

The K ranges' partial sums are added by a second launch (`_split_reduce`), or, with `ONE_LAUNCH`
(PDFLASH_LINEAR_ONE_LAUNCH=1), in the same launch by whichever program of an output tile finishes last: each
program stores its partial, counts itself in on the tile's counter (an atomic used as a semaphore, never for
the sum), and the last one adds the partials in split order 0..S-1 exactly as `_split_reduce` does (the same
bits), then sets the counter back to zero. That saves a launch per linear (a decode forward's graph is
launch-bound); the counters are one device buffer of regions handed out in turn, so kernels on two streams at
once (the expert cache's side stream) use different ones. Off by default until measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
import weakref

import torch

from pdflash_kernels import runtime

triton, tl = runtime.triton, runtime.tl
to_out = runtime.to_out if triton is not None else None

ONE_LAUNCH = runtime.env_flag("PDFLASH_LINEAR_ONE_LAUNCH")
# software-pipeline depth: a number, or "auto" (one stage more than a split's K steps, 2..4: a decode linear's split has
# 2 steps, and unused stages only hold shared memory that a second program on the SM could use). It changes when a
# tile's loads are issued, not what a dot adds or in which order: the bits are the same
# (benchmarks/linear_sweep.py checks that on the GPU).
STAGES = os.environ.get("PDFLASH_LINEAR_STAGES", "4")
if STAGES != "auto" and not (STAGES.isdigit() and 1 <= int(STAGES) <= 8):
    raise ValueError(f"PDFLASH_LINEAR_STAGES must be a number of pipeline stages (1-8) or 'auto', got {STAGES!r}")
# the tile's rows: one value for every call (a row's bits may depend on the MMA form the tile's height selects, never on
# M). At decode shapes a 64-row tile holds one real row, and its activation tile takes a quarter of each pipeline
# stage's shared memory; 16-row tiles fit two programs an SM (benchmarks/linear_sweep.py, cold in L2: qwen3 qkv 9.98 ->
# 7.56 us, o 9.94 -> 6.33; gpt-oss qkv 13.24 -> 10.74, o 10.56 -> 7.99; the same bits as 64 rows at every shape it timed).
# The default since stop 25, with PDFLASH_PDL_TRIGGER=after-wait (block-1 forward qwen3-8l 0.690 ms, gptoss-24l 3.10 ms).
_BLOCK_M = os.environ.get("PDFLASH_LINEAR_BLOCK_M", "16")
if _BLOCK_M not in ("16", "32", "64", "128"):
    raise ValueError(f"PDFLASH_LINEAR_BLOCK_M must be 16, 32, 64 or 128, got {_BLOCK_M!r}")
BLOCK_M = int(_BLOCK_M)
# How far K is split (linear_config): 1 (the default since stop 33: programs within the SMs) or 4 (programs past 2x the
# SMs: every build before stop 33). A split writes and reads back split x M x N float32 partials, so fewer splits pay
# at 16-64 rows: benchmarks/linear_sweep.py --splits (H200, L2-cold, whole calls, ratio to cuBLAS at M = 1 / 16 / 64)
# moved Qwen3-30B-A3B's o projection 0.93 / 0.99 / 1.44 -> 0.76 / 0.75 / 0.88, its LM head 1.08 / 1.21 / 1.83 -> 1.01 /
# 1.02 / 1.25, gpt-oss-20b's o 0.79 / 0.83 / 1.66 -> 0.83 / 0.84 / 1.28 and qkv 1.13 / 1.17 / 1.69 -> 1.12 / 1.15 /
# 1.48; only Qwen3's merged qkv lost at 64 rows (1.88 -> 2.11), which WIDE_FROM's 64-row tiles take back (1.13). Every
# split gives invariant rows; another split gives other last bits. With 1, Qwen3-30B-A3B's q projection (4096 wide)
# would split K 2 ways and its k/v (512) 8: merged (pdflash_kernels.qkv), they all take the merged width's split instead
# (share_config). The GPU suite ran with it at stop 33 (benchmarks/results/gpu_runs_h200.md).
_SPLIT_FILL = os.environ.get("PDFLASH_LINEAR_SPLIT_FILL", "1")
if _SPLIT_FILL not in ("1", "2", "4"):
    raise ValueError(f"PDFLASH_LINEAR_SPLIT_FILL must be 1, 2 or 4, got {_SPLIT_FILL!r}")
SPLIT_FILL = int(_SPLIT_FILL)
# Calls of more rows than this (0: never) take 64-row tiles (one wgmma-shaped dot a weight tile on sm_90) instead of
# `m_tiles` 16-row tiles: four 16-row dots re-read the same weight tile's shared memory once per row tile and their
# activations once per warp, which held 64-row calls at 1.7-2.3x cuBLAS (benchmarks/results/linear_m_tiles_h200.txt).
# The bits of a row must not depend on the tile's height for this to be batch-invariant: on the H200 64- and 16-row
# tiles were bit-identical at every shape and split timed (linear_sweep_h200.txt `default bits`; stop 33's
# linear_wide_h200.txt `rows invariant`, 7 projections x 2-3 splits; a probe of 6 shapes with unscaled weights), and
# tests/test_kernels_gpu.py checks it (rows alone against the same rows in 17- to 256-row calls, 10 shapes). With it,
# 64-row calls of the 7 verify projections linear_sweep times went from 0.63-2.09x cuBLAS to 0.53-1.19x (L2-cold, stop
# 33, PDFLASH_LINEAR_SPLIT_FILL=1: Qwen3's merged qkv 2.09 -> 1.13, gpt-oss's 1.47 -> 1.19, the LM head 1.22 -> 1.10); the
# GPU suite ran with it. 0 turns it off.
_WIDE_FROM = os.environ.get("PDFLASH_LINEAR_WIDE_FROM", "16")
if not _WIDE_FROM.isdigit() or (int(_WIDE_FROM) and int(_WIDE_FROM) < 16):
    raise ValueError(f"PDFLASH_LINEAR_WIDE_FROM must be 0 (off) or a row count >= 16, got {_WIDE_FROM!r}")
WIDE_FROM = int(_WIDE_FROM)
WIDE_BLOCK_M = 64
COUNTER_REGIONS = 64  # calls in flight at once never share a region: they would have to be 64 calls apart
COUNTERS_PER_REGION = 16384  # output tiles a one-launch call may have (more: the two-launch path)


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 4
    max_m_tiles: int = 4  # the most 16-row tiles a program computes against one weight tile (`m_tiles`: 1, 2 or 4)


@functools.lru_cache(maxsize=None)
def linear_config(n: int, k: int, esize: int = 2) -> LinearConfig:
    sms = runtime.sm_count()
    block_n = 64
    block_k = 128 if esize <= 2 else 64
    block_m = BLOCK_M
    n_tiles = (n + block_n - 1) // block_n
    k_steps = (k + block_k - 1) // block_k
    split = 1
    # Split K only as far as it takes to give every SM work at small M, keeping >= 2 steps per split: doubled while the
    # doubled program count stays below SPLIT_FILL x the SMs.
    while n_tiles * split * 2 < SPLIT_FILL * sms and k_steps // (split * 2) >= 2:
        split *= 2
    k_per_split = ((k_steps + split - 1) // split) * block_k
    split = (k + k_per_split - 1) // k_per_split
    stages = min(4, max(2, k_per_split // block_k + 1)) if STAGES == "auto" else int(STAGES)
    return LinearConfig(block_m, block_n, block_k, split, k_per_split, num_stages=stages)


if triton is not None:

    @triton.jit
    def _linear_store(acc, rm, rn, m_ok, n_ok, bias_ptr, out_ptr, stride_om, ws_ptr, pid_s, M, N: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, F32DOT: tl.constexpr, PARTIALS: tl.constexpr):
        """One tile's accumulator out: the output (one split: + bias, rounded) or its split's partial into ws."""
        if SPLIT == 1 and not PARTIALS:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], to_out(acc, out_ptr, F32DOT), mask=m_ok[:, None] & n_ok[None, :])
        else:
            ws = ws_ptr + pid_s.to(tl.int64) * M * N
            tl.store(ws + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _linear_kernel(
        a_ptr, stride_am, stride_ak,
        b_ptr, stride_bk, stride_bn,
        bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr,
        M,
        N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, F32DOT: tl.constexpr,
        FIXUP: tl.constexpr = False, PARTIALS: tl.constexpr = False, MT: tl.constexpr = 1,
        LOOP_STAGES: tl.constexpr = None,
    ):
        """MT (1, 2 or 4): row tiles of BLOCK_M a program computes against each weight tile it loads (`m_tiles`). Each
        is its own BLOCK_M-row dot, in the same K order, so a row's bits do not depend on MT (nor, so, on M)."""
        runtime.pdl_begin()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * (BLOCK_M * MT) + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_s * K_PER_SPLIT
        # (MT > 1: a loop pipelined for every load; Triton's default streams only the first row tile's activations)
        for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=LOOP_STAGES):
            kk = k_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if F32DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
            if MT > 1:  # the next row tiles against the same weight tile (written out: no lists of tensors in Triton)
                r1 = rm + BLOCK_M
                a1 = tl.load(a_ptr + r1[:, None] * stride_am + kk[None, :] * stride_ak, mask=(r1 < M)[:, None] & k_ok[None, :], other=0.0)
                if F32DOT:
                    a1 = a1.to(tl.float32)
                acc1 += tl.dot(a1, b, input_precision=PRECISION)
            if MT > 2:
                r2 = rm + 2 * BLOCK_M
                r3 = rm + 3 * BLOCK_M
                a2 = tl.load(a_ptr + r2[:, None] * stride_am + kk[None, :] * stride_ak, mask=(r2 < M)[:, None] & k_ok[None, :], other=0.0)
                a3 = tl.load(a_ptr + r3[:, None] * stride_am + kk[None, :] * stride_ak, mask=(r3 < M)[:, None] & k_ok[None, :], other=0.0)
                if F32DOT:
                    a2 = a2.to(tl.float32)
                    a3 = a3.to(tl.float32)
                acc2 += tl.dot(a2, b, input_precision=PRECISION)
                acc3 += tl.dot(a3, b, input_precision=PRECISION)
        _linear_store(acc, rm, rn, m_ok, n_ok, bias_ptr, out_ptr, stride_om, ws_ptr, pid_s, M, N, SPLIT, HAS_BIAS, F32DOT, PARTIALS)
        if MT > 1:
            r1 = rm + BLOCK_M
            _linear_store(acc1, r1, rn, r1 < M, n_ok, bias_ptr, out_ptr, stride_om, ws_ptr, pid_s, M, N, SPLIT, HAS_BIAS, F32DOT, PARTIALS)
        if MT > 2:
            r2 = rm + 2 * BLOCK_M
            r3 = rm + 3 * BLOCK_M
            _linear_store(acc2, r2, rn, r2 < M, n_ok, bias_ptr, out_ptr, stride_om, ws_ptr, pid_s, M, N, SPLIT, HAS_BIAS, F32DOT, PARTIALS)
            _linear_store(acc3, r3, rn, r3 < M, n_ok, bias_ptr, out_ptr, stride_om, ws_ptr, pid_s, M, N, SPLIT, HAS_BIAS, F32DOT, PARTIALS)
        if FIXUP and (SPLIT > 1 or PARTIALS):  # the tile's last program adds the partials in split order (as _split_reduce); MT 1
            tl.debug_barrier()  # every thread's partial stored before the count is released
            tile = pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    part = ws_ptr + (s * M).to(tl.int64) * N
                    total += tl.load(part + rm[:, None] * N + rn[None, :], mask=m_ok[:, None] & n_ok[None, :],
                                     other=0.0, cache_modifier=".cg")  # (from L2: other SMs wrote them)
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], to_out(total, out_ptr, F32DOT),
                         mask=m_ok[:, None] & n_ok[None, :])
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @triton.jit
    def sum_partials(ws_ptr, row, cols, mask, M, N, SPLIT: tl.constexpr):
        """A linear's output values at (row, cols) from `partials`' buffer, before its bias and rounding: summed in
        split order from zero as `_split_reduce` adds them (one split: the partial itself, as the one-split kernel
        stores its accumulator), so bias + rounding after it gives `matmul`'s bits."""
        if SPLIT == 1:
            acc = tl.load(ws_ptr + row.to(tl.int64) * N + cols, mask=mask, other=0.0)
        else:
            acc = tl.zeros(cols.shape, dtype=tl.float32)
            for s in range(SPLIT):
                acc += tl.load(ws_ptr + (s * M + row).to(tl.int64) * N + cols, mask=mask, other=0.0)
        return acc

    @triton.jit
    def _split_reduce(ws_ptr, bias_ptr, out_ptr, stride_om, M, N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        runtime.pdl_begin()
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = sum_partials(ws_ptr, m, cols, ok, M, N, SPLIT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + cols, to_out(acc, out_ptr, EMULATE), mask=ok)


# Linears whose weights are views of one merged tensor (pdflash_kernels.qkv: an attention's q/k/v stacked) run with the merged
# projection's config wherever they are called: the merged partials in the fused epilogue, and each module's own
# projection one by one (verifier_svc.fused_attention's probe compares the two bit for bit), so every column is the same
# sum in the same order either way. Keyed by the storage's address, with the K the config was made for (a K split is
# only valid for its K). An entry lives as long as the modules that own the views (`owners`: the projections; their
# weights keep the storage, and so the address, theirs), not as long as the merged tensor object: a Parameter whose
# `.data` was made a view has no `_base`, so a runner's merged tensor can die while the projections still read its
# storage (stop 45: a second runner built on the same target and dropped took the projections' entry with it, and the
# target's own forward then split K its own way, off the verifier's bits). A projection whose fused form was refused
# keeps the merged config, still one per weight.
_SHARED: dict[int, tuple[int, LinearConfig]] = {}


def share_config(weight: torch.Tensor, cfg: LinearConfig, owners: typing.Iterable[object] = ()) -> None:
    """Every linear whose weight [N, K] is a view of `weight`'s storage runs with `cfg` (see _SHARED) while every one of
    `owners` lives (default: `weight` itself)."""
    key = weight.untyped_storage().data_ptr()
    entry = (weight.shape[1], cfg)
    _SHARED[key] = entry
    for owner in tuple(owners) or (weight,):
        weakref.finalize(owner, _unshare, key, entry)


def _unshare(key: int, entry: tuple) -> None:
    """An owner is gone: its entry leaves (not a newer one made at the same address since)."""
    if _SHARED.get(key) is entry:
        del _SHARED[key]


def config_for(b: torch.Tensor, n: int, k: int, esize: int) -> LinearConfig:
    """The config a call with weight operand b [K, N] runs: its merged tensor's (share_config), else linear_config."""
    if _SHARED:
        hit = _SHARED.get(b.untyped_storage().data_ptr())
        if hit is not None and hit[0] == k:
            return hit[1]
    return linear_config(n, k, esize)


def partials(a: torch.Tensor, b: torch.Tensor, cfg: LinearConfig | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] as its K ranges' float32 partial sums [cfg.split, M, N], unsummed and without a bias: for
    a kernel that consumes the linear's output to add them itself (`sum_partials`: the bits `matmul` would store, one
    launch fewer). `cfg`: the tiles and split (by default `config_for`: linear_config(N, K), or a merged tensor's)."""
    m, k = _check(a, b)
    n = b.shape[1]
    cfg = cfg or config_for(b, n, k, a.element_size())
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return ws
    if k == 0:
        return ws.zero_()
    _launch(a, b, cfg, ws, ws, None, None, partials=True)
    return ws


@dataclasses.dataclass
class Partials:
    """A linear's output not yet summed: its K partials [S, M, N] (`partials`) and its bias, for a consumer kernel that
    adds them (pdflash_kernels.fused.add_rms_norm_partials); `value()` is the output as `matmul` would have stored it."""

    ws: torch.Tensor
    bias: torch.Tensor | None
    shape: tuple
    dtype: torch.dtype

    def value(self) -> torch.Tensor:
        _, m, n = self.ws.shape
        out = torch.empty((m, n), dtype=self.dtype, device=self.ws.device)
        if m and n:
            _reduce(self.ws, self.bias, out)
        return out.view(self.shape)


def m_tiles(m: int, cfg: LinearConfig, fixup: bool = False) -> int:
    """Row tiles a program computes against each weight tile it loads: 1 for up to 16 rows (decode), 2 up to 32, else 4.
    Only with 16-row tiles and no one-launch fixup (whose semaphore sums one tile). The bits do not depend on it (each
    row tile is its own dot in the same K order); it only saves reading the weights once per 16 rows."""
    if cfg.block_m != 16 or fixup or m <= 16:
        return 1
    return min(2 if m <= 32 else 4, cfg.max_m_tiles)


def wide(m: int, cfg: LinearConfig) -> LinearConfig:
    """The config a call of m rows launches: cfg, or above WIDE_FROM rows the same split and K steps in 64-row tiles."""
    if WIDE_FROM and m > WIDE_FROM and cfg.block_m < WIDE_BLOCK_M:
        return dataclasses.replace(cfg, block_m=WIDE_BLOCK_M)
    return cfg


def _launch(a, b, cfg: LinearConfig, out, ws, bias, counters, partials: bool = False) -> None:
    """The split-K kernel: out (one split), or the partials into ws; with `counters` the tile's last program sums them."""
    m, k = a.shape
    n = b.shape[1]
    cfg = wide(m, cfg)
    mt = m_tiles(m, cfg, counters is not None)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split, triton.cdiv(m, cfg.block_m * mt))
    _linear_kernel[grid](
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), bias if bias is not None else out, out, out.stride(0),
        ws, counters if counters is not None else ws, m,
        N=n, K=k, K_PER_SPLIT=cfg.k_per_split, SPLIT=cfg.split, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", F32DOT=runtime.interpreting(),
        FIXUP=counters is not None, PARTIALS=partials, MT=mt, LOOP_STAGES=cfg.num_stages if mt > 1 else None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **runtime.pdl_launch(),
    )


def _reduce(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the partials ws [S, M, N] summed in split order (+ bias), rounded to out's dtype."""
    s, m, n = ws.shape
    block = min(1024, triton.next_power_of_2(n))
    _split_reduce[(m, triton.cdiv(n, block))](ws, bias if bias is not None else out, out, out.stride(0), m, N=n, SPLIT=s,
                                              HAS_BIAS=bias is not None, BLOCK=block, EMULATE=runtime.interpreting(),
                                              **runtime.pdl_launch())


def _check(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    m, k = a.shape
    if k != b.shape[0]:
        raise ValueError(f"matmul shapes {tuple(a.shape)} @ {tuple(b.shape)} do not match")
    return m, k


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N]; any strides (b is usually a weight's transposed view)."""
    m, k = _check(a, b)
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config_for(b, n, k, a.element_size())
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=a.device) if cfg.split > 1 else out
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, wide(m, cfg).block_m)
    counters = _counters(a.device, tiles) if cfg.split > 1 and ONE_LAUNCH else None
    _launch(a, b, cfg, out, ws, bias, counters)
    if cfg.split > 1 and counters is None:
        _reduce(ws, bias, out)
    return out


_COUNTERS: dict = {}  # device -> [zeroed int32 buffer of COUNTER_REGIONS regions, the next region to hand out]


def _counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The next region of the device's tile counters (all zero between launches), or None (two launches) when the
    call has more tiles than a region or the buffer would have to be made inside a CUDA-graph capture."""
    if tiles > COUNTERS_PER_REGION:
        return None
    key = (device.type, device.index)
    entry = _COUNTERS.get(key)
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        entry = _COUNTERS[key] = [torch.zeros(COUNTER_REGIONS, COUNTERS_PER_REGION, dtype=torch.int32, device=device), 0]
    buf, i = entry
    entry[1] = (i + 1) % COUNTER_REGIONS
    return buf[i]
