"""Multi-session verify waves: several sessions' verify blocks in one forward (`VerifierCore.verify_wave`,
`verifier_svc.runner.ForwardRunner.forward_wave`, the ragged attention) must answer each session exactly as a verify
of its own would: the same tokens, log-probabilities (the logits' bits), features and routed experts.

On the CPU the paged forward runs the batch-invariant kernels under Triton's interpreter (a tiny model, few tokens);
tests/test_gpu_verifier.py runs the same comparison on CUDA at real layer shapes, eager and graph-replayed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.errors import FailedPrecondition, InvalidArgument, NotFound
from pdflash.types import DraftResult, SamplingParams
from tests.conftest import needs_triton as needs_interpreter  # (Triton's interpreter: CPU hosts with triton)

# (prompt, sampling, feature layers): one prompt crosses a KV page, one session samples, the feature layers differ
SESSIONS = [
    (list(range(5, 15)), SamplingParams(), (0, 1)),
    (list(range(20, 90)), SamplingParams(temperature=0.9, seed=7), (1,)),
    ([3, 4, 5], SamplingParams(), ()),
]
# each round's drafts per session (after its anchor): drafts of different lengths, one session with none
ROUNDS = [[[7, 8, 9], [11, 12], []], [[30, 31, 32, 33, 34], [], [40, 41]]]


@pytest.fixture(scope="module")
def paged_core(tiny):
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(tiny.target("qwen3_moe"), "cpu", "bfloat16", kernels="on")
    return VerifierCore(target, max_block_size=32, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01),
                        max_wave_sessions=4)


def _prefill(core, tag: str, sessions=SESSIONS):
    from verifier_svc.engine import PrefillInput

    outs = [core.prefill(PrefillInput(f"{tag}{i}", tuple(p), sp, 40, feature_layer_ids=fl, logprobs=True, top_logprobs=3))
            for i, (p, sp, fl) in enumerate(sessions)]
    return [o.session_id for o in outs], [o.tokens[-1] for o in outs]


def _answer(o) -> tuple:
    feats = None if o.features is None else o.features.tobytes()
    return (o.tokens, o.num_accepted, o.committed, o.finished, o.logprobs, o.top_logprobs, feats,
            {l: sorted(ids) for l, ids in o.routed_union.items()}, o.routed_bytes)


def _rounds(core, sids, anchors, wave: bool) -> list[list[tuple]]:
    got = []
    for r, drafts in enumerate(ROUNDS, start=1):
        reqs = [DraftResult(sid, r, (a, *d), {}, 0) for sid, a, d in zip(sids, anchors, drafts)]
        outs = core.verify_wave([(d, True) for d in reqs]) if wave else [core.verify(d) for d in reqs]
        assert not any(isinstance(o, BaseException) for o in outs), outs
        got.append([_answer(o) for o in outs])
        anchors = [o.tokens[-1] for o in outs]
    return got


@needs_interpreter
@pytest.mark.timeout(900)
def test_a_wave_answers_each_session_as_its_own_verify_would(paged_core):
    core = paged_core  # (sinks and sliding windows: the ragged attention's own test; every architecture on CUDA)
    assert core.wave_forward
    assert core.forward_info["verify_waves"] == "up to 4 sessions' blocks in one ragged forward"  # (model info's kernels JSON)
    free = core.pool.free_pages
    alone = _rounds(core, *_prefill(core, "alone"), wave=False)
    together = _rounds(core, *_prefill(core, "wave"), wave=True)
    assert together == alone
    for sid in list(core.sessions._sessions):
        core.end(sid)
    assert core.pool.free_pages == free


@needs_interpreter
@pytest.mark.timeout(600)
def test_a_wave_refuses_an_item_alone_and_runs_the_others(paged_core):
    core = paged_core
    sids, anchors = _prefill(core, "r", [([5, 6], SamplingParams(), ())] * 3)
    ok = DraftResult(sids[0], 1, (anchors[0], 7), {}, 0)
    wrong_round = DraftResult(sids[1], 2, (anchors[1],), {}, 0)
    again = DraftResult(sids[0], 1, (anchors[0], 8), {}, 0)  # a second verify of the first session in the same wave
    unknown = DraftResult("no-such-session", 1, (1,), {}, 0)
    good = DraftResult(sids[2], 1, (anchors[2], 40, 41), {}, 0)
    outs = core.verify_wave([(ok, True), (wrong_round, True), (again, True), (unknown, True), (good, False)])
    assert isinstance(outs[1], InvalidArgument) and "expected round 1" in str(outs[1].violations)
    assert isinstance(outs[2], FailedPrecondition) and "another verify in this wave" in str(outs[2])
    assert isinstance(outs[3], NotFound)
    assert outs[0].round == 1 and outs[4].round == 1 and outs[4].features is None
    assert outs[0].forward_ms == outs[4].forward_ms and outs[0].wave_sessions == outs[4].wave_sessions == 2  # one forward
    assert core.verify(DraftResult(sids[0], 2, (outs[0].tokens[-1],), {}, 0)).wave_sessions == 1
    # the refused session is untouched: its round 1 still verifies, alone
    assert core.verify(DraftResult(sids[1], 1, (anchors[1],), {}, 0)).round == 1
    # a full KV pool refuses an item before its round is used: the same round passes once pages are free again
    from pdflash.errors import ResourceExhausted

    (long,), (anchor,) = _prefill(core, "long", [(list(range(3, 63)), SamplingParams(), ())])  # 60 tokens: page 0
    need = DraftResult(long, 1, (anchor, *range(50, 57)), {}, 0)  # positions 60..67: a second page
    taken = core.pool.alloc(core.pool.free_pages)
    try:
        got = core.verify_wave([(need, False), (DraftResult(sids[2], 2, (outs[4].tokens[-1],), {}, 0), False)])
        assert isinstance(got[0], ResourceExhausted) and core.sessions.get(long).round == 0
        assert got[1].round == 2  # the other item ran
    finally:
        core.pool.release(taken)
    assert core.verify_wave([(need, False)])[0].round == 1
    sids.append(long)
    for sid in sids:
        core.end(sid)


def test_a_wave_on_transformers_cache_runs_its_verifies_one_after_another(tiny):
    """Without the paged KV (the CPU default) a wave is each verify in turn: the same answers as verifies."""
    from verifier_svc.engine import PrefillInput, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(tiny.target("qwen3_moe"), "cpu", "float32")
    core = VerifierCore(target, max_wave_sessions=4)
    assert not core.wave_forward

    def start(tag):
        outs = [core.prefill(PrefillInput(f"{tag}{i}", tuple(p), sp, 40, feature_layer_ids=fl, logprobs=True))
                for i, (p, sp, fl) in enumerate(SESSIONS)]
        return [o.session_id for o in outs], [o.tokens[-1] for o in outs]

    assert _rounds(core, *start("w"), wave=True) == _rounds(core, *start("a"), wave=False)


def test_route_unions_of_a_wave_split_by_rows():
    import torch

    from verifier_svc.experts import RouteRecorder

    rec = RouteRecorder()
    rec.add(0, torch.tensor([[1, 2], [3, 4], [5, 9], [0, 1]]))
    rec.add(2, torch.tensor([[7, 0], [1, 1], [2, 2], [3, 3]]))
    n = {0: 8, 2: 8}
    got = rec.unions(n, [0, 1, 3, 3])
    assert got == [{0: frozenset({1, 2}), 2: frozenset({7, 0})}, {0: frozenset({3, 4, 5}), 2: frozenset({1, 2})},
                   {0: frozenset(), 2: frozenset()}]
    assert got[1] == rec.union(n, rows=3, start=1)  # (9 is a padding sentinel: dropped)
    assert RouteRecorder().unions(n, [0, 2, 5]) == [{}, {}]


# ---- which waiting calls form a wave (verifier_svc.waves, pure) ---------------------------------------------------

def test_take_wave_keeps_sessions_in_order_and_never_starves_the_oldest():
    from verifier_svc.waves import take_wave

    calls = [("a", 4), ("b", 30), ("a", 2), ("c", 8), ("d", 1), ("e", 1)]
    take = lambda n, rows: take_wave(calls, lambda c: c[0], lambda c: c[1], n, rows)  # noqa: E731
    assert take(8, 64) == [0, 1, 3, 4, 5]  # a's second round waits for the next wave
    assert take(2, 64) == [0, 1]
    assert take(8, 16) == [0, 3, 4, 5]  # b's 30 rows do not fit beside a's 4 now; smaller calls behind it still go
    assert take_wave([("big", 40)], lambda c: c[0], lambda c: c[1], 4, 16) == [0]  # the oldest goes whatever its rows
    assert take(1, 64) == [0]
    assert take_wave([], lambda c: c[0], lambda c: c[1], 4, 16) == []


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 32)), max_size=20),
       st.integers(1, 8), st.integers(1, 128))
def test_take_wave_properties(calls, max_sessions, max_rows):
    from verifier_svc.waves import take_wave

    got = take_wave(calls, lambda c: c[0], lambda c: c[1], max_sessions, max_rows)
    assert got == sorted(got) and len(got) <= max_sessions
    assert len({calls[i][0] for i in got}) == len(got)  # one call per session
    if calls:
        assert got[0] == 0  # the oldest always goes
        assert len(got) == 1 or sum(calls[i][1] for i in got) <= max_rows
    for i, (sid, rows) in enumerate(calls):  # a call left out had a reason: its session was in, or it did not fit
        if i not in got and len(got) < max_sessions and all(calls[j][0] != sid for j in got if j < i):
            assert sum(calls[j][1] for j in got if j < i) + rows > max_rows


# ---- the servicer gathers the calls waiting for the device into one wave ------------------------------------------

@pytest.fixture(scope="module")
def waves_served(tiny):
    from tests.test_prefetch import Served

    v = Served(model=str(tiny.target("qwen3_moe")), max_wave_sessions=4)
    yield v
    v.stop()


def _verify_req(sid, r, tokens):
    from pdflash.v1 import common_pb2, verifier_pb2

    return verifier_pb2.VerifyRequest(request_id=f"{sid}-{r}", draft=common_pb2.DraftResult(
        session_id=sid, round=r, tokens=tokens), return_features=False)


def _verifies_behind_the_device(v, pre) -> list:
    """Take the served verifier's device lock, send one round-1 Verify per prefilled session, and wait until they all
    wait in the wave queue; the caller releases the lock (`v.loop.call_soon_threadsafe(servicer._device.release)`)."""
    import asyncio
    import time

    servicer = v.running.servicer
    asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop).result(timeout=10)
    calls = [v.stub.Verify.future(_verify_req(p.session_id, 1, [p.first_token]), timeout=30) for p in pre]
    deadline = time.time() + 10
    while len(servicer._waiting) < len(pre) and time.time() < deadline:
        time.sleep(0.01)
    return calls


@pytest.mark.slow
def test_the_servicer_gathers_waiting_verifies_into_one_wave(waves_served):
    import asyncio
    import time

    import grpc

    from pdflash.v1 import verifier_pb2

    v = waves_served
    servicer, metrics = v.running.servicer, v.running.metrics
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    def prefill():
        outs = [v.stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=p, max_tokens=32, ignore_eos=True), timeout=30)
                for p in prompts]
        return [o.session_id for o in outs], [o.first_token for o in outs]

    def waves():
        return (metrics.registry.get_sample_value("pdflash_verify_wave_sessions_count") or 0,
                metrics.registry.get_sample_value("pdflash_verify_wave_sessions_sum") or 0)

    # one at a time: each call is a wave of one
    sids, firsts = prefill()
    before = waves()
    alone = [v.stub.Verify(_verify_req(s, 1, [f, 7, 8]), timeout=30) for s, f in zip(sids, firsts)]
    assert waves() == (before[0] + 3, before[1] + 3)

    # the device held (as by a running forward) while three calls and a fourth session's call arrive
    sids, firsts = prefill()
    lock = asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop)
    lock.result(timeout=10)
    try:
        calls = [v.stub.Verify.future(_verify_req(s, 1, [f, 7, 8]), timeout=30) for s, f in zip(sids, firsts)]
        left = v.stub.Verify.future(_verify_req("gone", 1, [1]), timeout=0.5)  # its caller gives up while it waits
        deadline = time.time() + 10
        while len(servicer._waiting) < 4 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            left.result()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.time() + 10  # (the server learns of the deadline on its own clock, a moment after the client)
        while len(servicer._waiting) > 3 and time.time() < deadline:
            time.sleep(0.01)
        assert len(servicer._waiting) == 3  # the call that left is out of the queue
        before = waves()
    finally:
        v.loop.call_soon_threadsafe(servicer._device.release)
    together = [c.result() for c in calls]
    assert waves() == (before[0] + 1, before[1] + 3)  # one wave of three sessions
    strip = lambda r: (r.accepted_tokens, r.num_accepted_drafts, r.committed_tokens, r.routed_union)  # noqa: E731
    assert [strip(r) for r in together] == [strip(r) for r in alone]
    assert all(r.timings.queue_ms > 0 for r in together)
    assert all(r.wave_sessions == 1 for r in together)  # (transformers' cache: each verify its own forward, in one turn)

    # a wave's item that fails is refused alone: a wrong round beside a good call
    bad = v.stub.Verify.future(_verify_req(sids[0], 5, [together[0].accepted_tokens[-1]]), timeout=30)
    good = v.stub.Verify.future(_verify_req(sids[1], 2, [together[1].accepted_tokens[-1]]), timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        bad.result()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected round 2" in e.value.details() + str(
        e.value.trailing_metadata())
    assert good.result().round == 2


def test_the_waves_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/waves.py's smoke run: the demo pair, two sessions, every output its block-1 reference."""
    import json

    from benchmarks import waves

    assert waves.main(["--device", "cpu", "--targets", "demo", "--sessions", "1", "2", "--new-tokens", "6",
                       "--prompt-tokens", "16", "--prefill-tokens", "40", "--chunks", "16", "--prefill-waves", "2",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "waves_cpu.json").read_text())
    rows = result["rows"]
    assert [(r["chunk"], r["forwards"], r["same_first_token"]) for r in result["prefill"]] == [(0, 1, True), (16, 1, True)]
    assert [(r["sessions"], r["mode"]) for r in rows] == [(1, "one after another"), (2, "one after another"), (2, "waves")]
    assert all(r["identical"] and r["tokens"] == 5 * r["sessions"] for r in rows)  # (the first token is the prefill's)
    assert rows[2]["speedup"] > 0 and not rows[2]["wave_forward"]
    # the routed experts a round: one session's union is its own set; two sessions' union is at most their sum
    assert rows[0]["experts_union"] == rows[0]["experts_summed"] > 0
    assert 0 < rows[2]["experts_union"] <= rows[2]["experts_summed"]
    (pw,) = result["prefill_waves"]  # (transformers' cache: a prefill wave is its prompts in turn)
    assert pw["prompts"] == 2 and pw["same"] and pw["wave_ms"] > 0


