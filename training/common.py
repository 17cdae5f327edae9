"""What the training scripts share: devices and seeds, the target's features, greedy decoding, DFlash
blocks (the same block layout for training and for the acceptance simulation), and a loss table."""

from __future__ import annotations

import json
import math
import pathlib
import random
import time

import numpy as np
import torch


# ---- machine ---------------------------------------------------------------------------------------

def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain float32 on the CPU (smoke runs)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def write_json(path: str | pathlib.Path, obj: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---- target ----------------------------------------------------------------------------------------

class _Bf16Experts:
    """A view of an experts module whose expert weights read as bf16 (autograd flows to the fp32 masters)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name in ("gate_up_proj", "down_proj") and isinstance(value, torch.Tensor):
            return value.to(torch.bfloat16)
        return value


def _grouped_mm_bf16(module, hidden_states, top_k_index, top_k_weights):
    # torch's grouped_mm wants bf16 on CUDA; under autocast the fp32 master weights would reach it as fp32.
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(_Bf16Experts(module), hidden_states, top_k_index, top_k_weights)


def use_fast_experts(model, device: torch.device, training: bool) -> str:
    """Set (and return) the first experts implementation that runs here: training in bf16 autocast on
    CUDA -> grouped matmuls on bf16 views of the weights; float32 inference on CUDA -> the exact eager
    loop (matches the CPU verifier's float32); bf16 on CUDA or anything on the CPU -> grouped_mm."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if "grouped_mm_bf16" not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register("grouped_mm_bf16", _grouped_mm_bf16)
    dtype = next(model.parameters()).dtype
    if device.type != "cuda":
        candidates = ["grouped_mm", "eager"]
    elif training:
        candidates = ["grouped_mm_bf16", "grouped_mm", "eager"]
    else:
        candidates = ["grouped_mm", "eager"] if dtype == torch.bfloat16 else ["eager"]
    ids = torch.randint(2, model.config.vocab_size, (2, 16), device=device)
    for impl in candidates:
        try:
            model.set_experts_implementation(impl)
            if training:
                with autocast(device):
                    out = model(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
            return impl
        except Exception as e:  # noqa: BLE001 - any failure means: try the next implementation
            print(f"experts implementation {impl!r} does not run here ({type(e).__name__}: {e}); trying the next")
    raise RuntimeError("no experts implementation runs here")


def load_target(directory: str | pathlib.Path, device: torch.device, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    use_fast_experts(model, device, training=False)
    return model


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, T, N*H] = hidden_states[l + 1] of each target layer l, concatenated; greedy [B, T]).

    greedy[t] is the target's argmax after seeing ids[:t + 1], i.e. its prediction for position t + 1.
    """
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1)
    return feats, out.logits.argmax(-1)


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, n_new: int, chunk: int = 4096, desc: str | None = None) -> torch.Tensor:
    """Greedy continuations [N, n_new] of equal-length prompts [N, Lp], batched, with a KV cache."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from pdflash.hf_compat import cache_kwarg

    kv = cache_kwarg(model)
    outs = []
    bar = tqdm(total=n_new * math.ceil(len(prompts) / chunk), desc=desc or "greedy", leave=False, mininterval=2.0)
    for i in range(0, len(prompts), chunk):
        ids = prompts[i : i + chunk]
        cache = DynamicCache()
        logits = model(input_ids=ids, **{kv: cache}, use_cache=True).logits[:, -1]
        toks = []
        for _ in range(n_new):
            nxt = logits.argmax(-1, keepdim=True)
            toks.append(nxt)
            bar.update(1)
            if len(toks) == n_new:
                break
            logits = model(input_ids=nxt, **{kv: cache}, use_cache=True).logits[:, -1]
        outs.append(torch.cat(toks, dim=1))
    bar.close()
    return torch.cat(outs)


# ---- DFlash blocks ---------------------------------------------------------------------------------

def dflash_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int, ctx_len: int):
    """Blocks `[anchor, MASK x (B-1)]` at the given anchor positions, for the drafter's training path.

    tokens [S, T]; anchors [S, A] (positions, >= 1). Returns block_ids [S, A*B], block_positions
    [S, A*B] and attn_mask [S, 1, A*B, ctx_len + A*B] (True = may attend): a block row sees the
    context strictly before its anchor and every row of its own block (no causal mask inside).
    """
    s, a = anchors.shape
    k = torch.arange(block_size, device=tokens.device)
    positions = (anchors[:, :, None] + k).reshape(s, a * block_size)
    ids = torch.full((s, a, block_size), mask_id, dtype=tokens.dtype, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    ctx = torch.arange(ctx_len, device=tokens.device)
    ctx_mask = ctx[None, None, :] < anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # [S, A*B, C]
    blk = torch.arange(a * block_size, device=tokens.device) // block_size
    blk_mask = (blk[:, None] == blk[None, :]).expand(s, -1, -1)
    mask = torch.cat([ctx_mask, blk_mask], dim=2)[:, None]
    return ids.reshape(s, a * block_size), positions, mask


def draft_hidden(drafter, target, block_ids, block_positions, features, attn_mask):
    """Drafter output rows [S, A*B, H] for blocks over the target's features (training path)."""
    embeds = target.get_input_embeddings()(block_ids)
    ctx_pos = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
    return drafter(embeds, block_positions, context=features, context_positions=ctx_pos, attn_mask=attn_mask)


# ---- progress --------------------------------------------------------------------------------------

class LossTable:
    """Collects (step, named values) rows and prints them as a small table."""

    def __init__(self, title: str, columns: list[str]):
        self.title = title
        self.columns = columns
        self.rows: list[dict] = []
        self.t0 = time.time()

    def add(self, step: int, **values) -> dict:
        row = {"step": step, "time_s": round(time.time() - self.t0, 1), **values}
        self.rows.append(row)
        return row

    def render(self) -> str:
        cols = ["step", "time_s"] + self.columns
        lines = [self.title, "  ".join(f"{c:>10}" for c in cols)]
        for r in self.rows:
            cells = []
            for c in cols:
                v = r.get(c, "")
                cells.append(f"{v:>10.4f}" if isinstance(v, float) and c != "time_s" else f"{v!s:>10}")
            lines.append("  ".join(cells))
        return "\n".join(lines)


def fit_steps(total: int, done: int, step_s: float, elapsed_s: float, budget_s: float) -> tuple[int, str | None]:
    """Steps that fit a wall-time budget, given the measured time per step. (total, None) when all fit."""
    fit = done + int(max(0.0, budget_s - elapsed_s) / max(step_s, 1e-9))
    if fit >= total:
        return total, None
    return max(fit, done + 1), (f"time budget {budget_s:.0f}s: {step_s * 1000:.0f} ms/step projects past it; "
                                f"training {max(fit, done + 1)} steps instead of {total}")


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
