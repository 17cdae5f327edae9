"""Loading a MoE checkpoint for MXFP4 experts straight from its safetensors, one layer of experts at a time.

transformers would materialize every routed expert in the model's dtype first: a gpt-oss checkpoint's native MXFP4
experts are dequantized (without the `kernels` hub package, and always on a CPU), and a bf16 checkpoint's experts
are all loaded before anything can quantize them. Here instead:

- the model is built by transformers from its config with every *parameter* on the meta device (buffers, such as
  the rotary frequencies, are computed as usual), so nothing of the experts is allocated;
- every other parameter and persistent buffer is read from the safetensors by its name: the model's own, or where
  the checkpoint's are not, the names transformers' own renamings for the model give them at load (its conversion
  mapping's plain renames, such as Nemotron-H's `backbone.` -> `model.`: `named_as`). A checkpoint whose experts only
  transformers' merging converters make the model's, such as Mixtral's `block_sparse_moe.experts.N.w1`, is left to
  `from_pretrained`: `plan` says so and why;
- the experts are read per layer into the host store (`verifier_svc.expert_store`): gpt-oss's `*_blocks`/`*_scales`
  byte for byte (`pdflash_kernels.mxfp4.from_gpt_oss` only reshapes them), float experts (fused `gate_up_proj`/`down_proj`,
  or one `experts.N.{gate,up,down}_proj.weight` per expert; up-only experts, Nemotron-H's: `up_proj`/`down_proj`, or
  `experts.N.{up,down}_proj.weight`) quantized with `pdflash_kernels.mxfp4.quantize`.

Peak host memory is the non-expert weights + the MXFP4 store + one expert's weights in flight; the mapped file
pages of the layer being read also count in RSS until its file is closed (one layer of the checkpoint's experts).
Measured on a 4-layer gpt-oss-20b-shaped checkpoint (CPU, bf16): 5.1 GiB peak RSS from bf16 experts, 3.4 GiB from
native MXFP4, against 20.8 / 20.6 GiB for transformers' load followed by quantizing the loaded model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pathlib
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pdflash_kernels import mxfp4
from pdflash_kernels.installer import _activation, _up_only_activation, experts_modules, num_experts_of
from pdflash_kernels.mxfp4 import ExpertLayout

_MXFP4_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def native_mxfp4(config) -> bool:
    """The config declares gpt-oss's MXFP4 experts (`quantization_config: {"quant_method": "mxfp4"}`)."""
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method) or "").lower() == "mxfp4"


def fp8_blocks(config) -> tuple[int, int] | None:
    """The weight block of a block-scaled FP8 checkpoint (DeepSeek-V3's and Kimi K2's form: `quantization_config:
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}`; each quantized `X.weight` is float8 e4m3
    with a float32 `X.weight_scale_inv` of one scale a block), else None."""
    q = getattr(config, "quantization_config", None)
    get = (lambda k: q.get(k)) if isinstance(q, dict) else (lambda k: getattr(q, k, None))
    method = get("quant_method") if q is not None else None
    if str(getattr(method, "value", method) or "").lower() != "fp8":
        return None
    block = get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return None
    return int(block[0]), int(block[1])



def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A block-scaled FP8 weight [..., rows, cols] in `dtype`: each element times its block's scale, in float32, then
    rounded once (transformers' dequantization at load). The scale grid is [..., ceil(rows / block[0]), ceil(cols /
    block[1])]: the last blocks of a dimension the block does not divide are partial (DeepSeek-V3's 576-row
    kv_a_proj_with_mqa)."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 scales {list(scale_inv.shape)} do not match a weight {list(weight.shape)} in "
                         f"{block[0]}x{block[1]} blocks (expected [..., {grid[0]}, {grid[1]}])")
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * s).to(dtype)


