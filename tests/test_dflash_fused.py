"""The DFlash drafter's fused inference form (`DFlashDraftModel.fuse`, what `load_dflash` does by default) against the
model as constructed (unfused, the original Qwen3 ops; what training runs): the same drafts on the demo drafter, the
checkpoint layout kept on save and load, and the kernel count of a proposal and a commit held at what the fusion
reached (benchmarks/drafter_ops.py counts them; counting aten ops on the CPU is deterministic)."""

from __future__ import annotations

import copy
import json
import pathlib

import numpy as np
import pytest
import torch
from safetensors import safe_open

from drafter_svc.dflash_model import ContextKV, DFlashDraftModel, DFlashSpec, load_dflash

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = 40
NEW = 96
WIDTHS = (15, 3, 7, 11, 1, 15, 5, 2, 9)
#: Fused vs unfused in float32: the fused form changes float rounding only (addcmul's fused multiply-add, the residual
#: adds inside the matmuls, summation order of the reordered heads and concatenated weights). Measured on this sequence
#: (2026-12-01, torch 2.13 CPU): max abs difference 2.0e-5 on logits up to ~21 in magnitude, 1.2e-5 on hidden states,
#: 1e-6 on cached K/V. The bounds are ~10x that; a real mistake (a head or weight mixed up) is off by 1e-2 and more.
#: (In bfloat16 the two differ by bf16 rounding: up to ~0.2 on logits, 2 of 405 drafts flipped on near ties.)
LOGITS_ATOL, LOGITS_RTOL = 2e-4, 1e-5
HIDDEN_ATOL, HIDDEN_RTOL = 1e-4, 1e-5

#: Kernel-launching aten ops (views apart) the fused drafter dispatches on the CPU in float32, and the same with each
#: F.rms_norm counted as its one CUDA kernel (`cuda`), per call of any bucket; benchmarks/drafter_ops.py prints them. A
#: change that adds ops fails here: cut them again, or raise the bound knowingly (and update benchmarks/README.md's table).
MAX_KERNELS = {
    ("static", "propose"): (163, 93),
    ("static", "commit"): (19, 11),
    ("eager", "propose"): (159, 89),
    ("eager", "commit"): (18, 10),
}


from tests.test_dflash_graphs import demo, one_thread  # noqa: E402,F401 - the same fixtures (one torch thread, the demo pair)


