"""How `pytest -n N` splits the suite into work units (tests/conftest.py `xdist_scope`): whole modules, and the
architecture-parametrized GPU modules by architecture, so their real-shape models load once per unit and the
architectures run on different workers."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from tests.conftest import _ARCH_SCOPED, xdist_scope

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plain_modules_are_one_unit_each():
    assert xdist_scope("tests/test_sampling.py::test_x") == "tests/test_sampling.py"
    assert xdist_scope("tests/test_sampling.py::test_x[gpt_oss]") == "tests/test_sampling.py"  # not arch-scoped
    assert xdist_scope("tests/test_services.py::TestA::test_b") == "tests/test_services.py::TestA"


def test_arch_scoped_modules_split_by_architecture():
    v = "tests/test_gpu_verifier.py"
    assert xdist_scope(f"{v}::test_a[gpt_oss]") == xdist_scope(f"{v}::test_b[gpt_oss]") == f"{v}[gpt_oss]"
    assert xdist_scope(f"{v}::test_a[mixtral]") == f"{v}[mixtral]" != xdist_scope(f"{v}::test_a[qwen3_moe]")
    o = "tests/test_offload_gpu.py"
    assert xdist_scope(f"{o}::test_c[qwen3_moe-union+layer-device-overlap]") == f"{o}[qwen3_moe]"
    assert xdist_scope(f"{v}::test_plain") == v  # no architecture: the module's unit
    assert xdist_scope(f"{v}::test_d[gpt_oss_like]") == v  # a whole id, not a prefix


def test_the_arch_scoped_modules_parametrize_their_model_by_architecture():
    """Every arch-scoped module exists and its collected ids name the architectures (or the split would be silent)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *_ARCH_SCOPED],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert r.returncode == 0 and ids, r.stdout[-2000:] + r.stderr[-2000:]
    for module in _ARCH_SCOPED:
        units = {xdist_scope(i) for i in ids if i.startswith(module)}
        assert {f"{module}[qwen3_moe]", f"{module}[gpt_oss]"} <= units, units
