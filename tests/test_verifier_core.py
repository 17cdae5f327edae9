"""The verifier core in-process: KV commit/rollback, acceptance, stop rules, exact bytes, validation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from transformers import AutoModelForCausalLM

from pdflash.errors import FailedPrecondition, InvalidArgument, NotFound
from pdflash.tiny import ARCHITECTURES
from pdflash.types import DraftResult, FinishReason, SamplingParams, union_bytes, union_of
from tests.conftest import DEVICE, DTYPE
from verifier_svc.engine import PrefillInput, VerifierCore
from verifier_svc.model import load_target

PROMPT = (11, 52, 7, 300, 41, 99, 5, 17)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def core(request, tiny):
    return request.param, VerifierCore(load_target(tiny.target(request.param), DEVICE, DTYPE), max_block_size=16)


def plain_greedy(model_dir, prompt, n, eos=True):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    kw = {} if eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=0, **kw)
    return out[0, len(prompt):].tolist()


def run(core: VerifierCore, prompt, n, drafts_for, sampling=SamplingParams(), ignore_eos=False, feature_layer_ids=(0,)):
    o = core.prefill(PrefillInput("r", tuple(prompt), sampling, n, ignore_eos=ignore_eos, feature_layer_ids=feature_layer_ids))
    toks, outs = list(o.tokens), [o]
    rnd = 0
    while o.finished is None:
        rnd += 1
        block = (toks[-1], *drafts_for(len(toks)))
        o = core.verify(DraftResult(o.session_id, rnd, block, {}, 0))
        toks += o.tokens
        outs.append(o)
    return toks, outs


def test_rollback_with_corrupted_oracle_drafts_equals_plain_decoding(core, tiny):
    """Drafts that are right for a while then wrong exercise accept, reject and KV crop every round."""
    arch, c = core
    n = 48
    want = plain_greedy(tiny.target(arch), list(PROMPT), n, eos=False)
    rng = random.Random(0)

    def drafts(pos):
        k = rng.randint(0, 7)
        return [want[pos + i] if pos + i < len(want) and rng.random() < 0.85 else rng.randrange(c.target.vocab_size) for i in range(k)]

    got, outs = run(c, PROMPT, n, drafts, ignore_eos=True)
    assert got == want
    assert outs[-1].finished == FinishReason.LENGTH
    assert sum(o.num_accepted for o in outs[1:]) > 0
    # while running, the KV cache holds exactly prompt + every emitted token but the last (the anchor)
    emitted = len(outs[0].tokens)
    for o in outs[1:-1]:
        emitted += len(o.tokens)
        assert o.committed == len(PROMPT) + emitted - 1
    # features: one row per committed position, N*H wide
    assert outs[0].features.shape == (len(PROMPT), c.target.hidden_size)
    for o in outs[1:]:
        assert o.features.shape[0] == o.num_accepted + 1


def test_stop_token_ends_exactly_where_plain_decoding_does(core, tiny):
    arch, c = core
    want = plain_greedy(tiny.target(arch), list(PROMPT), 30, eos=False)
    stop = want[9]
    first = want.index(stop)
    got, outs = run(c, PROMPT, 30, lambda pos: want[pos : pos + 6], sampling=SamplingParams())
    # the model's EOS may come first; otherwise use an explicit stop id
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 30, stop_token_ids=(stop,), ignore_eos=True))
    toks = list(o.tokens)
    rnd = 0
    while o.finished is None:
        rnd += 1
        o = c.verify(DraftResult(o.session_id, rnd, (toks[-1], *want[len(toks) : len(toks) + 6]), {}, 0))
        toks += o.tokens
    assert toks == want[: first + 1]
    assert o.finished == FinishReason.STOP
    assert len(c.sessions) == 0  # finished sessions free their KV


def test_max_tokens_counts_every_emitted_token(core):
    _, c = core
    for n in (1, 2, 5):
        got, outs = run(c, PROMPT, n, lambda pos: [1, 2, 3, 4, 5, 6], ignore_eos=True)
        assert len(got) == n and outs[-1].finished == FinishReason.LENGTH


def router_choices(model, prompt_and_block: list[list[int]]) -> dict[int, set[int]]:
    """Routed experts per layer seen by forward hooks on the routers: independent of the capture code."""
    seen: dict[int, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Router") and ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])

            def hook(mod, args, out, layer=layer):
                seen.setdefault(layer, set()).update(out[-1].reshape(-1).tolist())

            hooks.append(module.register_forward_hook(hook))
    assert hooks, "no router modules found"
    return seen, hooks


def test_routed_union_and_exact_bytes(core, tiny):
    arch, c = core
    ref = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    seen, hooks = router_choices(ref, [])
    with torch.no_grad():
        ref(torch.tensor([list(PROMPT)]))
    for h in hooks:
        h.remove()
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 8, ignore_eos=True))
    assert {l: set(ids) for l, ids in o.routed_union.items()} == seen
    # exact bytes: the byte map holds every expert's stored tensors; the reported bytes are its sum over the union
    bm = c.target.byte_map
    assert o.routed_bytes == union_bytes(o.routed_union, bm)
    for layer, module in c.target.seam.modules.items():
        n = len(bm[layer])
        per_expert = sum(t[0].numel() * t.element_size() for t in [*module.parameters(recurse=False)] if t.shape[0] == n)
        assert bm[layer] == [per_expert] * n
    assert o.routed_bytes == sum(len(ids) for ids in seen.values()) * bm[c.target.moe_layers[0]][0]
    c.end(o.session_id)


def test_verify_union_covers_block_routes(core):
    _, c = core
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 20, ignore_eos=True))
    union = o.routed_union
    v = c.verify(DraftResult(o.session_id, 1, (o.tokens[0], 3, 4, 5), union, union_bytes(union, c.target.byte_map)))
    assert v.routed_union and all(ids for ids in v.routed_union.values())
    assert v.routed_bytes == union_bytes(v.routed_union, c.target.byte_map)
    assert union_of([v.routed_union]) == v.routed_union
    c.end(o.session_id)


def test_validation(core):
    _, c = core
    V = c.target.vocab_size
    with pytest.raises(InvalidArgument) as e:
        c.prefill(PrefillInput("r", (), SamplingParams(), 8))
    assert e.value.violations[0].field == "prompt_tokens"
    with pytest.raises(InvalidArgument):
        c.prefill(PrefillInput("r", (V,), SamplingParams(), 8))
    with pytest.raises(InvalidArgument):
        c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 0))
    with pytest.raises(InvalidArgument):
        c.prefill(PrefillInput("r", PROMPT, SamplingParams(temperature=-1.0), 8))
    with pytest.raises(InvalidArgument):
        c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 8, feature_layer_ids=(c.target.num_layers,)))
    o = c.prefill(PrefillInput("r", PROMPT, SamplingParams(), 8, ignore_eos=True))
    sid, a = o.session_id, o.tokens[0]
    layer = c.target.moe_layers[0]
    bad = [
        DraftResult(sid, 2, (a,), {}, 0),  # round skipped
        DraftResult(sid, 1, (a + 1 if a + 1 < V else a - 1,), {}, 0),  # not the anchor
        DraftResult(sid, 1, (a, V), {}, 0),  # outside the vocabulary
        DraftResult(sid, 1, (a,) * 17, {}, 0),  # block too large
        DraftResult(sid, 1, (a,), {999: frozenset({0})}, 0),  # not an MoE layer
        DraftResult(sid, 1, (a,), {layer: frozenset({99})}, 0),  # no such expert
        DraftResult(sid, 1, (a,), {layer: frozenset({0})}, 1),  # bytes do not match
    ]
    for d in bad:
        with pytest.raises(InvalidArgument):
            c.verify(d)
    # a bad request changes nothing: the session still verifies round 1 from its anchor
    ok = c.verify(DraftResult(sid, 1, (a,), {layer: frozenset({0})}, c.target.byte_map[layer][0]))
    assert ok.round == 1
    with pytest.raises(NotFound):
        c.verify(DraftResult("nope", 1, (a,), {}, 0))
    c.end(sid)
    with pytest.raises(NotFound):
        c.verify(DraftResult(sid, 2, (a,), {}, 0))


def test_sessions_expire_and_capacity(tiny):
    from pdflash.errors import ResourceExhausted

    c = VerifierCore(load_target(tiny.target("qwen3_moe"), DEVICE, DTYPE), max_sessions=2, idle_ttl_s=60)
    s1 = c.prefill(PrefillInput("a", PROMPT, SamplingParams(), 8, ignore_eos=True)).session_id
    c.prefill(PrefillInput("b", PROMPT, SamplingParams(), 8, ignore_eos=True))
    with pytest.raises(ResourceExhausted):
        c.prefill(PrefillInput("c", PROMPT, SamplingParams(), 8, ignore_eos=True))
    import time

    assert c.sessions.expire(time.monotonic() + 61) and len(c.sessions) == 0
    with pytest.raises(NotFound):
        c.verify(DraftResult(s1, 1, (0,), {}, 0))


def test_finished_session_refuses_verify(tiny):
    c = VerifierCore(load_target(tiny.target("qwen3_moe"), DEVICE, DTYPE))
    o = c.prefill(PrefillInput("a", PROMPT, SamplingParams(), 2, ignore_eos=True))
    v = c.verify(DraftResult(o.session_id, 1, (o.tokens[0],), {}, 0))
    assert v.finished == FinishReason.LENGTH
    with pytest.raises(NotFound):  # ended and freed
        c.verify(DraftResult(o.session_id, 2, (v.tokens[-1],), {}, 0))


def test_prefill_threads_change_nothing_but_the_prefill_threads(tiny):
    """A prefill on more CPU threads gives the same tokens, and verify forwards keep the thread count."""
    target = load_target(tiny.target("qwen3_moe"), DEVICE, DTYPE)
    before = torch.get_num_threads()
    seen = []
    want = None
    for threads in (0, before + 1):
        c = VerifierCore(target, max_block_size=16, prefill_threads=threads)
        forward = c._forward

        def spy(*args, _f=forward, **kw):
            seen.append(torch.get_num_threads())
            return _f(*args, **kw)

        c._forward = spy
        toks, _ = run(c, PROMPT, 12, lambda pos: [], ignore_eos=True)
        assert torch.get_num_threads() == before
        want = want or toks
        assert toks == want
    assert seen[len(seen) // 2] == before + 1  # the second core's prefill
    assert all(n == before for i, n in enumerate(seen) if i != len(seen) // 2)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_runs_the_lm_head_on_the_last_position_only(tiny, arch):
    """A prompt needs only the next token's logits; verify blocks need every position's."""
    target = load_target(tiny.target(arch), DEVICE, DTYPE)
    rows = []
    hook = target.model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    try:
        c = VerifierCore(target, max_block_size=16)
        o = c.prefill(PrefillInput("a", PROMPT, SamplingParams(), 8, ignore_eos=True))
        c.verify(DraftResult(o.session_id, 1, (o.tokens[0], 5, 6, 7), o.routed_union, union_bytes(o.routed_union, target.byte_map)))
    finally:
        hook.remove()
    assert rows == [1, 4]
    ref = AutoModelForCausalLM.from_pretrained(tiny.target(arch), dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    with torch.no_grad():
        assert o.tokens[0] == int(ref(torch.tensor([PROMPT])).logits[0, -1].argmax())


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_route_union_is_the_set_of_routed_ids_per_layer(data):
    """The one-scatter union equals the plain set of each layer's ids in [0, n) (ids outside are padding)."""
    from verifier_svc.experts import RouteRecorder

    experts = data.draw(st.integers(1, 12))
    layers = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True))
    n_ids = data.draw(st.integers(1, 16))
    uniform = data.draw(st.booleans())
    rec, want = RouteRecorder(), {}
    for layer in layers:
        k = n_ids if uniform else data.draw(st.integers(1, 16))
        ids = data.draw(st.lists(st.integers(-1, experts + 2), min_size=k, max_size=k))
        rec.add(layer, torch.tensor(ids).reshape(-1, 1))
        want[layer] = frozenset(i for i in ids if 0 <= i < experts)
    assert rec.union({layer: experts for layer in layers}) == dict(sorted(want.items()))