def test_the_waves_benchmark_runs_one_session_alone(tmp_path):
    """`gpu.sh prefillbench`'s form, one session and no prefill waves (its max() over the session counts took a bare
    int there and stopped at once: stop 57)."""
    from benchmarks import waves

    assert waves.main(["--device", "cpu", "--targets", "demo", "--sessions", "1", "--new-tokens", "3",
                       "--prompt-tokens", "16", "--prefill-tokens", "24", "--chunks", "16", "--out", str(tmp_path)]) == 0


def test_the_prefill_profile_runs_on_the_cpu(tmp_path):
    """benchmarks/prefill_profile.py's smoke run: the demo target (transformers' cache on the CPU: a prompt is one
    forward whatever the chunk), its forwards' ops by CPU time."""
    import json

    from benchmarks import prefill_profile

    assert prefill_profile.main(["--device", "cpu", "--targets", "demo", "--tokens", "24", "--chunk", "8", "--host-profile",
                                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "prefill_profile_cpu.json").read_text())
    assert [(r["form"], r["rows"], r["start"]) for r in result["rows"]] == [("whole", 24, 0), ("chunk 1 of 1", 24, 0)]
    assert all(r["wall_ms"] > 0 and r["families"] for r in result["rows"]) and not result["meta"]["prefill_graphs"]
    (host,) = result["host"]
    assert host["rows"] == 24 and host["wall_ms"] > 0 and len(host["functions"]) == 30
    assert all(f["self_ms"] >= 0 and f["calls"] >= 1 for f in host["functions"])
    md = (tmp_path / "prefill_profile_cpu.md").read_text()
    assert "Prefill forwards by kernel family" in md and "host time of one prefill step" in md


