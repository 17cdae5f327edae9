"""pdflash_kernels/fused.py (RMSNorm, rotary, routing in one launch each) and their installation, on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, set by conftest.py). Each fused kernel must give, bit for bit, what the op-by-op
path gives (transformers' formula with pdflash_kernels.dispatch's invariant reductions), and a row's result must not depend
on the other rows. The GPU versions are in tests/test_kernels_gpu.py."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from pdflash_kernels import fused
from pdflash_kernels.dispatch import InvariantMode

from tests.conftest import needs_triton  # noqa: E402
G = torch.Generator().manual_seed(0)


def _norm_op_by_op(x, w, eps, cast_first):
    with InvariantMode():  # the mean through pdflash_kernels.reduce.row_sum, as an installed model runs it
        xf = x.to(torch.float32)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * y.to(x.dtype) if cast_first else (w * y).to(x.dtype)


@needs_triton
@pytest.mark.parametrize("cast_first", [True, False])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("d", [64, 3000])  # one chunk; two chunks with a ragged tail
def test_rms_norm_equals_the_op_by_op_path(cast_first, dtype, wdtype, d):
    x = (torch.randn(5, 2, d, generator=G) * 3).to(dtype)
    w = torch.randn(d, generator=G).to(wdtype)
    want = _norm_op_by_op(x, w, 1e-6, cast_first)
    got = fused.rms_norm(x, w, 1e-6, cast_first)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(fused.rms_norm(x[:1, :1], w, 1e-6, cast_first), got[:1, :1])  # rows independent


@needs_triton
@pytest.mark.parametrize("cast_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_equals_the_add_then_the_norm(cast_first, dtype):
    x = (torch.randn(4, 3000, generator=G) * 3).to(dtype)
    res = (torch.randn(4, 3000, generator=G) * 3).to(dtype)
    w = torch.randn(3000, generator=G).to(dtype)
    total, y = fused.add_rms_norm(x, res, w, 1e-5, cast_first)
    assert torch.equal(total, x + res)
    assert torch.equal(y, fused.rms_norm(x + res, w, 1e-5, cast_first))
    assert torch.equal(y, _norm_op_by_op(x + res, w, 1e-5, cast_first))
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(x, res.float() if dtype != torch.float32 else res.bfloat16(), w, 1e-5, cast_first)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@needs_triton
@pytest.mark.parametrize("half_table", [False, True])
@pytest.mark.parametrize("cos_dtype", [torch.bfloat16, torch.float32])
def test_rotary_equals_the_formula(half_table, cos_dtype):
    b, hq, hk, t, d = 2, 4, 2, 3, 16
    q = torch.randn(b, t, hq, d, generator=G).bfloat16().transpose(1, 2)  # the attention modules' permuted layout
    k = torch.randn(b, t, hk, d, generator=G).bfloat16().transpose(1, 2)
    ang = torch.randn(b, t, d // 2, generator=G)
    cos, sin = ang.cos().to(cos_dtype), ang.sin().to(cos_dtype)
    if half_table:  # gpt-oss: first*cos - second*sin, second*cos + first*sin, then cat
        def ref(x):
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        tc, ts = cos, sin
    else:  # Llama / Qwen3 / Mixtral: x * cos + rotate_half(x) * sin over a duplicated table
        tc, ts = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

        def ref(x):
            return x * tc.unsqueeze(1) + _rotate_half(x) * ts.unsqueeze(1)
    assert fused.rotary_supported(q, k, tc, ts)
    gq, gk = fused.rotary(q, k, tc, ts, contiguous=half_table)
    for got, x in ((gq, q), (gk, k)):
        want = ref(x)
        assert got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.equal(got, want)
    one_q, _ = fused.rotary(q[:1, :, 1:2], k[:1, :, 1:2], tc[:1, 1:2], ts[:1, 1:2], contiguous=half_table)
    assert torch.equal(one_q, gq[:1, :, 1:2])  # one position alone: the same bits
    # the table as transformers <= 5.17 builds it ((inv_freq @ positions).transpose(1, 2): last stride T), same bits
    tct, tst = tc.transpose(1, 2).contiguous().transpose(1, 2), ts.transpose(1, 2).contiguous().transpose(1, 2)
    assert tct.stride(-1) == t and torch.equal(tct, tc)
    assert fused.rotary_supported(q, k, tct, tst)
    sq, sk = fused.rotary(q, k, tct, tst, contiguous=half_table)
    assert torch.equal(sq, gq) and torch.equal(sk, gk)


@needs_triton
def test_rotary_refuses_layouts_it_does_not_take():
    q, k = torch.randn(1, 4, 3, 16).bfloat16(), torch.randn(1, 2, 3, 16).bfloat16()
    cos = torch.randn(1, 3, 16).bfloat16()
    assert fused.rotary_supported(q, k, cos, cos)
    assert not fused.rotary_supported(q, k, cos, cos, unsqueeze_dim=2)
    assert not fused.rotary_supported(q, k, torch.randn(1, 3, 12).bfloat16(), torch.randn(1, 3, 12).bfloat16())
    assert not fused.rotary_supported(q, k.float(), cos, cos)
    assert not fused.rotary_supported(q[..., ::2], k[..., ::2], cos[..., :8], cos[..., :8])


def _route_op_by_op(logits, k, softmax_first, norm, dtype):
    with InvariantMode():
        if softmax_first:
            v, i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
            if norm:
                v /= v.sum(dim=-1, keepdim=True)
            return v.to(dtype), i
        v, i = torch.topk(logits, k, dim=-1)
        return torch.softmax(v, dim=1, dtype=v.dtype), i


@needs_triton
@pytest.mark.parametrize("softmax_first,norm,dtype", [(True, True, torch.bfloat16), (True, True, torch.float32),
                                                      (True, False, torch.bfloat16), (False, False, torch.bfloat16)])
@pytest.mark.parametrize("e,k", [(128, 8), (32, 4), (8, 2)])
def test_route_equals_the_op_by_op_path(softmax_first, norm, dtype, e, k):
    # distinct logits (exact in bf16): torch.topk orders tied values as it likes, the fused kernel by expert id
    logits = torch.stack([(torch.randperm(e, generator=G) - e / 2) / 16 for _ in range(6)]).bfloat16()
    want_v, want_i = _route_op_by_op(logits, k, softmax_first, norm, dtype)
    v, i = fused.route(logits, k, softmax_first, norm, dtype)
    assert torch.equal(i, want_i)
    assert v.dtype == want_v.dtype and torch.equal(v, want_v)
    v1, i1 = fused.route(logits[2:3], k, softmax_first, norm, dtype)
    assert torch.equal(v1, v[2:3]) and torch.equal(i1, i[2:3])


@needs_triton
def test_route_with_tied_logits_is_a_top_k_in_expert_order():
    logits = torch.randn(16, 128, generator=G).bfloat16()  # bf16 logits: ties are common
    v, i = fused.route(logits, 8, True, False, torch.float32)
    with InvariantMode():
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    assert torch.equal(torch.gather(probs, 1, i), v)
    assert torch.equal(v, torch.topk(probs, 8, dim=-1).values)  # the same values (which of tied experts: may differ)
    tied = v[:, 1:] == v[:, :-1]
    assert tied.any() and bool((i[:, 1:] > i[:, :-1])[tied].all())


@needs_triton
def test_route_breaks_ties_to_the_lower_expert():
    logits = torch.zeros(1, 8).bfloat16()
    logits[0, 5] = 1.0
    _, ids = fused.route(logits, 3, True, True, torch.bfloat16)
    assert ids.tolist() == [[5, 0, 1]]


# DeepSeek-V3 / Kimi K2 (256 experts, 8 groups, 4 kept, top 8), Nemotron 3 Nano (128, 1 group, top 6), a small one
GROUP_ROUTES = {"deepseek-v3": (256, 8, 8, 4, True, 2.5), "nemotron-3-nano": (128, 6, 1, 1, True, 2.5),
                "small": (64, 4, 4, 2, False, 1.0)}


def _group_routes(name, t=9, seed=0):
    from pdflash_kernels.installer import GroupRoute

    e, k, g, tg, norm, scale = GROUP_ROUTES[name]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=gen), torch.randn(e, generator=gen) * 0.1, GroupRoute(k, g, tg, norm, scale,
                                                                                            torch.float32)


@needs_triton
@pytest.mark.parametrize("name", list(GROUP_ROUTES))
def test_group_route_is_the_routers_formula_and_row_invariant(name):
    """DeepSeek-V3's group routing in one launch (sigmoid, correction bias, groups by their two best, top-k of the kept
    groups, normalized, scaled): the experts of transformers' formula and its weights to float32 rounding; a row alone
    has the bits it has among others."""
    from pdflash_kernels.installer import _group_route_reference, _same_routes

    logits, bias, g = _group_routes(name)
    _, w, ids = fused.group_route(logits, bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale)
    assert _same_routes(w, ids, *_group_route_reference(logits, bias, g))
    for r in (0, 4):
        _, w1, i1 = fused.group_route(logits[r:r + 1], bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale)
        assert torch.equal(w1, w[r:r + 1]) and torch.equal(i1, ids[r:r + 1])
    assert bool((ids[:, :-1] != ids[:, 1:]).all())  # k distinct experts


@needs_triton
def test_group_route_from_the_linears_partials_stores_the_linears_logits():
    """With the router linear's K partials the kernel writes the logits `matmul` stores, bit for bit, and routes them
    as it routes those logits."""
    from pdflash_kernels import linear

    _, bias, g = _group_routes("deepseek-v3")
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 128, generator=gen), torch.randn(256, 128, generator=gen) * 0.1
    logits, fw, fi = fused.group_route(None, bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale,
                                       ws=linear.partials(x, w.t()))
    assert torch.equal(logits, linear.matmul(x, w.t()))
    _, w2, i2 = fused.group_route(logits, bias, g.top_k, g.n_group, g.topk_group, g.norm, g.scale)
    assert torch.equal(fw, w2) and torch.equal(fi, i2)


@needs_triton
@pytest.mark.parametrize("arch", ["deepseek_v3", "nemotron_h", "glm4_moe"])
def test_installed_group_routers_are_fused_and_give_the_op_by_op_logits(arch):
    """DeepSeek-V3-style routers (Nemotron-H's, GLM-4.5's: sigmoid scores, a correction bias, group top-k) run fused
    (their linear's partials + one routing launch), and the model's logits are those of the op-by-op routers."""
    from transformers import AutoModelForCausalLM

    import pdflash_kernels
    from pdflash.tiny import generic_config
    from pdflash_kernels import installer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(generic_config(arch, 512, 0, 2), dtype=torch.bfloat16).eval()
    for r in installer.routers(model).values():
        torch.nn.init.normal_(r.e_score_correction_bias, std=0.05)  # (random checkpoints hold zeros)
    other = copy.deepcopy(model)
    inst = pdflash_kernels.install(model, probe=False)
    ref = pdflash_kernels.install(other, probe=False, fuse=False)
    try:
        n = len(installer.routers(model))
        assert inst.summary()["fused"]["router"] == f"triton ({n} of {n} routers)", inst.summary()["fused"]
        assert all(installer.router_variant(r)[0] == "group" for r in installer.routers(model).values())
        ids = torch.randint(2, 500, (1, 6), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            a, b = model(ids).logits, other(ids).logits
        torch.testing.assert_close(a.float(), b.float(), rtol=0.0, atol=2e-2 * b.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    finally:
        inst.uninstall()
        ref.uninstall()


@needs_triton
def test_a_group_routing_kernel_that_disagrees_is_said_and_not_used(monkeypatch):
    """A group router whose probe finds the kernel disagreeing with the router keeps its own ops, and the report says
    why (never a silent fallback); so does one with PDFLASH_GROUP_ROUTE=0."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import generic_config
    from pdflash_kernels import installer

    model = AutoModelForCausalLM.from_config(generic_config("deepseek_v3", 512, 0, 2)).eval()
    real = fused.group_route

    def wrong(*args, **kwargs):
        logits, w, ids = real(*args, **kwargs)
        return logits, w, (ids + 1) % model.config.n_routed_experts

    monkeypatch.setattr(fused, "group_route", wrong)
    monkeypatch.setattr(installer, "_ROUTE_VARIANTS_SEEN", {})
    report, undo = installer.install_fused(model)
    for u in undo:
        u()
    assert report["router"].startswith("transformers; not fused: DeepseekV3TopkRouter (the group-routing kernel "
                                       "disagreed with the router on a probe)"), report
    monkeypatch.setattr(fused, "group_route", real)
    monkeypatch.setattr(installer, "_ROUTE_VARIANTS_SEEN", {})
    monkeypatch.setattr(installer, "GROUP_ROUTE", False)  # PDFLASH_GROUP_ROUTE=0: the A/B's other side
    report, undo = installer.install_fused(model)
    for u in undo:
        u()
    assert report["router"] == "transformers; not fused: DeepseekV3TopkRouter (PDFLASH_GROUP_ROUTE=0)", report


# ---- the installation --------------------------------------------------------------------------------------
def _tiny(arch):
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, 512, 0, num_layers=1), dtype=torch.bfloat16).eval()


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_installed_fused_kernels_give_the_op_by_op_logits(arch):
    """Every RMSNorm, the rotary function and every router run fused, and the logits equal those of the same model
    with the kernels installed op by op (fuse=False), bit for bit; uninstalling puts transformers' code back."""
    import pdflash_kernels
    from pdflash_kernels import installer

    model = _tiny(arch)
    other = copy.deepcopy(model)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original_rotary = modeling.apply_rotary_pos_emb
    inst = pdflash_kernels.install(model, probe=False)  # (the probe's forwards: slow under the interpreter, tested elsewhere)
    ref = pdflash_kernels.install(other, probe=False, fuse=False)
    try:
        report = inst.summary()["fused"]
        n_norms = len(installer.norm_modules(model))
        assert report["rms_norm"] == f"triton ({n_norms} of {n_norms} modules)", report
        assert report["rotary"].startswith("triton"), report
        assert report["router"] == "triton (1 of 1 routers)", report
        assert ref.summary()["fused"] == {}
        ids = torch.randint(2, 500, (1, 5), generator=torch.Generator().manual_seed(1))
        before = installer.CALLS["fused"]
        with torch.inference_mode():
            a, b = model(ids).logits, other(ids).logits
        assert installer.CALLS["fused"] - before == n_norms + 1 + 1  # norms, rotary per layer, routers
        assert torch.equal(a, b)
    finally:
        inst.uninstall()
        ref.uninstall()
    assert modeling.apply_rotary_pos_emb is original_rotary
    assert all("forward" not in m.__dict__ for m in model.modules())


