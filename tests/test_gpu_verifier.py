"""The verifier on a CUDA GPU (skipped without one): with the batch-invariant kernels installed at load, greedy
output is token for token the verifier's own block-1 decoding, for every drafter and block width, fixed or
adaptive, and for sessions verified interleaved; real layer shapes in bf16 (Qwen3-30B-A3B, gpt-oss-20b with
its sliding window and sinks, Mixtral-8x7B; two layers, random weights) so near ties exist.

The reference is block-1 decoding on the same GPU, the same dtype (bf16) and the same kernels. Run on the GPU
machine with `bash benchmarks/gpu.sh OUT tests`."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW = 256


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "mixtral"])
def core(request, tmp_path_factory):
    from pdflash.tiny import make_real_shape_checkpoint
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    d = make_real_shape_checkpoint(tmp_path_factory.mktemp(request.param), request.param, device="cuda")
    target = load_target(d, "cuda", "bfloat16", kernels="on")
    assert target.batch_invariant, target.kernels
    # as the server runs it on CUDA: the paged KV pool, verify forwards replayed from CUDA graphs
    c = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=4),
                     max_wave_sessions=4)
    assert c.graphs is not None
    from verifier_svc.runner import PREFILL_BUCKETS

    c.graphs.prefill_buckets = PREFILL_BUCKETS  # (PDFLASH_PREFILL_GRAPHS=1: every test here prefills from graphs too)
    c.eager = VerifierCore(target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(mode="off"))
    yield c
    del c, target
    torch.cuda.empty_cache()


def real_shape_target(arch: str, directory, num_layers: int):
    """A random bf16 model of `arch`'s real layer shapes (pdflash.tiny.real_shape_config) built on the GPU and wrapped
    with the kernels, which must report it batch-invariant."""
    from transformers import AutoModelForCausalLM

    from pdflash.tiny import real_shape_config
    from verifier_svc.model import wrap_model

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(real_shape_config(arch, num_layers=num_layers), dtype=torch.bfloat16)
    target = wrap_model(model, directory, kernels="on")
    assert target.batch_invariant, target.kernels
    return target


def _prompts(vocab: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


class Session:
    """One request driven round by round, as the drafter's loop does (anchor + drafts -> Verify)."""

    def __init__(self, core, prompt, propose, width: int, adaptive: bool):
        from drafter_svc.width import VerifyWidth
        from pdflash.types import SamplingParams
        from verifier_svc.engine import PrefillInput

        self.core, self.propose, self.prompt = core, propose, list(prompt)
        self.width = VerifyWidth(width) if adaptive else None
        self.fixed = width
        pre = core.prefill(PrefillInput("t", tuple(prompt), SamplingParams(), NEW, ignore_eos=True))
        self.sid, self.out, self.anchor, self.union, self.round = pre.session_id, list(pre.tokens), pre.tokens[-1], pre.routed_union, 0
        self.done = pre.finished is not None

    def step(self) -> None:
        self.take(self.core.verify(self.draft()))

    def draft(self):
        """The next round's DraftResult (what the drafter sends)."""
        from pdflash.types import DraftResult, union_bytes

        self.round += 1
        want = (self.width.drafts() if self.width else self.fixed - 1)
        drafts = self.propose(self.prompt, self.out, max(0, min(want, NEW - len(self.out) - 1)))
        return DraftResult(self.sid, self.round, (self.anchor, *drafts), self.union,
                           union_bytes(self.union, self.core.target.byte_map))

    def take(self, res) -> None:
        """The round's answer."""
        if self.width:
            self.width.observe(res.num_accepted)
        self.out += res.tokens
        self.anchor, self.union = res.tokens[-1], res.routed_union
        self.done = res.finished is not None


def run_in_waves(core, sessions: list[Session]) -> None:
    """Every session to its end, each round one `verify_wave` over the sessions still running."""
    while not all(s.done for s in sessions):
        live = [s for s in sessions if not s.done]
        outs = core.verify_wave([(s.draft(), True) for s in live])
        assert not any(isinstance(o, BaseException) for o in outs), outs
        for s, o in zip(live, outs):
            s.take(o)


