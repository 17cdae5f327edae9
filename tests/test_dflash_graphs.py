"""The DFlash drafter's static-buffer forwards (drafter_svc/dflash_graphs.py), run eagerly on the CPU in float32: the
math the CUDA graphs replay. On the embedded demo pair (a trained drafter, real target features), round after round
with commits, it drafts what the eager drafter drafts, over a prompt longer than one commit bucket, across the
capacity fallback and with sessions taking turns in the working buffer. Capture and replay themselves are CUDA only:
tests/test_drafter_gpu.py."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from drafter_svc.dflash_graphs import (
    COMMIT_BUCKETS,
    SPARE,
    DFlashGraphs,
    graphs_unsupported,
    propose_buckets,
)
from drafter_svc.drafters import make_factory
from pdflash.types import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = 40  # longer than the largest commit bucket: a prompt goes in chunks
NEW = 120
WIDTHS = (15, 3, 7, 11, 1, 15, 5, 15, 2, 9)  # drafts asked per round, cycled: every propose bucket, padded or not


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The drafter's own setting (--torch-threads 1): small forwards, and no OpenMP team spinning against other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo():
    from pdflash.defaults import default_drafter_dir, default_target_dir

    drafter = default_drafter_dir()
    assert drafter is not None, "the embedded demo drafter (pdflash/assets/demo/drafter) is missing from this checkout"
    return pathlib.Path(default_target_dir()), drafter


def _target_runs(demo, **generate) -> list[tuple[list[int], np.ndarray]]:
    """Two prompts' greedy continuations by the demo target (transformers' `generate`, with `generate`'s extra
    keywords) and the features of every position (as the verifier sends them: outputs of the drafter's target layers,
    float32)."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = demo
    layers = json.loads((drafter_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = [p[:PROMPT] for p in json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[:2]]
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = target.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **generate)[0]
            hidden = target(seq[None], output_hidden_states=True).hidden_states
            feats = torch.cat([hidden[i + 1][0] for i in layers], -1).numpy()
            out.append((seq.tolist(), np.ascontiguousarray(feats)))
    return out


@pytest.fixture(scope="module")
def sequences(demo):
    return _target_runs(demo)


def _factory(demo, capacity: int | None):
    """The demo drafter on the CPU in float32; with a capacity, its sessions run the static path (uncaptured)."""
    f = make_factory("dflash", *demo)
    assert f.graphs is None  # the CPU default: eager
    if capacity is not None:
        f.use_graphs(DFlashGraphs(f.model, f.head.embed, f.head.lm_head, capacity=capacity, capture=False))
    return f


class Rounds:
    """One session following a target's greedy sequence: propose, accept what matches, commit anchor + accepted."""

    def __init__(self, factory, seq, feats, sampling=None):
        self.s, self.seq, self.feats = factory.new_session(sampling), seq, feats
        self.s.start(seq[:PROMPT], feats[:PROMPT])
        self.pos, self.rounds, self.emitted = PROMPT, 0, 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.seq) - 1

    def propose(self) -> list[int]:
        k = min(WIDTHS[self.rounds % len(WIDTHS)], len(self.seq) - self.pos - 1)
        return self.s.propose(self.seq[self.pos], k)

    def commit(self, drafts: list[int]) -> None:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.seq[self.pos + 1 + accepted]:
            accepted += 1
        n = accepted + 1
        self.s.commit(self.seq[self.pos : self.pos + n], self.feats[self.pos : self.pos + n])
        self.pos += n
        self.rounds += 1
        self.emitted += n


def test_buckets_cover_every_block_and_commit():
    assert propose_buckets(16) == (4, 8, 16) and propose_buckets(8) == (4, 8)
    assert propose_buckets(12) == (4, 8, 12) and propose_buckets(3) == (3,)
    assert COMMIT_BUCKETS[-1] <= SPARE and propose_buckets(SPARE)[-1] == SPARE


