"""Multi-head latent attention on the paged latent cache (pdflash_kernels.mla, attention.paged_latent_attention), under
Triton's interpreter here and compiled on the GPU (tests/test_mla_gpu.py, bf16 at DeepSeek-V3's real widths).

The absorbed form must equal transformers' expanded form up to rounding, and every step must be batch-invariant: a row's
bits the same whatever the call's other rows, whatever the programs per tile, alone or in a ragged multi-session wave.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import needs_triton

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _expanded_reference(q_nope, q_rope, latent, rope, w_uk, w_uv, positions, scaling):
    """transformers' form in float64: every cached position's latent expanded per head into keys and values, causal.
    q_nope [H, T, nope], q_rope [H, T, DR], latent [S, L], rope [S, DR], w_uk [H, nope, L], w_uv [H, v, L]."""
    d = torch.float64
    k_nope = torch.einsum("hnl,sl->hsn", w_uk.to(d), latent.to(d))  # [H, S, nope]
    v = torch.einsum("hvl,sl->hsv", w_uv.to(d), latent.to(d))  # [H, S, v]
    scores = (torch.einsum("htn,hsn->hts", q_nope.to(d), k_nope) + torch.einsum("htr,sr->hts", q_rope.to(d), rope.to(d))) * scaling
    s = latent.shape[0]
    allowed = torch.arange(s)[None, :].to(positions.device) <= positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hts,hsv->thv", scores.softmax(-1), v)  # [T, H, v]


def _pools(latent, rope, g, spare_pages=3):
    """The latent / rotary pools [pages, 1, PAGE, .] holding `latent`/`rope` [S, .] in shuffled pages, and the table."""
    from pdflash_kernels.attention import PAGE

    s = latent.shape[0]
    n = -(-s // PAGE)
    order = torch.randperm(n + spare_pages, generator=g)[:n]
    lp = torch.zeros(n + spare_pages, 1, PAGE, latent.shape[1], dtype=latent.dtype)
    rp = torch.zeros(n + spare_pages, 1, PAGE, rope.shape[1], dtype=rope.dtype)
    for i in range(n):
        lp[order[i], 0, : min(PAGE, s - i * PAGE)] = latent[i * PAGE : (i + 1) * PAGE]
        rp[order[i], 0, : min(PAGE, s - i * PAGE)] = rope[i * PAGE : (i + 1) * PAGE]
    table = torch.cat([order, torch.zeros(2, dtype=torch.long)]).to(torch.int32).reshape(1, -1)
    return lp.to(DEV), rp.to(DEV), table.to(DEV)


@needs_triton
@pytest.mark.parametrize("k,n", [(16, 32), (24, 40), (128, 512), (512, 128)])
def test_head_matmul_is_the_per_head_product_with_row_bits_independent_of_the_rows(k, n):
    """head_matmul: each head's x @ w[h] (close to the float64 product), and a row's bits the same in calls of 1, 7, 16,
    17 and 40 rows (one 16-row tile height for every call), with w a strided view as kv_b_proj's weight gives it."""
    from pdflash_kernels.mla import head_matmul

    g = torch.Generator().manual_seed(k + n)
    h = 3
    x = torch.randn(40, h, k, generator=g).bfloat16().to(DEV)
    w_full = torch.randn(h, n + 8, k, generator=g).bfloat16().to(DEV)
    w = w_full[:, 8:].transpose(1, 2)  # [H, K, N], non-contiguous (W_UV^T's layout)
    full = head_matmul(x, w)
    ref = torch.einsum("thk,hkn->thn", x.double(), w.double())
    torch.testing.assert_close(full.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    for m in (1, 7, 16, 17):
        assert torch.equal(head_matmul(x[:m], w), full[:m]), m
    with pytest.raises(ValueError, match="do not match"):
        head_matmul(x, w[:2])


@needs_triton
@pytest.mark.parametrize("latent_dim,rope_dim,t", [(32, 16, 5), (64, 8, 3)])
def test_latent_attention_equals_the_expanded_form_and_its_rows_are_batch_invariant(latent_dim, rope_dim, t):
    """The absorbed MLA attention over the paged latent cache (3 KV segments, pages shuffled, a rotary width below a
    tensor-core dot's 16 that the kernel pads) equals transformers' expanded form to rounding; a row's bits are the same
    for any programs per tile, for the last query alone (1-token decoding), and inside a ragged wave of two sequences."""
    from pdflash_kernels.attention import SEG, paged_latent_attention
    from pdflash_kernels.mla import head_matmul

    g = torch.Generator().manual_seed(latent_dim + t)
    h, nope, v_dim, s = 4, 16, 16, 2 * SEG + 37
    scaling = (nope + rope_dim) ** -0.5
    latent = torch.randn(s, latent_dim, generator=g).bfloat16()
    rope = torch.randn(s, rope_dim, generator=g).bfloat16()
    w_kv = (torch.randn(h * (nope + v_dim), latent_dim, generator=g) / latent_dim**0.5).bfloat16()  # kv_b_proj.weight
    w = w_kv.view(h, nope + v_dim, latent_dim)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_nope = torch.randn(h, t, nope, generator=g).bfloat16()
    q_rope = torch.randn(h, t, rope_dim, generator=g).bfloat16()
    pos = torch.arange(s - t, s)
    lp, rp, table = _pools(latent, rope, g)

    q_lat = head_matmul(q_nope.transpose(0, 1).contiguous().to(DEV), w_uk.to(DEV)).transpose(0, 1).unsqueeze(0)  # [1, H, T, L]
    qr = q_rope.unsqueeze(0).to(DEV)
    posd = pos.reshape(1, t).to(DEV)
    outs = [paged_latent_attention(q_lat, qr, lp, rp, table, posd, scaling, programs=n) for n in (1, 2, 16)]
    assert outs[0].shape == (1, t, h, latent_dim)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    alone = paged_latent_attention(q_lat[:, :, t - 1 :], qr[:, :, t - 1 :], lp, rp, table, posd[:, t - 1 :], scaling)
    assert torch.equal(alone[:, 0], outs[0][:, t - 1])
    out = head_matmul(outs[0][0], w_uv.transpose(1, 2).to(DEV))  # [T, H, v]
    ref = _expanded_reference(q_nope, q_rope, latent, rope, w_uk, w_uv, pos, scaling)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0.0, atol=0.03 * ref.abs().max().item())

    # a ragged wave: this sequence's rows after 2 rows of a second, shorter sequence with its own table
    from pdflash_kernels.attention import PAGE

    lp2_latent = torch.randn(70, latent_dim, generator=g).bfloat16()
    lp2_rope = torch.randn(70, rope_dim, generator=g).bfloat16()
    n1 = table.shape[1]
    lp_all = torch.cat([lp, torch.zeros(2, *lp.shape[1:], dtype=lp.dtype, device=DEV)])
    rp_all = torch.cat([rp, torch.zeros(2, *rp.shape[1:], dtype=rp.dtype, device=DEV)])
    base = lp.shape[0]
    for i in range(2):  # the second sequence's two pages, past the first's: both sequences live in one pool
        lp_all[base + i, 0, : min(PAGE, 70 - i * PAGE)] = lp2_latent[i * PAGE : (i + 1) * PAGE].to(DEV)
        rp_all[base + i, 0, : min(PAGE, 70 - i * PAGE)] = lp2_rope[i * PAGE : (i + 1) * PAGE].to(DEV)
    table2 = torch.full((1, n1), base, dtype=torch.int32, device=DEV)
    table2[0, 1] = base + 1
    q2 = torch.randn(1, h, 2, latent_dim, generator=g).bfloat16().to(DEV)
    qr2 = torch.randn(1, h, 2, rope_dim, generator=g).bfloat16().to(DEV)
    pos2 = torch.tensor([[68, 69]], device=DEV)
    wave = paged_latent_attention(torch.cat([q2, q_lat], 2), torch.cat([qr2, qr], 2), lp_all, rp_all,
                                  torch.cat([table2, table]), torch.cat([pos2, posd], 1), scaling,
                                  seq_starts=torch.tensor([0, 2, 2 + t], dtype=torch.int32, device=DEV), max_rows=t)
    assert torch.equal(wave[:, 2:], paged_latent_attention(q_lat, qr, lp_all, rp_all, table, posd, scaling))
    assert torch.equal(wave[:, :2], paged_latent_attention(q2, qr2, lp_all, rp_all, table2, pos2, scaling))
    assert torch.equal(wave[:, 2:], outs[0])


