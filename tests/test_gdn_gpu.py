"""Gated DeltaNet on a CUDA GPU (skipped without one), bf16 at Qwen3-Next-80B-A3B / Qwen3.5's real widths (16 key and 32
value heads of 128, convolution 4), and Mamba-2 at Granite-4.0-H-Small's (128 heads of 64, state 128): the compiled
kernels give a token the same bits whatever block it is in and whatever was rolled back before it, close to the float64
references; and a Qwen3-Next-shaped model (four layers: three Gated
DeltaNet layers and a full-attention one, 64 of its 512 experts, random weights) served with the kernels gives its
block-1 tokens for n-gram drafts, for drafts that roll back mid-block and in multi-session waves, on the paged forward
with CUDA graphs (a state slot per session) and on transformers' cache alike; the same for a Nemotron 3 Nano-shaped
model (Mamba-2, up-only relu^2 experts bf16 or MXFP4, attention without positions), and its MXFP4 experts offloaded to
an evicting device cache give the resident ones' tokens. Run with `bash benchmarks/gpu.sh OUT gdn`."""

from __future__ import annotations

import pytest
import torch

from pdflash_kernels import gdn
from tests.test_gpu_verifier import drafts_and_waves_give_block_one, real_shape_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, K = 2, 4
# (key heads, value heads, key width, value width, Mamba-2): Qwen3-Next-80B-A3B's Gated DeltaNet (16 / 32 heads of 128),
# Granite-4.0-H-Small's Mamba-2 (1 group, 128 heads of 64, state 128)
WIDTHS = {"qwen3_next": (16, 32, 128, 128, False), "granite_4_h_mamba2": (1, 128, 128, 64, True)}


def _inputs(t: int, seed: int, hk: int, hv: int, dk: int, dv: int, mamba: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, t, 2 * hk * dk + hv * dv, generator=g).bfloat16().cuda()
    decay = (-torch.rand(B, t, hv, generator=g) * 0.7).cuda()
    beta = torch.rand(B, t, hv, generator=g) * (0.1 if mamba else 1.0)  # (Mamba-2: dt, float32)
    return x, decay, (beta if mamba else beta.bfloat16()).cuda()


def _run_chunks(chunks, drops, w, dims, rule):
    hk, hv, dk, dv = dims
    st = gdn.GDNState.zeros(B, hv, dk, dv, K, 2 * hk * dk + hv * dv, torch.bfloat16, "cuda")
    kept = []
    for (x, dec, beta), d in zip(chunks, drops):
        conv = gdn.causal_conv(x, st, w)
        out = gdn.gated_delta(conv, dec, beta, st, hk, hv, dk, dv, rule=rule)
        st.pending, st.accepted = (x, conv, dec, beta), x.shape[1]
        st.drop(d)
        kept.append(out[:, : x.shape[1] - d])
    return torch.cat(kept, dim=1)


@pytest.mark.parametrize("widths", list(WIDTHS))
def test_the_recurrences_at_real_widths(widths):
    """Gated DeltaNet at Qwen3-Next's widths and Mamba-2 at Granite-4.0-H's: a token's output has the same bits at
    block 1 and in blocks that carry rejected tokens (rolled back), and is close to the float64 references."""
    hk, hv, dk, dv, mamba = WIDTHS[widths]
    dims, c = (hk, hv, dk, dv), 2 * hk * dk + hv * dv
    rule = (gdn.Rule(delta=False, qk_norm=False, layout="xbc", D=torch.rand(hv).cuda()) if mamba else gdn.GDN_RULE)
    total = 40
    x, dec, beta = _inputs(total, 0, *WIDTHS[widths])
    w = (torch.randn(c, K, generator=torch.Generator().manual_seed(1)) * 0.5).bfloat16().cuda()
    one = _run_chunks([(x[:, i:i + 1], dec[:, i:i + 1], beta[:, i:i + 1]) for i in range(total)], [0] * total, w, dims,
                      rule)
    for split in ([(16, 0)] * 2 + [(8, 0)], [(7, 0), (16, 13), (16, 9), (16, 0), (11, 4)], [(32, 0), (12, 4)]):
        chunks, at = [], 0
        for n, d in split:
            keep = n - d
            jx, jg, jb = _inputs(d, 100 + at, *WIDTHS[widths])
            chunks.append((torch.cat([x[:, at:at + keep], jx], 1), torch.cat([dec[:, at:at + keep], jg], 1),
                           torch.cat([beta[:, at:at + keep], jb], 1)))
            at += keep
        assert at == total
        got = _run_chunks(chunks, [d for _, d in split], w, dims, rule)
        assert torch.equal(got, one), split
    st = gdn.GDNState.zeros(B, hv, dk, dv, K, c, torch.bfloat16, "cuda")
    conv = gdn.causal_conv(x, st, w)
    ref_conv, _ = gdn.causal_conv_ref(x.cpu(), torch.zeros(B, K - 1, c).bfloat16(), None, 0, w.cpu())
    torch.testing.assert_close(conv.cpu().float(), ref_conv.float(), rtol=2e-2, atol=1e-2)  # (1 bf16 ulp: 2^-6 relative)
    out = gdn.gated_delta(conv, dec, beta, st, hk, hv, dk, dv, rule=rule)
    cpu_rule = gdn.Rule(rule.delta, rule.qk_norm, rule.layout, rule.D.cpu() if rule.D is not None else None)
    ref, _ = gdn.gated_delta_ref(*gdn._split(conv.cpu(), hk, hv, dk, dv, cpu_rule), dec.cpu(), beta.cpu(),
                                 torch.zeros(B, hv, dk, dv), cpu_rule)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=0.0, atol=0.02 * ref.abs().max().item())


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = real_shape_target("qwen3_next", tmp_path_factory.mktemp("qnext"), 4)
    assert t.kernels["linear_attention"].startswith("triton gated delta rule / Mamba and Mamba-2 scans / short convolution, token by token (3 layers")
    yield t
    del t
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def core(target):
    from verifier_svc.engine import PagedKVOptions, VerifierCore

    c = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4),
                     max_wave_sessions=4)
    # the paged forward with CUDA graphs, the Gated DeltaNet state in per-session slots, no pages for those layers
    assert c.graphs is not None and c.pool.linear is not None and not c.pool.k[0].numel() and c.pool.k[3].numel()
    yield c
    del c
    torch.cuda.empty_cache()


