"""Sampled verification is lossless: the emitted tokens follow the target's distribution exactly."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pdflash.client import Client
from pdflash.sampler import target_probs
from pdflash.types import SamplingParams
from tests.conftest import DEVICE, DTYPE
from verifier_svc.verify import accept_greedy, accept_sampled


@pytest.mark.parametrize("sp", [SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(1.0, top_p=0.8), SamplingParams(0.9, 0.9, 7)])
def test_target_probs_match_transformers_warpers(sp):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    x = TemperatureLogitsWarper(sp.temperature)(None, logits.clone())
    if sp.top_k:
        x = TopKLogitsWarper(sp.top_k)(None, x)
    if sp.top_p < 1:
        x = TopPLogitsWarper(sp.top_p)(None, x)
    torch.testing.assert_close(target_probs(logits, sp), x.softmax(-1))


def test_accept_greedy():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 1.0
    assert accept_greedy([3, 4, 5], logits) == (3, 6)
    assert accept_greedy([3, 9, 5], logits) == (1, 4)
    assert accept_greedy([], logits[:1]) == (0, 3)


def chi2_ok(counts: collections.Counter, probs: dict, n: int, alpha: float = 1e-3) -> float:
    keys = [k for k, p in probs.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in keys]
    exp = [probs[k] * n for k in keys]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        exp = list(np.array(exp) * (sum(obs) / sum(exp)))
    p = chisquare(obs, exp).pvalue
    assert p > alpha, f"chi-square p={p:.2e}: sampled distribution differs from the target's"
    return p


@pytest.mark.parametrize("draft", [[2], [2, 0], [7, 7, 1]])
def test_accept_sampled_emits_target_distribution(draft):
    """With a deterministic draft, the emitted token sequence is distributed as the target's samples."""
    gen = torch.Generator().manual_seed(1234)
    V = 8
    torch.manual_seed(5)
    probs = torch.softmax(torch.randn(len(draft) + 1, V) * 1.5, dim=-1)
    n = 20000
    first = collections.Counter()
    joint = collections.Counter()
    for _ in range(n):
        acc, nxt = accept_sampled(draft, probs, gen)
        toks = draft[:acc] + [nxt]
        first[toks[0]] += 1
        if acc >= 1:
            joint[(toks[0], toks[1])] += 1
    chi2_ok(first, {t: float(probs[0, t]) for t in range(V)}, n)
    # given the first token equals draft[0], the second follows probs[1] (the target's conditional)
    n2 = sum(joint.values())
    chi2_ok(collections.Counter({b: c for (a, b), c in joint.items()}), {t: float(probs[1, t]) for t in range(V)}, n2)