def test_the_graph_pool_switch_is_checked(monkeypatch):
    from verifier_svc.runner import GraphRunner

    monkeypatch.setenv("PDFLASH_GRAPH_POOL", "own")
    assert GraphRunner._new_mempool() is None  # (a pool per graph: no shared handle)
    monkeypatch.setenv("PDFLASH_GRAPH_POOL", "one")
    with pytest.raises(ValueError, match="PDFLASH_GRAPH_POOL must be shared or own, got 'one'"):
        GraphRunner._new_mempool()


@pytest.mark.parametrize("name, default, error", [
    ("PDFLASH_PREFILL_GRAPHS", True, "PDFLASH_PREFILL_GRAPHS: 0 or 1"),  # prefill graphs: on since stop 48
    ("PDFLASH_PREFILL_WAVE_GRAPHS", True, "PDFLASH_PREFILL_WAVE_GRAPHS must be 0 or 1"),  # on since stop 50 (timed on an H200)
])
def test_the_prefill_graph_switches_default_and_are_checked(name, default, error, monkeypatch):
    from verifier_svc import runner

    enabled = {"PDFLASH_PREFILL_GRAPHS": runner.prefill_graphs_enabled,
               "PDFLASH_PREFILL_WAVE_GRAPHS": runner.prefill_wave_graphs_enabled}[name]
    monkeypatch.delenv(name, raising=False)
    assert enabled() is default
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert enabled() is on
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=error):
        enabled()
    import pathlib

    import yaml

    compose = pathlib.Path(__file__).parents[1] / "compose.gpu.yaml"
    env = yaml.safe_load(compose.read_text())["services"]["verifier"]["environment"]
    assert env[name] == "${%s:-%d}" % (name, int(default))  # the GPU compose file passes it with the same default


