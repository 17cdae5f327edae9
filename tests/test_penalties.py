"""Repetition, presence and frequency penalties (SamplingParams): applied to each verify row as plain decoding would
have applied them at that position, so speculation keeps the output of plain decoding with the same penalties.

Pure: `pdflash.penalties.Penalties` row by row against transformers' RepetitionPenaltyLogitsProcessor and OpenAI's formula.
Core (three architectures): greedy with random drafts (accepted and rejected) equals transformers' `generate` with
repetition_penalty, and a plain decoding loop with presence / frequency penalties. Stack: every drafter, the same
output. Client, CLI and server refuse values out of range.
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pdflash.client import Client
from pdflash.errors import InvalidArgument
from pdflash.penalties import Penalties
from pdflash.tiny import ARCHITECTURES
from pdflash.types import DraftResult, SamplingParams
from pdflash.v1 import common_pb2, drafter_pb2
from tests.conftest import DEVICE, DTYPE
from verifier_svc.engine import PrefillInput, VerifierCore
from verifier_svc.model import load_target
from verifier_svc.verify import accept_greedy

PROMPT = (11, 52, 7, 300, 41, 99, 5, 17, 52, 7)


def test_each_row_sees_the_output_so_far_and_the_drafts_before_it():
    g = torch.Generator().manual_seed(0)
    vocab, prompt, output, drafts = 50, [3, 4, 4, 9], [9, 12, 3], [12, 20, 20, 7]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    for s in (SamplingParams(repetition_penalty=1.7), SamplingParams(presence_penalty=0.8, frequency_penalty=-0.3),
              SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=1.5)):
        p = Penalties(s, prompt, vocab, "cpu")
        p.emitted(output)
        got = p.apply(logits, drafts)
        for i in range(len(drafts) + 1):
            seq = prompt + output + drafts[:i]
            want = logits[i : i + 1].clone()
            if s.repetition_penalty != 1.0:
                want = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(torch.tensor([seq]), want)
            counts = torch.bincount(torch.tensor(output + drafts[:i]), minlength=vocab).float()
            want = want - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
            assert torch.equal(got[i], want[0]), (s, i)
    assert torch.equal(Penalties(SamplingParams(repetition_penalty=2.0), [], vocab, "cpu").apply(logits[:1], []), logits[:1])



@pytest.mark.parametrize("sampling", [SamplingParams(repetition_penalty=1.7), SamplingParams(presence_penalty=2.5),
                                      SamplingParams(frequency_penalty=1.2, repetition_penalty=1.2)])
def test_a_drafter_under_the_penalties_drafts_what_the_verifier_accepts(sampling):
    """The drafter's rule (`greedy_drafts`: draft j sees the output so far, the anchor and drafts 1..j-1) and the
    verifier's (`apply` after the anchor is emitted) are the same: on the same logits every draft is accepted. The
    logits favour the anchor and the tokens seen so far, so the penalties decide (the plain argmax differs)."""
    g = torch.Generator().manual_seed(1)
    vocab, prompt, output, anchor, k = 40, [5, 6, 7], [8, 6, 8], 9, 6  # (the anchor new to the output)
    logits = torch.randn(k + 1, vocab, generator=g)
    logits[:, [anchor, 5, 8, 20, 30]] += torch.tensor([4.0, 3.0, 3.5, 2.5, 2.0])  # 20, 30: unseen so far
    drafter = Penalties(sampling, prompt, vocab, "cpu")
    drafter.emitted(output)
    drafts = drafter.greedy_drafts(logits[:k], anchor)
    assert len(drafts) == k and drafts != logits[:k].argmax(-1).tolist()
    assert torch.equal(drafter.counts, torch.bincount(torch.tensor(output), minlength=vocab).float())  # unchanged
    verifier = Penalties(sampling, prompt, vocab, "cpu")
    verifier.emitted(output + [anchor])
    accepted, _ = accept_greedy(drafts, verifier.apply(logits, drafts))
    assert accepted == k


@pytest.fixture(scope="module", params=ARCHITECTURES)
def core(request, tiny):
    return request.param, VerifierCore(load_target(tiny.target(request.param), DEVICE, DTYPE), max_block_size=16)


def _run(c: VerifierCore, sampling: SamplingParams, n: int, want: list[int] | None = None, seed: int = 0) -> list[int]:
    """A session driven with random-width blocks: the reference's own tokens with errors (some accepted, some not)."""
    rng = random.Random(seed)
    o = c.prefill(PrefillInput("r", PROMPT, sampling, n, ignore_eos=True))
    toks, rnd = list(o.tokens), 0
    while o.finished is None:
        rnd += 1
        k = rng.randint(0, 6)
        drafts = [(want[len(toks) + i] if want and len(toks) + i < len(want) and rng.random() < 0.8
                   else rng.randrange(c.target.vocab_size)) for i in range(k)]
        o = c.verify(DraftResult(o.session_id, rnd, (toks[-1], *drafts), {}, 0))
        toks += o.tokens
    return toks


def test_greedy_with_a_repetition_penalty_is_transformers_generate(core, tiny):
    arch, c = core
    model = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, repetition_penalty=1.3,
                             eos_token_id=None, min_new_tokens=0)
    want = out[0, len(PROMPT):].tolist()
    plain = _run(c, SamplingParams(), 40, want)
    assert _run(c, SamplingParams(repetition_penalty=1.3), 40, want) == want != plain  # (the penalty changes the text)


def test_greedy_with_presence_and_frequency_penalties_is_plain_decoding_with_them(core, tiny):
    arch, c = core
    s = SamplingParams(presence_penalty=1.5, frequency_penalty=0.7)
    model = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    seq, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(24):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
            tok = int((logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()).argmax())
            out.append(tok)
            seq.append(tok)
    assert _run(c, s, 24, out) == out


@pytest.mark.slow
def test_every_drafter_gives_the_same_penalized_output(stack):
    with Client(stack.drafter) as c:
        kw = dict(max_tokens=40, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.4)
        ref = c.generate("def fib(n):\n", drafter="none", **kw)
        for drafter in ("ngram", "dflash", "hybrid"):
            assert c.generate("def fib(n):\n", drafter=drafter, **kw).token_ids == ref.token_ids, drafter
        assert c.generate("def fib(n):\n", drafter="none", max_tokens=40, ignore_eos=True).token_ids != ref.token_ids
        with pytest.raises(grpc.RpcError) as e:
            list(c.stream(drafter_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                repetition_penalty=-1.0, presence_penalty=2.5)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.repetition_penalty" in e.value.details()


def test_the_client_and_cli_check_the_ranges(capsys):
    from pdflash.cli import main

    with pytest.raises(InvalidArgument) as e:
        Client.request("x", repetition_penalty=12, presence_penalty=-3, frequency_penalty=float("nan"))
    assert [v.field for v in e.value.violations] == ["sampling.repetition_penalty", "sampling.presence_penalty",
                                                     "sampling.frequency_penalty"]
    assert Client.request("x", repetition_penalty=0).sampling.repetition_penalty == 0  # (0 = off on the wire)
    assert main(["generate", "x", "--target", "127.0.0.1:9", "--frequency-penalty", "2.5"]) == 2
    assert "--frequency-penalty: must be in [-2, 2] (0 = off), got 2.5" in capsys.readouterr().err
