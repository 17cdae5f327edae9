"""pdflash_kernels/ compiled on a CUDA GPU (skipped without one): each kernel against its torch reference over many
shapes, bit-identical rows whatever the other rows of the call, and an installed model (real layer shapes
of Qwen3-30B-A3B, gpt-oss-20b and Mixtral-8x7B, few layers, random bf16 weights) whose logits for a
position are bit-identical whether computed in one forward or in blocks of 1, 2, 4, 16 or 32.

Error bounds: the kernels and the references round at the same points (bf16 after each projection) but add
in a different order, so a value may land one bf16 step apart and a routing weight or activation can
carry that on; we bound the error by 2% of the largest output (several bf16 steps).
Run on the GPU machine with `bash benchmarks/gpu.sh` (results: benchmarks/results/gpu_tests_h200.txt)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
SHAPES = {  # experts, top-k, hidden, expert width
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "small": (16, 4, 256, 512),
}


def _weights(model: str, fp4: bool, seed: int = 0):
    from pdflash_kernels import mxfp4
    from pdflash_kernels.moe import ACT_GPTOSS, ACT_SILU, ExpertWeights

    e, _, h, i = SHAPES[model]
    g = torch.Generator(device=DEV).manual_seed(seed)
    w1 = (torch.randn(e, 2 * i, h, generator=g, device=DEV) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device=DEV) * 0.02).bfloat16()
    gptoss = model == "gpt-oss-20b"
    b1 = (torch.randn(e, 2 * i, generator=g, device=DEV) * 0.02).bfloat16() if gptoss else None
    b2 = (torch.randn(e, h, generator=g, device=DEV) * 0.02).bfloat16() if gptoss else None
    act = ACT_GPTOSS if gptoss else ACT_SILU
    # gpt-oss keeps gate/up rows interleaved (read in place: row_mul 2, up_off 1)
    kw = dict(row_mul=2, up_off=1) if gptoss else {}
    if fp4:
        b1q, s1 = mxfp4.quantize(w1)
        b2q, s2 = mxfp4.quantize(w2)
        return ExpertWeights(b1q, b2q, s1, s2, b1, b2, act=act, **kw)
    return ExpertWeights(w1, w2, b1=b1, b2=b2, act=act, **kw)


def _pair(w):
    """The same MXFP4 experts stored as pair words (pdflash_kernels/mxfp4.py to_pair_words: decodes 5 and 6 read them)."""
    import dataclasses

    from pdflash_kernels import mxfp4

    return dataclasses.replace(w, w1=mxfp4.to_pair_words(w.w1), w2=mxfp4.to_pair_words(w.w2), pair_words=True)


def _tokens(model: str, t: int, seed: int = 0):
    e, k, h, _ = SHAPES[model]
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=DEV).bfloat16()
    ids = torch.argsort(torch.rand(t, e, generator=g, device=DEV), dim=1)[:, :k]
    wts = torch.softmax(torch.randn(t, k, generator=g, device=DEV), dim=-1).bfloat16()
    return x, ids, wts


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_moe_matches_reference(model, fp4, t):
    from pdflash_kernels.moe import MoeConfig, default_config, moe_forward
    from pdflash_kernels.reference import moe_reference

    w = _weights(model, fp4)
    x, ids, wts = _tokens(model, t)
    e = SHAPES[model][0]
    ref = moe_reference(x, ids, wts, w, e)
    decodes = (0, 1) if fp4 else (0,)
    for decode in decodes:
        c1 = default_config(w.intermediate, w.hidden, ids.shape[1], fp4, gemm=1)
        c2 = default_config(w.hidden, w.intermediate, ids.shape[1], fp4, gemm=2)
        c1, c2 = (MoeConfig(**{**c.__dict__, "decode": decode}) for c in (c1, c2))
        out = moe_forward(x, ids, wts, w, e, config=c1, config2=c2)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 0.02 * ref.float().abs().max().item() + 1e-4, (decode, err)


def _variant_params() -> list:
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16

    return [pytest.param(True, n, id=f"fp4-{n}") for n in SWEEP_VARIANTS] + [pytest.param(False, n, id=f"bf16-{n}") for n in SWEEP_VARIANTS_BF16]


@pytest.mark.parametrize("fp4,name", _variant_params())
@pytest.mark.parametrize("model", ["small", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_variants_match_reference(model, fp4, name):
    """Every GEMM variant the sweep times (pdflash_kernels.moe.SWEEP_VARIANTS*), compiled, at 1 and 16 tokens."""
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, moe_forward, variant_config
    from pdflash_kernels.reference import moe_reference

    w = _weights(model, fp4)
    e, k, h, i = SHAPES[model]
    fields = (SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16)[name]
    if fields.get("decode") in (5, 6):  # pair-word variants run on pair-word weights
        w = _pair(w)
    c1, c2 = variant_config(i, h, k, fp4, fields), variant_config(h, i, k, fp4, fields)
    for t in (1, 16):
        x, ids, wts = _tokens(model, t, seed=t)
        ref = moe_reference(x, ids, wts, w, e)
        out = moe_forward(x, ids, wts, w, e, config=c1, config2=c2)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 0.02 * ref.float().abs().max().item() + 1e-4, (t, err)


@pytest.mark.parametrize("decode,a_load", [(0, 0), (0, 2), (1, 0), (1, 2), (3, 0), (3, 2), (4, 2), (5, 2), (6, 2)])
def test_fp4_decodes_give_the_exact_bf16_weights(decode, a_load):
    """The GEMMs' weight decode on the GPU: every byte value at every scale byte a decode covers gives
    mxfp4.dequantize's bf16 value bit for bit, subnormals included (decode 0: scales 1..254, +0 for -0;
    decodes 1 and 3: 0..FAST_DECODE_MAX_SCALE)."""
    from pdflash_kernels import mxfp4
    from pdflash_kernels.moe import FAST_DECODE_MAX_SCALE, decode_fp4

    top = 254 if decode in (0, 6) else FAST_DECODE_MAX_SCALE
    lo = 1 if decode in (0, 6) else 0
    n, k = 64, 512
    blocks = torch.stack([torch.arange(256, dtype=torch.uint8).roll(37 * r) for r in range(n)]).to(DEV)
    scales = (lo + torch.arange(n * k // 32) % (top - lo + 1)).to(torch.uint8).reshape(n, k // 32).to(DEV)
    ref = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    stored = mxfp4.to_pair_words(blocks) if decode in (5, 6) else blocks  # pair words: decodes 5 and 6
    for block_k in (64, 128, 256):
        out = decode_fp4(stored, scales, decode, a_load, block_k=block_k)
        assert torch.equal(out.float(), ref.float()), block_k  # +0 == -0
        if decode != 0:
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), block_k


@pytest.mark.parametrize("t", [1, 7, 64, 2048])
def test_fused_align_equals_torch_align(t):
    from pdflash_kernels.moe import align, align_fused

    x, ids, _ = _tokens("qwen3-30b-a3b", t, seed=t)
    slots = torch.randperm(128, device=DEV).int()
    for n_valid in (None, torch.tensor([max(1, t // 2)], device=DEV)):
        a, b = align(ids, 128, 16, slots, n_valid), align_fused(ids, 128, 16, slots, n_valid)
        assert torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_slot, b.block_slot)
        assert torch.equal(a.num_blocks, b.num_blocks) and torch.equal(a.pair_valid, b.pair_valid)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("fp4,variant", [(False, None), (True, None), (True, "join_bf16"), (True, "join_bf16_swap64"),
                                         (True, "join_bf16_persist"), (True, "scaled_swap64"), (True, "word"), (True, "word_k256_raster"),
                                         (True, "word_swap64_k256"), (False, "swap64"), (False, "persist"),
                                         (True, "join_bf16_raster_split2"), (True, "join_bf16_raster_split4"),
                                         (False, "persist_split2"), (True, "pair"), (True, "pair_swap64_w2"),
                                         (True, "pair_k256_raster"), (True, "pair_swap64_w2_raster"),
                                         (True, "pair_k256_wk4_raster"), (True, "pair_k256_raster_split2"),
                                         (True, "pair_swap64_w2_raster_split2"), (True, "pair_swap64_w2_raster_split4"),
                                         (True, "pair_swap64_w2_k128_raster_split4"), (False, "persist_split4"),
                                         (False, "swap64_split4")])
def test_moe_rows_are_bit_identical_whatever_the_other_rows(model, fp4, variant):
    from pdflash_kernels.moe import SWEEP_VARIANTS, SWEEP_VARIANTS_BF16, moe_forward, variant_config

    w = _weights(model, fp4)
    if variant is not None and variant.startswith("pair"):
        w = _pair(w)
    e, k, h, i = SHAPES[model]
    cfg = {}
    if variant is not None:  # None: the default configs
        fields = (SWEEP_VARIANTS if fp4 else SWEEP_VARIANTS_BF16)[variant]
        cfg = dict(config=variant_config(i, h, k, fp4, fields), config2=variant_config(h, i, k, fp4, fields))
    x0, ids0, w0 = _tokens(model, 1, seed=99)
    alone = moe_forward(x0, ids0, w0, w, e, **cfg)
    for t in (2, 3, 8, 16, 31, 64, 128, 256):
        x, ids, wts = _tokens(model, t, seed=t)
        where = t // 2
        x[where], ids[where], wts[where] = x0[0], ids0[0], w0[0]
        out = moe_forward(x, ids, wts, w, e, **cfg)
        assert torch.equal(out[where], alone[0]), t


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("fp4", [True, False])
def test_moe_split_k_in_one_launch_gives_the_two_launch_bits_also_replayed_in_a_graph(model, fp4, monkeypatch):
    """MoeConfig.split_k (2 ranges): the tiles' last programs add the partials (counters as semaphores) with the bits of
    the second-launch path, for 1..64 tokens, in a CUDA graph replayed many times, the counters back at zero."""
    from pdflash_kernels import linear, moe

    w = _weights(model, fp4)
    e, k, h, i = SHAPES[model]
    fields = moe.SWEEP_VARIANTS["join_bf16_raster_split2"] if fp4 else moe.SWEEP_VARIANTS_BF16["persist_split2"]
    cfg = dict(config=moe.variant_config(i, h, k, fp4, fields), config2=moe.variant_config(h, i, k, fp4, fields))
    assert moe.split_span(h, cfg["config"])[0] == 2 and moe.split_span(i, cfg["config2"])[0] == 2
    x, ids, wts = _tokens(model, 64, seed=5)
    with monkeypatch.context() as m:
        m.setattr(linear, "_counters", lambda device, tiles: None)  # no counters: the second launch adds the partials
        two = {t: moe.moe_forward(x[:t], ids[:t], wts[:t], w, e, **cfg) for t in (1, 3, 16, 64)}
    for t, ref in two.items():
        for _ in range(3):
            assert torch.equal(moe.moe_forward(x[:t], ids[:t], wts[:t], w, e, **cfg), ref), t
    xs, ids_s, wts_s = x[:16].clone(), ids[:16].clone(), wts[:16].clone()
    moe.moe_forward(xs, ids_s, wts_s, w, e, **cfg)  # warm (compiled, counters made) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_forward(xs, ids_s, wts_s, w, e, **cfg)
    for j in range(0, 48, 3):
        xs.copy_(x[j : j + 16])
        ids_s.copy_(ids[j : j + 16])
        wts_s.copy_(wts[j : j + 16])
        graph.replay()
        assert torch.equal(out, two[64][j : j + 16]), j
    torch.cuda.synchronize()
    assert int(linear._COUNTERS[("cuda", x.device.index)][0].abs().sum()) == 0


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("t,groups", [(1, 1), (16, 1), (16, 3)])
def test_moe_two_phases_with_a_side_stream_copy_equal_one_phase_also_in_a_graph(model, t, groups):
    """moe_forward's phases as the device-managed expert cache runs them: the late experts' slots are copied in from
    pinned host memory on a side stream, a copy group at a time with an event each, while the resident experts' GEMMs
    run, and each group's phase waits for its copy's event; eagerly and replayed from a CUDA graph (the copies re-done
    each replay), the output's bits equal one phase over the finished slots."""
    from pdflash_kernels.moe import moe_forward

    e = SHAPES[model][0]
    w = _weights(model, True)
    x, ids, wts = _tokens(model, t, seed=t)
    one = moe_forward(x, ids, wts, w, e)
    routed = sorted(set(ids.reshape(-1).tolist()))
    flagged = routed[::2]  # half the routed experts arrive late, in `groups` copy groups
    parts = [flagged[g::groups] for g in range(groups)]
    phase = torch.zeros(e, dtype=torch.int8, device=DEV)
    for g, part in enumerate(parts):
        phase[part] = g + 1
    names = [n for n in ("w1", "w2", "s1", "s2") if getattr(w, n) is not None]
    host = [{n: getattr(w, n)[part].cpu().pin_memory() for n in names} for part in parts]
    side, done = torch.cuda.Stream(), [torch.cuda.Event() for _ in parts]
    late = [torch.tensor(part, device=DEV) for part in parts]

    def forward():
        cur = torch.cuda.current_stream()
        for idx in late:  # the late experts' slots hold other bytes until their copy lands
            for n in names:
                getattr(w, n).index_copy_(0, idx, getattr(w, n).index_select(0, idx).flip(-1))
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for g, idx in enumerate(late):
                for n in names:
                    getattr(w, n).index_copy_(0, idx, host[g][n].to(DEV, non_blocking=True))
                done[g].record(side)
        return moe_forward(x, ids, wts, w, e, phase_of_expert=phase, between=lambda g: cur.wait_event(done[g - 1]),
                           groups=groups)

    assert torch.equal(forward(), one)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        forward()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, one)


