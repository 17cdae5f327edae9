"""Calling transformers models the way the installed transformers expects (pyproject allows >=5.17,<6).

transformers renamed the forward keyword of the KV cache from `past_key_values` to `cache` (5.24 has
`cache` and warns on every call that passes `past_key_values`, which it removes in 5.40; 5.17 knows
only `past_key_values`). The keyword is read once from the model's forward signature, at load time,
and every call site passes the cache through `cache_kwargs`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

NEW, OLD = "cache", "past_key_values"


def cache_kwarg(model: Any) -> str:
    """The name of the KV-cache keyword of `model.forward`: "cache" or "past_key_values".

    `inspect.signature` follows the `__wrapped__` chain of transformers' decorators (including the one
    that still accepts the old name), so it sees the forward's own parameters.
    """
    params = inspect.signature(model.forward).parameters
    if NEW in params:
        return NEW
    if OLD in params:
        return OLD
    raise TypeError(f"{type(model).__name__}.forward takes neither `{NEW}` nor `{OLD}`: not a causal LM with a KV cache")


def cache_kwargs(model_or_name: Any, cache: Any) -> dict[str, Any]:
    """`{keyword: cache}` for a forward call; pass a name from `cache_kwarg` on hot paths."""
    name = model_or_name if isinstance(model_or_name, str) else cache_kwarg(model_or_name)
    return {name: cache}


@functools.lru_cache(maxsize=None)
def keeps_recurrent_states() -> bool:
    """Whether this transformers' caches can roll a linear-attention / state-space layer's recurrent state back after
    rejected tokens (`activate_past_recording(recurrent_states_to_keep=N)`, transformers >= 5.25; before it, `crop`
    restores their convolution states alone)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return "recurrent_states_to_keep" in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters


STATELESS_BLOCKS = ("moe", "mlp")  # layer types of a hybrid's blocks that keep no state across tokens (Nemotron-H)


def new_session_cache(config: Any, max_block: int):
    """A DynamicCache for one session that can drop a verify block's rejected tokens (`crop(-n)`): sliding-window
    layers keep what they would evict, linear-attention / state-space layers (Qwen3-Next, Jamba, ...) the recurrent
    state after each of a block's last `max_block` tokens where this transformers can (`keeps_recurrent_states`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if keeps_recurrent_states():
        cache.activate_past_recording(recurrent_states_to_keep=max_block)
    else:
        cache.activate_past_recording()
    # A hybrid's blocks without attention or a recurrence (Nemotron-H's "moe" / "mlp") hold nothing; transformers < 5.25
    # gives them a linear-attention layer anyway, whose crop then fails on its never-set convolution width
    types = list(getattr(config.get_text_config(), "layer_types", None) or [])
    for i, layer in enumerate(cache.layers):
        if i < len(types) and types[i] in STATELESS_BLOCKS:
            layer.crop = lambda n: None
    return cache


def plain_attention_cache(cache: Any) -> bool:
    """Whether every layer of `cache` holds keys and values alone (full or sliding-window attention), which `crop`
    is known to roll back; False for a cache with linear-attention / state-space layers or of a model's own class."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    return type(cache) is DynamicCache and all(
        isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)
