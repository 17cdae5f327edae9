"""The DFlash drafter on a CUDA GPU (skipped without one), with the embedded demo pair (trained, so drafts are accepted):
- in process, bf16 on CUDA, from CUDA graphs and eagerly: it drafts what the target goes on to say (tau > 1), a commit
  does not wait for the device and a proposal waits once (its drafts' one device->host copy);
- the graphs (drafter_svc/dflash_graphs.py) replay what the same static-buffer code computes uncaptured (the context rows
  close in bf16, the drafts equal), across the capacity fallback, and draft as well as the eager path;
- through the stack, drafter and verifier on the same GPU: every drafter's greedy output equals the stack's block-1
  output, which equals the verifier's own block-1 decoding in process (`benchmarks.load.greedy_reference` on CUDA: bf16,
  the batch-invariant kernels), with tau > 1 for DFlash and hybrid; with the drafter's graphs off the output is the same.

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


def _target_runs(demo, n: int, **generate) -> list[tuple[list[int], list[int], np.ndarray]]:
    """n prompts' greedy continuations by the demo target on CUDA in bf16 (transformers' `generate`, with `generate`'s
    extra keywords), and the features of every position: outputs of the drafter's target layers, as the verifier
    sends them (float32)."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = demo
    layers = json.loads((drafter_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for prompt in _prompts(n):
        with torch.no_grad():
            seq = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False, **generate)[0]
            hidden = target(seq[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in layers], -1).float().cpu().numpy()
        out.append((prompt, seq.tolist(), feats))
    del target
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def sequences(demo):
    return _target_runs(demo, 2)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_dflash_drafts_on_cuda_in_bf16_with_one_copy_back_per_round(demo, sequences, graphs):
    from drafter_svc.drafters import make_factory

    target_dir, drafter_dir = demo
    f = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", cuda_graphs=graphs)
    assert (f.graphs is not None) == graphs and (not graphs or f.graphs.captured)
    assert f.head.embed.is_cuda and f.model.fc.weight.is_cuda
    assert f.model.fc.weight.dtype == f.head.lm_head.dtype == torch.bfloat16
    assert f.model.rotary_emb.inv_freq.dtype == torch.float32
    emitted = drafts_total = rounds = 0
    syncs_commit, syncs_propose = [], []
    for prompt, seq, feats in sequences:
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
        assert (s.graphed is not None) == graphs  # 128 + 96 rows: within the default capacity
    tau = emitted / rounds
    assert tau > 1.5, f"tau {tau:.2f}: the drafts on the GPU are not what the target says"
    # The first round of a session may warm things up; from the second on: a proposal copies its drafts back once
    # (one wait for the device), a commit sends its feature rows without waiting.
    assert max(syncs_propose[1:]) <= 1, syncs_propose
    assert max(syncs_commit[1:]) == 0, syncs_commit


WIDTHS = (15, 3, 7, 11, 1, 15, 5, 15, 2, 9)  # drafts per round, cycled: every propose bucket, padded or not
CAPACITY = 160  # the demo's 128-token prompts pass it after ~32 generated tokens: the fallback runs too


class _Rounds:
    """One session following the target's greedy sequence: propose, accept what matches, commit anchor + accepted."""

    def __init__(self, factory, prompt, seq, feats, sampling=None):
        self.s, self.seq, self.feats = factory.new_session(sampling), seq, feats
        self.s.start(prompt, feats[: len(prompt)])
        self.pos, self.rounds, self.emitted = len(prompt), 0, 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.seq) - 1

    def propose(self) -> list[int]:
        return self.s.propose(self.seq[self.pos], min(WIDTHS[self.rounds % len(WIDTHS)], len(self.seq) - self.pos - 1))

    def commit(self, drafts: list[int]) -> None:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.seq[self.pos + 1 + accepted]:
            accepted += 1
        n = accepted + 1
        self.s.commit(self.seq[self.pos : self.pos + n], np.ascontiguousarray(self.feats[self.pos : self.pos + n]))
        self.pos, self.rounds, self.emitted = self.pos + n, self.rounds + 1, self.emitted + n


