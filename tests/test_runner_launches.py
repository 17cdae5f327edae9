"""The verifier forward's launch savings (verifier_svc/runner.py): the rotary table gathered by position instead of the
rotary module per forward, the paged KV write as one Triton launch (pdflash_kernels.attention.paged_write), and a ceiling on a
qwen3_moe block-1 forward's launches (counted on the CPU as benchmarks/forward_launches.py counts them: Triton launches
under the interpreter plus the aten ops that launch a kernel on CUDA)."""

from __future__ import annotations

import pytest
import torch

from pdflash_kernels import runtime
from pdflash_kernels.attention import PAGE, paged_write, paged_write_reference
from verifier_svc.kv import KVPool, SequenceKV
from verifier_svc.runner import ForwardRunner, RotaryTable, static_rope

from tests.conftest import needs_triton  # noqa: E402
G = torch.Generator().manual_seed(0)

#: launches of a block-1 verify forward of the 2-layer tiny qwen3_moe (bf16), as reached by the table, the pre-norm
#: chain (verifier_svc/prenorm.py) and the fused attention (verifier_svc/fused_attention.py): per layer 12 (the merged
#: q/k/v projection, its epilogue (q/k norms, rotary, the KV write), attention, the output projection, its residual
#: add fused with the norm after it, the router linear, routing, align + 2 expert GEMMs + combine, the second residual
#: add + norm), outside the layers 5 (embedding, rotary gather, the first layer's input norm, LM head, the logits'
#: cast). The tiny model's linears have one K split; at real shapes each split linear's second launch (the sum of the
#: partials) is folded into its consumer for the q/k/v, output and router projections. Raise it only for a reason; a
#: regression that adds launches fails here.
QWEN3_BLOCK1_LAUNCHES = 29
QWEN3_LAYER_LAUNCHES = 12


def _tiny(arch, dtype, layers=1, **overrides):
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import tiny_config

    cfg = tiny_config(arch, 512, 0, num_layers=layers)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _pool(model, pages=8):
    cfg = model.config
    return KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, pages, next(model.parameters()).dtype,
                  torch.device("cpu"))


# ---- the rotary table ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_the_rotary_table_is_the_module_bit_for_bit(arch, dtype):
    """Every position alone, blocks of 4 and 32 at every alignment class, two sequences at once: the gathered cos/sin
    equal the module's (values, dtype, shape, contiguity), over the whole table (the tiny configs: 2048 positions;
    gpt-oss: yarn, a half-width table)."""
    model = _tiny(arch, dtype)
    rot = model.model.rotary_emb
    assert static_rope(rot) is None
    runner = ForwardRunner(model, None, _pool(model), max_positions=2048)
    assert runner.rope is not None and runner.rotary == "table (2048 positions)"
    table = runner.rope
    x = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
    cases = [torch.arange(p, p + 1) for p in range(2048)]
    cases += [torch.arange(s, s + 4) for s in range(0, 2048 - 4, 3)] + [torch.arange(s, s + 32) for s in (0, 1, 63, 1000, 2016)]
    with torch.inference_mode():
        for pos in cases:
            want_cos, want_sin = rot(x, pos.unsqueeze(0))
            cos, sin = table(pos.unsqueeze(0))
            assert cos.dtype == want_cos.dtype and cos.shape == want_cos.shape and cos.is_contiguous()
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), pos[:4]
        two = torch.stack([torch.arange(5, 9), torch.arange(2040, 2044)])
        want = rot(x, two)
        got = table(two)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].shape == (2, 4, want[0].shape[-1])