@needs_triton
def test_the_patched_rotary_runs_transformers_code_outside_an_installed_forward():
    """A second model of the same architecture in the process (a reference, not installed) keeps transformers' own
    rotary while the patch is in place."""
    import pdflash_kernels
    from pdflash_kernels import installer

    model, plain = _tiny("qwen3_moe"), _tiny("qwen3_moe")
    inst = pdflash_kernels.install(model, probe=False)
    try:
        before = installer.CALLS["fused"]
        with torch.inference_mode():
            plain(torch.tensor([[3, 4, 5]]))
        assert installer.CALLS["fused"] == before
    finally:
        inst.uninstall()


class _GemmaLikeRMSNorm(nn.Module):  # (1 + weight): a formula the fused kernel does not compute
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight.float())).to(x.dtype)


@needs_triton
def test_an_unrecognised_norm_keeps_its_own_ops_and_is_reported():
    import pdflash_kernels

    model = _tiny("qwen3_moe")
    d = model.config.hidden_size
    model.model.norm = _GemmaLikeRMSNorm(d).to(torch.bfloat16)
    inst = pdflash_kernels.install(model, probe=False)
    try:
        report = inst.summary()["fused"]["rms_norm"]
        assert "not fused: _GemmaLikeRMSNorm (an unrecognised formula)" in report, report
        assert "forward" not in model.model.norm.__dict__
        assert inst.attention.startswith("triton") and inst.dense.startswith("triton")  # its ops: invariant reductions
    finally:
        inst.uninstall()


