"""The target's sampler as a pure function over logits (temperature, top-k, top-p), shared by the verifier (its
acceptance rules draw from it: the output's definition) and the drafter (which draws sampled drafts from the same
warpers on its own logits, so its distribution q is close to the target's p). No model, no grpc."""

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
