"""Multi-head latent attention on a CUDA GPU (skipped without one), bf16 at DeepSeek-V3 / Kimi K2's real widths (128
heads, latent 512, rotary 64): the absorbed attention over the paged latent cache is close to transformers' expanded
form and batch-invariant, and a DeepSeek-V3-shaped model (two layers: the dense first layer and a MoE layer of 32 of
its 256 experts, random weights) served with the kernels, the paged latent KV and CUDA graphs gives its block-1
tokens for drafts that roll back mid-block and inside multi-session waves. Run with `bash benchmarks/gpu.sh OUT mla`."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_verifier import drafts_and_waves_give_block_one, real_shape_target
from tests.test_mla import _expanded_reference, _pools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, L, DR, NOPE, V = 128, 512, 64, 128, 128


def test_latent_attention_at_deepseek_v3_widths():
    """The compiled kernels at real widths: each row's bits the same at 1, 5, 16 and 32 rows and for 1 or 16 programs a
    tile, and close to the float64 expanded form."""
    from pdflash_kernels.attention import paged_latent_attention
    from pdflash_kernels.mla import head_matmul

    g = torch.Generator().manual_seed(0)
    s, t = 1000, 32
    scaling = (NOPE + DR) ** -0.5
    latent = torch.randn(s, L, generator=g).bfloat16()
    rope = torch.randn(s, DR, generator=g).bfloat16()
    w = (torch.randn(H, NOPE + V, L, generator=g) / L**0.5).bfloat16()
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    q_nope = torch.randn(H, t, NOPE, generator=g).bfloat16()
    q_rope = torch.randn(H, t, DR, generator=g).bfloat16()
    pos = torch.arange(s - t, s)
    lp, rp, table = _pools(latent, rope, g)
    dev = lp.device
    q_lat = head_matmul(q_nope.transpose(0, 1).contiguous().to(dev), w_uk.to(dev)).transpose(0, 1).unsqueeze(0)
    qr = q_rope.unsqueeze(0).to(dev)
    posd = pos.reshape(1, t).to(dev)
    full = paged_latent_attention(q_lat, qr, lp, rp, table, posd, scaling, programs=1)
    assert torch.equal(paged_latent_attention(q_lat, qr, lp, rp, table, posd, scaling, programs=16), full)
    for n in (1, 5, 16):  # the last n queries alone
        part = paged_latent_attention(q_lat[:, :, t - n :], qr[:, :, t - n :], lp, rp, table, posd[:, t - n :], scaling)
        assert torch.equal(part, full[:, t - n :]), n
    x = q_nope.transpose(0, 1).contiguous().to(dev)
    assert torch.equal(head_matmul(x[:1], w_uk.to(dev)), head_matmul(x, w_uk.to(dev))[:1])
    out = head_matmul(full[0], w_uv.transpose(1, 2).to(dev))
    ref = _expanded_reference(q_nope, q_rope, latent, rope, w_uk, w_uv, pos, scaling)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0.0, atol=0.03 * ref.abs().max().item())


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from verifier_svc.engine import PagedKVOptions, VerifierCore

    target = real_shape_target("deepseek_v3", tmp_path_factory.mktemp("dsv3"), 2)
    c = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4),
                     max_wave_sessions=4)
    assert c.graphs is not None and c.pool.k[0].shape[1:] == (1, 64, L) and c.pool.v[0].shape[-1] == DR
    assert "latent" in c.forward_info["attention"]
    yield c
    del c, target
    torch.cuda.empty_cache()


def test_deepseek_v3_shapes_give_block_one_tokens_for_every_drafter_and_in_waves(core):
    """Greedy at real MLA shapes (near ties): n-gram drafts at block 8, drafts replaying the output with every 3rd one
    wrong at block 16 (a rollback most rounds), and the same sessions verified together in waves give block 1's tokens."""
    drafts_and_waves_give_block_one(core)
