"""Every forward we make passes the KV cache under the keyword the installed transformers expects
(pdflash/hf_compat.py): `cache` where the forward takes it (5.24 warns on `past_key_values` and drops it in
5.40), `past_key_values` where that is all it knows (5.17). No call of ours warns, and the cache really
reaches the model (the cached decodings equal transformers' own `generate`)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

from pdflash.hf_compat import cache_kwarg, cache_kwargs
from pdflash.tiny import ARCHITECTURES
from pdflash.types import DraftResult, SamplingParams
from tests.conftest import DEVICE, DTYPE
from verifier_svc.engine import PrefillInput, VerifierCore
from verifier_svc.model import load_target

PROMPT = [11, 52, 7, 300, 41, 99, 5, 17]


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_call_site_passes_the_cache_the_installed_way_without_warnings(tiny, arch):
    from training.common import greedy_generate
    from training.eval_acceptance import run_loop

    target = load_target(tiny.target(arch), DEVICE, DTYPE)
    params = inspect.signature(target.model.forward).parameters
    assert target.cache_arg in params
    assert target.cache_arg == ("cache" if "cache" in params else "past_key_values")
    want = hf_greedy(target.model, PROMPT, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword (FutureWarning) would raise here
        core = VerifierCore(target, max_block_size=8)  # verifier_svc/engine.py `_forward`
        o = core.prefill(PrefillInput("r", tuple(PROMPT), SamplingParams(), 12, ignore_eos=True))
        got = list(o.tokens)
        rnd = 0
        while o.finished is None:
            rnd += 1
            o = core.verify(DraftResult(o.session_id, rnd, (got[-1], *want[len(got):len(got) + 3]), {}, 0))
            got += o.tokens
        trained = greedy_generate(target.model, torch.tensor([PROMPT]), 12)[0].tolist()  # training/common.py
        looped, _ = run_loop(target.model, None, PROMPT, 12, 4, "ngram", mask_id=1, eos_id=-1)  # training/eval_acceptance.py
    assert got == want and trained == want and looped == want


def test_benchmark_forward_cost_passes_the_cache_the_installed_way():
    from transformers import AutoModelForCausalLM

    from benchmarks.replay import forward_cost
    from pdflash.defaults import default_target_dir

    model = AutoModelForCausalLM.from_pretrained(str(default_target_dir()), dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cost = forward_cost(model, widths=(1, 2))
    assert set(cost) == {1, 2} and all(ms > 0 for ms in cost.values())


class _OldStyle(nn.Module):
    """The forward signature transformers 5.17 gives its causal LMs (the KV cache as `past_key_values`)."""

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


class _NoCache(nn.Module):
    def forward(self, x):
        return x


def test_the_keyword_is_read_from_the_forward_signature():
    assert cache_kwarg(_OldStyle()) == "past_key_values"
    assert _OldStyle()(**cache_kwargs(_OldStyle(), "kv")) == "kv"
    assert cache_kwargs("cache", 1) == {"cache": 1}
    with pytest.raises(TypeError, match="neither"):
        cache_kwarg(_NoCache())


def test_no_package_of_ours_shadows_a_dependency():
    """Our top-level import names are not another installed distribution's: transformers 5.25 requires the hub's
    `kernels` package and imports it at `import transformers...activations`, so a top-level `kernels` of ours (the
    name the Triton kernels had until stop 35) made every model import fail. Now they are `pdflash_kernels`. The same
    for the scripts of benchmarks/: `python benchmarks/X.py` puts that folder first on sys.path, so its file names are
    import names too (benchmarks/kernels.py is now kernel_bench.py)."""
    import importlib
    import importlib.metadata as md
    import pathlib

    ours = {"pdflash", "pdflash_kernels", "drafter_svc", "scheduler_svc", "verifier_svc", "training"}
    ours |= {p.stem for p in (pathlib.Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")}
    owners = md.packages_distributions()
    clashes = {name: owners[name] for name in sorted(ours) if set(owners.get(name, [])) - {"pdflash"}}
    assert not clashes, f"import names of ours also installed by other distributions: {clashes}"
    importlib.import_module("transformers.activations")  # imports the hub's `kernels` where it is installed
    importlib.import_module("transformers.integrations.hub_kernels")
