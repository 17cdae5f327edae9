"""The direct checkpoint load (`verifier_svc.checkpoint.plan`) of checkpoints whose tensor names transformers renames at
load by plain renamings (Nemotron-H's `backbone.` -> `model.`, Granite's `block_sparse_moe.input_linear.weight` ->
`...experts.gate_up_proj`, ERNIE-4.5's `moe_statics`): read under the model's names, it gives the model and the MXFP4
store that transformers' own load followed by quantizing the loaded experts gives, byte for byte."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version


@pytest.mark.parametrize("arch", ["nemotron_h", "granitemoe", "ernie4_5_moe"])
def test_a_renamed_checkpoint_loads_directly_as_transformers_loads_it(arch, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdflash.tiny import make_tiny_checkpoint
    from verifier_svc.checkpoint import DirectLoad, plan
    from verifier_svc.model import load_target, offload_experts

    d = make_tiny_checkpoint(tmp_path / arch, arch)
    direct = plan(d, AutoConfig.from_pretrained(d), torch.float32)
    if Version(transformers.__version__) >= Version("5.25"):  # (older ones lack some renamings: their load falls back to
        # transformers' own, then quantizes, which must give the same model and store all the same)
        assert isinstance(direct, DirectLoad), direct
        assert any(name != key for name, key in direct.tensors.stored.items())  # (some names are transformers' renames)
    target = load_target(d, "cpu", experts="mxfp4", expert_cache_gb=1.0)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    store = offload_experts(model, torch.device("cpu"), 1.0).store
    assert store.layout == target.expert_cache.store.layout
    assert torch.equal(store.arena, target.expert_cache.store.arena)
    got = {k: v for k, v in target.model.state_dict().items() if v.numel()}  # (experts: zero-size, in the store)
    want = {k: v for k, v in model.state_dict().items() if v.numel()}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
