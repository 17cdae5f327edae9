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
