"""The stub's tokenizers: UTF-8 bytes by default, or a real tokenizer.json through the `tokenizers` package.

Both have what the drafter's incremental detokenizer (drafter_svc.tokens) calls: `decode(ids,
skip_special_tokens=...)`, plus `encode_ids(text)` for prompts and scripted text. Neither needs torch or
transformers; `tokenizers` is optional (the serving extra has it) and only imported for a tokenizer file.
"""

from __future__ import annotations

import pathlib

from pdflash.config import ConfigError


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255). Any other id decodes as `<id>`, so echoed prompt_tokens of a
    real model's vocabulary still read as something."""

    vocab_size = 256

    def encode_ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """A conversation as the stub's chat format (ChatML's text markers, the assistant's turn opened), as bytes: so
        clients that send `messages` can be tested against the stub (an echo script streams this text back)."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode_ids(text + "<|im_start|>assistant\n")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(f"<{t}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class FileTokenizer:
    """A Hugging Face tokenizer.json (the file, or a checkpoint directory holding it). No chat template (`chat_ids` is
    None): `messages` are refused, as by a model without one."""

    chat_ids = None

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(f"--tokenizer {path!r}: needs the `tokenizers` package (pip install tokenizers, "
                              "or pdflash's serving extra)") from None
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"--tokenizer {path!r}: no tokenizer.json there")
        self.path = str(p)
        self._tok = Tokenizer.from_file(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode_ids(self, text: str) -> list[int]:
        # As the drafter tokenizes a prompt: transformers' fast tokenizer, add_special_tokens=True.
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load(path: str) -> ByteTokenizer | FileTokenizer:
    return FileTokenizer(path) if path else ByteTokenizer()
