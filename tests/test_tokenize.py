"""Tokenize / Detokenize (the public API's token counting): the ids are exactly those Generate takes for the same
prompt or conversation; Detokenize is the tokenizer's decode; bad ids and conversations are refused with field
violations. Through the stack, the stub, the client and `pdflash tokenize`."""

from __future__ import annotations

import grpc
import pytest

from pdflash.client import Client
from pdflash.testing import StubServer
from pdflash.testing.tokenizer import ByteTokenizer
from pdflash.v1 import drafter_pb2

CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.mark.slow
def test_tokenize_gives_the_ids_generate_takes(stack, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.target("qwen3_moe")))
    with Client(stack.drafter) as c:
        for prompt in ("def fib(n):\n", CHAT):
            r = c.tokenize(prompt)
            assert r.count == len(r.ids) > 0 and r.fits_prompt
            out = c.generate(prompt, max_tokens=4, drafter="none")
            assert out.usage.prompt_tokens == r.count
            assert c.generate(list(r.ids), max_tokens=4, drafter="none").token_ids == out.token_ids
        assert list(c.tokenize("def fib(n):\n").ids) == tok("def fib(n):\n")["input_ids"]
        assert c.tokenize("").count == 0
        ids = tok("x = [1, 2]\n")["input_ids"]
        assert c.detokenize(ids) == tok.decode(ids) == "x = [1, 2]\n"
        with pytest.raises(grpc.RpcError) as e:
            c.detokenize([0, 10**6])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Tokenize(drafter_pb2.TokenizeRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "give one of prompt" in e.value.details()


def test_the_stub_tokenizes_as_it_generates(pdflash_stub):
    c = pdflash_stub.client
    r = c.tokenize("héllo")
    assert r.count == len("héllo".encode()) and c.detokenize(r.ids) == "héllo"
    assert c.generate("héllo", max_tokens=2).usage.prompt_tokens == r.count
    assert list(c.tokenize(CHAT).ids) == ByteTokenizer().chat_ids(CHAT)  # its chat format, as Generate takes it
    with StubServer(max_prompt_tokens=4) as small:
        assert not small.client.tokenize("too long a prompt").fits_prompt


def test_the_cli_counts_tokens(pdflash_stub, capsys):
    from pdflash.cli import main

    assert main(["tokenize", "abc", "--ids", "--target", pdflash_stub.address]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["3 tokens", "97 98 99"]
    assert main(["tokenize", "abc", "--chat", "--target", pdflash_stub.address]) == 0  # a user turn, the stub's format
    n = len(ByteTokenizer().chat_ids([{"role": "user", "content": "abc"}]))
    assert capsys.readouterr().out.split("\n")[0] == f"{n} tokens"