def test_graph_replay_equals_the_static_path_uncaptured(demo, sequences):
    """Captured graphs against the same static-buffer code run eagerly on the same GPU, fed the same commits: the context
    rows agree within bf16 tolerances and the drafts are the same tokens (near-ties apart), before and after the capacity fallback; two
    sessions take turns in the working buffer. The graphed drafts earn what the eager drafter's earn (bf16 near-ties
    apart, the static path's masked attention sums in another order)."""
    from drafter_svc.dflash_graphs import DFlashGraphs
    from drafter_svc.drafters import make_factory

    target_dir, drafter_dir = demo
    graphed = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", graph_capacity=CAPACITY)
    uncaptured = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", cuda_graphs=False)
    uncaptured.use_graphs(DFlashGraphs(uncaptured.model, uncaptured.head.embed, uncaptured.head.lm_head,
                                       capacity=CAPACITY, capture=False))
    eager = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", cuda_graphs=False)
    assert graphed.graphs.captured and not uncaptured.graphs.captured and eager.graphs is None
    sessions = [tuple(_Rounds(f, *x) for f in (graphed, uncaptured, eager)) for x in sequences]
    differ = compared = 0
    replay_differs = []
    while not all(g.done for g, _, _ in sessions):
        for g, u, e in sessions:  # interleaved: the two sessions take turns in each working buffer
            if g.done:
                continue
            dg, du, de = g.propose(), u.propose(), e.propose()
            if dg != du:
                replay_differs.append(f"round {g.rounds} at {g.pos}: graph {dg}, uncaptured {du}")
            differ += dg != de
            compared += 1
            if g.s.graphed is not None:
                length = g.s.length
                torch.testing.assert_close(graphed.graphs.kv[:, :, :, :length], uncaptured.graphs.kv[:, :, :, :length],
                                           rtol=1.6e-2, atol=1e-2)
            g.commit(dg)
            u.commit(dg)  # the same commits: a draft that differed must not steer the two apart
            e.commit(de)
    # The same kernels on the same inputs: the same drafts (a rare flip allowed, should capture pick another cuBLAS
    # algorithm than the eager call does and land on a bf16 near-tie).
    assert len(replay_differs) <= compared // 50, replay_differs
    for g, u, _ in sessions:
        assert g.s.graphed is None and u.s.graphed is None, "the sessions should have passed the capacity"
    tau_g = sum(g.emitted for g, _, _ in sessions) / sum(g.rounds for g, _, _ in sessions)
    tau_e = sum(e.emitted for _, _, e in sessions) / sum(e.rounds for _, _, e in sessions)
    assert tau_g > 1.5 and abs(tau_g - tau_e) <= 0.15 * tau_e, (tau_g, tau_e, f"{differ}/{compared} rounds differ")


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


def test_stack_output_is_the_same_with_the_drafters_graphs_off(demo, tmp_path):
    """The same requests through a stack whose drafter runs eagerly (`--no-drafter-cuda-graphs`, what `pdflash up
    --no-drafter-graphs` passes) and through one that replays its graphs: the same greedy tokens, equal to block 1."""
    from pdflash.client import Client
    from tests.conftest import start_stack

    target_dir, drafter_dir = demo
    outputs = {}
    for graphs in (False, True):
        extra = [] if graphs else ["--no-drafter-cuda-graphs"]
        stack = start_stack(target_dir, drafter_dir, tmp_path / f"graphs-{graphs}", device="cuda", dtype="bfloat16",
                            drafter_args=extra)
        try:
            with Client(stack.drafter) as c:
                for prompt in _prompts(2):
                    key = tuple(prompt)
                    outputs.setdefault(key, {})["block1", graphs] = c.generate(prompt, max_tokens=NEW, drafter="none",
                                                                               timeout=300).token_ids
                    for kind in ("dflash", "hybrid"):
                        got = c.generate(prompt, max_tokens=NEW, drafter=kind, block_size=16, timeout=300)
                        outputs[key][kind, graphs] = got.token_ids
        finally:
            stack.stop()
    for key, out in outputs.items():
        block1 = out["block1", True]
        assert out["block1", False] == block1
        for kind in ("dflash", "hybrid"):
            assert out[kind, False] == out[kind, True] == block1, kind


def test_a_capture_that_fails_leaves_an_eager_drafter(demo, monkeypatch):
    """A CUDA-graph capture that raises at load costs speed, not the service: the factory logs it and drafts eagerly."""
    import drafter_svc.drafters.dflash as dflash
    from drafter_svc.drafters import make_factory

    def broken(*a, **k):
        raise RuntimeError("capture failed (test)")

    monkeypatch.setattr(dflash, "DFlashGraphs", broken)
    target_dir, drafter_dir = demo
    f = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", cuda_graphs=True)
    assert f.graphs is None
    s = f.new_session()
    s.start([1, 2, 3, 4], np.zeros((4, f.feature_dim), np.float32))
    assert len(s.propose(5, 7)) == 7


def test_penalized_drafts_on_cuda_graphs_follow_the_penalized_target(demo):
    """A request with a repetition penalty on the captured graphs: the drafts come from the graph's logits under the
    penalty (pdflash.penalties), and on the target's penalized greedy output (bf16, CUDA) they are accepted more often
    than the same drafter's unpenalized drafts (the CPU twin: tests/test_dflash_graphs.py)."""
    from drafter_svc.drafters import make_factory
    from pdflash.types import SamplingParams

    target_dir, drafter_dir = demo
    penalty = SamplingParams(repetition_penalty=1.3)
    runs = _target_runs(demo, 3, repetition_penalty=penalty.repetition_penalty)
    f = make_factory("dflash", target_dir, drafter_dir, device="cuda", dtype="bfloat16", cuda_graphs=True)
    assert f.graphs is not None and f.graphs.captured
    tau = {}
    for penalized in (False, True):
        emitted = rounds = 0
        for prompt, seq, feats in runs:
            r = _Rounds(f, prompt, seq, feats, penalty if penalized else None)
            assert (r.s.penalties is not None) == penalized and r.s.graphed is not None
            while not r.done:
                r.commit(r.propose())
            emitted, rounds = emitted + r.emitted, rounds + r.rounds
        tau[penalized] = emitted / rounds
    assert tau[True] > tau[False], tau
