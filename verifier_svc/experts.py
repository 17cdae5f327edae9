"""The experts seam: capture the routed experts of every forward, and the exact byte map.

transformers (>= 5) MoE architectures dispatch their experts forward through
`ALL_EXPERTS_FUNCTIONS[config._experts_implementation]` with the routed ids of every token
(REFERENCE.md section 6). We register one implementation that records those ids (read-only) and
then calls the implementation the model would have used anyway, so outputs are unchanged. The same
seam is where an offloaded MXFP4 expert store will plug in.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from pdflash.types import ExpertUnion

IMPL_NAME = "pdflash_capture"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RouteRecorder:
    """Routed expert ids seen during one forward, per decoder layer."""

    def __init__(self) -> None:
        self._ids: list[tuple[int, torch.Tensor]] = []

    def add(self, layer: int, top_k_index: torch.Tensor) -> None:
        self._ids.append((layer, top_k_index.detach().reshape(-1)))

    def union(self, num_experts: dict[int, int]) -> ExpertUnion:
        """Layer -> the expert ids routed to. One scatter and one device->host copy for all layers (a
        forward calls each layer's experts once, with as many ids per layer); ids outside [0, n) are
        padding sentinels and are dropped."""
        if not self._ids:
            return {}
        layers = [layer for layer, _ in self._ids]
        if len(set(layers)) != len(layers) or len({ids.numel() for _, ids in self._ids}) != 1:
            return self._union_by_layer(num_experts)
        width = max(num_experts[layer] for layer in layers) + 1  # the last column takes the sentinels
        idx = torch.stack([ids for _, ids in self._ids])
        idx = torch.where((idx < 0) | (idx >= width - 1), width - 1, idx)
        seen = torch.zeros(idx.shape[0], width, dtype=torch.bool, device=idx.device).scatter_(1, idx, True)
        out = {}
        for layer, row in zip(layers, seen.tolist()):
            n = num_experts[layer]
            out[layer] = frozenset(e for e, hit in enumerate(row[:n]) if hit)
        return dict(sorted(out.items()))

    def _union_by_layer(self, num_experts: dict[int, int]) -> ExpertUnion:
        parts: dict[int, list[torch.Tensor]] = {}
        for layer, ids in self._ids:
            parts.setdefault(layer, []).append(ids)
        out: dict[int, frozenset[int]] = {}
        for layer, ps in sorted(parts.items()):
            n = num_experts[layer]
            out[layer] = frozenset(int(i) for i in torch.unique(torch.cat(ps)).tolist() if 0 <= i < n)
        return out


_active: contextvars.ContextVar[RouteRecorder | None] = contextvars.ContextVar("pdflash_route_recorder", default=None)


def _capture_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args, **kwargs):
    recorder = _active.get()
    if recorder is not None:
        recorder.add(module._pdflash_layer, top_k_index)
    return module._pdflash_inner_fn(module, hidden_states, top_k_index, *args, **kwargs)


ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, _capture_forward)


def experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its experts module (classes decorated with use_experts_implementation)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        fwd = getattr(type(module), "forward", None)
        if not (hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(fwd, "__wrapped__")):
            continue
        m = _LAYER_RE.search(name)
        if m is None:
            continue
        found[int(m.group(1))] = module
    return dict(sorted(found.items()))


def num_experts_of(module: nn.Module) -> int:
    for attr in ("num_experts", "num_local_experts"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            return v
    for p in module.parameters(recurse=False):
        return int(p.shape[0])
    raise ValueError(f"cannot tell the number of experts of {type(module).__name__}")


def expert_byte_map(model: nn.Module) -> dict[int, list[int]]:
    """Exact stored bytes of every (layer, expert), from the tensors as the verifier holds them.

    Every parameter or buffer of an experts module whose leading dimension is the expert count is
    stored per expert; its slice bytes are counted for that expert.
    """
    out: dict[int, list[int]] = {}
    for layer, module in experts_modules(model).items():
        n = num_experts_of(module)
        sizes = [0] * n
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        for t in tensors:
            if t.dim() >= 1 and t.shape[0] == n:
                per = t[0].numel() * t.element_size()
                for e in range(n):
                    sizes[e] += per
        out[layer] = sizes
    return out


class ExpertsSeam:
    """Installs the capture implementation on a loaded model."""

    def __init__(self, model: nn.Module):
        self.modules = experts_modules(model)
        if not self.modules:
            raise ValueError(
                f"{type(model).__name__} has no experts module using transformers' experts-implementation seam; "
                "supported: MoE architectures such as qwen3_moe, mixtral, gpt_oss, olmoe, qwen2_moe"
            )
        inner = getattr(model.config, "_experts_implementation", None) or "eager"
        if inner == IMPL_NAME:
            inner = "eager"
        self.inner = inner
        for layer, module in self.modules.items():
            module._pdflash_layer = layer
            module._pdflash_inner = inner
            # Looked up once here, not on every call of every layer.
            module._pdflash_inner_fn = ALL_EXPERTS_FUNCTIONS.get_interface(inner, type(module).forward.__wrapped__)
        model.set_experts_implementation(IMPL_NAME)
        self.num_experts = {layer: num_experts_of(m) for layer, m in self.modules.items()}

    @contextlib.contextmanager
    def record(self) -> Iterator[RouteRecorder]:
        recorder = RouteRecorder()
        token = _active.set(recorder)
        try:
            yield recorder
        finally:
            _active.reset(token)
