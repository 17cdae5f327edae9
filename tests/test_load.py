"""A small, bounded load run (the full one with latency numbers is benchmarks/load.py): many concurrent
streams, zero errors, every output equal to its greedy reference, nothing held afterwards. The stacks and their
references: conftest.DEVICE/DTYPE (cpu, float32), on every host."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.load import greedy_reference, in_use, make_jobs, run_load, summarize
from tests.conftest import DEVICE, start_stack

pytestmark = pytest.mark.slow


def test_concurrent_streams_are_exact_and_leave_nothing_behind(stack, tiny):
    model = str(tiny.target("qwen3_moe"))
    jobs = make_jobs(clients=8, requests=2, max_tokens=16, drafters=["ngram", "none", "hybrid", "dflash"])
    references = {j: greedy_reference(model, j.prompt, j.max_tokens, device=DEVICE) for js in jobs for j in js}
    records, wall = asyncio.run(run_load(stack.drafter, jobs, request_timeout=120, time_limit=300))
    summary = summarize(records, wall, references)
    assert summary["requests"] == 16
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["mismatches"] == 0
    held = in_use(stack.scheduler, stack.verifier)
    assert not any(held.values()), held


def _expired_total(stack) -> int:
    import grpc

    from pdflash.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(stack.scheduler) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.StatsRequest(), timeout=10).expired_total


def test_streams_contending_for_a_small_budget_never_wait_on_each_others_leases(tiny, tmp_path):
    """A budget of two blocks, eight streams: every lease is given back by its holder (none expires). A
    session must not hold a finished round's lease while it queues for its next round, or sessions would
    wait on each other until the leases expire."""
    model = str(tiny.target("qwen3_moe"))
    stack = start_stack(model, tiny.drafter("qwen3_moe"), tmp_path, scheduler_args=["--token-budget", "32", "--lease-s", "30"])
    try:
        jobs = make_jobs(clients=8, requests=2, max_tokens=24, drafters=["ngram", "none", "hybrid"])
        references = {j: greedy_reference(model, j.prompt, j.max_tokens, device=DEVICE) for js in jobs for j in js}
        records, wall = asyncio.run(run_load(stack.drafter, jobs, request_timeout=60, time_limit=300))
        summary = summarize(records, wall, references)
        assert summary["errors"] == 0, summary["error_samples"]
        assert summary["mismatches"] == 0
        assert _expired_total(stack) == 0
        held = in_use(stack.scheduler, stack.verifier)
        assert not any(held.values()), held
    finally:
        stack.stop()


def test_concurrent_streams_in_verify_waves_are_exact_and_leave_nothing_behind(tiny, tmp_path):
    """`pdflash up --max-wave-sessions 8`: the verifier gathers the Verify calls waiting for it into waves (on the CPU's
    transformers cache, one forward after another in one turn); every stream's output is still its greedy reference,
    nothing is held afterwards, and the verifier's metrics counted the waves."""
    import re
    import urllib.request

    model = str(tiny.target("qwen3_moe"))
    stack = start_stack(model, tiny.drafter("qwen3_moe"), tmp_path, verifier_args=["--max-wave-sessions", "8"])
    try:
        jobs = make_jobs(clients=8, requests=2, max_tokens=16, drafters=["ngram", "none", "hybrid", "dflash"])
        references = {j: greedy_reference(model, j.prompt, j.max_tokens, device=DEVICE) for js in jobs for j in js}
        records, wall = asyncio.run(run_load(stack.drafter, jobs, request_timeout=120, time_limit=300))
        summary = summarize(records, wall, references)
        assert summary["requests"] == 16 and summary["errors"] == 0, summary["error_samples"]
        assert summary["mismatches"] == 0
        held = in_use(stack.scheduler, stack.verifier)
        assert not any(held.values()), held
        text = urllib.request.urlopen(f"http://127.0.0.1:{stack.spec.metrics_ports[2]}/metrics", timeout=10).read().decode()
        waves = float(re.search(r"^pdflash_verify_wave_sessions_count (\S+)$", text, re.M).group(1))
        sessions = float(re.search(r"^pdflash_verify_wave_sessions_sum (\S+)$", text, re.M).group(1))
        assert waves > 0 and sessions >= waves  # every verify went through a wave
    finally:
        stack.stop()


