"""MoE architectures beyond the three the rest of the suite uses: pdflash serves any transformers MoE whose cache can drop
a block's rejected drafts, token for token as transformers' own greedy decoding, and refuses the others at load.

Each architecture is a tiny random checkpoint (`pdflash.tiny.generic_config`): multi-head latent attention (DeepSeek-V2/V3,
GLM-4.7-Flash), shared experts, sliding-window layers, float32 routers, and hybrids of linear attention / state-space and
full attention (Qwen3-Next, Qwen3.5, Jamba, Kimi Linear, Granite 4.0-H, LFM2), whose recurrent state rolls back through
transformers' past recording.
On the GPU `python benchmarks/arch_matrix.py --device cuda --mxfp4` runs the same matrix with the kernels, the paged KV
and offloaded experts (benchmarks/results/arch_matrix_gpu.md).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from pdflash.client import Client
from pdflash_kernels import runtime
from pdflash.hf_compat import keeps_recurrent_states
from pdflash.tiny import MORE_ARCHITECTURES, make_tiny_checkpoint
from tests.conftest import needs_triton, start_stack
from verifier_svc.engine import VerifierCore
from verifier_svc.model import load_target

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_matrix import PROMPTS, hf_greedy  # noqa: E402
from e2e_gpu import replay  # noqa: E402
from inprocess import core_run  # noqa: E402

NEW = 32
# linear-attention / state-space hybrids: their recurrent state rolls back with transformers >= 5.25, and an older one
# refuses them at load (what the GPU machine's transformers 5.17 did: benchmarks/results/arch_matrix_gpu.md), unless the
# kernels serve their layers (Gated DeltaNet, Kimi Delta Attention, LFM2's short convolutions: tests/test_gdn.py)
# (granitemoehybrid's Mamba-2 and lfm2_moe's convolutions roll back with 5.17 too)
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text", "jamba", "kimi_linear")
OLD_TRANSFORMERS = r"leaves them in its state .*transformers >= 5\.25"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    made: dict[str, pathlib.Path] = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in made:
            made[arch] = make_tiny_checkpoint(root / arch, arch)
        return made[arch]

    return get


def _prompts(model_dir: pathlib.Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_greedy_decoding_equals_transformers_at_every_width(arch, checkpoints):
    """Block 1, n-gram drafts at block 16, and drafts that replay the output with every 4th one wrong (a rejection in
    most rounds: the KV, and a hybrid's recurrent state, rolled back to mid-block each time) give transformers' tokens."""
    d = checkpoints(arch)
    if arch in HYBRIDS and not keeps_recurrent_states():
        with pytest.raises(ValueError, match=OLD_TRANSFORMERS):
            VerifierCore(load_target(d, "cpu"), max_block_size=16)
        return
    prompts = _prompts(d)
    want = hf_greedy(d, prompts, NEW)
    core = VerifierCore(load_target(d, "cpu"), max_block_size=16)
    one = core_run(core, prompts, NEW, 1)
    assert [o[:NEW] for o in one["outputs"]] == want
    assert [o[:NEW] for o in core_run(core, prompts, NEW, 16)["outputs"]] == want
    replayed = core_run(core, prompts, NEW, 16, propose=replay(want))
    assert [o[:NEW] for o in replayed["outputs"]] == want
    rounds = replayed["round_log"]
    assert any(0 < acc < drafts for drafts, acc, _ in rounds), "no round rolled back to mid-block"
    assert len(core.sessions) == 0


def test_a_model_whose_cache_cannot_drop_tokens_is_refused_at_load(checkpoints, tmp_path):
    """MiniMax-Text-01's own cache class refuses `crop`: the verifier says so when it loads, before any request."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdflash.tiny import EOS, _save, make_tokenizer

    tok = make_tokenizer(tmp_path)
    cfg = AutoConfig.for_model("minimax", vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                               num_experts_per_tok=2, eos_token_id=tok.convert_tokens_to_ids(EOS),
                               layer_types=["linear_attention", "full_attention"])
    _save(AutoModelForCausalLM.from_config(cfg), tmp_path, False)
    with pytest.raises(ValueError, match="minimax: pdflash cannot verify drafts on this model: .*cache"):
        VerifierCore(load_target(tmp_path, "cpu"))


def test_a_hybrid_whose_recurrent_state_does_not_roll_back_is_refused(checkpoints, monkeypatch):
    """Before transformers 5.25, `crop` restored a linear-attention layer's convolution state but not its recurrent
    state: every rejected draft would stay in the model's memory. The load-time rollback check sees the logits move
    and refuses the model, naming the version that fixes it. (Emulated: crop leaves the recurrent state as it is.)"""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from verifier_svc import servable

    crop = LinearAttentionCacheLayerMixin.crop

    def crop_conv_only(self, tokens_to_remove):
        kept = dict(self.recurrent_states)
        crop(self, tokens_to_remove)
        self.recurrent_states.update(kept)

    d = checkpoints("qwen3_next")
    target = load_target(d, "cpu")
    if keeps_recurrent_states():
        assert VerifierCore(target, max_block_size=8) is not None  # rolled back right: served
    monkeypatch.setattr(LinearAttentionCacheLayerMixin, "crop", crop_conv_only)
    monkeypatch.setattr(servable, "keeps_recurrent_states", lambda: False)
    with pytest.raises(ValueError, match="qwen3_next: .*" + OLD_TRANSFORMERS + r".*serve it with the kernels"):
        VerifierCore(target, max_block_size=8)  # (with them its Gated DeltaNet layers roll back: tests/test_gdn.py)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", pytest.param("qwen3_next", marks=pytest.mark.skipif(
    not keeps_recurrent_states(), reason="a hybrid needs transformers >= 5.25 (an older one refuses it at load: tested above)"))])