@pytest.fixture(scope="module")
def sequence(demo):
    """A prompt's greedy continuation by the demo target and the features of every position (float32)."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = demo
    layers = json.loads((drafter_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[0][:PROMPT]
    with torch.no_grad():
        seq = target.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0]
        hidden = target(seq[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[i + 1][0] for i in layers], -1)
    return seq.tolist(), feats


def test_the_fused_drafter_drafts_what_the_unfused_one_drafts(demo, sequence):
    """Round after round over a real sequence (commits of every size, proposals of every width): the fused model's
    cached K/V, hidden states and logits equal the unfused model's to float rounding, and its drafts are the same
    tokens; the fused model's own forward (the training-time code path, from scratch over all context) agrees too."""
    from drafter_svc.drafters.dflash import load_target_head

    target_dir, drafter_dir = demo
    fused, plain = load_dflash(drafter_dir), load_dflash(drafter_dir, fuse=False)
    assert fused.fused and not plain.fused and not hasattr(fused.layers[0].self_attn, "q_proj")
    head = load_target_head(target_dir)
    seq, feats = sequence
    caches = ContextKV(len(fused.layers)), ContextKV(len(plain.layers))
    pos, rounds, accepted_total = PROMPT, 0, 0
    with torch.no_grad():
        for model, cache in zip((fused, plain), caches):
            model.extend_context(cache, feats[None, :PROMPT])
        while pos < len(seq) - 1:
            k = min(WIDTHS[rounds % len(WIDTHS)], len(seq) - pos - 1)
            block = head.embed[torch.tensor([seq[pos]] + [fused.spec.mask_token_id] * k)][None]
            h_fused, h_plain = fused.draft(block, caches[0]), plain.draft(block, caches[1])
            torch.testing.assert_close(h_fused, h_plain, atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
            l_fused, l_plain = h_fused[0, 1:] @ head.lm_head.T, h_plain[0, 1:] @ head.lm_head.T
            torch.testing.assert_close(l_fused, l_plain, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
            drafts = l_fused.argmax(-1).tolist()
            assert drafts == l_plain.argmax(-1).tolist(), f"round {rounds} at {pos}"
            if rounds % 4 == 0:  # from scratch over every committed row: the same hidden states
                scratch = fused(block, torch.arange(pos, pos + k + 1)[None], context=feats[None, :pos],
                                context_positions=torch.arange(pos)[None])
                torch.testing.assert_close(scratch, h_fused, atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
            accepted = 0
            while accepted < k and drafts[accepted] == seq[pos + 1 + accepted]:
                accepted += 1
            n = accepted + 1
            for model, cache in zip((fused, plain), caches):
                model.extend_context(cache, feats[None, pos : pos + n])
            pos, rounds, accepted_total = pos + n, rounds + 1, accepted_total + n
    assert caches[0].length == caches[1].length == pos
    for i in range(len(fused.layers)):
        for a, b in zip(caches[0].layer(i), caches[1].layer(i)):
            torch.testing.assert_close(a, b, atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
    assert accepted_total / rounds > 1.5, "the demo drafter should draft its target: the comparison covers real drafts"


def test_the_graphs_static_path_drafts_what_the_unfused_drafter_drafts(demo, sequence):
    """The graphs' static forwards (run uncaptured) on the fused model: the unfused eager drafter's drafts."""
    from drafter_svc.dflash_graphs import DFlashGraphs
    from drafter_svc.drafters import make_factory

    f = make_factory("dflash", *demo)
    f.use_graphs(DFlashGraphs(f.model, f.head.embed, f.head.lm_head, capacity=256, capture=False))
    plain = load_dflash(demo[1], fuse=False)
    seq, feats = sequence
    s, cache = f.new_session(), ContextKV(len(plain.layers))
    s.start(seq[:PROMPT], feats[:PROMPT].numpy())
    with torch.no_grad():
        plain.extend_context(cache, feats[None, :PROMPT])
        pos, rounds = PROMPT, 0
        while pos < len(seq) - 1:
            k = min(WIDTHS[rounds % len(WIDTHS)], len(seq) - pos - 1)
            block = f.head.embed[torch.tensor([seq[pos]] + [plain.spec.mask_token_id] * k)][None]
            want = (plain.draft(block, cache)[0, 1:] @ f.head.lm_head.T).argmax(-1).tolist()
            assert s.propose(seq[pos], k) == want, f"round {rounds} at {pos}"
            n = 1 + next((i for i in range(k) if want[i] != seq[pos + 1 + i]), k)
            s.commit(seq[pos : pos + n], feats[pos : pos + n].numpy())
            plain.extend_context(cache, feats[None, pos : pos + n])
            pos, rounds = pos + n, rounds + 1
    assert s.graphed is not None, "the session left the graphs: the comparison did not cover the static path"


def test_save_keeps_the_checkpoint_layout_and_load_takes_it_back(demo, tmp_path):
    """A fused model's state dict and saved checkpoint are the original layout, names, shapes, dtypes and values (the
    file byte for byte what the unfused model writes); the saved checkpoint loads back fused to the same weights, and a
    checkpoint-layout state loads into a fused model (the derived q/k norm weights follow it)."""
    drafter_dir = demo[1]
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as f:
        dtype = {f.get_tensor(k).dtype for k in f.keys()}.pop()  # bfloat16: as trained drafters are saved
    fused, plain = load_dflash(drafter_dir, dtype=dtype), load_dflash(drafter_dir, dtype=dtype, fuse=False)
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    state = fused.state_dict()
    assert set(state) == set(on_disk) == set(plain.state_dict())
    for name, tensor in on_disk.items():
        assert state[name].shape == tensor.shape and state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name
    fused.save(tmp_path / "fused")
    plain.save(tmp_path / "plain")
    assert (tmp_path / "fused" / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    assert (tmp_path / "fused" / "config.json").read_text() == (tmp_path / "plain" / "config.json").read_text()
    again = load_dflash(tmp_path / "fused", dtype=dtype)
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, on_disk[name]), name
    assert torch.equal(again.qkv_weight, fused.qkv_weight)
    assert torch.equal(again.layers[0].self_attn.o_proj.weight, fused.layers[0].self_attn.o_proj.weight)

    # A changed checkpoint-layout state into the fused model: it drafts what the unfused model given it drafts.
    fused, plain = load_dflash(drafter_dir), load_dflash(drafter_dir, fuse=False)
    changed = {k: v * 1.01 if k.endswith(("q_norm.weight", "k_norm.weight", "q_proj.weight", "o_proj.weight")) else v
               for k, v in plain.state_dict().items()}
    fused.load_state_dict(changed)
    plain.load_state_dict(changed)
    feats = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 12, fused.fc.in_features)).astype(np.float32))
    block = torch.randn(1, 8, fused.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        caches = ContextKV(len(fused.layers)), ContextKV(len(plain.layers))
        fused.extend_context(caches[0], feats)
        plain.extend_context(caches[1], feats)
        torch.testing.assert_close(fused.draft(block, caches[0]), plain.draft(block, caches[1]),
                                   atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL)
    # training's warm start: an unfused model takes a fused model's state dict
    fresh = DFlashDraftModel(plain.config, plain.spec)
    fresh.load_state_dict(fused.state_dict())
    assert all(torch.equal(v, fused.state_dict()[k]) for k, v in fresh.state_dict().items() if not k.startswith("rotary_emb."))


@pytest.mark.parametrize("heads, kv_heads, bias", [(6, 2, True), (4, 1, False), (2, 2, False)])
def test_fusion_holds_for_other_head_layouts_and_biases(heads, kv_heads, bias):
    """Random drafters with 3 query heads per key head and biased projections, one key head, and no grouping: fused
    and unfused agree in every forward (cached drafts, a commit, and the training-style forward with a per-row mask)."""
    from transformers import Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=16, attention_bias=bias, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain = DFlashDraftModel(cfg, DFlashSpec(block_size=8, mask_token_id=1, target_layer_ids=[0, 1], num_target_layers=2)).eval()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from their init, so that a mixed-up one shows
    fused = copy.deepcopy(plain).fuse()
    g = torch.Generator().manual_seed(1)
    feats, block = torch.randn(1, 10, 96, generator=g), torch.randn(1, 6, 48, generator=g)
    with torch.no_grad():
        caches = ContextKV(3), ContextKV(3)
        for model, cache in zip((fused, plain), caches):
            model.extend_context(cache, feats[:, :7])
        torch.testing.assert_close(fused.draft(block, caches[0]), plain.draft(block, caches[1]), atol=1e-5, rtol=1e-5)
        for model, cache in zip((fused, plain), caches):
            model.extend_context(cache, feats[:, 7:])
        torch.testing.assert_close(fused.draft(block, caches[0]), plain.draft(block, caches[1]), atol=1e-5, rtol=1e-5)
        mask = torch.rand(1, 1, 6, 16, generator=g) > 0.3
        mask[..., 10:] = True  # every row sees some key
        args = (block, torch.arange(10, 16)[None])
        kwargs = dict(context=feats, context_positions=torch.arange(10)[None], attn_mask=mask)
        torch.testing.assert_close(fused(*args, **kwargs), plain(*args, **kwargs), atol=1e-5, rtol=1e-5)
    state = fused.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())


def test_the_kernel_count_stays_at_what_the_fusion_reached():
    """The aten ops that launch kernels (benchmarks/drafter_ops.py's count, float32 on the CPU), for every proposal and
    commit bucket of the static (graph) path and the eager path, stay at or under MAX_KERNELS (the unfused drafter
    dispatched 275 / 89 for a static proposal / commit, 317 / 102 in bfloat16)."""
    from benchmarks.drafter_ops import measure

    with torch.no_grad():
        counts = measure("float32", 64)
    for (path, call), (kernels, cuda) in MAX_KERNELS.items():
        for bucket, c in counts[path][call].items():
            assert c["kernels"] <= kernels and c["cuda"] <= cuda, (path, call, bucket, c["kernels"], c["cuda"], c["by_op"])
