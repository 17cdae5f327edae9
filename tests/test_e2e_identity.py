"""Token identity: the full three-process stack over gRPC equals plain greedy decoding.

The reference depends on where the stack serves (the verifier's --device auto):
- CPU (CI): transformers' own greedy `generate` in float32 on the CPU, the dtype and device the stack serves in;
- CUDA: the verifier's own block-1 decoding (bf16, the batch-invariant kernels): on the GPU greedy output is only
  defined up to the kernels' rounding, and the promise is that every drafter and width gives block 1's tokens
  (tests/test_gpu_verifier.py checks the same on real layer shapes). Both from benchmarks.load.greedy_reference."""

from __future__ import annotations

import pytest

from benchmarks.load import greedy_reference
from pdflash.client import Client
from pdflash.tiny import ARCHITECTURES
from tests.conftest import start_stack

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self.",
]
MAX_TOKENS = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_stack(request, tiny, tmp_path_factory):
    arch = request.param
    stack = start_stack(tiny.target(arch), tiny.drafter(arch), tmp_path_factory.mktemp(f"logs-{arch}"))
    yield arch, stack
    stack.stop()


def reference(model_dir, prompt: str, max_tokens: int) -> list[int]:
    return list(greedy_reference(str(model_dir), prompt, max_tokens))  # says which device it decodes on


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash", "hybrid"])
def test_greedy_stack_equals_transformers(arch_stack, tiny, drafter):
    arch, stack = arch_stack
    with Client(stack.drafter) as client:
        for prompt in PROMPTS:
            want = reference(tiny.target(arch), prompt, MAX_TOKENS)
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
    """Every verify width, fixed or adaptive, gives the same tokens (n-gram drafts are accepted often on a looping model)."""
    want = reference(tiny.target("qwen3_moe"), PROMPTS[0], 64)
    accepted = 0
    with Client(stack.drafter) as client:
        for block in (1, 2, 4, 8, 16, 32):
            for fixed in (False, True):  # the adaptive width (default) and every round at the full block
                got = client.generate(PROMPTS[0], max_tokens=64, drafter="ngram", block_size=block, fixed_width=fixed)
                assert got.token_ids == want, f"block {block}, fixed width {fixed}"
                accepted += got.usage.accepted_draft_tokens
    assert accepted > 0, "no draft was ever accepted: the acceptance path was not exercised"