def test_up_passes_prefill_graphs_to_the_verifier_and_its_config_reads_them(monkeypatch):
    import argparse

    from pdflash.cli import _spec, build_parser
    from pdflash.config import add_arguments, from_sources
    from verifier_svc.config import VerifierConfig

    def parse(argv, env):
        p = argparse.ArgumentParser()
        add_arguments(p, VerifierConfig)
        return from_sources(VerifierConfig, p.parse_args(argv), env=env)

    assert "--no-prefill-graphs" not in _spec(build_parser().parse_args(["up"])).verifier_args  # the default: on
    args = _spec(build_parser().parse_args(["up", "--no-prefill-graphs"])).verifier_args
    assert args[-1] == "--no-prefill-graphs"
    assert VerifierConfig().prefill_graphs is True
    assert parse(args[-1:], {}).prefill_graphs is False  # what the stack passes, the verifier reads
    assert parse([], {}).prefill_graphs is True
    assert parse([], {"PDFLASH_PREFILL_GRAPHS": "1"}).prefill_graphs is True
    assert parse([], {"PDFLASH_PREFILL_GRAPHS": "0"}).prefill_graphs is False


# ---- the option, as a user sets it -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-2", "1.5", "many", "2000"])
def test_up_refuses_a_wave_size_that_is_not_a_session_count(value, capsys):
    from pdflash import cli

    assert cli.main(["up", "--max-wave-sessions", value]) == 2
    assert "--max-wave-sessions" in capsys.readouterr().err


def test_up_passes_the_wave_size_to_the_verifier_and_the_verifier_checks_it():
    from pdflash.cli import _spec, build_parser
    from pdflash.config import ConfigError
    from verifier_svc.config import VerifierConfig

    assert "--max-wave-sessions" not in _spec(build_parser().parse_args(["up"])).verifier_args  # the default, 0: auto
    for n in ("8", "1"):
        spec = _spec(build_parser().parse_args(["up", "--max-wave-sessions", n]))
        assert spec.verifier_args[-2:] == ["--max-wave-sessions", n]
    cfg = VerifierConfig()
    assert cfg.max_wave_sessions == 0 and cfg.wave_sessions("cuda") == 8 and cfg.wave_sessions("cpu") == 1
    assert cfg.wave_sessions("cuda", wave_forward=False) == 1  # (transformers' cache, a rescaling RoPE: no ragged forward)
    assert VerifierConfig(max_wave_sessions=4).wave_sessions("cuda", wave_forward=False) == 4  # (asked for: kept)
    assert VerifierConfig(max_wave_sessions=3).wave_sessions("cuda") == VerifierConfig(max_wave_sessions=3).wave_sessions("cpu") == 3
    VerifierConfig(max_wave_sessions=0).validate()
    for bad in (-1, 1025):
        with pytest.raises(ConfigError, match="--max-wave-sessions .*a session count 1..1024, or 0 = auto"):
            VerifierConfig(max_wave_sessions=bad).validate()
    spec = _spec(build_parser().parse_args(["up", "--prefill-chunk", "256"]))
    assert spec.verifier_args[-2:] == ["--prefill-chunk", "256"] and VerifierConfig().prefill_chunk == 0
    with pytest.raises(ConfigError, match="--prefill-chunk -1: must be >= 0"):
        VerifierConfig(prefill_chunk=-1).validate()


def test_up_refuses_a_prefill_chunk_that_is_not_a_count(capsys):
    from pdflash import cli

    assert cli.main(["up", "--prefill-chunk", "-5"]) == 2
    assert "--prefill-chunk" in capsys.readouterr().err


