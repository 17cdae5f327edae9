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
                 v_dim: int | None = None):
        shape = (num_pages, kv_heads, PAGE, head_dim)
        # zeros, not empty: a masked key is still multiplied by a zero probability, and 0 * NaN would be NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape[:-1] + (v_dim or head_dim,), dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.device = device
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
