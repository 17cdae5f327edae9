"""Tiny random-weight MoE checkpoints (and a tiny BPE tokenizer) made on the spot.

Used by the tests (three architectures through the same seam) and, until a trained model is
shipped, by `pdflash up` as its default. Random weights: outputs are meaningless text, but the
serving path (loading, routing capture, KV rollback, acceptance) is exercised for real.
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch

ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss")
# More MoE architectures of transformers that pdflash serves (tests/test_architectures.py: greedy decoding at blocks 1 and
# 16 equals transformers' own on the CPU), made by `generic_config`: MLA attention (deepseek_v3, glm4_moe_lite), shared
# experts (qwen2_moe, dots1, ...), linear-attention / state-space / convolution hybrids whose state rolls back through
# transformers' past recording (qwen3_next, qwen3_5_moe_text, jamba, kimi_linear, granitemoehybrid, lfm2_moe).
MORE_ARCHITECTURES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "qwen2_moe", "olmoe", "glm4_moe", "ernie4_5_moe",
                      "granitemoe", "granitemoeshared", "phimoe", "minimax_m2", "hunyuan_v1_moe", "dots1", "flex_olmo",
                      "exaone_moe", "afmoe", "cohere2_moe", "lfm2_moe", "qwen3_next", "qwen3_5_moe_text", "jamba",
                      "granitemoehybrid", "kimi_linear", "nemotron_h")
EOS = "<|endoftext|>"
MASK = "<|mask|>"
# A ChatML-like template, so that GenerateRequest.messages can be tried (and tested) on a tiny checkpoint: each turn
# "<|role|>\ncontent" ended by the end-of-sequence token, then the assistant's turn opened.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _corpus(max_files: int = 40) -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:max_files]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def make_tokenizer(out_dir: str | pathlib.Path, vocab_size: int = 512):
    """A byte-level BPE trained on a few stdlib files, saved so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _gpt_oss_rope(max_positions: int) -> dict:
    """gpt-oss's YaRN rotary (factor 32) stretched to this config's context: its pre-YaRN length is the context / 32,
    as in the published model (4096 x 32 = 131072), so transformers finds the factor consistent and says nothing."""
    from transformers import GptOssConfig

    rope = dict(GptOssConfig().rope_parameters)
    rope["original_max_position_embeddings"] = max_positions // int(rope["factor"])
    return rope


def tiny_config(arch: str, vocab_size: int, eos_id: int, num_layers: int = 2):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            **common, rope_parameters=_gpt_oss_rope(common["max_position_embeddings"]), intermediate_size=64,
            num_local_experts=8, num_experts_per_tok=2, sliding_window=1024,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        )
    if arch in MORE_ARCHITECTURES:
        return generic_config(arch, vocab_size, eos_id, num_layers)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES + MORE_ARCHITECTURES}")


