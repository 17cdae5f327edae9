"""Conversions between the shared protobuf messages and pdflash.types. The only shared place that knows protobuf.

numpy is imported by the tensor conversions only: the public API's edge (drafter_svc.api, which the stub
server shares) converts sampling parameters here and must import without numpy (the light install).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pdflash.types import DraftDistribution, DraftResult, ExpertUnion, SamplingParams
from pdflash.v1 import common_pb2

if TYPE_CHECKING:
    import numpy as np

_DTYPE_NAMES = ("float32", "float16")


# A union goes through these several times a round in each service (hundreds to thousands of ids for a real
# model). A union that came off the wire stays its messages until something reads it (the scheduler only keeps
# it, the drafter only sends it on) and is sent on as those messages (copied in C), not converted again; the
# conversions do no Python work per id beyond what sorted() / frozenset() do in C.
class _Received(Mapping):
    """An ExpertUnion (layer -> frozenset of expert ids) as LayerExperts messages, parsed on first read. A value:
    nothing changes one once made."""

    __slots__ = ("messages", "_union")

    def __init__(self, messages: list[common_pb2.LayerExperts]):
        self.messages = messages
        self._union: dict[int, frozenset[int]] | None = None

    def _parsed(self) -> dict[int, frozenset[int]]:
        if self._union is None:
            out: dict[int, frozenset[int]] = {}
            for le in self.messages:
                ids = frozenset(le.expert_ids)
                out[le.layer] = out[le.layer] | ids if le.layer in out else ids  # a layer listed twice: both
            self._union = dict(sorted(out.items()))
        return self._union

    def __getitem__(self, layer: int) -> frozenset[int]:
        return self._parsed()[layer]

    def __iter__(self):
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def __repr__(self) -> str:
        return repr(self._parsed())


def union_to_pb(union: Mapping[int, frozenset[int] | set[int]]) -> list[common_pb2.LayerExperts]:
    if isinstance(union, _Received):
        return list(union.messages)
    return [common_pb2.LayerExperts(layer=int(l), expert_ids=sorted(ids)) for l, ids in sorted(union.items())]


def union_from_pb(layers) -> ExpertUnion:
    """The union of LayerExperts messages (a read-only mapping, parsed when first read)."""
    return _Received(list(layers))


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                                   frequency_penalty=s.frequency_penalty)
    if s.seed is not None:
        pb.seed = s.seed
    return pb


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    top_p = float(pb.top_p)
    rep = float(pb.repetition_penalty)
    return SamplingParams(
        temperature=float(pb.temperature),
        top_p=1.0 if top_p == 0.0 else top_p,
        top_k=int(pb.top_k),
        seed=int(pb.seed) if pb.HasField("seed") else None,
        repetition_penalty=1.0 if rep == 0.0 else rep,
        presence_penalty=float(pb.presence_penalty),
        frequency_penalty=float(pb.frequency_penalty),
    )


def draft_to_pb(d: DraftResult) -> common_pb2.DraftResult:
    return common_pb2.DraftResult(
        session_id=d.session_id,
        round=d.round,
        tokens=list(d.tokens),
        expert_union=union_to_pb(d.expert_union),
        expert_bytes=d.expert_bytes,
        draft_dists=[common_pb2.DraftDistribution(ids=list(q.ids), probs=list(q.probs)) for q in d.draft_dists],
    )


def draft_from_pb(pb: common_pb2.DraftResult) -> DraftResult:
    return DraftResult(
        session_id=pb.session_id,
        round=int(pb.round),
        tokens=tuple(int(t) for t in pb.tokens),
        expert_union=union_from_pb(pb.expert_union),
        expert_bytes=int(pb.expert_bytes),
        draft_dists=tuple(DraftDistribution(tuple(int(i) for i in q.ids), tuple(float(p) for p in q.probs)) for q in pb.draft_dists),
    )


def array_to_pb(a: np.ndarray | None) -> common_pb2.Tensor | None:
    import numpy as np

    if a is None:
        return None
    a = np.ascontiguousarray(a)
    name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}[a.dtype]
    # one copy (tobytes); astype copies only on a big-endian host
    return common_pb2.Tensor(shape=list(a.shape), dtype=name, data=a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def array_from_pb(pb: common_pb2.Tensor) -> np.ndarray:
    """A writeable array of its own (one copy of the payload: torch.from_numpy needs a writeable array)."""
    import numpy as np

    if pb.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported tensor dtype {pb.dtype!r}")
    dt = np.dtype(pb.dtype).newbyteorder("<")
    shape = tuple(pb.shape)
    arr = np.frombuffer(pb.data, dtype=dt)
    if arr.size != math.prod(shape):
        raise ValueError(f"tensor data has {arr.size} elements, shape {shape} needs {math.prod(shape)}")
    return arr.reshape(shape).astype(dt.newbyteorder("="))


def top_logprobs_to_pb(tops) -> list[common_pb2.TopLogprobs]:
    """[(ids, logprobs), ...] (one a position, the likeliest first) -> TopLogprobs messages (None: none)."""
    return [common_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in (tops or ())]


def top_logprobs_from_pb(messages) -> list[tuple[list[int], list[float]]] | None:
    """TopLogprobs messages -> [(ids, logprobs), ...]; None when there are none."""
    return [(list(m.token_ids), list(m.logprobs)) for m in messages] or None
