"""The attention block's fused input side (pdflash_kernels/qkv.py, verifier_svc/fused_attention.py) and the linears whose K
partials are summed by the kernel that consumes them (pdflash_kernels.linear.partials: the residual add + norm after the
output projection, the routing after the router): each gives the op-by-op path's bits. On the CPU under Triton's
interpreter; tests/test_gpu_verifier.py runs the runner on CUDA at the real layer shapes."""

from __future__ import annotations

import pytest
import torch

from pdflash_kernels import fused, linear, qkv
from pdflash_kernels.attention import PAGE, paged_write_reference
from tests.conftest import needs_triton

G = torch.Generator().manual_seed(0)


def _w(*shape):
    return (torch.randn(*shape, generator=G) / shape[-1] ** 0.5).bfloat16()


@needs_triton
@pytest.mark.parametrize("norm,bias,half,two", [(True, False, False, False), (False, True, True, False),
                                                (False, False, False, False), (True, True, False, True)])
def test_qkv_rope_write_equals_the_op_by_op_path(norm, bias, half, two):
    """Merged projection (K split 4; or q apart from k|v: `two`), per-head norms, rotary, K/V into the page pool: the
    bits of three linears, two rms_norms, the rotary and the pool write one after the other."""
    hq, hk, d, k, t = 4, 2, 32, 1024, 3
    cfg = qkv.merge_config([hq * d, hk * d, hk * d], k, 2)
    assert cfg is not None and cfg.split == 4
    x = torch.randn(t, k, generator=G).bfloat16()
    ws = [_w(hq * d, k), _w(hk * d, k), _w(hk * d, k)]
    bs = [_w(n.shape[0]) for n in ws] if bias else [None] * 3
    qn, kn = (torch.rand(d, generator=G) + 0.5).bfloat16(), (torch.rand(d, generator=G) + 0.5).bfloat16()
    ang = torch.randn(1, t, d // 2 if half else d, generator=G)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    pages, offs = torch.tensor([1, 1, 0]), torch.tensor([5, 6, PAGE - 1])
    # the op-by-op path
    q, kk, v = (linear.matmul(x, w.t(), bias=b) for w, b in zip(ws, bs))
    q, kk, v = q.view(1, t, hq, d), kk.view(1, t, hk, d), v.view(1, t, hk, d)
    if norm:
        q, kk = fused.rms_norm(q, qn, 1e-6, True), fused.rms_norm(kk, kn, 1e-5, True)
    q, kk = fused.rotary(q.transpose(1, 2), kk.transpose(1, 2), cos, sin, contiguous=half)
    want_k, want_v = torch.zeros(3, hk, PAGE, d).bfloat16(), torch.zeros(3, hk, PAGE, d).bfloat16()
    paged_write_reference(want_k, want_v, kk[0], v.transpose(1, 2)[0], pages, offs)
    # fused
    parts = [(ws[0], cfg), (torch.cat(ws[1:]), cfg)] if two else [(torch.cat(ws), cfg)]
    b = torch.cat(bs) if bias else None
    kp, vp = torch.zeros_like(want_k), torch.zeros_like(want_v)
    got = qkv.qkv_rope_write(x, parts, b, hq, hk, d, (qn, kn, 1e-6, 1e-5, True) if norm else None, cos, sin, kp, vp,
                             pages, offs)
    assert got.shape == q.shape and torch.equal(got, q)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


@needs_triton
def test_merged_projections_share_the_merged_config_also_called_alone(monkeypatch):
    """q, k and v merge whatever their own K splits would be: the merged projection's config is linear_config of its
    whole width, and once their weights are views of the merged tensor (`merged_weight`) and it is shared
    (`linear.share_config`) each projection called alone gives the merged partials' columns bit for bit. With 8 SMs
    (patched) k/v alone would split K 2 ways and q and the merged projection 1: here the parts run split 1. The
    sharing leaves with the merged tensor, and a call with another K ignores it."""
    from pdflash_kernels import runtime

    monkeypatch.setattr(runtime, "sm_count", lambda: 8)
    linear.linear_config.cache_clear()
    try:
        hq, hk, d, k = 4, 1, 64, 512
        sizes = [hq * d, hk * d, hk * d]
        assert [linear.linear_config(n, k).split for n in sizes] == [1, 2, 2]
        cfg = qkv.merge_config(sizes, k, 2)
        assert cfg == linear.linear_config(sum(sizes), k) and cfg.split == 1
        assert [(g, c) for g, c in qkv.plan(sizes, k, 2)] == [((0, 1, 2), cfg)]
        mods = [torch.nn.Linear(k, n, bias=False).bfloat16() for n in sizes]
        with torch.no_grad():
            for m in mods:
                m.weight.copy_(_w(m.out_features, k))
        x = torch.randn(3, k, generator=G).bfloat16()
        own = [linear.matmul(x, m.weight.t()) for m in mods]  # each with its own config (k/v: split 2)
        (whole,), _ = qkv.merged_weight(mods)
        assert all(m.weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for m in mods)
        linear.share_config(whole, cfg)
        merged = linear.partials(x, whole.t(), cfg)
        cols = [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
        for i, m in enumerate(mods):
            alone = linear.partials(x, m.weight.t())
            assert alone.shape[0] == cfg.split and torch.equal(alone, merged[:, :, cols[i] : cols[i + 1]])
            assert torch.equal(linear.matmul(x, m.weight.t()), linear.matmul(x, whole.t())[:, cols[i] : cols[i + 1]])
        assert torch.equal(own[0], linear.matmul(x, mods[0].weight.t()))  # q's own config was the merged one
        assert linear.config_for(whole[:, :256].t(), sum(sizes), 256, 2) == linear.linear_config(sum(sizes), 256)
        key = whole.untyped_storage().data_ptr()
        assert key in linear._SHARED
        import gc

        del whole  # the merged tensor object gone, the projections (views of its storage) alive: they keep the config
        gc.collect()
        assert key in linear._SHARED
        for i, m in enumerate(mods):
            assert torch.equal(linear.partials(x, m.weight.t()), merged[:, :, cols[i] : cols[i + 1]])
        (again,), _ = qkv.merged_weight(mods)  # merged again (a second runner on the model): the same tensor, no copy
        assert again.untyped_storage().data_ptr() == key and all(m.weight.untyped_storage().data_ptr() == key for m in mods)
        del again, merged, mods, m  # the projections gone: the entry leaves with them
        gc.collect()
        assert key not in linear._SHARED
    finally:
        linear.linear_config.cache_clear()


@needs_triton
@pytest.mark.parametrize("k,bias", [(64, False), (1024, True), (1024, False)])
def test_add_rms_norm_partials_equals_the_linear_then_add_rms_norm(k, bias):
    t, n = 5, 96
    x, w = torch.randn(t, k, generator=G).bfloat16(), _w(n, k)
    b = _w(n) if bias else None
    res, nw = torch.randn(1, t, n, generator=G).bfloat16(), (torch.rand(n, generator=G) + 0.5).bfloat16()
    ws = linear.partials(x, w.t())
    assert ws.shape[0] == linear.linear_config(n, k).split
    y = linear.matmul(x, w.t(), bias=b).view(1, t, n)
    assert torch.equal(linear.Partials(ws, b, (1, t, n), torch.bfloat16).value(), y)
    for cast_first in (True, False):
        want = fused.add_rms_norm(y, res, nw, 1e-6, cast_first)
        got = fused.add_rms_norm_partials(ws, b, res, nw, 1e-6, cast_first)
        assert all(torch.equal(a, c) for a, c in zip(got, want))


@needs_triton
@pytest.mark.parametrize("softmax_first,norm", [(True, True), (False, False)])
def test_route_partials_equals_the_router_linear_then_route(softmax_first, norm):
    t, e, k = 4, 32, 1024
    x, w, b = torch.randn(t, k, generator=G).bfloat16(), _w(e, k), _w(e)
    logits = linear.matmul(x, w.t(), bias=b)
    want = fused.route(logits, 4, softmax_first, norm, torch.bfloat16)
    got = fused.route_partials(linear.partials(x, w.t()), b, torch.bfloat16, 4, softmax_first, norm, torch.bfloat16)
    assert torch.equal(got[0], logits) and torch.equal(got[1], want[0]) and torch.equal(got[2], want[1])


def _tiny(arch, layers=2):
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, 512, 0, num_layers=layers), dtype=torch.bfloat16).eval()


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_the_runner_fuses_attention_and_gives_the_modules_bits(arch):
    """The runner's probe passes on the tiny models (bf16); a prefill and two verify blocks give the logits, features
    and pool contents of the same runner calling the attention modules."""
    import pdflash_kernels
    from verifier_svc.experts import ExpertsSeam
    from verifier_svc.kv import KVPool, SequenceKV
    from verifier_svc.runner import ForwardRunner

    model = _tiny(arch)
    inst = pdflash_kernels.install(model, probe=False)
    try:
        seam, cfg = ExpertsSeam(model), model.config
        results = []
        for use_fused in (True, False):
            pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, torch.bfloat16, torch.device("cpu"))
            runner = ForwardRunner(model, seam, pool, max_positions=4 * PAGE)
            assert runner.attention.startswith("fused") and all(a is not None for a in runner.chain.attn), runner.attention
            if not use_fused:
                runner.chain.attn = [None] * len(runner.chain.attn)
            seq = SequenceKV(pool, 4 * PAGE)
            outs = [runner.forward([3, 9, 27, 81, 243, 7, 8], 0, seq, feature_layers=(0, 1)),
                    runner.forward([11], 7, seq, feature_layers=(0, 1)), runner.forward([12, 13, 14], 8, seq)]
            results.append((outs, [k.clone() for k in pool.k], [v.clone() for v in pool.v]))
    finally:
        inst.uninstall()
    (fo, fk, fv), (mo, mk, mv) = results
    for a, b in zip(fo, mo):
        assert torch.equal(a.logits, b.logits)
        assert (a.features is None and b.features is None) or torch.equal(a.features, b.features)
    assert all(torch.equal(a, b) for a, b in zip(fk + fv, mk + mv))


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_a_second_build_on_the_same_attention_shares_the_first_merge_and_outlives_it(arch):
    """Two runners on one model (a warm-up core beside the server's, tests' cores): the second FusedAttention gets the
    first's merged weights (no second copy of q/k/v), and dropping either leaves the projections their merged config,
    so the model's own forward keeps the fused path's K split (stop 45: a dropped second runner took the entry with it
    and gpt-oss's eager reference drifted off the verifier's bits)."""
    import gc

    import pdflash_kernels
    from verifier_svc.fused_attention import FusedAttention

    model = _tiny(arch, layers=1)
    inst = pdflash_kernels.install(model, probe=False)
    try:
        attn = model.model.layers[0].self_attn
        first = FusedAttention.build(attn, model.config, "past_key_values")
        assert not isinstance(first, str), first
        ptrs = [p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)]
        second = FusedAttention.build(attn, model.config, "past_key_values")
        assert len(second.parts) == len(first.parts) and all(a is b for (a, _), (b, _) in zip(second.parts, first.parts))
        assert [p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)] == ptrs
        if first.b is not None:
            assert second.b is first.b
        want = [cfg for _, cfg in first.parts]
        del first, second
        gc.collect()
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            w = proj.weight
            got = linear.config_for(w.t(), w.shape[0], w.shape[1], w.element_size())
            assert got in want, (got, want)
    finally:
        inst.uninstall()