def _run(core, prompt, propose, width=1, adaptive=False) -> list[int]:
    s = Session(core, prompt, propose, width, adaptive)
    while not s.done:
        s.step()
    return s.out


def _no_drafts(prompt, out, k):
    return []


def _replay(reference: list[int], error_every: int, vocab: int):
    """Proposes the reference continuation, with a wrong token every `error_every` drafts (acceptance ~ that)."""

    def propose(prompt, out, k):
        n = len(out)
        drafts = list(reference[n : n + k])
        for i in range(len(drafts)):
            if (n + i) % error_every == error_every - 1:
                drafts[i] = (drafts[i] + 1) % vocab
        return drafts

    return propose


def _ngram():
    from benchmarks.inprocess import ngram_propose

    state: dict = {}
    return lambda prompt, out, k: ngram_propose(0, prompt, out, k, state)


def drafts_and_waves_give_block_one(core, dense=None) -> None:
    """Two prompts on a real-shape model's paged core (near ties): n-gram drafts at block 8, drafts replaying the output
    with every 3rd one wrong at block 16 (a rollback most rounds) and the same sessions verified together in waves give
    block 1's tokens; `dense` (a core on transformers' cache), the same tokens for the replayed drafts there."""
    vocab = core.target.vocab_size
    prompts = _prompts(vocab, 2)
    solo = [_run(core, p, _no_drafts) for p in prompts]
    for i, p in enumerate(prompts):
        assert _run(core, p, _ngram(), width=8) == solo[i]
        assert _run(core, p, _replay(solo[i], 3, vocab), width=16) == solo[i]
    sessions = [Session(core, p, _replay(solo[i], 3 + 2 * i, vocab), 16, True) for i, p in enumerate(prompts)]
    run_in_waves(core, sessions)
    assert [s.out for s in sessions] == solo
    if dense is not None:
        assert [_run(dense, p, _replay(solo[i], 3, vocab), width=16) for i, p in enumerate(prompts)] == solo


def test_every_drafter_and_width_equals_block_one(core):
    vocab = core.target.vocab_size
    for prompt in _prompts(vocab, 2):
        ref = _run(core, prompt, _no_drafts)
        assert len(ref) == NEW
        cases = {
            "ngram@16 adaptive": dict(propose=_ngram(), width=16, adaptive=True),
            "replay tau~4 @16 fixed": dict(propose=_replay(ref, 4, vocab), width=16),
            "replay tau~8 @32 adaptive": dict(propose=_replay(ref, 8, vocab), width=32, adaptive=True),
            "replay exact @8": dict(propose=_replay(ref, 10**9, vocab), width=8),
        }
        for name, kw in cases.items():
            got = _run(core, prompt, **kw)
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            assert got == ref, f"{name}: differs from block-1 decoding at token {first}"


def test_graphs_on_the_paged_cache_equal_eager_forwards_on_transformers_cache(core):
    """The graphed paged forward (pre-norm chain, fused attention where its probe passed) against transformers' own
    forward of the modules on its DynamicCache, both on the batch-invariant kernels."""
    assert core.runner.attention.startswith("fused"), core.runner.attention  # (q|k|v merged, pdflash_kernels.qkv.plan)
    prompt = _prompts(core.target.vocab_size, 1)[0]
    assert _run(core, prompt, _no_drafts) == _run(core.eager, prompt, _no_drafts)


def test_interleaved_sessions_equal_their_solo_runs(core):
    vocab = core.target.vocab_size
    prompts = _prompts(vocab, 3)
    solo = [_run(core, p, _no_drafts) for p in prompts]
    sessions = [Session(core, p, _replay(solo[i], 3 + i, vocab), 16, True) for i, p in enumerate(prompts)]
    while not all(s.done for s in sessions):
        for s in sessions:
            if not s.done:
                s.step()
    for i, s in enumerate(sessions):
        assert s.out == solo[i], i


