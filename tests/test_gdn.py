"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) on pdflash_kernels.gdn: the references equal transformers'
own formulas; the kernels (Triton's interpreter here, bf16 at real widths on the GPU: tests/test_gdn_gpu.py) give a
token the same bits whatever block it is forwarded in and whatever rejected tokens were forwarded and dropped before
it; the installed forward rolls back on any transformers (its state is its own), so the engine verifies drafts on
these hybrids exactly."""

from __future__ import annotations

import pytest
import torch

from pdflash_kernels import gdn
from tests.conftest import needs_triton

B, HK, HV, DK, DV, K = 2, 2, 4, 16, 16, 4
C = 2 * HK * DK + HV * DV


def _inputs(t: int, seed: int, dtype=torch.bfloat16, per_channel: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, t, C, generator=g).to(dtype)
    decay = -torch.rand(B, t, HV, *([DK] if per_channel else []), generator=g) * 0.7  # per key channel: Kimi's
    beta = torch.rand(B, t, HV, generator=g).to(dtype)
    return x, decay, beta


def _run(chunks, drops, weight, dtype=torch.bfloat16, commits=None):
    """Forward `chunks` ((x, g, beta) each) one after another, dropping drops[i] tokens after forward i, as the
    installed layer does (commits[i]: forward i's first tokens put into the state at once, as a long prompt's are);
    the outputs of the kept tokens, and the state."""
    st = gdn.GDNState.zeros(B, HV, DK, DV, K, C, dtype, "cpu")
    kept = []
    for i, ((x, dec, beta), d) in enumerate(zip(chunks, drops)):
        c = commits[i] if commits else 0
        conv = gdn.causal_conv(x, st, weight, commit=c)
        out = gdn.gated_delta(conv, dec, beta, st, HK, HV, DK, DV, commit=c)
        st.pending, st.accepted = tuple(t[:, c:].clone() for t in (x, conv, dec, beta)), x.shape[1] - c
        st.drop(d)
        kept.append(out[:, : x.shape[1] - d])
    return torch.cat(kept, dim=1), st


def test_the_references_are_transformers_formulas():
    """gated_delta_ref is transformers' token-by-token rule (q, k L2-normalized, q / sqrt(d_k), grouped value heads),
    and causal_conv_ref its causal depthwise convolution + SiLU, within float32 rounding."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    x, dec, beta = _inputs(7, 0, torch.float32)
    w = torch.randn(C, K)
    hist = torch.zeros(B, K - 1, C)
    conv, new_hist = gdn.causal_conv_ref(x, hist, None, 0, w)
    want = m.torch_causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu") if hasattr(
        m, "torch_causal_conv1d_fn") else m.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu")
    torch.testing.assert_close(conv, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert torch.equal(new_hist, hist)  # nothing accepted before x yet: x is still pending

    q, k, v = gdn._split(conv, HK, HV, DK, DV)
    s0 = torch.randn(B, HV, DK, DV) * 0.1
    out, s = gdn.gated_delta_ref(q, k, v, dec, beta, s0)
    rule = getattr(m, "torch_recurrent_gated_delta_rule")
    rep = HV // HK  # (transformers 5.17's rule takes key heads already repeated to the value heads, as its module does)
    want_out, want_s = rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g=dec, beta=beta,
                            initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)


def test_the_reference_is_kimi_delta_attentions_rule_with_a_decay_per_channel():
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    _, dec, beta = _inputs(5, 3, torch.float32, per_channel=True)
    q, k, v = gdn._split(torch.randn(B, 5, 3 * HV * DK), HV, HV, DK, DV)  # (Kimi: as many key heads as value heads)
    s0 = torch.randn(B, HV, DK, DV) * 0.1
    out, s = gdn.gated_delta_ref(q, k, v, dec, beta, s0)
    want_out, want_s = m.recurrent_kimi_delta_attention(q, k, v, g=dec, beta=beta, initial_state=s0,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)


@needs_triton
def test_the_kernels_match_the_float64_references():
    x, dec, beta = _inputs(6, 1)
    w = (torch.randn(C, K) * 0.5).to(torch.bfloat16)
    st = gdn.GDNState.zeros(B, HV, DK, DV, K, C, torch.bfloat16, "cpu")
    st.S = torch.randn(B, HV, DK, DV) * 0.1
    s0, h0 = st.S.clone(), torch.randn(B, K - 1, C).to(torch.bfloat16)
    st.hist = h0.clone()
    conv = gdn.causal_conv(x, st, w)
    out = gdn.gated_delta(conv, dec, beta, st, HK, HV, DK, DV)
    want_conv, _ = gdn.causal_conv_ref(x, h0, None, 0, w)
    torch.testing.assert_close(conv.float(), want_conv.float(), rtol=2e-2, atol=2e-2)
    want_out, _ = gdn.gated_delta_ref(*gdn._split(conv, HK, HV, DK, DV), dec, beta, s0)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(st.S, s0)  # nothing replayed: the committed state is untouched until the next forward