def test_the_load_benchmark_on_a_model_of_ones_own_starts_without_the_embedded_drafter(tiny, tmp_path):
    """benchmarks/load.py --model DIR (not the embedded target) and no --drafter: the embedded DFlash drafter (made for
    the embedded target) is not started beside it, so the stack starts and every output is its greedy reference."""
    import json

    from benchmarks import load

    out = tmp_path / "load.json"
    assert load.main(["--model", str(tiny.target("qwen3_moe")), "--clients", "2", "--requests", "1", "--max-tokens", "8",
                      "--drafters", "ngram,dflash", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["drafter"] == "" and result["config"]["drafters"] == ["ngram"]
    (run,) = result["runs"]
    assert run["requests"] == 2 and run["errors"] == 0 and run["mismatches"] == 0
    # the started verifier's /metrics: the level's verifies and the forwards that ran them (waves are off on the CPU)
    v = run["verifier"]
    assert v["verifies"] > 0 and v["forwards"] == v["verifies"] and v["verifies_per_forward"] == 1.0
    assert v["verify_server_ms_mean"] > 0
    # and each service's CPU time over the level (from /proc), per verify
    cpu = run["services_cpu_per_verify"]
    # (/proc counts CPU time in clock ticks, 10 ms: a service that idles through this short level may read 0)
    assert set(cpu) == {"drafter", "scheduler", "verifier"} and all(c["cpu_ms_per_verify"] >= 0 for c in cpu.values())
    assert sum(c["cpu_s"] for c in cpu.values()) > 0


def test_service_probe_counts_forwards_and_summarizes_py_spy_stacks():
    """benchmarks/service_probe.py: a level's verifies and forwards from two scrapes (with waves every verify is in a
    wave, a lone one a wave of one; without, one forward each), and py-spy's raw stacks summed by function."""
    from benchmarks.service_probe import forwards, summarize

    zero = dict.fromkeys(("pdflash_verify_wave_sessions_count", "pdflash_verify_wave_sessions_sum",
                          "pdflash_verify_latency_seconds_count", "pdflash_verify_latency_seconds_sum"), 0.0)
    waves = {**zero, "pdflash_verify_wave_sessions_count": 10, "pdflash_verify_wave_sessions_sum": 25,
             "pdflash_verify_latency_seconds_count": 25, "pdflash_verify_latency_seconds_sum": 0.05}
    assert forwards(zero, waves) == dict(verifies=25, forwards=10, verifies_per_forward=2.5, verify_server_ms_mean=2.0)
    plain = {**zero, "pdflash_verify_latency_seconds_count": 4, "pdflash_verify_latency_seconds_sum": 0.004}
    assert forwards(zero, plain)["forwards"] == 4 and forwards(zero, zero)["verifies_per_forward"] is None
    raw = ("main (a.py:1);loop (b.py:2);verify (c.py:3);forward (d.py:4) 60\n"
           "main (a.py:1);loop (b.py:2);send (e.py:5) 30\n"
           "main (a.py:1);idle (f.py:6) 10\n"
           "garbage line\n")
    got = summarize(raw, rate=100, top=3)
    assert got["samples"] == 100 and got["cpu_s"] == 1.0
    assert got["self"] == [("forward", 0.6), ("send", 0.3), ("idle", 0.1)]
    # main is in every sample (left out); loop in 90%
    assert got["inclusive"][0] == ("loop", 0.9) and set(got["inclusive"][1:]) == {("verify", 0.6), ("forward", 0.6)}
    assert summarize("", rate=100)["samples"] == 0
    # CPU time from /proc: this process's own grows; a process that is gone has none
    import os

    from benchmarks.service_probe import cpu_per_verify, cpu_seconds

    import time

    t0 = cpu_seconds(os.getpid())
    deadline = time.monotonic() + 20  # (clock ticks of 10 ms: spin until the next one, however loaded the machine)
    while cpu_seconds(os.getpid()) <= t0 and time.monotonic() < deadline:
        sum(i * i for i in range(100_000))
    assert cpu_seconds(os.getpid()) > t0 and cpu_seconds(2**22 + 12345) is None
    assert cpu_per_verify({"a": 1.0, "b": None}, {"a": 1.5, "b": 2.0}, 100) == {"a": {"cpu_s": 0.5, "cpu_ms_per_verify": 5.0}}


def test_grpc_pingpong_times_stream_and_unary_round_trips(capsys):
    """benchmarks/grpc_pingpong.py --modes stream unary: a row per mode with the round trip and the CPU each side
    spends on it (the unary call is the scheduler's Admit hop, the stream message the verify stream's)."""
    from benchmarks import grpc_pingpong

    assert grpc_pingpong.main(["--busy-ms", "0", "--n", "30", "--modes", "stream", "unary"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| stream", "| unary"))]
    assert [r.split("|")[1].strip() for r in rows] == ["stream", "unary"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[4]) > 0  # round trip p50 us, client CPU us