def test_the_warm_up_runs_one_wave_per_wave_graph_bucket():
    from verifier_svc.runner import WAVE_BUCKETS
    from verifier_svc.warmup import wave_blocks

    got = wave_blocks(4, 32)
    assert [sum(b) for b in got] == list(WAVE_BUCKETS)  # every bucket: 2 .. 128 rows
    assert all(2 <= len(b) <= 4 and max(b) <= 32 for b in got)
    assert [sum(b) for b in wave_blocks(2, 16)] == [2, 4, 8, 16, 32]  # 64 rows need 4 blocks of 16: more than 2 sessions
    assert wave_blocks(1, 32) == []


def test_the_warm_up_runs_one_prefill_wave_per_prefill_wave_graph_bucket():
    from verifier_svc.runner import PREFILL_BUCKETS, PREFILL_WAVE_BUCKETS
    from verifier_svc.warmup import prefill_wave_rows

    got = prefill_wave_rows(PREFILL_WAVE_BUCKETS, 8, 4096)
    assert [sum(w) for w in got] == list(PREFILL_WAVE_BUCKETS)  # every bucket: 256 .. 2048 rows, filled exactly
    assert all(2 <= len(w) <= 8 and max(w) <= PREFILL_BUCKETS[-1] for w in got)
    assert [sum(w) for w in prefill_wave_rows(PREFILL_WAVE_BUCKETS, 2, 4096)] == [256, 512, 1024]  # 2048: 4 prompts
    assert [sum(w) for w in prefill_wave_rows(PREFILL_WAVE_BUCKETS, 8, 1024)] == [256, 512, 1024, 2048]
    assert [sum(w) for w in prefill_wave_rows(PREFILL_WAVE_BUCKETS, 8, 600)] == [256, 512]  # a prompt at most half the context
    assert prefill_wave_rows(PREFILL_WAVE_BUCKETS, 1, 4096) == []


@pytest.mark.slow
def test_inline_waves_let_the_answered_callers_go_before_the_next_wave(waves_served, monkeypatch):
    """With verify forwards on the event loop (inline verify), the wave task gives the loop to the callers it answered
    before it runs the next wave: they are no longer pending when it starts."""

    from pdflash.v1 import verifier_pb2

    v = waves_served
    servicer, core = v.running.servicer, v.running.core
    pre = [v.stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7 + i], max_tokens=8, ignore_eos=True),
                          timeout=30) for i in range(5)]
    pending_at_wave = []
    wave = core.verify_wave
    monkeypatch.setattr(core, "verify_wave", lambda items: pending_at_wave.append(servicer._pending) or wave(items))
    monkeypatch.setattr(servicer, "inline_verify", True)
    try:
        calls = _verifies_behind_the_device(v, pre)
    finally:
        v.loop.call_soon_threadsafe(servicer._device.release)
    assert [c.result().round for c in calls] == [1] * 5
    assert pending_at_wave == [5, 1]  # four sessions a wave; the first wave's callers gone before the second


@pytest.mark.slow
def test_calls_waiting_for_a_wave_are_answered_when_the_wave_task_ends(waves_served):
    """However the task that runs waves ends (here: cancelled, as at shutdown), no call it left waiting hangs: each
    gets UNAVAILABLE, and the next call starts a new task."""

    import grpc

    from pdflash.v1 import verifier_pb2

    v = waves_served
    servicer = v.running.servicer
    pre = [v.stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7], max_tokens=8, ignore_eos=True), timeout=30)
           for _ in range(2)]
    try:
        calls = _verifies_behind_the_device(v, pre)
        v.loop.call_soon_threadsafe(servicer._waves.cancel)
        for c in calls:
            with pytest.raises(grpc.RpcError) as e:
                c.result()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in e.value.details()
        assert servicer._waiting == [] and servicer._pending == 0
    finally:
        v.loop.call_soon_threadsafe(servicer._device.release)
    again = v.stub.Verify(_verify_req(pre[0].session_id, 1, [pre[0].first_token]), timeout=30)
    assert again.round == 1


# ---- chunked prefill: a long prompt gives the device to waiting verifies between its chunks ----------------------

@needs_interpreter
@pytest.mark.timeout(600)
def test_a_padded_prefill_forward_gives_the_unpadded_ones_bits(paged_core):
    """What a prefill CUDA graph runs (verifier_svc.runner.GraphRunner.forward_prefill: the rows padded to the bucket,
    `valid_rows` the real count, the last real row's logits picked on the device), eagerly under the interpreter: the
    unpadded forward's logits bits, features, routed experts and keys/values of the real rows."""
    import torch

    from verifier_svc.kv import SequenceKV

    core, runner = paged_core, paged_core.runner
    toks, b, layers = list(range(5, 15)), 16, (0, 1)
    n = len(toks)
    plain, padded = SequenceKV(core.pool, core.target.max_context), SequenceKV(core.pool, core.target.max_context)
    try:
        want = runner.forward(toks, 0, plain, layers, last_only=True)
        padded.reserve(b)
        pages, offsets = padded.slots(0, b)
        dev = core.pool.device
        ids = torch.tensor([toks + [toks[-1]] * (b - n)], device=dev)
        pos = torch.arange(b, device=dev).unsqueeze(0)
        got = runner.forward_tensors(ids, pos, padded.table.unsqueeze(0), pages, offsets,
                                     torch.tensor([n], dtype=torch.int32, device=dev), layers, True)
        assert got.logits.shape == want.logits.shape == (1, core.target.vocab_size)
        assert torch.equal(got.logits, want.logits)
        assert torch.equal(got.features[:n], want.features)
        e = core.target.seam.num_experts
        assert got.recorder.union(e, rows=n) == want.recorder.union(e, rows=n)
        for layer in range(len(core.pool.k)):
            for pool in (core.pool.k, core.pool.v):
                assert torch.equal(pool[layer][padded.pages[0], :, :n], pool[layer][plain.pages[0], :, :n])
    finally:
        plain.free()
        padded.free()


