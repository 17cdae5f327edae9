"""Repetition, presence and frequency penalties as one pure function over logits, shared by the verifier (which applies
them to the target's logits: the output's definition) and the drafter (which applies the same rule to its own logits,
so that its drafts guess the penalized target's tokens). No model, no grpc.

Semantics: `repetition_penalty` is transformers' RepetitionPenaltyLogitsProcessor over the prompt and the output so far
(a seen token's logit divided by it when positive, multiplied when negative); `frequency_penalty` subtracts the token's
count in the output so far times the penalty, `presence_penalty` the penalty once if it occurs in the output (OpenAI's).
"""

from __future__ import annotations

import torch

from pdflash.types import SamplingParams


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> penalized float32 logits (a new tensor; the caller's stay as they are).

    counts: [R, V] (or [V], broadcast) float32, each token's count in the output so far, row by row;
    seen: [R, V] (or [V]) bool, the tokens of the prompt and the output so far (repetition penalty's set)."""
    s = sampling
    x = logits.float()
    if s.repetition_penalty != 1.0:
        pen = torch.where(x < 0, x * s.repetition_penalty, x / s.repetition_penalty)
        x = torch.where(seen | (counts > 0), pen, x)
    if s.frequency_penalty != 0.0:
        x = x - s.frequency_penalty * counts
    if s.presence_penalty != 0.0:
        x = x - s.presence_penalty * (counts > 0).float()
    return x


class Penalties:
    """The prompt and the output so far of a session that asked for penalties (SamplingParams.penalized), on the
    logits' device, and the penalties applied to a block's logits.

    The verifier's `apply`: row i of a verify block [anchor, d1..dk] scores the token after d_i, so it sees the output
    so far plus d1..di (as plain decoding would have, had those drafts been its tokens). The drafter's `greedy_drafts`:
    the same rule on its own logits, drafting one token after another, so that drafts equal to the penalized target's
    choices get accepted."""

    def __init__(self, sampling: SamplingParams, prompt: list[int], vocab: int, device: torch.device | str):
        self.sampling = sampling
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # output tokens so far, per id
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # prompt and output tokens
        if prompt:
            self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def apply(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] logits of a verify block -> penalized float32 (a new tensor)."""
        rows, vocab = logits.shape
        counts = self.counts.expand(rows, vocab).clone()
        if drafts:
            d = torch.tensor(drafts[: rows - 1], dtype=torch.long, device=logits.device)
            step = torch.zeros(rows, vocab, dtype=torch.float32, device=logits.device)
            step[torch.arange(1, len(d) + 1, device=logits.device), d] = 1.0
            counts += step.cumsum(0)
        return penalize(logits, counts, self.seen, self.sampling)

    def emitted(self, tokens: list[int]) -> None:
        """Tokens that joined the output, each counted once."""
        if tokens:
            t = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, t, torch.ones(len(tokens), dtype=torch.float32, device=t.device))
            self.seen[t] = True

    def greedy_drafts(self, logits: torch.Tensor, anchor: int) -> list[int]:
        """[k, V] draft logits (row j scores the token after the anchor and drafts 1..j) -> k greedy drafts under the
        penalties. One device->host copy at the end."""
        out = self.sequential(logits, anchor, lambda row, j: row.argmax(dim=-1))
        return torch.cat(out).tolist() if out else []

    def sequential(self, logits: torch.Tensor, anchor: int, pick) -> list:
        """Drafts one after another under the penalties: row j of [k, V] draft logits penalized with the output so far
        plus the anchor (emitted, not yet `emitted` here) and drafts 1..j-1, then `pick(row [1, V], j)` chooses draft
        j (a token id, or a 1-element tensor on the device: no copy). Nothing of the state changes."""
        counts, seen = self.counts.clone(), self.seen.clone()
        one = torch.ones(1, dtype=torch.float32, device=counts.device)
        last = torch.tensor([anchor], dtype=torch.long, device=counts.device)
        out = []
        for j in range(logits.shape[0]):
            counts.index_add_(0, last, one)  # the previous token (the anchor, then each draft) joins the output
            seen.index_fill_(0, last, True)
            tok = pick(penalize(logits[j : j + 1], counts, seen, self.sampling), j)
            out.append(tok)
            last = tok if isinstance(tok, torch.Tensor) else torch.tensor([tok], dtype=torch.long, device=counts.device)
        return out