def generic_config(arch: str, vocab_size: int, eos_id: int, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                   experts: int = 8, top_k: int = 2, expert_width: int = 32):
    """A small config of any MoE model type transformers knows: its defaults, with the sizes every such config names
    (whichever of the aliases it uses) made small. Multi-head latent attention (DeepSeek-V2/V3) gets all heads as KV
    heads and its rotary part as head_dim; a hybrid of linear and full attention at least 4 layers of its own pattern
    (Qwen3-Next: 3 linear, 1 full); a model with dense first layers (DeepSeek) one of them."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(arch)
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
                 num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, intermediate_size=2 * hidden,
                 moe_intermediate_size=expert_width, shared_expert_intermediate_size=expert_width, n_shared_experts=1,
                 num_experts=experts, num_local_experts=experts, n_routed_experts=experts, moe_num_experts=experts,
                 num_experts_per_tok=top_k, moe_k=top_k, max_position_embeddings=2048, eos_token_id=eos_id,
                 pad_token_id=eos_id, bos_token_id=None, tie_word_embeddings=False, initializer_range=0.1,
                 first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=hidden // 4, q_lora_rank=None,
                 qk_rope_head_dim=hidden // heads // 2, qk_nope_head_dim=hidden // heads // 2, v_head_dim=hidden // heads,
                 mlp_only_layers=[], decoder_sparse_step=1, sliding_window=16,
                 # Gated DeltaNet (Qwen3-Next, Qwen3.5): 2 key heads, 4 value heads of 16 (its defaults are real widths)
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=hidden // heads,
                 linear_value_head_dim=hidden // heads)
    kw = {k: v for k, v in sizes.items() if hasattr(base, k)}
    if hasattr(base, "qk_rope_head_dim"):  # MLA: one latent KV shared by every head
        kw["head_dim"], kw["num_key_value_heads"] = kw["qk_rope_head_dim"], heads
    pattern = list(getattr(base, "layer_types", None) or [])
    if "linear_attention" in pattern and "full_attention" in pattern:  # a hybrid: its pattern, to its first full layer
        kw["num_hidden_layers"] = max(num_layers, pattern.index("full_attention") + 1)
    if pattern:
        kw["layer_types"] = [pattern[i % len(pattern)] for i in range(kw["num_hidden_layers"])]
    if arch == "jamba":  # its pattern is periods and offsets: attention every 4th layer from the 4th, experts every 2nd
        kw.update(num_hidden_layers=max(num_layers, 4), attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2,
                  expert_layer_offset=1)
        kw.pop("layer_types", None)
    if arch == "granitemoehybrid":  # Granite 4.0-H: Mamba-2 layers and an attention layer, its heads sized from hidden
        kw.update(num_hidden_layers=max(num_layers, 4), mamba_n_heads=hidden // 8, mamba_d_head=16, mamba_d_state=16,
                  mamba_chunk_size=16, layer_types=["linear_attention"] * (max(num_layers, 4) - 1) + ["full_attention"])
    if arch == "kimi_linear":  # Kimi Linear: KDA linear attention and MLA, dense first layer; its own names for sizes
        kw.update(num_experts_per_token=top_k, num_shared_experts=1, linear_num_heads=heads, linear_head_dim=hidden // heads,
                  mlp_layer_types=["dense"] + ["sparse"] * (kw["num_hidden_layers"] - 1))
    if arch == "nemotron_h":  # Nemotron-H / Nemotron 3: one mixer a block (Mamba-2, MoE with up-only relu^2 experts, attention)
        kw.update(num_hidden_layers=max(num_layers, 4), mamba_num_heads=hidden // 8, mamba_head_dim=16, n_groups=2,
                  ssm_state_size=16, chunk_size=16, moe_shared_expert_intermediate_size=expert_width,
                  layers_block_type=["linear_attention", "moe", "full_attention", "moe"][: max(num_layers, 4)])
    if arch == "lfm2_moe":  # LFM2: short-convolution layers and attention, dense first layers
        kw.update(num_hidden_layers=max(num_layers, 4), num_dense_layers=1,
                  layer_types=["conv", "conv", "full_attention", "conv"][: max(num_layers, 4)])
    return AutoConfig.for_model(arch, **kw)


def make_tiny_checkpoint(out_dir: str | pathlib.Path, arch: str = "qwen3_moe", seed: int = 0, num_layers: int = 2,
                         mxfp4: bool = False) -> pathlib.Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir.

    mxfp4 (gpt_oss only): the experts as gpt-oss publishes them (`save_gpt_oss_mxfp4`), everything else float32.
    The architecture is checked before anything is written, so a call with its arguments swapped,
    `make_tiny_checkpoint("qwen3_moe", path)`, writes nothing.
    """
    from transformers import AutoModelForCausalLM

    if arch not in ARCHITECTURES + MORE_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES + MORE_ARCHITECTURES}")
    if mxfp4 and arch != "gpt_oss":
        raise ValueError(f"native MXFP4 checkpoints are gpt-oss's format; {arch!r} has none")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    cfg = tiny_config(arch, vocab_size=len(tok), eos_id=tok.convert_tokens_to_ids(EOS), num_layers=num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return _save(model, out, mxfp4)


def real_shape_config(arch: str, vocab_size: int = 4096, num_layers: int = 2, eos_id: int = 0):
    """The layer shapes of a real model (Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B, DeepSeek-V3 with 32 of its 256
    experts, Qwen3-Next-80B-A3B with 64 of its 512 and at least 4 layers, Nemotron 3 Nano 30B-A3B with at least 4
    blocks, Jamba-1.5-Mini with at least 4 layers), few layers, a small vocabulary: random weights of real size have the near ties that bf16 kernels turn
    into different tokens."""
    common = dict(vocab_size=vocab_size, num_hidden_layers=num_layers, max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.05, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(**common, rope_parameters=_gpt_oss_rope(common["max_position_embeddings"]), hidden_size=2880,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                            intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)])
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch == "deepseek_v3":  # DeepSeek-V3 / Kimi K2's attention (MLA) and expert widths; 32 routed experts, not 256
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**common, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=32,
                                num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                norm_topk_prob=True, first_k_dense_replace=1, rope_interleave=True)
    if arch == "qwen3_next":  # Qwen3-Next-80B-A3B's layers (Qwen3.5's Gated DeltaNet too); 64 of its 512 experts
        from transformers import Qwen3NextConfig

        layers = max(num_layers, 4)  # three Gated DeltaNet layers, then full attention, as the model repeats them
        return Qwen3NextConfig(**{**common, "num_hidden_layers": layers}, hidden_size=2048, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, intermediate_size=5120, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, num_experts=64, num_experts_per_tok=10,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                            for i in range(layers)])
    if arch == "nemotron_h":  # Nemotron 3 Nano 30B-A3B's blocks (Mamba-2, MoE of up-only relu^2 experts, attention
        # without positions); its 128 experts of width 1856, top 6, a shared expert. The blocks repeat its pattern's
        # start: Mamba-2, MoE, then attention in the 4th block (then Mamba-2 / MoE again)
        from transformers import AutoConfig

        layers = max(num_layers, 4)
        pattern = ["linear_attention", "moe", "linear_attention", "full_attention", "moe"]
        return AutoConfig.for_model("nemotron_h", **common | dict(num_hidden_layers=layers), hidden_size=2688,
                                    num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
                                    mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
                                    n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                                    moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
                                    routed_scaling_factor=2.5, norm_topk_prob=True, intermediate_size=3712,
                                    layers_block_type=[pattern[i % len(pattern)] for i in range(layers)])
    if arch == "jamba":  # Jamba-1.5-Mini's (and v0.1's) layers: Mamba (v1: 8192 channels, state 16, dt rank 256),
        # attention without positions (32 / 8 heads of 128), 16 experts of width 14336, top 2, every 2nd layer; three
        # Mamba layers, then attention, as the model's period of 8 starts
        from transformers import JambaConfig

        layers = max(num_layers, 4)
        return JambaConfig(**common | dict(num_hidden_layers=layers), hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=8, intermediate_size=14336, num_experts=16, num_experts_per_tok=2,
                           expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=3,
                           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256, mamba_conv_bias=True,
                           mamba_proj_bias=False)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES} or deepseek_v3, qwen3_next, "
                     "nemotron_h, jamba")