def test_the_static_path_drafts_what_the_eager_drafter_drafts(demo, sequences):
    """Round after round, with commits of every size, the static path's drafts equal the eager drafter's; the drafter
    is trained, so the drafts are accepted (tau > 1) and the comparison covers real proposals, not noise. The capacity
    (96 rows) is passed mid-sequence: from then on the session runs eagerly on the rows it had."""
    eager, static = _factory(demo, None), _factory(demo, 96)
    for seq, feats in sequences:
        a, b = Rounds(eager, seq, feats), Rounds(static, seq, feats)
        assert b.s.graphed is not None and b.s.length == PROMPT
        left_at = None
        while not a.done:
            da, db = a.propose(), b.propose()
            assert da == db, f"round {a.rounds} at {a.pos}: eager {da}, static {db}"
            a.commit(da)
            b.commit(db)
            assert a.s.length == b.s.length == a.pos
            if left_at is None and b.s.graphed is None:
                left_at = b.pos
                assert b.s.cache is not None and b.s.cache.length == b.pos
        assert left_at is not None and left_at > 96, "the session never reached the capacity"
        assert a.emitted / a.rounds > 1.5, f"tau {a.emitted / a.rounds:.2f}: the demo drafter should draft its target"


def test_the_context_rows_equal_the_eager_caches(demo, sequences):
    """The working buffer's rows 0..L-1 are the eager ContextKV's rows (fc, norm, k/v and rotary over padded
    buckets), and the session's length is what it committed."""
    eager, static = _factory(demo, None), _factory(demo, 256)
    seq, feats = sequences[0]
    a, b = Rounds(eager, seq, feats), Rounds(static, seq, feats)
    for _ in range(6):
        drafts = a.propose()
        assert b.propose() == drafts
        a.commit(drafts)
        b.commit(drafts)
    kv, length = static.graphs.kv, b.s.length
    assert static.graphs.resident is b.s.graphed and length == a.s.cache.length
    for i in range(len(eager.model.layers)):
        k, v = a.s.cache.layer(i)
        torch.testing.assert_close(kv[i, 0, :, :length][None], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[i, 1, :, :length][None], v, rtol=1e-5, atol=1e-5)


def test_padding_rows_never_enter_the_context_and_proposals_touch_none_of_it(demo, sequences):
    f = _factory(demo, 128)
    g = f.graphs
    seq, feats = sequences[0]
    s = f.new_session()
    s.start(seq[:PROMPT], feats[:PROMPT])
    g.kv[:, :, :, PROMPT : g.capacity] = float("nan")  # the rows past the context: nothing may write them but commits
    before = g.kv[:, :, :, : g.capacity].clone()
    s.propose(seq[PROMPT], 15)
    s.propose(seq[PROMPT], 2)
    assert torch.equal(g.kv[:, :, :, : g.capacity].nan_to_num(), before.nan_to_num())  # proposals: spare rows only
    s.commit(seq[PROMPT : PROMPT + 3], feats[PROMPT : PROMPT + 3])  # 3 rows in the bucket of 4
    assert not g.kv[:, :, :, : PROMPT + 3].isnan().any()
    assert g.kv[:, :, :, PROMPT + 3 : g.capacity].isnan().all(), "a padding row was written past the context"


def test_sessions_take_turns_in_the_working_buffer(demo, sequences):
    """Two sessions' rounds interleaved: each one's drafts equal those of an eager session of its own; the buffer
    holds one at a time (the other's rows in its store), and a closed session's rows are never saved again."""
    eager, static = _factory(demo, None), _factory(demo, 512)
    pairs = [(Rounds(eager, seq, feats), Rounds(static, seq, feats)) for seq, feats in sequences]
    g = static.graphs
    for _ in range(8):
        for a, b in pairs:
            da, db = a.propose(), b.propose()
            assert da == db
            assert g.resident is b.s.graphed
            a.commit(da)
            b.commit(db)
    other = pairs[0][1].s.graphed
    assert other is not g.resident and other.store is not None and other.store.shape[3] >= other.length
    closed = pairs[1][1].s
    resident = closed.graphed
    assert resident is g.resident and resident.store is not None  # saved once, when session 0 took its turn
    store, stale = resident.store, resident.store.clone()
    closed.close()
    assert resident.closed and closed.graphed is None
    a, b = pairs[0]
    assert a.propose() == b.propose()  # loads session 0 back; the closed one is dropped, not saved
    assert g.resident is pairs[0][1].s.graphed
    # (bytes, not values: the store's rows past the session's length are uninitialized and may hold NaN patterns)
    assert resident.store is store and torch.equal(store.view(torch.uint8), stale.view(torch.uint8))