_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pdflash_kernels import fused

import os
PDL = os.environ.get("PDFLASH_PDL") == "1"
AFTER_WAIT = os.environ.get("PDFLASH_PDL_TRIGGER") == "after-wait"

def ptx(fn, types, const):
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(fused.LAUNCH_OPTIONS))
    assert k.asm["cubin"], fn
    # PDFLASH_PDL=1: every forward kernel waits for the one before it (runtime.pdl_begin), else none does
    p = k.asm["ptx"]
    assert ("griddepcontrol.wait" in p) == PDL, (fn, PDL)
    if PDL:  # PDFLASH_PDL_TRIGGER: the next kernel may launch before this one's wait ("start") or after it
        assert (p.index("griddepcontrol.wait") < p.index("griddepcontrol.launch_dependents")) == AFTER_WAIT, (fn, AFTER_WAIT)
    return p

bf = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16", sum_ptr="*bf16", eps="fp32", scale="fp32")
for d, cast, res, split in ((2048, True, False, 0), (2880, False, False, 0), (128, True, False, 0), (2048, True, True, 0),
                           (2048, True, True, 8), (2880, False, True, 1)):  # split: x from a linear's partials
    types = {**bf, "x_ptr": "*fp32", "bias_ptr": "*bf16", "M": "i32"} if split else {**bf, "M": "i32"}
    p = ptx(fused._rms_norm_kernel, types, dict(D=d, CAST_FIRST=cast, XROUND=1, OROUND=1, BLOCK=min(2048, triton.next_power_of_2(d)),
                                                EMULATE=False, HAS_RES=res, SPLIT=split, HAS_BIAS=split == 1,
                                                **({} if split else dict(bias_ptr=None))))
    assert "fma." not in p, "x * x contracted into the sum"