LINEAR_SHAPES = [(4096, 2048), (512, 2048), (2048, 4096), (128, 2048), (4096, 2880), (2880, 4096), (1024, 4096), (4096, 4096), (2048, 64), (151936, 2048)]


@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_linear_matches_cublas_and_rows_are_invariant(n, k):
    from pdflash_kernels.linear import matmul

    g = torch.Generator(device=DEV).manual_seed(n + k)
    a = torch.randn(256, k, generator=g, device=DEV).bfloat16()
    w = (torch.randn(n, k, generator=g, device=DEV) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g, device=DEV).bfloat16()
    full = matmul(a, w.t(), b)
    ref = torch.nn.functional.linear(a, w, b)
    assert (full.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    for m in (1, 2, 3, 5, 8, 13, 16, 17, 32, 33, 64, 100, 128, 255):
        assert torch.equal(matmul(a[:m], w.t(), b), full[:m]), m
    assert torch.equal(matmul(a[200:201], w.t(), b), full[200:201])


@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_linear_wide_tiles_give_the_16_row_tiles_bits(n, k, monkeypatch):
    """PDFLASH_LINEAR_WIDE_FROM=16: calls of 17+ rows take 64-row tiles (wgmma on sm_90), calls of up to 16 rows 16-row
    tiles (mma.sync): the batch invariance rests on the two giving a row the same bits, checked here at every linear
    shape, 1..256 rows, with the bias."""
    from pdflash_kernels import linear

    g = torch.Generator(device=DEV).manual_seed(n + k + 1)
    a = torch.randn(256, k, generator=g, device=DEV).bfloat16()
    w = (torch.randn(n, k, generator=g, device=DEV) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g, device=DEV).bfloat16()
    monkeypatch.setattr(linear, "WIDE_FROM", 0)
    narrow = linear.matmul(a, w.t(), b)
    monkeypatch.setattr(linear, "WIDE_FROM", 16)
    full = linear.matmul(a, w.t(), b)
    assert torch.equal(full, narrow)
    for m in (1, 5, 16, 17, 33, 64, 100, 255):
        assert torch.equal(linear.matmul(a[:m], w.t(), b), full[:m]), m


@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_linear_in_one_launch_gives_the_two_launch_bits_also_replayed_in_a_graph(n, k, monkeypatch):
    """PDFLASH_LINEAR_ONE_LAUNCH (the tile's last program adds the partials, an atomic counter as its semaphore):
    bit-identical to the two-launch path for 1..256 rows, in a CUDA graph replayed many times, with the counters
    back at zero after every launch."""
    from pdflash_kernels import linear

    g = torch.Generator(device=DEV).manual_seed(n + k)
    a = torch.randn(256, k, generator=g, device=DEV).bfloat16()
    w = (torch.randn(n, k, generator=g, device=DEV) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g, device=DEV).bfloat16()
    monkeypatch.setattr(linear, "ONE_LAUNCH", False)
    two = {m: linear.matmul(a[:m], w.t(), b) for m in (1, 3, 16, 64, 256)}
    monkeypatch.setattr(linear, "ONE_LAUNCH", True)
    for m, ref in two.items():
        for _ in range(3):
            assert torch.equal(linear.matmul(a[:m], w.t(), b), ref), m
    x = a[:16].clone()
    linear.matmul(x, w.t(), b)  # warm (compiled) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear.matmul(x, w.t(), b)
    for i in range(20):
        x.copy_(a[i : i + 16])
        graph.replay()
        assert torch.equal(out, two[256][i : i + 16]), i
    torch.cuda.synchronize()
    assert int(linear._COUNTERS[("cuda", a.device.index)][0].abs().sum()) == 0


@pytest.mark.parametrize("d", [8, 128, 2048, 2880, 151936])
def test_reductions_rows_are_invariant(d):
    from pdflash_kernels.reduce import row_sum, softmax

    x = torch.randn(256, d, device=DEV).bfloat16()
    s, m = row_sum(x, [-1], dtype=torch.float32), row_sum(x.float(), [-1], mean=True)
    sm = softmax(x, -1, dtype=torch.float32)
    assert torch.allclose(s, x.float().sum(-1), rtol=1e-3, atol=1e-2)
    assert torch.allclose(sm, x.float().softmax(-1), rtol=1e-3, atol=1e-6)
    for r in (1, 3, 17, 100):
        assert torch.equal(row_sum(x[:r], [-1], dtype=torch.float32), s[:r])
        assert torch.equal(row_sum(x[:r].float(), [-1], mean=True), m[:r])
        assert torch.equal(softmax(x[:r], -1, dtype=torch.float32), sm[:r])


@pytest.mark.parametrize("d", [64, 128, 2048, 2880, 4096])
@pytest.mark.parametrize("cast_first", [True, False])
def test_fused_rms_norm_matches_the_op_by_op_path_and_rows_are_invariant(d, cast_first):
    """One launch for what transformers' RMSNorm runs as 8; rsqrt is Triton's, not torch's, so a value may be one
    bf16 step apart from the op-by-op path (how often is printed); rows are bit-identical whatever the others."""
    from pdflash_kernels import fused
    from pdflash_kernels.dispatch import InvariantMode

    g = torch.Generator(device=DEV).manual_seed(d)
    x = (torch.randn(256, d, generator=g, device=DEV) * 3).bfloat16()
    w = torch.randn(d, generator=g, device=DEV).bfloat16()
    with InvariantMode():
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = w * y.to(x.dtype) if cast_first else (w * y).to(x.dtype)
    out = fused.rms_norm(x, w, 1e-6, cast_first)
    diff = (out.float() - ref.float()).abs()
    print(f"d={d}: {(diff > 0).float().mean().item():.4%} of values differ from the op-by-op path")
    assert diff.max() <= 0.02 * ref.float().abs().max()
    for r in (1, 3, 17, 100):
        assert torch.equal(fused.rms_norm(x[:r], w, 1e-6, cast_first), out[:r])
    assert torch.equal(fused.rms_norm(x[200:201], w, 1e-6, cast_first), out[200:201])


@pytest.mark.parametrize("hq,hk,d,half", [(32, 4, 128, False), (64, 8, 64, True), (32, 8, 128, False)])
def test_fused_rotary_equals_the_op_by_op_path(hq, hk, d, half):
    """q and k in one launch, bit-identical to torch's elementwise formula (products and sums rounded alike)."""
    from pdflash_kernels import fused

    g = torch.Generator(device=DEV).manual_seed(d)
    t = 32
    q = torch.randn(1, t, hq, d, generator=g, device=DEV).bfloat16().transpose(1, 2)
    k = torch.randn(1, t, hk, d, generator=g, device=DEV).bfloat16().transpose(1, 2)
    ang = torch.rand(1, t, d // 2, generator=g, device=DEV) * 100
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    if half:
        def ref(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        tc, ts = cos, sin
    else:
        tc, ts = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

        def ref(x):
            h = x.shape[-1] // 2
            return x * tc.unsqueeze(1) + torch.cat((-x[..., h:], x[..., :h]), -1) * ts.unsqueeze(1)
    oq, ok = fused.rotary(q, k, tc, ts, contiguous=half)
    assert torch.equal(oq, ref(q)) and torch.equal(ok, ref(k))
    one_q, one_k = fused.rotary(q[:, :, 7:8], k[:, :, 7:8], tc[:, 7:8], ts[:, 7:8], contiguous=half)
    assert torch.equal(one_q, oq[:, :, 7:8]) and torch.equal(one_k, ok[:, :, 7:8])


@pytest.mark.parametrize("e,k,softmax_first,norm,dtype", [(128, 8, True, True, torch.bfloat16), (32, 4, False, False, torch.bfloat16),
                                                          (8, 2, True, True, torch.float32)])
def test_fused_route_equals_the_op_by_op_path(e, k, softmax_first, norm, dtype):
    """Qwen3-MoE, gpt-oss and Mixtral routing in one launch: the same experts and bit-identical scores (distinct
    logits: torch.topk's order among tied values is its own), rows invariant."""
    from pdflash_kernels import fused
    from pdflash_kernels.dispatch import InvariantMode

    g = torch.Generator(device=DEV).manual_seed(e)
    logits = torch.stack([(torch.randperm(e, generator=g, device=DEV) - e / 2) / 16 for _ in range(256)]).bfloat16()
    with InvariantMode():
        if softmax_first:
            v, i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
            if norm:
                v /= v.sum(dim=-1, keepdim=True)
            v = v.to(dtype)
        else:
            v, i = torch.topk(logits, k, dim=-1)
            v = torch.softmax(v, dim=1, dtype=v.dtype)
    fv, fi = fused.route(logits, k, softmax_first, norm, dtype)
    assert torch.equal(fi, i) and torch.equal(fv, v)
    for r in (1, 5, 33):
        rv, ri = fused.route(logits[:r], k, softmax_first, norm, dtype)
        assert torch.equal(rv, fv[:r]) and torch.equal(ri, fi[:r])


@pytest.mark.parametrize("e,k,groups,kept,scale", [(256, 8, 8, 4, 2.5), (128, 6, 1, 1, 2.5)])
def test_fused_group_route_is_the_routers_formula_and_row_invariant(e, k, groups, kept, scale):
    """DeepSeek-V3's (and Kimi K2's) and Nemotron 3 Nano's group routing in one launch from the router linear's float32
    partials: the logits `matmul` stores, transformers' experts and weights to float32 rounding, rows invariant."""
    from pdflash_kernels import fused, linear
    from pdflash_kernels.installer import GroupRoute, _group_route_reference, _same_routes

    g = torch.Generator(device=DEV).manual_seed(e)
    x = torch.randn(256, 2048, generator=g, device=DEV)
    w = torch.randn(e, 2048, generator=g, device=DEV) * 0.02
    bias = torch.randn(e, generator=g, device=DEV) * 0.05
    route = GroupRoute(k, groups, kept, True, scale, torch.float32)
    logits, fw, fi = fused.group_route(None, bias, k, groups, kept, True, scale, ws=linear.partials(x, w.t()))
    assert torch.equal(logits, linear.matmul(x, w.t()))
    assert _same_routes(fw, fi, *_group_route_reference(logits, bias, route))
    for r in (1, 5, 33):
        _, rw, ri = fused.group_route(None, bias, k, groups, kept, True, scale, ws=linear.partials(x[:r], w.t()))
        assert torch.equal(rw, fw[:r]) and torch.equal(ri, fi[:r])


@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (64, 8, 64)])
@pytest.mark.parametrize("window,sinks", [(None, False), (128, True)])
def test_attention_matches_reference_and_queries_are_invariant(hq, hkv, d, window, sinks):
    from pdflash_kernels.attention import attention
    from pdflash_kernels.reference import attention_reference

    s = 700
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, hq, 32, d, generator=g, device=DEV).bfloat16()
    k = torch.randn(1, hkv, s, d, generator=g, device=DEV).bfloat16()
    v = torch.randn(1, hkv, s, d, generator=g, device=DEV).bfloat16()
    sk = torch.randn(hq, generator=g, device=DEV) if sinks else None
    pos = torch.arange(s - 32, s, device=DEV).reshape(1, 32)
    out = attention(q, k, v, pos, d**-0.5, window, sk)
    ref = attention_reference(q, k, v, pos[0], 0, d**-0.5, window, sk)
    assert (out.float() - ref.float()).abs().max() < 0.02
    # query i alone on a cache that ends at its own position (what 1-token decoding does), and in blocks
    for i in (0, 7, 31):
        end = s - 32 + i + 1
        alone = attention(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], pos[:, i : i + 1], d**-0.5, window, sk)
        assert torch.equal(alone[:, 0], out[:, i]), i
    for t in (2, 4, 16):
        blk = attention(q[:, :, 32 - t :], k, v, pos[:, 32 - t :], d**-0.5, window, sk)
        assert torch.equal(blk, out[:, 32 - t :]), t
    if window:  # a sliding-window cache holds only the last keys: its tensor starts elsewhere
        start = s - 32 - window
        cut = attention(q, k[:, :, start:], v[:, :, start:], pos, d**-0.5, window, sk)
        assert torch.equal(cut, out)


