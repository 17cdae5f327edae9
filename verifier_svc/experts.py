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
from collections.abc import Iterator

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from pdflash_kernels.installer import experts_modules, num_experts_of
from pdflash.types import ExpertUnion

IMPL_NAME = "pdflash_capture"


class RouteRecorder:
    """Routed expert ids seen during one forward, per decoder layer."""

    def __init__(self) -> None:
        self._ids: list[tuple[int, torch.Tensor]] = []

    def add(self, layer: int, top_k_index: torch.Tensor) -> None:
        self._ids.append((layer, top_k_index.detach().reshape(top_k_index.shape[0], -1)))

    def union(self, num_experts: dict[int, int], rows: int | None = None, start: int = 0) -> ExpertUnion:
        """Layer -> the expert ids routed to by rows [start, rows) (None: to the last); ids outside [0, n) are padding
        sentinels and are dropped. One concatenation and one device->host copy for all layers (right after a forward,
        each small torch op costs tens of microseconds: a unique per layer cost ~80 us a verify on the demo target)."""
        if not self._ids:
            return {}
        # rows: the real tokens of a forward padded to a bucket (a captured graph's routing buffers hold them all);
        # start: a wave's item begins there (verifier_svc.runner `forward_wave`)
        flat = torch.cat([ids[start:rows].reshape(-1) for _, ids in self._ids]).tolist()
        seen: dict[int, set[int]] = {}
        pos = 0
        for layer, ids in self._ids:
            n = ids[start:rows].numel()
            seen.setdefault(layer, set()).update(flat[pos:pos + n])
            pos += n
        return {layer: frozenset(e for e in ids if 0 <= e < num_experts[layer]) for layer, ids in sorted(seen.items())}


    def unions(self, num_experts: dict[int, int], starts: list[int]) -> list[ExpertUnion]:
        """A wave's unions, item i's from rows [starts[i], starts[i + 1]), with one device->host copy for all."""
        n_items = len(starts) - 1
        if not self._ids:
            return [{} for _ in range(n_items)]
        mats = [ids[: starts[-1]] for _, ids in self._ids]
        flat = torch.cat([m.reshape(-1) for m in mats]).tolist()
        seen: list[dict[int, set[int]]] = [{} for _ in range(n_items)]
        pos = 0
        for (layer, _), m in zip(self._ids, mats):
            k = m.shape[1] if m.dim() > 1 else 1
            for i in range(n_items):
                seen[i].setdefault(layer, set()).update(flat[pos + starts[i] * k : pos + starts[i + 1] * k])
            pos += m.numel()
        return [{layer: frozenset(e for e in ids if 0 <= e < num_experts[layer]) for layer, ids in sorted(u.items())}
                for u in seen]


_active: contextvars.ContextVar[RouteRecorder | None] = contextvars.ContextVar("pdflash_route_recorder", default=None)


def _capture_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args, **kwargs):
    recorder = _active.get()
    if recorder is not None:
        recorder.add(module._pdflash_layer, top_k_index)
    return module._pdflash_inner_fn(module, hidden_states, top_k_index, *args, **kwargs)


ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, _capture_forward)


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
