"""The DFlash block drafter as a torch module, in the z-lab checkpoint layout.

A small Qwen3-style decoder with no embedding or LM head of its own (it borrows the target's).
Conditioning: outputs of N target layers are concatenated (N*H), projected by `fc` (no bias) and
normalized by `hidden_norm`. In every layer, K and V come from both the projected context rows
(committed tokens, absolute positions) and the block rows; Q comes from the block rows only. There is
no causal mask inside a block. See REFERENCE.md section 2.

Inference keeps a per-layer cache of context K/V (`ContextKV`): each round appends the rows of newly
committed tokens, then one forward over the block `[anchor, MASK x (B-1)]` gives B-1 drafts (`draft`).
The block's own K/V rows are written into the cache's spare rows past the committed ones, so attention reads
one view of context + block (no copy of the whole context per layer and round); the next commit overwrites
them, so nothing of a proposal outlives it. Rotary cos/sin come from a table (`RopeTable`) sliced per call.
Training uses the same layers with an explicit attention mask over many blocks at once.

Inference fuses the weights in memory at load (`DFlashDraftModel.fuse`, `load_dflash(fuse=True)`, the default): on a GPU
every aten op is a kernel launch of ~2 us for tiny work, so the fused forward is written to dispatch few of them
(benchmarks/drafter_ops.py counts them; `DFlashLayer.fused` lists a layer's): every layer's q | k | v one slice of a
stacked `qkv_weight` (one matmul per layer in a proposal, one batched matmul for all layers' K | V in a commit), MLP
gate/up one matmul, RMSNorm as `F.rms_norm` (one kernel on CUDA), q and k normalized and rotated together and written
back into the projection's output, rotary (cos, signed sin) pairs gathered once per forward (no rotate_half
negation), the residual adds inside the o_proj and down_proj matmuls (`addmm_`), a row's K and V side by side in the
caches (a layer's new rows one copy), and query heads interleaved (`interleaved_heads`) so that attention folds each key
head's query heads into its rows and never runs with `enable_gqa`. The checkpoint layout does not change: `state_dict`
(so `save`) gives the original names and head order, `load_state_dict` takes them. The unfused module (as constructed,
what training uses) runs the original Qwen3 ops; the two agree to float rounding (tests/test_dflash_fused.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

WEIGHTS_NAME = "model.safetensors"


@dataclasses.dataclass
class DFlashSpec:
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int


def spec_from_config(cfg: dict) -> DFlashSpec:
    d = cfg.get("dflash_config") or {}
    return DFlashSpec(
        block_size=int(cfg.get("block_size", 16)),
        mask_token_id=int(d["mask_token_id"]),
        target_layer_ids=[int(i) for i in d["target_layer_ids"]],
        num_target_layers=int(cfg.get("num_target_layers", 0)),
    )


def default_target_layers(num_target_layers: int, n: int) -> list[int]:
    """n distinct layer ids spread evenly over the target (one layer -> the middle one)."""
    if not 1 <= n <= num_target_layers:
        raise ValueError(f"cannot pick {n} distinct layers of a {num_target_layers}-layer target")
    if n == 1:
        return [num_target_layers // 2]
    # Prefer layers 1 .. L-3 (as DFlash does); widen to 0 .. L-1 when too few layers for n distinct ids.
    start, end = (1, num_target_layers - 3) if num_target_layers - 3 - 1 >= n - 1 else (0, num_target_layers - 1)
    return [start + (i * (end - start)) // (n - 1) for i in range(n)]


class ContextKV:
    """Per-layer K/V of the projected context rows (K already rotated), [B, Hkv, T, D] each. Grows as tokens commit.

    The rows live in one buffer for all layers that doubles when full: a commit writes only its own rows (no copy of
    the whole context, no allocation of a bigger tensor every round, which on a GPU can mean a device malloc). The
    buffer is [layers, B, capacity, 2, Hkv, D], a row's K and V side by side: the fused model writes a commit's rows of
    every layer in one copy (`append_all`) and a proposal's block rows of a layer in one (`with_block_rows`); K and V
    are strided views of it. A proposal's block rows go to the spare rows after the committed ones (`with_block`) and
    are never committed."""

    MIN_CAPACITY = 256

    def __init__(self, num_layers: int):
        self._buf: torch.Tensor | None = None
        self._used = [0] * num_layers
        self.length = 0

    @staticmethod
    def _views(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, Hkv, T, D] of rows [B, T, 2, Hkv, D] (views)."""
        return rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2)

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's context K and V (views of the buffer), or (None, None) before anything was written."""
        if self._buf is None:
            return None, None
        return self._views(self._buf[i, :, : self._used[i]])

    @property
    def k(self) -> list[torch.Tensor | None]:
        return [self.layer(i)[0] for i in range(len(self._used))]

    @property
    def v(self) -> list[torch.Tensor | None]:
        return [self.layer(i)[1] for i in range(len(self._used))]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Commit layer's K and V rows [B, Hkv, t, D]."""
        n = self._used[layer]
        rows = self._rows(layer, n, k.shape[2], k)
        rows[:, :, 0] = k.transpose(1, 2)
        rows[:, :, 1] = v.transpose(1, 2)
        self._used[layer] = n + k.shape[2]

    def append_all(self, rows: torch.Tensor) -> None:
        """Commit every layer's rows [layers, B, t, 2, Hkv, D] (each row's K then V) in one copy."""
        n, t = self._used[0], rows.shape[2]
        assert all(u == n for u in self._used), "append_all after layers were appended unevenly"
        self._rows(None, n, t, rows).copy_(rows)
        self._used = [n + t] * len(self._used)

    def with_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's context K and V followed by a block's rows k, v (views of its buffer), without committing them.

        The block's rows go to the spare rows past the committed ones: the attention of a proposal reads context and
        block in one view, and no copy of the context is made. The next `append` or `with_block` overwrites them."""
        n, t = self._used[layer], k.shape[2]
        rows = self._rows(layer, n, t, k)
        rows[:, :, 0] = k.transpose(1, 2)
        rows[:, :, 1] = v.transpose(1, 2)
        return self._views(self._buf[layer, :, : n + t])

    def with_block_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`with_block` for rows [B, t, 2, Hkv, D] (K | V), written in one copy."""
        n, t = self._used[layer], rows.shape[1]
        self._rows(layer, n, t, rows).copy_(rows)
        return self._views(self._buf[layer, :, : n + t])

    def _rows(self, layer: int | None, n: int, t: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer's rows n..n+t-1 of layer (of every layer when None), [(layers,) B, t, 2, Hkv, D], the buffer grown
        first when they do not fit (the rows written so far come along). like: rows [.., B, t, 2, Hkv, D] or K [B, Hkv,
        t, D] (the buffer's sizes, dtype and device)."""
        if like.dim() == 4:
            b, h, _, d = like.shape
        else:
            b, h, d = like.shape[-5], like.shape[-2], like.shape[-1]
        buf = self._buf
        if buf is None or n + t > buf.shape[2]:
            cap = max(n + t, 2 * (0 if buf is None else buf.shape[2]), self.MIN_CAPACITY)
            new = like.new_empty(len(self._used), b, cap, 2, h, d)
            if buf is not None:
                used = max(self._used)
                new[:, :, :used] = buf[:, :, :used]
            buf = self._buf = new
        return buf[:, :, n : n + t] if layer is None else buf[layer, :, n : n + t]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated at its positions: transformers' apply_rotary_pos_emb for one tensor, the same ops in the same order
    (cos and sin already [B, 1, T, D]: unsqueezed once per forward, not per layer and tensor)."""
    return (x * cos) + (rotate_half(x) * sin)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed sin, elementwise exactly."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, rope: torch.Tensor) -> None:
    """out = x rotated (the fused path: 3 kernels, no negation): x * cos + swap_halves(x) * signed sin, the last two as
    one addcmul written straight into out. x, out [B, T, heads, D]; rope [B or 1, T, 2, D] = (cos, signed sin) pairs."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    torch.addcmul(x * rope[:, :, 0:1], swapped, rope[:, :, 1:2], out=out)


class RopeTable:
    """Rotary cos/sin of positions 0..n-1, computed once and grown by doubling: a forward slices rows instead of
    computing them (on a GPU ~8 launches per forward). The same numbers as `Qwen3RotaryEmbedding` at those
    positions (elementwise: a position's row does not depend on the others); rope types whose frequencies depend on
    the length (dynamic, longrope) are not tabled (`fixed` is False: call the embedding itself).

    `pairs` gives the fused path's layout: [1, n, 2, D], a position's cos and signed sin side by side (one gather per
    forward fetches both)."""

    MIN_POSITIONS = 256

    def __init__(self, rotary: Qwen3RotaryEmbedding):
        self.rotary = rotary
        self.fixed = "dynamic" not in rotary.rope_type and rotary.rope_type != "longrope"
        self._rows: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pairs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _positions(self, like: torch.Tensor, have: int, need: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [1, size, D] of positions 0..size-1 (size >= need, doubling) when a table of `have` rows is short."""
        if have >= need:
            return None
        return self.rotary(like, torch.arange(max(need, self.MIN_POSITIONS, 2 * have), device=like.device)[None])

    def __call__(self, like: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, n, D] of positions start..start+n-1, in like's dtype on like's device."""
        key = (like.dtype, like.device)
        rows = self._rows.get(key)
        grown = self._positions(like, 0 if rows is None else rows[0].shape[2], start + n)
        if grown is not None:
            rows = self._rows[key] = (grown[0][:, None], grown[1][:, None])
        return rows[0][:, :, start : start + n], rows[1][:, :, start : start + n]

    def pairs(self, like: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """(cos, signed sin) [1, n, 2, D] of positions start..start+n-1, in like's dtype on like's device."""
        key = (like.dtype, like.device)
        rows = self._pairs.get(key)
        grown = self._positions(like, 0 if rows is None else rows.shape[1], start + n)
        if grown is not None:
            rows = self._pairs[key] = rope_pairs(*grown)
        return rows[:, start : start + n]


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[B, T, 2, D] (cos, signed sin) of a rotary embedding's cos, sin [B, T, D]."""
    return torch.stack([cos, _signed_sin(sin)], dim=2)


# join(k, v) -> (K, V): what a block's rows attend to besides themselves (context before them, or nothing)
Join = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The fused path's join: sink(rows [B, t, 2, Hkv, D]) -> (K, V) [B, Hkv, S, D], the rows stored wherever the sink keeps them
Sink = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _alone(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def _after(ctx_k: torch.Tensor, ctx_v: torch.Tensor) -> Join:
    return lambda k, v: (torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2))


def _rows_alone(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ContextKV._views(rows)


def _rows_after(ctx_rows: torch.Tensor) -> Sink:
    return lambda rows: ContextKV._views(torch.cat([ctx_rows, rows], dim=1))


def interleaved_heads(num_heads: int, num_kv_heads: int) -> list[int]:
    """The fused model's query head order: its head h is the checkpoint's head (h % Hkv) * g + h // Hkv (g = Hq / Hkv).

    In the checkpoint, query heads kvh * g .. kvh * g + g - 1 read key head kvh (grouped, as repeat_interleave has it).
    Interleaved, head h reads key head h % Hkv, and in a contiguous q [B, T, Hq, D] = [B, T, g, Hkv, D] the query rows
    of one key head, (token, j) for j < g, sit at one constant stride: folding them into that key head's rows
    ([B, Hkv, T * g, D]) is a view (after the one copy that takes q out of the q | k | v projection), and the
    attention's output comes back as [B, T, Hq * D] in the same order without a copy (flash, memory-efficient and the
    CPU kernel return [B, rows, heads, D] memory). o_proj's input columns follow the same order."""
    g = num_heads // num_kv_heads
    return [(h % num_kv_heads) * g + h // num_kv_heads for h in range(num_heads)]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of queries q [B, T, Hq, D] (heads interleaved: head h reads key head h % Hkv) over keys, values
    [B, Hkv, S, D]; mask None, or boolean / additive [B or 1, 1, T or 1, S]. Returns [B, T, Hq * D] (same head order).

    Each key head's g = Hq / Hkv query heads are folded into its rows, [B, Hkv, T * g, D] (see `interleaved_heads`: a
    view of q made contiguous): scaled_dot_product_attention sees equal head counts, no `enable_gqa`. That matters on CUDA:
    with a mask and `enable_gqa`, torch <= 2.11 has no fused kernel (flash takes no mask, the memory-efficient kernel
    wants equal head counts) and runs the math fallback, ~10-15 kernels a call; folded, the graphs' masked proposals run
    the memory-efficient kernel and the eager drafts flash, one kernel each. A mask per query row is repeated for the
    folded rows (a copy; only the training-style forward passes one)."""
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    # [B, Hkv, T * g, D], row (t, j): a view of q laid out [B, T, Hq, D] (one copy when q is a slice of q | k | v)
    folded = q.contiguous().unflatten(2, (g, hkv)).permute(0, 3, 1, 2, 4).flatten(2, 3)
    if mask is not None and g > 1 and mask.shape[-2] != 1:
        mask = mask.unsqueeze(-2).expand(*mask.shape[:-1], g, mask.shape[-1]).flatten(-3, -2)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, t, hq * d)


def _linear_residual(x: torch.Tensor, linear: nn.Linear, residual: torch.Tensor, inplace: bool) -> torch.Tensor:
    """residual + linear(x) as one matmul (gemm with beta = 1); in place in residual when inplace (out of place, CUDA's
    addmm first copies the residual into its output: one more kernel)."""
    r2 = residual.view(-1, residual.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    out = r2.addmm_(x2, linear.weight.t()) if inplace else torch.addmm(r2, x2, linear.weight.t())
    if linear.bias is not None:
        out.add_(linear.bias)
    return out.view(residual.shape)


def _norm(x: torch.Tensor, module: Qwen3RMSNorm) -> torch.Tensor:
    """module(x) as torch's fused RMSNorm (`aten::_fused_rms_norm`: one kernel on CUDA for a contiguous input, the
    same composite ops as Qwen3RMSNorm on the CPU; in bf16 the weight multiplies before the cast back: float rounding)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def _permute_heads(w: torch.Tensor, perm: list[int], head_dim: int, dim: int) -> torch.Tensor:
    """w with its heads (blocks of head_dim along dim) reordered: the result's head h is w's head perm[h]."""
    heads = w.unflatten(dim, (len(perm), head_dim))
    return heads.index_select(dim, torch.tensor(perm, device=w.device)).flatten(dim, dim + 1)


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for new, old in enumerate(perm):
        inv[old] = new
    return inv


def _unfuse_state(model: DFlashDraftModel, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a fused model: the checkpoint's layout (q/k/v_proj per layer, heads in their order)."""
    a = model.layers[0].self_attn
    hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    inv = _inverse(interleaved_heads(hq, hkv))
    for kind in ("weight", "bias"):
        stacked = state_dict.pop(f"{prefix}qkv_{kind}", None)
        if stacked is None:
            continue
        for i, w in enumerate(stacked):
            q, k, v = w.split([hq * d, hkv * d, hkv * d])
            at = f"{prefix}layers.{i}.self_attn."
            state_dict[at + f"q_proj.{kind}"] = _permute_heads(q, inv, d, dim=0)
            state_dict[at + f"k_proj.{kind}"], state_dict[at + f"v_proj.{kind}"] = k, v
    for i in range(len(model.layers)):
        key = f"{prefix}layers.{i}.self_attn.o_proj.weight"
        state_dict[key] = _permute_heads(state_dict[key], inv, d, dim=1)


def _fuse_state(model: DFlashDraftModel, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook of a fused model: a checkpoint-layout state into the fused parameters."""
    a = model.layers[0].self_attn
    perm, d = interleaved_heads(a.num_heads, a.num_kv_heads), a.head_dim
    n = len(model.layers)
    for kind in ("weight", "bias"):
        names = [[f"{prefix}layers.{i}.self_attn.{p}_proj.{kind}" for p in "qkv"] for i in range(n)]
        if all(k in state_dict for layer in names for k in layer):
            state_dict[f"{prefix}qkv_{kind}"] = torch.stack([
                torch.cat([_permute_heads(state_dict.pop(q), perm, d, dim=0), state_dict.pop(k), state_dict.pop(v)])
                for q, k, v in names
            ])
    for i in range(n):
        key = f"{prefix}layers.{i}.self_attn.o_proj.weight"
        if key in state_dict:
            state_dict[key] = _permute_heads(state_dict[key], perm, d, dim=1)


def _refresh_after_load(model: DFlashDraftModel, incompatible_keys) -> None:
    """load_state_dict post-hook of a fused model: the derived q/k norm weights follow the loaded norm weights."""
    model._refresh_norm_weights()


class DFlashAttention(nn.Module):
    """Attention of one layer. Fused (`DFlashDraftModel.fuse`), q/k/v_proj move into the model's stacked `qkv_weight`
    (query heads interleaved) and o_proj's input columns follow the interleaved order."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V of rows x, [B, Hkv, T, D] each; cos, sin [B, 1, T, D]. (Unfused.)"""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, join: Join, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """(Unfused.)"""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k, v = join(*self.kv(x, cos, sin))
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), k, v, attn_mask=attn_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def fused_forward(self, x: torch.Tensor, w: FusedAttention, rope: torch.Tensor, sink: Sink,
                      attn_mask: torch.Tensor | None) -> torch.Tensor:
        """The attention's output before o_proj, [B, T, Hq * D] (heads interleaved), of normalized rows x [B, T, H], on
        the layer's fused weights w. One matmul gives q | k | v; q and k are normalized together (one norm over
        [B, T, Hq + Hkv, D], one multiply by their weights) and rotated together back into the matmul's output; sink
        takes the rows' K | V (one copy) and gives what they attend to."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, w.weight, w.bias)
        qk = qkv[..., : (hq + hkv) * d].unflatten(-1, (hq + hkv, d))
        _rotate_into(qk, F.rms_norm(qk, (d,), None, self.q_norm.variance_epsilon) * w.qk_norm_weight, rope)
        keys, values = sink(qkv[..., hq * d :].unflatten(-1, (2, hkv, d)))
        return attend(qkv[..., : hq * d].unflatten(-1, (hq, d)), keys, values, attn_mask)


@dataclasses.dataclass(frozen=True)
class FusedAttention:
    """One layer's slices of the model's stacked fused attention weights (views)."""

    weight: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q (interleaved heads) | k | v
    bias: torch.Tensor | None
    qk_norm_weight: torch.Tensor  # [Hq + Hkv, D]: q_norm's weight for each query head, then k_norm's for each key head


class DFlashMLP(Qwen3MLP):
    """Qwen3's MLP (same weights, same unfused forward) with a fused inference form: gate and up one matmul."""

    fused = False

    @torch.no_grad()
    def fuse(self) -> None:
        if self.fused:
            return
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        self.gate_up_proj.weight = nn.Parameter(w)
        del self.gate_proj, self.up_proj
        self.register_state_dict_post_hook(_split_gate_up)
        self.register_load_state_dict_pre_hook(_join_gate_up)
        self.fused = True

    def fused_forward(self, x: torch.Tensor, residual: torch.Tensor, inplace: bool) -> torch.Tensor:
        """residual + mlp(x): gate | up one matmul, the activation, the product, down_proj with the residual add."""
        gate_up = self.gate_up_proj(x)
        i = self.intermediate_size
        return _linear_residual(self.act_fn(gate_up[..., :i]) * gate_up[..., i:], self.down_proj, residual, inplace)


def _split_gate_up(module, state_dict, prefix, local_metadata) -> None:
    gate, up = state_dict.pop(prefix + "gate_up_proj.weight").chunk(2)
    state_dict[prefix + "gate_proj.weight"], state_dict[prefix + "up_proj.weight"] = gate, up


def _join_gate_up(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    keys = (prefix + "gate_proj.weight", prefix + "up_proj.weight")
    if all(k in state_dict for k in keys):
        state_dict[prefix + "gate_up_proj.weight"] = torch.cat([state_dict.pop(k) for k in keys])


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, join: Join, attn_mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, join, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fused(self, x: torch.Tensor, w: FusedAttention, rope: torch.Tensor, sink: Sink,
              attn_mask: torch.Tensor | None, inplace: bool = True) -> torch.Tensor:
        """The layer on fused weights, x [B, T, H] contiguous; inplace: x may be overwritten (it becomes the output, the
        residual adds accumulate into it), else the first add is out of place. Kernels on CUDA: 2 norms, 4 matmuls (2
        with the residual add), the q/k norm (+ a copy: its input is strided) and its weights, 3 rotary, the K/V copy
        (the sink's), q's copy before the fold, attention, the activation and its product: 17."""
        attn = self.self_attn.fused_forward(_norm(x, self.input_layernorm), w, rope, sink, attn_mask)
        h = _linear_residual(attn, self.self_attn.o_proj, x, inplace)
        return self.mlp.fused_forward(_norm(h, self.post_attention_layernorm), h, True)


class DFlashDraftModel(nn.Module):
    """Weights named as in z-lab drafter checkpoints: fc, hidden_norm, layers.{i}.*, norm."""

    def __init__(self, config: Qwen3Config, spec: DFlashSpec):
        super().__init__()
        self.config = config
        self.spec = spec
        n_feat = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_feat * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._table: RopeTable | None = None
        self.fused = False

    # ---- fusion (inference) ------------------------------------------------------------------
    @torch.no_grad()
    def fuse(self) -> DFlashDraftModel:
        """Fuse the weights for inference, in place; idempotent. Every layer's q | k | v projection becomes one slice of
        `qkv_weight` [layers, (Hq + 2 Hkv) D, H] (query heads interleaved, `interleaved_heads`; o_proj's columns
        permuted alike), so one batched matmul gives every layer's K | V rows of a commit; the q/k norm weights become
        `qk_norm_weight` [layers, Hq + Hkv, D] and `k_norm_weight` [layers, 1, 1, 1, D] (derived, refreshed after a
        load); each MLP's gate | up one matmul. `state_dict` (so `save`) and `load_state_dict` keep the checkpoint's
        layout. A fused model is for inference: its forward writes into its own activations."""
        if self.fused:
            return self
        a = self.layers[0].self_attn
        perm = interleaved_heads(a.num_heads, a.num_kv_heads)
        self.qkv_weight = nn.Parameter(torch.stack([self._fused_qkv(layer.self_attn, "weight", perm) for layer in self.layers]))
        bias = a.q_proj.bias is not None
        self.qkv_bias = nn.Parameter(torch.stack([self._fused_qkv(layer.self_attn, "bias", perm) for layer in self.layers])) if bias else None
        for layer in self.layers:
            attn = layer.self_attn
            attn.o_proj.weight = nn.Parameter(_permute_heads(attn.o_proj.weight, perm, attn.head_dim, dim=1))
            del attn.q_proj, attn.k_proj, attn.v_proj
            layer.mlp.fuse()
        self.register_buffer("qk_norm_weight", torch.empty(0), persistent=False)
        self.register_buffer("k_norm_weight", torch.empty(0), persistent=False)
        self._refresh_norm_weights()
        self.register_state_dict_post_hook(_unfuse_state)
        self.register_load_state_dict_pre_hook(_fuse_state)
        self.register_load_state_dict_post_hook(_refresh_after_load)
        self.fused = True
        return self

    @staticmethod
    def _fused_qkv(attn: DFlashAttention, kind: str, perm: list[int]) -> torch.Tensor:
        q = _permute_heads(getattr(attn.q_proj, kind), perm, attn.head_dim, dim=0)
        return torch.cat([q, getattr(attn.k_proj, kind), getattr(attn.v_proj, kind)])

    @torch.no_grad()
    def _refresh_norm_weights(self) -> None:
        a = self.layers[0].self_attn
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        self.qk_norm_weight = torch.stack([
            torch.cat([layer.self_attn.q_norm.weight.expand(hq, d), layer.self_attn.k_norm.weight.expand(hkv, d)])
            for layer in self.layers
        ])
        self.k_norm_weight = torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])[:, None, None, None]

    def _fused_attention(self, i: int) -> FusedAttention:
        return FusedAttention(self.qkv_weight[i], None if self.qkv_bias is None else self.qkv_bias[i], self.qk_norm_weight[i])

    def kv_rows(self, ctx: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Fused: every layer's K (normalized, rotated) | V rows of context rows ctx [B, T, H], [layers, B, T, 2, Hkv, D]:
        one batched matmul over the layers' K | V weights, one norm (+ its copy) and one multiply by the layers' k norm
        weights, 3 rotary kernels, K rotated in place in the matmul's output; rope [B or 1, T, 2, D]."""
        a = self.layers[0].self_attn
        hkv, d, lo = a.num_kv_heads, a.head_dim, a.num_heads * a.head_dim
        kv = torch.matmul(ctx[None], self.qkv_weight[:, lo:].transpose(1, 2)[:, None])  # [layers, B, T, 2 Hkv D]
        if self.qkv_bias is not None:
            kv += self.qkv_bias[:, None, None, lo:]
        k = kv[..., : hkv * d].unflatten(-1, (hkv, d))
        _rotate_into(k, F.rms_norm(k, (d,), None, a.k_norm.variance_epsilon) * self.k_norm_weight, rope)
        return kv.unflatten(-1, (2, hkv, d))

    # ---- context -------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, N*H] target features -> [B, T, H] fused context rows."""
        if self.fused:
            return _norm(self.fc(features), self.hidden_norm)
        return self.hidden_norm(self.fc(features))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] of positions [B, T]."""
        cos, sin = self.rotary_emb(x, positions)
        return cos[:, None], sin[:, None]

    def _rope_pairs(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(cos, signed sin) [B, T, 2, D] of positions [B, T] (the fused path's layout)."""
        return rope_pairs(*self.rotary_emb(x, positions))

    def _table_for(self) -> RopeTable:
        if self._table is None or self._table.rotary is not self.rotary_emb:  # load_dflash replaces the embedding
            self._table = RopeTable(self.rotary_emb)
        return self._table

    def _rope_from(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, T, D] of positions start..start+T-1 (x [1, T, H]), from the table when it applies."""
        table = self._table_for()
        if not table.fixed:
            return self._rope(x, torch.arange(start, start + x.shape[1], device=x.device)[None])
        return table(x, start, x.shape[1])

    def _pairs_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """(cos, signed sin) [1, T, 2, D] of positions start..start+T-1, from the table when it applies."""
        table = self._table_for()
        if not table.fixed:
            return self._rope_pairs(x, torch.arange(start, start + x.shape[1], device=x.device)[None])
        return table.pairs(x, start, x.shape[1])

    @torch.no_grad()
    def extend_context(self, cache: ContextKV, features: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append K/V of new context rows: features [B, T, N*H] at absolute positions [B, T] (default: the
        cache's next T positions, B = 1)."""
        ctx = self.project_context(features.to(self.fc.weight.dtype))
        if self.fused:
            rope = self._rope_pairs(ctx, positions) if positions is not None else self._pairs_from(ctx, cache.length)
            cache.append_all(self.kv_rows(ctx, rope))
        else:
            cos, sin = self._rope(ctx, positions) if positions is not None else self._rope_from(ctx, cache.length)
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.kv(ctx, cos, sin)
                cache.append(i, k, v)
        cache.length += features.shape[1]

    # ---- block ---------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, block_embeds: torch.Tensor, cache: ContextKV) -> torch.Tensor:
        """Hidden states (after the final norm) of the block rows [1, T, H] at positions L..L+T-1 (L = the cache's
        committed length), every row seeing all cached context: `forward(block, arange(L, L+T), cache=cache)`."""
        if self.fused:
            return self._fused_layers(block_embeds, self._pairs_from(block_embeds, cache.length), cache, None, None)
        cos, sin = self._rope_from(block_embeds, cache.length)
        return self._layers(block_embeds, cos, sin, cache, None, None)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: ContextKV | None = None,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (after the final norm) of the block rows.

        Either `cache` (inference: every block row sees all cached context) or `context` +
        `context_positions` + `attn_mask` (training: [B, 1, Q, C + Q] boolean, True = may attend).
        """
        ctx = None
        if context is not None:
            ctx = self.project_context(context.to(self.fc.weight.dtype))
        if self.fused:
            if ctx is not None:
                ctx = self.kv_rows(ctx, self._rope_pairs(ctx, context_positions))
            return self._fused_layers(block_embeds, self._rope_pairs(block_embeds, block_positions), cache, ctx, attn_mask)
        cos, sin = self._rope(block_embeds, block_positions)
        if ctx is not None:
            ctx = (ctx, *self._rope(ctx, context_positions))
        return self._layers(block_embeds, cos, sin, cache, ctx, attn_mask)

    def _layers(self, h, cos, sin, cache: ContextKV | None, ctx: tuple | None, attn_mask) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if cache is not None:
                join = functools.partial(cache.with_block, i)
            elif ctx is not None:
                join = _after(*layer.self_attn.kv(*ctx))
            else:
                join = _alone
            h = layer(h, cos, sin, join, attn_mask)
        return self.norm(h)

    def _fused_layers(self, h, rope, cache: ContextKV | None, ctx_rows: torch.Tensor | None, attn_mask) -> torch.Tensor:
        """The fused layers and the final norm; h (the caller's) is not written: the first residual add is out of place.
        ctx_rows: every layer's context K | V rows (`kv_rows`), when the block attends to them rather than a cache."""
        for i, layer in enumerate(self.layers):
            if cache is not None:
                sink = functools.partial(cache.with_block_rows, i)
            elif ctx_rows is not None:
                sink = _rows_after(ctx_rows[i])
            else:
                sink = _rows_alone
            h = layer.fused(h.contiguous(), self._fused_attention(i), rope, sink, attn_mask, inplace=i > 0)
        return _norm(h, self.norm)

    # ---- checkpoint (z-lab layout) -------------------------------------------------------------
    def config_dict(self) -> dict:
        d = self.config.to_dict()
        d.update(
            {
                "architectures": ["DFlashDraftModel"],
                "block_size": self.spec.block_size,
                "num_target_layers": self.spec.num_target_layers,
                "dflash_config": {
                    "mask_token_id": self.spec.mask_token_id,
                    "target_layer_ids": list(self.spec.target_layer_ids),
                },
            }
        )
        return d

    def save(self, directory: str | pathlib.Path) -> None:
        """config.json + model.safetensors in the z-lab layout (a fused model writes its weights unfused)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config_dict(), indent=2, sort_keys=True))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        save_file(state, str(directory / WEIGHTS_NAME))


def load_dflash(directory: str | pathlib.Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                fuse: bool = True) -> DFlashDraftModel:
    """A drafter checkpoint (z-lab layout) on device in dtype, in eval mode; fused for inference unless fuse=False
    (`DFlashDraftModel.fuse`: the forward dispatches far fewer kernels; the state dict keeps the checkpoint's layout)."""
    directory = pathlib.Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    spec = spec_from_config(cfg)
    qcfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("dflash_config", "architectures", "auto_map")})
    model = DFlashDraftModel(qcfg, spec)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {directory} does not match: missing {missing}, unexpected {unexpected}")
    model = model.to(device=device, dtype=dtype).eval()
    # The rotary frequencies stay float32 whatever the weights' dtype, as in training (fp32 weights, bf16 autocast) and in
    # the target: cast to bf16 they would put a position's angle off by radians a few hundred tokens in.
    model.rotary_emb = Qwen3RotaryEmbedding(model.config).to(device)
    return model.fuse() if fuse else model