def test_qwen3_next_shapes_give_block_one_tokens_for_every_drafter_and_in_waves(core, target):
    """Greedy at real Gated DeltaNet shapes (near ties), on the paged forward with CUDA graphs: n-gram drafts at block
    8, drafts replaying the output with every 3rd one wrong at block 16 (a rollback most rounds), and the same
    sessions verified together in waves give block 1's tokens; and block 1 on transformers' cache (the layers' state on
    the cache, eager) gives the same tokens."""
    from verifier_svc.engine import PagedKVOptions, VerifierCore

    dense = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(mode="off"))
    drafts_and_waves_give_block_one(core, dense)
    assert len(core.sessions) == 0 and core.pool.linear.free_slots == core.pool.linear.slots - 1


@pytest.mark.parametrize("experts", ["native", "mxfp4"])
def test_nemotron_h_shapes_give_block_one_tokens_for_every_drafter_and_in_waves(tmp_path, experts):
    """Nemotron 3 Nano 30B-A3B's blocks (Mamba-2 at 64 heads of 64 with 8 groups and state 128; MoE blocks of 128
    up-only relu^2 experts of width 1856, top 6; attention without positions), five blocks, random bf16 weights, the
    experts bf16 or MXFP4 (fragment words on a GPU with Gluon: the first GEMM's programs hold up tiles alone), on the
    paged forward with CUDA graphs:
    block 1's tokens for n-gram drafts at block 8, for replayed drafts with every 3rd one wrong at block 16, in waves of
    two sessions, and on transformers' cache; KV pages for the attention block alone."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import real_shape_config
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import serve_mxfp4, wrap_model

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(real_shape_config("nemotron_h", num_layers=5), dtype=torch.bfloat16)
    target = serve_mxfp4(model, tmp_path, "on") if experts == "mxfp4" else wrap_model(model, tmp_path, kernels="on")
    assert target.batch_invariant and not target.kernels["uncovered_ops"], target.kernels
    if experts == "mxfp4":
        from pdflash_kernels import moe
        from pdflash_kernels.installer import experts_modules

        w = next(iter(experts_modules(target.model).values()))._pdflash_weights
        want = moe.expert_format_for("cuda", None) == "fragments"  # (Gluon there, PDFLASH_FP4_FRAGMENTS on)
        assert getattr(w, "fragments", False) == want and not w.gated, type(w)
    core = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4),
                        max_wave_sessions=4)
    assert core.graphs is not None and core.pool.linear is not None
    assert [bool(core.pool.k[i].numel()) for i in range(5)] == [False, False, False, True, False]
    dense = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(mode="off"))
    drafts_and_waves_give_block_one(core, dense)
    del core, dense, target, model
    torch.cuda.empty_cache()


def test_nemotron_h_offloaded_up_only_experts_give_the_resident_tokens(tmp_path):
    """Nemotron 3 Nano's blocks (five, random bf16) with their up-only experts in MXFP4 (fragment words where Gluon is
    there) offloaded to a device cache of one layer's experts + 3 slots, so every forward evicts and copies: block 1,
    drafts replaying the output with every 3rd one wrong at block 16, and waves give the resident experts' block-1
    tokens; the cache did copy."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import real_shape_config
    from tests.test_gpu_verifier import _no_drafts, _prompts, _replay, _run
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import offload_experts, serve_mxfp4, wrap_offloaded

    def build():
        torch.manual_seed(0)
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(real_shape_config("nemotron_h", num_layers=5), dtype=torch.bfloat16)

    resident = serve_mxfp4(build(), tmp_path, "on")
    core = VerifierCore(resident, max_block_size=16, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=2))
    prompts = _prompts(core.target.vocab_size, 2)
    want = [_run(core, p, _no_drafts) for p in prompts]
    del core, resident
    torch.cuda.empty_cache()
    model = build()
    probe = offload_experts(model, torch.device("cuda"), 100.0)
    store, per_layer = probe.store, max(probe.store.num_experts.values())
    from pdflash_kernels import moe

    assert store.format == moe.expert_format_for("cuda", store.layout) and not store.layout.gated
    small_gb = (per_layer + 3) * store.slice_bytes / 2**30
    del probe, model
    torch.cuda.empty_cache()
    model = build()
    cache = offload_experts(model, torch.device("cuda"), small_gb)
    target = wrap_offloaded(model, tmp_path, "on", cache)
    core = VerifierCore(target, max_block_size=16, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=2),
                        max_wave_sessions=4)
    vocab = core.target.vocab_size
    for i, p in enumerate(prompts):
        assert _run(core, p, _no_drafts) == want[i], i
        assert _run(core, p, _replay(want[i], 3, vocab), width=16) == want[i], i
    drafts_and_waves_give_block_one(core)
    st = cache.stats
    assert st.evictions > 0 and st.bytes_moved > per_layer * store.slice_bytes, st
    del core, target, cache, model
    torch.cuda.empty_cache()


