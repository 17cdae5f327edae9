"""No drafting: every block is just the anchor (plain autoregressive verification, block size 1)."""

from __future__ import annotations

import numpy as np

from drafter_svc.drafters.base import Drafter, DrafterFactory


class NoneDrafter(Drafter):
    def start(self, prompt_ids: list[int], features: np.ndarray | None = None) -> None:
        pass

    def propose(self, anchor: int, k: int) -> list[int]:
        return []

    def commit(self, tokens: list[int], features: np.ndarray | None = None) -> None:
        pass


class NoneFactory(DrafterFactory):
    name = "none"
    max_block_size = 1

    def __init__(self) -> None:
        self.feature_layer_ids = []

    def new_session(self, sampling=None) -> NoneDrafter:
        return NoneDrafter()
