"""Block-scaled FP8 checkpoints (DeepSeek-V3's and Kimi K2's published form) read directly: `--experts mxfp4` reads
every quantized weight with its per-block `weight_scale_inv`, dequantizes it (non-expert weights to the model's dtype,
experts exactly, then to MXFP4 in the host store) one layer of experts at a time, as it reads float checkpoints. The
reference is the same checkpoint dequantized to float32 tensors and read by the float path."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import DEVICE, DTYPE

BLOCK = (16, 16)  # DeepSeek ships 128 x 128; tiny widths need a smaller block to have several, and partial ones
FP8_MAX = 448.0


def _quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (float8 e4m3 weight, float32 scale_inv [ceil(rows/bn), ceil(cols/bk)]) as DeepSeek's
    checkpoints hold it: each block scaled so that its largest magnitude is FP8's largest."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(gr, gc)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
    s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w.float() / s).to(torch.float8_e4m3fn), scale


def _checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepSeek's published names: one gate/up/down weight per expert."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"], out[f"{p}.{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


def _quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek stores in FP8: every linear weight of attention and MLP (experts, shared experts, the dense
    layer's MLP); not the embeddings, norms, router or LM head."""
    return t.dim() == 2 and (name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 directory, its float32 dequantized twin): the same tokenizer and config, but for quantization_config."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import EOS, generic_config, make_tokenizer
    from verifier_svc.checkpoint import dequantize_fp8

    fp8_dir, ref_dir = tmp_path_factory.mktemp("dsv3-fp8"), tmp_path_factory.mktemp("dsv3-dequantized")
    tok = make_tokenizer(fp8_dir)
    make_tokenizer(ref_dir)
    cfg = generic_config("deepseek_v3", len(tok), tok.convert_tokens_to_ids(EOS), num_layers=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = _checkpoint_tensors(model)
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            w8, s = _quantize(t)
            fp8[name], fp8[f"{name}_scale_inv"] = w8, s
            ref[name] = dequantize_fp8(w8, s, BLOCK, torch.float32)
        else:
            fp8[name] = ref[name] = t
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    json.dump(conf, open(ref_dir / "config.json", "w"))
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": list(BLOCK)}
    json.dump(conf, open(fp8_dir / "config.json", "w"))
    return pathlib.Path(fp8_dir), pathlib.Path(ref_dir), fp8


def test_dequantize_fp8_is_the_block_scale_times_the_weight_partial_blocks_included():
    """Each element times its block's scale (rows and columns the block does not divide: partial last blocks), in
    float32; transformers' own dequantization where its block divides the weight."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from verifier_svc.checkpoint import dequantize_fp8

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 36, generator=g)
    w8, s = _quantize(w)
    got = dequantize_fp8(w8, s, BLOCK, torch.float32)
    i, j = 33, 35  # in the last (partial) block of both dimensions
    assert got[i, j] == w8[i, j].float() * s[i // 16, j // 16]
    torch.testing.assert_close(got, w, rtol=0.07, atol=0.0)  # e4m3 keeps 3 mantissa bits
    w8, s = _quantize(torch.randn(32, 48, generator=g))
    want = Fp8Dequantize(None)._dequantize_one(w8, s, output_dtype=torch.float32)
    assert torch.equal(dequantize_fp8(w8, s, BLOCK, torch.float32), want)
    with pytest.raises(ValueError, match="do not match a weight"):
        dequantize_fp8(w8, s[:1], BLOCK, torch.float32)


def test_an_fp8_checkpoint_reads_as_its_dequantized_twin_and_serves(checkpoints):
    """--experts mxfp4 on the FP8 checkpoint: the direct reader takes it (no transformers load), every non-expert weight
    equals its dequantized value, the host store holds the very MXFP4 bytes of the dequantized twin's experts, and
    greedy decoding gives the twin's tokens."""
    from verifier_svc.checkpoint import plan
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target
    from transformers import AutoConfig

    fp8_dir, ref_dir, _ = checkpoints
    direct = plan(fp8_dir, AutoConfig.from_pretrained(fp8_dir), torch.float32)
    assert not isinstance(direct, str), direct
    assert direct.fp8_block == BLOCK and all(f.fp8_block == BLOCK for f in direct.forms.values())
    ours = load_target(fp8_dir, DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=1.0)
    twin = load_target(ref_dir, DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=1.0)
    assert torch.equal(ours.expert_cache.store.arena, twin.expert_cache.store.arena)
    theirs = dict(twin.model.named_parameters())
    for name, t in ours.model.named_parameters():
        if ".mlp.experts." not in name:
            assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    prompt = list(range(5, 30))
    outs = []
    for target in (ours, twin):
        from benchmarks.inprocess import core_run

        outs.append(core_run(VerifierCore(target, max_block_size=8), [prompt], 12, 4)["outputs"])
    assert outs[0] == outs[1]


def test_a_missing_fp8_scale_fails_at_load_naming_the_tensor(checkpoints, tmp_path):
    fp8_dir, _, tensors = checkpoints
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (fp8_dir / f).exists():
            (tmp_path / f).write_bytes((fp8_dir / f).read_bytes())
    broken = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"}
    save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    from verifier_svc.model import load_target

    with pytest.raises(ValueError, match=r"no tensor model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight_scale_inv"):
        load_target(tmp_path, DEVICE, DTYPE, experts="mxfp4", expert_cache_gb=1.0)


def test_native_experts_on_an_fp8_checkpoint_are_its_dequantized_twin(checkpoints):
    """--experts native (the default) on the FP8 checkpoint: read directly too (transformers' FP8 loader needs
    accelerate and a GPU), every weight dequantized to the model's dtype: the very parameters, experts included, and
    greedy tokens of transformers' load of the dequantized twin."""
    from transformers import AutoModelForCausalLM

    from benchmarks.inprocess import core_run
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    fp8_dir, ref_dir, _ = checkpoints
    ours = load_target(fp8_dir, DEVICE, DTYPE)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=getattr(torch, DTYPE))
    mine = dict(ours.model.named_parameters())
    names = [n for n, _ in ref.named_parameters()]
    assert sorted(mine) == sorted(names) and any(".mlp.experts." in n for n in names)
    for name, t in ref.named_parameters():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    twin = load_target(ref_dir, DEVICE, DTYPE)
    prompt = list(range(5, 30))
    outs = [core_run(VerifierCore(t, max_block_size=8), [prompt], 12, 4)["outputs"] for t in (ours, twin)]
    assert outs[0] == outs[1]
