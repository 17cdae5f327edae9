"""Incremental detokenization: chunks concatenate to a full decode; no broken characters in between."""

from __future__ import annotations

import random

import pytest

from drafter_svc.tokens import IncrementalDetokenizer, load_tokenizer
from pdflash.tiny import EOS, MASK, make_tokenizer

TEXT = "héllo wörld ✓ 😀 日本語\n\tdef f(x):  return x  # ünïcode ✓✓"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return load_tokenizer(d)


def stream(tok, ids, groups=None, prompt_ids=()):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    chunks, i = [], 0
    for size in groups or [1] * len(ids):
        chunks.append(d.add(ids[i : i + size]))
        i += size
    assert i == len(ids)
    chunks.append(d.flush())
    return chunks


def test_multibyte_one_token_at_a_time(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the tokenizer really splits characters
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in c for c in chunks)


def test_special_tokens_are_skipped(tok):
    eos, mask = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(MASK)
    ids = [mask] + tok.encode("ok é", add_special_tokens=False) + [eos, mask] + tok.encode("✓ end", add_special_tokens=False) + [eos]
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == "ok é✓ end"
    assert not any(EOS in c or MASK in c or "\ufffd" in c for c in chunks)


def test_random_groups_and_prompt_context(tok):
    rng = random.Random(0)
    ids = tok.encode(TEXT * 3, add_special_tokens=False)
    full = tok.decode(ids)
    # Prompts end on a character boundary (a prompt is text, encoded).
    cuts = [c for c in range(len(ids)) if full.startswith(tok.decode(ids[:c])) and not tok.decode(ids[:c]).endswith("\ufffd")]
    for cut in rng.sample(cuts, 20):
        prompt, gen = ids[:cut], ids[cut:]
        groups = []
        while sum(groups) < len(gen):
            groups.append(min(rng.randint(1, 4), len(gen) - sum(groups)))
        chunks = stream(tok, gen, groups, prompt_ids=prompt)
        # With the prompt as context, the chunks extend the prompt's text exactly.
        assert tok.decode(prompt) + "".join(chunks) == tok.decode(ids)


def test_incomplete_character_is_flushed_at_the_end(tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) > 2
    d = IncrementalDetokenizer(tok)
    out = [d.add([i]) for i in ids[:-1]]
    assert "".join(out) == "a"
    assert d.flush() == tok.decode(ids[:-1])[1:]  # the dangling bytes, as U+FFFD
    assert d.flush() == "" and d.add([]) == ""