def make_model(arch: str, layers: int = 2, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    from pdflash.tiny import real_shape_config

    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(real_shape_config(arch, num_layers=layers), dtype=torch.bfloat16)
    return model.eval()


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "native"), ("gpt_oss", "native"), ("mixtral", "native"), ("gpt_oss", "mxfp4")])
def test_installed_model_logits_are_identical_in_blocks(arch, fmt):
    from transformers import DynamicCache

    import pdflash_kernels
    from pdflash.hf_compat import cache_kwarg

    model = make_model(arch)
    n = 200  # past the 128-token sliding window of gpt-oss's odd layers
    ids = torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.inference_mode():
        stock = model(input_ids=ids[:, :64]).logits.float()
    inst = pdflash_kernels.install(model, experts_format=fmt)
    assert inst.exact, inst.summary()
    assert all(v.startswith("triton") and "not fused" not in v for v in inst.fused.values()) and len(inst.fused) == 3, inst.fused
    kw = cache_kwarg(model)
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        # the kernels compute what the model computes: bf16 rounding differs, and where a router's top-k nearly
        # ties a position can take another expert, so compare typical positions (MXFP4 experts are lossy too)
        cos = torch.nn.functional.cosine_similarity(full[0, :64].float(), stock[0], dim=-1)
        assert cos.median() > (0.99 if fmt == "native" else 0.8), cos
        prefix = 100
        for block in (1, 2, 4, 16, 32):
            cache = DynamicCache(config=model.config)
            outs = [model(input_ids=ids[:, :prefix], use_cache=True, **{kw: cache}).logits]
            for p in range(prefix, n, block):
                outs.append(model(input_ids=ids[:, p : p + block], use_cache=True, **{kw: cache}).logits)
            got = torch.cat(outs, 1)
            diff = (got != full).any(-1)[0].nonzero().flatten().tolist()
            assert not diff, f"block {block}: positions {diff[:10]} differ"
    inst.uninstall()