@needs_triton
@pytest.mark.parametrize("split", [
    [(3, 0), (4, 2), (1, 0), (1, 0), (5, 3)],  # a block whose last 2 were rejected, singles, a block with 3 rejected
    [(1, 0), (8, 7), (8, 0), (2, 1)],  # a block where only the anchor was kept, then one where all were
    [(6, 0), (6, 5), (6, 5), (3, 0)],  # rollbacks back to back
    [(7, 0, 5), (6, 2, 1), (3, 0)],  # a "prompt" whose first 5 tokens enter the state at once, then a block of 6 whose
])                                   # first enters it at once and whose last 2 are dropped
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated-deltanet", "kimi-delta"])
def test_a_token_has_the_same_bits_whatever_block_it_is_in_and_whatever_was_rolled_back(split, per_channel):
    """The same token sequence forwarded one token at a time (block 1) and in blocks that carry rejected tokens (random
    ones, dropped afterwards): every kept token's output and the final state are bit-identical (a decay per head, or
    per key channel as Kimi Delta Attention's)."""
    total = sum(sp[0] - sp[1] for sp in split)
    x, dec, beta = _inputs(total, 2, per_channel=per_channel)
    w = (torch.randn(C, K) * 0.5).to(torch.bfloat16)
    one, st_one = _run([(x[:, i:i + 1], dec[:, i:i + 1], beta[:, i:i + 1]) for i in range(total)], [0] * total, w)
    chunks, at = [], 0
    for n, d, *_ in split:
        keep = n - d
        junk_x, junk_g, junk_b = _inputs(d, 100 + at, per_channel=per_channel)
        chunks.append((torch.cat([x[:, at:at + keep], junk_x], 1), torch.cat([dec[:, at:at + keep], junk_g], 1),
                       torch.cat([beta[:, at:at + keep], junk_b], 1)))
        at += keep
    blocks, st_blocks = _run(chunks, [sp[1] for sp in split], w, commits=[(sp[2:] or [0])[0] for sp in split])
    assert torch.equal(one.view(torch.int16), blocks.view(torch.int16))
    # the committed state after one more (empty-output) forward: both replay their pending tokens
    for st in (st_one, st_blocks):
        gdn.causal_conv(x[:, :1], st, w)
        gdn.gated_delta(gdn.causal_conv_ref(x[:, :1], st.hist, None, 0, w)[0], dec[:, :1], beta[:, :1], st, HK, HV, DK, DV)
    assert torch.equal(st_one.S, st_blocks.S) and torch.equal(st_one.hist, st_blocks.hist)