from pdflash_kernels import qkv
qt = dict(ws_a="*fp32", ws_b="*fp32", bias_ptr="*bf16", qn_ptr="*bf16", kn_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_ptr="*bf16",
          kp_ptr="*bf16", vp_ptr="*bf16", pages_ptr="*i64", offs_ptr="*i64", q_eps="fp32", k_eps="fp32", scale="fp32")
for hq, hk, d, split, bias, norm, half, ha in ((32, 4, 128, 8, False, True, False, 40), (64, 8, 64, 8, True, False, True, 80),
                                              (32, 8, 128, 8, False, False, False, 32)):  # the last: Mixtral, q apart
    p = ptx(qkv._qkv_rope_kernel, qt, dict(HQ=hq, HK=hk, D=d, HA=ha, SPLIT_A=split, SPLIT_B=16 if ha == hq else split,
                                           HAS_BIAS=bias, NORM=norm, CAST_FIRST=True,
                                           XROUND=1, NROUND=1, ROUND=1, HALF_TABLE=half, BLOCK=d, EMULATE=False, HB=1))
    assert "fma." not in p, "a product contracted into a sum (norm or rotary)"
rt = dict(q_ptr="*bf16", k_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", qo_ptr="*bf16", ko_ptr="*bf16")
for d, half, rnd in ((128, False, 1), (64, True, 1), (128, False, 0)):
    c = dict(cos_ptr="*fp32", sin_ptr="*fp32", qo_ptr="*fp32", ko_ptr="*fp32") if rnd == 0 else {}
    p = ptx(fused._rotary_kernel, {**rt, **c}, dict(D=d, HALF_TABLE=half, ROUND=rnd, BLOCK=d, EMULATE=False))
    assert "fma." not in p, "a product contracted into the sum"
for e, k, sf, norm, st in ((128, 8, True, True, "*bf16"), (32, 4, False, False, "*bf16"), (8, 2, True, True, "*fp32")):
    for split in (0, 8):
        extra = dict(ws_ptr="*fp32", bias_ptr="*bf16") if split else {}
        ptx(fused._route_kernel, dict(logits_ptr="*bf16", scores_ptr=st, ids_ptr="*i64", **extra),
            dict(E=e, K=k, SOFTMAX_FIRST=sf, NORM=norm, BLOCK_E=e, BLOCK_K=k, EMULATE=False, SPLIT=split,
                 HAS_BIAS=False, XROUND=1, **({} if split else dict(ws_ptr=None, bias_ptr=None))))
for e, k, g, tg, split in ((256, 8, 8, 4, 0), (256, 8, 8, 4, 8), (128, 6, 1, 1, 8)):  # DeepSeek-V3's, Nemotron 3 Nano's
    ptx(fused._group_route_kernel, dict(logits_ptr="*fp32", bias_ptr="*fp32", scores_ptr="*fp32", ids_ptr="*i64",
                                        ws_ptr="*fp32", scale="fp32"),
        dict(E=e, K=k, G=g, TOPK_GROUP=tg, NORM=True, BLOCK_E=e, BLOCK_G=max(2, g), BLOCK_K=triton.next_power_of_2(k), EMULATE=False,
             SPLIT=split))
from pdflash_kernels import linear
const = dict(N=512, K=2048, K_PER_SPLIT=256, SPLIT=8, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, PRECISION="tf32",
             F32DOT=False, FIXUP=True, PARTIALS=False, MT=1, LOOP_STAGES=None)
p = ptx(linear._linear_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32",
                                    cnt_ptr="*i32"), const)
