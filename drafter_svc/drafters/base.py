"""What every drafter is: per-request drafting state behind a factory that holds the loaded weights.

A round's block is `[anchor, d1 .. d_k]`: the anchor is the last token the target emitted (not yet in
the target's KV cache), the d_i are this drafter's proposals. After verification the loop calls
`commit` with the tokens that entered the target's KV this round (the anchor and the accepted drafts)
and, for drafters that condition on the target, their feature rows.
"""

from __future__ import annotations

import abc

import numpy as np

from pdflash.types import DraftDistribution, SamplingParams


class Proposal(list):
    """A drafter's drafts: a list of token ids, and for drafts it sampled (a request with temperature > 0) the
    distribution each was drawn from (`dists`, one per draft, sent to the verifier: DraftResult.draft_dists).
    Deterministic drafts (argmax, n-gram copies) have none."""

    def __init__(self, tokens=(), dists: tuple[DraftDistribution, ...] = ()):
        super().__init__(tokens)
        self.dists = tuple(dists)


class Drafter(abc.ABC):
    """Drafting state of one request. Not thread-safe: one request, one round at a time."""

    #: Whether `start`/`commit` need the target's feature rows (else they may be None).
    needs_features: bool = False

    @abc.abstractmethod
    def start(self, prompt_ids: list[int], features: np.ndarray | None = None) -> None:
        """The prompt is in the target's KV; `features` [len(prompt_ids), N*H] float32, or None."""

    @abc.abstractmethod
    def propose(self, anchor: int, k: int) -> list[int]:
        """Up to `k` draft tokens following `anchor` (may be fewer, even none). Does not change the context (a
        sampling drafter's random stream moves on). Sampled drafts come as a `Proposal` with their distributions."""

    @abc.abstractmethod
    def commit(self, tokens: list[int], features: np.ndarray | None = None) -> None:
        """`tokens` entered the target's KV this round; `features` has one row per token, or None."""

    def close(self) -> None:
        """Release per-request memory. Safe to call twice."""


class DrafterFactory(abc.ABC):
    """One per drafter kind per process: holds what all sessions share (weights, options)."""

    #: Kind name: "none", "ngram", "dflash" or "hybrid".
    name: str
    #: Target layers whose outputs the sessions need as features, in order; empty = none.
    feature_layer_ids: list[int]
    #: Largest useful block (anchor + drafts); None = no limit of the drafter's own.
    max_block_size: int | None = None

    @property
    def needs_features(self) -> bool:
        return bool(self.feature_layer_ids)

    @abc.abstractmethod
    def new_session(self, sampling: SamplingParams | None = None) -> Drafter:
        """A request's drafter. `sampling`: the request's; a drafter that can follows its penalties (their rule on its own
        logits, `pdflash.penalties`), so that its drafts guess the penalized target's tokens."""
