"""Stop sequences (GenerateRequest.stop): the text ends before the first one generated, whatever pieces it comes in.

Pure: drafter_svc.tokens.StopSequences against a reference cut of the whole text (hypothesis over texts, stops and
chunkings) and TextStream over a real tokenizer. Through the stack (the shared CPU stack, real servers): the greedy
output with a stop equals the output without one cut at the stop, for every drafter, the tokens end with the one that
completed it, and nothing stays held (verifier session, scheduler budget). The stub applies them the same way; the
client and the CLI refuse bad ones with the server's words.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_svc.tokens import StopSequences, TextStream
from pdflash.client import Client
from pdflash.errors import InvalidArgument
from pdflash.v1 import drafter_pb2
from tests.test_services import assert_nothing_held


def reference_cut(text: str, stops) -> tuple[str, str | None]:
    """The whole text cut before the stop sequence that ends first (of two ending together, the longer)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    return (text, None) if best is None else (text[: best[0]], best[1])


def run_pieces(stops, pieces) -> tuple[list[str], str | None]:
    s = StopSequences(stops)
    out, hit = [], None
    for p in pieces:
        o, hit = s.feed(p)
        out.append(o)
        if hit is not None:
            return out, hit
    out.append(s.flush())
    return out, None


def test_examples():
    assert run_pieces(["\n\n"], ["a\n", "\nb"]) == (["a", ""], "\n\n")
    assert run_pieces(["\n\n"], ["a\n", "b"]) == (["a", "\nb", ""], None)  # the held newline goes out once it cannot stop
    assert run_pieces(["ab", "b"], ["a", "b"]) == (["", ""], "ab")  # ending together: the longer
    assert run_pieces(["xyz", "y"], ["xy", "z"]) == (["x"], "y")  # the one that ends first, though the other began first
    assert run_pieces(["def "], ["x = 1\nde", "f", " g"]) == (["x = 1\n", "", ""], "def ")
    assert run_pieces(["END"], ["no stop here"]) == (["no stop here", ""], None)
    with pytest.raises(ValueError):
        StopSequences([""])


