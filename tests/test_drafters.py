"""Drafting cores: n-gram lookup, the DFlash runtime on a tiny target, the hybrid, the factory."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from drafter_svc.dflash_model import load_dflash
from drafter_svc.drafters import default_kind, make_factory
from drafter_svc.drafters.dflash import DFlashFactory, load_target_head, make_tiny_dflash
from drafter_svc.drafters.hybrid import HybridFactory
from drafter_svc.drafters.ngram import NgramDrafter, NgramFactory, NgramIndex
from pdflash.tiny import make_tiny_checkpoint
from pdflash.types import DrafterKind

BLOCK = 8


# ---- n-gram ------------------------------------------------------------------------------------


def ngram(prompt, min_n=1, max_n=3):
    d = NgramDrafter(min_n, max_n)
    d.start(prompt, None)
    return d


def test_ngram_continues_most_recent_trigram():
    d = ngram([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 1, 2])
    # query [1, 2, 3]: last earlier occurrence is followed by 7, 8, 0, 1, 2, 3(anchor) ...
    assert d.match(3, 4) == (3, [7, 8, 0, 1])
    assert d.propose(3, 2) == [7, 8]


def test_ngram_backs_off_to_shorter_matches():
    prompt = [5, 6, 7, 8, 1, 2, 9, 4, 8, 2]
    d = ngram(prompt)
    assert d.match(9, 3) == (2, [4, 8, 2])  # [2, 9] matches, [8, 2, 9] does not
    assert d.match(7, 2) == (1, [8, 1])  # only [7]
    d3 = ngram(prompt, min_n=2)
    assert d3.match(7, 2) == (0, [])


def test_ngram_caps_weak_matches():
    prompt = [5, 6, 7, 8, 1, 2, 9, 4, 8, 2, 3, 3, 3, 3]
    d = ngram(prompt)
    assert d.match(9, 6) == (1, [4, 8, 2, 3, 3, 3])  # only [9] matches: weak
    assert d.propose(9, 6) == [4, 8, 2]  # at most weak_drafts (3)
    assert len(d.propose(3, 6)) == 6  # [3, 3, 3] matches on max_n tokens: the whole ask
    loose = NgramDrafter(1, 3, weak_drafts=None)
    loose.start(prompt, None)
    assert loose.propose(9, 6) == [4, 8, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="weak_drafts"):
        NgramDrafter(1, 3, weak_drafts=0)


def test_ngram_no_match_and_zero_k():
    d = ngram([1, 2, 3])
    assert d.propose(42, 5) == []
    assert d.propose(2, 0) == []
    assert ngram([]).propose(1, 5) == []


def test_ngram_overlapping_match_repeats_the_period():
    # ... 1 2 3 1 2 [anchor 3]: the match of [1 2 3] ends 3 before the anchor, period 3.
    d = ngram([9, 1, 2, 3, 1, 2])
    assert d.match(3, 7) == (3, [1, 2, 3, 1, 2, 3, 1])
    assert ngram([4, 4, 4]).propose(4, 3) == [4, 4, 4]


def test_ngram_commit_extends_the_index():
    d = ngram([1, 2, 3])
    assert d.propose(8, 2) == []
    d.commit([8, 5, 6])
    d.commit([7])
    assert d.match(8, 3) == (1, [5, 6, 7])
    assert d.match(6, 3) == (1, [7, 6, 7])  # [6] then 7, then the anchor 6 itself, then 7 again
    assert len(d.index) == 7


def brute_force(tokens, anchor, k, min_n, max_n):
    if k <= 0:
        return 0, []
    seq = tokens + [anchor]
    for n in range(max_n, min_n - 1, -1):
        if n > len(seq):
            continue
        q = seq[-n:]
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end - n + 1 : end + 1] == q:
                out = []
                for i in range(k):
                    s = end + 1 + i
                    out.append(seq[s] if s < len(seq) else out[s - len(seq)])
                return n, out
    return 0, []


def test_ngram_index_matches_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 4)
        idx = NgramIndex(min_n, max_n)
        tokens = []
        for _ in range(rng.randint(1, 5)):
            chunk = [rng.randint(0, 4) for _ in range(rng.randint(0, 8))]
            idx.extend(chunk)
            tokens += chunk
            anchor, k = rng.randint(0, 4), rng.randint(0, 6)
            assert idx.lookup(anchor, k) == brute_force(tokens, anchor, k, min_n, max_n), (tokens, anchor, k)


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_n"):
        NgramFactory(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)


# ---- DFlash on a tiny target ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "qwen3_moe")


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory):
    return make_tiny_dflash(target_dir, tmp_path_factory.mktemp("drafter"), num_layers=2, block_size=BLOCK, seed=1)


@pytest.fixture(scope="module")
def dflash(target_dir, drafter_dir):
    return DFlashFactory(target_dir, drafter_dir)


def features(rng, n, factory):
    return rng.standard_normal((n, factory.feature_dim)).astype(np.float32)


def reference_drafts(factory, all_features, anchor, k):
    """From scratch: every context row projected again, the block attending to all of it."""
    model, head = factory.model, factory.head
    length = all_features.shape[0]
    ids = torch.tensor([anchor] + [factory.spec.mask_token_id] * k)
    with torch.no_grad():
        hidden = model(
            head.embed[ids][None],
            torch.arange(length, length + k + 1)[None],
            context=torch.from_numpy(all_features)[None],
            context_positions=torch.arange(length)[None],
        )
    return (hidden[0, 1:] @ head.lm_head.T).argmax(-1).tolist(), hidden


def test_tiny_dflash_layout(drafter_dir, target_dir):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    tcfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["block_size"] == BLOCK and cfg["hidden_size"] == tcfg["hidden_size"]
    assert cfg["dflash_config"]["mask_token_id"] == 1  # <|mask|> of the tiny tokenizer
    assert all(0 <= i < tcfg["num_hidden_layers"] for i in cfg["dflash_config"]["target_layer_ids"])
    assert load_dflash(drafter_dir).spec.block_size == BLOCK


def test_factory_reads_target_head_untied(dflash, target_dir):
    from safetensors import safe_open

    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        embed, lm_head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    assert torch.equal(dflash.head.embed, embed) and torch.equal(dflash.head.lm_head, lm_head)
    assert dflash.name == "dflash" and dflash.needs_features
    assert dflash.feature_layer_ids == dflash.spec.target_layer_ids and dflash.max_block_size == BLOCK


def test_cached_drafting_equals_from_scratch(dflash):
    rng = np.random.default_rng(0)
    s = dflash.new_session()
    prompt = [3, 4, 5, 6, 7]
    feats = features(rng, len(prompt), dflash)
    s.start(prompt, feats)
    assert s.length == 5
    for n_commit, anchor, k in [(0, 10, BLOCK - 1), (3, 11, 4), (1, 12, BLOCK - 1), (4, 13, 2)]:
        if n_commit:
            new = features(rng, n_commit, dflash)
            s.commit(list(range(n_commit)), new)
            feats = np.concatenate([feats, new])
        assert s.length == feats.shape[0] == s.cache.k[0].shape[2]
        want, want_hidden = reference_drafts(dflash, feats, anchor, k)
        got = s.propose(anchor, k)
        assert got == want and len(got) == k
        ids = torch.tensor([anchor] + [dflash.spec.mask_token_id] * k)
        with torch.no_grad():
            cached_hidden = dflash.model(dflash.head.embed[ids][None], torch.arange(s.length, s.length + k + 1)[None], cache=s.cache)
        torch.testing.assert_close(cached_hidden, want_hidden, rtol=1e-5, atol=1e-5)


def test_proposals_leave_nothing_behind_after_partial_acceptance(dflash):
    """Each proposal writes its block's K/V past the committed context; after a partial acceptance the commit
    overwrites them. Round after round the proposal equals, bit for bit, that of a fresh session given the same
    commits (one that never proposed before), and the drafts equal the from-scratch recompute over all features."""
    rng = np.random.default_rng(5)
    prompt = features(rng, 6, dflash)
    chunks = []  # the commits so far: (tokens, features)
    busy = dflash.new_session()
    busy.start(list(range(6)), prompt)
    model, head, mask = dflash.model, dflash.head, dflash.spec.mask_token_id
    for anchor, k, accepted in [(10, BLOCK - 1, 2), (11, 3, 0), (12, BLOCK - 1, BLOCK - 1), (13, 1, 1), (14, 5, 3)]:
        fresh = dflash.new_session()
        fresh.start(list(range(6)), prompt)
        for tokens, f in chunks:
            fresh.commit(tokens, f)
        ids = torch.tensor([anchor] + [mask] * k)
        with torch.no_grad():
            want = model.draft(head.embed[ids][None], fresh.cache)
            assert torch.equal(model.draft(head.embed[ids][None], busy.cache), want)
            # the module's forward over the cache (the training-time code path) agrees bit for bit
            assert torch.equal(model(head.embed[ids][None], torch.arange(busy.length, busy.length + k + 1)[None], cache=busy.cache), want)
        got = busy.propose(anchor, k)
        all_feats = np.concatenate([prompt, *(f for _, f in chunks)])
        assert got == fresh.propose(anchor, k) == reference_drafts(dflash, all_feats, anchor, k)[0]
        chunks.append(([anchor] + got[:accepted], features(rng, accepted + 1, dflash)))  # the anchor + accepted drafts
        busy.commit(*chunks[-1])
        assert busy.length == 6 + sum(len(t) for t, _ in chunks)


def test_positions_follow_committed_length(dflash):
    """Context rows at 0..T-1 then T.., the block at L..L+k: shifting any of them changes the drafts."""
    rng = np.random.default_rng(1)
    feats = features(rng, 6, dflash)
    s = dflash.new_session()
    s.start([1, 2, 3, 4], feats[:4])
    s.commit([5, 6], feats[4:])
    got = s.propose(20, BLOCK - 1)
    assert got == reference_drafts(dflash, feats, 20, BLOCK - 1)[0]
    # Shifted context positions (as if the commit had restarted at 0) give different hidden states.
    model = dflash.model
    ids = torch.tensor([20] + [dflash.spec.mask_token_id] * (BLOCK - 1))
    with torch.no_grad():
        shifted = model(dflash.head.embed[ids][None], torch.arange(6, 6 + BLOCK)[None],
                        context=torch.from_numpy(feats)[None], context_positions=torch.tensor([[0, 1, 2, 3, 0, 1]]))
        right = model(dflash.head.embed[ids][None], torch.arange(6, 6 + BLOCK)[None], cache=s.cache)
    assert not torch.allclose(shifted, right, atol=1e-4)


def test_propose_is_pure_and_clamped(dflash):
    rng = np.random.default_rng(2)
    feats = features(rng, 3, dflash)
    s = dflash.new_session()
    s.start([1, 2, 3], feats)
    a = s.propose(7, 100)
    assert len(a) == BLOCK - 1 and s.length == 3
    assert s.propose(7, 100) == a
    assert s.propose(7, 3) == reference_drafts(dflash, feats, 7, 3)[0]
    assert s.propose(7, 0) == []


def test_sessions_are_independent(dflash):
    rng = np.random.default_rng(3)
    a, b = dflash.new_session(), dflash.new_session()
    fa = features(rng, 4, dflash)
    a.start([1, 2, 3, 4], fa)
    before = a.propose(9, 5)
    b.start([5, 6], features(rng, 2, dflash))
    b.commit([7, 8, 9], features(rng, 3, dflash))
    assert a.propose(9, 5) == before and a.length == 4 and b.length == 5
    a.close()
    a.close()


def test_feature_shape_errors(dflash):
    s = dflash.new_session()
    with pytest.raises(ValueError, match="needs target features"):
        s.start([1, 2], None)
    with pytest.raises(ValueError, match=r"expected \(2, "):
        s.start([1, 2], np.zeros((3, dflash.feature_dim), np.float32))
    s.start([1, 2], np.zeros((2, dflash.feature_dim), np.float32))
    with pytest.raises(ValueError, match="expected"):
        s.commit([1], np.zeros((1, dflash.feature_dim + 1), np.float32))
    s.commit([], None)  # nothing committed: nothing needed
    ro = np.zeros((1, dflash.feature_dim), np.float32)
    ro.flags.writeable = False  # as np.frombuffer gives from a protobuf payload
    s.commit([3], ro)
    assert s.length == 3
    with pytest.raises(ValueError, match="vocabulary"):
        s.propose(10**6, 3)


def write_fake_target(path, hidden=64, vocab=512, layers=2, tie=False, lm_head=True, shards=False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(
        {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": tie}))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
               "model.layers.9.embed_tokens.weight": torch.zeros(vocab, hidden)}
    if lm_head:
        tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    if shards:
        names = sorted(tensors)
        weight_map = {}
        for i, name in enumerate(names):
            file = f"model-{i:05d}.safetensors"
            save_file({name: tensors[name]}, str(path / file))
            weight_map[name] = file
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("tie,lm_head,shards", [(True, True, False), (False, False, False), (False, True, True)])
def test_load_target_head_variants(tmp_path, tie, lm_head, shards):
    tensors = write_fake_target(tmp_path, tie=tie, lm_head=lm_head, shards=shards)
    head = load_target_head(tmp_path)
    assert head.embed.dtype == torch.float32
    assert torch.equal(head.embed, tensors["model.embed_tokens.weight"].float())
    if tie or not lm_head:
        assert head.lm_head is head.embed
    else:
        assert torch.equal(head.lm_head, tensors["lm_head.weight"])
    assert (head.hidden_size, head.num_hidden_layers, head.vocab_size) == (64, 2, 512)


def test_incompatible_drafters_are_refused(tmp_path, drafter_dir, target_dir):
    write_fake_target(tmp_path / "wide", hidden=32)
    with pytest.raises(ValueError, match="hidden_size 64 but target .* has 32"):
        DFlashFactory(tmp_path / "wide", drafter_dir)
    deep = make_tiny_dflash(target_dir, tmp_path / "deep", target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match=r"target layers \[0, 5\].*layers 0..1"):
        DFlashFactory(target_dir, deep)
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashFactory(tmp_path / "missing", drafter_dir)


# ---- hybrid -----------------------------------------------------------------------------------


def test_hybrid_switches_between_ngram_and_dflash(dflash):
    rng = np.random.default_rng(4)
    hybrid = HybridFactory(dflash)
    # Only DFlash proposals are bounded by its trained block; n-gram rounds may use the server's largest.
    assert hybrid.feature_layer_ids == dflash.feature_layer_ids and hybrid.max_block_size is None
    prompt = [10, 11, 12, 13, 14, 15, 16, 10, 11]
    feats = features(rng, len(prompt), dflash)
    h = hybrid.new_session()
    plain = dflash.new_session()
    h.start(prompt, feats)
    plain.start(prompt, feats)

    assert h.propose(12, 5) == [13, 14, 15, 16, 10]  # [10, 11, 12] occurred: n-gram
    assert h.last_source == "ngram"
    assert len(h.propose(12, 40)) == 40  # n-gram: the whole ask, past DFlash's block
    assert h.propose(99, 5) == plain.propose(99, 5)  # no match: DFlash
    assert h.last_source == "dflash"
    # Both inner drafters see the commit.
    new = features(rng, 2, dflash)
    h.commit([99, 15], new)
    plain.commit([99, 15], new)
    # [15, 16] matches but is shorter than min_match=3: DFlash, although n-gram alone would propose.
    assert ngram(prompt + [99, 15]).match(16, 3) == (2, [10, 11, 99])
    assert h.propose(16, 3) == plain.propose(16, 3)
    assert h.last_source == "dflash"
    assert h.dflash.length == len(prompt) + 2 and len(h.ngram.index) == len(prompt) + 2
    assert len(h.propose(77, 40)) == BLOCK - 1  # DFlash: at most its block
    assert h.last_source == "dflash"


def test_hybrid_min_match_is_configurable(dflash):
    h = HybridFactory(dflash, min_match=2).new_session()
    h.start([1, 2, 3, 4, 2], np.zeros((5, dflash.feature_dim), np.float32))
    assert h.propose(3, 2) == [4, 2] and h.last_source == "ngram"
    with pytest.raises(ValueError, match="min_match"):
        HybridFactory(dflash, min_match=0)
    with pytest.raises(ValueError, match="max_n"):
        HybridFactory(dflash, min_match=3, max_n=2)


# ---- make_factory -------------------------------------------------------------------------------


def test_make_factory_kinds(target_dir, drafter_dir):
    none = make_factory("none", target_dir)
    s = none.new_session()
    s.start([1, 2], None)
    assert s.propose(3, 7) == [] and none.max_block_size == 1 and none.feature_layer_ids == []
    ng = make_factory("ngram", target_dir, max_n=4)
    assert ng.name == "ngram" and not ng.needs_features and ng.max_n == 4
    assert make_factory(DrafterKind.DFLASH, target_dir, drafter_dir).name == "dflash"
    hy = make_factory("hybrid", target_dir, drafter_dir, min_match=2)
    assert hy.name == "hybrid" and hy.min_match == 2 and hy.feature_layer_ids
    assert default_kind(drafter_dir) == "hybrid" and default_kind(None) == "ngram"


def test_make_factory_errors(target_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown drafter kind 'eagle'"):
        make_factory("eagle", target_dir)
    with pytest.raises(ValueError, match="needs a DFlash drafter checkpoint"):
        make_factory("dflash", target_dir)
    with pytest.raises(ValueError, match="needs a DFlash drafter checkpoint"):
        make_factory("hybrid", target_dir, None)
    with pytest.raises(ValueError, match="does not exist"):
        make_factory("dflash", target_dir, tmp_path / "nope")
    with pytest.raises(ValueError, match="takes no option"):
        make_factory("ngram", target_dir, min_match=3)