@pytest.mark.parametrize("graphs", [True, False], ids=["wave-graphs", "eager-waves"])
def test_waves_equal_their_solo_runs(core, graphs):
    """Multi-session verify waves (VerifierCore.verify_wave: one ragged forward over every session's block, replayed
    from a wave graph or eager): each session's output is its solo block-1 run's, at real shapes with near ties; the
    sessions' blocks differ in width round by round (adaptive widths, one session without drafts)."""
    vocab = core.target.vocab_size
    prompts = _prompts(vocab, 4)
    solo = [_run(core, p, _no_drafts) for p in prompts]
    props = [_replay(solo[0], 3, vocab), _replay(solo[1], 5, vocab), _no_drafts, _ngram()]
    sessions = [Session(core, p, props[i], 16 if i != 3 else 8, i != 0) for i, p in enumerate(prompts)]
    waves = core.graphs.wave_sessions
    if not graphs:
        core.graphs.wave_sessions = 1  # more sessions than a wave graph holds: the eager ragged forward
    try:
        run_in_waves(core, sessions)
    finally:
        core.graphs.wave_sessions = waves
    for i, s in enumerate(sessions):
        first = next((j for j, (a, b) in enumerate(zip(s.out, solo[i])) if a != b), None)
        assert s.out == solo[i], f"session {i} differs from its solo run at token {first}"
    assert not graphs or any(k[0] == "wave" for k in core.graphs._graphs), "no wave graph was captured"


def test_the_bucket_graphs_share_one_memory_pool(core, monkeypatch):
    """GraphRunner's whole-forward graphs capture into one memory pool (PDFLASH_GRAPH_POOL=shared, the default): the
    buckets' graphs hold less memory together than with a pool each. (That sharing keeps the bits: every other test
    here replays several buckets' and waves' graphs of the core's shared pool against solo and eager runs.)"""
    from verifier_svc.runner import GraphRunner

    def held(mode: str) -> int:
        monkeypatch.setenv("PDFLASH_GRAPH_POOL", mode)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        g = GraphRunner(core.runner, core.graphs.max_pages, buckets=core.graphs.buckets)
        try:
            assert g.capture(feature_layers=(), max_rows=32) == len([b for b in g.buckets if b <= 32])
            torch.cuda.synchronize()
            return torch.cuda.memory_reserved() - before
        finally:
            g.reset()
            core.runner.pool.release([g.scratch_page])
            del g
            torch.cuda.empty_cache()

    own, shared = held("own"), held("shared")
    print(f"graph memory, buckets <= 32: a pool each {own / 2**20:.1f} MiB, one shared pool {shared / 2**20:.1f} MiB")
    assert 0 < shared < own, (own, shared)


def test_a_wave_graph_that_fails_to_capture_leaves_waves_eager_and_exact(core, monkeypatch):
    """Waves are on by default on CUDA: a wave graph whose capture fails (here: made to) is logged once and the waves run
    eagerly from then on, each session still its solo run's."""
    from verifier_svc import runner as runner_mod
    from verifier_svc.engine import PagedKVOptions, VerifierCore

    def refuse(*args, **kwargs):
        raise RuntimeError("capture refused (test)")

    fresh = VerifierCore(core.target, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=1),
                         max_wave_sessions=4)
    monkeypatch.setattr(runner_mod, "_WaveGraph", refuse)
    vocab = core.target.vocab_size
    prompts = _prompts(vocab, 2)
    solo = [_run(core, p, _no_drafts) for p in prompts]
    sessions = [Session(fresh, p, _replay(solo[i], 4, vocab), 8, False) for i, p in enumerate(prompts)]
    run_in_waves(fresh, sessions)
    assert [s.out for s in sessions] == solo
    assert fresh.graphs.wave_graphs is False and not any(k[0] == "wave" for k in fresh.graphs._graphs)
    del fresh, sessions
    torch.cuda.empty_cache()


def test_a_chunked_prefill_decodes_as_the_one_go_prefill(core):
    """--prefill-chunk on CUDA at real shapes: prompts prefilled 16 tokens a forward (the last chunk shorter) decode
    token for token as after a one-go prefill."""
    vocab = core.target.vocab_size
    prompts = _prompts(vocab, 2)
    whole = [_run(core, p, _no_drafts) for p in prompts]
    core.prefill_chunk = 16
    try:
        chunked = [_run(core, p, _replay(whole[i], 4, vocab), width=8) for i, p in enumerate(prompts)]
    finally:
        core.prefill_chunk = 0
    assert chunked == whole


