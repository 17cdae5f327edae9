"""Lossless acceptance rules (REFERENCE.md section 3). Pure functions over logits; no model, no grpc.

Greedy: accept drafts while each equals the target's argmax at its position, then emit the target's
own token (the correction at the first mismatch, or the bonus after a full accept).
Sampling with a deterministic draft x: accept with probability p(x); on rejection sample from p with x
removed and renormalised. With a sampled draft x ~ q (the drafter sends q): accept with min(1, p(x) / q(x)); on
rejection sample from max(0, p - q) renormalised. The emitted tokens are then distributed exactly as the target's
samples. p is `pdflash.sampler.target_probs`.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """logits [len(drafts) + 1, V]: row i predicts the token after block position i.

    Returns (number of drafts accepted, the target's next token).
    """
    argmax = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n, int(argmax[n])


def accept_sampled(drafts: list[int], probs: torch.Tensor, generator: torch.Generator, dists=()) -> tuple[int, int]:
    """probs [len(drafts) + 1, V] from `target_probs`. Returns (accepted drafts, next token). `generator` lives on
    probs' device (torch.multinomial on CUDA probabilities refuses a CPU generator).

    dists: () for deterministic drafts (q one-hot on each draft: accept with p(x), else sample p without x), or one
    DraftDistribution per draft, the q it was drawn from (accept with min(1, p(x) / q(x)), else sample max(0, p - q)
    renormalized): either way the emitted tokens follow p."""
    n = 0
    for i, d in enumerate(drafts):
        p = probs[i]
        q = _dense(dists[i], p) if dists else None
        p_d = float(p[d])
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u * q_d < p_d:
            n += 1
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p.double() - q).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p was one-hot on d (or equal to q) up to rounding: accept
            n += 1
            continue
        tok = int(torch.multinomial(residual / total, 1, generator=generator))
        return n, tok
    tok = int(torch.multinomial(probs[n], 1, generator=generator))
    return n, tok


def _dense(q, like: torch.Tensor) -> torch.Tensor:
    """A DraftDistribution as a float64 row of `like`'s size and device: probs / sum(probs) at ids, 0 elsewhere."""
    probs = torch.tensor(q.probs, dtype=torch.float64)
    row = torch.zeros(like.shape[-1], dtype=torch.float64, device=like.device)
    row[torch.tensor(q.ids, dtype=torch.long, device=like.device)] = (probs / probs.sum()).to(like.device)
    return row