@needs_triton
def test_mamba_v1_blocks_with_rollbacks_give_block_ones_bits():
    """Jamba's Mamba (v1) mixer on the kernels (a decay per state and channel, exp(dt A), dt and D a channel; B and C
    from x_proj after the convolution): blocks that carry rejected tokens, cropped from the session's cache, give every
    kept token block 1's bits, which are the mixer's own float32 outputs to bf16 rounding."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    from pdflash.hf_compat import new_session_cache
    from pdflash.tiny import generic_config

    cfg = generic_config("jamba", 64, 1, 2)
    torch.manual_seed(0)
    ref = JambaMambaMixer(cfg, layer_idx=0).eval()
    mixer = JambaMambaMixer(cfg, layer_idx=0).eval()
    mixer.load_state_dict(ref.state_dict())
    mixer = mixer.to(torch.bfloat16)
    assert gdn.layer_forward(mixer) is gdn.mamba1_forward and gdn.layer_forward(ref) is gdn.mamba1_forward
    total = 20
    h = torch.randn(1, total, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        cache = new_session_cache(cfg, 32)
        one = torch.cat([gdn.mamba1_forward(mixer, h[:, i:i + 1], cache=cache) for i in range(total)], 1)
        for split in ([(8, 0)] * 2 + [(4, 0)], [(3, 0), (8, 5), (8, 2), (6, 0), (5, 3)]):
            cache, kept, at = new_session_cache(cfg, 32), [], 0
            for n, d in split:
                junk = torch.randn(1, d, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + at)).bfloat16()
                out = gdn.mamba1_forward(mixer, torch.cat([h[:, at:at + n - d], junk], 1), cache=cache)
                if d:
                    cache.layers[0].crop(-d)  # (the one layer run here; the others hold nothing)
                kept.append(out[:, :n - d])
                at += n - d
            assert torch.equal(torch.cat(kept, 1), one), split
        want = ref(h.float())
    torch.testing.assert_close(one.float(), want, rtol=0.0, atol=0.03 * want.abs().max().item())


def test_dropping_more_than_the_last_forward_left_pending_is_refused():
    st = gdn.GDNState.zeros(1, HV, DK, DV, K, C, torch.float32, "cpu")
    x = torch.zeros(1, 4, C)
    st.pending, st.accepted = (x, x, x[..., :HV], x[..., :HV]), 4
    st.drop(1)
    st.drop(0)  # crop(0) after a crop keeps what the first left
    assert st.accepted == 3
    with pytest.raises(ValueError, match="3 of the last forward's tokens can still be dropped"):
        st.drop(4)


@pytest.mark.parametrize("keep", [gdn.ROLLBACK_TOKENS, 2])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text", "kimi_linear", "lfm2_moe", "granitemoehybrid",
                                  "nemotron_h", "jamba"])
def test_the_layer_forward_is_transformers_and_rolls_back_itself(arch, keep, monkeypatch):
    """gdn's forward on a real Qwen3-Next / Qwen3.5 / Kimi Linear / LFM2 / Granite-4.0-H (Mamba-2) layer (float32, the
    references: CPU) gives the layer's own outputs, with and without a cache; after a block whose last 2 tokens are cropped, the next token's output equals a run that
    never saw them, even where transformers' own crop would not roll the recurrent state back (transformers < 5.25,
    emulated by a crop that does nothing to it: the state is gdn's own); the same where only a forward's last 2 tokens
    stay pending."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from pdflash.hf_compat import new_session_cache
    from pdflash.tiny import generic_config

    monkeypatch.setattr(gdn, "_use_triton", lambda x: False)
    monkeypatch.setattr(gdn, "ROLLBACK_TOKENS", keep)  # 2: each forward's first tokens enter the state at once
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(generic_config(arch, 64, 1, 2)).eval()
    layer = next(m for m in model.modules() if gdn.layer_forward(m) is not None)
    fwd = gdn.layer_forward(layer)
    h = torch.randn(1, 6, model.config.hidden_size)
    with torch.inference_mode():
        want = layer(h)
        torch.testing.assert_close(fwd(layer, h), want, rtol=1e-4, atol=1e-5)
        monkeypatch.setattr(LinearAttentionCacheLayerMixin, "crop", lambda self, n: None)  # rolls nothing back
        cache = new_session_cache(model.config, 8)
        kw = {"cache": cache}
        fwd(layer, h[:, :3], **kw)
        fwd(layer, torch.cat([h[:, 3:4], torch.randn(1, 2, h.shape[-1])], 1), **kw)
        cache.layers[layer.layer_idx].crop(-2)  # (the one layer run here: transformers 5.17's crop of the empty
        got = fwd(layer, h[:, 4:6], **kw)      # attention layers fails)
        torch.testing.assert_close(got, want[:, 4:6], rtol=1e-4, atol=1e-5)
        fresh = DynamicCache(config=model.config)
        torch.testing.assert_close(fwd(layer, h, cache=fresh), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@needs_triton
@pytest.mark.timeout(1200)  # interpreted Triton: granitemoehybrid took 352-402 s on a 2-core CPU under -n 2
@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear", "granitemoehybrid", "nemotron_h", "jamba"])  # (Qwen3.5, LFM2: the layer tests)
def test_hybrids_with_the_kernels_verify_drafts_exactly_on_any_transformers(arch, tmp_path, monkeypatch):
    """A tiny Qwen3-Next / Kimi Linear (latent attention without positions) / Granite-4.0-H (Mamba-2, no positions) with
    the kernels (Triton's interpreter): every part of the forward is reported batch-invariant (no op left on torch's
    kernels), and drafts replayed with every 4th one wrong give block 1's tokens. With transformers' crop unable to roll
    the recurrent state back (transformers 5.17's, emulated), the load-time rollback check still passes: the installed
    layers roll back themselves. Each runs on the paged forward (the recurrent state in per-session slots, no KV pages
    for those layers) and gives the tokens of transformers' cache."""
    import sys
    import pathlib

    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from pdflash.tiny import make_tiny_checkpoint
    from verifier_svc import servable
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from e2e_gpu import replay
    from inprocess import core_run

    crop = LinearAttentionCacheLayerMixin.crop

    def crop_conv_only(self, tokens_to_remove):
        kept = dict(self.recurrent_states)
        crop(self, tokens_to_remove)
        self.recurrent_states.update(kept)

    monkeypatch.setattr(LinearAttentionCacheLayerMixin, "crop", crop_conv_only)
    monkeypatch.setattr(servable, "keeps_recurrent_states", lambda: False)
    d = make_tiny_checkpoint(tmp_path / arch, arch)
    target = load_target(d, "cpu", "bfloat16", kernels="on")
    info = target.kernels
    assert info["batch_invariant"] and not info["uncovered_ops"], info
    assert info["linear_attention"].startswith("triton gated delta rule")
    from verifier_svc.engine import PagedKVOptions

    core = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="auto", kv_cache_gb=0.01))
    assert core.pool is not None and core.pool.linear is not None and not core.pool.k[0].numel(), core.paged_off
    types = target.model.config.get_text_config().layer_types  # KV pages for the attention layers alone
    assert [bool(core.pool.k[i].numel()) for i in range(len(types))] == [
        "attention" in k and k != "linear_attention" for k in types], types
    assert core.wave_forward  # (positions: a table, or none at all)
    prompts, n = [[5, 9, 13, 2, 7, 11]], 8
    one = core_run(core, prompts, n, 1)["outputs"]
    replayed = core_run(core, prompts, n, 8, propose=replay([o[:n] for o in one]))
    assert [o[:n] for o in replayed["outputs"]] == [o[:n] for o in one]
    assert any(0 < acc < drafts for drafts, acc, _ in replayed["round_log"])
    dense = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="off"))
    assert core_run(dense, prompts, n, 1)["outputs"] == one


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_triton), False], ids=["kernels", "references"])
@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear", "lfm2_moe", "granitemoehybrid", "nemotron_h", "jamba"])
def test_the_paged_state_gives_block_ones_bits_in_waves_with_rollbacks(arch, kernels, monkeypatch):
    """The paged form (a state slot per session, pending tokens in alternating halves written by the kernels, every
    count read from device memory: what CUDA graphs replay): two sessions forwarded in solo forwards and in waves of
    both, with rejected tokens, a forward that commits all but its last `pending` tokens and a wave's padding rows past
    both sessions, give each kept token the bits of that session's token-by-token forward on transformers' cache. The
    CPU's references (no Triton) give the same to rounding (their float64 state is rounded where a forward ends)."""
    if not kernels:
        monkeypatch.setattr(gdn, "_use_triton", lambda x: False)
    from transformers import AutoModelForCausalLM

    from pdflash.hf_compat import new_session_cache
    from pdflash.tiny import generic_config
    from verifier_svc.kv import KVPool, LinearStates, SequenceKV
    from verifier_svc.runner import LinearStep, PagedLayerCache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(generic_config(arch, 64, 1, 2)).to(torch.bfloat16).eval()
    layer = next(m for m in model.modules() if gdn.layer_forward(m) is not None)
    fwd = gdn.layer_forward(layer)
    hidden = model.config.hidden_size
    streams = [torch.randn(1, 14, hidden).to(torch.bfloat16) for _ in range(2)]
    with torch.inference_mode():
        want = []
        for h in streams:
            cache = new_session_cache(model.config, 8)
            want.append(torch.cat([fwd(layer, h[:, i:i + 1], cache=cache) for i in range(h.shape[1])], 1))
        states = LinearStates({layer.layer_idx: layer}, 3, 4, torch.bfloat16, torch.device("cpu"))
        pool = KVPool(1, 1, 8, 4, torch.bfloat16, torch.device("cpu"), kv_layers=set(), linear=states)
        seqs, at = [SequenceKV(pool, 64), SequenceKV(pool, 64)], [0, 0]
        # (session, kept, junk) per forward; a list of them is a wave (then 3 padding rows follow)
        plan = [[(0, 6, 0)], [(1, 2, 1), (0, 1, 3)], [(1, 3, 0)], [(0, 4, 0), (1, 2, 2)], [(1, 1, 0)], [(0, 3, 1)],
                [(1, 6, 0)]]
        for step in plan:
            xs, rows, row0 = [], [], 0
            for s, keep, junk in step:
                x = torch.cat([streams[s][:, at[s]: at[s] + keep], torch.randn(1, junk, hidden).to(torch.bfloat16)], 1)
                rows.append(seqs[s].linear_row(at[s], keep + junk, row0))
                xs.append(x)
                row0 += x.shape[1]
            pad = 3 if len(step) > 1 else 0
            x = torch.cat(xs + [torch.randn(1, pad, hidden).to(torch.bfloat16)], 1)
            step_ = LinearStep(states, torch.tensor(rows, dtype=torch.int32), rows)
            out = fwd(layer, x, cache=PagedLayerCache(pool, None, None, step_))
            for (s, keep, _), (_, _, _, _, r0, _) in zip(step, rows):
                got, ref = out[:, r0: r0 + keep], want[s][:, at[s]: at[s] + keep]
                if kernels:
                    assert torch.equal(got, ref), (step, s)
                else:
                    torch.testing.assert_close(got.float(), ref.float(), rtol=0.02, atol=0.02)
                at[s] += keep
        assert at == [14, 14]
        seqs[0].free()
        assert states.free_slots == 1 and seqs[0].linear is None
        with pytest.raises(ValueError, match="cannot continue the recurrent state"):
            seqs[1].linear_row(3, 1)  # before the tokens its last forward left pending


