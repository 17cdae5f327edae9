"""gpt-oss checkpoints in their published MXFP4 form (config `quantization_config: {"quant_method": "mxfp4"}`, experts
as `*_blocks`/`*_scales` + bf16 biases): `--experts mxfp4` fills the host store with the checkpoint's bytes as they are
(layer by layer, no bf16 round trip), offloaded == resident, both close to transformers' own forward of the
dequantized weights; `--experts native` is transformers' dequantization; a bad checkpoint fails at load in one line
naming the tensor. Float checkpoints read layer by layer give the same model as transformers' loader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdflash_kernels import mxfp4
from pdflash_kernels.installer import experts_modules
from pdflash.tiny import make_tiny_checkpoint
from tests.conftest import DEVICE, DTYPE

BIG = 1.0  # GiB: every expert of the tiny model cached
EXPERTS = "model.layers.{}.mlp.experts.{}"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gptoss-mxfp4"), "gpt_oss", mxfp4=True)


def _tensors(d) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _load(d, cache_gb=BIG, **kw):
    from verifier_svc.model import load_target

    return load_target(d, DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=cache_gb, **kw)


def _core(target):
    from verifier_svc.engine import VerifierCore

    return VerifierCore(target, max_block_size=8)


def test_the_tiny_checkpoint_is_in_gpt_oss_published_form(native):
    cfg = json.loads((native / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    t = _tensors(native)
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        k = lambda n: EXPERTS.format(layer, n)  # noqa: E731
        assert t[k("gate_up_proj_blocks")].shape == (e, 2 * i, h // 32, 16) and t[k("gate_up_proj_blocks")].dtype == torch.uint8
        assert t[k("gate_up_proj_scales")].shape == (e, 2 * i, h // 32) and t[k("gate_up_proj_scales")].dtype == torch.uint8
        assert t[k("down_proj_blocks")].shape == (e, h, i // 32, 16) and t[k("down_proj_scales")].shape == (e, h, i // 32)
        assert t[k("gate_up_proj_bias")].dtype == t[k("down_proj_bias")].dtype == torch.bfloat16
        assert k("gate_up_proj") not in t and k("down_proj") not in t


def test_experts_native_is_transformers_dequantization_of_the_checkpoint(native):
    """--experts native: transformers dequantizes (fp32 here), exactly the values the blocks/scales encode."""
    from verifier_svc.model import load_target

    target = load_target(native, DEVICE, DTYPE)
    t = _tensors(native)
    for layer, m in experts_modules(target.model).items():
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = mxfp4.from_gpt_oss(t[EXPERTS.format(layer, f"{proj}_blocks")], t[EXPERTS.format(layer, f"{proj}_scales")])
            want = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)  # the module holds [E, in, out]
            assert torch.equal(getattr(m, proj), want), (layer, proj)


def test_the_store_holds_the_checkpoint_bytes_and_no_expert_is_ever_float(native):
    target = _load(native)
    store = target.expert_cache.store
    t = _tensors(native)
    assert target.byte_map == store.byte_map() and target.experts_format == "mxfp4"
    assert set(target.byte_map) == {0, 1} and all(b == [store.slice_bytes] * 8 for b in target.byte_map.values())
    for layer, module in experts_modules(target.model).items():
        assert sum(p.numel() for p in module.parameters()) == 0  # the store holds them, nothing else does
        k = lambda n: t[EXPERTS.format(layer, n)]  # noqa: E731
        for e in range(8):
            v = store.layout.views(store.slice(layer, e).reshape(1, -1))
            assert torch.equal(v["w1_blocks"][0], k("gate_up_proj_blocks")[e].flatten(1))
            assert torch.equal(v["w1_scales"][0], k("gate_up_proj_scales")[e])
            assert torch.equal(v["w2_blocks"][0], k("down_proj_blocks")[e].flatten(1))
            assert torch.equal(v["w2_scales"][0], k("down_proj_scales")[e])
            assert torch.equal(v["b1"][0], k("gate_up_proj_bias")[e]) and torch.equal(v["b2"][0], k("down_proj_bias")[e])
    sd = target.model.state_dict()  # every other weight as the checkpoint stores it
    for key, val in t.items():
        if ".mlp.experts." not in key:
            assert torch.equal(sd[key], val.to(sd[key].dtype)), key


def _greedy_reference(native, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own forward of the dequantized model (float32, its eager experts): greedy tokens, no KV cache,
    and the logits of the prompt's last position."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(native, dtype=getattr(torch, DTYPE), quantization_config=Mxfp4Config(dequantize=True))
    # transformers 5.17 (the GPU image's) dequantizes to bf16 whatever the dtype asked, on a CPU without its kernels: MXFP4 values
    # are exact in bf16 (E2M1 times a power of two), so the cast gives the very dequantized weights in DTYPE
    model = model.to(device=DEVICE, dtype=getattr(torch, DTYPE)).eval()
    ids, first = list(prompt), None
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], first


def test_offloaded_equals_resident_and_transformers_reference(native, monkeypatch):
    """Greedy with a cache of 9 of the 16 experts (evicting every forward) == every expert cached, on the checkpoint's
    own bytes; both == transformers' float32 forward of the dequantized weights token for token here, and the logits
    agree to 2e-2 of their range (our experts round to bf16 after each projection, as the kernels do; transformers
    stays in float32)."""
    import tests.test_gpu_verifier as drive
    from tests.test_gpu_verifier import _no_drafts, _replay, _run

    monkeypatch.setattr(drive, "NEW", 16)
    full = _core(_load(native))
    small = _core(_load(native, 9.5 * full.target.expert_cache.store.slice_bytes / 2**30))
    cache = small.target.expert_cache
    assert cache.num_slots == 9
    prompt = list(range(3, 40))
    want = _run(full, prompt, _no_drafts)
    assert _run(small, prompt, _no_drafts) == want
    assert _run(small, prompt, _replay(want, 3, small.target.vocab_size), width=8) == want
    assert cache.stats.evictions > 0 and cache.stats.bytes_moved == (cache.stats.misses + cache.stats.prefetched) * cache.store.slice_bytes
    ref, ref_logits = _greedy_reference(native, prompt, len(want))
    assert want == ref
    with torch.inference_mode():
        ours = full.target.model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
    span = float(ref_logits.max() - ref_logits.min())
    assert float((ours - ref_logits).abs().max()) <= 2e-2 * span


def _broken(native, tmp_path, edit) -> object:
    d = tmp_path / "broken"
    shutil.copytree(native, d)
    t = _tensors(native)
    edit(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("edit,names", [
    (lambda t: t.pop(EXPERTS.format(1, "down_proj_scales")), "model.layers.1.mlp.experts.down_proj_scales"),
    (lambda t: t.update({EXPERTS.format(0, "gate_up_proj_blocks"): t[EXPERTS.format(0, "gate_up_proj_blocks")][:, :64].contiguous()}),
     "model.layers.0.mlp.experts.gate_up_proj_blocks"),
    (lambda t: t.update({EXPERTS.format(0, "down_proj_scales"): t[EXPERTS.format(0, "down_proj_scales")].float()}),
     "model.layers.0.mlp.experts.down_proj_scales"),
    (lambda t: t.pop("model.layers.1.self_attn.sinks"), "model.layers.1.self_attn.sinks"),
], ids=["scales-missing", "blocks-shape", "scales-dtype", "other-missing"])
def test_a_bad_checkpoint_fails_at_load_in_one_line_naming_the_tensor(native, tmp_path, edit, names):
    d = _broken(native, tmp_path, edit)
    with pytest.raises(ValueError) as err:
        _load(d)
    msg = str(err.value)
    assert names in msg and "\n" not in msg, msg


def test_float_checkpoints_read_layer_by_layer_equal_transformers_loader(tiny):
    """qwen3_moe (one tensor per expert) and gpt_oss (fused): the direct reader gives the very weights, buffers and
    store of transformers' loader followed by quantizing the loaded model."""
    from transformers import AutoModelForCausalLM

    from verifier_svc.expert_store import HostExpertStore

    for arch in ("qwen3_moe", "gpt_oss"):
        target = _load(tiny.target(arch))
        ref = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=getattr(torch, DTYPE)).to(DEVICE)
        want = HostExpertStore.from_model(ref)
        assert torch.equal(target.expert_cache.store.arena, want.arena), arch
        ours = dict(target.model.named_parameters()) | dict(target.model.named_buffers())
        for name, t in list(ref.named_parameters()) + list(ref.named_buffers()):
            if ".mlp.experts." not in name:
                assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), (arch, name)
        assert target.model.config._attn_implementation == ref.config._attn_implementation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_direct_reader_keeps_transformers_dtypes(native, dtype):
    """gpt-oss keeps its norms in float32 under fp16 (transformers' keep-in-fp32 rule): the same dtypes and values."""
    from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

    from verifier_svc.checkpoint import plan

    direct = plan(native, AutoConfig.from_pretrained(native), dtype)
    direct.load_rest()
    ref = AutoModelForCausalLM.from_pretrained(native, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True))
    ours = dict(direct.model.named_parameters())
    for name, t in ref.named_parameters():
        if ".mlp.experts." not in name:
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_resident_mxfp4_kernels_read_the_checkpoint_bytes(native):
    """--experts mxfp4 without a cache (the kernels, here under Triton's interpreter): each layer's kernel weights are
    the checkpoint's bytes in one arena; the byte map is its slices."""
    from pdflash_kernels import runtime

    if not runtime.triton_usable("cpu"):
        pytest.skip("needs triton (its CPU interpreter)")
    from verifier_svc.model import load_target

    target = load_target(native, DEVICE, DTYPE, kernels="on", experts="mxfp4")
    t = _tensors(native)
    assert target.experts_format == "mxfp4"
    for layer, module in experts_modules(target.model).items():
        w = module._pdflash_weights
        assert torch.equal(w.w1, t[EXPERTS.format(layer, "gate_up_proj_blocks")].flatten(2))
        assert torch.equal(w.s2, t[EXPERTS.format(layer, "down_proj_scales")])
        assert target.byte_map[layer] == [target.byte_map[layer][0]] * 8 and target.byte_map[layer][0] % 256 == 0