class Tensors:
    """Which safetensors file holds each tensor of a checkpoint directory (headers only; nothing is read). Tensors are
    named as the checkpoint stores them, or as `renamed` names them (`stored` keeps the checkpoint's own key)."""

    def __init__(self, directory: str | pathlib.Path):
        from safetensors import safe_open

        self.directory = pathlib.Path(directory)
        self.file: dict[str, pathlib.Path] = {}
        self.stored: dict[str, str] = {}  # name -> the key the checkpoint stores it under
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for path in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self.file[key] = path
                    self.stored[key] = key
                    self._meta[key] = (tuple(sl.get_shape()), sl.get_dtype())

    def renamed(self, rename: Callable[[str], str]) -> "Tensors":
        """The same tensors, each named `rename(its stored key)` (nothing is read again)."""
        out = copy.copy(self)
        out.file, out.stored, out._meta = {}, {}, {}
        for name, key in self.stored.items():
            new = rename(key)
            if new in out.file:
                raise ValueError(f"the checkpoint in {self.directory} has two tensors named {new} once renamed as "
                                 f"transformers loads it ({out.stored[new]}, {key})")
            out.file[new], out.stored[new], out._meta[new] = self.file[name], key, self._meta[name]
        return out

    def __contains__(self, key: str) -> bool:
        return key in self.file

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def dtype(self, key: str) -> str:
        """safetensors' name of the stored dtype: "BF16", "F32", "U8", ..."""
        return self._meta[key][1]

    @contextlib.contextmanager
    def open(self, keys: list[str]):
        """`read(key, index=None)`: a tensor, or its [index] along the first dimension (only those bytes are read),
        from files that stay mapped until the block ends."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            handles = {path: stack.enter_context(safe_open(str(path), "pt")) for path in {self.file[k] for k in keys}}

            def read(key: str, index: int | None = None) -> torch.Tensor:
                h, stored = handles[self.file[key]], self.stored[key]
                return h.get_tensor(stored) if index is None else h.get_slice(stored)[index]

            yield read

    def read(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, one file opened (mapped) at a time and closed before the next."""
        from safetensors import safe_open

        by_file: dict[pathlib.Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.file[k], []).append(k)
        for path, ks in by_file.items():
            with safe_open(str(path), "pt") as f:
                for k in ks:
                    yield k, f.get_tensor(self.stored[k])


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (allocated nowhere); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _keep_fp32(model, dtype: torch.dtype) -> re.Pattern | None:
    """transformers' keep-in-float32 rule at load (modules matched by name): fp16 for `_keep_in_fp32_modules`,
    fp16/bf16 for `_keep_in_fp32_modules_strict`."""
    pats: list[str] = []
    if dtype == torch.float16:
        pats += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        pats += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not pats:
        return None
    return re.compile("|".join(re.escape(p).replace(r"\*", r"[^.]*") for p in pats))


