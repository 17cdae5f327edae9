"""Conversations (GenerateRequest.messages): the model's chat template makes the prompt.

Through the stack (the tiny checkpoints carry a ChatML-like template, pdflash.tiny.CHAT_TEMPLATE): ModelInfo says so,
a conversation generates exactly what its templated token ids generate, bad conversations get field violations; the
template's own refusal and a model without a template are refused in words a user can act on (api level); the stub
has no template and says so; the client and the CLI build conversations.
"""

from __future__ import annotations

import grpc
import pytest

from drafter_svc import api
from pdflash.client import Client
from pdflash.errors import InvalidArgument
from pdflash.types import DrafterKind
from pdflash.v1 import drafter_pb2

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


def _templated(tiny) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.target("qwen3_moe")))
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>\n") and "You write Python." in text
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_a_conversation_generates_what_its_templated_ids_do(stack, tiny):
    with Client(stack.drafter) as c:
        assert c.model_info().chat_template
        for drafter in ("none", "hybrid"):
            chat = c.generate(CHAT, max_tokens=24, drafter=drafter, ignore_eos=True)
            ids = c.generate(_templated(tiny), max_tokens=24, drafter="none", ignore_eos=True)
            assert chat.token_ids == ids.token_ids and chat.text == ids.text
            assert chat.usage.prompt_tokens == len(_templated(tiny))


@pytest.mark.slow
def test_bad_conversations_get_field_violations(stack):
    with Client(stack.drafter) as c:
        for msgs, field in (([], "messages"), ([drafter_pb2.ChatMessage(role="", content="x")], "messages[0].role")):
            req = drafter_pb2.GenerateRequest(messages=drafter_pb2.ChatMessages(messages=msgs))
            with pytest.raises(grpc.RpcError) as e:
                list(c.stream(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


@pytest.mark.slow
def test_the_cli_sends_the_prompt_as_a_users_turn(stack, capsys):
    from pdflash.cli import main

    assert main(["generate", "def add(a, b):", "--system", "You write Python.", "--target", stack.drafter,
                 "--max-tokens", "12", "--ignore-eos", "--drafter", "none"]) == 0
    with Client(stack.drafter) as c:
        want = c.generate(CHAT, max_tokens=12, drafter="none", ignore_eos=True).text
    assert capsys.readouterr().out == want + "\n"


LIMITS = api.Limits(max_prompt_tokens=64, max_tokens_limit=64, default_max_tokens=8, block_size=4, max_block_size=8,
                    vocab_size=100, max_context=128, drafters={DrafterKind.NGRAM: None}, default_drafter=DrafterKind.NGRAM)


def _parse(chat, msgs=CHAT):
    req = drafter_pb2.GenerateRequest(messages=drafter_pb2.ChatMessages(
        messages=[drafter_pb2.ChatMessage(**m) for m in msgs]))
    return api.parse_generate(req, "r", LIMITS, lambda text: [1, 2], chat)


def test_a_model_without_a_template_or_a_template_that_refuses():
    with pytest.raises(InvalidArgument, match="no chat template; send prompt"):
        _parse(None)

    def refuses(messages):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    with pytest.raises(InvalidArgument, match="chat template refused them: Conversation roles must alternate"):
        _parse(refuses)
    with pytest.raises(InvalidArgument, match="exceeds the limit of 64"):
        _parse(lambda m: list(range(1, 70)))
    req, _ = _parse(lambda m: [len(m), 7])
    assert req.prompt == (2, 7)


STUB_CHAT = "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"


def test_the_stub_takes_conversations_in_its_chat_format(pdflash_stub):
    """The stub's byte tokenizer has a chat format (ChatML's markers): Generate and Tokenize take `messages`, an echo
    script streams the rendered conversation back, model info says there is a template."""
    c = pdflash_stub.client
    assert c.model_info().chat_template
    out = c.generate(CHAT, max_tokens=len(STUB_CHAT.encode()), ignore_eos=True)
    assert out.text == STUB_CHAT
    assert list(c.tokenize(CHAT).ids) == list(STUB_CHAT.encode())


def test_a_stub_with_a_tokenizer_file_has_no_chat_template_and_says_so(tiny):
    from pdflash.testing.stub import StubServer

    with StubServer(tokenizer=str(tiny.target("qwen3_moe"))) as stub, Client(stub.address) as c:
        assert not c.model_info().chat_template
        with pytest.raises(grpc.RpcError) as e:
            c.generate(CHAT, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.value.details()


def test_the_client_builds_and_checks_conversations():
    req = Client.request(CHAT)
    assert req.WhichOneof("input") == "messages" and [m.role for m in req.messages.messages] == ["system", "user"]
    assert Client.request([3, 4]).WhichOneof("input") == "prompt_tokens"
    with pytest.raises(InvalidArgument) as e:
        Client.request([{"role": "user"}, {"content": "x"}])
    assert [v.field for v in e.value.violations] == ["messages[0].content", "messages[1].role"]
