"""The verifier's warm-up at load (verifier_svc/warmup.py, --warmup): it runs a prefill and a verify per CUDA-graph
bucket, with and without the drafter's feature layers, then leaves nothing behind (no session, every KV page back in
the pool, the expert cache's counters zero and nothing marked as an unused prefetch) and changes no token of the
requests that follow. On the CPU (where --warmup auto is off) with --warmup on; the CUDA path (graphs captured, the
device-managed cache) is tested in tests/test_gpu_verifier.py."""

from __future__ import annotations

import argparse
import asyncio
import functools
import urllib.request

import grpc
import pytest
import yaml

from pdflash.config import ConfigError, add_arguments, from_sources
from tests.conftest import DEVICE, DTYPE, ROOT, needs_triton
from verifier_svc.config import VerifierConfig

NEW = 24  # tokens a request generates


def parse(argv, env=None) -> VerifierConfig:
    p = argparse.ArgumentParser()
    add_arguments(p, VerifierConfig)
    return from_sources(VerifierConfig, p.parse_args(argv), env=env or {})


@functools.cache
def demo_dir() -> str:
    from pdflash.defaults import default_target_dir

    return str(default_target_dir())


def _core(model: str, max_block_size: int = 8, **load):
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    return VerifierCore(load_target(model, DEVICE, DTYPE, **load), max_block_size=max_block_size)


def _tokens(core, reference: list[int] | None = None, new: int = NEW) -> list[int]:
    """A greedy request of `new` tokens: at block 1, or (given the reference continuation) with drafts at block 8, the
    reference with a wrong token every third draft."""
    import tests.test_gpu_verifier as drive

    before, drive.NEW = drive.NEW, new
    prompt = list(range(5, 30))
    try:
        if reference is None:
            return drive._run(core, prompt, drive._no_drafts)
        return drive._run(core, prompt, drive._replay(reference, 3, core.target.vocab_size), width=8)
    finally:
        drive.NEW = before


def _unused_prefetches(cache) -> int:
    """Slices a prefetch brought in that no forward has used yet (they count as waste when evicted unused)."""
    if getattr(cache, "device_managed", False):
        return int(cache.unused.sum())
    return len(cache._unused_prefetch)


# ---- the warm-up itself ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_warmup_on_the_demo_model_leaves_nothing_behind_and_changes_no_token():
    from verifier_svc import warmup

    cold = _core(demo_dir())
    warm = _core(demo_dir())
    layers = warmup.feature_layers(None, "")  # auto: the embedded drafter's layers for the embedded target
    assert layers and layers == warmup.feature_layers(None, demo_dir())
    report = warmup.warm(warm, layers)
    t = warm.target
    forms = warmup.align_lengths(t.experts_per_token, t.max_context)
    assert t.experts_per_token > 0 and len(forms) >= 3
    # each form of the align prefilled too where it compiles (CUDA); on a CPU nothing compiles, so they are skipped
    assert report.feature_layers == layers
    assert report.prefills == 2 + (len(forms) if t.device.type == "cuda" else 0)
    assert report.verifies == 2 * len(warmup.block_sizes(8)) == 8  # blocks 1, 2, 4, 8; without and with features
    assert len(warm.sessions) == 0
    assert warm.warmup_seconds == report.seconds > 0 and cold.warmup_seconds == 0
    want = _tokens(cold)
    assert _tokens(warm) == want and _tokens(warm, want) == want
    assert len(warm.sessions) == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["device", "host"])
