"""Token identity: the full three-process stack over gRPC equals plain greedy decoding.

Each stack runs where its test id says, and its reference on the same device in the same dtype
(benchmarks.load.greedy_reference):
- cpu-float32 (every host, CI too): transformers' own greedy `generate` in float32 on the CPU;
- cuda-bfloat16 (a CUDA host only; skipped elsewhere): the verifier's own block-1 decoding in process on the GPU (bf16,
  the batch-invariant kernels): on the GPU greedy output is only defined up to the kernels' rounding, and the promise is
  that every drafter and width gives block 1's tokens (tests/test_gpu_verifier.py checks the same on real layer shapes).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.load import greedy_reference
from pdflash.client import Client
from pdflash.tiny import ARCHITECTURES
from tests.conftest import DEVICE, DTYPE, start_stack

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, dtype) of a stack and of its reference
PLACEMENTS = [pytest.param((DEVICE, DTYPE), id=f"{DEVICE}-{DTYPE}"),
              pytest.param(("cuda", "bfloat16"), id="cuda-bfloat16", marks=needs_cuda)]

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self.",
]
MAX_TOKENS = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(request) -> tuple[str, str]:
    return request.param


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_stack(request, placement, tiny, tmp_path_factory):
    arch, (device, dtype) = request.param, placement
    stack = start_stack(tiny.target(arch), tiny.drafter(arch), tmp_path_factory.mktemp(f"logs-{arch}-{device}"),
                        device=device, dtype=dtype)
    yield arch, stack
    stack.stop()


def reference(model_dir, prompt: str, max_tokens: int, device: str) -> list[int]:
    return list(greedy_reference(str(model_dir), prompt, max_tokens, device=device))


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash", "hybrid"])
def test_greedy_stack_equals_transformers(arch_stack, placement, tiny, drafter):
    arch, stack = arch_stack
    with Client(stack.drafter) as client:
        for prompt in PROMPTS:
            want = reference(tiny.target(arch), prompt, MAX_TOKENS, placement[0])
            got = client.generate(prompt, max_tokens=MAX_TOKENS, drafter=drafter)
            assert got.token_ids == want, f"{arch}/{drafter}: {prompt!r}"
            assert got.finish_reason in ("length", "stop")
            if got.finish_reason == "length":
                assert len(got.token_ids) == MAX_TOKENS
            u = got.usage
            assert u.completion_tokens == len(want)
            assert u.prompt_tokens > 0
            if drafter == "none":
                assert u.rounds == len(want) - 1 and u.draft_tokens == 0


def test_block_sizes_all_equal_reference(stack, tiny):
    """Every verify width, fixed or adaptive, gives the same tokens (n-gram drafts are accepted often on a looping model).
    The shared `stack` (conftest): CPU, float32, and its reference there."""
    want = reference(tiny.target("qwen3_moe"), PROMPTS[0], 64, DEVICE)
    accepted = 0
    with Client(stack.drafter) as client:
        for block in (1, 2, 4, 8, 16, 32):
            for fixed in (False, True):  # the adaptive width (default) and every round at the full block
                got = client.generate(PROMPTS[0], max_tokens=64, drafter="ngram", block_size=block, fixed_width=fixed)
                assert got.token_ids == want, f"block {block}, fixed width {fixed}"
                accepted += got.usage.accepted_draft_tokens
    assert accepted > 0, "no draft was ever accepted: the acceptance path was not exercised"
