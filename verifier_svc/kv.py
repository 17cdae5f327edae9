"""The verifier's paged KV cache: one pool of pages per layer, shared by every session.

A page holds PAGE consecutive positions of one sequence (all KV heads): pool[layer] is [pages, Hkv, PAGE, D].
A session owns a list of pages (its page table); position p lives in page table[p // PAGE] at p % PAGE.
Rollback after a rejected draft is a length change (the next forward overwrites the rejected positions);
pages return to the pool when the session ends. Because the layout is a pool plus per-sequence tables, the
same forward can later read several sessions at once (a ragged batch: one table row per sequence), and a
CUDA graph captured once serves every session (its table is copied into the graph's table buffer).
"""

from __future__ import annotations

import itertools

import torch

from pdflash_kernels.attention import PAGE
from pdflash.errors import ResourceExhausted


class KVPool:
    """`k`/`v`: each layer's pools. `v_dim` (default head_dim): a value width of its own; multi-head latent attention
    keeps its latent in `k` ([pages, 1, PAGE, L]) and the latent's rotary key in `v` ([pages, 1, PAGE, DR])
    (`layout`)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_pages: int, dtype: torch.dtype, device: torch.device,
                 v_dim: int | None = None, kv_layers: "set[int] | None" = None, linear: "LinearStates | None" = None):
        shape = (num_pages, kv_heads, PAGE, head_dim)
        # zeros, not empty: a masked key is still multiplied by a zero probability, and 0 * NaN would be NaN.
        # A hybrid's layers without keys (`kv_layers`: those with) get no pages: their state is in `linear`.
        has = lambda i: kv_layers is None or i in kv_layers  # noqa: E731
        self.k = [torch.zeros(shape if has(i) else (0,), dtype=dtype, device=device) for i in range(num_layers)]
        self.v = [torch.zeros(shape[:-1] + (v_dim or head_dim,) if has(i) else (0,), dtype=dtype, device=device)
                  for i in range(num_layers)]
        self.num_pages = num_pages
        self.device = device
        self.linear = linear
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ResourceExhausted(
                f"the KV cache is full ({self.num_pages} pages of {PAGE} positions); retry when other requests end",
                retry_after_s=1.0,
            )
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    @staticmethod
    def pages_for(kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype, budget_bytes: int,
                  v_dim: int | None = None) -> int:
        per_page = num_layers * kv_heads * PAGE * (head_dim + (v_dim or head_dim)) * torch.empty((), dtype=dtype).element_size()
        return max(1, budget_bytes // per_page)

    @staticmethod
    def layout(config) -> tuple[int, int, int]:
        """(kv_heads, k width, v width) of a text config's pools: its key/value heads and head_dim, or for multi-head
        latent attention (kv_lora_rank and qk_rope_head_dim set) one latent of kv_lora_rank and its rotary key."""
        from pdflash_kernels.mla import latent_layout

        latent = latent_layout(config)
        if latent is not None:
            return 1, latent[0], latent[1]
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return kv_heads, head_dim, head_dim


_SEQ_IDS = itertools.count(1)


class SequenceKV:
    """One session's pages (its committed length lives in the session: `Session.committed`). `uid`: unique in the
    process; with len(pages) it names the content of `table` (pages are only appended until `free`)."""

    def __init__(self, pool: KVPool, max_positions: int):
        self.pool = pool
        self.uid = next(_SEQ_IDS)
        self.pages: list[int] = []
        self.max_pages = (max_positions + PAGE - 1) // PAGE
        self.table = torch.zeros(self.max_pages, dtype=torch.int32, device=pool.device)
        # a hybrid's recurrent state: its slot, and where the tokens its last forward left pending start, how many, and
        # in which half of the slot's pending buffers they are (`linear_row`)
        self.linear = pool.linear.alloc() if pool.linear is not None else None
        self.pending_at, self.pending_len, self.pending_half = 0, 0, 0

    def reserve(self, positions: int) -> None:
        """Make sure pages exist for positions [0, positions)."""
        need = (positions + PAGE - 1) // PAGE
        if need > self.max_pages:
            raise ValueError(f"{positions} positions exceed the context of {self.max_pages * PAGE}")
        if need > len(self.pages):
            new = self.pool.alloc(need - len(self.pages))
            self.table[len(self.pages) : need] = torch.tensor(new, dtype=torch.int32, device="cpu").to(self.table.device)
            self.pages += new

    def slot_lists(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """(page, offset) of positions start .. start + n - 1, on the host."""
        return [self.pages[p // PAGE] for p in range(start, start + n)], [p % PAGE for p in range(start, start + n)]

    def slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of positions start .. start + n - 1, as device tensors."""
        pos = torch.arange(start, start + n)
        pages = torch.tensor([self.pages[p // PAGE] for p in pos.tolist()], dtype=torch.long)
        return pages.to(self.pool.device), (pos % PAGE).to(self.pool.device)

    def free(self) -> None:
        self.pool.release(self.pages)
        self.pages = []
        if self.linear is not None:
            self.pool.linear.release(self.linear)
            self.linear = None

    def linear_row(self, start: int, n: int, row0: int = 0) -> list[int]:
        """The recurrent layers' row for a forward of this sequence's positions start .. start + n - 1 in rows row0 ..
        of the forward (pdflash_kernels.gdn's `META`), and the bookkeeping of what that forward leaves pending: it
        replays the last forward's tokens up to `start` (the accepted ones; the rest are dropped), commits all of its
        own but the last `pending`, and writes those into the other half. Called once per forward, as its inputs are set."""
        if self.linear is None:
            raise RuntimeError("this sequence has no recurrent-state slot (freed, or a model without recurrent layers)")
        a = start - self.pending_at
        if not 0 <= a <= self.pending_len:
            raise ValueError(f"a forward from position {start} cannot continue the recurrent state: it holds the tokens up to "
                             f"{self.pending_at} and {self.pending_len} pending after them (a hybrid rolls back only "
                             "its last forward's tokens)")
        commit = max(0, n - self.pool.linear.pending)
        row = [self.linear, a, commit, self.pending_half, row0, n]
        self.pending_at, self.pending_len, self.pending_half = start + commit, n - commit, 1 - self.pending_half
        return row


class LinearStates:
    """A hybrid model's recurrent layers on the paged forward (Gated DeltaNet, Kimi Delta Attention, Mamba-2, LFM2 short
    convolutions: pdflash_kernels.gdn's PagedGDN per layer), one slot per live sequence; slot 0 is the CUDA graphs' scratch (captures write there), never
    handed out. `pending`: the most tokens a forward leaves pending (the longest verify block: a forward's earlier tokens
    enter the state at once)."""

    def __init__(self, modules: dict, slots: int, pending: int, dtype: torch.dtype, device: torch.device):
        from pdflash_kernels.gdn import PagedGDN

        if slots < 2:
            raise ValueError("the recurrent state needs at least 2 slots (one session and the scratch)")
        self.layers = {i: PagedGDN.for_module(m, slots, pending, dtype, device) for i, m in modules.items()}
        self.slots, self.pending, self.scratch = slots, pending, 0
        self._free = list(range(slots - 1, 0, -1))

    @staticmethod
    def slot_bytes(modules: dict, pending: int, dtype: torch.dtype) -> int:
        from pdflash_kernels.gdn import PagedGDN

        return sum(PagedGDN.slot_bytes(m, pending, dtype) for m in modules.values())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise ResourceExhausted(f"every recurrent-state slot is taken ({self.slots - 1} sessions); retry when other "
                                    "requests end", retry_after_s=1.0)
        slot = self._free.pop()
        for st in self.layers.values():
            st.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def scratch_row(self, rows: int, row0: int = 0) -> list[int]:
        """A row for a capture or an unused sequence slot of a wave graph (rows 0: it runs nothing)."""
        return [self.scratch, 0, 0, 0, row0, rows]