def test_gpt_oss_past_its_sliding_window_equals_plain_decoding(tmp_path):
    """A prompt longer than gpt-oss's sliding window, then rounds that accept and reject, on transformers' DynamicCache
    (the CPU path). The prefill must leave each sliding layer its window: transformers 5.17 returns every recorded state
    of a layer that was not cropped since its last forward, so the next verify's keys outran its mask (a RuntimeError,
    seen on the H200 machine's 5.17); 5.24 slices them but still holds them."""
    import json

    from pdflash.tiny import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / "gpt-oss-window", "gpt_oss")
    cfg = json.loads((d / "config.json").read_text())
    window = 16
    cfg["sliding_window"] = window
    (d / "config.json").write_text(json.dumps(cfg))
    c = VerifierCore(load_target(d, DEVICE, DTYPE), max_block_size=16)
    assert c.pool is None  # the DynamicCache path
    prompt = [(7 * i + 3) % 300 + 10 for i in range(window + 9)]
    n = 40
    want = plain_greedy(d, prompt, n, eos=False)
    got, _ = run(c, prompt, n, lambda pos: [], ignore_eos=True)
    assert got == want
    o = c.prefill(PrefillInput("r", tuple(prompt), SamplingParams(), n, ignore_eos=True))
    sliding = [layer for layer in c.sessions.get(o.session_id).cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(layer.keys.shape[-2] <= window - 1 for layer in sliding)
    c.sessions.end(o.session_id)
    rng = random.Random(1)

    def drafts(pos):
        return [want[pos + i] if pos + i < len(want) and rng.random() < 0.8 else rng.randrange(300) for i in range(rng.randint(0, 9))]

    got, outs = run(c, prompt, n, drafts, ignore_eos=True)
    assert got == want and sum(o.num_accepted for o in outs[1:]) > 0
