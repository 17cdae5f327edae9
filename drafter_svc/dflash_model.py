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
    """Per-layer K/V of the projected context rows (already rotated), [B, Hkv, T, D] each. Grows as tokens commit.

    The rows live in per-layer buffers that double when full: a commit writes only its own rows (no copy of the
    whole context, no allocation of a bigger tensor every round, which on a GPU can mean a device malloc). A
    proposal's block rows go to the spare rows after the committed ones (`with_block`) and are never committed."""

    MIN_CAPACITY = 256

    def __init__(self, num_layers: int):
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._used = [0] * num_layers
        self.length = 0

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's context K and V (views of its buffers), or (None, None) before anything was committed."""
        if self._k[i] is None:
            return None, None
        n = self._used[i]
        return self._k[i][:, :, :n], self._v[i][:, :, :n]

    @property
    def k(self) -> list[torch.Tensor | None]:
        return [self.layer(i)[0] for i in range(len(self._k))]

    @property
    def v(self) -> list[torch.Tensor | None]:
        return [self.layer(i)[1] for i in range(len(self._v))]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, t = self._write(layer, k, v)
        self._used[layer] = n + t

    def with_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's context K and V followed by a block's rows k, v (views of its buffers), without committing them.

        The block's rows go to the spare rows past the committed ones: the attention of a proposal reads context and
        block in one view, and no copy of the context is made. The next `append` or `with_block` overwrites them."""
        n, t = self._write(layer, k, v)
        return self._k[layer][:, :, : n + t], self._v[layer][:, :, : n + t]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        """k, v into layer's rows n..n+t-1 (n = its committed rows), the buffers grown first when they are full."""
        n, t = self._used[layer], k.shape[2]
        buf = self._k[layer]
        if buf is None or n + t > buf.shape[2]:
            cap = max(n + t, 2 * (0 if buf is None else buf.shape[2]), self.MIN_CAPACITY)
            self._k[layer] = self._grown(buf, k, n, cap)
            self._v[layer] = self._grown(self._v[layer], v, n, cap)
        self._k[layer][:, :, n : n + t] = k
        self._v[layer][:, :, n : n + t] = v
        return n, t

    @staticmethod
    def _grown(old: torch.Tensor | None, like: torch.Tensor, n: int, cap: int) -> torch.Tensor:
        b, h, _, d = like.shape
        new = like.new_empty(b, h, cap, d)
        if old is not None:
            new[:, :, :n] = old[:, :, :n]
        return new


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated at its positions: transformers' apply_rotary_pos_emb for one tensor, the same ops in the same order
    (cos and sin already [B, 1, T, D]: unsqueezed once per forward, not per layer and tensor)."""
    return (x * cos) + (rotate_half(x) * sin)


class RopeTable:
    """Rotary cos/sin of positions 0..n-1, computed once and grown by doubling: a forward slices rows instead of
    computing them (on a GPU ~8 launches per forward). The same numbers as `Qwen3RotaryEmbedding` at those
    positions (elementwise: a position's row does not depend on the others); rope types whose frequencies depend on
    the length (dynamic, longrope) are not tabled (`fixed` is False: call the embedding itself)."""

    MIN_POSITIONS = 256

    def __init__(self, rotary: Qwen3RotaryEmbedding):
        self.rotary = rotary
        self.fixed = "dynamic" not in rotary.rope_type and rotary.rope_type != "longrope"
        self._rows: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, like: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, n, D] of positions start..start+n-1, in like's dtype on like's device."""
        key = (like.dtype, like.device)
        rows = self._rows.get(key)
        if rows is None or rows[0].shape[2] < start + n:
            size = max(start + n, self.MIN_POSITIONS, 2 * (0 if rows is None else rows[0].shape[2]))
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])
            rows = self._rows[key] = (cos[:, None], sin[:, None])
        return rows[0][:, :, start : start + n], rows[1][:, :, start : start + n]


# join(k, v) -> (K, V): what a block's rows attend to besides themselves (context before them, or nothing)
Join = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _alone(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def _after(ctx_k: torch.Tensor, ctx_v: torch.Tensor) -> Join:
    return lambda k, v: (torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2))


class DFlashAttention(nn.Module):
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
        """K (rotated) and V of rows x, [B, Hkv, T, D] each; cos, sin [B, 1, T, D]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, join: Join, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k, v = join(*self.kv(x, cos, sin))
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), k, v, attn_mask=attn_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, join: Join, attn_mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, join, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


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

    # ---- context -------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, N*H] target features -> [B, T, H] fused context rows."""
        return self.hidden_norm(self.fc(features))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] of positions [B, T]."""
        cos, sin = self.rotary_emb(x, positions)
        return cos[:, None], sin[:, None]

    def _rope_from(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, T, D] of positions start..start+T-1 (x [1, T, H]), from the table when it applies."""
        if self._table is None or self._table.rotary is not self.rotary_emb:  # load_dflash replaces the embedding
            self._table = RopeTable(self.rotary_emb)
        if not self._table.fixed:
            return self._rope(x, torch.arange(start, start + x.shape[1], device=x.device)[None])
        return self._table(x, start, x.shape[1])

    @torch.no_grad()
    def extend_context(self, cache: ContextKV, features: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append K/V of new context rows: features [B, T, N*H] at absolute positions [B, T] (default: the
        cache's next T positions, B = 1)."""
        ctx = self.project_context(features.to(self.fc.weight.dtype))
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
        cos, sin = self._rope(block_embeds, block_positions)
        ctx = None
        if context is not None:
            ctx = self.project_context(context.to(self.fc.weight.dtype))
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
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config_dict(), indent=2, sort_keys=True))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        save_file(state, str(directory / WEIGHTS_NAME))


def load_dflash(directory: str | pathlib.Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DFlashDraftModel:
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
    return model
