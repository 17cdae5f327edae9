"""The DFlash block drafter at inference: one forward per round over `[anchor, MASK x k]`.

The drafter has no embedding or LM head of its own; it borrows the target's, read straight from the
target checkpoint's safetensors (two tensors, not the whole model). Each session keeps a `ContextKV`
of the projected target features of every committed token at its absolute position: `start` adds the
prompt rows at 0..T-1, `commit` appends the round's rows after them. `propose` places the block at
positions L..L+k (L = committed length; the anchor is not yet committed) and drafts
argmax(lm_head(hidden)) of the k mask rows. See REFERENCE.md section 2.

On a GPU a round moves data between host and device twice: a commit's feature rows go to the device in one
copy (from pinned memory, without waiting), and a proposal's drafts come back in one copy (the only sync of
the round). The block's input rows are built on the device (the anchor's embedding row, the mask row).

On CUDA the factory captures the forwards as CUDA graphs at load (`drafter_svc/dflash_graphs.py`; `cuda_graphs=False`
keeps them eager): a session runs from the graphs while its context fits their capacity, then eagerly. With the
graphs off it runs one eager round at load instead, so the first request does not pay the device's first-use costs.
On the CPU the path is the eager one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from pdflash.logging import get_logger
from pdflash.penalties import Penalties
from pdflash.sampler import target_probs
from pdflash.types import DraftDistribution, SamplingParams

from drafter_svc.compat import mismatch, read_config
from drafter_svc.dflash_graphs import DEFAULT_CAPACITY, DFlashGraphs, GraphedContext, graphs_unsupported, host_rows
from drafter_svc.dflash_model import (
    ContextKV,
    DFlashDraftModel,
    DFlashSpec,
    default_target_layers,
    load_dflash,
)
from drafter_svc.drafters.base import Drafter, DrafterFactory, Proposal

log = get_logger(__name__)

EMBED_SUFFIX = "embed_tokens.weight"
LM_HEAD_SUFFIX = "lm_head.weight"


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
    return value


def read_target_config(target_dir: str | pathlib.Path) -> dict:
    """The target's config.json, with a multimodal `text_config` merged over the top level."""
    return read_config(target_dir, what="target checkpoint ")


