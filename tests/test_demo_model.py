"""The embedded demo pair (pdflash/assets/demo) through the real stack: lossless, and DFlash drafts land.

A trained drafter makes acceptance meaningful: if features were misaligned by one position or taken from
the wrong layers, the output would still be correct (lossless) but acceptance would collapse to ~1.
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdflash.client import Client
from pdflash.defaults import ASSETS
from tests.conftest import DEVICE, DTYPE, start_stack

pytestmark = pytest.mark.slow  # the demo pair is part of the repository: no skip when it is missing

PROMPTS = [
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield every file path under root.\"\"\"\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
N = 64


@pytest.fixture(scope="module")
def demo_stack(tmp_path_factory):
    s = start_stack(ASSETS / "target", ASSETS / "drafter", tmp_path_factory.mktemp("demo-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def references():
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            out[p] = model.generate(ids, max_new_tokens=N, do_sample=False)[0, ids.shape[1]:].tolist()
    return out


@pytest.mark.parametrize("drafter", ["dflash", "hybrid", "ngram"])
def test_demo_pair_lossless_and_accepting(demo_stack, references, drafter):
    taus = []
    with Client(demo_stack.drafter) as c:
        info = c.model_info()
        assert info.default_drafter == 4  # hybrid when a DFlash drafter is loaded
        for p in PROMPTS:
            got = c.generate(p, max_tokens=N, drafter=drafter, block_size=16)
            assert got.token_ids == references[p], f"{drafter}: {p!r}"
            taus.append(got.usage.mean_acceptance_length)
    if drafter in ("dflash", "hybrid"):
        assert sum(taus) / len(taus) > 2.0, f"{drafter} acceptance collapsed: {taus}"