assert "atom.global.gpu.acq_rel.add" in p and "ld.global.cg" in p, "the one-launch linear's semaphore or L2 reads"
ptx(linear._linear_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", bias_ptr="*fp32", out_ptr="*fp32", ws_ptr="*fp32",
                                cnt_ptr="*fp32"), {**const, "SPLIT": 1, "HAS_BIAS": False, "FIXUP": False, "PARTIALS": True})
from pdflash_kernels import attention
at = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", pos_ptr="*i64", kmask_ptr="*i64", sink_ptr="*fp32",
          table_ptr="*i32", ws_ptr="*fp32", ml_ptr="*fp32", cnt_ptr="*i32", cu_ptr="*i32", scaling="fp32", qr_ptr="*bf16",
          kr_ptr="*bf16")
dummy = dict(ws_ptr="*bf16", ml_ptr="*bf16", cnt_ptr="*bf16")  # one program: the launcher passes the output as the buffers
# (ragged: a multi-session wave's rows, sequence b's from cu_ptr; else the launcher passes the positions as cu_ptr)
for progs, paged, sink, group, ragged in ((16, True, False, 8, False), (1, True, True, 8, False), (1, False, False, 4, False),
                                          (16, True, False, 8, True), (1, True, True, 8, True)):
    p = ptx(attention._attn_kernel, {**(at if progs > 1 else {**at, **dummy}), **({} if ragged else {"cu_ptr": "*i64"})},
            dict(GROUP=group, D=128 if group != 8 or not sink else 64, HAS_SINK=sink, HAS_KMASK=not paged,
                 BLOCK_M=16, BLOCK_N=64, SEG_CHUNKS=attention.SEG_CHUNKS, PROGRAMS=progs,
                 DIRECT_SEGS=attention.DIRECT_SEGS, F32DOT=False, PAGED=paged, RAGGED=ragged, DR=0, BLOCK_DR=0,
                 V_IS_K=False))
    if progs > 1:
        assert "atom.global.gpu.acq_rel.add" in p and "ld.global.cg" in p, "the split attention's semaphore or L2 reads"
from pdflash_kernels import moe
al = dict(ids_ptr="*i64", nvalid_ptr="*i64", slot_ptr="*i32", sorted_ptr="*i32", block_slot_ptr="*i32", num_blocks_ptr="*i32",
          valid_ptr="*i1", phase_ptr="*i8", block_phase_ptr="*i8")
for e, ch, phase, slot in ((128, 64, False, True), (128, 1024, True, True), (32, 256, False, False), (8, 64, True, True),
                          (60, 128, False, True)):  # the align's histogram, sort and gather
    ptx(moe._align_kernel, al, dict(E=e, NB=triton.next_power_of_2(e), TOPK=8 if e == 128 else 4, BM=16, HAS_NVALID=True,
                                    HAS_SLOT=slot, HAS_PHASE=phase, CH=ch, C=64, PAD_C=1024, SORT=e != 60))
g2 = dict(h_ptr="*bf16", y_ptr="*fp32", sorted_pairs_ptr="*i32", block_slot_ptr="*i32", num_blocks_ptr="*i32", rw_ptr="*bf16",
          w_ptr="*bf16", s_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", cnt_ptr="*i32", valid_ptr="*i1", ws_ptr="*fp32",
          scnt_ptr="*i32", block_phase_ptr="*i8")
for persist, fp4 in ((False, False), (True, True)):
    types = {**g2, "w_ptr": "*u8", "s_ptr": "*u8"} if fp4 else g2
    p = ptx(moe._moe_gemm2, types, dict(N=2048, K=768, FP4=fp4, HAS_BIAS=fp4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                        DECODE=moe.DECODE_WORD if fp4 else 0, F32DOT=False, A_LOAD=moe.A_JOIN if fp4 else 0,
                                        SWAP=False, RASTER=0, PERSIST=persist, COMBINE=True, TOPK=8, TOPK_PAD=8,
                                        S_AHEAD=int(fp4), S_WORDS=False, LOOP_STAGES=None, SPLIT=1, SPAN=768, FIXUP=False,
                                        PHASE=2 if persist else 0))  # (moe_forward's second phase, and one phase)
    assert "atom.global.gpu.acq_rel.add" in p and "ld.global.cg" in p, "the fused combine's semaphore or L2 reads"
# The K loops as the launcher specializes them (pointers and int arguments divisible by 16, arguments equal to 1 as
# constants: without that Triton pipelines nothing): every dot operand streams ahead through cp.async. Guards against
# a change that quietly turns a loop's loads synchronous (one memory round trip per step).
import re


def compiled_ir(fn, types, const, div, warps, stages):
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages)).asm["ttgir"]


def loop_loads(ir):
    """The first K loop of a kernel's TTGIR: its header line, its synchronous loads' types and its streamed ones'."""
    lines = ir.splitlines()
    start = next(i for i, line in enumerate(lines) if "scf.for" in line)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines)) if len(lines[i]) - len(lines[i].lstrip()) <= indent)
    body = "\n".join(lines[start + 1 : end])  # (nested regions included)
    sync = re.findall(r"tt\.load .*: (tensor<[^>]*>)", body)
    streamed = re.findall(r"async_copy_global_to_local .*: (tensor<[^>]*>)", body)
    return lines[start], sync, streamed