@needs_triton
def test_a_kv_budget_too_small_for_one_sessions_recurrent_state_is_said(tmp_path):
    """The recurrent state's slots take at most half of --kv-cache-gb: a budget without room for one session's (and the
    graphs' scratch) turns the paged forward off in auto, saying how much to ask for, and is refused with `on`."""
    from pdflash.tiny import make_tiny_checkpoint
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(make_tiny_checkpoint(tmp_path / "qnext", "qwen3_next"), "cpu", "bfloat16", kernels="on")
    core = VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="auto", kv_cache_gb=1e-7))
    assert core.pool is None and "holds the recurrent state of no session" in core.paged_off
    with pytest.raises(ValueError, match=r"--paged-kv on: .* ask --kv-cache-gb [0-9.e-]+ or more"):
        VerifierCore(target, max_block_size=8, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=1e-7))


def test_a_session_beyond_the_recurrent_state_slots_is_told_to_retry():
    """Slot 0 is the graphs' scratch: with 2 slots one sequence gets a state, the next is refused with a retry hint
    (RESOURCE_EXHAUSTED), and a freed slot is handed out again, reset."""
    from transformers import AutoModelForCausalLM

    from pdflash.errors import ResourceExhausted
    from pdflash.tiny import generic_config
    from verifier_svc.kv import KVPool, LinearStates, SequenceKV

    model = AutoModelForCausalLM.from_config(generic_config("qwen3_next", 64, 1, 2))
    layer = next(m for m in model.modules() if gdn.layer_forward(m) is not None)
    states = LinearStates({layer.layer_idx: layer}, 2, 4, torch.float32, torch.device("cpu"))
    pool = KVPool(1, 1, 8, 4, torch.float32, torch.device("cpu"), kv_layers=set(), linear=states)
    first = SequenceKV(pool, 64)
    assert first.linear == 1
    states.layers[layer.layer_idx].S[1].fill_(1.0)
    with pytest.raises(ResourceExhausted, match="every recurrent-state slot is taken"):
        SequenceKV(pool, 64)
    first.free()
    again = SequenceKV(pool, 64)
    assert again.linear == 1 and not states.layers[layer.layer_idx].S[1].any()


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear", "lfm2_moe", "granitemoehybrid", "nemotron_h", "jamba"])
def test_a_slots_stated_bytes_are_what_it_allocates(arch):
    """PagedGDN.slot_bytes (what --kv-cache-gb's share for the recurrent state is divided by) equals the bytes one slot
    of the state takes: S, the convolution history, and both halves of the pending rows, g and beta (Mamba v1's rows x |
    B | C wide and its dt a channel)."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import generic_config

    model = AutoModelForCausalLM.from_config(generic_config(arch, 64, 1, 2))
    layer = next(m for m in model.modules() if gdn.layer_forward(m) is not None)
    st = gdn.PagedGDN.for_module(layer, 1, 8, torch.bfloat16, "cpu")
    held = sum(t.numel() * t.element_size() for t in (st.S, st.hist, st.px, st.pc, st.pg, st.pb))
    assert gdn.PagedGDN.slot_bytes(layer, 8, torch.bfloat16) == held
