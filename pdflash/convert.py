"""Conversions between the shared protobuf messages and pdflash.types. The only shared place that knows protobuf.

numpy is imported by the tensor conversions only: the public API's edge (drafter_svc.api, which the stub
server shares) converts sampling parameters here and must import without numpy (the light install).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pdflash.types import DraftResult, ExpertUnion, SamplingParams
from pdflash.v1 import common_pb2

if TYPE_CHECKING:
    import numpy as np

_DTYPE_NAMES = ("float32", "float16")


def union_to_pb(union: Mapping[int, frozenset[int] | set[int]]) -> list[common_pb2.LayerExperts]:
    return [common_pb2.LayerExperts(layer=int(l), expert_ids=sorted(int(e) for e in ids)) for l, ids in sorted(union.items())]


def union_from_pb(layers) -> ExpertUnion:
    out: dict[int, set[int]] = {}
    for le in layers:
        out.setdefault(int(le.layer), set()).update(int(e) for e in le.expert_ids)
    return {l: frozenset(ids) for l, ids in sorted(out.items())}


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if s.seed is not None:
        pb.seed = s.seed
    return pb


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    top_p = float(pb.top_p)
    return SamplingParams(
        temperature=float(pb.temperature),
        top_p=1.0 if top_p == 0.0 else top_p,
        top_k=int(pb.top_k),
        seed=int(pb.seed) if pb.HasField("seed") else None,
    )


def draft_to_pb(d: DraftResult) -> common_pb2.DraftResult:
    return common_pb2.DraftResult(
        session_id=d.session_id,
        round=d.round,
        tokens=list(d.tokens),
        expert_union=union_to_pb(d.expert_union),
        expert_bytes=d.expert_bytes,
    )


def draft_from_pb(pb: common_pb2.DraftResult) -> DraftResult:
    return DraftResult(
        session_id=pb.session_id,
        round=int(pb.round),
        tokens=tuple(int(t) for t in pb.tokens),
        expert_union=union_from_pb(pb.expert_union),
        expert_bytes=int(pb.expert_bytes),
    )


def array_to_pb(a: np.ndarray | None) -> common_pb2.Tensor | None:
    import numpy as np

    if a is None:
        return None
    a = np.ascontiguousarray(a)
    name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}[a.dtype]
    return common_pb2.Tensor(shape=list(a.shape), dtype=name, data=a.astype(a.dtype.newbyteorder("<")).tobytes())


def array_from_pb(pb: common_pb2.Tensor) -> np.ndarray:
    import numpy as np

    if pb.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported tensor dtype {pb.dtype!r}")
    dt = np.dtype(pb.dtype).newbyteorder("<")
    shape = tuple(int(s) for s in pb.shape)
    arr = np.frombuffer(pb.data, dtype=dt)
    if arr.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor data has {arr.size} elements, shape {shape} needs {int(np.prod(shape))}")
    return arr.reshape(shape).astype(dt.newbyteorder("="))
