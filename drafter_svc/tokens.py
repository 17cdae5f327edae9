"""Incremental detokenization: token ids in, new text out, correct across split UTF-8 characters.

Two offsets into the ids (as in TGI): `prefix` marks the start of a short window already emitted and
`read` the end of what has been emitted. Each step decodes the window with and without the new ids
and emits the difference, so a decoder's context-dependent output (leading spaces, byte-level
merges) matches a decode of the whole sequence. Text that ends in U+FFFD is an incomplete multi-byte
character: it is held back until a later token completes it, or until `flush` at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT = "\ufffd"
# How many already-emitted ids of a prompt to keep as decoding context for the first new ones.
PROMPT_CONTEXT = 5


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - one line that names the checkpoint (pdflash.server.failure_reason)
        raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e


class IncrementalDetokenizer:
    """Feed ids with `add` (returns the new text, possibly ""); call `flush` once at the end."""

    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only ids from `prefix` on are kept; earlier ones are never decoded again.
        self._ids = [int(t) for t in prompt_ids][-PROMPT_CONTEXT:]
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        if len(self._ids) == self._read:
            return ""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT):
            return ""
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD here)."""
        if len(self._ids) == self._read:
            return ""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(emitted) :] if text.startswith(emitted) else text