def test_the_stack_serves_them_token_for_token(arch, checkpoints, tmp_path):
    """Through the three services (a DFlash drafter made for the model, conditioned on its hidden states): every
    drafter gives transformers' greedy tokens, and each verify reports the experts it routed."""
    from drafter_svc.drafters.dflash import make_tiny_dflash

    d = checkpoints(arch)
    drafter = make_tiny_dflash(d, tmp_path / "drafter", num_layers=1, block_size=8)
    want = hf_greedy(d, _prompts(d)[:1], NEW)[0]
    stack = start_stack(d, drafter, tmp_path / "logs")
    try:
        with Client(stack.drafter) as client:
            for drafter_kind in ("none", "ngram", "dflash", "hybrid"):
                got = client.generate(PROMPTS[0], max_tokens=NEW, drafter=drafter_kind, ignore_eos=True)
                assert got.token_ids == want, drafter_kind
                assert got.usage.completion_tokens == NEW
            info = client.model_info()
            assert info.architecture == arch
    finally:
        stack.stop()


def test_hybrid_caches_are_probed_and_plain_ones_are_not():
    from transformers import AutoConfig

    from pdflash.hf_compat import new_session_cache, plain_attention_cache

    assert plain_attention_cache(new_session_cache(AutoConfig.for_model("gpt_oss"), 8))  # sliding window: keys/values
    assert plain_attention_cache(new_session_cache(AutoConfig.for_model("deepseek_v3"), 8))
    assert not plain_attention_cache(new_session_cache(AutoConfig.for_model("qwen3_next"), 8))


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_triton
def test_latent_attention_models_run_on_the_paged_latent_kv(checkpoints):
    """DeepSeek-V3 (and Kimi K2, GLM-4.7-Flash: the same module) with the kernels (under Triton's interpreter here; bf16
    at real widths on the GPU: tests/test_mla_gpu.py): the paged KV keeps one latent and its rotary key a position and
    attention runs in the absorbed form. Greedy at block 1 gives the tokens of the same kernels on transformers' cache
    (expanded keys and values), and drafts replayed with every 4th one wrong (rollbacks mid-block) give block 1's."""
    from verifier_svc.engine import PagedKVOptions

    d = checkpoints("deepseek_v3")
    target = load_target(d, "cpu", "bfloat16", kernels="on")
    prompts, n = _prompts(d)[:1], 5
    paged = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01))
    assert paged.pool.k[0].shape[1:] == (1, 64, target.model.config.kv_lora_rank)  # one latent a position
    assert paged.pool.v[0].shape[-1] == target.model.config.qk_rope_head_dim
    assert paged.forward_info["kv"].startswith("paged: ") and "latent" in paged.forward_info["attention"]
    assert paged.runner.chain is not None  # the layer probe drove an MLA layer (its cache's values of their own width)
    one = core_run(paged, prompts, n, 1)["outputs"]
    replayed = core_run(paged, prompts, n, 8, propose=replay([o[:n] for o in one]))
    assert [o[:n] for o in replayed["outputs"]] == [o[:n] for o in one]
    assert any(0 < acc < drafts for drafts, acc, _ in replayed["round_log"])
    assert len(paged.sessions) == 0 and paged.pool.free_pages == paged.pool.num_pages
    expanded = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="off"))
    assert expanded.pool is None
    assert [o[:n] for o in core_run(expanded, prompts, n, 1)["outputs"]] == [o[:n] for o in one]


@pytest.mark.slow
@needs_triton
def test_deepseek_v2s_complex_rotary_is_tabled_and_fits_the_paged_forward(checkpoints):
    """DeepSeek-V2's rotary module returns one complex freqs_cis, not (cos, sin): the runner's table holds it (the
    module's bits, gathered by position), and the paged forward passes its load-time check against the model's own."""
    from verifier_svc.engine import PagedKVOptions

    target = load_target(checkpoints("deepseek_v2"), "cpu", "bfloat16", kernels="on")
    core = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01))
    assert core.runner.rotary.startswith("table")
    rope = core.runner.rope
    pos = torch.tensor([[0, 5, 77, 1000]])
    want = target.model.model.rotary_emb(torch.zeros(1, 4, target.model.config.hidden_size, dtype=torch.bfloat16), pos)
    assert want.is_complex() and torch.equal(rope(pos), want)


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_triton
def test_a_model_the_paged_forward_does_not_fit_runs_on_transformers_cache(tmp_path):
    """An MLA model whose latent is not a power of two wide (24 here; real ones have 512) does not fit the paged latent
    attention kernel: with the kernels (interpreted here) the paged forward's load-time check fails, so `auto` serves
    the model on transformers' cache and says why, and an explicit `--paged-kv on` is refused."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import EOS, _save, generic_config, make_tokenizer
    from verifier_svc.engine import PagedKVOptions

    tok = make_tokenizer(tmp_path)
    cfg = generic_config("deepseek_v3", len(tok), tok.convert_tokens_to_ids(EOS))
    cfg.kv_lora_rank = 24
    _save(AutoModelForCausalLM.from_config(cfg), tmp_path, False)
    target = load_target(tmp_path, "cpu", "bfloat16", kernels="on")
    assert target.batch_invariant
    core = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="auto", kv_cache_gb=0.01))
    assert core.pool is None and core.runner is None and core.paged_off
    assert core.forward_info["kv"].startswith("transformers' DynamicCache (the paged forward does not fit this model: ")
    assert "24 is not a power of two" in core.forward_info["kv"]
    with pytest.raises(ValueError, match="--paged-kv on: the paged forward does not fit this model"):
        VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01))
