"""The DFlash drafter's forwards replayed from CUDA graphs: a proposal and a commit cost a few launches of host time.

Eagerly (before the model was fused) a proposal dispatched ~440 aten ops and a commit ~160 (3.4-3.8 ms and 1.2-2.2 ms
of host time on the H200 for tens of microseconds of GPU work). Here each forward runs over static buffers, so it can be captured once at load and
replayed at any position:

- One working buffer of context K/V rows, `[layers, rows, 2 (K, V), Hkv, D]` (a row's K and V side by side: a layer's
  new rows go in with one `index_copy_`, a commit's rows of every layer with one; `kv` is its `[layers, 2, Hkv, rows,
  D]` view), rows = `capacity` context rows followed by `SPARE` rows for a forward's own block (a proposal's block rows,
  a commit's padding rows), rounded up to a multiple of 16 (the memory-efficient attention kernel's mask alignment).
  Attention reads the whole buffer under a key mask: rows `0 .. L-1` (the committed context) and the block's real
  rows; everything else (rows past L, padding rows) is masked out, so the buffer's size changes nothing but float
  summation order. The mask is additive, built once per proposal (3 kernels), not per layer.
- Inputs in static device tensors: `meta` = (L, n real rows, then per row of the widest bucket: its position, the
  buffer row it writes, its token id), one host->device copy per forward, computed on the host; a commit's feature rows,
  one more. Rotary (cos, signed sin) pairs are gathered from a table of every position the buffer can hold, one gather
  per forward.
- The model runs fused (`DFlashDraftModel.fuse`, what `load_dflash` does by default): see drafter_svc/dflash_model.py
  and benchmarks/drafter_ops.py for the kernels a forward dispatches.
- Buckets: a proposal's block (anchor + k drafts, k+1 = 2 .. block_size rows) is padded to the next of
  `propose_buckets` (4, 8, 16 for a 16-row drafter; the drafter's block size is always one), a commit's rows to the next
  of `COMMIT_BUCKETS` (4 .. 32; a longer commit, e.g. a prompt, goes in chunks of 32). Padding rows of a commit go to
  the spare rows, never into the context's rows: the committed context is exactly the real rows.

Sessions share the buffer: it holds one session's context at a time (`resident`); a session that is not resident keeps
its rows in its own store (`GraphedContext.store`, grown by doubling up to its length, as the eager `ContextKV` does).
A forward for another session first saves the resident's rows into its store and loads the new one's (one strided copy
each, only when the session changes: a lone request never copies). A session whose context would pass `capacity` leaves
the graphs for good: its rows move into a `ContextKV` and it runs the eager path (correctness first; nothing is
re-captured). Memory: the working buffer is `layers * 2 * Hkv * rows * D` elements of the model's dtype
(bf16 at the default 2048 rows: the demo drafter 5 MiB, a 5-layer drafter with 8 KV heads of 128 41 MiB), plus each
graph's private pool (its forward's activations, the LM head's logits the largest of them: 15 x vocab in bf16 for a
16-row proposal) and each session's store (its own context only).

Without capture (`capture=False`, or a CPU device) the same static-buffer code runs eagerly: that is how the CPU tests
check the math against the eager drafter. Capture and replay run only on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from drafter_svc.dflash_model import ContextKV, DFlashDraftModel, RopeTable, _norm

#: Rows after the context: a proposal's block and a commit's padding rows land here (the largest bucket of either).
SPARE = 32
#: meta's scalar fields (L, n) before its per-row ones.
META = 2
COMMIT_BUCKETS = (4, 8, 16, 32)
DEFAULT_CAPACITY = 2048
#: Eager runs of each forward on a side stream before its capture (cuBLAS handles, kernels' first-use work).
WARMUP_RUNS = 2


def propose_buckets(block_size: int) -> tuple[int, ...]:
    """Padded block widths for a drafter whose blocks have 2 .. block_size rows: 4, 8, 16, ... below block_size, then
    block_size itself (its widest block is never padded)."""
    out, b = [], 4
    while b < block_size:
        out.append(b)
        b *= 2
    return (*out, block_size)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows: wider than the largest bucket ({buckets[-1]})")


def graphs_unsupported(model: DFlashDraftModel) -> str:
    """Why the graphed path cannot serve this drafter ('' when it can)."""
    if not RopeTable(model.rotary_emb).fixed:
        return f"rope type {model.rotary_emb.rope_type!r} depends on the length (no fixed table of positions)"
    if model.spec.block_size > SPARE:
        return f"block size {model.spec.block_size} is wider than the graphs' {SPARE} spare rows"
    return ""


@dataclasses.dataclass(eq=False)
class GraphedContext:
    """One session's committed context on the graphed path: its length, and its rows while another session is resident."""

    length: int = 0
    store: torch.Tensor | None = None  # [layers, 2, Hkv, rows >= length, D]; valid only while not resident
    closed: bool = False


