"""The attention kernels compile for sm_90a (H100/H200) on a machine without a GPU (Triton and the ptxas it ships) and
fit an SM's shared memory: above all the forms no CPU test runs compiled, multi-head latent attention at DeepSeek-V3's
widths. `benchmarks/attention_sass.py` in a process of its own (the suite's kernels are Triton's interpreted ones)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from pdflash_kernels import runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(runtime.triton is None, reason="needs triton")
@pytest.mark.timeout(600)
def test_the_attention_forms_compile_for_sm90_and_fit_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_sass.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=540)
    rows = json.loads((tmp_path / "attention_sass.json").read_text())["forms"]
    bad = [r for r in rows if not (r.get("compiles") and r.get("fits_smem"))]
    assert done.returncode == 0 and not bad, (bad, done.stderr[-2000:])
    assert {r["kernel"] for r in rows} >= {"mla paged split", "mla paged wave", "gqa paged split"}
