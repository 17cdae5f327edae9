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


class StopSequences:
    """Stop sequences over streamed text. `feed(text)` -> (the text that can go out now, the stop sequence that ended
    the text or None). The text is cut before the first stop sequence completed, the one that ends first (of two
    ending together, the longer): where decoding that checked the text after each token would have stopped, whatever
    the pieces the text comes in. Until then the longest end of the text that begins a stop sequence is held back
    (it may still become one); `flush` returns it when the text ends without a stop."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        if not self.stops or any(not s for s in self.stops):
            raise ValueError("stop sequences must be non-empty strings")
        self._pending = ""
        self.matched: str | None = None

    def _held(self) -> int:
        """How many characters at the end of the pending text begin a stop sequence (the longest such end)."""
        p = self._pending
        for k in range(min(len(p), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(p[-k:]) for s in self.stops if len(s) > k):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        self._pending += text
        best = None
        for s in self.stops:
            i = self._pending.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
                best = (i, s)
        if best is not None:
            out, self._pending, self.matched = self._pending[: best[0]], "", best[1]
            return out, self.matched
        cut = len(self._pending) - self._held()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class TextStream:
    """A request's generated ids -> the ids and text to stream: incremental detokenization, then the stop sequences
    (none: the ids pass as they come)."""

    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), stops: Iterable[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        stops = tuple(stops)
        self.stops = StopSequences(stops) if stops else None

    def add(self, token_ids: Iterable[int]) -> tuple[list[int], str, str | None]:
        """(the ids to send, their text, the stop sequence that ended the text or None). With a stop, the ids end with
        the one whose text completed it; nothing is sent after that."""
        ids = [int(t) for t in token_ids]
        if self.stops is None:
            return ids, self.detok.add(ids), None
        if self.stops.matched is not None:
            return [], "", self.stops.matched
        parts = []
        for n, t in enumerate(ids, 1):
            text, hit = self.stops.feed(self.detok.add([t]))
            parts.append(text)
            if hit is not None:
                return ids[:n], "".join(parts), hit
        return ids, "".join(parts), None

    def finish(self) -> tuple[str, str | None]:
        """At the end of the ids: (the text held back, the stop sequence it completed or None)."""
        text = self.detok.flush()
        if self.stops is None:
            return text, None
        if self.stops.matched is not None:
            return "", self.stops.matched
        out, hit = self.stops.feed(text)
        return (out, hit) if hit is not None else (out + self.stops.flush(), None)