class DFlashGraphs:
    """Static-buffer forwards of one loaded drafter, captured as CUDA graphs (one per bucket) and shared by its sessions.

    Not thread-safe: the drafter runs every torch call on one thread (pdflash.torch_thread); `release` alone may come
    from another thread (it only marks the context)."""

    def __init__(
        self,
        model: DFlashDraftModel,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        capacity: int = DEFAULT_CAPACITY,
        capture: bool | None = None,
    ):
        why = graphs_unsupported(model)
        if why:
            raise ValueError(f"the DFlash drafter cannot run from CUDA graphs: {why}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 context row, got {capacity}")
        self.model, self.embed, self.lm_head = model.fuse(), embed, lm_head
        self.capacity = capacity
        self.device = embed.device
        self.dtype = model.fc.weight.dtype
        self.propose_buckets = propose_buckets(model.spec.block_size)
        self.commit_buckets = COMMIT_BUCKETS
        attn = model.layers[0].self_attn
        # Context rows, spare rows, and up to 15 more (masked like padding) so that the key count is a multiple of 16: the
        # memory-efficient attention kernel would pad an unaligned mask on every call (a copy per layer).
        rows = -(-(capacity + SPARE) // 16) * 16
        dev = self.device
        #: The rows: [layers, rows, 2, Hkv, D]; `kv` is the same memory as [layers, 2, Hkv, rows, D].
        self.kv_rows = torch.zeros(len(model.layers), rows, 2, attn.num_kv_heads, attn.head_dim, dtype=self.dtype, device=dev)
        self.kv = self.kv_rows.permute(0, 2, 3, 1, 4)
        self.meta = torch.zeros(META + 3 * SPARE, dtype=torch.long, device=dev)  # see _set_meta
        self.features = torch.zeros(SPARE, model.fc.in_features, dtype=torch.float32, device=dev)
        # Rotary (cos, signed sin) of every position a forward may use (L + bucket - 1 < rows), as the eager table has them.
        self._rope = RopeTable(model.rotary_emb).pairs(self.kv_rows, 0, rows)
        # The proposal's key mask: key r is visible when order[r] < (L for context rows, n for spare rows).
        r = torch.arange(rows, device=dev)
        self._spare = r >= capacity
        self._order = torch.where(self._spare, r - capacity, r)
        self._zero = torch.zeros((), dtype=self.dtype, device=dev)
        self._ninf = torch.full((), float("-inf"), dtype=self.dtype, device=dev)
        # Host-side templates of meta's per-row fields.
        self._j = np.arange(SPARE)
        self._mask_ids = np.full(SPARE, model.spec.mask_token_id)
        self.resident: GraphedContext | None = None
        self.captured = self.device.type == "cuda" if capture is None else capture
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        if self.captured:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
            self._capture_all()

    # ---- sessions --------------------------------------------------------------------------
    def new_context(self) -> GraphedContext:
        return GraphedContext()

    def fits(self, ctx: GraphedContext, n: int) -> bool:
        """Whether n more rows fit in the working buffer after ctx's."""
        return ctx.length + n <= self.capacity

    def release(self, ctx: GraphedContext) -> None:
        """The session ended: its rows are never saved or loaded again (its store goes with the last reference)."""
        ctx.closed = True

    def to_context_kv(self, ctx: GraphedContext) -> ContextKV:
        """ctx's rows as an eager `ContextKV` (a session leaving the graphs); ctx is released."""
        src = self.kv if self.resident is ctx else ctx.store
        cache = ContextKV(len(self.model.layers))
        if ctx.length:  # src is a [layers, 2, Hkv, rows, D] view of rows [layers, rows, 2, Hkv, D]: one copy
            cache.append_all(src.permute(0, 3, 1, 2, 4)[:, None, : ctx.length])
        cache.length = ctx.length
        if self.resident is ctx:
            self.resident = None
        self.release(ctx)
        return cache

    def _enter(self, ctx: GraphedContext) -> None:
        """Make ctx resident: save the resident's rows into its store, load ctx's (only when the session changes)."""
        if self.resident is ctx:
            return
        if ctx.closed:
            raise RuntimeError("the DFlash session was closed")
        old = self.resident
        if old is not None and not old.closed and old.length:
            if old.store is None or old.store.shape[3] < old.length:
                size = min(max(64, 2 * old.length), self.capacity)
                old.store = self.kv_rows.new_empty(self.kv_rows.shape[0], size, *self.kv_rows.shape[2:]).permute(0, 2, 3, 1, 4)
            old.store[:, :, :, : old.length].copy_(self.kv[:, :, :, : old.length])
        if ctx.length:
            self.kv[:, :, :, : ctx.length].copy_(ctx.store[:, :, :, : ctx.length])
        self.resident = ctx

    # ---- a round's two calls ---------------------------------------------------------------
    @torch.no_grad()
    def propose(self, ctx: GraphedContext, anchor: int, k: int) -> list[int]:
        """k drafts after anchor at positions L..L+k (L = ctx's length); nothing of ctx changes. k+1 <= block size."""
        return self._replay_proposal(ctx, anchor, k)[0][:k].tolist()  # the round's one device->host copy

    @torch.no_grad()
    def propose_logits(self, ctx: GraphedContext, anchor: int, k: int) -> torch.Tensor:
        """The k draft rows' logits [k, V] of the same forward as `propose` (a penalized request drafts from them): a view
        of the graph's output, valid until the next replay."""
        return self._replay_proposal(ctx, anchor, k)[1][:k]

    def _replay_proposal(self, ctx: GraphedContext, anchor: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = _bucket(self.propose_buckets, k + 1)
        self._enter(ctx)
        self._set_meta(ctx.length, k + 1, anchor)
        return self._run("propose", t)

    @torch.no_grad()
    def extend(self, ctx: GraphedContext, rows: torch.Tensor) -> None:
        """Append the context rows of host features [n, N*H] float32 (pinned on CUDA) at ctx's next positions; the
        caller checked `fits`."""
        if not self.fits(ctx, rows.shape[0]):
            raise ValueError(f"{rows.shape[0]} rows after {ctx.length} do not fit in {self.capacity}")
        self._enter(ctx)
        top = self.commit_buckets[-1]
        for start in range(0, rows.shape[0], top):
            chunk = rows[start : start + top]
            n = chunk.shape[0]
            self.features[:n].copy_(chunk, non_blocking=True)
            self._set_meta(ctx.length, n, kind="commit")
            self._run("commit", _bucket(self.commit_buckets, n))
            ctx.length += n

    def _set_meta(self, length: int, n: int, anchor: int = 0, kind: str = "propose") -> None:
        """meta = [L, n | positions L + j | buffer rows written | token ids], j = 0 .. SPARE-1 (a forward reads its
        bucket's first t of each): a proposal writes its block to the spare rows, its ids are [anchor, MASK ...]; a
        commit's real rows go to rows L.., its padding rows to the spare rows."""
        host = torch.empty(META + 3 * SPARE, dtype=torch.long, pin_memory=self.device.type == "cuda")
        m = host.numpy()  # a fresh (pinned) block: torch's host allocator keeps it until the copy has run
        j, cap = self._j, self.capacity
        m[0], m[1] = length, n
        m[META : META + SPARE] = length + j
        m[META + SPARE : META + 2 * SPARE] = cap + j if kind == "propose" else np.where(j < n, length + j, cap + j)
        m[META + 2 * SPARE :] = self._mask_ids
        m[META + 2 * SPARE] = anchor
        self.meta.copy_(host, non_blocking=True)

    def _run(self, kind: str, t: int) -> torch.Tensor | None:
        if not self.captured:
            return self._forward(kind, t)
        graph, out = self._graphs[(kind, t)]
        graph.replay()
        return out

    # ---- the static forwards (captured on CUDA) ---------------------------------------------
    def _forward(self, kind: str, t: int) -> torch.Tensor | None:
        return self._propose_forward(t) if kind == "propose" else self._commit_forward(t)

    def _inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bucket's (cos, signed sin) pairs [1, t, 2, D] (one gather), the rows it writes, its token ids (views)."""
        m = self.meta
        rope = self._rope.index_select(1, m[META : META + t])
        return rope, m[META + SPARE : META + SPARE + t], m[META + 2 * SPARE : META + 2 * SPARE + t]

    def _propose_forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [t-1], their logits [t-1, V]): the block [anchor, MASK x t-1] at L..L+t-1 over the context; its rows in the spare rows."""
        rope, slots, ids = self._inputs(t)
        h = self.embed.index_select(0, ids)[None]
        limit = torch.where(self._spare, self.meta[1], self.meta[0])
        mask = torch.where(self._order < limit, self._zero, self._ninf)[None, None, None]  # [1, 1, 1, rows], every query row alike
        for i, layer in enumerate(self.model.layers):
            sink = functools.partial(self._write, i, slots)
            h = layer.fused(h, self.model._fused_attention(i), rope, sink, mask)  # h is ours: updated in place
        h = _norm(h, self.model.norm)
        logits = h[0, 1:] @ self.lm_head.T
        return logits.argmax(dim=-1), logits

    def _commit_forward(self, t: int) -> None:
        """The K/V of features[:n] into rows L..L+n-1; padding rows (n..t-1) into spare rows."""
        rope, slots, _ = self._inputs(t)
        ctx = self.model.project_context(self.features[:t].to(self.dtype)[None])
        self.kv_rows.index_copy_(1, slots, self.model.kv_rows(ctx, rope)[:, 0])  # every layer's rows, one copy
        return None

    def _write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [1, t, 2, Hkv, D] (K | V) into the layer's buffer rows `slots`, one copy; the layer's whole K and V
        [1, Hkv, rows, D] (views)."""
        self.kv_rows[layer].index_copy_(0, slots, rows[0])
        return self.kv[layer, 0][None], self.kv[layer, 1][None]

    # ---- capture (CUDA only) ----------------------------------------------------------------
    def _capture_all(self) -> None:
        """One graph per (kind, bucket), each in its own private memory pool (they replay in any order, so they do not
        share one: torch's rule for a shared pool is replay in capture order). Capture writes into the working buffer;
        no session is resident yet."""
        with torch.cuda.device(self.device), torch.no_grad():
            side = torch.cuda.Stream()
            for kind, buckets in (("propose", self.propose_buckets), ("commit", self.commit_buckets)):
                for t in buckets:
                    self._set_meta(0, t, kind=kind)  # any valid input: rows 0..t-1
                    fn = functools.partial(self._forward, kind, t)
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(WARMUP_RUNS):
                            fn()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = fn()
                    self._graphs[(kind, t)] = (graph, out)
            torch.cuda.synchronize()
        self.kv.zero_()
        self.resident = None

    def memory_bytes(self) -> int:
        """The working buffer's and the static inputs' bytes (the graphs' pool comes on top)."""
        return sum(x.numel() * x.element_size() for x in (self.kv_rows, self.features, self._rope, self.meta, self._order, self._spare))


def host_rows(features: np.ndarray, device: torch.device) -> torch.Tensor:
    """Feature rows as a host tensor that copies to `device` without waiting (pinned on CUDA)."""
    rows = torch.from_numpy(features) if features.flags.writeable else torch.tensor(features)
    return rows.pin_memory() if device.type == "cuda" else rows
