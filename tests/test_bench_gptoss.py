"""benchmarks/e2e_gpu.py on the CPU (`--device cpu --tiny`): the gpt-oss target with MXFP4 experts runs end to end and
writes its rows, and the verifier's block-1 tokens are transformers' greedy decoding of the same model with its experts
dequantized from MXFP4 (float32), computed here apart from the script; the demo's DFlash and hybrid drafters driven in
process (`benchmarks.inprocess.drafter_propose`) draft from the verifier's features and equal block 1; the helpers the
script serves gpt-oss with (`verifier_svc.model.quantize_experts` / `serve_mxfp4`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pdflash_kernels import mxfp4
from pdflash_kernels.installer import experts_modules

VERIFIER_KEYS = {"target", "mode", "block", "tok_s", "tau", "forward_ms", "byte_time_ms", "of_byte_time", "round_other_ms",
                 "identical", "tokens", "rounds", "routed_bytes_per_round"}


def _run(tmp_path, *args: str) -> dict:
    from benchmarks.e2e_gpu import main

    rc = main(["--device", "cpu", "--out", str(tmp_path), *args])
    result = json.loads((tmp_path / "e2e_gpu_cpu.json").read_text())
    assert rc == 0, result["not_identical"]
    md = (tmp_path / "e2e_gpu_cpu.md").read_text()
    assert all(f"| {r['target']} | {r['mode']} |" in md for r in result["rows"])
    return result


def _dequantized_oracle(model) -> None:
    """The experts through MXFP4 and back with pdflash_kernels.mxfp4 alone (K = each projection's input dimension; gpt-oss
    stores [E, in, out]), the biases through bf16: what an MXFP4 verifier of this model computes with."""
    for module in experts_modules(model).values():
        assert module.is_transposed
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name).data.transpose(1, 2)  # [E, out, in]
            deq = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32).transpose(1, 2).contiguous()
            assert not torch.equal(deq, getattr(module, name).data)  # MXFP4 is lossy: the oracle differs from the float model
            setattr(module, name, nn.Parameter(deq, requires_grad=False))
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            b = getattr(module, name)
            setattr(module, name, nn.Parameter(b.data.to(torch.bfloat16).float(), requires_grad=False))


def _greedy(model, prompts, new: int) -> list[list[int]]:
    from benchmarks.e2e_gpu import hf_generate

    return [r["tokens"] for r in hf_generate(model, prompts, new)]


def test_gptoss_tiny_runs_end_to_end_and_block_one_is_transformers_greedy_on_the_dequantized_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    from benchmarks.e2e_gpu import target_config
    from pdflash_kernels.mxfp4 import ExpertLayout

    new = 12
    result = _run(tmp_path, "--tiny", "--targets", "gptoss-2l", "--prompts", "2", "--new-tokens", str(new),
                  "--prompt-tokens", "72", "--blocks", "4", "8")
    rows = [r for r in result["rows"] if r["target"] == "gptoss-2l"]
    modes = [r["mode"] for r in rows]
    assert modes[:3] == ["verifier none@1", "verifier ngram@4", "verifier ngram@8"], modes
    assert modes[3].startswith("verifier replay@8") and modes[4:] == ["transformers greedy", "transformers prompt lookup"]
    for r in rows[:4]:
        assert VERIFIER_KEYS <= set(r), set(VERIFIER_KEYS) - set(r)
        assert r["identical"] is True and r["tokens"] == 2 * new and r["forward_ms"] > 0 and r["byte_time_ms"] > 0
        assert r["tau"] >= 1.0 and r["rounds"] >= 1
    assert rows[3]["tau"] > 2  # the replay drafter proposes block 1's tokens, every 4th wrong
    assert all(r["same_as_block1"] is True for r in rows[4:]) and all(r["tok_s"] > 0 for r in rows[4:])
    info = result["targets"]["gptoss-2l"]
    assert info["experts"].startswith("MXFP4") and info["mxfp4_expert_bytes"] > 0
    cfg = target_config("gpt_oss", 2, tiny=True)
    layout = ExpertLayout(cfg.hidden_size, cfg.intermediate_size, True)
    assert info["expert_slice_bytes"] == layout.nbytes
    assert info["expert_bytes"] == layout.nbytes * cfg.num_local_experts * 2
    # a block-1 round routes at most 2 of the 8 experts in each of the 2 layers; byte time = dense + those slices
    none = rows[0]
    assert none["routed_bytes_per_round"] <= 2 * 2 * layout.nbytes
    rate = result["meta"]["copy_rate_bytes_per_s"]
    assert none["byte_time_ms"] == pytest.approx((info["dense_bytes"] + none["routed_bytes_per_round"]) / rate * 1e3, rel=1e-2, abs=1e-4)

    # the oracle, apart from the script: the same seeded model, experts through MXFP4 by pdflash_kernels.mxfp4, transformers'
    # own greedy decoding in float32, against the verifier's block-1 tokens the script recorded
    prompts = info["prompt_ids"]
    assert len(prompts) == 2 and all(len(p) == 72 for p in prompts)
    assert 72 > cfg.sliding_window  # the sliding layers' window is crossed
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    plain = _greedy(model, prompts, new)
    _dequantized_oracle(model)
    want = _greedy(model, prompts, new)
    assert info["reference_tokens"] == want
    assert plain != want  # the verifier did not serve the float experts


def test_mxfp4_experts_serves_a_qwen3_target_in_mxfp4_and_stays_identical_to_block_one(tmp_path):
    """--mxfp4-experts: a Qwen3 target's experts quantized and served in MXFP4 (the fragment kernels' small-call paths
    on a GPU), every mode identical to block 1; without it the same target keeps its float experts."""
    args = ("--tiny", "--targets", "qwen3-2l", "--prompts", "1", "--new-tokens", "8", "--prompt-tokens", "24",
            "--blocks", "4", "--no-hf")
    result = _run(tmp_path, *args, "--mxfp4-experts")
    info = result["targets"]["qwen3-2l"]
    assert info["experts"].startswith("MXFP4") and info["mxfp4_expert_bytes"] > 0
    assert all(r["identical"] is True for r in result["rows"]) and len(result["rows"]) == 3
    plain = _run(tmp_path, *args)["targets"]["qwen3-2l"]
    assert not plain["experts"].startswith("MXFP4") and "mxfp4_expert_bytes" not in plain
    assert "quantized to MXFP4" in info["weights"] and "MXFP4" not in plain["weights"]


def test_demo_dflash_and_hybrid_in_process_draft_from_the_verifier_features(tmp_path):
    result = _run(tmp_path, "--targets", "demo", "--prompts", "1", "--new-tokens", "24", "--blocks", "8", "--no-hf",
                  "--repeat", "2")
    rows = {r["mode"]: r for r in result["rows"]}
    # --repeat 2: two timed runs a mode, the row the one of median forward time, both runs' times kept, both identical
    assert all(r["runs"] == 2 and len(r["forward_ms_runs"]) == 2 and r["forward_ms"] in r["forward_ms_runs"]
               for r in rows.values())
    assert "forward ms, every run" in (tmp_path / "e2e_gpu_cpu.md").read_text()
    assert set(rows) == {"verifier none@1", "verifier ngram@8", "verifier dflash@8", "verifier hybrid@8",
                         "verifier replay@8 (block-1 output, every 4th draft wrong)"}
    assert all(r["identical"] for r in rows.values())
    # DFlash drafts from the target's features of what was committed: with them misaligned or missing it would accept
    # next to nothing (tau ~ 1)
    assert rows["verifier dflash@8"]["tau"] > 1.8 and rows["verifier hybrid@8"]["tau"] > 1.8


def test_quantize_experts_then_serve_mxfp4_reads_the_same_bytes():
    """quantize_experts keeps the MXFP4 experts on the modules and gives them their dequantization; serve_mxfp4 (here
    without kernels: an expert cache of every expert) stores those very bytes, its byte map is the store's slices,
    and the float weights are gone from the modules."""
    from transformers import AutoModelForCausalLM

    from benchmarks.e2e_gpu import target_config
    from verifier_svc.model import quantize_experts, serve_mxfp4

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target_config("gpt_oss", 2, tiny=True), dtype=torch.float32).eval()
    held = quantize_experts(model)
    kept = {layer: m._pdflash_mxfp4 for layer, m in experts_modules(model).items()}
    for layer, m in experts_modules(model).items():
        w = kept[layer]
        assert held > 0 and w.fp4
        assert torch.equal(m.gate_up_proj.data, mxfp4.dequantize(w.w1, w.s1, torch.float32).transpose(1, 2))
        assert torch.equal(m.down_proj_bias.data, w.b2.float())
    import pathlib

    target = serve_mxfp4(model, pathlib.Path("/tmp/pdflash-test-gptoss"), kernels="off")
    cache = target.expert_cache
    assert target.experts_format == "mxfp4" and cache is not None and target.byte_map == cache.store.byte_map()
    assert cache.num_slots >= sum(cache.store.num_experts.values())
    for layer, m in experts_modules(model).items():
        assert "_pdflash_mxfp4" not in m.__dict__ and m.gate_up_proj.numel() == 0
        got = cache.store.layer_weights(layer)
        assert torch.equal(got.w1, kept[layer].w1) and torch.equal(got.s2, kept[layer].s2)


def test_serve_mxfp4_resident_with_the_kernels_equals_the_reference(monkeypatch):
    """With the kernels (here Triton's interpreter on the CPU), serve_mxfp4 serves every expert resident: the store's
    arena built where the model lies, used as it is by the installed kernels (no cache), byte map = its slices; greedy
    tokens equal the same model served without the kernels (the torch reference over the same MXFP4 bytes)."""
    import pathlib

    from transformers import AutoModelForCausalLM

    from benchmarks.e2e_gpu import target_config
    from benchmarks.inprocess import core_run
    from pdflash_kernels import runtime
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import quantize_experts, serve_mxfp4

    if not runtime.triton_usable("cpu"):
        pytest.skip("needs triton (its CPU interpreter)")
    cores = {}
    for kernels in ("on", "off"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(target_config("gpt_oss", 2, tiny=True), dtype=torch.float32).eval()
        quantize_experts(model)
        target = serve_mxfp4(model, pathlib.Path("/tmp/pdflash-test-gptoss"), kernels=kernels)
        cores[kernels] = VerifierCore(target, max_block_size=4, paged_kv=PagedKVOptions(kv_cache_gb=0.01))
    on = cores["on"].target
    assert on.expert_cache is None and on.experts_format == "mxfp4" and on.batch_invariant, on.kernels
    assert on.byte_map == cores["off"].target.byte_map
    arena = None
    for layer, m in experts_modules(on.model).items():
        w = m._pdflash_weights
        assert w.fp4 and m.gate_up_proj.numel() == 0
        base = w.w1.untyped_storage().data_ptr()
        arena = base if arena is None else arena
        assert base == arena  # every layer's weights are rows of the one arena
    prompt = [[(7 * i) % 500 + 2 for i in range(20)]]
    runs = {k: core_run(c, prompt, 4, 1, lambda *a: [])["outputs"] for k, c in cores.items()}
    assert runs["on"] == runs["off"], runs


def test_the_iid_replay_drafter_errs_a_third_of_the_time_wherever_a_round_starts():
    from benchmarks.e2e_gpu import replay, replay_iid

    ref = [list(range(100, 2100))]
    iid, periodic = replay_iid(ref), replay(ref, every=3)
    first_wrong = {}
    for name, propose in (("iid", iid), ("periodic", periodic)):
        for start in (0, 1, 2):  # the round starts 0, 1 or 2 positions past an error-period boundary
            firsts = [propose(0, None, [0] * n, 1, {})[0] != ref[0][n] for n in range(start, 1800, 3)]
            first_wrong[name, start] = sum(firsts) / len(firsts)
    assert all(abs(first_wrong["iid", s] - 1 / 3) < 0.06 for s in (0, 1, 2))  # the same at any alignment
    assert [first_wrong["periodic", s] for s in (0, 1, 2)] == [0.0, 0.0, 1.0]  # the periodic one depends on it
    assert iid(0, None, [0] * 5, 8, {}) == iid(0, None, [0] * 5, 8, {})  # a fixed mask: every run the same drafts


def test_a_deepseek_v3_target_runs_identical_to_block_one(tmp_path):
    """`dsv3-<N>l` (DeepSeek-V3's MLA and group-limited routing; tiny widths here, real ones on the GPU): every mode
    identical to block 1."""
    result = _run(tmp_path, "--tiny", "--targets", "dsv3-2l", "--prompts", "1", "--new-tokens", "8", "--prompt-tokens",
                  "24", "--blocks", "4", "--no-hf")
    assert result["targets"]["dsv3-2l"]["layers"] == 2
    assert all(r["identical"] is True for r in result["rows"]) and len(result["rows"]) == 3
