"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) on the paged latent cache, absorbed form.

transformers' MLA modules cache one latent per position (c = kv_a_layernorm of the compressed KV, [L]) and its rotary
key r [DR], then expand every cached position through kv_b_proj into per-head keys and values on each forward: work
and memory that grow with the context times the heads. The absorbed form never expands the cache:

    q_latent[h] = q_nope[h] @ W_UK[h]             (W_UK[h] [nope, L]: kv_b_proj's key rows of head h)
    o_latent[h] = softmax((q_latent[h] . c + q_rope[h] . r) * scaling) @ c     (pdflash_kernels.attention)
    out[h]      = o_latent[h] @ W_UV[h]^T          (W_UV[h] [v, L]: kv_b_proj's value rows of head h)

It equals the expanded form up to rounding (two more roundings to the model's dtype, of q_latent and o_latent). Every
step is batch-invariant: `head_matmul` computes each row in 16-row tiles with one K order whatever the call's rows, and
the attention is the paged kernel's (a row's bits depend on its own position and keys only), so a verify block's rows
get the bits of block-1 decoding.
"""

from __future__ import annotations

import torch

from pdflash_kernels import attention, runtime

triton, tl = runtime.triton, runtime.tl

BLOCK_M = 16  # rows a program computes: one tile height for every call (the bits of a row do not depend on M)

if triton is not None:

    @triton.jit
    def _head_mm_kernel(
        x_ptr, sxt, sxh, sxk, w_ptr, swh, swk, swn, o_ptr, sot, soh, son, T,
        K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, F32DOT: tl.constexpr,
    ):
        runtime.pdl_begin()
        pid_n = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < T
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(x_ptr + rm[:, None] * sxt + h * sxh + kk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + h * swh + kk[:, None] * swk + rn[None, :] * swn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if F32DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        tl.store(o_ptr + rm[:, None] * sot + h * soh + rn[None, :] * son, runtime.to_out(acc, o_ptr, F32DOT),
                 mask=m_ok[:, None] & n_ok[None, :])


def head_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] @ w [H, K, N] per head -> [T, H, N] in x's dtype (float32 accumulation): torch's einsum."""
    return torch.einsum("thk,hkn->thn", x.float(), w.float()).to(x.dtype)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] @ w [H, K, N], head by head -> [T, H, N] in x's dtype: one launch for every head (any strides: w is
    usually a view of kv_b_proj's weight). Each output row is the float32 sum over K in BLOCK_K steps of its own row,
    in 16-row tiles for every T: its bits do not depend on T. The torch reference where Triton is not usable."""
    t, h, k = x.shape
    if w.dim() != 3 or w.shape[0] != h or w.shape[1] != k:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not match ([T, H, K] @ [H, K, N])")
    if x.dtype != w.dtype:
        raise ValueError(f"head_matmul: x is {x.dtype} and w {w.dtype}")
    if not runtime.triton_usable(x.device):
        return head_matmul_reference(x, w)
    n = w.shape[2]
    out = torch.empty((t, h, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    _head_mm_kernel[(triton.cdiv(n, block_n), h, triton.cdiv(t, BLOCK_M))](
        x, x.stride(0), x.stride(1), x.stride(2), w, w.stride(0), w.stride(1), w.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2), t,
        K=k, N=n, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", F32DOT=runtime.interpreting(), **runtime.pdl_launch(),
    )
    return out


def is_latent_attention(module) -> bool:
    """A transformers MLA module: it caches (latent, rotary key) and expands them through kv_b_proj (`expand_kv`)."""
    return all(hasattr(module, a) for a in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "expand_kv"))


def latent_layout(config) -> tuple[int, int] | None:
    """(latent width L, rotary key width DR) of an MLA text config, else None."""
    lora, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if isinstance(lora, int) and isinstance(rope, int) and lora > 0 and rope > 0:
        return lora, rope
    return None


def up_projections(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, L], W_UV^T [H, L, v]): views of the module's kv_b_proj weight [H * (nope + v), L], no copy."""
    w = module.kv_b_proj.weight
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    w = w.view(-1, nope + v, w.shape[-1])
    return w[:, :nope], w[:, nope:].transpose(1, 2)


def latent_attention(module, query: torch.Tensor, latent_pool: torch.Tensor, rope_pool: torch.Tensor,
                     page_table: torch.Tensor, positions: torch.Tensor, scaling: float, seq_starts=None,
                     max_rows=None) -> torch.Tensor:
    """The attention step of an MLA module's forward on the paged latent cache: query [B, H, T, nope + rope] (as the
    module builds it: q_nope then the rotated q_rope) -> [B, T, H, v], what its attention interface returns."""
    b, h, t, _ = query.shape
    nope = module.qk_nope_head_dim
    w_uk, w_uv_t = up_projections(module)
    q = query.transpose(1, 2).reshape(b * t, h, -1)  # [B*T, H, nope + rope]
    q_latent = head_matmul(q[..., :nope], w_uk.to(q.dtype) if w_uk.dtype != q.dtype else w_uk)  # [B*T, H, L]
    q_latent = q_latent.view(b, t, h, -1).transpose(1, 2)
    q_rope = query[..., nope:]
    o = attention.paged_latent_attention(q_latent, q_rope, latent_pool, rope_pool, page_table, positions, scaling,
                                         seq_starts=seq_starts, max_rows=max_rows)  # [B, T, H, L]
    out = head_matmul(o.reshape(b * t, h, -1), w_uv_t.to(o.dtype) if w_uv_t.dtype != o.dtype else w_uv_t)
    return out.view(b, t, h, -1)