def test_mamba_v1_at_jamba_widths_gives_block_ones_bits_and_transformers_outputs():
    """Jamba-1.5-Mini's Mamba (v1) mixer (8192 channels, state 16, dt rank 256; bf16) on the kernels: a token's output
    has the same bits at block 1 and in blocks that carry rejected tokens (cropped from the session's cache), and is
    close to the mixer's own transformers forward in float32."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    from pdflash.hf_compat import new_session_cache
    from pdflash.tiny import real_shape_config

    cfg = real_shape_config("jamba")
    torch.manual_seed(0)
    mixer = JambaMambaMixer(cfg, layer_idx=0).eval()
    ref_mixer = JambaMambaMixer(cfg, layer_idx=0).eval()
    ref_mixer.load_state_dict(mixer.state_dict())
    mixer = mixer.to("cuda", torch.bfloat16)
    assert gdn.layer_forward(mixer) is gdn.mamba1_forward
    total, hidden = 40, cfg.hidden_size
    h = (torch.randn(1, total, hidden, generator=torch.Generator().manual_seed(1))).bfloat16().cuda()
    with torch.inference_mode():
        cache = new_session_cache(cfg, 32)
        one = torch.cat([gdn.mamba1_forward(mixer, h[:, i:i + 1], cache=cache) for i in range(total)], 1)
        for split in ([(16, 0)] * 2 + [(8, 0)], [(7, 0), (16, 13), (16, 9), (16, 0), (11, 4)], [(32, 0), (12, 4)]):
            cache, kept, at = new_session_cache(cfg, 32), [], 0
            for n, d in split:
                keep = n - d
                junk = torch.randn(1, d, hidden, generator=torch.Generator().manual_seed(100 + at)).bfloat16().cuda()
                out = gdn.mamba1_forward(mixer, torch.cat([h[:, at:at + keep], junk], 1), cache=cache)
                if d:
                    cache.layers[0].crop(-d)  # (the one layer run here; the others hold nothing)
                kept.append(out[:, :keep])
                at += keep
            assert at == total
            assert torch.equal(torch.cat(kept, 1), one), split
        want = ref_mixer(h.cpu().float())
    torch.testing.assert_close(one.cpu().float(), want, rtol=0.0, atol=0.03 * want.abs().max().item())


@pytest.mark.parametrize("experts", ["native", "mxfp4"])
def test_jamba_shapes_give_block_one_tokens_for_every_drafter_and_in_waves(tmp_path, experts):
    """Jamba-1.5-Mini's layers (three Mamba v1 layers, then attention without positions; 16 experts of width 14336, top
    2, every 2nd layer), random bf16 weights, the experts bf16 or MXFP4, on the paged forward with CUDA graphs: block 1's
    tokens for n-gram drafts at block 8, for replayed drafts with every 3rd one wrong at block 16, in waves of two
    sessions, and on transformers' cache; KV pages for the attention layer alone; every part batch-invariant."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import real_shape_config
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import serve_mxfp4, wrap_model

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(real_shape_config("jamba", num_layers=4), dtype=torch.bfloat16)
    target = serve_mxfp4(model, tmp_path, "on") if experts == "mxfp4" else wrap_model(model, tmp_path, kernels="on")
    assert target.batch_invariant and not target.kernels["uncovered_ops"], target.kernels
    assert "(3 layers" in target.kernels["linear_attention"], target.kernels
    core = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4),
                        max_wave_sessions=4)
    assert core.graphs is not None and core.pool.linear is not None
    assert [bool(core.pool.k[i].numel()) for i in range(4)] == [False, False, False, True]
    dense = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(mode="off"))
    drafts_and_waves_give_block_one(core, dense)
    del core, dense, target, model
    torch.cuda.empty_cache()