@dataclasses.dataclass
class TargetHead:
    """The target's token embedding and LM head, [vocab, hidden] each (the same tensor when tied)."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    hidden_size: int
    num_hidden_layers: int

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]


def _tensor_files(target_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> safetensors file, from the shard index when there is one (no tensor is read)."""
    where: dict[str, pathlib.Path] = {}
    for index in sorted(target_dir.glob("*.safetensors.index.json")):
        for name, file in json.loads(index.read_text()).get("weight_map", {}).items():
            where[name] = target_dir / file
    if not where:
        for file in sorted(target_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    where[name] = file
    if not where:
        raise FileNotFoundError(f"target checkpoint {target_dir} has no *.safetensors files")
    return where


def _pick(names: list[str], suffix: str) -> str | None:
    # The shortest match is the main model's (e.g. model.embed_tokens.weight, not an MTP layer's copy).
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    return min(found, key=lambda n: (len(n), n)) if found else None


def load_target_head(
    target_dir: str | pathlib.Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu"
) -> TargetHead:
    """Read only `*embed_tokens.weight` and `*lm_head.weight` (or the embedding, when tied) of a target."""
    target_dir = pathlib.Path(target_dir)
    dtype = _as_dtype(dtype)
    cfg = read_target_config(target_dir)
    files = _tensor_files(target_dir)
    embed_name = _pick(list(files), EMBED_SUFFIX)
    if embed_name is None:
        raise ValueError(f"target checkpoint {target_dir} has no tensor named *{EMBED_SUFFIX}")
    head_name = None if cfg.get("tie_word_embeddings", False) else _pick(list(files), LM_HEAD_SUFFIX)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    embed = read(embed_name)
    lm_head = read(head_name) if head_name is not None else embed
    hidden = int(cfg.get("hidden_size", embed.shape[1]))
    if embed.shape[1] != hidden or lm_head.shape != embed.shape:
        raise ValueError(
            f"target checkpoint {target_dir}: {embed_name} {tuple(embed.shape)} and "
            f"{head_name or embed_name} {tuple(lm_head.shape)} do not fit hidden_size {hidden}"
        )
    return TargetHead(embed=embed, lm_head=lm_head, hidden_size=hidden, num_hidden_layers=int(cfg["num_hidden_layers"]))


def check_compatible(spec: DFlashSpec, drafter_hidden: int, head: TargetHead, drafter_dir, target_dir) -> None:
    """Raise ValueError when a drafter cannot condition on / decode through this target (the words of
    `drafter_svc.compat`, which asks the same of the two config.json files before anything loads)."""
    why = mismatch(
        drafter_dir, target_dir, drafter_hidden=drafter_hidden, target_layer_ids=list(spec.target_layer_ids),
        mask_token_id=spec.mask_token_id, block_size=spec.block_size, target_hidden=head.hidden_size,
        target_layers=head.num_hidden_layers, target_vocab=head.vocab_size,
    )
    if why is not None:
        raise ValueError(why)
    if spec.num_target_layers and spec.num_target_layers != head.num_hidden_layers:
        log.warning(
            "drafter_target_layers_mismatch",
            drafter=str(drafter_dir),
            drafter_num_target_layers=spec.num_target_layers,
            target_num_hidden_layers=head.num_hidden_layers,
        )


class DFlashFactory(DrafterFactory):
    """Loaded drafter weights plus the target's embedding and LM head, shared by all sessions."""

    name = "dflash"

    def __init__(
        self,
        target_dir: str | pathlib.Path,
        drafter_dir: str | pathlib.Path,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        cuda_graphs: bool = True,
        graph_capacity: int = DEFAULT_CAPACITY,
    ):
        dtype = _as_dtype(dtype)
        device = torch.device(device)
        self.target_dir = pathlib.Path(target_dir)
        self.drafter_dir = pathlib.Path(drafter_dir)
        self.head = load_target_head(target_dir, dtype=dtype, device=device)
        self.model: DFlashDraftModel = load_dflash(drafter_dir, dtype=dtype, device=device)
        self.spec = self.model.spec
        check_compatible(self.spec, self.model.config.hidden_size, self.head, drafter_dir, target_dir)
        self.feature_layer_ids = list(self.spec.target_layer_ids)
        self.max_block_size = self.spec.block_size
        self.feature_dim = len(self.feature_layer_ids) * self.head.hidden_size
        self.dtype = dtype
        self.device = device
        # The block's mask rows, one view of the mask token's embedding row (no copy, no host->device traffic).
        self.mask_rows = self.head.embed[self.spec.mask_token_id].expand(self.max_block_size, -1)
        #: The graphed forwards sessions run from (None: every session runs eagerly).
        self.graphs: DFlashGraphs | None = None
        if device.type == "cuda":
            why = "turned off" if not cuda_graphs else graphs_unsupported(self.model)
            if why:
                log.info("dflash_cuda_graphs_off", reason=why)
                self.warm_up()
            else:
                try:
                    graphs = DFlashGraphs(self.model, self.head.embed, self.head.lm_head, capacity=graph_capacity)
                except Exception as e:  # noqa: BLE001 - a capture that fails costs speed, never the service
                    log.warning("dflash_cuda_graphs_failed", error=f"{type(e).__name__}: {e}",
                                hint="drafting runs eagerly; --no-drafter-cuda-graphs silences this")
                    torch.cuda.synchronize(device)
                    self.warm_up()
                else:
                    self.use_graphs(graphs)

    def use_graphs(self, graphs: DFlashGraphs | None) -> None:
        """Sessions started from now on run from `graphs` (None: eagerly); on CUDA the factory does this at load."""
        self.graphs = graphs
        if graphs is not None:
            log.info("dflash_cuda_graphs", captured=graphs.captured, capacity=graphs.capacity,
                     propose_buckets=list(graphs.propose_buckets), commit_buckets=list(graphs.commit_buckets),
                     buffer_mib=round(graphs.memory_bytes() / 2**20, 1))

    @torch.no_grad()
    def warm_up(self) -> None:
        """One eager round (start, the widest proposal, a commit, a proposal): the device's first-use costs (kernel
        loading, cuBLAS handles, the caching allocator's first blocks) are paid at load, not by the first request."""
        s = DFlashDrafter(self)
        zeros = np.zeros((8, self.feature_dim), np.float32)
        s.start([0] * 8, zeros)
        s.propose(0, s.max_drafts)
        s.commit([0] * 4, zeros[:4])
        s.propose(0, 3)
        s.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def new_session(self, sampling: SamplingParams | None = None) -> DFlashDrafter:
        return DFlashDrafter(self, sampling)


class DFlashDrafter(Drafter):
    needs_features = True

    def __init__(self, factory: DFlashFactory, sampling: SamplingParams | None = None):
        self._f = factory
        self._penalized = sampling if sampling is not None and sampling.penalized else None
        self.penalties: Penalties | None = None  # the request's penalties on the drafts (after start)
        # a sampled request's drafts are drawn from the target's warpers on the drafter's logits (SampledDrafts)
        self.sampler = SampledDrafts(sampling) if sampling is not None and not sampling.greedy else None
        self.cache: ContextKV | None = None  # the eager path's context
        self.graphed: GraphedContext | None = None  # the graphed path's (one of the two, after start)
        self._graphs: DFlashGraphs | None = None  # the graphs `graphed` belongs to (the factory's when it started)

    @property
    def max_drafts(self) -> int:
        return self._f.spec.block_size - 1

    @property
    def length(self) -> int:
        """Committed tokens whose features are in the context cache."""
        if self.graphed is not None:
            return self.graphed.length
        return 0 if self.cache is None else self.cache.length

    def start(self, prompt_ids: list[int], features: np.ndarray | None = None) -> None:
        self.close()
        if self._penalized is not None:
            self.penalties = Penalties(self._penalized, prompt_ids, self._f.head.vocab_size, self._f.device)
        graphs = self._f.graphs
        if graphs is not None and len(prompt_ids) <= graphs.capacity:
            self._graphs, self.graphed = graphs, graphs.new_context()
        else:
            self.cache = ContextKV(len(self._f.model.layers))
        self._extend(len(prompt_ids), features)

    def commit(self, tokens: list[int], features: np.ndarray | None = None) -> None:
        if self.cache is None and self.graphed is None:
            raise RuntimeError("DFlashDrafter.commit before start")
        self._extend(len(tokens), features)
        if self.penalties is not None:
            self.penalties.emitted(tokens)  # (a round's commit: its anchor and accepted drafts, all output)

    def _extend(self, n: int, features: np.ndarray | None) -> None:
        if n == 0:
            return
        if features is None:
            raise ValueError(f"the DFlash drafter needs target features for {n} committed tokens, got none")
        arr = np.asarray(features)
        if arr.shape != (n, self._f.feature_dim):
            raise ValueError(
                f"DFlash features have shape {arr.shape}, expected ({n}, {self._f.feature_dim}) "
                f"({n} tokens x {len(self._f.feature_layer_ids)} layers x hidden {self._f.head.hidden_size})"
            )
        # Pinned on CUDA (torch's caching host allocator keeps the block until the copy is done): the copy does not wait.
        rows = host_rows(arr, self._f.device)
        if self.graphed is not None:
            graphs = self._graphs
            if graphs.fits(self.graphed, n):
                graphs.extend(self.graphed, rows)
                return
            # Past the graphs' capacity: this session goes on eagerly, its rows moved into a ContextKV.
            log.debug("dflash_session_leaves_graphs", length=self.graphed.length, rows=n, capacity=graphs.capacity)
            self.cache, self.graphed = graphs.to_context_kv(self.graphed), None
        rows = rows.to(self._f.device, non_blocking=True).to(self._f.dtype)[None]
        self._f.model.extend_context(self.cache, rows)  # at the cache's next positions

    @torch.no_grad()
    def propose(self, anchor: int, k: int) -> list[int]:
        if self.cache is None and self.graphed is None:
            raise RuntimeError("DFlashDrafter.propose before start")
        k = min(k, self.max_drafts)
        if k <= 0:
            return []
        head = self._f.head
        if not 0 <= anchor < head.vocab_size:
            raise ValueError(f"anchor token {anchor} is outside the target vocabulary ({head.vocab_size} tokens)")
        graphed = self.graphed
        if graphed is not None:
            if self.penalties is not None or self.sampler is not None:
                return self._pick(self._graphs.propose_logits(graphed, anchor, k), anchor)
            return self._graphs.propose(graphed, anchor, k)
        embeds = torch.cat([head.embed[anchor : anchor + 1], self._f.mask_rows[:k]])[None]  # [anchor, MASK x k]
        hidden = self._f.model.draft(embeds, self.cache)  # at positions L..L+k
        logits = hidden[0, 1:] @ head.lm_head.T
        if self.penalties is not None or self.sampler is not None:
            return self._pick(logits, anchor)
        return logits.argmax(dim=-1).tolist()  # the round's one device->host copy

    def _pick(self, logits: torch.Tensor, anchor: int) -> list[int] | Proposal:
        """Drafts from the k rows' logits under the request's penalties and / or its sampler."""
        if self.sampler is not None:
            return self.sampler.drafts(logits, self.penalties, anchor)
        return self.penalties.greedy_drafts(logits, anchor)

    def close(self) -> None:
        if self.graphed is not None:
            self._graphs.release(self.graphed)
        self.cache = self.graphed = None
        self.penalties = None


SAMPLED_SUPPORT = 64  # a sampled draft's distribution: the top tokens of the warped drafter distribution
# Drafts drawn at random: the first two of a block; the later ones are the argmax (q one-hot). A DFlash block drafts
# every position at once, so q_j is not conditioned on the drafts drawn before it. Demo pair, 90 seeded requests of 40
# tokens, 7 drafts a round, drafts accepted a round (`python benchmarks/sampled_drafts.py --positions 0,16,1,2,3
# --seeds 90`; argmax / all drawn / first 1 / first 2 / first 3):
# temperature 1: 0.65 / 0.75 / 0.78 / 0.77 / 0.76; temperature 1, top-k 3: 1.08 / 1.13 / 1.11 / 1.22 / 1.10;
# temperature 0.7, top-p 0.9: 1.28 / 1.39 / 1.27 / 1.34 / 1.25. Every drawn count beats the argmax at temperature 1;
# between the counts the differences are within this sample's noise (~0.05): 2 is a choice, not a measured optimum.
SAMPLED_POSITIONS = 2


class SampledDrafts:
    """Sampled drafts of a request with temperature > 0: draft j is drawn from q_j, the request's warpers (temperature,
    top-k, top-p: `pdflash.sampler.target_probs`) on the drafter's logits, cut to its SAMPLED_SUPPORT likeliest tokens
    and renormalized, and sent with q_j (`Proposal.dists`), so the verifier accepts it with min(1, p / q) and the output
    still follows the target. Against the argmax draft this raises a draft's acceptance from p(argmax q) to
    sum(min(p, q)); drafts past SAMPLED_POSITIONS are the argmax (q one-hot). The random stream is the request's
    seed's (numpy), else fresh: a seeded request reproduces."""

    def __init__(self, sampling: SamplingParams):
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)

    def drafts(self, logits: torch.Tensor, penalties: Penalties | None, anchor: int) -> Proposal:
        """[k, V] draft logits -> k drafts and their distributions. Without penalties: one device->host copy; with
        them, draft j's penalties count the drafts drawn before it (one copy per draft)."""
        if penalties is None:
            ids, probs = self._top(logits)
            return self._draw(ids, probs)
        out = Proposal()

        def draw(row: torch.Tensor, j: int) -> int:
            one = self._draw(*self._top(row), j)
            out.dists += one.dists
            return one[0]

        out.extend(penalties.sequential(logits, anchor, draw))
        return out

    def _top(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        probs = target_probs(logits, self.sampling)
        vals, ids = torch.topk(probs, min(SAMPLED_SUPPORT, probs.shape[-1]), dim=-1)
        both = torch.cat([vals, ids.to(vals.dtype)]).cpu().numpy()  # one copy (ids < 2^24: exact in float32)
        return both[len(vals):].astype(np.int64), both[: len(vals)].astype(np.float32)

    def _draw(self, ids: np.ndarray, probs: np.ndarray, start: int = 0) -> Proposal:
        """Rows of (top ids, their probabilities), the first being draft `start`'s -> drafts and their q."""
        out = Proposal()
        for j, (row_ids, row_p) in enumerate(zip(ids, probs), start):
            keep = row_p > 0
            i, p = row_ids[keep], row_p[keep]
            if j >= SAMPLED_POSITIONS:  # the argmax, as a one-hot q (the deterministic rule)
                i, p = i[:1], np.ones(1, np.float32)
            q = p.astype(np.float64) / float(np.sum(p, dtype=np.float64))
            out.append(int(i[0]) if len(i) == 1 else int(self.rng.choice(i, p=q)))
            out.dists += (DraftDistribution(tuple(int(x) for x in i), tuple(float(x) for x in p)),)
        return out


def make_tiny_dflash(
    target_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    block_size: int = 8,
    mask_token_id: int | None = None,
) -> pathlib.Path:
    """Write a random-weight drafter (z-lab layout) sized for a target checkpoint; for tests.

    Sizes come from the target's config.json; the mask token from its tokenizer unless given.
    """
    cfg = read_target_config(target_dir)
    n_target = int(cfg["num_hidden_layers"])
    if mask_token_id is None:
        from transformers import AutoTokenizer

        mask_token_id = AutoTokenizer.from_pretrained(str(target_dir)).mask_token_id
        if mask_token_id is None:
            raise ValueError(f"the tokenizer of {target_dir} has no mask token; pass mask_token_id")
    if target_layer_ids is None:
        # Deduplicated: for small targets the default spread can repeat a layer.
        target_layer_ids = sorted(set(default_target_layers(n_target, min(3, n_target))))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    qcfg = Qwen3Config(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 2 * hidden),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_bias=False,
    )
    spec = DFlashSpec(
        block_size=block_size,
        mask_token_id=int(mask_token_id),
        target_layer_ids=[int(i) for i in target_layer_ids],
        num_target_layers=n_target,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDraftModel(qcfg, spec)
    model.save(out_dir)
    return pathlib.Path(out_dir)
