"""PDFLASH_PDL=1 (programmatic dependent launch, pdflash_kernels.runtime.PDL) on a CUDA GPU (skipped without one): the
verifier's graphed paged forward with every kernel launched early and waiting for the one before it gives the tokens
of the plain launches, at block 1 and with drafted blocks, with either PDFLASH_PDL_TRIGGER. PDL is read at import, so each side runs in its own process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import test_gpu_verifier as drive
from pdflash_kernels import runtime
from pdflash.tiny import make_real_shape_checkpoint
from verifier_svc.engine import PagedKVOptions, VerifierCore
from verifier_svc.model import load_target

d = make_real_shape_checkpoint(sys.argv[1], sys.argv[2], device="cuda")
target = load_target(d, "cuda", "bfloat16", kernels="on")
core = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4))
assert core.graphs is not None
drive.NEW = 96
prompts = drive._prompts(target.vocab_size, 2)
one = [drive._run(core, p, drive._no_drafts) for p in prompts]
rep = [drive._run(core, p, drive._replay(o, 3, target.vocab_size), width=8) for p, o in zip(prompts, one)]
print(json.dumps(dict(pdl=runtime.PDL, trigger=runtime.PDL_TRIGGER, one=one, rep=rep)))
"""


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_pdl_launches_give_the_plain_launches_tokens(arch, tmp_path):
    outs = {}
    for key, pdl, trigger in (("0", "0", "start"), ("1", "1", "start"), ("aw", "1", "after-wait")):
        r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / key), arch], cwd=ROOT, capture_output=True,
                           env={**os.environ, "PDFLASH_PDL": pdl, "PDFLASH_PDL_TRIGGER": trigger}, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[key] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["1"]["pdl"] and outs["aw"]["pdl"] and not outs["0"]["pdl"] and outs["aw"]["trigger"] == "after-wait"
    for key in ("1", "aw"):  # either trigger: the plain launches' tokens, and drafted blocks == block 1
        assert outs[key]["one"] == outs["0"]["one"] and outs[key]["rep"] == outs["0"]["rep"]
        assert outs[key]["rep"] == outs[key]["one"]