@pytest.mark.parametrize("hq,hkv,d,window,sinks", [(32, 4, 128, None, False), (64, 8, 64, 128, True)])
def test_split_kv_attention_has_one_program_bits_at_long_contexts(hq, hkv, d, window, sinks):
    """The paged attention at a 3000-position context: the split form (programs 2..16 per tile, the last merging the
    segments through the tile semaphore) gives the one-program bits, repeatedly (no stale partials, counters reset),
    for 1 query and blocks of 16 and 32; close to the reference."""
    from pdflash_kernels.attention import PAGE, paged_attention
    from pdflash_kernels.reference import attention_reference

    s, t = 3000, 32
    g = torch.Generator(device=DEV).manual_seed(2)
    k = torch.randn(1, hkv, s, d, generator=g, device=DEV).bfloat16()
    v = torch.randn(1, hkv, s, d, generator=g, device=DEV).bfloat16()
    q = torch.randn(1, hq, t, d, generator=g, device=DEV).bfloat16()
    sk = torch.randn(hq, generator=g, device=DEV) if sinks else None
    n_pages = -(-s // PAGE)
    order = torch.randperm(n_pages, device=DEV)
    pad = torch.zeros(n_pages * PAGE - s, hkv, d, device=DEV, dtype=torch.bfloat16)
    kp = torch.empty(n_pages, hkv, PAGE, d, dtype=torch.bfloat16, device=DEV)
    vp = torch.empty_like(kp)
    kp[order] = torch.cat([k[0].transpose(0, 1), pad]).reshape(n_pages, PAGE, hkv, d).transpose(1, 2)
    vp[order] = torch.cat([v[0].transpose(0, 1), pad]).reshape(n_pages, PAGE, hkv, d).transpose(1, 2)
    table = torch.cat([order, order[:40]]).to(torch.int32).reshape(1, -1)  # a table longer than the context
    pos = torch.arange(s - t, s, device=DEV).reshape(1, t)
    ref = attention_reference(q, k, v, pos[0], 0, d**-0.5, window, sk)
    for n in (16, 32):
        qs, ps = q[:, :, t - n :], pos[:, t - n :]
        one = paged_attention(qs, kp, vp, table, ps, d**-0.5, window, sk, programs=1)
        assert (one.float() - ref[:, t - n :].float()).abs().max() < 0.02
        for progs in (2, 5, 16, None, 16):
            assert torch.equal(paged_attention(qs, kp, vp, table, ps, d**-0.5, window, sk, programs=progs), one), progs
    for i in (0, 31):  # one query alone (1-token decoding) on keys up to its own position
        alone = paged_attention(q[:, :, i : i + 1], kp, vp, table, pos[:, i : i + 1], d**-0.5, window, sk)
        assert torch.equal(alone[:, 0], one[:, i]), i


@pytest.mark.parametrize("hq,hkv,d,window,sinks", [(32, 4, 128, None, False), (64, 8, 64, 128, True)])
def test_ragged_attention_gives_each_sequence_its_own_calls_bits(hq, hkv, d, window, sinks):
    """A multi-session wave's attention compiled for the GPU: five sequences (contexts 7 to 3000 positions, 0 to 32
    query rows, one empty) in one launch give each sequence the bits of a call of its own, for any program count and
    replayed from a CUDA graph; the rows past the last sequence stay zero."""
    from pdflash_kernels.attention import PAGE, paged_attention

    g = torch.Generator(device=DEV).manual_seed(3)
    lengths, rows = [3000, 7, 700, 300, 64], [32, 1, 0, 16, 5]
    n_pages = sum(-(-n // PAGE) for n in lengths) + 4
    kp = torch.randn(n_pages, hkv, PAGE, d, generator=g, device=DEV).bfloat16()
    vp = torch.randn(n_pages, hkv, PAGE, d, generator=g, device=DEV).bfloat16()
    order = torch.randperm(n_pages, device=DEV).tolist()
    table = torch.zeros(len(lengths), max(-(-n // PAGE) for n in lengths) + 8, dtype=torch.int32, device=DEV)
    for b, n in enumerate(lengths):
        for i in range(-(-n // PAGE)):
            table[b, i] = order.pop()
    total = sum(rows) + 6  # 6 rows of a padded wave's tail
    q = torch.randn(1, hq, total, d, generator=g, device=DEV).bfloat16()
    pos = torch.zeros(1, total, dtype=torch.long, device=DEV)
    starts = [0]
    for n, r in zip(lengths, rows):
        pos[0, starts[-1] : starts[-1] + r] = torch.arange(n - r, n, device=DEV)
        starts.append(starts[-1] + r)
    cu = torch.tensor(starts, dtype=torch.int32, device=DEV)
    sk = torch.randn(hq, generator=g, device=DEV) if sinks else None
    run = lambda progs: paged_attention(q, kp, vp, table, pos, d**-0.5, window, sk, programs=progs,  # noqa: E731
                                        seq_starts=cu, max_rows=32)
    out = run(1)
    for progs in (2, 16, None, 16):
        assert torch.equal(run(progs), out), progs
    for b, r in enumerate(rows):
        if r:
            a, e = starts[b], starts[b + 1]
            alone = paged_attention(q[:, :, a:e], kp, vp, table[b : b + 1], pos[:, a:e], d**-0.5, window, sk)
            assert torch.equal(out[:, a:e], alone), b
    assert not out[:, starts[-1] :].any()
    run(None)  # (the workspace and counters made outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("fp4", [False, True])
def test_fused_combine_gives_the_separate_combines_bits_also_replayed_in_a_graph(model, fp4, monkeypatch):
    """PDFLASH_MOE_FUSED_COMBINE (the down GEMM's last program per token and n tile sums the token's rows): the
    separate combine's bits for 1..64 rows, padding rows zero, repeated and replayed from a CUDA graph."""
    from pdflash_kernels import moe

    w = _weights(model, fp4)
    e = SHAPES[model][0]
    x, ids, wts = _tokens(model, 64, seed=3)
    nv = torch.tensor([40], device=DEV)
    monkeypatch.setattr(moe, "FUSED_COMBINE", False)
    want = {t: moe.moe_forward(x[:t], ids[:t], wts[:t], w, e, n_valid=nv if t == 64 else None) for t in (1, 5, 16, 64)}
    monkeypatch.setattr(moe, "FUSED_COMBINE", True)
    for t, ref in want.items():
        for _ in range(3):
            got = moe.moe_forward(x[:t], ids[:t], wts[:t], w, e, n_valid=nv if t == 64 else None)
            assert torch.equal(got, ref), t
    assert torch.equal(want[64][40:], torch.zeros_like(want[64][40:]))
    xs, ids_s, wts_s = x[:16].clone(), ids[:16].clone(), wts[:16].clone()
    moe.moe_forward(xs, ids_s, wts_s, w, e)  # compiled and the counters made before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_forward(xs, ids_s, wts_s, w, e)
    for i in range(0, 48, 6):
        xs.copy_(x[i : i + 16]), ids_s.copy_(ids[i : i + 16]), wts_s.copy_(wts[i : i + 16])
        graph.replay()
        monkeypatch.setattr(moe, "FUSED_COMBINE", False)
        ref = moe.moe_forward(x[i : i + 16], ids[i : i + 16], wts[i : i + 16], w, e)
        monkeypatch.setattr(moe, "FUSED_COMBINE", True)
        assert torch.equal(out, ref), i


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
@pytest.mark.parametrize("big", [False, True])
def test_pair_word_experts_give_the_nibble_order_bits(model, big):
    """The same experts stored as pair words (their default configs, decode 5; 6 with big scales) against nibble order
    through the same tiles (decode 4; 0 with big scales): bit for bit, at 1, 16 and 64 tokens."""
    import dataclasses

    from pdflash_kernels.moe import default_config, moe_forward

    w = dataclasses.replace(_weights(model, True), big_scales=big)
    pw = _pair(w)
    e, k, h, i = SHAPES[model]
    c1 = default_config(i, h, k, True, gemm=1, pair_words=True)
    c2 = default_config(h, i, k, True, gemm=2, pair_words=True)
    n1, n2 = (dataclasses.replace(c, decode=0 if big else 4) for c in (c1, c2))
    for t in (1, 16, 64):
        x, ids, wts = _tokens(model, t, seed=t)
        got = moe_forward(x, ids, wts, pw, e)
        want = moe_forward(x, ids, wts, w, e, config=n1, config2=n2)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), t