def test_warmup_with_offloaded_experts_zeroes_the_cache_counters_and_keeps_it_warm(mode):
    from verifier_svc import warmup
    from verifier_svc.expert_cache import CacheStats

    cold = _core(demo_dir(), experts="mxfp4", expert_cache_gb=1.0, expert_cache_mode=mode)  # every expert cached
    store = cold.target.expert_cache.store
    per_layer = max(store.num_experts.values())
    # host: one layer's experts + 2; device: the overflow range (one layer's) + a partition of ~2 a layer: evicts
    slots = per_layer + 2 if mode == "host" else per_layer + 2 * len(store.num_experts)
    warm = _core(demo_dir(), experts="mxfp4", expert_cache_gb=(slots + 0.5) * store.slice_bytes / 2**30, expert_cache_mode=mode)
    cache = warm.target.expert_cache
    assert cache.num_slots < sum(store.num_experts.values())
    reset, marks = cache.reset_stats, []
    cache.reset_stats = lambda: marks.append(_unused_prefetches(cache)) or reset()
    report = warmup.warm(warm, warmup.feature_layers(None, ""))
    # the warm-up left prefetches unused, which would count as the first request's waste (the device-managed cache's
    # small partitions here evict them within the forward: its marks are tested below)
    assert marks and (marks[0] > 0 or mode == "device")
    spent = report.expert_cache
    assert spent.lookups > 0 and spent.bytes_moved > 0 and spent.evictions > 0 and spent.prefetched > 0
    assert cache.stats == CacheStats() and _unused_prefetches(cache) == 0 and len(warm.sessions) == 0
    assert any(cache.resident(layer, e) for layer in store.num_experts for e in range(per_layer))  # it stays warm
    # the first request's counters are its own: each call's add up to the cache's totals
    calls = []
    for name in ("prefill", "verify"):
        step = getattr(warm, name)
        setattr(warm, name, lambda *a, _step=step, **k: calls.append(_step(*a, **k)) or calls[-1])
    want = _tokens(cold, new=12)
    assert _tokens(warm, want, new=12) == want  # the cache's contents change no token (tests/test_offload.py)
    total = functools.reduce(CacheStats.plus, [c.expert_cache for c in calls])
    assert cache.stats == total and total.lookups > 0


@pytest.mark.slow
@needs_triton
def test_warmup_on_the_paged_kv_pool_returns_every_page(tiny):
    """The paged KV pool and the layer-by-layer forward (the CUDA path's, here under Triton's interpreter: slow, so
    blocks of 1 and 2 and a few tokens)."""
    from verifier_svc import warmup
    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    target = load_target(tiny.target("qwen3_moe"), "cpu", "bfloat16", kernels="on")
    cold, warm = (VerifierCore(target, max_block_size=2, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01)) for _ in range(2))
    free = warm.pool.free_pages
    report = warmup.warm(warm, (target.num_layers - 1,))
    assert report.verifies == 4 and len(warm.sessions) == 0
    assert warm.pool.free_pages == free
    assert _tokens(warm, new=6) == _tokens(cold, new=6)
    assert warm.pool.free_pages == free


def test_feature_layers_out_of_the_model_fail_at_load():
    from verifier_svc import warmup

    class Core:  # warm() checks the layers before any forward
        target = type("T", (), {"num_layers": 4, "name": "m"})()

    with pytest.raises(ValueError, match=r"layers \[7\] are not layers of m \(0..3\)"):
        warmup.warm(Core(), (1, 7))


