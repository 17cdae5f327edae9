"""The host expert store: every routed expert of every MoE layer as one contiguous MXFP4 slice of one host
arena (pinned when a GPU will read it), in `pdflash_kernels.mxfp4.ExpertLayout` (the unit a GPU slot holds and one
copy moves).

Experts come from the checkpoint's safetensors one layer at a time (`verifier_svc.checkpoint`: gpt-oss's MXFP4
`*_blocks`/`*_scales` byte for byte, float experts quantized with `pdflash_kernels.mxfp4.quantize`), or from a loaded model
(`from_model`), rows kept as the model stores them (gate/up concatenated, or gpt-oss's interleave: the kernels read
both; up-only experts, Nemotron-H's relu^2, hold their up rows alone: `ExpertLayout.gated` False). The byte map of an
offloaded verifier is the slice size of every expert: what a verify's union moves, exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from pdflash_kernels.installer import expert_weights, experts_modules, num_experts_of
from pdflash_kernels.fragments import (FragmentExperts, fragment_experts_over, fragments_fit, from_fragment_parts,
                                       section_bytes, to_fragment_parts)
from pdflash_kernels.mxfp4 import ExpertLayout, big_scales, from_pair_words, nibble_blocks, to_pair_words
from pdflash_kernels.moe import GATED_ACTS, ExpertWeights


@dataclasses.dataclass(frozen=True)
class GateLayout:
    """How gate/up rows and the activation read in every layer (the same for all layers of a model). The activation
    says whether there are gate rows at all (`gated`: pdflash_kernels.moe.ACT_RELU2 reads the up rows alone)."""

    row_mul: int
    up_off: int
    act: int
    alpha: float
    limit: float

    @property
    def gated(self) -> bool:
        return self.act in GATED_ACTS

    @classmethod
    def of(cls, w: ExpertWeights) -> "GateLayout":
        return cls(w.row_mul, w.up_offset, w.act, w.alpha, w.limit)


def layout_of(w: ExpertWeights) -> ExpertLayout:
    """The store slice of one of these experts (MXFP4 ExpertWeights: w1 2I rows, or I for up-only experts)."""
    return ExpertLayout(w.hidden, w.intermediate, w.b1 is not None, w.gated)


FORMATS = ("nibbles", "pair_words", "fragments")


class HostExpertStore:
    def __init__(self, layout: ExpertLayout, num_experts: dict[int, int], gate: GateLayout, pin: bool = False,
                 device: torch.device | str = "cpu", pair_words: bool = False, convert_on: torch.device | str | None = None,
                 fmt: str | None = None):
        """`device`: where the arena lies: the host (pinned with `pin`, for a GPU's cache to copy from), or a GPU itself
        (every expert resident there: `verifier_svc.model.resident_experts` then uses it as it is). `fmt` (the same bytes
        per slice in each, rearranged; `pdflash_kernels.moe.expert_format_for(device, ...)` says which a device gets):
        "nibbles" (mxfp4's checkpoint order, the torch reference's), "pair_words" (`pair_words` True: each 4-byte
        word's bits rearranged for the Triton kernels' cheapest decode, pdflash_kernels/mxfp4.py `to_pair_words`) or
        "fragments" (weights and scales as tensor-core fragment words, pdflash_kernels/fragments.py: the Gluon kernel's
        format; a store that meets a scale byte above 128, which fragment words cannot decode, turns itself into pair
        words while loading: `demoted`). `convert_on`: a GPU to rearrange host blocks on (a checkpoint's bytes), as they
        pass to the arena."""
        fmt = fmt or ("pair_words" if pair_words else "nibbles")
        if fmt not in FORMATS:
            raise ValueError(f"expert store format must be one of {FORMATS}, got {fmt!r}")
        if layout.gated != gate.gated:  # (the kernels read w1's rows by the activation, the slice holds them by layout)
            raise ValueError(f"a store of {'gated' if layout.gated else 'up-only'} expert slices with activation "
                             f"{gate.act}, which reads {'gate and up rows' if gate.gated else 'the up rows alone'}")
        if fmt == "fragments":
            why = fragments_fit(layout.hidden, layout.intermediate, layout.gated)
            if why:
                raise ValueError(f"these experts cannot be held as fragment words: {why}")
        self.format, self.demoted = fmt, False
        self.layout, self.num_experts, self.gate = layout, dict(sorted(num_experts.items())), gate
        self._row: dict[tuple[int, int], int] = {}
        for layer, n in self.num_experts.items():
            for e in range(n):
                self._row[(layer, e)] = len(self._row)
        self.arena = torch.zeros(len(self._row), layout.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.big_scales = False  # some scale byte > 128 (pdflash_kernels.mxfp4.big_scales): the kernels decode exactly
        self._convert_on = None if convert_on is None or torch.device(convert_on).type != "cuda" else torch.device(convert_on)
        self._slice_bytes = layout.nbytes  # (the layout recomputes it from its sections: read on every verify)

    @property
    def pair_words(self) -> bool:
        return self.format == "pair_words"

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
        big = big_scales(w.s1, w.s2)
        if self.format == "fragments" and big:
            self._demote()
        if self.format == "fragments":
            self._put_fragments(self.arena[rows], dict(w1_blocks=nibble_blocks(w.w1, w.pair_words), w1_scales=w.s1,
                                                       w2_blocks=nibble_blocks(w.w2, w.pair_words), w2_scales=w.s2))
        else:
            views["w1_blocks"][rows] = self._blocks(w.w1, w.pair_words).to(dev)
            views["w1_scales"][rows] = w.s1.to(dev)
            views["w2_blocks"][rows] = self._blocks(w.w2, w.pair_words).to(dev)
            views["w2_scales"][rows] = w.s2.to(dev)
        self.big_scales = self.big_scales or big
        if self.layout.has_bias:
            views["b1"][rows] = w.b1.to(dev)
            views["b2"][rows] = w.b2.to(dev)

    def _put_fragments(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Nibble-order parts ([n, ...] or one expert's) into arena rows [n, nbytes] in the fragments format."""
        src = {k: v.reshape(rows.shape[0], *v.shape[-2:]) for k, v in parts.items()}
        if self._convert_on is not None and src["w1_blocks"].device.type == "cpu":
            src = {k: v.to(self._convert_on) for k, v in src.items()}
        raw = to_fragment_parts(src, self.gate.row_mul, self.gate.up_off)
        for name, b in raw.items():
            section_bytes(rows, self.layout, name).copy_(b.to(rows.device))

    def _demote(self) -> None:
        """Fragments -> pair words, every row (those not yet filled are zeros either way): a scale byte above 128 was
        met, which fragment words cannot decode."""
        g = self.gate
        for layer, n in self.num_experts.items():
            first = self._row[(layer, 0)]
            rows = self.arena[first:first + n]
            raw = {name: section_bytes(rows, self.layout, name) for name in ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales")}
            if self._convert_on is not None and rows.device.type == "cpu":
                raw = {k: v.to(self._convert_on) for k, v in raw.items()}
            parts = from_fragment_parts(raw, self.layout, g.row_mul, g.up_off)
            views = self.layout.views(rows)
            for name, v in parts.items():
                if name.endswith("_blocks"):
                    v = to_pair_words(v)
                views[name].copy_(v.to(rows.device))
        self.format, self.demoted = "pair_words", True

    def weights(self, pool: torch.Tensor) -> ExpertWeights | FragmentExperts:
        """The kernels' weights over a slot pool [slots, slice_bytes] (a GPU slot pool, or this arena itself):
        ExpertWeights, or FragmentExperts in the fragments format."""
        g = self.gate
        if self.format == "fragments":
            return fragment_experts_over(pool, self.layout, g.row_mul, g.up_off, g.act, g.alpha, g.limit)
        v = self.layout.views(pool)
        return ExpertWeights(v["w1_blocks"], v["w2_blocks"], v["w1_scales"], v["w2_scales"], v.get("b1"), v.get("b2"),
                             row_mul=g.row_mul, up_off=g.up_off, act=g.act, alpha=g.alpha, limit=g.limit,
                             big_scales=self.big_scales, pair_words=self.pair_words)

    def refresh(self, w, pool: torch.Tensor):
        """`w`, this store's weights over `pool` made earlier (a cache made before the experts were read), as the store
        is now: made again where the store changed its format while loading (`demoted`), with its big_scales flag."""
        if getattr(w, "fragments", False) != (self.format == "fragments"):
            w = self.weights(pool)
        w.big_scales = self.big_scales
        return w

    def _blocks(self, blocks: torch.Tensor, pair_words: bool = False) -> torch.Tensor:
        """Blocks (pair words when `pair_words`) in this store's format (nibbles or pair words)."""
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
        views = self.layout.views(row)
        for name, v in views.items():
            if name not in parts or tuple(parts[name].shape) != tuple(v.shape[1:]) or parts[name].dtype != v.dtype:
                got = "missing" if name not in parts else f"{parts[name].dtype} {list(parts[name].shape)}"
                raise ValueError(f"layer {layer} expert {expert}: {name} is {got}, the store holds {v.dtype} {list(v.shape[1:])}")
        big = big_scales(parts["w1_scales"], parts["w2_scales"])
        if self.format == "fragments" and big:
            self._demote()
        if self.format == "fragments":
            self._put_fragments(row, {k: parts[k] for k in ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales")})
            for name in ("b1", "b2"):
                if name in views:
                    views[name][0].copy_(parts[name])
        else:
            for name, v in views.items():
                v[0].copy_(self._blocks(parts[name]) if name in ("w1_blocks", "w2_blocks") else parts[name])
        self.big_scales = self.big_scales or big

    def layer_weights(self, layer: int, arena: torch.Tensor | None = None) -> ExpertWeights:
        """One layer's experts (slot = expert id) over this arena's rows or a copy of it (e.g. on the device)."""
        first = self._row[(layer, 0)]
        arena = self.arena if arena is None else arena
        return self.weights(arena[first : first + self.num_experts[layer]])

    @classmethod
    def from_model(cls, model, pin: bool = False, progress=None, device: torch.device | str = "cpu",
                   pair_words: bool = False, convert_on: torch.device | str | None = None,
                   fmt: str | None = None) -> "HostExpertStore":
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
                layout, gate = layout_of(w), GateLayout.of(w)
                if callable(fmt):  # (a chooser of the format by the experts' shape: moe.expert_format_for)
                    fmt = fmt(layout)
                store = cls(layout, {l: num_experts_of(m) for l, m in modules.items()}, gate, pin=pin, device=device,
                            pair_words=pair_words, convert_on=convert_on, fmt=fmt)
            elif (layout_of(w), GateLayout.of(w)) != (store.layout, store.gate):
                raise ValueError(f"layer {layer}: experts of another shape or gate than the first layer's "
                                 f"({layout_of(w)}, {GateLayout.of(w)} after {store.layout}, {store.gate}): one store "
                                 "holds slices of one layout")
            store.put(layer, w)
            if progress is not None:
                progress(layer)
        return store
