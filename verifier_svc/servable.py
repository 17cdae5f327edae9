"""Load-time checks that the verifier serves a model exactly, for architectures nobody listed.

Verification drops the rejected drafts of every block from the session's KV; the paged forward (verifier_svc.runner)
replaces transformers' cache with pdflash's pages. Both are checked on a few tokens at load against the model's own
forward, so an architecture whose cache cannot drop tokens is refused with one line before health turns SERVING, and
one whose layers the paged forward does not fit (DeepSeek's multi-head latent attention caches a compressed latent, not
keys and values per head) is served on transformers' cache instead, saying why, rather than failing at the first request
or, worse, answering with other tokens than the model's.
"""

from __future__ import annotations

import torch

from pdflash.hf_compat import keeps_recurrent_states, new_session_cache, plain_attention_cache

# a rollback or paged forward that is right differs from the model's own forward by rounding; a wrong one by what one
# token more or less of context changes (the whole logit scale)
TOLERANCE = 0.05


def _probe_ids(vocab_size: int) -> list[int]:
    return [(7 + 131 * i) % vocab_size for i in range(7)]


def _last_logits(out) -> torch.Tensor:
    return out.logits[0, -1].float()


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def rollback_error(model, cache_arg: str, max_block: int, device: torch.device) -> str | None:
    """None when a session's cache (`new_session_cache`) drops a block's rejected tokens as if they had never been
    forwarded, else why not. Caches of keys and values alone (full and sliding-window attention) are known to, and are
    not probed; others (linear-attention / state-space layers, a model's own cache class) run 3 tokens, a block of 3
    whose last 2 are rejected, and 1 more, against the same 5 tokens in one forward."""
    config = model.config
    try:
        if plain_attention_cache(new_session_cache(config, max_block)):
            return None
    except Exception as e:  # noqa: BLE001 - a config transformers' DynamicCache cannot hold
        return f"{type(e).__name__}: {e}"
    ids = _probe_ids(int(config.get_text_config().vocab_size))

    def run(*chunks, crop_after_first_block: int = 0) -> torch.Tensor:
        cache = new_session_cache(config, max_block)
        out = None
        for i, chunk in enumerate(chunks):
            out = model(input_ids=torch.tensor([chunk], device=device), use_cache=True, **{cache_arg: cache})
            if i == 1 and crop_after_first_block:
                cache.crop(-crop_after_first_block)
        return _last_logits(out)

    from pdflash_kernels.installer import experts_stubbed

    try:  # (experts served by the kernels stubbed, as in paged_error: no expert cache is touched before serving)
        with torch.inference_mode(), experts_stubbed():
            got = run(ids[:3], ids[3:6], [ids[6]], crop_after_first_block=2)
            ref = run(ids[:4] + [ids[6]])
            kept = run(ids[:6] + [ids[6]])  # what a cache that dropped nothing would give
    except Exception as e:  # noqa: BLE001 - the model refuses the cache or its crop
        return f"{type(e).__name__}: {e}".splitlines()[0]
    err, gap = _relative_error(got, ref), _relative_error(kept, ref)
    if err > TOLERANCE * max(gap, 1e-3) and err > 1e-4:
        hint = ("" if keeps_recurrent_states() else
                "; its linear-attention / state-space layers' recurrent state rolls back with transformers >= 5.25 "
                "(upgrade transformers)" + _kernel_hint(model))
        return (f"dropping rejected tokens from its cache leaves them in its state (logits {err:.2g} off the model's "
                f"own, {gap:.2g} with nothing dropped){hint}")
    return None


def _kernel_hint(model) -> str:
    """For a model whose linear-attention layers pdflash's kernels serve (Gated DeltaNet, Kimi Delta Attention) and are
    not installed: that the kernels would roll them back on this transformers."""
    from pdflash_kernels import gdn

    bare = [m for m in model.modules() if gdn.layer_forward(m) is not None and "forward" not in vars(m)]
    if not bare:  # (none, or the kernels' forwards already installed)
        return ""
    return ", or serve it with the kernels (a GPU, --kernels auto), whose linear-attention layers roll back themselves"


def paged_error(runner, pool, model, cache_arg: str, device: torch.device) -> str | None:
    """None when the paged forward (`runner`) gives the model's own logits (to rounding) for 4 tokens and then 3 more
    on a scratch sequence of `pool`, else why not. Experts are stubbed (verifier_svc.prenorm's probes do the same): the
    check is of attention and the KV, and touches no expert cache."""
    from pdflash_kernels.installer import experts_stubbed
    from verifier_svc.kv import SequenceKV
    from pdflash_kernels.attention import PAGE

    ids = _probe_ids(int(model.config.get_text_config().vocab_size))
    seq = SequenceKV(pool, PAGE)
    try:
        with torch.inference_mode(), experts_stubbed():
            runner.forward(ids[:4], 0, seq)
            got = runner.forward(ids[4:], 4, seq).logits[len(ids) - 4 - 1].float()  # (its rows: the 3 tokens')
            ref = _last_logits(model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                                     **{cache_arg: new_session_cache(model.config, 8)}))
    except Exception as e:  # noqa: BLE001 - a layer the paged cache does not fit
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    finally:
        seq.free()
    err = _relative_error(got, ref)
    if not err <= TOLERANCE:
        return f"its logits are {err:.2g} off the model's own forward"
    return None
