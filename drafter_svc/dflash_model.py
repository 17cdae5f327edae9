"""The DFlash block drafter as a torch module, in the z-lab checkpoint layout.

A small Qwen3-style decoder with no embedding or LM head of its own (it borrows the target's).
Conditioning: outputs of N target layers are concatenated (N*H), projected by `fc` (no bias) and
normalized by `hidden_norm`. In every layer, K and V come from both the projected context rows
(committed tokens, absolute positions) and the block rows; Q comes from the block rows only. There is
no causal mask inside a block. See REFERENCE.md section 2.

Inference keeps a per-layer cache of context K/V (`ContextKV`): each round appends the rows of newly
committed tokens, then one forward over the block `[anchor, MASK x (B-1)]` gives B-1 drafts.
Training uses the same forward with an explicit attention mask over many blocks at once.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
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
    whole context, no allocation of a bigger tensor every round, which on a GPU can mean a device malloc)."""

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
        n, t = self._used[layer], k.shape[2]
        buf = self._k[layer]
        if buf is None or n + t > buf.shape[2]:
            cap = max(n + t, 2 * (0 if buf is None else buf.shape[2]), self.MIN_CAPACITY)
            self._k[layer] = self._grown(buf, k, n, cap)
            self._v[layer] = self._grown(self._v[layer], v, n, cap)
        self._k[layer][:, :, n : n + t] = k
        self._v[layer][:, :, n : n + t] = v
        self._used[layer] = n + t

    @staticmethod
    def _grown(old: torch.Tensor | None, like: torch.Tensor, n: int, cap: int) -> torch.Tensor:
        b, h, _, d = like.shape
        new = like.new_empty(b, h, cap, d)
        if old is not None:
            new[:, :, :n] = old[:, :, :n]
        return new


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
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor | None,
        ctx_v: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.kv(x, cos, sin)
        if ctx_k is not None:
            k = torch.cat([ctx_k, k], dim=2)
            v = torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attn_mask)
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

    # ---- context -------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, N*H] target features -> [B, T, H] fused context rows."""
        return self.hidden_norm(self.fc(features))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, positions)

    @torch.no_grad()
    def extend_context(self, cache: ContextKV, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append K/V of new context rows (features [B, T, N*H] at absolute positions [B, T])."""
        ctx = self.project_context(features.to(self.fc.weight.dtype))
        cos, sin = self._rope(ctx, positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            cache.append(i, k, v)
        cache.length += features.shape[1]

    # ---- block ---------------------------------------------------------------------------
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
        if context is not None:
            ctx = self.project_context(context.to(self.fc.weight.dtype))
            ccos, csin = self._rope(ctx, context_positions)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            if cache is not None:
                ck, cv = cache.layer(i)
            elif context is not None:
                ck, cv = layer.self_attn.kv(ctx, ccos, csin)
            else:
                ck = cv = None
            h = layer(h, cos, sin, ck, cv, attn_mask)
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