@needs_interpreter
@pytest.mark.timeout(600)
def test_a_padded_prefill_wave_gives_each_prompts_unpadded_bits(paged_core):
    """What a prefill-wave CUDA graph runs (GraphRunner.forward_prefill_wave: a `_WaveGraph` with `last_rows`: the items'
    rows one after another, the tail padded to the bucket and written into a scratch page, empty sequence slots, each
    item's last row picked for the LM head on the device), eagerly under the interpreter: each item's logits bits,
    features, routed experts and keys/values are those of its own unpadded prefill."""
    import torch

    from pdflash_kernels.attention import PAGE
    from verifier_svc.kv import SequenceKV
    from verifier_svc.runner import wave_starts

    core, runner = paged_core, paged_core.runner
    prompts, layers, b, slots = [list(range(5, 15)), list(range(30, 37))], (0, 1), 24, 3
    seqs = [SequenceKV(core.pool, core.target.max_context) for _ in range(2 * len(prompts))]
    scratch = core.pool.alloc(1)[0]
    try:
        want = [runner.forward(p, 0, s, layers, last_only=True) for p, s in zip(prompts, seqs)]
        mine = seqs[len(prompts):]
        starts = wave_starts([len(p) for p in prompts])
        n = starts[-1]
        dev = core.pool.device
        ids, pos, pages, offsets = [], [], [], []
        for p, s in zip(prompts, mine):
            s.reserve(len(p))
            pg, off = s.slot_lists(0, len(p))
            ids += p
            pos += range(len(p))
            pages += pg
            offsets += off
        tail = range(n, b)
        ids += [0] * len(tail)
        pos += [0] * len(tail)
        pages += [scratch] * len(tail)
        offsets += [i % PAGE for i in tail]
        table = torch.full((slots, mine[0].max_pages), scratch, dtype=torch.int32, device=dev)
        for k, s in enumerate(mine):
            table[k] = s.table
        seq_starts = torch.tensor(starts + [n] * (slots + 1 - len(starts)), dtype=torch.int32, device=dev)
        rows = torch.tensor([e - 1 for e in starts[1:]] + [0] * (slots - len(prompts)), device=dev)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        got = runner.forward_tensors(as_long([ids]), as_long([pos]), table, as_long(pages), as_long(offsets),
                                     torch.tensor([n], dtype=torch.int32, device=dev), layers, False,
                                     seq_starts=seq_starts, max_rows=b, rows=rows)
        assert got.logits.shape == (slots, core.target.vocab_size)
        e = core.target.seam.num_experts
        unions = got.recorder.unions(e, starts)
        for k, (p, w) in enumerate(zip(prompts, want)):
            a, z = starts[k], starts[k + 1]
            assert torch.equal(got.logits[k : k + 1], w.logits), f"prompt {k}"
            assert torch.equal(got.features[a:z], w.features)
            assert unions[k] == w.recorder.union(e, rows=len(p))
            for layer in range(len(core.pool.k)):
                for pool in (core.pool.k, core.pool.v):
                    assert torch.equal(pool[layer][mine[k].pages[0], :, : len(p)], pool[layer][seqs[k].pages[0], :, : len(p)])
    finally:
        for s in seqs:
            s.free()
        core.pool.release([scratch])


@needs_interpreter
@pytest.mark.timeout(600)
def test_a_chunked_prefill_gives_the_one_go_session_bit_for_bit(paged_core):
    from verifier_svc.engine import PrefillInput

    core = paged_core
    prompt = tuple(range(7, 77))  # 70 tokens: chunks of 32, 32 and 6, across a KV page

    def start(chunk: int, tag: str):
        core.prefill_chunk = chunk
        try:
            return core.prefill(PrefillInput(tag, prompt, SamplingParams(), 20, feature_layer_ids=(0, 1), logprobs=True,
                                             top_logprobs=3))
        finally:
            core.prefill_chunk = 0

    whole, chunked = start(0, "whole"), start(32, "chunked")
    assert chunked.forward_ms > 0 and _answer(chunked)[:-2] == _answer(whole)[:-2]  # tokens, logprobs, features, ...
    assert chunked.routed_union == whole.routed_union and chunked.routed_bytes == whole.routed_bytes
    outs = [core.verify(DraftResult(o.session_id, 1, (o.tokens[0], 9, 10, 11), {}, 0)) for o in (whole, chunked)]
    assert _answer(outs[0]) == _answer(outs[1])  # and the KV it left: the next round's bits
    for o in (whole, chunked):
        core.end(o.session_id)
    free = core.pool.free_pages
    core.prefill_chunk = 32
    try:
        job = core.start_prefill(PrefillInput("left", prompt, SamplingParams(), 20))
    finally:
        core.prefill_chunk = 0
    assert job.steps == 3 and not job.step() and core.pool.free_pages < free
    # a prefill under way counts against max_sessions, though its session is not in the store yet
    from pdflash.errors import ResourceExhausted

    cap = core.sessions.max_sessions
    core.sessions.max_sessions = 1
    try:
        with pytest.raises(ResourceExhausted, match="maximum of 1 sessions"):
            core.start_prefill(PrefillInput("second", prompt, SamplingParams(), 20))
        job.close()  # its caller left between two chunks: the pages go back, the count too
        job.close()  # (twice: nothing more)
        assert core.pool.free_pages == free and len(core.sessions) == 0 and core._prefilling == 0
        core.start_prefill(PrefillInput("second", prompt, SamplingParams(), 20)).close()
    finally:
        core.sessions.max_sessions = cap
    assert core._prefilling == 0 and core.pool.free_pages == free


