"""Train the byte-level BPE tokenizer on the target-train stdlib files.

    python -m training.tokenizer --out runs/demo/target [--vocab-size 4096]

Writes tokenizer.json + tokenizer_config.json (AutoTokenizer loads them), with `<|endoftext|>` (id 0;
also the pad token) and `<|mask|>` (id 1, the DFlash drafter's mask token).
"""

from __future__ import annotations

import argparse
import pathlib
import time

from training.corpus import EOS, MASK, load_split


def train_tokenizer(texts: list[str], out_dir: str | pathlib.Path, vocab_size: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK)
    fast.save_pretrained(str(out_dir))
    return fast


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-files", type=int, default=None, help="smoke runs: use at most this many files per part")
    args = ap.parse_args(argv)
    t0 = time.time()
    split = load_split(max_files=args.max_files)
    texts = split.texts("train")
    tok = train_tokenizer(texts, args.out, args.vocab_size)
    n = sum(len(x) for x in tok(texts[:200], add_special_tokens=False)["input_ids"])
    b = sum(len(t.encode()) for t in texts[:200])
    print(f"tokenizer: {len(tok)} tokens from {len(texts)} files, {b / max(n, 1):.2f} bytes/token, "
          f"{time.time() - t0:.1f}s -> {args.out}")


if __name__ == "__main__":
    main()
