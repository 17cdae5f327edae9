"""Grouped MoE experts in Triton: every routed (token, expert) pair of one layer in three launches.

    align (torch ops, no host sync)  ->  gemm1: gather x rows, gate/up, bias, activation -> h (bf16)
                                     ->  gemm2: h @ w2^T, bias, * routing weight -> y[pair] (fp32)
                                     ->  combine: out[t] = sum over its k slots, in slot order -> bf16

Weights are bf16 or MXFP4 (`kernels/mxfp4.py` layout), rows = output features, K contiguous, gate rows
then up rows (`UP_OFF` / `ROW_MUL` also read gpt-oss's interleaved rows in place). Experts are reached
through a slot table (expert id -> slot index into the weight tensors' first dimension), so the same
kernels run on all experts resident or on a GPU slot pool of offloaded ones.

Batch invariance: a pair's row is computed by one program whose tile sizes, K order and activation are
fixed by the layer's static shape (never by the number of tokens or by routing), and the k slots of a
token are summed in slot order by one program; no atomics. So a token's output does not depend on which
other tokens share the call (tests/test_kernels_gpu.py checks 1..256 rows bit for bit).
"""

from __future__ import annotations

import dataclasses

import torch

from kernels import runtime

triton, tl = runtime.triton, runtime.tl
to_bf16, to_out = (runtime.to_bf16, runtime.to_out) if triton is not None else (None, None)

ACT_SILU = 0
ACT_GPTOSS = 1  # clamp(gate, max=limit), clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    decode: int = 0  # FP4 decode: 0 = exact selects, 1 = subnormal bit placement, 2 = tl.dot_scaled (GPU only)


def default_config(n: int, k: int, topk: int, fp4: bool) -> MoeConfig:
    """Tile sizes from the static shape only (never from the token count or the routing)."""
    sms = runtime.sm_count()
    # Enough programs at one token (topk pairs) to keep every SM reading: smaller N tiles for narrow layers.
    # (not below 32: 16-wide tiles were slower in every case the H200 sweep timed)
    block_n = 64
    while block_n > 32 and topk * triton_cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    # FP4: decode 1 (bit placement) was the fastest variant on the H200 at decode shapes (benchmarks/kernels.py --sweep)
    return MoeConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4 if fp4 else 3, decode=1 if fp4 else 0)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- routing: pairs sorted by expert, padded to blocks of BLOCK_M ----------------------------------------
@dataclasses.dataclass
class Routing:
    sorted_pairs: torch.Tensor  # int32 [max_blocks * BM]: pair index (token * topk + slot), P for padding
    block_slot: torch.Tensor  # int32 [max_blocks]: weight slot of each block (-1: unused)
    num_blocks: torch.Tensor  # int32 [1]
    pair_valid: torch.Tensor  # bool [P]
    max_blocks: int
    num_pairs: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return min(num_pairs, num_experts) + triton_cdiv(num_pairs, block_m)