@needs_interpreter
@pytest.mark.timeout(900)
def test_a_prefill_wave_makes_each_session_as_its_own_prefill_would(paged_core):
    """Several prompts in one forward (`VerifierCore.prefill_wave`, whole or a chunk each a wave): each answer (first
    token, log-probabilities, features, routed experts) and the KV it leaves (the next round's bits) are its own
    prefill's."""
    from pdflash.errors import ResourceExhausted
    from verifier_svc.engine import PrefillInput

    core = paged_core
    free = core.pool.free_pages

    def inputs(tag):
        return [PrefillInput(f"{tag}{i}", tuple(p), sp, 40, feature_layer_ids=fl, logprobs=True, top_logprobs=3)
                for i, (p, sp, fl) in enumerate(SESSIONS)]

    alone = [core.prefill(r) for r in inputs("alone")]

    def in_waves(tag, chunk):
        core.prefill_chunk = chunk
        try:
            jobs = [core.start_prefill(r) for r in inputs(tag)]
        finally:
            core.prefill_chunk = 0
        pending, waves = list(jobs), 0
        while pending:
            got = core.prefill_wave(pending)
            assert not any(isinstance(g, BaseException) for g in got), got
            pending, waves = [j for j, done in zip(pending, got) if not done], waves + 1
        return [j.finish() for j in jobs], waves

    whole, waves = in_waves("whole", 0)
    assert waves == 1 and [o.wave_sessions for o in whole] == [3, 3, 3]
    assert len({o.forward_ms for o in whole}) == 1  # one forward
    chunked, waves = in_waves("chunked", 16)  # prompts of 10, 70 and 3 tokens: the long one's chunks 2..5 alone
    assert waves == 5 and [o.wave_sessions for o in chunked] == [3, 3, 3]
    for got in (whole, chunked):
        assert [_answer(o) for o in got] == [_answer(o) for o in alone]
    anchors = [o.tokens[-1] for o in alone]
    assert _rounds(core, [o.session_id for o in whole], anchors, wave=False) == \
        _rounds(core, [o.session_id for o in alone], anchors, wave=False)
    for sid in list(core.sessions._sessions):
        core.end(sid)
    assert core.pool.free_pages == free and core._prefilling == 0

    # a full KV pool refuses a prompt alone: the others run, and the refused job runs once pages are free
    jobs = [core.start_prefill(r) for r in inputs("full")]
    taken = core.pool.alloc(core.pool.free_pages - 1)  # one page left: the first prompt takes it
    try:
        got = core.prefill_wave(jobs)
    finally:
        core.pool.release(taken)
    assert got[0] is True and isinstance(got[1], ResourceExhausted) and isinstance(got[2], ResourceExhausted)
    assert core.prefill_wave(jobs[1:]) == [True, True]
    outs = [j.finish() for j in jobs]
    assert [_answer(o) for o in outs] == [_answer(o) for o in alone]
    with pytest.raises(ValueError, match="each prompt once"):
        core.prefill_wave([jobs[0], jobs[0]])
    for o in outs:
        core.end(o.session_id)
    assert core.pool.free_pages == free and core._prefilling == 0


@needs_interpreter
@pytest.mark.timeout(600)
def test_prompts_that_would_replay_prefill_graphs_share_a_wave_only_when_their_rows_pay_for_it(paged_core, monkeypatch):
    """The served rule (`prefill_wave_graphed_rows`): prompts whose chunks would replay a prefill graph (CUDA, experts
    resident; here every prompt, as if) replay them one after another unless their rows together reach the threshold,
    where one eager wave costs less; a prompt that would run eagerly anyway always joins the wave."""
    from verifier_svc.engine import PrefillInput

    core = paged_core
    prompts = [tuple(range(5, 15)), tuple(range(20, 26)), (3, 4, 5)]

    def waves(replays, threshold):
        monkeypatch.setattr(core, "_replays_prefill", lambda job, n: replays(job))
        monkeypatch.setattr(core, "prefill_wave_graphed_rows", threshold)
        jobs = [core.start_prefill(PrefillInput(f"g{i}", p, SamplingParams(), 8)) for i, p in enumerate(prompts)]
        assert core.prefill_wave(jobs) == [True, True, True]
        outs = [j.finish() for j in jobs]
        for o in outs:
            core.end(o.session_id)
        return [o.wave_sessions for o in outs], [o.tokens for o in outs]

    each, first = waves(lambda job: True, 20)  # 10 + 6 + 3 = 19 rows, below 20: each replays its own graph
    assert each == [1, 1, 1]
    assert waves(lambda job: True, 19) == ([3, 3, 3], first)  # 19 rows reach 19: one wave
    # only g2 would replay a graph: g0 and g1 (eager anyway) share a wave, g2 replays alone
    assert waves(lambda job: job.req.request_id == "g2", 100) == ([2, 2, 1], first)
    # g1 alone would run eagerly: a wave of one is its own step, and g0 and g2 replay theirs
    assert waves(lambda job: job.req.request_id != "g1", 100) == ([1, 1, 1], first)


