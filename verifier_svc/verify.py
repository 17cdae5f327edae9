"""Lossless acceptance rules (REFERENCE.md section 3). Pure functions over logits; no model, no grpc.

Greedy: accept drafts while each equals the target's argmax at its position, then emit the target's
own token (the correction at the first mismatch, or the bonus after a full accept).
Sampling with a deterministic draft x: accept with probability p(x); on rejection sample from p with x
removed and renormalised. The emitted tokens are then distributed exactly as the target's samples.
"""

from __future__ import annotations

import torch

from pdflash.types import SamplingParams


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[T, V] logits -> [T, V] probabilities of the target's sampler.

    Same order as transformers' warpers for `generate(do_sample=True)`: temperature, top-k, top-p.
    """
    x = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - sampling.top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return x.softmax(dim=-1)


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """logits [len(drafts) + 1, V]: row i predicts the token after block position i.

    Returns (number of drafts accepted, the target's next token).
    """
    argmax = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n, int(argmax[n])


def accept_sampled(drafts: list[int], probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """probs [len(drafts) + 1, V] from `target_probs`. Returns (accepted drafts, next token). `generator` lives on
    probs' device (torch.multinomial on CUDA probabilities refuses a CPU generator)."""
    n = 0
    for i, d in enumerate(drafts):
        p = probs[i]
        p_d = float(p[d])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u < p_d:
            n += 1
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was one-hot on d up to rounding: accept
            n += 1
            continue
        tok = int(torch.multinomial(residual / total, 1, generator=generator))
        return n, tok
    tok = int(torch.multinomial(probs[n], 1, generator=generator))
    return n, tok