@pytest.mark.parametrize("support", [8, 5, 3])
def test_sampled_drafts_with_their_distributions_emit_the_target_distribution(support):
    """Drafts drawn from a drafter's q (sparse: its top `support` tokens, so some tokens p gives mass have q = 0) and
    sent with it: the first emitted token follows p[0], the second (after an accepted first) p[1], and the first
    draft is accepted at the rate sum(min(p, q)) (above p's mass on the deterministic draft q's argmax)."""
    from pdflash.types import DraftDistribution

    gen = torch.Generator().manual_seed(99)
    rng = np.random.default_rng(7)
    V, k = 8, 2
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(k + 1, V) * 1.5, dim=-1)
    q_full = torch.softmax(torch.randn(k, V) * 1.5, dim=-1)
    dists = []
    for j in range(k):
        ids = torch.topk(q_full[j], support).indices.tolist()
        vals = q_full[j, ids].float().tolist()  # as a drafter sends them (float32), normalized on both sides
        dists.append(DraftDistribution(tuple(ids), tuple(vals)))
    n = 20000
    first, second, accepted_first = collections.Counter(), collections.Counter(), 0
    for _ in range(n):
        drafts = [int(rng.choice(q.ids, p=np.array(q.probs) / np.sum(q.probs))) for q in dists]
        acc, nxt = accept_sampled(drafts, probs, gen, tuple(dists))
        toks = drafts[:acc] + [nxt]
        first[toks[0]] += 1
        accepted_first += acc >= 1
        if acc >= 1:
            second[toks[1]] += 1
    chi2_ok(first, {t: float(probs[0, t]) for t in range(V)}, n)
    chi2_ok(second, {t: float(probs[1, t]) for t in range(V)}, sum(second.values()))
    q0 = torch.zeros(V, dtype=torch.float64)
    q0[list(dists[0].ids)] = torch.tensor(dists[0].probs, dtype=torch.float64) / sum(dists[0].probs)
    rate = float(torch.minimum(probs[0].double(), q0).sum())
    assert abs(accepted_first / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5 + 1e-3, (accepted_first / n, rate)
    assert rate > float(probs[0, int(q0.argmax())])


def test_a_sampling_drafter_draws_its_first_drafts_from_the_distributions_it_sends():
    """SampledDrafts on fixed logits: drafts 1..SAMPLED_POSITIONS are drawn from the request's warpers on the logits (top
    SAMPLED_SUPPORT, renormalized: chi-square against them), each sent with that q; later drafts are the argmax with a
    one-hot q; a seed reproduces; with a penalty the draws count the drafts before them."""
    from drafter_svc.drafters.dflash import SAMPLED_POSITIONS, SAMPLED_SUPPORT, SampledDrafts

    g = torch.Generator().manual_seed(4)
    k, V = 4, 100
    logits = torch.randn(k, V, generator=g) * 2
    sp = SamplingParams(temperature=0.8, top_k=40, seed=11)
    a, b = SampledDrafts(sp).drafts(logits, None, 0), SampledDrafts(sp).drafts(logits, None, 0)
    assert list(a) == list(b) and a.dists == b.dists and len(a) == len(a.dists) == k
    p = target_probs(logits, sp)
    for j, (d, q) in enumerate(zip(a, a.dists)):
        assert d in q.ids
        if j < SAMPLED_POSITIONS:
            assert len(q.ids) == min(40, SAMPLED_SUPPORT) and q.ids[0] == int(p[j].argmax())
            assert np.allclose(q.probs, p[j, list(q.ids)].numpy())
        else:
            assert q.ids == (int(p[j].argmax()),) and q.probs == (1.0,)
    s = SampledDrafts(SamplingParams(temperature=0.8, top_k=40, seed=12))
    n, first = 4000, collections.Counter()
    for _ in range(n):
        first[s.drafts(logits[:1], None, 0)[0]] += 1
    q0 = p[0] / p[0].sum()
    chi2_ok(first, {t: float(q0[t]) for t in range(V) if q0[t] > 0}, n)


def test_sampled_drafts_of_a_penalized_request_count_the_drafts_drawn_before_them():
    """Temperature and a presence penalty: draft j is drawn from the penalized row, the anchor and drafts 1..j-1
    counted as output (token 5 leads every row by 1; once drawn, the penalty of 2 puts 6 ahead; then both are
    penalized and 5 leads again)."""
    from drafter_svc.drafters.dflash import SampledDrafts
    from pdflash.penalties import Penalties

    logits = torch.full((3, 10), -20.0)
    logits[:, 5], logits[:, 6] = 10.0, 9.0
    sp = SamplingParams(temperature=0.05, presence_penalty=2.0, seed=1)
    drafts = SampledDrafts(sp).drafts(logits, Penalties(sp, [], 10, "cpu"), anchor=0)
    assert list(drafts) == [5, 6, 5] and all(d in q.ids for d, q in zip(drafts, drafts.dists))
    assert list(SampledDrafts(sp).drafts(logits, None, anchor=0)) == [5, 5, 5]


def test_dflash_sampled_drafts_keep_the_target_distribution():
    """The verifier core and the DFlash drafter on the demo pair, a sampled request whose drafts are drawn and sent
    with their q: the (first, second) tokens follow the target's own probabilities (the second from a verify of a
    drawn draft), chi-square over the pairs; the drafts really are drawn (not all the argmax)."""
    import pathlib

    from drafter_svc.drafters import make_factory
    from pdflash.defaults import default_drafter_dir, default_target_dir
    from pdflash.types import DraftResult, union_bytes
    from verifier_svc.engine import PrefillInput, VerifierCore
    from verifier_svc.model import load_target

    tdir = pathlib.Path(default_target_dir())
    core = VerifierCore(load_target(tdir, DEVICE, DTYPE), max_block_size=4)
    f = make_factory("dflash", tdir, default_drafter_dir())
    prompt = list(range(40, 64))
    sp = dict(temperature=1.0, top_k=3)
    with torch.no_grad():
        def probs(ids):
            return target_probs(core.target.model(torch.tensor([ids])).logits[0, -1:].float(), SamplingParams(**sp))[0]

        p1 = probs(prompt)
        table = {(a, b): float(p1[a] * pb) for a in torch.nonzero(p1).flatten().tolist()
                 for b, pb in enumerate(probs(prompt + [a]).tolist()) if pb > 0}
    n, pairs, drafted = 300, collections.Counter(), collections.Counter()
    for seed in range(n):
        s = SamplingParams(seed=2000 + seed, **sp)
        pre = core.prefill(PrefillInput("s", tuple(prompt), s, 2, ignore_eos=True, feature_layer_ids=tuple(f.feature_layer_ids)))
        d = f.new_session(s)
        d.start(prompt, pre.features)
        a = pre.tokens[-1]
        prop = d.propose(a, 3)
        assert len(prop.dists) == len(prop) == 3
        drafted[(a, prop[0])] += 1
        res = core.verify(DraftResult(pre.session_id, 1, (a, *prop), pre.routed_union,
                                      union_bytes(pre.routed_union, core.target.byte_map), prop.dists))
        assert res.finished is not None and len(core.sessions) == 0
        pairs[(a, res.tokens[0])] += 1
        d.close()
    anchors = {a for a, _ in drafted}
    assert any(len({b for x, b in drafted if x == a}) > 1 for a in anchors), "one draft per anchor: nothing was drawn"
    assert set(pairs) <= set(table), "sampled a pair the target gives zero probability"
    chi2_ok(pairs, table, n)


@pytest.mark.slow
def test_stack_sampling_is_seeded_and_matches_target_distribution(stack, tiny):
    """Through the three services: a seed reproduces; the first two tokens follow the target's distribution."""
    prompt = "def fibonacci(n):\n"
    sp = dict(temperature=1.0, top_k=4)
    with Client(stack.drafter) as client:
        a = client.generate(prompt, max_tokens=24, seed=7, drafter="ngram", **sp)
        b = client.generate(prompt, max_tokens=24, seed=7, drafter="ngram", **sp)
        assert a.token_ids == b.token_ids
        # DFlash drafts drawn at random and sent with their distributions (DraftResult.draft_dists) through the
        # scheduler and the verifier: the drafter's stream is the seed's too, so a seed still reproduces
        # ignore_eos: the length check below is about the rounds running, not about where this host's float32 CPU math
        # (its bits follow the thread count) happens to sample the end token: on 16-core GPU hosts (stops 48-50) both
        # runs gave the same 18 tokens ending in token 0, which the old check (no ignore_eos) read as a failure
        c = client.generate(prompt, max_tokens=24, seed=7, drafter="dflash", ignore_eos=True, **sp)
        d = client.generate(prompt, max_tokens=24, seed=7, drafter="dflash", ignore_eos=True, **sp)
        assert c.token_ids == d.token_ids and len(c.token_ids) == 24, (
            f"first {list(c.token_ids)} ({c.usage.rounds} rounds, {c.usage.draft_tokens} drafts), "
            f"second {list(d.token_ids)} ({d.usage.rounds} rounds, {d.usage.draft_tokens} drafts)")
        n = 300
        pairs = collections.Counter()
        for seed in range(n):
            # block 4 with n-gram drafts: the second token comes from a verify of a drafted block
            got = client.generate(prompt, max_tokens=2, seed=1000 + seed, drafter="ngram", block_size=4, ignore_eos=True, **sp)
            pairs[tuple(got.token_ids)] += 1
    # exact target probabilities of every (t1, t2) from plain transformers
    model_dir = tiny.target("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    ids = tok(prompt).input_ids
    s = SamplingParams(**sp)
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([ids])).logits[0, -1:], s)[0]
        probs = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = target_probs(model(torch.tensor([ids + [t1]])).logits[0, -1:], s)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                probs[(t1, t2)] = float(p1[t1] * p2[t2])
    assert set(pairs) <= set(probs), "sampled a pair the target gives zero probability"
    chi2_ok(pairs, probs, n)