def test_prefill_graphs_give_the_eager_prefills_bits(core):
    """Prefills (whole prompts and --prefill-chunk chunks) replayed from the prefill CUDA graphs (GraphRunner.forward_prefill:
    rows padded to a PREFILL_BUCKETS bucket, the last real row's logits) give the eager prefill's first token,
    log-probabilities, features and routed experts bit for bit, and leave the KV the next verify reads the same."""
    from pdflash.types import DraftResult, SamplingParams
    from verifier_svc.engine import PrefillInput

    vocab = core.target.vocab_size
    layers = (0, core.target.num_layers - 1)
    prompts = _prompts(vocab, 3) + [[5] * 32, list(range(7, 7 + 300))]  # 20-120 tokens, one bucket exactly, past 256

    def prefill(p, chunk: int):
        core.prefill_chunk = chunk
        try:
            o = core.prefill(PrefillInput("pg", tuple(p), SamplingParams(), 16, ignore_eos=True, feature_layer_ids=layers,
                                          logprobs=True, top_logprobs=3))
        finally:
            core.prefill_chunk = 0
        v = core.verify(DraftResult(o.session_id, 1, (o.tokens[-1], 9, 10, 11), {}, 0))
        core.end(o.session_id)
        return (o.tokens, o.logprobs, o.top_logprobs, o.features.tobytes(), o.routed_union, v.tokens, v.logprobs)

    buckets = core.graphs.prefill_buckets
    assert buckets, "prefill graphs are off (PDFLASH_PREFILL_GRAPHS=0?)"
    try:
        core.graphs.prefill_buckets = ()
        eager = [prefill(p, c) for p in prompts for c in (0, 48)]
    finally:
        core.graphs.prefill_buckets = buckets
    graphed = [prefill(p, c) for p in prompts for c in (0, 48)]
    assert any(k[0] == "prefill" for k in core.graphs._graphs), "no prefill graph was captured"
    for i, (a, b) in enumerate(zip(graphed, eager)):
        assert a == b, f"prompt {i // 2} chunk {(0, 48)[i % 2]}"


def _prefill_input(core, prompt):
    from pdflash.types import SamplingParams
    from verifier_svc.engine import PrefillInput

    return PrefillInput("pw", tuple(prompt), SamplingParams(), 16, ignore_eos=True, logprobs=True, top_logprobs=3,
                        feature_layer_ids=(0, core.target.num_layers - 1))


def _prefilled_answer(core, o) -> tuple:
    """A prefill's answer and the next verify's (the KV it left); the session ended."""
    from pdflash.types import DraftResult

    v = core.verify(DraftResult(o.session_id, 1, (o.tokens[-1], 9, 10, 11), {}, 0))
    core.end(o.session_id)
    return (o.tokens, o.logprobs, o.top_logprobs, o.features.tobytes(), o.routed_union, v.tokens, v.logprobs)


def _prefilled_in_waves(core, prompts, chunk: int) -> list:
    """The prompts prefilled together, a `prefill_wave` a chunk, until every one is whole: their answers."""
    core.prefill_chunk = chunk
    try:
        jobs = [core.start_prefill(_prefill_input(core, p)) for p in prompts]
        pending = list(jobs)
        while pending:
            got = core.prefill_wave(pending)
            assert not any(isinstance(g, BaseException) for g in got), got
            pending = [j for j, done in zip(pending, got) if not done]
    finally:
        core.prefill_chunk = 0
    return [j.finish() for j in jobs]


def test_a_prefill_wave_gives_each_prompt_its_own_prefills_bits(core):
    """Prompts prefilled together (VerifierCore.prefill_wave: one ragged forward, whole or a chunk each a wave) at real
    shapes on CUDA: each session's first token, log-probabilities, features and routed experts, and the next verify's
    answer (the KV it left), bit for bit those of its own prefill (graph-replayed where a bucket holds it)."""
    prompts = _prompts(core.target.vocab_size, 3) + [list(range(7, 7 + 300)), [5] * 3]
    alone = [_prefilled_answer(core, core.prefill(_prefill_input(core, p))) for p in prompts]
    served = core.prefill_wave_graphed_rows
    for chunk, graphed_rows in ((0, 0), (64, 0), (0, served)):  # (0: every prompt in the ragged wave; served: the
        core.prefill_wave_graphed_rows = graphed_rows            # graph-replayable ones one after another)
        try:
            outs = _prefilled_in_waves(core, prompts, chunk)
        finally:
            core.prefill_wave_graphed_rows = served
        if graphed_rows == 0:
            assert all(o.wave_sessions == len(prompts) for o in outs)
        for i, o in enumerate(outs):
            assert _prefilled_answer(core, o) == alone[i], f"prompt {i} chunk {chunk} graphed rows {graphed_rows}"