def test_build_refuses_an_attention_with_one_per_head_norm():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention  # noqa: F401

    import pdflash_kernels
    from verifier_svc.fused_attention import FusedAttention

    model = _tiny("qwen3_moe", layers=1)
    inst = pdflash_kernels.install(model, probe=False)
    try:
        attn = model.model.layers[0].self_attn
        attn.k_norm = None
        why = FusedAttention.build(attn, model.config, "past_key_values")
        assert isinstance(why, str) and "q_norm/k_norm" in why
        del attn.q_proj
        assert "no q_proj" in FusedAttention.build(attn, model.config, "past_key_values")
    finally:
        inst.uninstall()


@needs_triton
def test_qkv_rope_write_with_q_apart_when_the_splits_differ():
    """Two parts, each with its own K split (Mixtral-like shapes: q 2 ways, k|v 16): q from its own partials, k|v
    from the merged ones, the same bits as three linears, the rotary and the pool write."""
    hq, hk, d, k, t = 32, 4, 128, 4096, 2
    cfg_q, cfg_kv = linear.linear_config(hq * d, k), linear.linear_config(hk * d, k)  # (k's and v's own, alike)
    assert (cfg_q.split, cfg_kv.split) == (2, 16)
    x = torch.randn(t, k, generator=G).bfloat16()
    ws = [_w(hq * d, k), _w(hk * d, k), _w(hk * d, k)]
    ang = torch.randn(1, t, d, generator=G)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    pages, offs = torch.tensor([0, 0]), torch.tensor([3, 4])
    q, kk, v = (linear.matmul(x, w.t()) for w in ws)
    q, kk = fused.rotary(q.view(1, t, hq, d).transpose(1, 2), kk.view(1, t, hk, d).transpose(1, 2), cos, sin)
    want_k, want_v = torch.zeros(1, hk, PAGE, d).bfloat16(), torch.zeros(1, hk, PAGE, d).bfloat16()
    paged_write_reference(want_k, want_v, kk[0], v.view(1, t, hk, d).transpose(1, 2)[0], pages, offs)
    kp, vp = torch.zeros_like(want_k), torch.zeros_like(want_v)
    got = qkv.qkv_rope_write(x, [(ws[0], cfg_q), (torch.cat(ws[1:]), cfg_kv)], None, hq, hk, d, None, cos, sin, kp, vp,
                             pages, offs)
    assert torch.equal(got, q) and torch.equal(kp, want_k) and torch.equal(vp, want_v)