@pytest.mark.parametrize("dists,why", [
    ((((3,), (1.0,)),), "for 2 drafts"),
    ((((3, 3), (0.5, 0.5)), ((4,), (1.0,))), "unique"),
    ((((3, 99), (0.5, 0.5)), ((4,), (1.0,))), "in [0, 50)"),
    ((((3,), (float("nan"),)), ((4,), (1.0,))), "finite"),
    ((((3, 5), (0.0, 1.0)), ((4,), (1.0,))), "draft 3 has probability 0"),
    ((((5,), (1.0,)), ((4,), (1.0,))), "draft 3 has probability 0"),
    ((((3, 5), (1.0,)), ((4,), (1.0,))), "one probability per id"),
    (((tuple(range(5000)), (1.0,) * 5000), ((4,), (1.0,))), "between 1 and"),
])
def test_bad_draft_distributions_are_refused_naming_the_field(dists, why):
    from pdflash.types import DraftDistribution
    from pdflash.validation import draft_dists_violations

    v = draft_dists_violations(tuple(DraftDistribution(*q) for q in dists), (3, 4), 50)
    assert len(v) == 1 and v[0].field.startswith("draft.draft_dists") and why in v[0].description, v
    assert draft_dists_violations((DraftDistribution((3, 7), (0.2, 0.8)), DraftDistribution((4,), (1.0,))), (3, 4), 50) == []
    assert draft_dists_violations((), (3, 4), 50) == []