lt = dict(a_ptr="*bf16", b_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
cfg = linear.linear_config(5120, 2048)  # Qwen3-30B-A3B's q/k/v
lc = dict(N=5120, K=2048, K_PER_SPLIT=cfg.k_per_split, SPLIT=cfg.split, HAS_BIAS=False, BLOCK_M=cfg.block_m,
          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION="tf32", F32DOT=False, FIXUP=False, PARTIALS=True, MT=1,
          LOOP_STAGES=None, stride_ak=1, stride_bk=1)  # a contiguous, the weight's transposed view: unit strides along K
_, sync, streamed = loop_loads(compiled_ir(linear._linear_kernel, lt, lc, [n for n in linear._linear_kernel.arg_names
                                           if n.endswith("_ptr") or n in ("stride_am", "stride_bn", "stride_om")],
                                           cfg.num_warps, cfg.num_stages))
assert len(streamed) == 2 and not sync, ("the linear's K loop", sync, streamed)
# four 16-row tiles against each weight tile (pdflash_kernels.linear.m_tiles, a 33..64-row call): every row tile's activations
# stream too, and each is its own 16-row dot
_, sync, streamed = loop_loads(compiled_ir(linear._linear_kernel, lt, {**lc, "BLOCK_M": 16, "MT": 4, "LOOP_STAGES": cfg.num_stages}, [n for n in linear._linear_kernel.arg_names
                                           if n.endswith("_ptr") or n in ("stride_am", "stride_bn", "stride_om")],
                                           cfg.num_warps, cfg.num_stages))
assert len(streamed) == 5 and not sync, ("the linear's K loop over 4 row tiles", sync, streamed)
for mt in (1, 4):  # the same MMA for every row tile whatever MT: a row's bits cannot depend on the call's row count
    mmas = set(re.findall(r"(mma\.sync\.aligned\.\S+|wgmma\.\S+)", ptx(linear._linear_kernel, lt, {**lc, "BLOCK_M": 16, "MT": mt, "LOOP_STAGES": 4 if mt > 1 else None})))
    assert mmas == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}, (mt, mmas)
ac = dict(GROUP=8, D=128, HAS_SINK=False, HAS_KMASK=False, BLOCK_M=16, BLOCK_N=64, SEG_CHUNKS=attention.SEG_CHUNKS,
          PROGRAMS=1, DIRECT_SEGS=attention.DIRECT_SEGS, F32DOT=False, PAGED=True, RAGGED=False, DR=0, BLOCK_DR=0, V_IS_K=False)
_, sync, streamed = loop_loads(compiled_ir(attention._attn_kernel, {**at, **dummy}, ac, [n for n in attention._attn_kernel.arg_names
                                           if n.endswith("_ptr") or n in ("sqb", "sqh", "sqt", "skb", "skh", "sks", "svb",
                                                                          "svh", "svs", "sob", "sot", "soh")], 4, 3))
assert sum("64x128xbf16" in t or "64x128x!tt.ptr<bf16>" in t for t in streamed) == 2 and not sync, ("the paged attention's chunk loop", sync, streamed)
# The MXFP4 gate/up GEMM, compiled as launched by benchmarks/kernels_sass.py's compile_gemm (pointers and strides
# divisible by 16 but the scale rows': gpt-oss-20b's hold 90 bytes). Its packed weights and activations stream ahead
# either way; at gpt-oss's shape its scales (BK/32 bytes a row: too narrow for cp.async) load in the loop, and with
# s_ahead those loads are the next step's, carried by the loop (gate and up tiles).
from benchmarks.kernels_sass import compile_gemm
for ahead in (0, 1):
    c = moe.variant_config(2880, 2880, 4, True, {**moe.FP4_DEFAULT, "s_ahead": ahead})
    loop, sync, streamed = loop_loads(compile_gemm(1, c, "gpt-oss-20b", True)[0].asm["ttgir"])
    carried = re.findall(r"tensor<\d+x\d+xi8", loop.split(") -> (")[1])
    assert len(streamed) == 3 and len(sync) == 2, ("the FP4 GEMM's K loop", ahead, sync, streamed)
    assert len(carried) == 2 * ahead, ("scale tiles carried by the K loop", ahead, carried)
# s_ahead=2: the tile's scale rows prefetched into L1 before the K loop (pair words, both GEMMs); none without it
for gemm, n_, k_ in ((1, 768, 2048), (2, 2048, 768)):
    for name in ("pair_k256_raster_pf", "pair_k256_raster"):
        c = moe.variant_config(n_, k_, 8, True, moe.SWEEP_VARIANTS[name])
        p = compile_gemm(gemm, c, "qwen3-30b-a3b", True)[0].asm["ptx"]
        assert ("prefetch.global.L1" in p) == name.endswith("_pf"), ("the scale rows' prefetch", gemm, name)