def test_dynamic_rope_keeps_calling_the_module():
    model = _tiny("qwen3_moe", torch.float32, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    rot = model.model.rotary_emb
    assert rot.rope_type == "dynamic"
    assert "changes with the sequence length" in static_rope(rot)
    runner = ForwardRunner(model, None, _pool(model), max_positions=2048)
    assert runner.rope is None and runner.rotary.startswith("module per forward")
    assert ForwardRunner(_tiny("qwen3_moe", torch.float32), None, _pool(model)).rope is None  # no bound: the module


def test_the_rotary_table_builds_in_chunks(monkeypatch):
    model = _tiny("gpt_oss", torch.bfloat16)
    monkeypatch.setattr(RotaryTable, "CHUNK", 100)
    chunked = RotaryTable(model.model.rotary_emb, 1000, torch.bfloat16, torch.device("cpu"), model.config.hidden_size)
    monkeypatch.setattr(RotaryTable, "CHUNK", 4096)
    whole = RotaryTable(model.model.rotary_emb, 1000, torch.bfloat16, torch.device("cpu"), model.config.hidden_size)
    assert torch.equal(chunked.table, whole.table) and whole.table.shape == (2, 1000, model.config.head_dim // 2)


def test_a_multimodal_rope_is_tabled_from_its_three_grids_of_text_positions():
    """Qwen3.5's M-RoPE module (`mrope_section`) gets a text position on each of its 3 grids ([3, B, T], as the
    model's own forward gives it; transformers 5.17's module indexes three dimensions): the table equals the module
    called so, and a module of 5.17's form (positions must be 3-D) builds the same table."""
    from verifier_svc.runner import rotary_positions

    model = _tiny("qwen3_5_moe_text", torch.bfloat16)
    rot = model.model.rotary_emb
    assert rot.mrope_section is not None
    table = RotaryTable(rot, 64, torch.bfloat16, torch.device("cpu"), model.config.hidden_size)
    pos = torch.arange(5, 12).unsqueeze(0)
    assert rotary_positions(rot, pos).shape == (3, 1, 7)
    want = rot(torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16), pos.expand(3, 1, 7))
    assert all(torch.equal(a, b) for a, b in zip(table(pos), want))
    forward = type(rot).forward

    def three_d_only(self, x, position_ids):
        assert position_ids.dim() == 3, "transformers 5.17's M-RoPE indexes [3, B, T] positions"
        return forward(self, x, position_ids)

    rot.forward = three_d_only.__get__(rot)
    assert torch.equal(RotaryTable(rot, 64, torch.bfloat16, torch.device("cpu"), model.config.hidden_size).table, table.table)


# ---- the paged KV write ----------------------------------------------------------------------------------------
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float16: torch.int16}[x.dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hkv,d,t", [(2, 16, 1), (2, 16, 4), (4, 64, 32), (8, 64, 5), (1, 128, 3), (2, 24, 7)])
def test_paged_write_is_the_index_put_path_bit_for_bit(dtype, hkv, d, t):
    """Random distinct slots over several pages, keys in the attention modules' permuted layout ([T, H, D] storage seen
    as [H, T, D]) and values contiguous, -0.0 and infinities among them: the pools equal the two index_put_ writes
    bit for bit, and nothing else in them changes."""
    pages_n = 6
    kp = torch.randn(pages_n, hkv, PAGE, d, generator=G).to(dtype)
    vp = torch.randn(pages_n, hkv, PAGE, d, generator=G).to(dtype)
    slots = torch.randperm(pages_n * PAGE, generator=G)[:t]
    pages, offsets = slots // PAGE, slots % PAGE
    key = torch.randn(t, hkv, d, generator=G).to(dtype).transpose(0, 1)
    value = torch.randn(hkv, t, d, generator=G).to(dtype)
    key[0, 0, :3] = torch.tensor([-0.0, float("inf"), -float("inf")], dtype=dtype)
    want_k, want_v = kp.clone(), vp.clone()
    paged_write_reference(want_k, want_v, key, value, pages, offsets)
    got_k, got_v = kp.clone(), vp.clone()
    paged_write(got_k, got_v, key, value, pages, offsets)
    assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))
    assert not torch.equal(want_k, kp)  # the write happened
    # int32 page ids (a page table's dtype) and a float32 block into a bf16 pool (cast as the reference casts)
    if dtype == torch.bfloat16:
        kf, vf = torch.randn(hkv, t, d, generator=G), torch.randn(hkv, t, d, generator=G)
        want_k, want_v = kp.clone(), vp.clone()
        paged_write_reference(want_k, want_v, kf, vf, pages, offsets)
        got_k, got_v = kp.clone(), vp.clone()
        paged_write(got_k, got_v, kf, vf, pages.int(), offsets.int())
        assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))


def test_paged_write_without_triton_is_the_reference(monkeypatch):
    monkeypatch.setattr(runtime, "triton_usable", lambda device: False)
    kp, vp = torch.zeros(2, 2, PAGE, 16), torch.zeros(2, 2, PAGE, 16)
    key, value = torch.randn(2, 3, 16, generator=G), torch.randn(2, 3, 16, generator=G)
    paged_write(kp, vp, key, value, torch.tensor([1, 0, 1]), torch.tensor([5, 63, 6]))
    assert torch.equal(kp[1, :, 5], key[:, 0]) and torch.equal(vp[0, :, 63], value[:, 1]) and torch.equal(kp[1, :, 6], key[:, 2])


# ---- the whole forward -----------------------------------------------------------------------------------------
@needs_triton
def test_a_qwen3_block1_forward_stays_within_its_launches_and_the_table_changes_no_bit():
    """Prefill 5 tokens, then one block-1 verify forward, counted: at most QWEN3_BLOCK1_LAUNCHES launches (each layer
    QWEN3_LAYER_LAUNCHES), no host sync; and the logits equal those of a runner that calls the rotary module and
    writes K/V with index_put_ and calls the decoder layers as they are (the stop-20 forward)."""
    import sys

    import pdflash_kernels
    from benchmarks.forward_launches import count_forward
    from verifier_svc.experts import ExpertsSeam

    runner_mod = sys.modules[ForwardRunner.__module__]
    model = _tiny("qwen3_moe", torch.bfloat16, layers=2)
    inst = pdflash_kernels.install(model, probe=False)
    try:
        seam = ExpertsSeam(model)
        outs, counts = [], None
        for tabled in (True, False):
            pool = _pool(model)
            runner = ForwardRunner(model, seam, pool, max_positions=4 * PAGE if tabled else None)
            assert (runner.rope is not None) == tabled and runner.chain is not None, runner.prenorm
            if not tabled:  # the layers called as they are
                runner.chain = None
            seq = SequenceKV(pool, 4 * PAGE)
            with pytest.MonkeyPatch.context() as mp:
                if not tabled:
                    mp.setattr(runner_mod, "paged_write", paged_write_reference)
                runner.forward([3, 9, 27, 81, 243], 0, seq)
                fw = count_forward(runner, lambda: outs.append(runner.forward([7], 5, seq).logits))
            if tabled:
                counts = fw
    finally:
        inst.uninstall()
    assert torch.equal(outs[0], outs[1])
    (f,) = counts
    assert f["rows"] == 1 and f["syncs"] == 0
    assert f["aten"].get("index_put_", 0) == 0 and "cos" not in f["aten"], f
    assert all(x["launches"] <= QWEN3_LAYER_LAUNCHES for x in f["layers"]), f["layers"]
    assert f["launches"] <= QWEN3_BLOCK1_LAUNCHES, (f["launches"], f["triton"], f["aten"])
