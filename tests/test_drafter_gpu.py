"""The DFlash drafter on a CUDA GPU (skipped without one), with the embedded demo pair (trained, so drafts are accepted):
- in process, bf16 on CUDA: it drafts what the target goes on to say (tau > 1), a commit does not wait for the device and
  a proposal waits once (its drafts' one device->host copy);
- through the stack, drafter and verifier on the same GPU: every drafter's greedy output equals the stack's block-1
  output, which equals the verifier's own block-1 decoding in process (`benchmarks.load.greedy_reference` on CUDA: bf16,
  the batch-invariant kernels), with tau > 1 for DFlash and hybrid.

Run on the GPU machine with `bash benchmarks/gpu.sh OUT tests` (TEST_FILES=tests/test_drafter_gpu.py for this file alone)."""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEW = 96


@pytest.fixture(scope="module")
def demo():
    from pdflash.defaults import default_drafter_dir, default_target_dir

    drafter = default_drafter_dir()
    assert drafter is not None, "the embedded demo drafter (pdflash/assets/demo/drafter) is missing from this checkout"
    return pathlib.Path(default_target_dir()), drafter


def _prompts(n: int) -> list[list[int]]:
    return [p[:128] for p in json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[:n]]


def _sync_warnings(fn, *args):
    """fn(*args) and how many synchronizing CUDA operations it ran (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchronizing" in str(w.message) for w in caught)


def test_dflash_drafts_on_cuda_in_bf16_with_one_copy_back_per_round(demo):
    from transformers import AutoModelForCausalLM

    from drafter_svc.drafters import make_factory

    target_dir, drafter_dir = demo
    f = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16")
    assert f.head.embed.is_cuda and f.model.fc.weight.is_cuda
    assert f.model.fc.weight.dtype == f.head.lm_head.dtype == torch.bfloat16
    assert f.model.rotary_emb.inv_freq.dtype == torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).cuda().eval()
    emitted = drafts_total = rounds = 0
    syncs_commit, syncs_propose = [], []
    for prompt in _prompts(2):
        with torch.no_grad():
            seq = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False)[0]
            hidden = target(seq[None], output_hidden_states=True).hidden_states
        # features of every position: outputs of the drafter's target layers, as the verifier sends them (float32)
        feats = torch.cat([hidden[i + 1][0] for i in f.feature_layer_ids], -1).float().cpu().numpy()
        seq = seq.tolist()
        s = f.new_session()
        s.start(prompt, feats[: len(prompt)])
        pos = len(prompt)  # the anchor's position: the target's token there is emitted, not yet committed
        while pos < len(seq) - 1:
            drafts, n_sync = _sync_warnings(s.propose, seq[pos], min(15, len(seq) - pos - 1))
            syncs_propose.append(n_sync)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == seq[pos + 1 + accepted]:
                accepted += 1
            committed = seq[pos : pos + 1 + accepted]
            _, n_sync = _sync_warnings(s.commit, committed, np.ascontiguousarray(feats[pos : pos + len(committed)]))
            syncs_commit.append(n_sync)
            pos += len(committed)
            rounds += 1
            emitted += accepted + 1
            drafts_total += len(drafts)
    tau = emitted / rounds
    assert tau > 1.5, f"tau {tau:.2f}: the drafts on the GPU are not what the target says"
    # The first round of a session may warm things up; from the second on: a proposal copies its drafts back once
    # (one wait for the device), a commit sends its feature rows without waiting.
    assert max(syncs_propose[1:]) <= 1, syncs_propose
    assert max(syncs_commit[1:]) == 0, syncs_commit


def test_stack_with_drafter_and_verifier_on_cuda_equals_block_one(demo, tmp_path):
    from benchmarks.load import greedy_reference
    from pdflash.client import Client
    from tests.conftest import start_stack

    target_dir, drafter_dir = demo
    stack = start_stack(target_dir, drafter_dir, tmp_path, device="cuda", dtype="bfloat16")
    try:
        with Client(stack.drafter) as c:
            info = c.model_info()
            assert info.drafter_device.startswith("cuda") and info.drafter_dtype == "bfloat16"
            taus: dict[str, list[float]] = {}
            for prompt in _prompts(3):
                block1 = c.generate(prompt, max_tokens=NEW, drafter="none", timeout=300).token_ids
                assert block1 == list(greedy_reference(str(target_dir), tuple(prompt), NEW, device="cuda"))  # bf16, the kernels
                for kind, block in (("ngram", 16), ("dflash", 8), ("dflash", 16), ("hybrid", 16), ("hybrid", 32)):
                    got = c.generate(prompt, max_tokens=NEW, drafter=kind, block_size=block, timeout=300)
                    first = next((i for i, (a, b) in enumerate(zip(got.token_ids, block1)) if a != b), None)
                    assert got.token_ids == block1, f"{kind}@{block}: differs from block 1 at token {first}"
                    taus.setdefault(f"{kind}@{block}", []).append(got.usage.mean_acceptance_length)
        for mode in ("dflash@8", "dflash@16", "hybrid@16", "hybrid@32"):
            assert np.mean(taus[mode]) > 1.5, taus
    finally:
        stack.stop()