# With s_words (Qwen3-30B-A3B's gate/up: 64 scale bytes a row, 4-byte aligned) the scales are read as 32-bit words and
# stream ahead like the weights: nothing in the K loop waits on a synchronous load.
c = moe.variant_config(768, 2048, 8, True, moe.SWEEP_VARIANTS["join_bf16_k128_sw"])
_, sync, streamed = loop_loads(compile_gemm(1, c, "qwen3-30b-a3b", True)[0].asm["ttgir"])
assert not sync and sum("i32" in t for t in streamed) == 2 and len(streamed) == 5, ("streamed scale words", sync, streamed)
# split K (MoeConfig.split_k; compile_gemm: the one-launch form): a K range's loop streams its operands as the whole K
# loop does; the tile's last program is found by a gpu-scope acq_rel atomic and reads the partials from L2
for gemm, n_, k_ in ((1, 2880, 2880), (2, 2880, 2880)):
    c = moe.variant_config(n_, k_, 4, True, moe.SWEEP_VARIANTS["join_bf16_raster_split2"])
    kern = compile_gemm(gemm, c, "gpt-oss-20b", True)[0]
    loop, sync, streamed = loop_loads(kern.asm["ttgir"])
    assert len(streamed) == (3 if gemm == 1 else 2), ("a split's K loop", gemm, sync, streamed)
    assert "atom.global.gpu.acq_rel.add" in kern.asm["ptx"] and "ld.global.cg" in kern.asm["ptx"], "the split's semaphore"
