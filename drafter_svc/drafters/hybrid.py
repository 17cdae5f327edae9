"""N-gram where the context repeats itself, DFlash elsewhere (REFERENCE.md section 9: the best of both).

Each round: when the last `min_match` or more tokens of (context + anchor) occurred earlier, propose
what followed them; otherwise propose the DFlash block. Both inner drafters see every start/commit, so
either is current whichever one proposed.
"""

from __future__ import annotations

import numpy as np

from drafter_svc.drafters.base import Drafter, DrafterFactory
from drafter_svc.drafters.dflash import DFlashDrafter, DFlashFactory
from drafter_svc.drafters.ngram import NgramDrafter


class HybridDrafter(Drafter):
    needs_features = True

    def __init__(self, ngram: NgramDrafter, dflash: DFlashDrafter, min_match: int):
        self.ngram = ngram
        self.dflash = dflash
        self.min_match = min_match
        #: Which drafter made the last proposal: "ngram", "dflash" or "" before the first.
        self.last_source = ""

    def start(self, prompt_ids: list[int], features: np.ndarray | None = None) -> None:
        self.ngram.start(prompt_ids)
        self.dflash.start(prompt_ids, features)

    def propose(self, anchor: int, k: int) -> list[int]:
        # The n-gram proposal may use the whole block; DFlash drafts at most its trained block.
        n, tokens = self.ngram.match(anchor, k)
        if n >= self.min_match and tokens:
            self.last_source = "ngram"
            return tokens
        self.last_source = "dflash"
        return self.dflash.propose(anchor, k)

    def commit(self, tokens: list[int], features: np.ndarray | None = None) -> None:
        self.ngram.commit(tokens)
        self.dflash.commit(tokens, features)

    def close(self) -> None:
        self.ngram.close()
        self.dflash.close()


class HybridFactory(DrafterFactory):
    name = "hybrid"

    def __init__(self, dflash: DFlashFactory, min_match: int = 3, max_n: int | None = None):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if max_n is not None and max_n < min_match:
            raise ValueError(f"max_n ({max_n}) must be >= min_match ({min_match})")
        self.dflash = dflash
        self.min_match = min_match
        # Shorter matches are never used here, so only n-grams of min_match..max_n are indexed.
        self.max_n = max_n or min_match
        self.feature_layer_ids = list(dflash.feature_layer_ids)
        self.max_block_size = None  # n-gram rounds may use the server's largest block

    def new_session(self, sampling=None) -> HybridDrafter:
        return HybridDrafter(NgramDrafter(self.min_match, self.max_n), self.dflash.new_session(sampling), self.min_match)
