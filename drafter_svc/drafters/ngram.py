"""Prompt-lookup drafting: continue the most recent earlier occurrence of the context's last n tokens.

The query is the last n tokens of (committed context + anchor), n from `max_n` down to `min_n`. An
index maps every n-gram of the committed context to the position of its last token, updated as
tokens commit, so a lookup costs `max_n - min_n + 1` dict probes instead of a scan of the context.
"""

from __future__ import annotations

import numpy as np

from drafter_svc.drafters.base import Drafter, DrafterFactory


class NgramIndex:
    """A growing token sequence and, per n-gram (min_n <= n <= max_n), where it last ended."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def lookup(self, anchor: int, k: int) -> tuple[int, list[int]]:
        """(n of the longest matching suffix of context + anchor, up to k tokens that followed it).

        (0, []) when nothing matches. Only matches ending inside the committed context are indexed,
        so the query never matches itself.
        """
        if k <= 0:
            return 0, []
        query = self.tokens[max(0, len(self.tokens) - (self.max_n - 1)) :] + [int(anchor)]
        for n in range(min(self.max_n, len(query)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(query[-n:]))
            if end is not None:
                return n, self._continuation(end, int(anchor), k)
        return 0, []

    def _continuation(self, end: int, anchor: int, k: int) -> list[int]:
        # Sequence positions: 0..L-1 the context, L the anchor, L+1.. the proposal itself. A match
        # that ends near the anchor overlaps the query; reading on into the proposal repeats the
        # pattern with its period (L - end), as an LZ77 overlapping copy does. Greedy loops are common.
        length = len(self.tokens)
        out: list[int] = []
        for i in range(k):
            src = end + 1 + i
            if src < length:
                out.append(self.tokens[src])
            elif src == length:
                out.append(anchor)
            else:
                out.append(out[src - length - 1])
        return out


class NgramDrafter(Drafter):
    """`weak_drafts`: a match on fewer than max_n tokens proposes at most this many (None = no cap).

    Short matches are weak evidence: on the demo pair's held-out prompts a 1- or 2-token match's first
    draft is rejected most of the time, and every draft past a rejection costs verify time for nothing
    (benchmarks/README.md, "Verify width", has the numbers).
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, weak_drafts: int | None = 3):
        if weak_drafts is not None and weak_drafts < 1:
            raise ValueError(f"weak_drafts must be >= 1 or None, got {weak_drafts}")
        self._min_n, self._max_n = min_n, max_n
        self.weak_drafts = weak_drafts
        self.index = NgramIndex(min_n, max_n)

    def start(self, prompt_ids: list[int], features: np.ndarray | None = None) -> None:
        self.index = NgramIndex(self._min_n, self._max_n)
        self.index.extend(prompt_ids)

    def match(self, anchor: int, k: int) -> tuple[int, list[int]]:
        """(matched n-gram length, continuation); (0, []) when nothing matches."""
        return self.index.lookup(anchor, k)

    def propose(self, anchor: int, k: int) -> list[int]:
        n, tokens = self.index.lookup(anchor, k)
        if self.weak_drafts is not None and n < self._max_n:
            return tokens[: self.weak_drafts]
        return tokens

    def commit(self, tokens: list[int], features: np.ndarray | None = None) -> None:
        self.index.extend(tokens)

    def close(self) -> None:
        self.index = NgramIndex(self._min_n, self._max_n)


class NgramFactory(DrafterFactory):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3, max_block_size: int | None = None, weak_drafts: int | None = 3):
        NgramDrafter(min_n, max_n, weak_drafts)  # validates the options now rather than per request
        if max_block_size is not None and max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {max_block_size}")
        self.min_n, self.max_n = min_n, max_n
        self.weak_drafts = weak_drafts
        self.max_block_size = max_block_size
        self.feature_layer_ids = []

    def new_session(self, sampling=None) -> NgramDrafter:  # (copies the context: no penalties)
        return NgramDrafter(self.min_n, self.max_n, self.weak_drafts)
