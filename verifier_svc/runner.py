"""The verifier's forward on a paged KV pool, eager or replayed from CUDA graphs.

`ForwardRunner` runs a transformers decoder-only model layer by layer (embeddings, rotary tables, each decoder
layer, final norm, LM head: the layout every transformers MoE causal LM shares) with a duck-typed cache whose
`update` writes the new keys/values into the layer's page pool (verifier_svc.kv) and hands the pool to the
batch-invariant attention (which reads it through the session's page table). Needs the kernels installed.

`GraphRunner` captures that forward once per block-size bucket (1, 2, 4, 8, 16, 32 rows) into a CUDA graph with
static input buffers (token ids, positions, write slots, the page table, the number of real rows); a verify of
T tokens replays the smallest bucket >= T with the session's table copied in. Padding rows are later positions:
causal attention keeps them out of the real rows, the experts skip them (`valid_rows`), and the batch-invariant
kernels make a real row's result independent of them, so a padded forward equals an exact-size one bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from pdflash_kernels.attention import PAGE, paged_write
from pdflash_kernels.dispatch import InvariantMode
from pdflash_kernels.installer import ForwardContext, forward_context
from pdflash_kernels.mla import is_latent_attention
from pdflash.errors import ResourceExhausted
from pdflash.hf_compat import cache_kwarg
from verifier_svc.kv import SequenceKV
from verifier_svc.prenorm import PreNormChain

BUCKETS = (1, 2, 4, 8, 16, 32)
#: a multi-session wave's graphs, by its rows in all (a wave of more rows runs eagerly)
WAVE_BUCKETS = (2, 4, 8, 16, 32, 64, 128)
#: a prefill forward's graphs (a prompt, or a chunk of one with --prefill-chunk), by its rows; a longer one runs eagerly.
#: An eager forward costs ~21 ms of host time on qwen3-8l whatever its rows (H100: a 256-row chunk's kernels take 3.7 ms
#: of its 26; benchmarks/results/prefill_profile_h100.md), so short prompts and chunks replay graphs like verifies.
#: On by default since stop 48 (tests/test_gpu_verifier.py::test_prefill_graphs_give_the_eager_prefills_bits passed on an
#: H100 for all three architectures; a 256-row chunk of qwen3-8l took 5.4 ms against 28.3 eager, stop48_gpu/call1):
#: PDFLASH_PREFILL_GRAPHS=0 turns them off.
PREFILL_BUCKETS = (32, 64, 128, 256, 512)
#: a prefill wave's graphs (several prompts or chunks of up to PREFILL_BUCKETS[-1] rows each, `VerifierCore.prefill_wave`),
#: by its rows in all; a bigger wave runs eagerly. On by default since stop 50: their GPU test
#: (tests/test_gpu_verifier.py::test_prefill_wave_graphs_give_the_eager_waves_bits) passed on an H100 for three
#: architectures (stop 49), and on an H200 one replayed wave beat the prompts' own prefill graphs one after another at
#: every size measured, 256-token prompts, one after another / one wave: qwen3-8l 9.7 / 8.8 ms (2 prompts), 19.8 / 17.0
#: (4), 39.0 / 28.8 (8); gptoss-24l 23.4 / 22.0, 48.1 / 41.7, 93.8 / 79.1 (benchmarks/waves.py --prefill-waves 2 4 8,
#: benchmarks/results/stop50_gpu/call1). PDFLASH_PREFILL_WAVE_GRAPHS=0 turns them off.
#: Why: an eager forward pays its host time whatever its rows (a 256-row qwen3-8l chunk: 28.3 ms eager, 5.4 replayed), so on an H100 two to four 256-token prompts took longer in one eager
#: wave than one after another from their prefill graphs (stop 48, benchmarks/waves.py --prefill-waves).
PREFILL_WAVE_BUCKETS = (256, 512, 1024, 2048)


def prefill_graphs_enabled() -> bool:
    """PDFLASH_PREFILL_GRAPHS as a boolean (what a core made without PagedKVOptions.prefill_graphs uses: benchmarks,
    tests; the server passes --prefill-graphs, read from the same variable by VerifierConfig)."""
    from pdflash.config import ConfigError, _parse

    try:
        return bool(_parse(os.environ.get("PDFLASH_PREFILL_GRAPHS", "1"), bool, "PDFLASH_PREFILL_GRAPHS"))
    except ConfigError as e:
        raise ValueError(f"{e} (PDFLASH_PREFILL_GRAPHS: 0 or 1)") from None

#: transformers RoPE types whose cos/sin depend on the position alone (`modeling_rope_utils.ROPE_INIT_FUNCTIONS`; the
#: `dynamic_rope_update` decorator rewrites inv_freq per call for "dynamic*" and "longrope", which keep the module)
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")


def static_rope(module) -> str | None:
    """Why `module` (a model's `rotary_emb`) cannot be tabled, or None when its cos/sin are a function of the position
    alone: a transformers rotary module of a static RoPE type, called as (x, position_ids)."""
    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, str):
        return f"rope_type {rope_type!r} (per layer type, or not a transformers rotary module)"
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} changes with the sequence length"
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return "no inv_freq buffer"
    return None


def rotary_positions(module, pos: torch.Tensor) -> torch.Tensor:
    """The position ids a model's rotary module takes for text positions `pos` [B, T]: as they are, or for a
    multimodal RoPE (`mrope_section`: Qwen3.5) the same positions on each of its 3 grids, [3, B, T], as the model's own
    forward gives a text-only input (transformers 5.17's module indexes three dimensions)."""
    return pos.expand(3, *pos.shape) if getattr(module, "mrope_section", None) is not None and pos.dim() == 2 else pos


class RotaryTable:
    """cos/sin of positions [0, positions), computed once by the model's own rotary module (every element is a function
    of its position alone: inv_freq * p, cos/sin, the scaling, the cast), and gathered by position in the forward: one
    `index_select` kernel instead of the module's ~9 (positions' cast, the product, cat, cos, sin, two scalings, two
    casts), capturable in a CUDA graph, no host sync. Bit-identical to calling the module (tests/test_runner_launches.py).
    Positions must be < `positions` (the verifier's sequences reserve pages up to that bound: verifier_svc.kv)."""

    CHUNK = 4096  # positions per module call while building (bounds the fp32 temporaries)

    def __init__(self, module, positions: int, dtype: torch.dtype, device: torch.device, hidden: int):
        self.positions = positions
        parts = []
        with torch.inference_mode(), InvariantMode():  # as the forward calls it
            x = torch.zeros(1, 1, hidden, dtype=dtype, device=device)  # the module reads x's dtype and device
            for s in range(0, positions, self.CHUNK):
                n = min(self.CHUNK, positions - s)
                pos = torch.arange(s, s + n, device=device).unsqueeze(0)
                out = module(x.expand(1, n, hidden), rotary_positions(module, pos))
                self.pair = not isinstance(out, torch.Tensor)  # (cos, sin); DeepSeek-V2: one complex freqs_cis
                parts.append(torch.stack((out[0][0], out[1][0])) if self.pair else out)  # [2 or 1, n, D]
            self.table = torch.cat(parts, dim=1)  # [2, positions, D]: cos, sin (or [1, positions, D])

    def __call__(self, pos: torch.Tensor):
        """pos [B, T] -> (cos, sin), each [B, T, D] contiguous, or the one tensor, as the module returns them."""
        g = self.table.index_select(1, pos.reshape(-1)).view(self.table.shape[0], *pos.shape, self.table.shape[-1])
        return (g[0], g[1]) if self.pair else g[0]


@dataclasses.dataclass
class LinearStep:
    """A forward's rows for a hybrid's recurrent layers (pdflash_kernels.gdn.paged_mix): the slots' states
    (verifier_svc.kv.LinearStates), `meta` [sequences, 6] int32 on the device (SequenceKV.linear_row per sequence), and
    the same rows on the host for the CPU's reference path (None in a CUDA graph: read from `meta` where needed)."""

    states: object
    meta: torch.Tensor
    rows: list | None


class PagedLayerCache:
    """What transformers' attention modules call `cache.update(k, v, layer_idx)` on: writes the block's keys and
    values at their slots (`pdflash_kernels.attention.paged_write`: one launch for both pools) and returns the layer's
    pools. A hybrid's recurrent layers read `linear_step` (their state slots and this forward's rows)."""

    def __init__(self, pool, pages: torch.Tensor, offsets: torch.Tensor, linear_step: LinearStep | None = None):
        self.pool, self.pages, self.offsets, self.linear_step = pool, pages, offsets, linear_step

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        kp, vp = self.pool.k[layer_idx], self.pool.v[layer_idx]
        paged_write(kp, vp, key[0], value[0], self.pages, self.offsets)  # one launch for K and V (Triton)
        return kp, vp


@dataclasses.dataclass
class ForwardOut:
    logits: torch.Tensor  # [rows, V] float32
    features: torch.Tensor | None  # [T, sum of feature layers' hidden] float32
    recorder: object  # verifier_svc.experts.RouteRecorder


def _submodule(module, names: tuple[str, ...]):
    """The first of `names` that is a submodule of `module`, or None."""
    return next((m for a in names if isinstance(m := getattr(module, a, None), torch.nn.Module)), None)


class ForwardRunner:
    """`max_positions`: the positions a forward can see (the verifier's context, a whole number of pages); with it a
    static RoPE's cos/sin are a table gathered by position (`RotaryTable`; `self.rotary` says which path runs)."""

    def __init__(self, model, seam, pool, max_positions: int | None = None):
        self.model, self.seam, self.pool = model, seam, pool
        self.inner = model.model
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.layer_kw = cache_kwarg(self.inner.layers[0])
        self.rope: RotaryTable | None = None
        # the embeddings, the rotary module and the final norm (LFM2 names the last two pos_emb and embedding_norm;
        # Nemotron-H the embeddings `embeddings` and the norm `norm_f`; Jamba the norm `final_layernorm`)
        self.embed, self.rotary_emb, self.final_norm = (
            _submodule(self.inner, names) for names in (("embed_tokens", "embeddings"), ("rotary_emb", "pos_emb"),
                                                        ("norm", "embedding_norm", "norm_f", "final_layernorm")))
        if self.final_norm is None:
            raise ValueError(f"{type(self.inner).__name__} has no final norm (norm) the paged forward knows")
        if self.embed is None:
            raise ValueError(f"{type(self.inner).__name__} has no token embeddings (embed_tokens) the paged forward knows")
        # no rotary module (Granite-4.0-H, Kimi Linear: NoPE): the layers get no position embeddings
        why = ("no max_positions" if max_positions is None else
               "no rotary module" if self.rotary_emb is None else static_rope(self.rotary_emb))
        if why is None:
            with torch.inference_mode():  # the dtype the embeddings hand the rotary module
                h = self.embed(torch.zeros(1, 1, dtype=torch.long, device=pool.device))
            self.rope = RotaryTable(self.rotary_emb, int(max_positions), h.dtype, pool.device, h.shape[-1])
        self.rotary = (f"table ({max_positions} positions)" if self.rope is not None else
                       "none (the model has no rotary module: its attention takes no positions)" if self.rotary_emb is None
                       else f"module per forward ({why})")
        self.chain = self._probe_chain()
        self.prenorm = ("residual adds fused into the next norm" if isinstance(self.chain, PreNormChain)
                        else f"layers as they are ({self.chain})")
        if not isinstance(self.chain, PreNormChain):
            self.chain = None
        self.attention = self._fuse_attention() if self.chain is not None else "the modules (no layer chain)"
        if any(is_latent_attention(getattr(layer, "self_attn", None)) for layer in self.inner.layers[: self.num_layers]):
            self.attention = ("multi-head latent attention, absorbed over the paged latent cache (pdflash_kernels.mla), "
                              "the modules' projections")

    @property
    def positions_static(self) -> bool:
        """Whether a row's position embeddings are a function of its position alone (a table, or none at all), so that
        rows of other lengths beside it (a wave, a chunked prompt) change nothing."""
        return self.rope is not None or self.rotary_emb is None

    def _layer_kwargs(self, h: torch.Tensor, pos: torch.Tensor, cache) -> dict:
        """What a decoder layer (and, in the chain, its attention) gets besides its input."""
        pe = (self.rope(pos) if self.rope is not None else None if self.rotary_emb is None else
              self.rotary_emb(h, rotary_positions(self.rotary_emb, pos)))
        return dict(attention_mask=None, position_ids=pos, use_cache=True, position_embeddings=pe, **{self.layer_kw: cache})

    def _probe_chain(self) -> "PreNormChain | str":
        """verifier_svc.prenorm's chain if one real layer's forward shows its dataflow (the experts stubbed out: the
        probe touches no expert cache), else why not."""
        from pdflash_kernels.installer import experts_stubbed

        layers = self.inner.layers[: self.num_layers]
        with torch.inference_mode(), InvariantMode(), experts_stubbed():
            return PreNormChain.probe(self.model, layers, self.final_norm, self._layer_kwargs)

    def _fuse_attention(self) -> str:
        """Give the chain each layer's fused attention (verifier_svc.fused_attention) when the first layer of each kind
        (module class, sliding window) passes the probe on the pool; -> what runs, for the log."""
        from verifier_svc import fused_attention as fa

        cfg = self.model.config.get_text_config()
        built, probed = [], {}
        for layer in self.chain.layers:
            f = fa.FusedAttention.build(layer.self_attn, cfg, self.layer_kw)
            if isinstance(f, str):
                return f"the modules ({f})"
            key = (type(layer.self_attn), f.sliding_window)
            if key not in probed:
                with torch.inference_mode(), InvariantMode():
                    probed[key] = fa.probe(f, self.pool, self._layer_kwargs, PagedLayerCache)
            if probed[key] is not None:
                return f"the modules ({probed[key]})"
            built.append(f)
        self.chain.attn = built
        return "fused q/k/v projection, norms, rotary and KV write (2 launches)"

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, cache: PagedLayerCache, feature_layers: tuple[int, ...]):
        h = self.embed(ids)
        kwargs = self._layer_kwargs(h, pos, cache)
        if self.chain is not None:
            h, feats = self.chain.run(h, kwargs, feature_layers)
        else:
            feats = []
            for i, layer in enumerate(self.inner.layers[: self.num_layers]):
                out = layer(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
                if i in feature_layers:
                    feats.append((i, h))
            h = self.final_norm(h)
        f = torch.cat([x for _, x in sorted(feats, key=lambda p: feature_layers.index(p[0]))], dim=-1)[0].float() if feats else None
        return h, f

    def forward_tensors(self, ids, pos, table, pages, offsets, valid_rows, feature_layers, last_only: bool, segments=None,
                        seq_starts=None, max_rows=None, rows=None, linear: LinearStep | None = None):
        """Everything on the device (what a CUDA graph captures): ids/pos [1, B], table [1, max_pages]. `segments`:
        the capture of a segmented graph (offloaded experts split the forward, see _SegmentedGraph). A wave
        (`seq_starts` [S + 1], `max_rows`): the rows are S sequences' one after the other, table [S, max_pages].
        `rows` (a long tensor of row indices): the logits of those rows only (a prefill wave: each prompt's last).
        `linear`: a hybrid's recurrent layers' rows (`linear_step`)."""
        ctx = ForwardContext(page_table=table, valid_rows=valid_rows, segments=segments, seq_starts=seq_starts,
                             max_rows=max_rows)
        cache = PagedLayerCache(self.pool, pages, offsets, linear)
        with torch.inference_mode(), InvariantMode(), forward_context(ctx), self.seam.record() as rec:
            h, feats = self._layers(ids, pos, cache, feature_layers)
            if rows is not None:
                hl = h.index_select(1, rows)
            elif not last_only:
                hl = h
            elif valid_rows is None:
                hl = h[:, -1:]
            else:  # a padded prefill graph: the last real row's (valid_rows, a device scalar: graph-safe)
                hl = h.index_select(1, valid_rows.to(torch.long) - 1)
            logits = self.model.lm_head(hl)[0].float()
        return ForwardOut(logits, feats, rec)

    def forward(self, tokens: list[int], start: int, seq: SequenceKV, feature_layers=(), last_only: bool = False) -> ForwardOut:
        """Eager: `tokens` at positions start .. start + len - 1 of the session's sequence."""
        dev = self.pool.device
        if self.rope is not None and start + len(tokens) > self.rope.positions:
            raise ValueError(f"positions up to {start + len(tokens) - 1} exceed the runner's {self.rope.positions}")
        seq.reserve(start + len(tokens))
        pages, offsets = seq.slots(start, len(tokens))
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        pos = torch.arange(start, start + len(tokens), device=dev).unsqueeze(0)
        return self.forward_tensors(ids, pos, seq.table.unsqueeze(0), pages, offsets, None, tuple(feature_layers), last_only,
                                    linear=self.linear_step([seq.linear_row(start, len(tokens))]
                                                            if self.pool.linear is not None else None))

    def linear_step(self, rows: list | None) -> LinearStep | None:
        """The recurrent layers' step for these rows (SequenceKV.linear_row's; None: a model without such layers)."""
        if rows is None:
            return None
        return LinearStep(self.pool.linear, torch.tensor(rows, dtype=torch.int32).to(self.pool.device), rows)


    def forward_wave(self, items: "list[tuple[list[int], int, SequenceKV]]", feature_layers=(), last_rows: bool = False) -> ForwardOut:
        """Eager, a multi-session verify wave: each item's `tokens` at positions start .. of its own sequence, all in
        one forward. Rows are the items' blocks one after the other (item i's rows [starts[i], starts[i + 1]) of the
        logits, features and routing, `wave_starts`); each item's rows get the bits of a forward of that item alone
        (every kernel's result for a row depends on that row and, for attention, on its own sequence's keys only).
        `last_rows` (a prefill wave): the logits of each item's last row only, [S, vocab] (features stay every row's)."""
        dev = self.pool.device
        ids, pos, pages, offsets = [], [], [], []
        for tokens, start, seq in items:
            if not tokens:
                raise ValueError("a wave item needs at least one token")
            if self.rope is not None and start + len(tokens) > self.rope.positions:
                raise ValueError(f"positions up to {start + len(tokens) - 1} exceed the runner's {self.rope.positions}")
            seq.reserve(start + len(tokens))
            p, o = seq.slot_lists(start, len(tokens))
            ids += tokens
            pos += range(start, start + len(tokens))
            pages += p
            offsets += o
        starts = wave_starts([len(t) for t, _, _ in items])
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        table = torch.stack([seq.table for _, _, seq in items])
        linear = self.linear_step([seq.linear_row(start, len(t), a) for (t, start, seq), a in zip(items, starts)]
                                  if self.pool.linear is not None else None)
        return self.forward_tensors(as_long([ids]), as_long([pos]), table, as_long(pages), as_long(offsets), None,
                                    tuple(feature_layers), False, seq_starts=torch.tensor(starts, dtype=torch.int32, device=dev),
                                    max_rows=max(len(t) for t, _, _ in items),
                                    rows=as_long([e - 1 for e in starts[1:]]) if last_rows else None, linear=linear)


def wave_starts(lengths: list[int]) -> list[int]:
    """Row offsets of a wave's items: [0, n0, n0 + n1, ...] (item i's rows [starts[i], starts[i + 1]))."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _served_by(model) -> list[tuple]:
    from pdflash_kernels.installer import experts_modules

    return [(m, m._pdflash_offload[0]) for m in experts_modules(model).values() if getattr(m, "_pdflash_offload", None) is not None]


class _Graph:
    """A verify forward (every row's logits) captured for `bucket` rows, or with `last_only` a prefill forward (the last
    real row's logits: `valid` rows of the bucket)."""

    def __init__(self, runner: ForwardRunner, bucket: int, max_pages: int, feature_layers: tuple[int, ...], scratch_page: int,
                 pool=None, last_only: bool = False):
        self.last_only = last_only
        self._static_inputs(runner, bucket, max_pages, scratch_page)
        self._capture(runner, feature_layers, pool)

    def _capture(self, runner: ForwardRunner, feature_layers: tuple[int, ...], pool=None, **kw) -> None:
        """Warm the forward up on a side stream (Triton compiles, the allocator settles), then capture it over the
        static inputs (`kw`: forward_tensors' wave arguments) into the memory pool `pool` (GraphRunner's, shared by its
        whole-forward graphs; None = a pool of its own)."""
        dev = runner.pool.device
        args = (self.ids, self.pos, self.table, self.pages, self.offsets, self.valid, feature_layers,
                getattr(self, "last_only", False))
        kw = dict(kw, linear=self.linear)
        self._served = _served_by(runner.model)  # offloaded experts: the graph reads these caches' state
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            runner.forward_tensors(*args, **kw)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = runner.forward_tensors(*args, **kw)

    def _static_inputs(self, runner: ForwardRunner, bucket: int, max_pages: int, scratch_page: int) -> None:
        """The graph's inputs. ids, positions, write pages and offsets are the rows of one device buffer that a round
        fills with one copy from a pinned host twin (`set_inputs`), not four pageable copies and two device copies."""
        dev = runner.pool.device
        self.bucket = bucket
        self.staging = torch.zeros(4, bucket, dtype=torch.long, device=dev)  # ids, positions, pages, offsets
        self.host = torch.zeros(4, bucket, dtype=torch.long, pin_memory=True)
        self.ids, self.pos = self.staging[0:1], self.staging[1:2]
        self.pages, self.offsets = self.staging[2], self.staging[3]
        self.table = torch.zeros(1, max_pages, dtype=torch.int32, device=dev)
        self.table_of: tuple[int, int] | None = None  # (SequenceKV.uid, its page count) the table holds
        # until the first replay fills them, the write slots point at a page no session owns: the warm-up forward
        # below really runs and writes its keys
        self.pages.fill_(scratch_page)
        self.offsets.copy_(torch.arange(bucket))
        self.table[:] = scratch_page
        self.valid = torch.ones(1, dtype=torch.int32, device=dev)
        self._linear_inputs(runner, 1, bucket)

    def _linear_inputs(self, runner: ForwardRunner, sequences: int, bucket: int) -> None:
        """A hybrid's recurrent layers' rows (`LinearStep`), static, with a pinned host twin: until the first replay
        the first sequence runs every row in the scratch slot, the others none."""
        states = runner.pool.linear
        self.linear = self.linear_host = None
        if states is None:
            return
        self.linear_host = torch.tensor([states.scratch_row(bucket)] + [states.scratch_row(0, bucket)] * (sequences - 1),
                                        dtype=torch.int32).pin_memory()
        self.linear = LinearStep(states, self.linear_host.to(runner.pool.device), None)

    def _set_linear(self, rows: list) -> None:
        if self.linear is not None:
            host = self.linear_host.numpy()
            host[:] = self.linear.states.scratch_row(0)  # (a wave's unused sequence slots: no rows)
            host[: len(rows)] = rows
            self.linear.meta.copy_(self.linear_host, non_blocking=True)

    def set_inputs(self, tokens: list[int], start: int, seq: SequenceKV) -> None:
        """A round's inputs: `tokens` at positions start.., padded to the bucket with later positions (the padding
        rows' keys land past the real ones, in pages `seq` has reserved). One H2D copy (the host buffer is reused:
        the previous round's copy is done, the verifier syncs at the end of each forward), the page table only when
        the session or its page count changed, and the real row count."""
        n, b = len(tokens), self.bucket
        pages, offsets = seq.slot_lists(start, b)
        host = self.host.numpy()
        host[0, :n] = tokens
        host[0, n:] = tokens[-1]
        host[1] = range(start, start + b)
        host[2] = pages
        host[3] = offsets
        self.staging.copy_(self.host, non_blocking=True)
        if self.table_of != (seq.uid, len(seq.pages)):
            self.table[0, : seq.table.numel()].copy_(seq.table)
            self.table_of = (seq.uid, len(seq.pages))
        if self.linear is not None:
            self._set_linear([seq.linear_row(start, n)])
        self.valid.fill_(n)

    def replay(self, n: int) -> None:
        self.graph.replay()

    def stale(self) -> bool:
        """True once an experts module is served by another cache than the one captured."""
        return any(getattr(module, "_pdflash_offload", (None,))[0] is not cache for module, cache in self._served)


class _WaveGraph(_Graph):
    """A multi-session wave's forward (`ForwardRunner.forward_wave`'s ragged rows) captured for `bucket` rows in all and
    up to `sessions` sequences of at most `max_rows` rows each. Static inputs: the rows' ids, positions, write pages and
    offsets (one pinned H2D copy a wave), a page table row per sequence (copied only when a row's session or page count
    changed), the sequences' row offsets, the real row count. The tail past the last sequence's rows is padding: it
    writes its keys into the scratch page, the experts skip it (`valid_rows`), the attention leaves it out; sequence
    slots past the wave's are empty (no rows)."""

    def __init__(self, runner: ForwardRunner, bucket: int, sessions: int, max_rows: int, max_pages: int,
                 feature_layers: tuple[int, ...], scratch_page: int, pool=None, last_rows: bool = False):
        dev = runner.pool.device
        self._static_inputs(runner, bucket, max_pages, scratch_page)
        self.sessions, self.max_rows, self.scratch_page = sessions, max_rows, scratch_page
        self.table = torch.full((sessions, max_pages), scratch_page, dtype=torch.int32, device=dev)
        self.table_of: list[tuple[int, int] | None] = [None] * sessions
        self.starts_host = torch.zeros(sessions + 1, dtype=torch.int32, pin_memory=True)
        self.starts = torch.zeros(sessions + 1, dtype=torch.int32, device=dev)
        self.starts[1] = bucket  # the warm-up and the capture: one sequence over every row, in the scratch page
        self.starts[2:] = bucket
        self._linear_inputs(runner, sessions, bucket)
        self.valid.fill_(bucket)
        self.positions_of_scratch = torch.arange(bucket) % PAGE  # (a wave bucket may pass one page's positions)
        self.pos.copy_(self.positions_of_scratch.view(1, -1))
        self.offsets.copy_(self.positions_of_scratch)
        # a prefill wave (`last_rows`): the LM head on each sequence's last row only (slots past the wave's: row 0, unread)
        self.last_host = torch.zeros(sessions, dtype=torch.long, pin_memory=True) if last_rows else None
        self.last = torch.full((sessions,), bucket - 1, dtype=torch.long, device=dev) if last_rows else None
        self._capture(runner, feature_layers, pool, seq_starts=self.starts, max_rows=max_rows, rows=self.last)

    def set_wave_inputs(self, items: "list[tuple[list[int], int, SequenceKV]]") -> int:
        """A wave's inputs (each item's pages already reserved); returns the real row count."""
        host = self.host.numpy()
        starts = wave_starts([len(t) for t, _, _ in items])
        n = starts[-1]
        for (tokens, start, seq), a in zip(items, starts):
            pages, offsets = seq.slot_lists(start, len(tokens))
            e = a + len(tokens)
            host[0, a:e] = tokens
            host[1, a:e] = range(start, start + len(tokens))
            host[2, a:e] = pages
            host[3, a:e] = offsets
        host[0, n:] = 0
        host[1, n:] = 0
        host[2, n:] = self.scratch_page
        host[3, n:] = self.positions_of_scratch[n:].numpy()
        self.staging.copy_(self.host, non_blocking=True)
        sh = self.starts_host.numpy()
        sh[: len(starts)] = starts
        sh[len(starts):] = n
        self.starts.copy_(self.starts_host, non_blocking=True)
        if self.last is not None:
            last = self.last_host.numpy()
            last[:] = 0
            last[: len(items)] = [e - 1 for e in starts[1:]]
            self.last.copy_(self.last_host, non_blocking=True)
        for b, (_, _, seq) in enumerate(items):
            if self.table_of[b] != (seq.uid, len(seq.pages)):
                self.table[b].copy_(seq.table)
                self.table_of[b] = (seq.uid, len(seq.pages))
        if self.linear is not None:
            self._set_linear([seq.linear_row(start, len(t), a) for (t, start, seq), a in zip(items, starts)])
        self.valid.fill_(n)
        return n


class _SegmentedGraph(_Graph):
    """The forward of a model whose experts are offloaded, as one CUDA graph per stretch between two layers' routing
    decisions: graph 0 = embeddings + layer 0 up to its router + the mask of its routed (and, with layer-ahead
    prefetch, next-layer predicted) experts; graph l + 1 = layer l's grouped experts kernels (reading the cache's slot
    pool through layer l's slot table, a static device tensor) + the rest of layer l + layer l + 1 up to its mask; the
    last graph ends with the norm and the LM head. Between two graphs the host does only what needs the host: one
    sync to read the layer's mask, the cache's bookkeeping and copies (the stream waits for the copies the layer needs
    and refreshes the slot table), and the prefetches. The graphs share one memory pool and replay in capture order
    (the rule for sharing a pool). A graph is tied to the expert caches it was captured over (`stale`)."""

    def __init__(self, runner: ForwardRunner, bucket: int, max_pages: int, feature_layers: tuple[int, ...], scratch_page: int,
                 pool=None):
        dev = runner.pool.device  # (`pool` unused: a host-stepped forward keeps a pool of its own, below)
        self._static_inputs(runner, bucket, max_pages, scratch_page)
        args = (self.ids, self.pos, self.table, self.pages, self.offsets, self.valid, feature_layers, False)
        kw = dict(linear=self.linear)
        self._served = _served_by(runner.model)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.steps: list[tuple] = []  # (module, cache, layer, device mask) per experts call, in forward order
        self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            runner.forward_tensors(*args, **kw)  # warm-up, eager: Triton compiles, the allocator settles, the cache fills
            self._begin()
            self.out = runner.forward_tensors(*args, segments=self, **kw)
            self._current.capture_end()
            self.graphs.append(self._current)
        torch.cuda.current_stream(dev).wait_stream(side)

    def _begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self._pool)

    def split(self, module, offload, x, top_k_index, top_k_weights):
        """Called by the experts forward during the capture: the layer's routing mask ends the graph so far; the next
        graph starts with the experts kernels over the slot table the host will have refreshed before replaying it."""
        from pdflash_kernels.installer import offloaded_kernel, routing_mask

        cache, layer = offload
        mask = routing_mask(module, cache, x, top_k_index, valid_rows=self.valid)
        self._current.capture_end()
        self.graphs.append(self._current)
        self.steps.append((module, cache, layer, mask))
        self._begin()
        n = module._pdflash_num_experts
        return offloaded_kernel(x, top_k_index, top_k_weights, cache, n, cache.tables[layer], None, self.valid)

    def replay(self, n: int) -> None:
        from pdflash_kernels.installer import admit_layer, after_layer

        guess, held = None, None
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if held is not None:  # graph i ran the previous layer's kernels: its slots may move from here on
                held.release()
                held = None
            if i < len(self.steps):
                module, cache, layer, mask = self.steps[i]
                flags = mask.tolist()  # the layer's one host sync
                _, guess = admit_layer(cache, layer, module._pdflash_num_experts, flags)
                held = cache
                after_layer(cache, layer, guess)


def _graph_failed(kind: str, bucket: int, e: BaseException) -> None:
    """A graph that could not be captured: said once, in the log (its forwards then run eagerly, with the same bits)."""
    from pdflash.logging import get_logger

    get_logger("verifier.graphs").warning(f"a {kind} graph could not be captured; {kind} forwards run eagerly from now on",
                                          bucket=bucket, error=f"{type(e).__name__}: {e}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # (a failed capture's stream work settles before the eager forward)


def prefill_wave_graphs_enabled() -> bool:
    """PDFLASH_PREFILL_WAVE_GRAPHS: 1 (default, PREFILL_WAVE_BUCKETS) or 0."""
    from pdflash_kernels import runtime

    return runtime.env_flag("PDFLASH_PREFILL_WAVE_GRAPHS", default=True)


class GraphRunner:
    """Bucketed CUDA graphs of the verify forward; falls back to eager beyond the largest bucket. Experts offloaded to
    a host-managed cache need a host step per layer: one graph per layer then (_SegmentedGraph); a device-managed
    cache (verifier_svc.device_cache) is captured whole like resident experts."""

    def __init__(self, runner: ForwardRunner, max_pages: int, buckets=BUCKETS, wave_sessions: int = 8,
                 prefill_graphs: bool | None = None):
        self.runner, self.max_pages, self.buckets = runner, max_pages, tuple(sorted(buckets))
        self.wave_sessions = wave_sessions  # the most sequences a captured wave holds (VerifierCore's max_wave_sessions)
        self._graphs: dict[tuple, _Graph] = {}
        self.scratch_page = runner.pool.alloc(1)[0]  # where captures write; never handed to a session
        self._mempool = self._new_mempool()
        from pdflash_kernels.installer import experts_modules

        self._experts = list(experts_modules(runner.model).values())  # (walked once: a wave or prefill asks per call)
        on = prefill_graphs_enabled() if prefill_graphs is None else prefill_graphs
        self.prefill_buckets = PREFILL_BUCKETS if on else ()
        self.prefill_wave_buckets = PREFILL_WAVE_BUCKETS if prefill_wave_graphs_enabled() else ()
        self.wave_graphs = True  # False once a wave graph failed to capture: waves then run eagerly (the same bits)

    @staticmethod
    def _new_mempool():
        """One CUDA-graph memory pool for every whole-forward graph (solo and wave buckets, feature layers or not), as
        vLLM shares one across its batch sizes: the pool holds the largest graph's intermediates, not their sum (the
        [rows, vocab] fp32 logits of each bucket alone are ~78 MB at 128 rows and a 152k vocabulary). Safe because one
        forward runs at a time and each replay's output is read (the verifier syncs and copies it out) before the next
        replay of any graph: a graph's output may sit in memory another graph's capture reused. PDFLASH_GRAPH_POOL=own
        gives each graph a pool of its own (the memory A/B)."""
        mode = os.environ.get("PDFLASH_GRAPH_POOL", "shared")
        if mode not in ("shared", "own"):
            raise ValueError(f"PDFLASH_GRAPH_POOL must be shared or own, got {mode!r}")
        return torch.cuda.graph_pool_handle() if mode == "shared" else None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def capture(self, feature_layers=(), max_rows: int | None = None) -> int:
        """Capture every bucket up to `max_rows` now (at load) rather than on a bucket's first use, where the capture
        would land inside somebody's verify. Returns the graphs captured."""
        n = 0
        for b in self.buckets:
            key = (b, tuple(feature_layers))
            if (max_rows is None or b <= max_rows) and key not in self._graphs:
                self._graphs[key] = self._kind(b, self.max_pages, tuple(feature_layers), self.scratch_page)
                n += 1
        return n

    def _host_managed(self) -> bool:
        """Experts offloaded to a host-managed cache: a host step per layer (no whole-forward graph). Read per call: an
        experts module's cache (`_pdflash_offload`) may be swapped after the runner was made."""
        return any(not getattr(off[0], "device_managed", False) for m in self._experts
                   if (off := getattr(m, "_pdflash_offload", None)) is not None)

    def _kind(self, *args) -> _Graph:
        return (_SegmentedGraph if self._host_managed() else _Graph)(self.runner, *args, pool=self._mempool)

    def _graph(self, key: tuple, make) -> _Graph:
        """The graph under `key`, captured by `make()` on first use. When it is stale (the experts moved to another
        cache) every graph is dropped first and this one captured anew. A failed capture raises (nothing kept)."""
        g = self._graphs.get(key)
        if g is not None and g.stale():
            self.reset()
            g = None
        if g is None:
            g = self._graphs[key] = make()
        return g

    def reset(self) -> None:
        """Drop every graph (and what they hold: an offloaded model's graphs keep its old cache's pool alive)."""
        self._graphs.clear()
        self._mempool = self._new_mempool()
        torch.cuda.empty_cache()

    def forward_wave(self, items: "list[tuple[list[int], int, SequenceKV]]", feature_layers=()) -> tuple[ForwardOut, list[int]]:
        """A multi-session wave (`ForwardRunner.forward_wave`) replayed from the graph of the smallest `WAVE_BUCKETS`
        bucket that holds its rows, captured on first use; eager where none does, where it has more sequences than
        `wave_sessions` or a block longer than the largest single bucket, or where experts are offloaded to a
        host-managed cache. Returns the output (its first starts[-1] rows real) and the items' row offsets."""
        starts = wave_starts([len(t) for t, _, _ in items])
        b = next((r for r in WAVE_BUCKETS if r >= starts[-1]), None)
        if (b is None or not self.wave_graphs or len(items) > self.wave_sessions
                or max(len(t) for t, _, _ in items) > self.buckets[-1] or self._host_managed()):
            return self.runner.forward_wave(items, feature_layers), starts
        layers = tuple(feature_layers)
        try:  # (a wave of b rows holds at most b sequences of at most b rows each: smaller grids for small buckets)
            g = self._graph(("wave", b, layers), lambda: _WaveGraph(
                self.runner, b, min(self.wave_sessions, b), min(self.buckets[-1], b), self.max_pages, layers,
                self.scratch_page, self._mempool))
        except Exception as e:  # noqa: BLE001 - waves are on by default on CUDA: a capture failure must not fail them
            _graph_failed("wave", b, e)
            self.wave_graphs = False
            return self.runner.forward_wave(items, feature_layers), starts
        for tokens, start, seq in items:
            seq.reserve(start + len(tokens))
        g.set_wave_inputs(items)
        g.replay(starts[-1])
        return g.out, starts

    def prefill_wave_bucket(self, items: "list[tuple[list[int], int, SequenceKV]]") -> int | None:
        """The prefill-wave graph bucket for these items (None: the wave runs eagerly): their rows together within
        PREFILL_WAVE_BUCKETS, each item's within PREFILL_BUCKETS' largest, at most `wave_sessions` items, no padding past
        a sequence's context or the rotary table, no host-managed expert cache."""
        if not self.prefill_wave_buckets or len(items) > self.wave_sessions or self._host_managed():
            return None
        rows = [len(t) for t, _, _ in items]
        b = next((r for r in self.prefill_wave_buckets if r >= sum(rows)), None)
        if b is None or max(rows) > PREFILL_BUCKETS[-1]:
            return None
        if self.runner.rope is not None and any(start + len(t) > self.runner.rope.positions for t, start, _ in items):
            return None
        return b

    def forward_prefill_wave(self, items: "list[tuple[list[int], int, SequenceKV]]", feature_layers=()) -> tuple[ForwardOut, list[int]] | None:
        """A prefill wave (`ForwardRunner.forward_wave(..., last_rows=True)`: each item's last row's logits, every row's
        features) replayed from the `_WaveGraph` of its `prefill_wave_bucket`, captured on first use; the padding rows
        past the items' write their keys into the scratch page. None where no graph applies or one fails to capture (the
        caller runs it eagerly; a capture failure turns these graphs off, said once). The output is the graph's (valid
        until the next replay): logits [wave_sessions, vocab], the first len(items) rows real."""
        b = self.prefill_wave_bucket(items)
        if b is None:
            return None
        layers = tuple(feature_layers)
        try:
            g = self._graph(("prefill_wave", b, layers), lambda: _WaveGraph(
                self.runner, b, self.wave_sessions, min(PREFILL_BUCKETS[-1], b), self.max_pages, layers, self.scratch_page,
                self._mempool, last_rows=True))
        except Exception as e:  # noqa: BLE001 - the wave still runs: eagerly
            _graph_failed("prefill wave", b, e)
            self.prefill_wave_buckets = ()
            return None
        for tokens, start, seq in items:
            seq.reserve(start + len(tokens))
        g.set_wave_inputs(items)
        g.replay(sum(len(t) for t, _, _ in items))
        return g.out, wave_starts([len(t) for t, _, _ in items])

    def prefill_bucket(self, n: int, start: int, seq: SequenceKV) -> int | None:
        """The prefill graph bucket for n rows at `start`: None where none holds them, where the padding rows would pass
        the context or the rotary table, or where experts are offloaded to a host-managed cache (a host step per layer)."""
        b = next((r for r in self.prefill_buckets if r >= n), None)
        if b is None or start + b > seq.max_pages * PAGE:
            return None
        if self.runner.rope is not None and start + b > self.runner.rope.positions:
            return None
        return None if self._host_managed() else b

    def forward_prefill(self, tokens: list[int], start: int, seq: SequenceKV, feature_layers=()) -> ForwardOut | None:
        """A prefill forward (a prompt or a chunk of one: the last row's logits, every row's features) replayed from the
        graph of the smallest `PREFILL_BUCKETS` bucket that holds it, captured on first use (or by the warm-up). The
        padding rows' keys land past the real ones, in pages reserved for them (the next forward overwrites them); the
        experts skip those rows. None where no graph applies (`prefill_bucket`, or the KV pool has no pages for the
        padding): the caller runs it eagerly. Bit for bit the eager forward's (batch-invariant kernels)."""
        n = len(tokens)
        b = self.prefill_bucket(n, start, seq)
        if b is None:
            return None
        seq.reserve(start + n)  # (the real rows' pages: a full pool refuses the prefill itself, as eagerly)
        try:
            seq.reserve(start + b)
        except ResourceExhausted:
            return None
        layers = tuple(feature_layers)
        try:
            g = self._graph(("prefill", b, layers), lambda: _Graph(self.runner, b, self.max_pages, layers, self.scratch_page,
                                                                   pool=self._mempool, last_only=True))
        except Exception as e:  # noqa: BLE001 - a forward that cannot be captured still runs: eagerly, said once
            _graph_failed("prefill", b, e)
            self.prefill_buckets = ()
            return None
        g.set_inputs(tokens, start, seq)
        g.replay(n)
        return g.out

    def forward(self, tokens: list[int], start: int, seq: SequenceKV, feature_layers=()) -> tuple[ForwardOut, int]:
        """Returns the output (logits of the bucket's rows: the first len(tokens) are real) and the real row count."""
        n = len(tokens)
        b = self.bucket(n)
        if b is None:
            return self.runner.forward(tokens, start, seq, feature_layers), n
        layers = tuple(feature_layers)
        g = self._graph((b, layers), lambda: self._kind(b, self.max_pages, layers, self.scratch_page))
        seq.reserve(start + b)  # the padding rows write their (ignored) keys past the real ones
        g.set_inputs(tokens, start, seq)
        g.replay(n)
        return g.out, n