def test_a_prompt_beyond_the_capacity_runs_eagerly_from_the_start(demo, sequences):
    eager, static = _factory(demo, None), _factory(demo, PROMPT - 1)
    seq, feats = sequences[1]
    a, b = Rounds(eager, seq, feats), Rounds(static, seq, feats)
    assert b.s.graphed is None and b.s.cache is not None
    for _ in range(3):
        drafts = a.propose()
        assert b.propose() == drafts
        a.commit(drafts)
        b.commit(drafts)


def test_a_session_may_start_again_and_close_twice(demo, sequences):
    f = _factory(demo, 256)
    seq, feats = sequences[0]
    s = f.new_session()
    s.start(seq[:10], feats[:10])
    first = s.graphed
    s.start(seq[:PROMPT], feats[:PROMPT])
    assert first.closed and s.graphed is not first and s.length == PROMPT
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="before start"):
        s.propose(3, 3)


def test_graphs_refuse_what_they_cannot_serve(demo):
    f = _factory(demo, None)
    assert graphs_unsupported(f.model) == ""
    with pytest.raises(ValueError, match="need a CUDA device"):
        DFlashGraphs(f.model, f.head.embed, f.head.lm_head, capture=True)
    with pytest.raises(ValueError, match="capacity"):
        DFlashGraphs(f.model, f.head.embed, f.head.lm_head, capacity=0, capture=False)
    f.model.rotary_emb.rope_type = "dynamic"
    try:
        assert "depends on the length" in graphs_unsupported(f.model)
    finally:
        f.model.rotary_emb.rope_type = "default"


def test_cpu_factories_stay_eager_whatever_the_option(demo):
    for on in (True, False):
        f = make_factory("dflash", *demo, cuda_graphs=on)
        assert f.graphs is None
        s = f.new_session()
        s.start([1, 2, 3], np.zeros((3, f.feature_dim), np.float32))
        assert s.graphed is None and s.cache is not None
    hybrid = make_factory("hybrid", *demo, cuda_graphs=False, graph_capacity=64)
    assert hybrid.dflash.graphs is None
    f.warm_up()  # what a CUDA factory without graphs runs at load: one eager round, leaving nothing behind


PENALTY = SamplingParams(repetition_penalty=1.3)


@pytest.fixture(scope="module")
def penalized_sequences(demo):
    """The target's continuations under PENALTY (transformers' greedy `generate` with repetition_penalty: the output a
    penalized request must get)."""
    return _target_runs(demo, repetition_penalty=PENALTY.repetition_penalty)


def test_a_penalized_request_drafts_under_its_penalties_on_both_paths(demo, penalized_sequences):
    """A request with a repetition penalty: its drafter applies the penalty to its own logits draft by draft
    (pdflash.penalties), the static path's drafts equal the eager one's, and on the target's penalized output the
    drafts are accepted more often than the same drafter's unpenalized drafts (through the verifier:
    `python benchmarks/sampled_drafts.py --repetition-penalty 1.3 --new 120`)."""
    eager, static = _factory(demo, None), _factory(demo, 96)
    emitted, rounds = {False: 0, True: 0}, {False: 0, True: 0}
    for seq, feats in penalized_sequences:
        for penalized in (False, True):
            a = Rounds(eager, seq, feats, PENALTY if penalized else None)
            b = Rounds(static, seq, feats, PENALTY if penalized else None)
            assert (a.s.penalties is not None) == penalized
            while not a.done:
                da, db = a.propose(), b.propose()
                assert da == db, f"round {a.rounds} at {a.pos}: eager {da}, static {db}"
                a.commit(da)
                b.commit(db)
            emitted[penalized] += a.emitted
            rounds[penalized] += a.rounds
    plain, penalized = (emitted[p] / rounds[p] for p in (False, True))
    assert penalized > plain, f"tau {penalized:.2f} with the penalty on the drafts, {plain:.2f} without"