texts = st.text(alphabet="ab\n x", max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=st.lists(st.text(alphabet="ab\n x", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_any_chunking_gives_the_reference_cut(text, stops, cuts):
    """Whatever pieces the text arrives in: the text sent is the reference cut, no piece sent contains a stop
    sequence, and a stop is reported exactly when the reference has one."""
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, hit = run_pieces(stops, pieces)
    want, want_hit = reference_cut(text, stops)
    assert "".join(out) == want and hit == want_hit
    sent = ""
    for o in out:
        sent += o
        assert not any(s in sent for s in stops)


def _tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.target("qwen3_moe")))


def test_text_stream_cuts_the_ids_at_the_token_that_completes_the_stop(tiny):
    tok = _tokenizer(tiny)
    ids = tok("x = 1\nreturn x + 2\n\ndef f():\n    pass\n", add_special_tokens=False)["input_ids"]
    whole = tok.decode(ids)
    stop = "def"
    ts = TextStream(tok, (), [stop])
    sent_ids, sent_text, hit = [], [], None
    for i in range(0, len(ids), 3):  # rounds of three tokens
        got, text, hit = ts.add(ids[i:i + 3])
        sent_ids += got
        sent_text.append(text)
        if hit is not None:
            break
    assert hit == stop and "".join(sent_text) == whole[: whole.index(stop)]
    assert stop not in tok.decode(sent_ids[:-1]) and stop in tok.decode(sent_ids)  # the last id completed it
    assert ts.add(ids[-2:]) == ([], "", stop)  # nothing after the stop
    plain = TextStream(tok, ())  # no stops: every id, the detokenizer's text
    got, text, hit = plain.add(ids)
    assert got == ids and hit is None and text + plain.finish()[0] == whole


def test_text_that_may_begin_a_stop_is_held_until_the_end(tiny):
    """The text's end that begins a stop sequence is held back; at the end of the ids it goes out (no stop). A stop
    completed goes at once, even where a longer one could have followed (it would end later)."""
    tok = _tokenizer(tiny)
    ts = TextStream(tok, (), ["END", "xyz"])
    _, text, hit = ts.add(tok("abc EN", add_special_tokens=False)["input_ids"])
    assert hit is None and text == "abc "
    assert ts.finish() == ("EN", None)
    ts = TextStream(tok, (), ["END", "ENDING"])
    _, text, hit = ts.add(tok("abc ENDING", add_special_tokens=False)["input_ids"])
    assert hit == "END" and text == "abc "


def test_the_client_refuses_bad_stop_sequences_in_the_servers_words():
    with pytest.raises(InvalidArgument) as e:
        Client.request("x", stop=["", "a" * 257, "ok"])
    assert [v.field for v in e.value.violations] == ["stop[0]", "stop[1]"]
    with pytest.raises(InvalidArgument, match="not one string"):
        Client.request("x", stop="\n")
    with pytest.raises(InvalidArgument, match="at most 16"):
        Client.request("x", stop=[str(i) for i in range(17)])
    assert list(Client.request("x", stop=["\n\n", "def "]).stop) == ["\n\n", "def "]


def test_the_cli_names_the_option(capsys):
    from pdflash.cli import main

    assert main(["generate", "x", "--target", "127.0.0.1:9", "--stop", "ok", "--stop", ""]) == 2  # (refused before a call)
    assert "--stop[1]: a stop sequence is 1 to 256 characters, got 0" in capsys.readouterr().err


# -- through the stack -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_server_refuses_bad_stop_sequences(stack):
    with Client(stack.drafter) as c, pytest.raises(grpc.RpcError) as e:
        list(c.stream(drafter_pb2.GenerateRequest(prompt="x", stop=["a", ""]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop[1]" in e.value.details()


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash", "hybrid"])
def test_greedy_output_with_a_stop_is_the_output_cut_at_it(stack, tiny, drafter):
    with Client(stack.drafter) as c:
        ref = c.generate("def add(a, b):\n", max_tokens=48, drafter="none", ignore_eos=True)
        assert ref.finish_reason == "length"
        stop = ref.text[len(ref.text) // 2:][:3]  # three characters from the middle of the text
        want = ref.text[: ref.text.index(stop)]
        out = c.generate("def add(a, b):\n", max_tokens=48, drafter=drafter, ignore_eos=True, stop=["\x00never", stop])
        assert out.finish_reason == "stop" and out.stop_sequence == stop
        assert out.text == want
        n = len(out.token_ids)
        assert out.token_ids == ref.token_ids[:n] and out.usage.completion_tokens == n
        tok = _tokenizer(tiny)
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])  # the last id completed it
        none = c.generate("def add(a, b):\n", max_tokens=48, drafter=drafter, ignore_eos=True, stop=["\x00never"])
        assert none.finish_reason == "length" and none.text == ref.text and none.stop_sequence == ""
    assert_nothing_held(stack)


# -- the stub ----------------------------------------------------------------------------------------------------


@pytest.mark.pdflash_stub(text="The quick brown fox. The lazy dog. ", chunk_tokens=4)
def test_the_stub_applies_stop_sequences_as_the_drafter_does(pdflash_stub):
    out = pdflash_stub.client.generate("anything", max_tokens=60, ignore_eos=True, stop=[". The l", "dog"])
    assert out.finish_reason == "stop" and out.stop_sequence == ". The l" and out.text == "The quick brown fox"
    assert out.usage.completion_tokens == len(out.token_ids) < 60
    plain = pdflash_stub.client.generate("anything", max_tokens=60, ignore_eos=True, stop=["cat"])
    assert plain.finish_reason == "length" and plain.stop_sequence == ""
