"""The generated stubs are fresh: regenerating from protos/ gives byte-identical files."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = sorted((tmp_path / "pdflash" / "v1").glob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    for f in fresh:
        committed = ROOT / "pdflash" / "v1" / f.name
        assert committed.exists(), f"{f.name} is not committed: run python protos/generate.py"
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale: run python protos/generate.py"
    committed = {p.name for p in (ROOT / "pdflash" / "v1").glob("*_pb2*.py*")}
    assert committed == {f.name for f in fresh}, "stale generated files without a .proto"


def test_enums_start_unspecified():
    from pdflash.v1 import common_pb2, drafter_pb2

    for enum in (common_pb2.FinishReason, drafter_pb2.DrafterKind):
        assert enum.Name(0).endswith("_UNSPECIFIED")


def test_plain_enums_mirror_protos():
    from pdflash.types import DrafterKind, FinishReason
    from pdflash.v1 import common_pb2, drafter_pb2

    for k in FinishReason:
        assert common_pb2.FinishReason.Name(int(k)) == f"FINISH_REASON_{k.name}"
    for k in DrafterKind:
        assert drafter_pb2.DrafterKind.Name(int(k)) == f"DRAFTER_KIND_{k.name}"


def test_unions_and_tensors_convert_both_ways():
    """A union off the wire equals the one sent (a layer listed twice: the union of both), is parsed only when read,
    and goes on as the messages it came in; a tensor comes back equal, writeable, in its own memory."""
    import numpy as np

    from pdflash import convert
    from pdflash.types import union_bytes
    from pdflash.v1 import common_pb2

    union = {5: frozenset({9, 2}), 1: frozenset({4}), 3: frozenset()}
    sent = common_pb2.DraftResult(expert_union=convert.union_to_pb(union))
    assert [(le.layer, list(le.expert_ids)) for le in sent.expert_union] == [(1, [4]), (3, []), (5, [2, 9])]
    wire = common_pb2.DraftResult.FromString(sent.SerializeToString()).expert_union
    got = convert.union_from_pb(wire)
    assert got._union is None  # nothing parsed yet
    resent = common_pb2.DraftResult(expert_union=convert.union_to_pb(got))
    assert resent == sent and got._union is None  # sent on as it came, still unparsed
    assert got == union and dict(got) == union and list(got) == [1, 3, 5] and 5 in got and 7 not in got
    assert union_bytes(got, {1: [0] * 4 + [10], 3: [], 5: [0, 0, 100] + [0] * 6 + [1000]}) == 1110
    twice = [common_pb2.LayerExperts(layer=2, expert_ids=[1, 3]), common_pb2.LayerExperts(layer=0, expert_ids=[7]),
             common_pb2.LayerExperts(layer=2, expert_ids=[3, 4])]
    assert convert.union_from_pb(twice) == {0: frozenset({7}), 2: frozenset({1, 3, 4})}
    assert convert.union_from_pb([]) == {} and not convert.union_from_pb([])

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    pb = common_pb2.Tensor.FromString(convert.array_to_pb(a).SerializeToString())
    back = convert.array_from_pb(pb)
    assert np.array_equal(back, a) and back.dtype == np.float32 and back.flags.writeable and back.flags.owndata
    pb.shape[:] = [5, 4]
    try:
        convert.array_from_pb(pb)
        raise AssertionError("a shape that does not fit the data was accepted")
    except ValueError as e:
        assert "needs 20" in str(e)
