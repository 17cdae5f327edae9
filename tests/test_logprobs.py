"""Log-probabilities (GenerateRequest.logprobs / top_logprobs): each emitted token's log-probability under the target
model, raw distribution, with the likeliest alternatives.

Core (in-process, three architectures): the values equal a plain transformers forward's log-softmax over the whole
sequence at each position, for greedy and sampled sessions, with drafts accepted and rejected; off = none. Stack: the
same values whatever the drafter, the top list led by the greedy token, cut with the ids by a stop sequence. Stub,
client and CLI: the fields and their checks.
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from pdflash.client import Client
from pdflash.errors import InvalidArgument
from pdflash.tiny import ARCHITECTURES
from pdflash.types import DraftResult, SamplingParams
from pdflash.v1 import drafter_pb2
from tests.conftest import DEVICE, DTYPE
from verifier_svc.engine import PrefillInput, VerifierCore
from verifier_svc.model import load_target

PROMPT = (11, 52, 7, 300, 41, 99, 5, 17)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def core(request, tiny):
    return request.param, VerifierCore(load_target(tiny.target(request.param), DEVICE, DTYPE), max_block_size=16)


def plain_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain transformers forward over the whole sequence: row i scores the token at i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)])
def test_logprobs_are_the_targets_at_every_position(core, tiny, sampling):
    arch, c = core
    rng = random.Random(1)
    o = c.prefill(PrefillInput("r", PROMPT, sampling, 24, ignore_eos=True, logprobs=True, top_logprobs=3))
    toks, lps, tops = list(o.tokens), list(o.logprobs), list(o.top_logprobs)
    rnd = 0
    while o.finished is None:
        rnd += 1
        drafts = [rng.randrange(c.target.vocab_size) for _ in range(rng.randint(0, 4))]  # mostly rejected
        o = c.verify(DraftResult(o.session_id, rnd, (toks[-1], *drafts), {}, 0))
        assert len(o.logprobs) == len(o.top_logprobs) == len(o.tokens)
        toks += o.tokens
        lps += o.logprobs
        tops += o.top_logprobs
    ref = plain_logprobs(tiny.target(arch), list(PROMPT) + toks)
    for i, (tok, lp, (ids, vals)) in enumerate(zip(toks, lps, tops)):
        row = ref[len(PROMPT) - 1 + i]
        assert lp == pytest.approx(float(row[tok]), abs=2e-4), i
        want_vals, want_ids = torch.topk(row, 3)
        assert vals == pytest.approx(want_vals.tolist(), abs=2e-4) and len(ids) == 3 and vals == sorted(vals, reverse=True)
        assert set(ids) == set(want_ids.tolist()) or abs(vals[-1] - float(row.topk(4).values[-1])) < 2e-4  # (a tie)
        if sampling.greedy:
            assert ids[0] == tok and vals[0] == lp


def test_no_logprobs_unless_asked(core):
    _, c = core
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 4, ignore_eos=True))
    assert o.logprobs is None and o.top_logprobs is None
    o = c.verify(DraftResult(o.session_id, 1, (o.tokens[-1], 5), {}, 0))
    assert o.logprobs is None and o.top_logprobs is None
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 4, ignore_eos=True, logprobs=True))
    assert len(o.logprobs) == 1 and o.top_logprobs is None
    c.end(o.session_id)


def test_the_verifier_checks_the_fields(core):
    _, c = core
    for lp, top, says in ((False, 2, "needs logprobs"), (True, 21, r"\[0, 20\]")):
        with pytest.raises(InvalidArgument, match=says):
            c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 4, logprobs=lp, top_logprobs=top))


def test_the_client_and_cli_check_them_in_the_servers_words(capsys):
    from pdflash.cli import main

    with pytest.raises(InvalidArgument, match="needs logprobs"):
        Client.request("x", top_logprobs=3)
    with pytest.raises(InvalidArgument, match=r"\[0, 20\]"):
        Client.request("x", logprobs=True, top_logprobs=21)
    req = Client.request("x", logprobs=True, top_logprobs=5)
    assert req.logprobs and req.top_logprobs == 5
    assert main(["generate", "x", "--target", "127.0.0.1:9", "--top-logprobs", "21"]) == 2
    assert "--top-logprobs: must be in [0, 20], got 21" in capsys.readouterr().err


# -- through the stack -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_same_logprobs_whatever_the_drafter(stack):
    with Client(stack.drafter) as c:
        ref = c.generate("def add(a, b):\n", max_tokens=32, drafter="none", ignore_eos=True, logprobs=True, top_logprobs=2)
        assert len(ref.logprobs) == len(ref.top_logprobs) == len(ref.token_ids) == 32
        for tok, lp, top in zip(ref.token_ids, ref.logprobs, ref.top_logprobs):
            assert top[0] == (tok, lp) and len(top) == 2 and top[1][1] <= lp <= 0.0  # greedy: the likeliest
        for drafter in ("ngram", "dflash", "hybrid"):
            out = c.generate("def add(a, b):\n", max_tokens=32, drafter=drafter, ignore_eos=True, logprobs=True)
            assert out.token_ids == ref.token_ids and out.top_logprobs is None
            assert out.logprobs == pytest.approx(ref.logprobs, abs=2e-4)  # (CPU: the block's width moves last bits)
        plain = c.generate("def add(a, b):\n", max_tokens=8, drafter="ngram")
        assert plain.logprobs is None
        stop = ref.text[len(ref.text) // 2:][:3]
        cut = c.generate("def add(a, b):\n", max_tokens=32, drafter="ngram", ignore_eos=True, logprobs=True, stop=[stop])
        assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.token_ids) < 32


@pytest.mark.slow
def test_the_server_refuses_top_logprobs_without_logprobs(stack):
    with Client(stack.drafter) as c, pytest.raises(grpc.RpcError) as e:
        list(c.stream(drafter_pb2.GenerateRequest(prompt="x", top_logprobs=2), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in e.value.details()


@pytest.mark.pdflash_stub(text="The quick brown fox. ", chunk_tokens=3)
def test_the_stub_is_certain_of_its_script(pdflash_stub):
    out = pdflash_stub.client.generate("anything", max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=4)
    assert out.logprobs == [0.0] * 10 and out.top_logprobs == [[(t, 0.0)] for t in out.token_ids]
    assert pdflash_stub.client.generate("anything", max_tokens=4).logprobs is None


@pytest.mark.pdflash_stub(text="The quick brown fox. ", chunk_tokens=3)
def test_the_cli_prints_each_tokens_text_with_its_logprob(pdflash_stub, capsys):
    """`pdflash generate --logprobs --top-logprobs N`: after the text, a line a token on stderr: its id, its own text
    (as Python writes a str), its log-probability, then the alternatives as id:text:logprob."""
    from pdflash.cli import main

    assert main(["generate", "anything", "--target", pdflash_stub.address, "--max-tokens", "4", "--ignore-eos",
                 "--logprobs", "--top-logprobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == "The \n"
    lines = err.splitlines()
    assert lines == [f"{ord(c)}\t{c!r}\t0.0000\t{ord(c)}:{c!r}:0.0000" for c in "The "], lines