@needs_interpreter
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verifies_waiting_for_the_device_run_between_a_prompts_chunks(tiny, monkeypatch):
    import asyncio
    import time

    from pdflash.v1 import verifier_pb2
    from tests.test_prefetch import Served
    from verifier_svc import servicer as servicer_mod

    v = Served(model=str(tiny.target("qwen3_moe")), dtype="bfloat16", kernels="on", paged_kv="on", kv_cache_gb=0.01,
               prefill_chunk=16, max_wave_sessions=2)
    try:
        servicer, core = v.running.servicer, v.running.core
        assert core.pool is not None and core.prefill_chunk == 16 and core.chunked_prefill and core.wave_forward
        events = []
        assert servicer.prefill_waves  # (a prompt's chunks go through prefill waves: one chunk a wave of one here)
        step = servicer_mod._prefill_wave_step
        monkeypatch.setattr(servicer_mod, "_prefill_wave_step", lambda core, jobs: events.append("chunk") or step(core, jobs))
        wave = core.verify_wave
        monkeypatch.setattr(core, "verify_wave", lambda *a, **k: events.append("verify") or wave(*a, **k))
        other = v.stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7], max_tokens=8, ignore_eos=True),
                               timeout=120)
        events.clear()
        asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop).result(timeout=10)
        try:
            long = v.stub.Prefill.future(verifier_pb2.PrefillRequest(prompt_tokens=list(range(9, 49)), max_tokens=8,
                                                                     ignore_eos=True), timeout=300)
            deadline = time.time() + 60
            while servicer._pending < 1 and time.time() < deadline:  # its first chunk waits for the device
                time.sleep(0.01)
            call = v.stub.Verify.future(_verify_req(other.session_id, 1, [other.first_token]), timeout=300)
            while servicer._pending < 2 and time.time() < deadline:
                time.sleep(0.01)
        finally:
            v.loop.call_soon_threadsafe(servicer._device.release)
        first, long = call.result(), long.result()
        assert first.round == 1 and first.wave_sessions == 1 and long.session_id
        assert events == ["chunk", "verify", "chunk", "chunk"]  # 40 tokens: 16 + 16 + 8, the verify after the first
        # the two sessions' next rounds, sent while the device is busy, share one ragged forward: the answer says so
        asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop).result(timeout=10)
        try:
            calls = [v.stub.Verify.future(_verify_req(sid, r, [tok, 9, 10]), timeout=300)
                     for sid, r, tok in ((other.session_id, 2, first.accepted_tokens[-1]), (long.session_id, 1, long.first_token))]
            while len(servicer._waiting) < 2 and time.time() < deadline + 60:
                time.sleep(0.01)
        finally:
            v.loop.call_soon_threadsafe(servicer._device.release)
        assert [c.result().wave_sessions for c in calls] == [2, 2]
        assert calls[0].result().timings.forward_ms == calls[1].result().timings.forward_ms
        # prompts that wait for the device together share a prefill wave (one chunk of 16 each: 2 a wave, the most
        # sessions a wave), and each gets the first token, features and experts its prefill alone gives
        monkeypatch.setattr(servicer_mod, "_prefill_wave_step", step)
        req = lambda p: verifier_pb2.PrefillRequest(prompt_tokens=p, max_tokens=8, ignore_eos=True,  # noqa: E731
                                                     feature_layer_ids=[0, 1])
        prompts = [[5, 6, 7], list(range(20, 32)), [40, 41]]
        alone = [v.stub.Prefill(req(p), timeout=120) for p in prompts]
        assert [a.wave_sessions for a in alone] == [1, 1, 1]
        asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop).result(timeout=10)
        try:
            futs = [v.stub.Prefill.future(req(p), timeout=300) for p in prompts]
            while len(servicer._prefills_waiting) < 3 and time.time() < deadline + 120:
                time.sleep(0.01)
            assert len(servicer._prefills_waiting) == 3
        finally:
            v.loop.call_soon_threadsafe(servicer._device.release)
        together = [f.result() for f in futs]
        assert [t.wave_sessions for t in together] == [2, 2, 1]
        strip = lambda r: (r.first_token, r.features.data, r.routed_union, r.routed_bytes, r.committed_tokens)  # noqa: E731
        assert [strip(t) for t in together] == [strip(a) for a in alone]
        metrics = v.running.metrics
        assert metrics.registry.get_sample_value("pdflash_prefill_wave_sessions_count") == 1
        for r in alone + together:
            v.stub.EndSession(verifier_pb2.EndSessionRequest(session_id=r.session_id), timeout=30)
        assert core._prefilling == 0 and len(core.sessions) == 1 + 1  # (the first two sessions of this test)
        # a caller that gives up while its prompt waits for a wave: its job is closed (no pages, no count held), and
        # the prompt beside it is answered
        import grpc

        free = core.pool.free_pages
        asyncio.run_coroutine_threadsafe(servicer._device.acquire(), v.loop).result(timeout=10)
        try:
            gone = v.stub.Prefill.future(req(list(range(50, 70))), timeout=1.0)
            kept = v.stub.Prefill.future(req(prompts[0]), timeout=300)
            while len(servicer._prefills_waiting) < 2 and time.time() < deadline + 180:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                gone.result()
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            while len(servicer._prefills_waiting) > 1 and time.time() < deadline + 180:
                time.sleep(0.01)
            assert len(servicer._prefills_waiting) == 1 and core._prefilling == 1  # (the kept prompt's job)
        finally:
            v.loop.call_soon_threadsafe(servicer._device.release)
        answer = kept.result()
        assert answer.wave_sessions == 1 and strip(answer) == strip(alone[0])  # (alone in its wave: the other left)
        v.stub.EndSession(verifier_pb2.EndSessionRequest(session_id=answer.session_id), timeout=30)
        assert core._prefilling == 0 and core.pool.free_pages == free and servicer._pending == 0
    finally:
        v.stop()
