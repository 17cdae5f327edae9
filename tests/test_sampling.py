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
from pdflash.types import SamplingParams
from tests.conftest import DEVICE, DTYPE
from verifier_svc.verify import accept_greedy, accept_sampled, target_probs


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


@pytest.mark.slow
def test_stack_sampling_is_seeded_and_matches_target_distribution(stack, tiny):
    """Through the three services: a seed reproduces; the first two tokens follow the target's distribution."""
    prompt = "def fibonacci(n):\n"
    sp = dict(temperature=1.0, top_k=4)
    with Client(stack.drafter) as client:
        a = client.generate(prompt, max_tokens=24, seed=7, drafter="ngram", **sp)
        b = client.generate(prompt, max_tokens=24, seed=7, drafter="ngram", **sp)
        assert a.token_ids == b.token_ids
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