def align_fused(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
) -> Routing:
    """`align` as one Triton launch (the torch version below is ~28 small kernels: ~85 us of a decode layer)."""
    t, topk = topk_ids.shape
    p = t * topk
    dev = topk_ids.device
    mb = max_blocks(p, num_experts, block_m)
    sorted_pairs = torch.empty(mb * block_m, dtype=torch.int32, device=dev)
    block_slot = torch.empty(mb, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    valid = torch.empty(p, dtype=torch.bool, device=dev)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    e_pad = triton.next_power_of_2(num_experts + 1)
    _align_kernel[(1,)](
        ids, n_valid if n_valid is not None else ids, slot_of_expert if slot_of_expert is not None else ids,
        sorted_pairs, block_slot, num_blocks, valid, p, mb,
        E=num_experts, E_PAD=e_pad, TOPK=topk, BM=block_m, HAS_NVALID=n_valid is not None,
        HAS_SLOT=slot_of_expert is not None, C=64 if e_pad <= 128 else 32, num_warps=4,
    )
    return Routing(sorted_pairs, block_slot, num_blocks, valid, mb, p)


def align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
) -> Routing:
    """Group the pairs by expert without a host sync (CUDA-graph safe: every shape is static). Torch ops: the
    reference of `align_fused`.

    Pairs of rows >= n_valid (padding rows of a bucketed forward) and ids outside [0, num_experts) are
    dropped: they compute nothing and the combine step gives their rows zeros.
    """
    t, topk = topk_ids.shape
    p = t * topk
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    if n_valid is not None:
        row = torch.arange(p, device=dev) // topk
        valid = valid & (row < n_valid.reshape(()).to(torch.int64))
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    pair_start = torch.cumsum(counts, 0) - counts
    sorted_key, order = torch.sort(key, stable=True)
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(p, device=dev) - pair_start[e]
    mb = max_blocks(p, num_experts, block_m)
    dest = torch.where(sorted_key < num_experts, block_start[e] * block_m + rank, torch.full_like(rank, mb * block_m))
    sorted_pairs = torch.full((mb * block_m + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    b = torch.arange(mb, device=dev)
    block_expert = torch.searchsorted(block_end, b, right=True)
    num_blocks = block_end[-1:]
    used = b < num_blocks
    block_expert = block_expert.clamp(max=num_experts - 1)
    slot = block_expert if slot_of_expert is None else slot_of_expert.to(torch.int64)[block_expert]
    block_slot = torch.where(used, slot, torch.full_like(slot, -1)).to(torch.int32)
    return Routing(sorted_pairs[:-1], block_slot, num_blocks.to(torch.int32), valid, mb, p)


# ---- the kernels ----------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _fp4_tiles(w_ptr, s_ptr, rows, row_ok, stride_wn, stride_sn, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr):
        """Packed rows [BN, BK/2] -> (even-K, odd-K) bf16 tiles [BN, BK/2] (low nibble = even index), scaled.
        One load of the packed bytes and one scale per 32 values."""
        BN: tl.constexpr = rows.shape[0]
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ok = row_ok[:, None] & (kh < K // 2)[None, :]
        p = tl.load(w_ptr + rows[:, None] * stride_wn + kh[None, :], mask=ok, other=0).to(tl.int32)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + kg[None, :], mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0).to(tl.int32)
        if DECODE == 0:
            # exact: E2M1 magnitude from its bits, code 1 (0.5) by a select; scale 2^(s-127) (s = 0 reads as 0)
            scale = (s << 23).to(tl.float32, bitcast=True)
            lo = p & 15
            hi = p >> 4
            ulo = lo & 7
            uhi = hi & 7
            mlo = tl.where(ulo < 2, ulo.to(tl.float32) * 0.5, ((ulo << 22) + (126 << 23)).to(tl.float32, bitcast=True))
            mhi = tl.where(uhi < 2, uhi.to(tl.float32) * 0.5, ((uhi << 22) + (126 << 23)).to(tl.float32, bitcast=True))
            vlo = tl.where(lo >= 8, -mlo, mlo)
            vhi = tl.where(hi >= 8, -mhi, mhi)
        else:
            # E2M1 bits placed straight into a float32 (code 1 becomes the subnormal 2^-127), rescaled by 2^(s-1)
            scale = (tl.minimum(s + 126, 254) << 23).to(tl.float32, bitcast=True)
            vlo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True)
            vhi = (((p & 0x70) << 18) | ((p & 0x80) << 24)).to(tl.float32, bitcast=True)
        sc = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BLOCK_K // 32, 16)), (BN, BLOCK_K // 2))
        return (vlo * sc).to(tl.bfloat16), (vhi * sc).to(tl.bfloat16)  # exact: E2M1 values times powers of two

    @triton.jit
    def _gemm_rows(
        acc0, acc1,
        a_ptr, a_rows, a_ok, stride_am,
        w_ptr, s_ptr, stride_wn, stride_sn,
        rows0, rows1, n_ok,
        K: tl.constexpr,
        FP4: tl.constexpr, TWO: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
    ):
        """acc[BM, BN] += a[a_rows, :K] @ w[rows, :K]^T for one (TWO: two) weight row sets, K in fixed order."""
        for k0 in range(0, K, BLOCK_K):
            if FP4 and DECODE < 2:
                kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                kh_ok = kh < K // 2
                ke = 2 * kh
                a_even = tl.load(a_ptr + a_rows[:, None] * stride_am + ke[None, :], mask=a_ok[:, None] & kh_ok[None, :], other=0.0)
                a_odd = tl.load(a_ptr + a_rows[:, None] * stride_am + (ke + 1)[None, :], mask=a_ok[:, None] & kh_ok[None, :], other=0.0)
                if F32DOT:
                    a_even = a_even.to(tl.float32)
                    a_odd = a_odd.to(tl.float32)
                w_lo, w_hi = _fp4_tiles(w_ptr, s_ptr, rows0, n_ok, stride_wn, stride_sn, k0, K, BLOCK_K, DECODE)
                if F32DOT:
                    w_lo = w_lo.to(tl.float32)
                    w_hi = w_hi.to(tl.float32)
                acc0 += tl.dot(a_even, tl.trans(w_lo))
                acc0 += tl.dot(a_odd, tl.trans(w_hi))
                if TWO:
                    v_lo, v_hi = _fp4_tiles(w_ptr, s_ptr, rows1, n_ok, stride_wn, stride_sn, k0, K, BLOCK_K, DECODE)
                    if F32DOT:
                        v_lo = v_lo.to(tl.float32)
                        v_hi = v_hi.to(tl.float32)
                    acc1 += tl.dot(a_even, tl.trans(v_lo))
                    acc1 += tl.dot(a_odd, tl.trans(v_hi))
            elif FP4:
                # Triton's own MXFP4 path (GPU only): it upcasts the packed weights itself
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                p0 = tl.load(w_ptr + rows0[:, None] * stride_wn + kh[None, :], mask=n_ok[:, None] & (kh < K // 2)[None, :], other=0)
                s0 = tl.load(s_ptr + rows0[:, None] * stride_sn + kg[None, :], mask=n_ok[:, None] & (kg < K // 32)[None, :], other=0)
                acc0 += tl.dot_scaled(a, None, "bf16", tl.trans(p0), s0, "e2m1")
                if TWO:
                    p1 = tl.load(w_ptr + rows1[:, None] * stride_wn + kh[None, :], mask=n_ok[:, None] & (kh < K // 2)[None, :], other=0)
                    s1 = tl.load(s_ptr + rows1[:, None] * stride_sn + kg[None, :], mask=n_ok[:, None] & (kg < K // 32)[None, :], other=0)
                    acc1 += tl.dot_scaled(a, None, "bf16", tl.trans(p1), s1, "e2m1")
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                w0 = tl.load(w_ptr + rows0[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if F32DOT:
                    a = a.to(tl.float32)
                    w0 = w0.to(tl.float32)
                acc0 += tl.dot(a, tl.trans(w0))
                if TWO:
                    w1 = tl.load(w_ptr + rows1[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    if F32DOT:
                        w1 = w1.to(tl.float32)
                    acc1 += tl.dot(a, tl.trans(w1))
        return acc0, acc1

    @triton.jit
    def _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M: tl.constexpr):
        """The routing block a program computes: its expert's slot, its rows of the sorted pairs, which are real."""
        slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rm)
        return slot, rm, pairs, pairs < P

    @triton.jit
    def _moe_gemm1(
        x_ptr, stride_xm,
        h_ptr, stride_hm,
        sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn,
        b_ptr, stride_be,
        P, alpha, limit,
        I: tl.constexpr, K: tl.constexpr, UP_OFF: tl.constexpr, ROW_MUL: tl.constexpr,
        TOPK: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m >= tl.load(num_blocks_ptr):
            return
        slot, rm, pairs, p_ok = _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M)
        tok = pairs // TOPK
        j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < I
        gate_rows = j * ROW_MUL
        up_rows = j * ROW_MUL + UP_OFF
        w_base = w_ptr + slot * stride_we
        s_base = s_ptr + slot * stride_se
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g, acc_u = _gemm_rows(
            acc_g, acc_u, x_ptr, tok, p_ok, stride_xm, w_base, s_base, stride_wn, stride_sn,
            gate_rows, up_rows, j_ok, K, FP4, True, BLOCK_K, DECODE, F32DOT,
        )
        # the weights' dtype is bf16 (or decoded to bf16): round the projections as a bf16 matmul would
        g = to_bf16(acc_g, F32DOT).to(tl.float32)
        u = to_bf16(acc_u, F32DOT).to(tl.float32)
        if HAS_BIAS:
            bg = tl.load(b_ptr + slot * stride_be + gate_rows, mask=j_ok, other=0.0).to(tl.float32)
            bu = tl.load(b_ptr + slot * stride_be + up_rows, mask=j_ok, other=0.0).to(tl.float32)
            g = to_bf16(g + bg[None, :], F32DOT).to(tl.float32)
            u = to_bf16(u + bu[None, :], F32DOT).to(tl.float32)
        if ACT == 0:
            h = g / (1.0 + tl.exp(-g)) * u
        else:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        tl.store(h_ptr + rm[:, None] * stride_hm + j[None, :], to_bf16(h, F32DOT), mask=p_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _moe_gemm2(
        h_ptr, stride_hm,
        y_ptr, stride_ym,
        sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, rw_ptr,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn,
        b_ptr, stride_be,
        P,
        N: tl.constexpr, K: tl.constexpr,
        FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m >= tl.load(num_blocks_ptr):
            return
        slot, rm, pairs, p_ok = _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc, _unused = _gemm_rows(
            acc, acc, h_ptr, rm, p_ok, stride_hm, w_ptr + slot * stride_we, s_ptr + slot * stride_se,
            stride_wn, stride_sn, n, n, n_ok, K, FP4, False, BLOCK_K, DECODE, F32DOT,
        )
        y = to_bf16(acc, F32DOT).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + slot * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
            y = to_bf16(y + b[None, :], F32DOT).to(tl.float32)
        rw = tl.load(rw_ptr + pairs, mask=p_ok, other=0.0).to(tl.float32)
        y = y * rw[:, None]
        tl.store(y_ptr + pairs[:, None].to(tl.int64) * stride_ym + n[None, :], y, mask=p_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_combine(y_ptr, valid_ptr, out_ptr, N: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(TOPK):
            pair = t * TOPK + s
            v = tl.load(valid_ptr + pair)
            row = tl.load(y_ptr + pair.to(tl.int64) * N + cols, mask=ok & (v != 0), other=0.0)
            acc += row
        tl.store(out_ptr + t.to(tl.int64) * N + cols, to_out(acc, out_ptr, EMULATE), mask=ok)


    @triton.jit
    def _pair_keys(ids_ptr, offs, P, nv, E: tl.constexpr, TOPK: tl.constexpr):
        """Pairs `offs`: in range, kept (an expert id of a real row), and the sort key (E for dropped pairs)."""
        ok = offs < P
        key = tl.load(ids_ptr + offs, mask=ok, other=E).to(tl.int32)
        valid = ok & (key >= 0) & (key < E) & (offs // TOPK < nv)
        return ok, valid, tl.where(valid, key, E)

    @triton.jit
    def _align_kernel(
        ids_ptr, nvalid_ptr, slot_ptr, sorted_ptr, block_slot_ptr, num_blocks_ptr, valid_ptr,
        P, MB,
        E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
        HAS_NVALID: tl.constexpr, HAS_SLOT: tl.constexpr, C: tl.constexpr,
    ):
        """`align` in one program: a stable counting sort of the pairs by expert into blocks of BM."""
        ev = tl.arange(0, E_PAD)
        ci = tl.arange(0, C)
        nv = P // TOPK
        if HAS_NVALID:
            nv = tl.load(nvalid_ptr)
        # while-loops with runtime bounds: P varies with the token count (a range() over it would not run under
        # Triton's interpreter, and a constexpr P would compile once per prompt length)
        start = P * 0
        while start < MB * BM:  # padding everywhere first
            offs = start + ci
            tl.store(sorted_ptr + offs, tl.zeros((C,), tl.int32) + P, mask=offs < MB * BM)
            start += C
        counts = tl.zeros((E_PAD,), tl.int32)
        start = P * 0
        while start < P:
            offs = start + ci
            ok, valid, key = _pair_keys(ids_ptr, offs, P, nv, E, TOPK)
            tl.store(valid_ptr + offs, valid, mask=ok)
            counts += tl.sum((key[:, None] == ev[None, :]).to(tl.int32), axis=0)
            start += C
        blocks = tl.where(ev < E, (counts + BM - 1) // BM, 0)
        block_end = tl.cumsum(blocks, axis=0)
        block_start = block_end - blocks
        num_blocks = tl.sum(blocks, axis=0)
        tl.store(num_blocks_ptr, num_blocks)
        tl.debug_barrier()  # the padding stores above land before the scatter below
        running = block_start * BM
        start = P * 0
        while start < P:
            offs = start + ci
            ok, valid, key = _pair_keys(ids_ptr, offs, P, nv, E, TOPK)
            onehot = (key[:, None] == ev[None, :]).to(tl.int32)
            earlier = ((key[:, None] == key[None, :]) & (ci[None, :] < ci[:, None])).to(tl.int32)
            dest = tl.sum(onehot * running[None, :], axis=1) + tl.sum(earlier, axis=1)
            tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=valid)
            running += tl.sum(onehot, axis=0)
            start += C
        bstart = P * 0
        while bstart < MB:
            b = bstart + ci
            e_b = tl.sum(((block_end[None, :] <= b[:, None]) & (ev[None, :] < E)).to(tl.int32), axis=1)
            used = b < num_blocks
            e_b = tl.minimum(e_b, E - 1)
            if HAS_SLOT:
                e_b = tl.load(slot_ptr + e_b, mask=used, other=0)
            tl.store(block_slot_ptr + b, tl.where(used, e_b, -1), mask=b < MB)
            bstart += C


# ---- the launcher ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ExpertWeights:
    """One layer's expert weights as the kernels read them; first dimension = slot.

    bf16: w1 [S, R1, H] (R1 = 2I rows), w2 [S, H, I]. MXFP4: w1 [S, R1, H/2] u8 + s1 [S, R1, H/32] u8, w2
    [S, H, I/2] + s2 [S, H, I/32]. Row r of w1 is gate row j at r = j * row_mul, up row j at j * row_mul + up_off
    (concatenated: row_mul 1, up_off I; gpt-oss interleaved: row_mul 2, up_off 1).
    """

    w1: torch.Tensor
    w2: torch.Tensor
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    row_mul: int = 1
    up_off: int | None = None
    act: int = ACT_SILU
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def fp4(self) -> bool:
        return self.s1 is not None

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    @property
    def up_offset(self) -> int:
        return self.intermediate if self.up_off is None else self.up_off


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: ExpertWeights,
    num_experts: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    config2: MoeConfig | None = None,
) -> torch.Tensor:
    """x [T, H] bf16, topk_ids/weights [T, k] -> [T, H] in x's dtype. Triton on CUDA (or under TRITON_INTERPRET)."""
    t, hdim = x.shape
    topk = topk_ids.shape[1]
    inter = w.intermediate
    if config is None:
        config = default_config(inter, hdim, topk, w.fp4)
    if config2 is None:
        config2 = default_config(hdim, inter, topk, w.fp4)
    bm = config.block_m
    if config2.block_m != bm:
        raise ValueError("both GEMMs share the routing blocks: block_m must match")
    x = x.contiguous()
    r = align_fused(topk_ids, num_experts, bm, slot_of_expert, n_valid)
    dev = x.device
    h = torch.empty((r.max_blocks * bm, inter), dtype=torch.bfloat16, device=dev)
    y = torch.empty((r.num_pairs, hdim), dtype=torch.float32, device=dev)
    out = torch.empty((t, hdim), dtype=x.dtype, device=dev)
    rw = topk_weights.reshape(-1).contiguous()
    f32dot = runtime.interpreting()
    s1 = w.s1 if w.fp4 else w.w1
    s2 = w.s2 if w.fp4 else w.w2
    b1 = w.b1 if w.b1 is not None else w.w1
    b2 = w.b2 if w.b2 is not None else w.w2
    grid1 = (r.max_blocks, triton_cdiv(inter, config.block_n))
    _moe_gemm1[grid1](
        x, x.stride(0), h, h.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks,
        w.w1, w.w1.stride(0), w.w1.stride(1), s1, s1.stride(0), s1.stride(1), b1, b1.stride(0),
        r.num_pairs, float(w.alpha), float(w.limit),
        I=inter, K=hdim, UP_OFF=w.up_offset, ROW_MUL=w.row_mul, TOPK=topk, FP4=w.fp4, HAS_BIAS=w.b1 is not None, ACT=w.act,
        BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DECODE=config.decode, F32DOT=f32dot,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    grid2 = (r.max_blocks, triton_cdiv(hdim, config2.block_n))
    _moe_gemm2[grid2](
        h, h.stride(0), y, y.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, rw,
        w.w2, w.w2.stride(0), w.w2.stride(1), s2, s2.stride(0), s2.stride(1), b2, b2.stride(0),
        r.num_pairs, N=hdim, K=inter,
        FP4=w.fp4, HAS_BIAS=w.b2 is not None,
        BLOCK_M=bm, BLOCK_N=config2.block_n, BLOCK_K=config2.block_k, DECODE=config2.decode, F32DOT=f32dot,
        num_warps=config2.num_warps, num_stages=config2.num_stages,
    )
    block = min(1024, triton.next_power_of_2(hdim))
    _moe_combine[(t, triton_cdiv(hdim, block))](y, r.pair_valid, out, hdim, TOPK=topk, BLOCK=block, EMULATE=f32dot)
    return out