@needs_triton
@pytest.mark.parametrize("hq,hk,hb", [(5, 2, None), (4, 2, "2"), (3, 1, "8")])
def test_qkv_heads_in_one_program_give_the_one_head_programs_bits(hq, hk, hb, monkeypatch):
    """The interpreter's form of qkv_rope_write (HB heads a program, `qkv.heads_per_program`: every head of a token in
    one tile, or HB = 2 of them) stores q, k and v bit for bit as the GPU's one (token, head) a program does: norms,
    bias, rotary on a half table, q apart from k|v, heads past the last masked."""
    d, k, t = 16, 256, 3
    cfg_q, cfg_kv = linear.linear_config(hq * d, k), linear.linear_config(2 * hk * d, k)
    x = torch.randn(t, k, generator=G).bfloat16()
    wq, wkv = _w(hq * d, k), _w(2 * hk * d, k)
    b = _w((hq + 2 * hk) * d)
    qn, kn = (torch.rand(d, generator=G) + 0.5).bfloat16(), (torch.rand(d, generator=G) + 0.5).bfloat16()
    ang = torch.randn(1, t, d // 2, generator=G)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    pages, offs = torch.tensor([1, 0, 1]), torch.tensor([2, PAGE - 1, 3])
    out = {}
    for form in ("1", hb):
        monkeypatch.setattr(qkv, "_HB", qkv.heads_setting(form))
        kp, vp = torch.zeros(2, hk, PAGE, d).bfloat16(), torch.zeros(2, hk, PAGE, d).bfloat16()
        q = qkv.qkv_rope_write(x, [(wq, cfg_q), (wkv, cfg_kv)], b, hq, hk, d, (qn, kn, 1e-6, 1e-5, True), cos, sin, kp,
                               vp, pages, offs)
        out[form] = (q, kp, vp)
    assert qkv.heads_per_program(hq + 2 * hk) == (int(hb) if hb else qkv.triton.next_power_of_2(hq + 2 * hk))
    assert all(torch.equal(a, c) for a, c in zip(out["1"], out[hb])) and out["1"][1].abs().sum() > 0



def test_qkv_heads_per_program_setting_is_checked(monkeypatch):
    """PDFLASH_QKV_HEADS_PER_PROGRAM: a power of two or a one-line error at import; only the interpreter takes it."""
    import os
    import subprocess
    import sys

    for bad in ("3", "0", "-2", "all"):
        with pytest.raises(ValueError, match="PDFLASH_QKV_HEADS_PER_PROGRAM must be a power of two"):
            qkv.heads_setting(bad)
    assert qkv.heads_setting("") is None and qkv.heads_setting("4") == 4
    r = subprocess.run([sys.executable, "-c", "import pdflash_kernels.qkv"], capture_output=True, text=True,
                       env={**os.environ, "PDFLASH_QKV_HEADS_PER_PROGRAM": "3"})
    assert r.returncode != 0 and "PDFLASH_QKV_HEADS_PER_PROGRAM must be a power of two" in r.stderr
    monkeypatch.setattr(qkv, "_HB", 4)
    monkeypatch.setattr(qkv.runtime, "interpreting", lambda: False)
    assert qkv.heads_per_program(40) == 1  # a GPU: one head a program whatever the setting