def test_prefill_wave_graphs_give_the_eager_waves_bits(core):
    """Prefill waves replayed from their CUDA graphs (GraphRunner.forward_prefill_wave, PDFLASH_PREFILL_WAVE_GRAPHS=1:
    a `_WaveGraph` with each prompt's last row picked for the LM head) give each prompt what its own prefill gives, bit
    for bit (first token, log-probabilities, features, routed experts, the next verify's answer), whole prompts and
    chunks (the long prompt's last chunks alone: its own prefill graph)."""
    from verifier_svc.runner import PREFILL_WAVE_BUCKETS

    prompts = _prompts(core.target.vocab_size, 3) + [list(range(7, 7 + 300))]
    alone = [_prefilled_answer(core, core.prefill(_prefill_input(core, p))) for p in prompts]
    before = core.graphs.prefill_wave_buckets
    core.graphs.prefill_wave_buckets = PREFILL_WAVE_BUCKETS
    try:
        for chunk in (0, 64):
            outs = _prefilled_in_waves(core, prompts, chunk)
            assert all(o.wave_sessions == len(prompts) for o in outs)
            for i, o in enumerate(outs):
                assert _prefilled_answer(core, o) == alone[i], f"prompt {i} chunk {chunk}"
        assert any(k[0] == "prefill_wave" for k in core.graphs._graphs), "no prefill-wave graph was captured"
    finally:
        core.graphs.prefill_wave_buckets = before


def test_a_dropped_second_core_leaves_the_targets_own_forward_bits(core):
    """A second VerifierCore on the same target (the warm-up test's, a benchmark's), built and dropped, changes nothing
    of the first: the target's own forward gives the same logits bits before and after. Stop 45: the second runner's
    fused attention merged q/k/v again and its merged config left with it, so the projections called one by one split
    K their own way (the sampled tests take their reference from this forward, and failed after the warm-up test)."""
    import gc

    from verifier_svc.engine import PagedKVOptions, VerifierCore

    t = core.target
    ids = torch.tensor([_prompts(t.vocab_size, 1)[0][:24]], device="cuda")
    with torch.no_grad():
        before = t.model(ids).logits.clone()
        other = VerifierCore(t, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=1))
        assert other.runner.attention == core.runner.attention
        del other
        gc.collect()
        torch.cuda.empty_cache()
        after = t.model(ids).logits
    assert torch.equal(before, after)


