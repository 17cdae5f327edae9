"""One way to configure every service: flags > PDFLASH_* environment > config file > defaults."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdflash.config import ConfigError, add_arguments, describe, from_sources
from scheduler_svc.config import SchedulerConfig
from verifier_svc.config import VerifierConfig


def parse(cls, argv):
    p = argparse.ArgumentParser()
    add_arguments(p, cls)
    return p.parse_args(argv)


def test_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("token_budget: 111\nlease_s: 7.5\nmax_wait_s: 3\n")
    args = parse(SchedulerConfig, ["--config", str(f), "--token-budget", "333"])
    cfg = from_sources(SchedulerConfig, args, env={"PDFLASH_TOKEN_BUDGET": "222", "PDFLASH_LEASE_S": "9"})
    assert cfg.token_budget == 333  # flag wins
    assert cfg.lease_s == 9.0  # env beats file
    assert cfg.max_wait_s == 3.0  # file beats default
    assert cfg.port == 50052  # default


def test_json_config_and_booleans(tmp_path):
    from drafter_svc.config import DrafterConfig

    f = tmp_path / "d.json"
    f.write_text('{"no_dflash": true, "block_size": 4}')
    cfg = from_sources(DrafterConfig, parse(DrafterConfig, ["--config", str(f)]), env={})
    assert cfg.no_dflash is True and cfg.block_size == 4
    cfg = from_sources(DrafterConfig, parse(DrafterConfig, ["--no-no-dflash"]), env={"PDFLASH_NO_DFLASH": "yes"})
    assert cfg.no_dflash is False


@pytest.mark.parametrize(
    "argv, env, fragment",
    [
        (["--port", "70000"], {}, "--port"),
        (["--token-budget", "abc"], {}, "token_budget"),
        ([], {"PDFLASH_LEASE_S": "-1"}, "lease"),
    ],
)
def test_invalid_values_name_the_option(argv, env, fragment):
    with pytest.raises(ConfigError) as e:
        from_sources(SchedulerConfig, parse(SchedulerConfig, argv), env=env)
    assert fragment in str(e.value)


def test_unknown_file_key_is_an_error(tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("modle: /x\n")
    with pytest.raises(ConfigError, match="unknown option"):
        from_sources(VerifierConfig, parse(VerifierConfig, ["--config", str(f)]), env={})


def test_secrets_are_masked_in_the_logged_configuration():
    cfg = from_sources(SchedulerConfig, parse(SchedulerConfig, []), env={"PDFLASH_TICKET_SECRET": "hunter2"})
    assert describe(cfg)["ticket_secret"] == "***"


def test_cli_reports_bad_configuration_and_documents_options():
    r = subprocess.run([sys.executable, "-m", "pdflash.cli", "serve-verifier", "--model", "/nonexistent"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "/nonexistent" in r.stderr and "config.json" in r.stderr
    for cmd in ("serve-scheduler", "serve-verifier", "serve-drafter"):
        h = subprocess.run([sys.executable, "-m", "pdflash.cli", cmd, "--help"], capture_output=True, text=True, timeout=120)
        assert h.returncode == 0 and "--config" in h.stdout and "PDFLASH_PORT" in h.stdout


@pytest.mark.parametrize("module", ["scheduler_svc.config:SchedulerConfig", "verifier_svc.config:VerifierConfig", "drafter_svc.config:DrafterConfig"])
@pytest.mark.parametrize("argv, fragment", [(["--log-level", "loud"], "--log-level"), (["--metrics-port", "-5"], "--metrics-port"),
                                            (["--grace-s", "-1"], "--grace-s"), (["--port", "-1"], "--port")])
def test_every_service_checks_the_shared_server_options(module, argv, fragment):
    import importlib

    mod, name = module.split(":")
    cls = getattr(importlib.import_module(mod), name)
    with pytest.raises(ConfigError) as e:
        from_sources(cls, parse(cls, argv), env={})
    assert fragment in str(e.value)


def test_torch_threads_and_round_options():
    from drafter_svc.config import DrafterConfig

    d = from_sources(DrafterConfig, parse(DrafterConfig, []), env={})
    assert (d.torch_threads, d.admit_ahead, d.verify_stream) == (1, True, True)  # the drafter leaves the cores to the verifier
    d = from_sources(DrafterConfig, parse(DrafterConfig, ["--no-admit-ahead", "--no-verify-stream", "--torch-threads", "0"]), env={})
    assert (d.torch_threads, d.admit_ahead, d.verify_stream) == (0, False, False)
    assert from_sources(VerifierConfig, parse(VerifierConfig, []), env={}).torch_threads == 0  # all cores
    for cls in (DrafterConfig, VerifierConfig):
        with pytest.raises(ConfigError) as e:
            from_sources(cls, parse(cls, ["--torch-threads", "-2"]), env={})
        assert "--torch-threads" in str(e.value)


def test_width_and_prefill_thread_options():
    from drafter_svc.config import DrafterConfig

    d = from_sources(DrafterConfig, parse(DrafterConfig, []), env={})
    assert (d.block_size, d.fixed_width) == (32, False)  # the widest block; rounds adapt within it
    assert from_sources(DrafterConfig, parse(DrafterConfig, ["--fixed-width"]), env={}).fixed_width
    v = from_sources(VerifierConfig, parse(VerifierConfig, ["--prefill-threads", "4"]), env={})
    assert v.prefill_threads == 4
    with pytest.raises(ConfigError, match="--prefill-threads"):
        from_sources(VerifierConfig, parse(VerifierConfig, ["--prefill-threads", "-1"]), env={})


def test_a_colocated_verifier_leaves_a_core_to_the_other_services_unless_told_otherwise():
    from pdflash.stack import Stack, StackSpec

    def counts(argv, env=None, cores=8):
        return from_sources(VerifierConfig, parse(VerifierConfig, argv), env=env or {}).thread_counts(cores)

    assert counts([]) == (0, 0)  # alone on its machine: torch's defaults, all cores
    assert counts(["--colocated"]) == (7, 0)  # forwards leave a core (prefill: as verify)
    assert counts(["--colocated"], cores=1) == (1, 0)
    assert counts(["--colocated", "--torch-threads", "2"]) == (2, 0)  # explicit settings win
    assert counts(["--colocated", "--prefill-threads", "8"]) == (7, 8)
    assert counts([], env={"PDFLASH_COLOCATED": "true", "PDFLASH_PREFILL_THREADS": "3"}) == (7, 3)
    # pdflash up (Stack) runs the three on one machine; compose.yaml sets it for the verifier container too.
    assert "--colocated" in Stack(StackSpec())._cmd("verifier")
    assert "--colocated" not in Stack(StackSpec())._cmd("drafter")


def test_verify_forwards_run_on_the_event_loop_when_they_are_one_cpu_thread():
    def inline(argv, device, threads):
        return from_sources(VerifierConfig, parse(VerifierConfig, argv), env={}).verify_inline(device, threads)

    assert inline([], "cpu", 1)  # auto: one CPU thread, no OpenMP team to keep on the torch thread
    assert not inline([], "cpu", 2)
    assert not inline([], "cuda", 1)  # the torch thread owns the device's streams
    assert inline(["--inline-verify", "on"], "cpu", 4)
    assert not inline(["--inline-verify", "off"], "cpu", 1)
    with pytest.raises(ConfigError, match="--inline-verify"):
        from_sources(VerifierConfig, parse(VerifierConfig, ["--inline-verify", "sometimes"]), env={})


def test_inline_runs_on_the_loop_thread_and_one_call_at_a_time():
    import asyncio
    import threading

    from verifier_svc.servicer import VerifierServicer

    async def main():
        s = VerifierServicer()
        seen = []

        def fn(tag):
            seen.append((tag, threading.get_ident(), s._device.locked()))
            return tag

        loop_thread = threading.get_ident()
        assert (await s._run(fn, "inline", inline=True))[0] == "inline"
        assert (await s._run(fn, "worker"))[0] == "worker"
        assert seen[0] == ("inline", loop_thread, True)  # on this thread, holding the device
        assert seen[1][1] != loop_thread and seen[1][2]  # on the torch thread, holding the device

    asyncio.run(main())


def test_cpus_option_parses_taskset_lists_and_refuses_garbage():
    from pdflash.config import parse_cpus

    assert parse_cpus("3") == {3}
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    for bad in ("a", "2-1", "-1", "1,,2"):
        with pytest.raises(ConfigError, match="--cpus"):
            parse_cpus(bad)
    with pytest.raises(ConfigError, match="--cpus"):
        from_sources(SchedulerConfig, parse(SchedulerConfig, ["--cpus", "x"]), env={})


def test_a_service_runs_on_the_cores_it_is_given_and_refuses_cores_it_cannot_use():
    import os

    bad = subprocess.run([sys.executable, "-m", "pdflash.cli", "serve-scheduler", "--port", "0", "--metrics-port", "-1",
                          "--cpus", "4095"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cpus '4095'" in bad.stderr
    core = max(os.sched_getaffinity(0))
    p = subprocess.Popen([sys.executable, "-m", "pdflash.cli", "serve-scheduler", "--port", "0", "--metrics-port", "-1",
                          "--cpus", str(core)], stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:  # the effective configuration is logged after the affinity is set
            if "effective configuration" in line:
                break
        assert os.sched_getaffinity(p.pid) == {core}
    finally:
        p.terminate()
        p.wait(10)


def test_pdflash_up_puts_the_drafter_and_scheduler_on_one_core_and_leaves_the_verifier_free(monkeypatch):
    import os

    from pdflash import torch_thread
    from pdflash.stack import Stack, StackSpec

    monkeypatch.setattr(torch_thread, "usable_cores", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    s = Stack(StackSpec())
    for name in ("drafter", "scheduler"):
        cmd = s._cmd(name)
        assert cmd[cmd.index("--cpus") + 1] == "3"
    assert "--cpus" not in s._cmd("verifier")
    assert "--cpus" not in Stack(StackSpec(pin=False))._cmd("drafter")
    monkeypatch.setattr(torch_thread, "usable_cores", lambda: 1)
    assert "--cpus" not in Stack(StackSpec())._cmd("drafter")  # one core: nothing to share out

    from pdflash.cli import _spec, build_parser

    assert _spec(build_parser().parse_args(["up"])).pin
    assert not _spec(build_parser().parse_args(["up", "--no-pin"])).pin


def test_pdflash_up_passes_the_verifier_device_and_kernel_options():
    from pdflash.cli import _spec, build_parser
    from pdflash.stack import Stack

    args = build_parser().parse_args(["up", "--device", "cuda:1", "--kernels", "off", "--dtype", "float16"])
    spec = _spec(args)
    assert spec.verifier_args == ["--device", "cuda:1", "--dtype", "float16", "--kernels", "off"]
    cmd = Stack(spec)._cmd("verifier")
    assert cmd[cmd.index("--device") + 1] == "cuda:1" and cmd[cmd.index("--kernels") + 1] == "off"
    assert _spec(build_parser().parse_args(["up"])).verifier_args == []  # defaults: the verifier decides
    kv = Stack(_spec(build_parser().parse_args(["up", "--kv-cache-gb", "2.5"])))._cmd("verifier")
    assert kv[kv.index("--kv-cache-gb") + 1] == "2.5"
    assert _spec(build_parser().parse_args(["up"])).metrics_ports == (9101, 9102, 9103)
    moved = Stack(_spec(build_parser().parse_args(["up", "--metrics-port", "9201"])))
    assert moved.spec.metrics_ports == (9201, 9202, 9203)
    assert [c[c.index("--metrics-port") + 1] for c in map(moved._cmd, ("drafter", "scheduler", "verifier"))] == ["9201", "9202", "9203"]
    assert _spec(build_parser().parse_args(["up", "--metrics-port", "-1"])).metrics_ports == (-1, -1, -1)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["up", "--experts", "fp8"])
    assert e.value.code == 2


def test_pdflash_up_refuses_a_bad_expert_cache_before_anything_starts(capsys):
    from pdflash.cli import main

    for argv, words in ((["--expert-cache-gb", "-1"], "must be a number of GiB >= 0"), (["--expert-cache-gb", "nan"], "got nan"),
                        (["--expert-cache-gb", "0.5"], "add --experts mxfp4"),
                        (["--kv-cache-gb", "-2"], "--kv-cache-gb: must be a number of GiB >= 0"),
                        (["--kv-cache-gb", "inf"], "got inf"),
                        (["--metrics-port", "65534"], "--metrics-port: must be in [1, 65533] (-1 = no metrics), got 65534")):
        assert main(["up", *argv]) == 2
        assert words in capsys.readouterr().err