print("compiled")
'''


def test_fused_kernels_compile_for_an_h200_without_contracting_products_into_sums():
    """The interpreter runs the kernels' logic; this compiles them for sm_90 with Triton and the ptxas it ships (no GPU
    needed) at the real models' shapes, and checks the PTX keeps each product rounded before its sum (no fma: torch's
    op-by-op path rounds there too); also the one-launch linear (pdflash_kernels.linear ONE_LAUNCH): its tile semaphore is a
    gpu-scope acq_rel atomic and the partials are read from L2; and the K loops of the linear, the paged attention and
    the MXFP4 GEMM stream their dot operands ahead (cp.async), the MXFP4 scales a step ahead with s_ahead, and a split-K
    GEMM's K ranges as well (its semaphore as the linear's)."""
    import os
    import pathlib
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[1]
    # PDFLASH_PDL=1: the same kernels with the programmatic-dependent-launch wait, its trigger before or after the wait
    for pdl, trigger in (("0", "start"), ("1", "start"), ("1", "after-wait")):
        r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, capture_output=True, text=True, timeout=300,
                           env={**env, "PYTHONPATH": str(root), "PDFLASH_PDL": pdl, "PDFLASH_PDL_TRIGGER": trigger})
        assert r.returncode == 0 and "compiled" in r.stdout, (pdl, trigger, r.stderr[-3000:])


# ---- the pre-norm chain (verifier_svc/prenorm.py) ----------------------------------------------------------------
def _chain_kwargs(model, kw_name):
    def make(h, pos, cache):
        return dict(attention_mask=None, position_ids=pos, use_cache=True,
                    position_embeddings=model.model.rotary_emb(h, pos), **{kw_name: cache})
    return make


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_prenorm_chain_gives_the_layers_bits(arch):
    """Each residual add fused into the next norm: the final normed rows and every layer's output equal running the
    layers as they are, then the final norm."""
    import pdflash_kernels
    from pdflash.hf_compat import cache_kwarg
    from verifier_svc.prenorm import PreNormChain, _ProbeCache

    from transformers import AutoModelForCausalLM

    from pdflash.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, 512, 0, num_layers=2), dtype=torch.bfloat16).eval()
    inst = pdflash_kernels.install(model, probe=False)
    try:
        layers, kw = model.model.layers, cache_kwarg(model.model.layers[0])
        make = _chain_kwargs(model, kw)
        with torch.inference_mode(), InvariantMode():
            chain = PreNormChain.probe(model, layers, model.model.norm, make)
            assert isinstance(chain, PreNormChain), chain
            h = torch.randn(1, 4, model.config.hidden_size, generator=G).bfloat16()
            pos = torch.arange(5, 9).unsqueeze(0)
            x, feats = chain.run(h, {k: v for k, v in make(h, pos, _ProbeCache()).items()}, (0, 1))
            ref, outs = h, []
            for layer in layers:
                ref = layer(ref, **make(ref, pos, _ProbeCache()))
                ref = ref[0] if isinstance(ref, tuple) else ref
                outs.append(ref)
            ref = model.model.norm(ref)
        assert torch.equal(x, ref)
        assert [i for i, _ in feats] == [0, 1] and all(torch.equal(f, o) for (_, f), o in zip(feats, outs))
    finally:
        inst.uninstall()


@needs_triton
def test_prenorm_chain_refuses_a_layer_with_another_dataflow():
    """A layer that norms the attention's output before the add (a sandwich norm) is not the chain's pattern."""
    import pdflash_kernels
    from pdflash.hf_compat import cache_kwarg
    from verifier_svc.prenorm import PreNormChain

    model = _tiny("qwen3_moe")
    layer = model.model.layers[0]
    cls, kw = type(layer), cache_kwarg(layer)

    class Sandwich(cls):
        def forward(self, hidden_states, **kwargs):
            r = hidden_states
            a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
            h = r + self.post_attention_layernorm(a)
            return h + self.mlp(self.post_attention_layernorm(h))

    layer.__class__ = Sandwich
    inst = pdflash_kernels.install(model, probe=False)
    try:
        with torch.inference_mode(), InvariantMode():
            why = PreNormChain.probe(model, model.model.layers, model.model.norm, _chain_kwargs(model, kw))
        assert isinstance(why, str) and "calls" in why, why
        model.model.norm.__dict__.pop("forward")  # the final norm left unfused: refused before any probe forward
        with torch.inference_mode(), InvariantMode():
            why = PreNormChain.probe(model, model.model.layers, model.model.norm, _chain_kwargs(model, kw))
        assert why == "the final norm does not run on the fused RMSNorm"
    finally:
        inst.uninstall()


@needs_triton
def test_stubbed_experts_return_zeros_and_touch_nothing():
    """pdflash_kernels.installer.experts_stubbed (the pre-norm chain's probe): the experts module answers zeros without running
    a kernel (CALLS unchanged), and outside the context the kernels run again."""
    import pdflash_kernels
    from pdflash_kernels import installer

    model = _tiny("qwen3_moe")
    inst = pdflash_kernels.install(model, probe=False)
    try:
        experts = model.model.layers[0].mlp.experts
        x = torch.randn(3, model.config.hidden_size, generator=G).bfloat16()
        ids = torch.tensor([[0, 1], [2, 3], [1, 4]])[:, : model.config.num_experts_per_tok]
        w = torch.full(ids.shape, 0.5).bfloat16()
        before = installer.CALLS["experts"]
        with torch.inference_mode():
            with installer.experts_stubbed():
                assert torch.equal(experts(x, ids, w), torch.zeros_like(x))
            assert installer.CALLS["experts"] == before
            assert not torch.equal(experts(x, ids, w), torch.zeros_like(x))
        assert installer.CALLS["experts"] == before + 1
    finally:
        inst.uninstall()


def test_forward_profile_runs_on_the_cpu(tmp_path):
    """benchmarks/forward_profile.py's CPU smoke run (tiny shapes; no CUDA kernels, so aten ops by CPU time): both
    blocks profiled, files written."""
    import json

    from benchmarks.forward_profile import main

    assert main(["--device", "cpu", "--tiny", "--targets", "qwen3-2l", "--rounds", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "forward_profile_cpu.json").read_text())["targets"]["qwen3-2l"]["blocks"]
    assert set(r) == {"1", "16"} and all(b["kernels"] and b["forward_ms"] > 0 for b in r.values())
    assert "## qwen3-2l" in (tmp_path / "forward_profile_cpu.md").read_text()


@pytest.mark.parametrize("arch,want", [("qwen3_moe", (True, True, torch.bfloat16)), ("mixtral", (True, True, torch.float32)),
                                       ("gpt_oss", (False, False, torch.bfloat16))])
def test_the_router_probe_tells_the_formulas_that_only_round_apart(arch, want):
    """"Softmax over all, top-k, renormalize" (Qwen3, Mixtral) and "top-k, softmax over those" (gpt-oss) are the same
    function: a random probe cannot tell them apart, rows where they round differently (run through the router's own
    forward) do."""
    from pdflash_kernels import installer

    model = _tiny(arch)
    (router,) = installer.routers(model).values()
    assert installer.route_variant(router) == want


@needs_triton
def test_a_gpt_oss_routing_score_at_a_rounding_midpoint_keeps_the_op_by_op_bits():
    """A tiny gpt_oss whose rotary (YaRN stretched to the config's context) routes one token to a score 3e-8 above a
    bf16 rounding midpoint: the fused router once took gpt-oss's formula for the Qwen3 one and rounded it the other
    way (0.49609375 against 0.498046875)."""
    import pdflash_kernels
    from transformers import AutoModelForCausalLM, GptOssConfig

    from pdflash.tiny import tiny_config

    cfg = tiny_config("gpt_oss", 512, 0, num_layers=1)
    cfg.rope_parameters = dict(GptOssConfig().rope_parameters, original_max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    other = copy.deepcopy(model)
    inst = pdflash_kernels.install(model, probe=False)
    ref = pdflash_kernels.install(other, probe=False, fuse=False)
    try:
        ids = torch.randint(2, 500, (1, 5), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, other(ids).logits)
    finally:
        inst.uninstall()
        ref.uninstall()



def test_tiny_gpt_oss_yarn_is_consistent_so_transformers_does_not_warn():
    """pdflash.tiny's gpt_oss configs stretch YaRN to their context (pre-YaRN length = context / factor, as the published
    model): the ratio transformers checks (and warns about, once a process, on every load of an inconsistent one)."""
    from pdflash.tiny import real_shape_config, tiny_config

    for cfg in (tiny_config("gpt_oss", 512, 0), real_shape_config("gpt_oss")):
        rope = cfg.rope_parameters
        assert rope["original_max_position_embeddings"] * rope["factor"] == cfg.max_position_embeddings


def test_group_routers_of_one_class_with_other_parameters_are_probed_apart():
    """Two models of the same router class and shape but another scaling factor each get their own GroupRoute, not
    the one probed first."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import generic_config
    from pdflash_kernels import installer

    def route(scale):
        cfg = generic_config("deepseek_v3", 512, 0, 2)
        cfg.routed_scaling_factor = scale
        return installer.group_route_variant(next(iter(installer.routers(AutoModelForCausalLM.from_config(cfg)).values())))

    a, b = route(1.0), route(2.5)
    assert isinstance(a, installer.GroupRoute) and isinstance(b, installer.GroupRoute), (a, b)
    assert (a.scale, b.scale) == (1.0, 2.5)