def test_warmup_leaves_a_clean_verifier_whose_first_request_equals_its_second(core):
    """--warmup (verifier_svc/warmup.py) on CUDA: every bucket's graph with the feature layers is captured, no session is
    left, every KV page is back; the first request after it equals the second and the eager reference. With offloaded
    experts (the device-managed cache) the counters read zero after it and the first request's counters are its own."""
    import functools
    import os

    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.expert_cache import CacheStats
    from verifier_svc.model import load_target
    from verifier_svc.runner import BUCKETS
    from verifier_svc.warmup import block_sizes, prefill_wave_rows, warm, wave_blocks

    t = core.target
    layers = (0, t.num_layers - 1)
    prompt = _prompts(t.vocab_size, 1)[0]
    want = _run(core.eager, prompt, _no_drafts)
    os.environ["PDFLASH_PREFILL_GRAPHS"] = "1"  # (read when the core's GraphRunner is made)
    try:
        fresh = VerifierCore(t, max_block_size=32, max_tokens_limit=1024, paged_kv=PagedKVOptions(kv_cache_gb=2),
                             max_wave_sessions=8)  # (the server's default on CUDA: --max-wave-sessions auto)
    finally:
        del os.environ["PDFLASH_PREFILL_GRAPHS"]
    assert fresh.graphs.prefill_buckets
    free = fresh.pool.free_pages
    report = warm(fresh, layers)
    wave_items = sum(len(blocks) for blocks in wave_blocks(8, 32))
    assert report.verifies == 2 * (len(block_sizes(32)) + wave_items) and fresh.warmup_seconds == report.seconds > 0
    assert len(fresh.sessions) == 0 and fresh.pool.free_pages == free
    assert {(b, layers) for b in BUCKETS} | {(b, ()) for b in BUCKETS} <= set(fresh.graphs._graphs)
    assert {("prefill", b, f) for b in fresh.graphs.prefill_buckets for f in ((), layers)} <= set(fresh.graphs._graphs)
    waves = {("wave", sum(blocks), f) for blocks in wave_blocks(8, 32) for f in ((), layers)}
    assert waves and waves <= set(fresh.graphs._graphs)  # one wave graph a bucket, captured by the warm-up's waves
    pwaves = {("prefill_wave", sum(w), f) for w in prefill_wave_rows(fresh.graphs.prefill_wave_buckets, 8, t.max_context)
              for f in ((), layers)}
    assert pwaves and pwaves <= set(fresh.graphs._graphs)  # and each prefill-wave graph (on by default since stop 50)
    print(f"warm-up: {report.seconds:.1f} s, {report.prefills} prefills, the allocator's reserve grew {report.reserved_mb:.0f} MiB")
    drafts = _replay(want, 4, t.vocab_size)
    assert _run(fresh, prompt, drafts, width=16) == _run(fresh, prompt, drafts, width=16) == want
    assert len(fresh.sessions) == 0 and fresh.pool.free_pages == free
    pool = fresh.pool
    page_bytes = 2 * len(pool.k) * pool.k[0][0].numel() * pool.k[0].element_size()
    del fresh, pool
    torch.cuda.empty_cache()

    # a KV pool of 1536 positions: the 2048-row prefill wave (four prompts of 512) does not fit it; the warm-up logs
    # that bucket and goes on (never a failed start), leaving no session and every page back; the rest is warm
    from pdflash_kernels.attention import PAGE

    tight = VerifierCore(t, max_block_size=32, max_tokens_limit=1024, max_wave_sessions=8,
                         paged_kv=PagedKVOptions(kv_cache_gb=page_bytes * (1536 // PAGE) / 2**30, prefill_graphs=True))
    assert tight.pool.num_pages * PAGE == 1536  # (less the graphs' scratch page: 1472 positions for sessions)
    rows = {sum(w) for w in prefill_wave_rows(tight.graphs.prefill_wave_buckets, 8, t.max_context)}
    assert 2048 in rows and 1024 in rows
    free = tight.pool.free_pages
    warm(tight, ())  # (the 2048-row wave: two prompts get pages, the third is refused; the warm-up logs the bucket)
    assert len(tight.sessions) == 0 and tight.pool.free_pages == free
    got = {k[1] for k in tight.graphs._graphs if k[0] == "prefill_wave"}
    assert 1024 in got and 2048 not in got, sorted(got)
    assert _run(tight, prompt, drafts, width=16) == want
    del tight
    torch.cuda.empty_cache()

    def offloaded(gb: float):
        return load_target(t.directory, "cuda", "bfloat16", kernels="on", experts="mxfp4", expert_cache_gb=gb)

    probe = offloaded(100.0)
    store = probe.expert_cache.store
    per_layer = max(store.num_experts.values())
    del probe
    torch.cuda.empty_cache()
    # the overflow range (one layer's experts) + partitions of about half a layer each: every forward evicts
    off = VerifierCore(offloaded((2 * per_layer + 3) * store.slice_bytes / 2**30), max_block_size=32, max_tokens_limit=1024,
                       paged_kv=PagedKVOptions(kv_cache_gb=2))
    cache = off.target.expert_cache
    assert getattr(cache, "device_managed", False) and off.graphs is not None
    free = off.pool.free_pages
    report = warm(off, layers)
    assert report.expert_cache.lookups > 0 and report.expert_cache.bytes_moved > 0
    assert cache.stats == CacheStats() and int(cache.unused.sum()) == 0 and int(cache.codes.abs().sum()) == 0
    assert len(off.sessions) == 0 and off.pool.free_pages == free
    calls = []
    for name in ("prefill", "verify"):
        step = getattr(off, name)
        setattr(off, name, lambda *a, _step=step, **k: calls.append(_step(*a, **k)) or calls[-1])
    first = _run(off, prompt, _no_drafts)
    assert cache.stats == functools.reduce(CacheStats.plus, [c.expert_cache for c in calls])
    assert _run(off, prompt, _no_drafts) == first
    assert len(off.sessions) == 0 and off.pool.free_pages == free
    del off, cache
    torch.cuda.empty_cache()


def _pair_probs(core, prompt: list[int], sp: dict):
    """The target's sampler probabilities (same GPU, same dtype) after the prompt, and after the prompt and each token
    it can sample: p1 and {a: p2}."""
    from pdflash.sampler import target_probs
    from pdflash.types import SamplingParams

    t = core.target
    with torch.no_grad():
        def probs(ids):
            return target_probs(t.model(torch.tensor([ids], device="cuda")).logits[0, -1:].float(), SamplingParams(**sp))[0]

        p1 = probs(prompt)
        return p1, {a: probs(prompt + [a]) for a in torch.nonzero(p1).flatten().tolist()}


def _check_pairs(pairs: list, table: dict) -> None:
    """Sampled (first, second) pairs against their probabilities: none outside, chi-square p > 1e-3."""
    from scipy.stats import chisquare

    outside = sorted({p for p in pairs if p not in table})
    assert not outside, (f"sampled pairs the target gives zero probability: {outside} ({sum(p in outside for p in pairs)} "
                         f"of {len(pairs)}); the target's pairs: {sorted(table)}")
    keys = sorted(table)
    observed = [sum(1 for p in pairs if p == k) for k in keys]
    expected = [table[k] * len(pairs) / sum(table.values()) for k in keys]
    test = chisquare(observed, expected)
    assert test.pvalue > 1e-3, ("pairs off the target's distribution: p = %.2e; (pair, observed, expected): %s"
                                % (test.pvalue, [(k, o, round(e, 1)) for k, o, e in zip(keys, observed, expected)]))


def test_sampled_verify_on_cuda_follows_the_target_distribution(core):
    """Sampled verification on CUDA (the session's generator on the GPU): with a drafted block after each sampled
    first token, the (first, second) token pairs follow the target's own probabilities (bf16, the same kernels),
    chi-square over the pairs; a seed reproduces. The reference probabilities come from the target's forward on the
    same GPU in the same dtype."""
    from pdflash.types import DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PrefillInput

    t = core.target
    prompt = _prompts(t.vocab_size, 1)[0][:24]
    sp = dict(temperature=1.0, top_k=3)
    p1, p2s = _pair_probs(core, prompt, sp)
    draft_after = {a: int(p2.argmax()) for a, p2 in p2s.items()}  # the drafted token: accepted with probability p2(draft)
    table = {(a, b): float(p1[a] * p2[b]) for a, p2 in p2s.items() for b in torch.nonzero(p2).flatten().tolist()}

    def sample(seed: int) -> tuple[int, ...]:
        pre = core.prefill(PrefillInput("s", tuple(prompt), SamplingParams(seed=seed, **sp), 2, ignore_eos=True))
        a = pre.tokens[-1]
        res = core.verify(DraftResult(pre.session_id, 1, (a, draft_after.get(a, 0), 0), pre.routed_union,
                                      union_bytes(pre.routed_union, t.byte_map)))
        assert res.finished is not None and len(core.sessions) == 0
        return (a, res.tokens[0])

    first, again = sample(7), sample(7)
    assert first == again, f"seed 7 gave {first}, then {again}"
    _check_pairs([sample(1000 + i) for i in range(300)], table)


def test_sampled_drafts_with_their_distributions_on_cuda_follow_the_target(core):
    """Drafts drawn from a q and sent with it (DraftResult.draft_dists: the verifier's min(1, p/q) rule and its
    residual max(0, p - q) on the GPU, float64 rows on the device): the (first, second) token pairs follow the target's
    probabilities, chi-square over the pairs. q: uniform over the target's top 3 and one token it gives no mass."""
    import numpy as np

    from pdflash.types import DraftDistribution, DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PrefillInput

    t = core.target
    prompt = _prompts(t.vocab_size, 1)[0][:24]
    sp = dict(temperature=1.0, top_k=3)
    p1, p2s = _pair_probs(core, prompt, sp)
    table, q_after = {}, {}
    for a, p2 in p2s.items():
        support = torch.nonzero(p2).flatten().tolist()
        outside = next(i for i in range(t.vocab_size) if i not in support)
        q_after[a] = DraftDistribution(tuple(support + [outside]), (1.0,) * (len(support) + 1))
        table.update({(a, b): float(p1[a] * p2[b]) for b in support})
    rng = np.random.default_rng(5)
    pairs = []
    for i in range(300):
        pre = core.prefill(PrefillInput("s", tuple(prompt), SamplingParams(seed=3000 + i, **sp), 2, ignore_eos=True))
        a = pre.tokens[-1]
        q = q_after[a]
        d = int(rng.choice(q.ids))
        res = core.verify(DraftResult(pre.session_id, 1, (a, d), pre.routed_union, union_bytes(pre.routed_union, t.byte_map), (q,)))
        assert res.finished is not None and len(core.sessions) == 0
        pairs.append((a, res.tokens[0]))
    _check_pairs(pairs, table)


def _logprob_run(core, prompt, propose, width: int, n: int = 64):
    """(tokens, logprobs, top-3) of a greedy session asking for logprobs, `width`-wide blocks of `propose`'s drafts."""
    from pdflash.types import DraftResult, SamplingParams
    from verifier_svc.engine import PrefillInput

    o = core.prefill(PrefillInput("t", tuple(prompt), SamplingParams(), n, ignore_eos=True, logprobs=True, top_logprobs=3))
    toks, lps, tops, rnd = list(o.tokens), list(o.logprobs), list(o.top_logprobs), 0
    while o.finished is None:
        rnd += 1
        drafts = propose(prompt, toks, max(0, min(width - 1, n - len(toks) - 1)))
        o = core.verify(DraftResult(o.session_id, rnd, (toks[-1], *drafts), {}, 0))
        toks += o.tokens
        lps += o.logprobs
        tops += o.top_logprobs
    return toks, lps, tops


def test_logprobs_are_block_ones_bit_for_bit(core):
    """A position's logprobs (and its top alternatives) do not depend on the block it was verified in: the batch-
    invariant log-softmax over the batch-invariant forward's logits, in bf16 at real layer shapes."""
    prompt = _prompts(core.target.vocab_size, 1)[0]
    ref = _logprob_run(core, prompt, _no_drafts, 1)
    for width, every in ((16, 4), (32, 10**9)):
        got = _logprob_run(core, prompt, _replay(ref[0], every, core.target.vocab_size), width)
        assert got[0] == ref[0] and got[1] == ref[1] and got[2] == ref[2], width
    for tok, lp, (ids, vals) in zip(*ref):
        assert vals[0] == lp and (ids[0] == tok or vals[1] == lp)  # greedy: the likeliest (bf16 logits tie at times)


def test_penalized_greedy_output_is_block_ones(core):
    """Repetition and frequency penalties on each verify row (the drafts before it counted): the output of every block
    width is block-1 decoding's with the same penalties, in bf16 at real layer shapes."""
    from pdflash.types import DraftResult, SamplingParams
    from verifier_svc.engine import PrefillInput

    sampling = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)

    def run(propose, width: int, n: int = 96) -> list[int]:
        o = core.prefill(PrefillInput("t", tuple(prompt), sampling, n, ignore_eos=True))
        toks, rnd = list(o.tokens), 0
        while o.finished is None:
            rnd += 1
            drafts = propose(prompt, toks, max(0, min(width - 1, n - len(toks) - 1)))
            o = core.verify(DraftResult(o.session_id, rnd, (toks[-1], *drafts), {}, 0))
            toks += o.tokens
        return toks

    prompt = _prompts(core.target.vocab_size, 1)[0]
    ref = run(_no_drafts, 1)
    for width, every in ((16, 4), (32, 10**9)):
        assert run(_replay(ref, every, core.target.vocab_size), width) == ref, width