def test_auto_feature_layers_are_the_default_drafters():
    import json

    from drafter_svc.compat import target_layers
    from pdflash.defaults import ASSETS, default_drafter_dir
    from verifier_svc import warmup

    assert default_drafter_dir() is not None, "the embedded demo drafter is part of the checkout (pdflash/assets/demo)"
    shipped = json.loads((ASSETS / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert warmup.feature_layers(None, "") == tuple(shipped) == target_layers(ASSETS / "drafter")
    assert warmup.feature_layers(None, "/some/other/model") == ()  # no default DFlash drafter for it
    assert warmup.feature_layers((), "") == () and warmup.feature_layers((4, 2), "/x") == (4, 2)
    assert target_layers(ASSETS / "target") == () and target_layers("/nonexistent") == ()


def test_block_sizes_cover_every_bucket_a_verify_can_land_in():
    from verifier_svc.warmup import block_sizes

    assert block_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert block_sizes(20) == [1, 2, 4, 8, 16, 20]  # 20 rows replay the 32-row bucket
    assert block_sizes(3) == [1, 2, 3]


# ---- configuration ------------------------------------------------------------------------------------------------
def test_warmup_option_auto_on_off_flags_env_and_file(tmp_path):
    cfg = parse([])
    assert cfg.warmup == "auto" and cfg.warmup_wanted("cuda") and not cfg.warmup_wanted("cpu")
    assert parse(["--warmup"]).warmup == "on" and parse(["--warmup"]).warmup_wanted("cpu")
    assert parse(["--no-warmup"]).warmup == "off" and not parse(["--no-warmup"]).warmup_wanted("cuda")
    for value in ("auto", "on", "off"):
        assert parse(["--warmup", value]).warmup == value
        assert parse([], {"PDFLASH_WARMUP": value}).warmup == value
    for value, want in (("true", "on"), ("1", "on"), ("no", "off"), ("OFF", "off"), ("", "auto")):
        assert parse([], {"PDFLASH_WARMUP": value}).warmup == want, value
    assert parse(["--warmup", "on"], {"PDFLASH_WARMUP": "off"}).warmup == "on"  # the flag wins
    f = tmp_path / "v.yaml"
    f.write_text("warmup: off\n")  # YAML reads an unquoted off as the boolean false
    assert parse(["--config", str(f)]).warmup == "off"
    with pytest.raises(ConfigError, match="--warmup 'sometimes'"):
        parse(["--warmup", "sometimes"])
    with pytest.raises(ConfigError, match="--warmup"):
        parse([], {"PDFLASH_WARMUP": "maybe"})



@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_read_the_warmup_switch_as_serve_verifier_does(command):
    """README: switches such as --warmup also read true/false/1/0; `pdflash up --warmup true` was refused by argparse
    while `serve-verifier --warmup true` took it. Whatever `up` reads, it passes on as auto/on/off."""
    from pdflash.cli import _verifier_args, build_parser

    p = build_parser()
    for argv, want in (([], "auto"), (["--warmup"], "on"), (["--no-warmup"], "off"), (["--warmup", "true"], "on"),
                       (["--warmup", "1"], "on"), (["--warmup", "False"], "off"), (["--warmup", "0"], "off"),
                       (["--warmup", "ON"], "on"), (["--warmup", "auto"], "auto")):
        args = p.parse_args([command, *argv])
        assert args.warmup == want, argv
        assert _verifier_args(args) == ([] if want == "auto" else ["--warmup", want]), argv
    with pytest.raises(SystemExit):
        p.parse_args([command, "--warmup", "sometimes"])

def test_warmup_feature_layers_option():
    assert parse([]).warmup_layer_ids() is None  # auto
    assert parse(["--warmup-feature-layers", "none"]).warmup_layer_ids() == ()
    assert parse(["--warmup-feature-layers", "5, 1,3"]).warmup_layer_ids() == (5, 1, 3)  # the drafter's order
    assert parse([], {"PDFLASH_WARMUP_FEATURE_LAYERS": "2"}).warmup_layer_ids() == (2,)
    for bad in ("x", "-1", "1,,3", "1;3"):
        with pytest.raises(ConfigError, match="--warmup-feature-layers"):
            parse(["--warmup-feature-layers", bad])


def test_pdflash_up_and_demo_pass_the_warmup_to_the_verifier():
    from pdflash.cli import _spec, build_parser
    from pdflash.defaults import ASSETS, default_drafter_dir
    from pdflash.stack import Stack

    def spec(command, *argv):
        return _spec(build_parser().parse_args([command, *argv]))

    for command in ("up", "demo"):
        assert spec(command).verifier_args == []  # auto: the verifier decides (on with CUDA)
        assert spec(command, "--no-warmup").verifier_args == ["--warmup", "off"]
        assert spec(command, "--warmup").verifier_args == ["--warmup", "on"]
        assert spec(command, "--warmup", "off").verifier_args == ["--warmup", "off"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--warmup", "sometimes"])
    cmd = Stack(spec("up", "--warmup"))._cmd("verifier")
    assert cmd[cmd.index("--warmup") + 1] == "on" and "--warmup-feature-layers" not in cmd  # auto: the verifier knows
    cmd = Stack(spec("up", "--no-dflash"))._cmd("verifier")
    assert cmd[cmd.index("--warmup-feature-layers") + 1] == "none"
    if default_drafter_dir() is not None:  # a named drafter: its layers, which the verifier cannot know
        cmd = Stack(spec("up", "--drafter", str(ASSETS / "drafter")))._cmd("verifier")
        assert cmd[cmd.index("--warmup-feature-layers") + 1] == "1,3,5"
    # what the stack passes, the verifier accepts
    parse(cmd[cmd.index("serve-verifier") + 1:])


def test_both_compose_files_set_the_verifier_warmup():
    for name in ("compose.yaml", "compose.gpu.yaml"):
        env = yaml.safe_load((ROOT / name).read_text())["services"]["verifier"]["environment"]
        assert env["PDFLASH_WARMUP"] == "${PDFLASH_WARMUP:-auto}", name


# ---- through a real server ----------------------------------------------------------------------------------------
async def _serve(cfg: VerifierConfig):
    """Start the verifier in this process, read its model info and metrics, stop it."""
    from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
    from verifier_svc import server

    running = await server.start(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            info = await verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
        with urllib.request.urlopen(running.metrics_server.url, timeout=10) as r:
            return info, r.read().decode()
    finally:
        await running.stop(0)


@pytest.mark.slow
def test_model_info_says_how_long_the_warmup_took_and_health_waits_for_it(monkeypatch):
    """Through a real server: warm-up runs before health turns SERVING (meanwhile health says NOT_SERVING and calls get
    UNAVAILABLE), model info carries its seconds, the metrics saw none of its forwards, and no session is left."""
    from pdflash.stack import SERVICE_NAMES, check_health, free_ports
    from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
    from tests.test_services import metric_value
    from verifier_svc import warmup

    port = free_ports(1)[0]
    seen = {}
    real = warmup.warm

    def spy(core, layers):  # on the torch thread, while the server's loop answers
        seen["health"] = check_health(f"127.0.0.1:{port}", SERVICE_NAMES["verifier"], timeout=5)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=5)
            except grpc.RpcError as e:
                seen["call"] = e.code()
        seen["layers"] = layers
        return real(core, layers)

    monkeypatch.setattr(warmup, "warm", spy)
    base = dict(host="127.0.0.1", device="cpu", dtype="float32", max_block_size=4, metrics_port=0)
    info, metrics = asyncio.run(_serve(VerifierConfig(port=port, warmup="on", **base)))
    assert seen == {"health": False, "call": grpc.StatusCode.UNAVAILABLE, "layers": warmup.feature_layers(None, "")}
    assert info.warmup_seconds > 0 and info.sessions_alive == 0
    for name in ("pdflash_prefill_latency_seconds_count", "pdflash_verify_latency_seconds_count", "pdflash_expert_cache_hits_total"):
        assert metric_value(metrics, name) == 0, name
    seen.clear()
    info, _ = asyncio.run(_serve(VerifierConfig(port=0, **base)))  # auto: off on the CPU
    assert info.warmup_seconds == 0 and not seen


def test_reset_stats_keeps_what_is_resident(tiny):
    """The host-managed cache on the CPU: the counters go to zero, the unused-prefetch marks go, the cached experts stay
    (the device-managed cache: in the offloaded warm-up test above)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verifier_svc.expert_cache import CacheStats, ExpertCache
    from verifier_svc.expert_store import HostExpertStore

    model = AutoModelForCausalLM.from_pretrained(tiny.target("qwen3_moe"), dtype=getattr(torch, DTYPE))
    store = HostExpertStore.from_model(model)
    first, second = sorted(store.num_experts)[:2]
    cache = ExpertCache(store, 4, torch.device("cpu"), need=2)
    cache.lookup(first, [0, 1])
    cache.release()
    cache.prefetch({second: {2}})
    assert (cache.stats.lookups, cache.stats.prefetched, _unused_prefetches(cache)) == (2, 1, 1)
    cache.reset_stats()
    assert cache.stats == CacheStats() and _unused_prefetches(cache) == 0
    assert cache.resident(first, 0) and cache.resident(first, 1) and cache.resident(second, 2)
    cache.lookup(second, [2])  # a plain hit now, not a prefetch used
    assert (cache.stats.hits, cache.stats.prefetch_used) == (1, 0)


@pytest.mark.slow
def test_reset_stats_of_the_device_managed_cache_keeps_what_is_resident():
    """Its counters, per-expert codes and unused-prefetch marks (device tensors) go to zero, the cached experts stay."""
    from pdflash.types import DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PrefillInput
    from verifier_svc.expert_cache import CacheStats

    core = _core(demo_dir(), experts="mxfp4", expert_cache_gb=1.0, expert_cache_mode="device", expert_prefetch="union")
    cache = core.target.expert_cache
    cache.guess_abort = False  # (else each layer frees the prefetches it did not route to: none would be left unused)
    pre = core.prefill(PrefillInput("r", (5, 6), SamplingParams(), 8, ignore_eos=True))
    # project the experts the prompt did not route: the union prefetch brings them in, no forward uses them
    wrong = {l: frozenset(range(cache.store.num_experts[l])) - pre.routed_union.get(l, frozenset()) for l in core.target.moe_layers}
    core.verify(DraftResult(pre.session_id, 1, (pre.tokens[-1],), wrong, union_bytes(wrong, core.target.byte_map)))
    assert cache.stats.prefetched > 0 and _unused_prefetches(cache) > 0 and int(cache.codes.abs().sum()) > 0
    resident = {(l, e) for l in cache.store.num_experts for e in range(cache.store.num_experts[l]) if cache.resident(l, e)}
    cache.reset_stats()
    assert cache.stats == CacheStats() and _unused_prefetches(cache) == 0 and int(cache.codes.abs().sum()) == 0
    assert int(cache.proj.abs().sum()) == 0
    assert resident and all(cache.resident(l, e) for l, e in resident)
    core.end(pre.session_id)


def test_align_lengths_reach_every_compiled_form_of_the_moe_align(monkeypatch):
    """The warm-up's extra prefills: one prompt a form of the MoE align (pdflash_kernels.moe.align_forms: one program or a
    program a chunk, ALIGN_PROGRAMS either way), whatever the experts a token; none for a dense model; none longer than
    half the context."""
    from pdflash_kernels import moe
    from verifier_svc.warmup import align_lengths

    for programs in (True, False):
        monkeypatch.setattr(moe, "ALIGN_PROGRAMS", programs)
        forms = [form for _, form in moe.align_forms()]
        for k in (1, 2, 4, 8, 32):
            assert [moe.align_form(n * k) for n in align_lengths(k, 1 << 16)] == forms
        if not programs:
            assert forms == [("one", c) for c in moe.ALIGN_CHUNKS]
        for pairs in range(1, 5000, 7):  # (the table is the form align_fused picks)
            assert moe.align_form(pairs) == next(f for most, f in moe.align_forms() if most is None or pairs <= most), pairs
    assert align_lengths(0, 4096) == []
    assert align_lengths(1, 200) == [64, 65]  # longer prompts do not fit half of a 200-token context

