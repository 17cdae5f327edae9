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
    assert counts(["--colocated"]) == (7, 8)  # verify forwards leave a core; prefill uses all
    assert counts(["--colocated"], cores=1) == (1, 1)
    assert counts(["--colocated", "--torch-threads", "2"]) == (2, 8)  # explicit settings win
    assert counts([], env={"PDFLASH_COLOCATED": "true", "PDFLASH_PREFILL_THREADS": "3"}) == (7, 3)
    # pdflash up (Stack) runs the three on one machine; compose.yaml sets it for the verifier container too.
    assert "--colocated" in Stack(StackSpec())._cmd("verifier")
    assert "--colocated" not in Stack(StackSpec())._cmd("drafter")