@needs_triton
def test_paged_write_takes_a_value_of_its_own_width():
    """MLA's cache write: the latent [1, T, L] into the latent pool and its rotary key [1, T, DR] into the other, one
    launch, the same bits as the torch path."""
    from pdflash_kernels.attention import PAGE, paged_write, paged_write_reference

    g = torch.Generator().manual_seed(0)
    lat, rope = torch.randn(1, 5, 32, generator=g).bfloat16().to(DEV), torch.randn(1, 5, 8, generator=g).bfloat16().to(DEV)
    pools = [torch.zeros(3, 1, PAGE, w, dtype=torch.bfloat16, device=DEV) for w in (32, 8)]
    ref = [p.clone() for p in pools]
    pages = torch.tensor([2, 2, 0, 0, 1], device=DEV)
    offs = torch.tensor([62, 63, 0, 1, 5], device=DEV)
    paged_write(*pools, lat, rope, pages, offs)
    paged_write_reference(*ref, lat, rope, pages, offs)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    assert torch.equal(pools[1][1, 0, 5], rope[0, 4])


@needs_triton
def test_attention_pads_odd_head_widths_and_narrower_values():
    """The non-paged attention (transformers' cache: MLA's expanded keys of nope + rope and values of v, e.g. 192 / 128
    in DeepSeek-V3) zero-pads to the next power of two: close to the reference, and a row's bits do not change with the
    call's rows."""
    from pdflash_kernels.attention import attention
    from pdflash_kernels.reference import attention_reference

    g = torch.Generator().manual_seed(2)
    s, t = 90, 4
    q = torch.randn(1, 4, t, 24, generator=g).bfloat16().to(DEV)
    k = torch.randn(1, 4, s, 24, generator=g).bfloat16().to(DEV)
    v = torch.randn(1, 4, s, 16, generator=g).bfloat16().to(DEV)
    pos = torch.arange(s - t, s).reshape(1, t).to(DEV)
    out = attention(q, k, v, pos, 24**-0.5)
    assert out.shape == (1, t, 4, 16)
    ref = attention_reference(q, k, v, pos[0], 0, 24**-0.5)
    assert (out.float() - ref.float()).abs().max() < 0.02
    assert torch.equal(attention(q[:, :, -1:], k, v, pos[:, -1:], 24**-0.5), out[:, -1:])
