"""Torch references of the kernels: plain math, any device (the CPU serving path and the tests' oracle).

They round at the same points as the Triton kernels (bf16 after each projection, fp32 sums of the k
slots), so a test can hold the kernels to a tight tolerance; the order of additions inside a dot product
differs, so they are not bit-identical to them.
"""

from __future__ import annotations

import torch

from pdflash_kernels import mxfp4
from pdflash_kernels.moe import ACT_RELU2, ACT_SILU, ExpertWeights


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def expert_matrices(w: ExpertWeights, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [R1, H], w2 [H, I]) of one slot as float32."""
    if w.fp4:
        return (mxfp4.dequantize(mxfp4.nibble_blocks(w.w1[slot], w.pair_words), w.s1[slot], torch.float32),
                mxfp4.dequantize(mxfp4.nibble_blocks(w.w2[slot], w.pair_words), w.s2[slot], torch.float32))
    return w.w1[slot].float(), w.w2[slot].float()


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: ExpertWeights,
    num_experts: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: int | torch.Tensor | None = None,
) -> torch.Tensor:
    if getattr(w, "fragments", False):  # fragment words (pdflash_kernels/fragments.py): the same values
        w = w.to_weights()
    t, _ = x.shape
    topk = topk_ids.shape[1]
    nv = t if n_valid is None else int(n_valid)
    inter = w.intermediate
    j = torch.arange(inter, device=x.device)
    gate_rows, up_rows = j * w.row_mul, j * w.row_mul + w.up_offset
    y = torch.zeros(t, topk, w.hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    xf = x.float()
    for e in torch.unique(ids).tolist():
        if not 0 <= e < num_experts:
            continue
        rows, slots = torch.where(ids == e)
        keep = rows < nv
        rows, slots = rows[keep], slots[keep]
        if rows.numel() == 0:
            continue
        slot = e if slot_of_expert is None else int(slot_of_expert[e])
        w1, w2 = expert_matrices(w, slot)
        xe = xf[rows]
        g = _bf16(xe @ w1[gate_rows].T)
        u = _bf16(xe @ w1[up_rows].T)
        if w.b1 is not None:
            b1 = w.b1[slot].float()
            g = _bf16(g + b1[gate_rows])
            u = _bf16(u + b1[up_rows])
        if w.act == ACT_SILU:
            h = g * torch.sigmoid(g) * u
        elif w.act == ACT_RELU2:  # up-only experts (gate_rows == up_rows)
            h = torch.relu(u) ** 2
        else:
            g = g.clamp(max=w.limit)
            u = u.clamp(-w.limit, w.limit)
            h = (u + 1) * (g * torch.sigmoid(w.alpha * g))
        out = _bf16(_bf16(h) @ w2.T)
        if w.b2 is not None:
            out = _bf16(out + w.b2[slot].float())
        y[rows, slots] = out * topk_weights[rows, slots].float()[:, None]
    return y.sum(dim=1).to(x.dtype)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos0: int,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D]; query i sits at absolute position q_pos[i], key j at k_pos0 + j.
    Causal (key pos <= query pos) and, with a window W, key pos > query pos - W. Returns [B, T, Hq, D]."""
    b, hq, tq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scaling
    kp = k_pos0 + torch.arange(s, device=q.device)
    qp = q_pos.to(q.device).reshape(-1)
    allowed = kp[None, :] <= qp[:, None]
    if sliding_window:
        allowed &= kp[None, :] > qp[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hq, 1, 1).expand(b, hq, tq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    p = torch.softmax(scores, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    out = p @ vf
    return out.transpose(1, 2).to(q.dtype)