def make_real_shape_checkpoint(out_dir: str | pathlib.Path, arch: str, num_layers: int = 2, seed: int = 0,
                               vocab_size: int = 4096, device: str = "cpu", mxfp4: bool = False) -> pathlib.Path:
    """A checkpoint directory (config, bf16 safetensors, a BPE tokenizer of `vocab_size`) with real layer shapes;
    mxfp4 (gpt_oss only): the experts in gpt-oss's published MXFP4 form (`save_gpt_oss_mxfp4`)."""
    from transformers import AutoModelForCausalLM

    if mxfp4 and arch != "gpt_oss":
        raise ValueError(f"native MXFP4 checkpoints are gpt-oss's format; {arch!r} has none")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out, vocab_size=vocab_size)
    cfg = real_shape_config(arch, vocab_size=len(tok), num_layers=num_layers, eos_id=tok.convert_tokens_to_ids(EOS))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return _save(model, out, mxfp4)


def _save(model, out: pathlib.Path, mxfp4: bool) -> pathlib.Path:
    """Write a made model (its eos as the generation config's eos and pad) as safetensors, or in gpt-oss's MXFP4 form."""
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.eos_token_id
    if mxfp4:
        save_gpt_oss_mxfp4(model, out)
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    return out


# gpt-oss's published quantization_config (the experts are MXFP4; these modules are not)
GPT_OSS_MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def gpt_oss_mxfp4_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """One gpt_oss layer's experts as transformers holds them (gate_up_proj [E, H, 2I] with gate/up columns
    interleaved, down_proj [E, I, H]) -> the published tensors (REFERENCE.md section 5), quantized with
    pdflash_kernels/mxfp4, one expert at a time: gate_up_proj_blocks [E, 2I, H/32, 16] u8 + _scales [E, 2I, H/32] u8,
    down_proj_blocks [E, H, I/32, 16] + _scales [E, H, I/32] (rows = output features, K = the input dimension)."""
    from pdflash_kernels import mxfp4

    out = {}
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        parts = [mxfp4.quantize(w[e].transpose(0, 1)) for e in range(w.shape[0])]
        blocks = torch.stack([b for b, _ in parts])
        scales = torch.stack([s for _, s in parts])
        out[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16).contiguous()
        out[f"{name}_scales"] = scales.contiguous()
    return out


def save_gpt_oss_mxfp4(model, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Save a gpt_oss model as gpt-oss checkpoints are published: every experts module's weights as MXFP4
    `*_blocks`/`*_scales` (quantized from the model's weights), bf16 expert biases, every other tensor as the model
    holds it, and `quantization_config: {"quant_method": "mxfp4", ...}` in config.json."""
    import json

    from safetensors.torch import save_file

    if model.config.model_type != "gpt_oss":
        raise ValueError(f"native MXFP4 checkpoints are gpt-oss's format, not {model.config.model_type!r}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    experts = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "GptOssExperts":
            experts[name] = module
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in experts:
            if leaf in ("gate_up_proj_bias", "down_proj_bias"):
                tensors[name] = t.detach().to(torch.bfloat16).contiguous().cpu()
            continue  # the weights: below
        tensors[name] = t.detach().contiguous().cpu()
    for prefix, module in experts.items():
        for key, t in gpt_oss_mxfp4_experts(module.gate_up_proj.detach().cpu(), module.down_proj.detach().cpu()).items():
            tensors[f"{prefix}.{key}"] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = dict(GPT_OSS_MXFP4_CONFIG)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
