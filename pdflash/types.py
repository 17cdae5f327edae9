"""Plain Python types shared by the services. No protobuf, no grpc: the servicers convert at the edge."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

# Per MoE layer, the set of routed expert ids. Keys are decoder layer indices. A value, never changed once made: one
# that came off the wire is a read-only mapping over its messages (pdflash.convert), a dict otherwise.
ExpertUnion = Mapping[int, frozenset[int]]


class FinishReason(enum.IntEnum):
    """Mirrors pdflash.v1.FinishReason (same numbers)."""

    UNSPECIFIED = 0
    LENGTH = 1
    STOP = 2
    ABORTED = 3
    CONTEXT = 4


class DrafterKind(enum.IntEnum):
    """Mirrors pdflash.v1.DrafterKind (same numbers)."""

    UNSPECIFIED = 0
    NONE = 1
    NGRAM = 2
    DFLASH = 3
    HYBRID = 4


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1 = off (transformers' semantics: prompt and output tokens)
    presence_penalty: float = 0.0  # 0 = off (OpenAI's: output tokens)
    frequency_penalty: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True)
class DraftDistribution:
    """A sparse distribution a sampled draft was drawn from: q(ids[i]) = probs[i] / sum(probs), 0 elsewhere."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class DraftResult:
    """One round's proposal: the block (anchor + drafts) and its projected expert demand. `draft_dists`: for sampled
    drafts, one per draft (the distribution it was drawn from); empty for deterministic drafts."""

    session_id: str
    round: int
    tokens: tuple[int, ...]
    expert_union: ExpertUnion
    expert_bytes: int
    draft_dists: tuple[DraftDistribution, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def union_of(unions: Iterable[Mapping[int, Iterable[int]]]) -> ExpertUnion:
    """Layer-wise union of several expert unions."""
    merged: dict[int, set[int]] = {}
    for u in unions:
        for layer, ids in u.items():
            merged.setdefault(int(layer), set()).update(int(i) for i in ids)
    return {layer: frozenset(ids) for layer, ids in sorted(merged.items())}


def union_bytes(union: Mapping[int, Iterable[int]], byte_map: Mapping[int, list[int] | tuple[int, ...]]) -> int:
    """Exact stored bytes of a union, from a per-layer list of per-expert byte sizes."""
    return int(sum(sum(map(byte_map[layer].__getitem__, ids)) for layer, ids in union.items()))