# ---- the experts of one layer, as the checkpoint stores them ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertsForm:
    """How one experts module is read and what it becomes: the layout of its store slices and its gate."""

    path: str  # the module's name, e.g. "model.layers.3.mlp.experts"
    kind: str  # "mxfp4" (gpt-oss blocks/scales), "fused" (gate_up_proj/down_proj tensors), "per_expert"
    num_experts: int
    hidden: int
    intermediate: int
    has_bias: bool
    transposed: bool  # fused float tensors stored [E, in, out] (gpt-oss's gate_up_proj [E, H, 2I])
    row_mul: int
    up_off: int
    act: int
    alpha: float
    limit: float
    fp8_block: tuple[int, int] | None = None  # float experts stored block-scaled FP8 (each weight has its scale_inv)
    gated: bool = True  # False: up-only experts (no gate: up_proj/down_proj, relu^2), w1 the I up rows

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.hidden, self.intermediate, self.has_bias, self.gated)

    @property
    def first(self) -> str:
        """The first projection's name: gate_up_proj, or up_proj on up-only experts."""
        return "gate_up_proj" if self.gated else "up_proj"

    @property
    def rows1(self) -> int:
        return self.layout.rows1

    @property
    def per_expert(self) -> tuple[str, ...]:
        """The projections of one expert stored on its own (`experts.N.{name}_proj.weight`), w1's first."""
        return ("gate", "up", "down") if self.gated else ("up", "down")

    def keys(self) -> list[str]:
        p = self.path
        if self.kind == "mxfp4":
            ks = [f"{p}.{n}" for n in _MXFP4_PARTS]
        elif self.kind == "fused":
            ks = [f"{p}.{self.first}", f"{p}.down_proj"]
        else:
            ks = [f"{p}.{e}.{n}_proj.weight" for e in range(self.num_experts) for n in self.per_expert]
        if self.fp8_block is not None:
            ks += [f"{k}_scale_inv" for k in ks]
        if self.has_bias:
            ks += [f"{p}.{self.first}_bias", f"{p}.down_proj_bias"]
        return ks

    def expected(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """key -> (shape, stored dtype or None for any float)."""
        e, h, i, p = self.num_experts, self.hidden, self.intermediate, self.path
        g = mxfp4.GROUP
        if self.kind == "mxfp4":
            out = {
                f"{p}.gate_up_proj_blocks": ((e, 2 * i, h // g, 16), "U8"),
                f"{p}.gate_up_proj_scales": ((e, 2 * i, h // g), "U8"),
                f"{p}.down_proj_blocks": ((e, h, i // g, 16), "U8"),
                f"{p}.down_proj_scales": ((e, h, i // g), "U8"),
            }
        elif self.kind == "fused":
            r1 = self.rows1
            out = {
                f"{p}.{self.first}": ((e, h, r1) if self.transposed else (e, r1, h), None),
                f"{p}.down_proj": ((e, i, h) if self.transposed else (e, h, i), None),
            }
        else:
            out = {}
            for x in range(e):
                for n in self.per_expert:
                    out[f"{p}.{x}.{n}_proj.weight"] = ((h, i) if n == "down" else (i, h), None)
        if self.fp8_block is not None:  # the weights float8 e4m3, each with its float32 grid of block scales
            bn, bk = self.fp8_block
            for key, (shape, _) in list(out.items()):
                out[key] = (shape, "F8_E4M3")
                out[f"{key}_scale_inv"] = ((*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk)), "F32")
        if self.has_bias:
            out[f"{p}.{self.first}_bias"] = ((e, self.rows1), None)
            out[f"{p}.down_proj_bias"] = ((e, h), None)
        return out


_FLOATS = ("F32", "BF16", "F16", "F64")


def _check(tensors: Tensors, form: ExpertsForm) -> None:
    """Every tensor of the layer is there with its shape and dtype, or one line that names the tensor."""
    for key, (shape, dtype) in form.expected().items():
        if key not in tensors:
            partner = key.replace("_scales", "_blocks") if key.endswith("_scales") else key.replace("_blocks", "_scales")
            why = f" (its {partner.rsplit('.', 1)[-1]} is there)" if partner != key and partner in tensors else ""
            raise ValueError(f"the checkpoint in {tensors.directory} has no tensor {key}{why}")
        got, stored = tensors.shape(key), tensors.dtype(key)
        if got != shape or (dtype is not None and stored != dtype) or (dtype is None and stored not in _FLOATS):
            want = dtype or "a float dtype"
            raise ValueError(f"checkpoint tensor {key} is {stored} {list(got)}, expected {want} {list(shape)} "
                             f"({form.num_experts} experts, hidden {form.hidden}, intermediate {form.intermediate})")


def _why_not(module: nn.Module) -> str | None:
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    if not all(isinstance(getattr(module, n, None), torch.Tensor) for n in (first, "down_proj")):
        return f"no {first}/down_proj parameters"
    return None


def experts_form(tensors: Tensors, path: str, module: nn.Module, mxfp4_config: bool,
                 fp8_block: tuple[int, int] | None = None) -> ExpertsForm | str:
    """How the checkpoint stores this experts module, or why it cannot be read here (then from_pretrained loads it).
    The module's parameters give the shapes (they may be on the meta device)."""
    why = _why_not(module)
    if why:
        return why
    gated = bool(getattr(module, "has_gate", True))
    w1 = module.gate_up_proj if gated else module.up_proj
    transposed = bool(getattr(module, "is_transposed", False))
    e = num_experts_of(module)
    r1, h = (w1.shape[2], w1.shape[1]) if transposed else (w1.shape[1], w1.shape[2])
    if gated:
        inter = r1 // 2
        row_mul, up_off = (1, inter) if getattr(module, "is_concatenated", True) else (2, 1)
        act, why = _activation(module, inter, row_mul, up_off)
    else:  # up-only (Nemotron-H): w1 is the I up rows, read by the kernels' ACT_RELU2
        inter, row_mul, up_off = r1, 1, 0
        act, why = _up_only_activation(module)
    if act < 0:
        return why
    has_bias = bool(getattr(module, "has_bias", False))
    if mxfp4_config or f"{path}.gate_up_proj_blocks" in tensors:
        if not gated:
            return "up-only experts in MXFP4 blocks (only gpt-oss's gate_up_proj_blocks are read)"
        kind = "mxfp4"
    elif form_key(path, "fused", gated) in tensors:
        kind = "fused"
    elif form_key(path, "per_expert", gated) in tensors and row_mul == 1 and not has_bias and not transposed:
        kind = "per_expert"
    else:
        names = "fused gate_up_proj, experts.N.gate_proj, MXFP4 blocks" if gated else "fused up_proj, experts.N.up_proj"
        return f"no experts tensors under {path} in a form read here ({names})"
    if h % mxfp4.GROUP or inter % mxfp4.GROUP:
        return f"hidden {h} / intermediate {inter} not multiples of {mxfp4.GROUP} (MXFP4 groups)"
    scaled = kind != "mxfp4" and f"{form_key(path, kind, gated)}_scale_inv" in tensors
    fp8 = fp8_block if fp8_block is not None and scaled else None
    return ExpertsForm(path, kind, e, h, inter, has_bias, transposed, row_mul, up_off, act,
                       float(getattr(module, "alpha", 1.702)), float(getattr(module, "limit", 7.0)), fp8, gated)


def form_key(path: str, kind: str, gated: bool = True) -> str:
    """The first weight tensor of a float experts module stored as `kind` (`gated` False: up-only experts)."""
    if kind == "fused":
        return f"{path}.{'gate_up_proj' if gated else 'up_proj'}"
    return f"{path}.0.{'gate' if gated else 'up'}_proj.weight"


def read_experts(tensors: Tensors, form: ExpertsForm, quantize_on: torch.device | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """One layer's experts, one expert at a time, as the parts of its store slice (`ExpertLayout` section names): the
    checkpoint's MXFP4 bytes (kind "mxfp4"), or its float weights quantized (on `quantize_on`: a CUDA device makes it
    fast). Only one expert's weights are read from the mapped files at a time."""
    _check(tensors, form)
    p, e_count = form.path, form.num_experts
    with tensors.open(form.keys()) as read:
        b1 = read(f"{p}.{form.first}_bias").to(torch.bfloat16) if form.has_bias else None
        b2 = read(f"{p}.down_proj_bias").to(torch.bfloat16) if form.has_bias else None
        dev = quantize_on or torch.device("cpu")

        def q(w: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
            try:
                b, s = mxfp4.quantize(w.to(dev))
            except ValueError as err:  # non-finite weights
                raise ValueError(f"cannot quantize {key} to MXFP4: {err}") from err
            return b.cpu(), s.cpu()

        for e in range(e_count):
            if form.kind == "mxfp4":
                parts = {
                    "w1_blocks": read(f"{p}.gate_up_proj_blocks", e).flatten(1),
                    "w1_scales": read(f"{p}.gate_up_proj_scales", e),
                    "w2_blocks": read(f"{p}.down_proj_blocks", e).flatten(1),
                    "w2_scales": read(f"{p}.down_proj_scales", e),
                }
            else:  # (block-scaled FP8 dequantized exactly: float32, no rounding before the MXFP4 quantization)
                k1, w1, k2, w2 = _float_expert(read, form, e, torch.float32)
                (b1q, s1q), (b2q, s2q) = q(w1, k1), q(w2, k2)
                parts = {"w1_blocks": b1q, "w1_scales": s1q, "w2_blocks": b2q, "w2_scales": s2q}
            if form.has_bias:
                parts["b1"], parts["b2"] = b1[e], b2[e]
            yield e, parts


def _float_expert(read, form: ExpertsForm, e: int, fp8_dtype: torch.dtype):
    """(key, gate_up [2I, H] (up [I, H] for up-only experts), key, down [H, I]) of expert e of a float experts layer
    (rows = output features), as stored; block-scaled FP8 dequantized to `fp8_dtype`."""
    p, fb = form.path, form.fp8_block

    def weight(key: str, index: int | None = None) -> torch.Tensor:
        w = read(key, index)
        return w if fb is None else dequantize_fp8(w, read(f"{key}_scale_inv", index), fb, fp8_dtype)

    if form.kind == "fused":
        k1, k2 = f"{p}.{form.first}", f"{p}.down_proj"
        w1, w2 = weight(k1, e), weight(k2, e)
        return (k1, w1.T, k2, w2.T) if form.transposed else (k1, w1, k2, w2)
    k2 = f"{p}.{e}.down_proj.weight"
    if not form.gated:
        k1 = f"{p}.{e}.up_proj.weight"
        return k1, weight(k1), k2, weight(k2)
    k1 = f"{p}.{e}.gate_proj.weight"
    return k1, torch.cat([weight(k1), weight(f"{p}.{e}.up_proj.weight")]), k2, weight(k2)


# ---- the plan: model skeleton + what is read from where --------------------------------------------------------
@dataclasses.dataclass
class DirectLoad:
    tensors: Tensors
    model: nn.Module  # parameters on meta until `load_rest`; experts parameters zero-size
    forms: dict[int, ExpertsForm]  # layer -> how its experts are stored
    rest: dict[str, list[tuple[nn.Module, str]]]  # checkpoint key -> every (module, attribute) holding it
    dtype: torch.dtype
    native_mxfp4: bool
    fp8_block: tuple[int, int] | None = None  # a block-scaled FP8 checkpoint: its quantized weights are dequantized

    @property
    def num_experts(self) -> dict[int, int]:
        return {layer: f.num_experts for layer, f in self.forms.items()}

    def load_rest(self, progress: Callable[[int], None] | None = None) -> None:
        """Every non-expert parameter and persistent buffer from the safetensors, cast to the model's dtype."""
        keep = _keep_fp32(self.model, self.dtype)
        scales = {}  # block-scaled FP8: every weight's scale grid (small), read in one pass over the files
        if self.fp8_block is not None:
            scales = dict(self.tensors.read([f"{k}_scale_inv" for k in self.rest if f"{k}_scale_inv" in self.tensors]))
        for key, t in self.tensors.read(list(self.rest)):
            owners = self.rest[key]
            module, attr = owners[0]
            old = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
            if tuple(t.shape) != tuple(old.shape):
                raise ValueError(f"checkpoint tensor {key} is {list(t.shape)}, the model expects {list(old.shape)}")
            if f"{key}_scale_inv" in scales:
                t = dequantize_fp8(t, scales[f"{key}_scale_inv"], self.fp8_block, old.dtype)
            dtype = torch.float32 if keep is not None and keep.search(key) and t.is_floating_point() else (
                old.dtype if t.is_floating_point() else t.dtype)
            t = t.to(dtype)
            if attr in module._parameters:
                new = nn.Parameter(t, requires_grad=False)
                for m, a in owners:  # tied weights: one tensor for every name
                    m._parameters[a] = new
            else:
                for m, a in owners:
                    m._buffers[a] = t
            if progress is not None:
                progress(1)
        for name, p in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if p.device.type == "meta":
                raise ValueError(f"{name} was not loaded from the checkpoint in {self.tensors.directory}")

    def load_float_experts(self) -> None:
        """Every experts module's weights in the model's dtype, as transformers would hold them (`--experts native` on
        a block-scaled FP8 checkpoint: each weight dequantized in float32, then rounded once to the model's dtype)."""
        for form in self.forms.values():
            if form.kind == "mxfp4":
                raise ValueError(f"{form.path}: MXFP4 experts are served with --experts mxfp4")
            _check(self.tensors, form)
            module = self.model.get_submodule(form.path)
            with self.tensors.open(form.keys()) as read:
                pairs = [_float_expert(read, form, e, self.dtype)[1::2] for e in range(form.num_experts)]
                params = {form.first: torch.stack([w1.T if form.transposed else w1 for w1, _ in pairs]),
                          "down_proj": torch.stack([w2.T if form.transposed else w2 for _, w2 in pairs])}
                if form.has_bias:
                    params[f"{form.first}_bias"] = read(f"{form.path}.{form.first}_bias")
                    params["down_proj_bias"] = read(f"{form.path}.down_proj_bias")
            for name, t in params.items():
                setattr(module, name, nn.Parameter(t.to(self.dtype).contiguous(), requires_grad=False))

    def experts(self, quantize_on: torch.device | None = None):
        """(layer, iterator of (expert, parts)) for every MoE layer, read lazily (`read_experts`)."""
        for layer, form in self.forms.items():
            yield layer, read_experts(self.tensors, form, quantize_on)


def _renamings(model: nn.Module) -> Callable[[str], str] | None:
    """transformers' plain renamings of checkpoint keys for this model (its conversion mapping's `WeightRenaming`s,
    which `from_pretrained` applies before anything else: Nemotron-H's `backbone.` -> `model.`), as one function of a
    key; None where this transformers has none or no such API. Its converters (experts merged from per-expert tensors)
    are not applied: `experts_form` reads per-expert tensors itself."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - an older or newer transformers: the checkpoint's names as they are
        return None
    if not renamings:
        return None
    return lambda key: apply_renamings(key, renamings)


def named_as(tensors: Tensors, model: nn.Module) -> Tensors:
    """The checkpoint's tensors under the names the model's parameters go by: as stored where every parameter outside
    the experts is found so, else renamed as transformers renames them at load (`_renamings`) where that finds more."""
    experts = {id(p) for m in experts_modules(model).values() for p in m.parameters(recurse=False)}
    names = [n for n, p in model.named_parameters() if id(p) not in experts]
    found = sum(n in tensors for n in names)
    if found == len(names):
        return tensors
    rename = _renamings(model)
    if rename is None:
        return tensors
    try:
        renamed = tensors.renamed(rename)
    except ValueError:  # two tensors under one name: transformers' own load decides (plan then says which is missing)
        return tensors
    return renamed if sum(n in renamed for n in names) > found else tensors


def plan(directory: str | pathlib.Path, config, dtype: torch.dtype) -> DirectLoad | str:
    """A direct load of this checkpoint (model skeleton built, nothing read yet), or why it cannot be one.
    For a native-MXFP4 checkpoint, a layer whose experts cannot be read raises (one line naming the tensor)."""
    from transformers import AutoModelForCausalLM

    native = native_mxfp4(config)
    fp8 = fp8_blocks(config)
    quant = getattr(config, "quantization_config", None)
    if quant is not None and not native and fp8 is None:  # gptq, awq, ...: their weights need transformers' quantizer
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        return f"a {method} checkpoint (only MXFP4, block-scaled FP8 or float experts are read directly)"
    tensors = Tensors(directory)
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the experts are ours: transformers builds plain float experts modules
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.config._name_or_path = str(directory)
    modules = experts_modules(model)
    if not modules:
        return f"{type(model).__name__} has no experts modules"
    tensors = named_as(tensors, model)
    path_of = {id(m): name for name, m in model.named_modules()}
    forms: dict[int, ExpertsForm] = {}
    for layer, module in modules.items():
        form = experts_form(tensors, path_of[id(module)], module, native, fp8)
        if isinstance(form, str):
            if native:
                raise ValueError(f"layer {layer}: experts the MXFP4 store cannot hold ({form})")
            return form
        forms[layer] = form
    if len({(f.hidden, f.intermediate, f.has_bias, f.gated, f.row_mul, f.up_off, f.act, f.alpha, f.limit)
            for f in forms.values()}) > 1:
        return "experts of different shapes or gates in different layers"
    for module in modules.values():  # no expert weight is ever allocated: the store holds them
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape[0], 0, dtype=p.dtype), requires_grad=False))
    owners: list[tuple[str, nn.Module, str, torch.Tensor]] = []  # every name of every tensor still to load
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                owners.append((f"{mname}.{attr}" if mname else attr, module, attr, p))
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                owners.append((f"{mname}.{attr}" if mname else attr, module, attr, b))
    key_of: dict[int, str] = {}  # id(tensor) -> the checkpoint key that loads it (tied weights share one)
    for name, _, _, t in owners:
        if name in tensors:
            key_of.setdefault(id(t), name)
    rest: dict[str, list[tuple[nn.Module, str]]] = {}
    for name, module, attr, t in owners:
        if id(t) in key_of:
            rest.setdefault(key_of[id(t)], []).append((module, attr))
        elif t.device.type == "meta":  # a parameter nothing in the checkpoint loads
            if native:
                raise ValueError(f"the checkpoint in {directory} has no tensor {name}")
            return f"the checkpoint has no tensor named {name} (transformers renames its keys at load)"
        # else: a persistent buffer the checkpoint does not carry keeps its computed value
    gen = pathlib.Path(directory) / "generation_config.json"
    if gen.exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    return DirectLoad(tensors, model, forms, rest, dtype, native, fp8)
