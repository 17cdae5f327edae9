"""Up-only experts (no gate: Nemotron-H's relu(up)^2, `pdflash_kernels.moe.ACT_RELU2`) on the MXFP4 paths: an
expert's slice holds its I up rows alone (`ExpertLayout.gated` False: a smaller slice, the byte map says so), the host
store keeps and serves them (nibbles, pair words, and fragment words: a GPU's default), the direct checkpoint load
reads Nemotron-H's per-expert tensors under transformers' renamed names, and the offloaded (a cache that evicts every
forward) and resident (the kernels, here under Triton's interpreter) verifiers of a tiny Nemotron-H give the greedy
tokens of transformers' own forward with the same MXFP4 experts (`verifier_svc.model.quantize_experts`)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import transformers
from packaging.version import Version

from pdflash_kernels import mxfp4
from pdflash_kernels.moe import ACT_RELU2, ACT_SILU, ExpertWeights
from pdflash_kernels.mxfp4 import ExpertLayout
from pdflash_kernels.reference import moe_reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

E, H, I = 6, 64, 32
NEW = 16
# transformers < 5.25 has no renaming for Nemotron-H's checkpoint names (`backbone.`): its `--experts mxfp4` load falls
# back to transformers' own load and quantizes after it (the same tokens; the resident byte map then counts the
# quantized tensors as they are, unpadded)
DIRECT = Version(transformers.__version__) >= Version("5.25")


def _up_only(bias: bool = False, seed: int = 0, h: int = H, i: int = I) -> tuple[mxfp4.MXFP4Experts, ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, i, h, generator=g) * 0.2  # the I up rows alone
    w2 = torch.randn(E, h, i, generator=g) * 0.2
    b1 = torch.randn(E, i, generator=g) * 0.2 if bias else None
    b2 = torch.randn(E, h, generator=g) * 0.2 if bias else None
    q = mxfp4.MXFP4Experts.quantize(w1, w2, b1, b2)
    return q, ExpertWeights(q.w1_blocks, q.w2_blocks, q.w1_scales, q.w2_scales, q.b1, q.b2, act=ACT_RELU2)


def test_an_up_only_layout_holds_the_up_rows_alone_and_round_trips():
    """An up-only expert's slice: w1 of I rows (not 2I), b1 of I; the byte count is those sections, each on a 256-byte
    boundary, scale rows padded to 4 bytes. Packing every expert into an arena and reading it back gives the bytes."""
    for bias in (False, True):
        q, _ = _up_only(bias)
        assert not q.gated and q.intermediate == I and q.hidden == H
        lay = q.layout()
        assert lay == ExpertLayout(H, I, bias, gated=False) and lay.rows1 == I
        # w1_blocks 32x32, w1_scales 32x(2 -> 4), w2_blocks 64x16, w2_scales 64x(1 -> 4), [b1 32 bf16, b2 64 bf16]
        sections = [I * H // 2, I * 4, H * I // 2, H * 4] + ([I * 2, H * 2] if bias else [])
        assert lay.nbytes == sum(-(-n // mxfp4.ALIGN) * mxfp4.ALIGN for n in sections) == (3072 if bias else 2560)
        gated = ExpertLayout(H, I, bias)  # (positional fields as before: gated by default)
        assert gated.gated and gated.rows1 == 2 * I and gated.nbytes > lay.nbytes
        arena = q.to_arena()
        assert arena.shape == (E, lay.nbytes)
        v = lay.views(arena)
        assert v["w1_blocks"].shape == (E, I, H // 2) and v["w1_scales"].shape == (E, I, H // 32)
        for name in ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales") + (("b1", "b2") if bias else ()):
            assert torch.equal(v[name], getattr(q, name)), name
        row = torch.zeros(lay.nbytes, dtype=torch.uint8)
        lay.pack(row, q.parts(3))
        assert torch.equal(row, arena[3])
    with pytest.raises(ValueError, match="up-only"):  # w1 rows that are neither I nor 2I
        mxfp4.MXFP4Experts(q.w1_blocks[:, :5], q.w1_scales[:, :5], q.w2_blocks, q.w2_scales).gated


@pytest.mark.parametrize("fmt", ["nibbles", "pair_words", "fragments"])
def test_the_host_store_serves_up_only_experts_as_they_were(fmt):
    """A store built for up-only experts (layout and activation agree) holds each layer's I up rows; the weights it
    serves over its arena (and over a slot pool copied from it) compute what the experts themselves compute. Fragment
    words (widths multiples of 64 there) are read back through `FragmentExperts.to_weights`: the same bits."""
    from verifier_svc.expert_store import GateLayout, HostExpertStore, layout_of

    h, i = (64, 64) if fmt == "fragments" else (H, I)
    q, w = _up_only(bias=True, h=h, i=i)
    lay, gate = layout_of(w), GateLayout.of(w)
    assert lay == ExpertLayout(h, i, True, gated=False) and gate == GateLayout(1, 0, ACT_RELU2, w.alpha, w.limit)
    store = HostExpertStore(lay, {0: E, 2: E}, gate, fmt=fmt)
    assert store.byte_map() == {0: [lay.nbytes] * E, 2: [lay.nbytes] * E} and store.slice_bytes == lay.nbytes
    store.put(0, w)
    for e in range(E):
        store.put_expert(2, e, q.parts(E - 1 - e))  # (layer 2: the experts in reverse order, one at a time)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    wts = torch.softmax(torch.randn(5, 2, generator=g), -1)
    want = moe_reference(x, ids, wts, w, E)
    got = store.layer_weights(0)
    assert not got.gated and got.intermediate == i and got.pair_words == (fmt == "pair_words")
    assert getattr(got, "fragments", False) == (fmt == "fragments") and store.format == fmt
    assert torch.equal(moe_reference(x, ids, wts, got, E), want)
    pool = store.arena[[store.row(2, E - 1 - e) for e in range(E)]].clone()  # slot e = layer 2's expert E-1-e = q's e
    assert torch.equal(moe_reference(x, ids, wts, store.weights(pool), E), want)


def test_up_only_experts_are_fragment_words_on_a_gpu():
    """Up-only experts fit fragment words (the first GEMM's programs hold up tiles alone): a GPU with Gluon stores them
    so by default where the widths are multiples of 64, and says why not where they are not. FragmentExperts holds the
    I up rows as they are and gives the same nibbles back; the sections' bytes round-trip (a demoted store's path)."""
    from pdflash_kernels import fragments, moe
    from verifier_svc.expert_store import GateLayout, HostExpertStore

    up_only = ExpertLayout(2688, 1856, False, gated=False)  # Nemotron 3 Nano's widths
    assert fragments.fragments_fit(2688, 1856, gated=False) is None
    assert "multiples of 64" in fragments.fragments_fit(2688, 1850, gated=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fragments, "gluon", object())
        m.setattr(moe, "FRAGMENTS", True)
        m.setattr(moe, "PAIR_WORDS", True)
        assert moe.expert_format_for(torch.device("cuda"), ExpertLayout(2880, 2880, False)) == "fragments"
        assert moe.expert_format_for(torch.device("cuda"), up_only) == "fragments"
        odd = ExpertLayout(2688, 1850, False, gated=False)
        import structlog

        from verifier_svc.model import expert_format_for

        with structlog.testing.capture_logs() as logs:  # (the verifier's chooser says why, once a load)
            assert expert_format_for(torch.device("cuda"), up_only) == "fragments"
            assert expert_format_for(torch.device("cuda"), odd) == "pair_words"
        assert [(x["event"], x["expert_format"]) for x in logs] == [
            ("MXFP4 experts not stored as fragment words", "pair_words")]
        assert "multiples of 64" in logs[0]["why"]
    with pytest.raises(ValueError, match="up-only"):  # a layout and an activation that disagree
        HostExpertStore(ExpertLayout(64, 64, False, gated=False), {0: 2}, GateLayout(1, 64, ACT_SILU, 1.0, 7.0))
    with pytest.raises(ValueError, match="multiples of 64"):
        fragments.FragmentExperts.from_weights(_up_only()[1])  # (I = 32)
    q, w = _up_only(bias=True, h=128, i=64)
    fw = fragments.FragmentExperts.from_weights(w)
    assert not fw.gated and fw.intermediate == 64 and fw.hidden == 128 and fw.w1.shape[:2] == (E, 64 // 16)
    back = fw.to_weights()
    for name in ("w1", "s1", "w2", "s2", "b1", "b2"):
        assert torch.equal(getattr(back, name), getattr(w, name)), name
    assert back.act == ACT_RELU2 and not back.gated
    parts = dict(w1_blocks=q.w1_blocks, w1_scales=q.w1_scales, w2_blocks=q.w2_blocks, w2_scales=q.w2_scales)
    raw = fragments.to_fragment_parts(parts, 1, 0)
    lay = q.layout()
    assert raw["w1_blocks"].shape == (E, 64 * 128 // 2) and raw["w1_scales"].shape == (E, 64 * 128 // 32)
    again = fragments.from_fragment_parts(raw, lay, 1, 0)
    assert all(torch.equal(again[k], v) for k, v in parts.items())
    with pytest.raises(ValueError, match="rows"):
        fragments.to_fragment_parts(dict(parts, w1_blocks=q.w1_blocks[:, :48], w1_scales=q.w1_scales[:, :48]), 1, 0)


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory) -> pathlib.Path:
    from pdflash.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("up_only") / "nh", "nemotron_h")


@pytest.fixture(scope="module")
def hf_tokens(nemotron_h) -> list[int]:
    """transformers' greedy tokens of the tiny Nemotron-H with its experts quantized to MXFP4 where they lie (its own
    forward computes with their dequantization)."""
    from transformers import AutoModelForCausalLM

    from pdflash_kernels.installer import experts_modules
    from verifier_svc.model import quantize_experts

    model = AutoModelForCausalLM.from_pretrained(nemotron_h, dtype=torch.float32).eval()
    before = {layer: m.up_proj.detach().clone() for layer, m in experts_modules(model).items()}
    assert quantize_experts(model) > 0
    for layer, m in experts_modules(model).items():
        w = m._pdflash_mxfp4
        assert not w.gated and not hasattr(m, "gate_up_proj")
        assert torch.equal(m.up_proj.data, mxfp4.dequantize(w.w1, w.s1, torch.float32))  # (the I up rows)
        assert not torch.equal(m.up_proj.data, before[layer])  # (MXFP4 is lossy: these are the quantized weights)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


PROMPT = list(range(3, 40))


def _tokens(core, block: int = 1, new: int = NEW) -> list[int]:
    from inprocess import core_run

    propose = (lambda *a: []) if block == 1 else None
    kw = {} if propose is None else {"propose": propose}
    return core_run(core, [PROMPT], new, block, **kw)["outputs"][0][:new]


def test_the_direct_load_reads_nemotron_h_per_expert_up_only_tensors(nemotron_h):
    """Nemotron-H's checkpoint names its weights `backbone.` (transformers renames them `model.` at load) and stores
    each expert's up_proj/down_proj on its own: the direct plan reads them under the model's names, layer by layer."""
    from transformers import AutoConfig

    from verifier_svc.checkpoint import DirectLoad, Tensors, plan

    if not DIRECT:
        pytest.skip(f"transformers {transformers.__version__} does not rename Nemotron-H's checkpoint names")
    assert "backbone.layers.1.mixer.experts.0.up_proj.weight" in Tensors(nemotron_h)
    direct = plan(nemotron_h, AutoConfig.from_pretrained(nemotron_h), torch.float32)
    assert isinstance(direct, DirectLoad), direct
    (layer, form), = direct.forms.items()
    assert (form.kind, form.gated, form.act, form.up_off, form.intermediate) == ("per_expert", False, ACT_RELU2, 0, 32)
    assert form.layout == ExpertLayout(64, 32, False, gated=False)
    assert "model.embeddings.weight" in direct.rest and "model.layers.1.mixer.gate.weight" in direct.rest
    assert direct.tensors.stored["model.embeddings.weight"] == "backbone.embeddings.weight"
    (_, experts), = direct.experts()
    parts = dict(experts)
    assert len(parts) == 8 and parts[0]["w1_blocks"].shape == (32, 32)  # the I up rows of expert 0, H/2 bytes each


def test_offloaded_mxfp4_nemotron_h_gives_transformers_tokens(nemotron_h, hf_tokens):
    """`--experts mxfp4 --expert-cache-gb` on a Nemotron-H checkpoint: its experts read layer by layer into the host
    store as up-only slices, served through a device cache that evicts every forward (10 slots: its overflow range of 8
    and 2 of its own for 8 experts), at block 1 and with n-gram drafts: transformers' greedy tokens with the same MXFP4
    experts. The quantize-after-a-transformers-load path (`offload_experts`) stores the same bytes."""
    from transformers import AutoModelForCausalLM

    from pdflash_kernels.installer import experts_modules
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target, offload_experts

    full = load_target(nemotron_h, "cpu", experts="mxfp4", expert_cache_gb=1.0)
    store = full.expert_cache.store
    assert store.layout == ExpertLayout(64, 32, False, gated=False) and store.format == "nibbles"
    assert full.byte_map == {1: [2560] * 8} and full.experts_format == "mxfp4"
    small = VerifierCore(load_target(nemotron_h, "cpu", experts="mxfp4", expert_cache_gb=10.5 * 2560 / 2**30),
                         max_block_size=8)
    cache = small.target.expert_cache
    assert cache.num_slots == 10 < 8 + 8
    assert _tokens(small) == hf_tokens
    assert _tokens(small, block=8) == hf_tokens
    assert cache.stats.evictions > 0 and cache.stats.bytes_moved == (cache.stats.misses + cache.stats.prefetched) * 2560

    model = AutoModelForCausalLM.from_pretrained(nemotron_h, dtype=torch.float32)
    quantized = offload_experts(model, torch.device("cpu"), 1.0).store
    assert quantized.layout == store.layout and torch.equal(quantized.arena, store.arena)
    assert all(m.up_proj.numel() == 0 for m in experts_modules(model).values())  # (dropped: the store holds them)


def test_a_pair_word_store_of_up_only_experts_serves_the_same_tokens(nemotron_h, hf_tokens, monkeypatch):
    """The store a GPU gets for up-only experts with fragment words off (pair words), read here through the torch
    reference: the same tokens, the same byte map."""
    from pdflash_kernels import moe
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    monkeypatch.setattr(moe, "expert_format_for", lambda device, layout=None: "pair_words")
    core = VerifierCore(load_target(nemotron_h, "cpu", experts="mxfp4", expert_cache_gb=10.5 * 2560 / 2**30),
                        max_block_size=8)
    assert core.target.expert_cache.store.format == "pair_words" and core.target.byte_map == {1: [2560] * 8}
    assert _tokens(core) == hf_tokens


def test_resident_mxfp4_nemotron_h_on_the_kernels_gives_transformers_tokens(nemotron_h, hf_tokens):
    """`--experts mxfp4` without a cache: every up-only slice resident in one arena, read by the grouped MXFP4 kernel
    (Triton's interpreter on the CPU), transformers' greedy tokens."""
    from pdflash_kernels import runtime
    from pdflash_kernels.installer import experts_modules
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    if not runtime.triton_usable("cpu"):
        pytest.skip("needs triton (its CPU interpreter)")
    target = load_target(nemotron_h, "cpu", kernels="on", experts="mxfp4")
    assert target.expert_cache is None and target.experts_format == "mxfp4"
    if DIRECT:  # (the store's slices: scale rows padded, sections aligned)
        assert target.byte_map == {1: [2560] * 8}
    assert target.kernels["experts"] == "triton mxfp4", target.kernels
    (w,) = [m._pdflash_weights for m in experts_modules(target.model).values()]
    assert w.fp4 and not w.gated and w.w1.shape == (8, 32, 32)
    core = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(kv_cache_gb=0.01))
    assert _tokens(core, new=8) == hf_tokens[:8]
