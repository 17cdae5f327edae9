"""The host expert store: every routed expert of every MoE layer as one contiguous MXFP4 slice of one host
arena (pinned when a GPU will read it), in `pdflash_kernels.mxfp4.ExpertLayout` (the unit a GPU slot holds and one
copy moves).

Experts come from the checkpoint's safetensors one layer at a time (`verifier_svc.checkpoint`: gpt-oss's MXFP4
`*_blocks`/`*_scales` byte for byte, float experts quantized with `pdflash_kernels.mxfp4.quantize`), or from a loaded model
(`from_model`), rows kept as the model stores them (gate/up concatenated, or gpt-oss's interleave: the kernels read
both). The byte map of an offloaded verifier is the slice size of every expert: what a verify's union moves, exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from pdflash_kernels.installer import expert_weights, experts_modules, num_experts_of
from pdflash_kernels.mxfp4 import ExpertLayout, big_scales, from_pair_words, to_pair_words
from pdflash_kernels.moe import ExpertWeights


@dataclasses.dataclass(frozen=True)
class GateLayout:
    """How gate/up rows and the activation read in every layer (the same for all layers of a model)."""

    row_mul: int
    up_off: int
    act: int
    alpha: float
    limit: float


class HostExpertStore:
    def __init__(self, layout: ExpertLayout, num_experts: dict[int, int], gate: GateLayout, pin: bool = False,
                 device: torch.device | str = "cpu", pair_words: bool = False, convert_on: torch.device | str | None = None):
        """`device`: where the arena lies: the host (pinned with `pin`, for a GPU's cache to copy from), or a GPU itself
        (every expert resident there: `verifier_svc.model.resident_experts` then uses it as it is). `pair_words`: the
        blocks are stored as pair words (pdflash_kernels/mxfp4.py `to_pair_words`: the same bytes per slice, each 4-byte word's
        bits rearranged for the GPU kernels' cheapest decode; `pdflash_kernels.moe.pair_words_for(device)` says when);
        `convert_on`: a GPU to rearrange host blocks on (a checkpoint's bytes), as they pass to the arena."""
        self.layout, self.num_experts, self.gate = layout, dict(sorted(num_experts.items())), gate
        self._row: dict[tuple[int, int], int] = {}
        for layer, n in self.num_experts.items():
            for e in range(n):
                self._row[(layer, e)] = len(self._row)
        self.arena = torch.zeros(len(self._row), layout.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.big_scales = False  # some scale byte > 128 (pdflash_kernels.mxfp4.big_scales): the kernels decode exactly
        self.pair_words = pair_words
        self._convert_on = None if convert_on is None or torch.device(convert_on).type != "cuda" else torch.device(convert_on)
        self._slice_bytes = layout.nbytes  # (the layout recomputes it from its sections: read on every verify)

    @property
    def slice_bytes(self) -> int:
        return self._slice_bytes

    @property
    def total_bytes(self) -> int:
        return self.arena.numel()

    def row(self, layer: int, expert: int) -> int:
        return self._row[(layer, expert)]

    def slice(self, layer: int, expert: int) -> torch.Tensor:
        return self.arena[self._row[(layer, expert)]]

    def byte_map(self) -> dict[int, list[int]]:
        return {layer: [self.layout.nbytes] * n for layer, n in self.num_experts.items()}

    def put(self, layer: int, w: ExpertWeights) -> None:
        """Pack one layer's MXFP4 experts (ExpertWeights with fp4 tensors, first dimension = expert)."""
        if not w.fp4:
            raise ValueError("the store holds MXFP4 experts")
        views = self.layout.views(self.arena)
        first = self._row[(layer, 0)]
        rows = slice(first, first + self.num_experts[layer])
        dev = self.arena.device
        views["w1_blocks"][rows] = self._blocks(w.w1, w.pair_words).to(dev)
        views["w1_scales"][rows] = w.s1.to(dev)
        views["w2_blocks"][rows] = self._blocks(w.w2, w.pair_words).to(dev)
        views["w2_scales"][rows] = w.s2.to(dev)
        self.big_scales = self.big_scales or big_scales(w.s1, w.s2)
        if self.layout.has_bias:
            views["b1"][rows] = w.b1.to(dev)
            views["b2"][rows] = w.b2.to(dev)

    def weights(self, pool: torch.Tensor) -> ExpertWeights:
        """ExpertWeights over a slot pool [slots, slice_bytes] (a GPU slot pool, or this arena itself)."""
        v = self.layout.views(pool)
        g = self.gate
        return ExpertWeights(v["w1_blocks"], v["w2_blocks"], v["w1_scales"], v["w2_scales"], v.get("b1"), v.get("b2"),
                             row_mul=g.row_mul, up_off=g.up_off, act=g.act, alpha=g.alpha, limit=g.limit,
                             big_scales=self.big_scales, pair_words=self.pair_words)

    def _blocks(self, blocks: torch.Tensor, pair_words: bool = False) -> torch.Tensor:
        """Blocks (pair words when `pair_words`) in this store's format."""
        if pair_words == self.pair_words:
            return blocks
        convert = to_pair_words if self.pair_words else from_pair_words
        if self._convert_on is not None and blocks.device.type == "cpu":
            return convert(blocks.to(self._convert_on)).cpu()
        return convert(blocks)

    def put_expert(self, layer: int, expert: int, parts: dict[str, torch.Tensor]) -> None:
        """Pack one expert's parts (ExpertLayout's section names: w1_blocks, w1_scales, w2_blocks, w2_scales[, b1, b2])
        into its slice."""
        row = self.slice(layer, expert).reshape(1, -1)
        for name, v in self.layout.views(row).items():
            if name not in parts or tuple(parts[name].shape) != tuple(v.shape[1:]) or parts[name].dtype != v.dtype:
                got = "missing" if name not in parts else f"{parts[name].dtype} {list(parts[name].shape)}"
                raise ValueError(f"layer {layer} expert {expert}: {name} is {got}, the store holds {v.dtype} {list(v.shape[1:])}")
            v[0].copy_(self._blocks(parts[name]) if name in ("w1_blocks", "w2_blocks") else parts[name])
        self.big_scales = self.big_scales or big_scales(parts["w1_scales"], parts["w2_scales"])

    def layer_weights(self, layer: int, arena: torch.Tensor | None = None) -> ExpertWeights:
        """One layer's experts (slot = expert id) over this arena's rows or a copy of it (e.g. on the device)."""
        first = self._row[(layer, 0)]
        arena = self.arena if arena is None else arena
        return self.weights(arena[first : first + self.num_experts[layer]])

    @classmethod
    def from_model(cls, model, pin: bool = False, progress=None, device: torch.device | str = "cpu",
                   pair_words: bool = False, convert_on: torch.device | str | None = None) -> "HostExpertStore":
        """Quantize every experts module of a loaded transformers model into a new store (its arena on `device`).
        Experts already quantized on their module (`_pdflash_mxfp4`, `verifier_svc.model.quantize_experts`) are taken
        as they are (`pdflash_kernels.installer.expert_weights`)."""
        modules = experts_modules(model)
        if not modules:
            raise ValueError(f"{type(model).__name__} has no experts modules")
        store = None
        for layer, module in modules.items():
            w = expert_weights(module, "mxfp4")
            if isinstance(w, str):
                raise ValueError(f"layer {layer}: experts the MXFP4 store cannot hold ({w})")
            if store is None:
                layout = ExpertLayout(w.hidden, w.intermediate, w.b1 is not None)
                gate = GateLayout(w.row_mul, w.up_offset, w.act, w.alpha, w.limit)
                store = cls(layout, {l: num_experts_of(m) for l, m in modules.items()}, gate, pin=pin, device=device,
                            pair_words=pair_words, convert_on=convert_on)
            store.put(layer, w)
            if progress is not None:
                progress(layer)
        return store
