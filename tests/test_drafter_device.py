"""Where the DFlash drafter runs: `--device` / `--dtype` of serve-drafter and `pdflash up --drafter-device/--drafter-dtype`,
checked before anything loads (one line, exit 2), and the options reaching the DFlash drafter. CPU only; the same drafter
on CUDA is tests/test_drafter_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pdflash.config import ConfigError, from_sources
from tests.test_config import parse


def _cuda(monkeypatch, available: bool, count: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _drafter_config(argv):
    from drafter_svc.config import DrafterConfig

    return from_sources(DrafterConfig, parse(DrafterConfig, argv), env={})


def test_device_and_dtype_default_to_the_host(monkeypatch):
    _cuda(monkeypatch, False)
    cfg = _drafter_config([])
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    assert (cfg.torch_device(), cfg.torch_dtype()) == ("cpu", "float32")
    _cuda(monkeypatch, True, 1)
    assert (cfg.torch_device(), cfg.torch_dtype()) == ("cuda", "bfloat16")
    cfg = _drafter_config(["--device", "cuda:0", "--dtype", "float16"])
    assert (cfg.torch_device(), cfg.torch_dtype()) == ("cuda:0", "float16")
    assert _drafter_config(["--device", "cpu", "--dtype", "bfloat16"]).torch_dtype() == "bfloat16"


@pytest.mark.parametrize("argv, cuda, words", [
    (["--device", "cuda"], (False, 0), "--device cuda: CUDA is not available on this host"),
    (["--device", "cuda:1"], (False, 0), "use --device cpu (or auto)"),
    (["--device", "cuda:2"], (True, 1), "--device cuda:2: this host has 1 CUDA device (cuda:0)"),
    (["--device", "cuda:4"], (True, 2), "has 2 CUDA devices (cuda:0 .. cuda:1)"),
    (["--device", "gpu"], (False, 0), "--device 'gpu': choose auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], (True, 1), "choose auto, cpu, cuda or cuda:N"),
    (["--dtype", "fp8"], (False, 0), "--dtype 'fp8': choose auto, float32, bfloat16 or float16"),
])
def test_bad_device_or_dtype_is_one_line_naming_the_option(monkeypatch, argv, cuda, words):
    _cuda(monkeypatch, *cuda)
    with pytest.raises(ConfigError) as e:
        _drafter_config(argv)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host has CUDA")
def test_serve_drafter_on_cuda_without_cuda_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "pdflash.cli", "serve-drafter", "--device", "cuda", "--port", "0",
                        "--metrics-port", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("pdflash serve-drafter: configuration error: --device cuda: CUDA is not available on this host")
    assert lines[0].endswith("use --device cpu (or auto)")


@pytest.mark.parametrize("argv, words", [
    (["--drafter-device", "cuda"], "--drafter-device cuda: CUDA is not available on this host"),
    (["--device", "cuda"], "--device cuda: CUDA is not available on this host"),
    (["--device", "cpu", "--drafter-device", "tpu"], "--drafter-device 'tpu': choose auto, cpu, cuda or cuda:N"),
])
def test_pdflash_up_refuses_a_device_this_host_lacks_before_anything_starts(monkeypatch, capsys, argv, words):
    from pdflash.cli import main
    from pdflash.stack import Stack

    _cuda(monkeypatch, False)
    monkeypatch.setattr(Stack, "start", lambda self: pytest.fail("the stack must not start"))
    assert main(["up", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_pdflash_up_refuses_a_cuda_index_beyond_the_devices(monkeypatch, capsys):
    from pdflash.cli import main

    _cuda(monkeypatch, True, 1)
    assert main(["up", "--device", "cuda:0", "--drafter-device", "cuda:1"]) == 2
    assert "--drafter-device cuda:1: this host has 1 CUDA device (cuda:0)" in capsys.readouterr().err


def test_pdflash_up_passes_the_drafter_device_and_dtype():
    from pdflash.cli import _spec, build_parser
    from pdflash.stack import Stack

    def spec(*argv):
        return _spec(build_parser().parse_args(["up", *argv]))

    s = spec("--drafter-device", "cpu")
    assert s.drafter_args == ["--device", "cpu"] and s.verifier_args == []
    cmd = Stack(s)._cmd("drafter")
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert "--device" not in Stack(s)._cmd("verifier")
    # By default the drafter follows the verifier's --device: on a one-GPU host both share it.
    s = spec("--device", "cuda:1", "--drafter-dtype", "float16")
    assert s.drafter_args == ["--device", "cuda:1", "--dtype", "float16"]
    assert s.verifier_args == ["--device", "cuda:1"]
    assert spec("--device", "cuda", "--drafter-device", "cpu").drafter_args == ["--device", "cpu"]
    assert spec().drafter_args == []  # auto: the drafter decides (cuda when it sees one)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["up", "--drafter-dtype", "fp8"])
    assert e.value.code == 2


def test_drafter_cuda_graphs_option_flag_env_and_pdflash_up():
    """On by default; --no-drafter-cuda-graphs or PDFLASH_DRAFTER_CUDA_GRAPHS=0 (not the verifier's PDFLASH_CUDA_GRAPHS)
    turn it off; `pdflash up --no-drafter-graphs` passes the flag to the drafter alone."""
    from drafter_svc.config import DrafterConfig
    from pdflash.cli import _spec, build_parser
    from pdflash.stack import Stack

    assert _drafter_config([]).drafter_cuda_graphs is True
    assert _drafter_config(["--no-drafter-cuda-graphs"]).drafter_cuda_graphs is False
    env = {"PDFLASH_DRAFTER_CUDA_GRAPHS": "0"}
    assert from_sources(DrafterConfig, parse(DrafterConfig, []), env=env).drafter_cuda_graphs is False
    assert from_sources(DrafterConfig, parse(DrafterConfig, []), env={"PDFLASH_CUDA_GRAPHS": "0"}).drafter_cuda_graphs

    s = _spec(build_parser().parse_args(["up", "--no-drafter-graphs", "--drafter-device", "cpu"]))
    assert s.drafter_args == ["--device", "cpu", "--no-drafter-cuda-graphs"]
    assert "--no-drafter-cuda-graphs" in Stack(s)._cmd("drafter")
    assert not any("graphs" in a for a in Stack(s)._cmd("verifier"))
    assert _spec(build_parser().parse_args(["up"])).drafter_args == []
    assert _spec(build_parser().parse_args(["demo", "--no-drafter-graphs"])).drafter_args == ["--no-drafter-cuda-graphs"]


def test_help_names_the_no_form_of_options_that_are_on_by_default(capsys, monkeypatch):
    """docs/gpu.md tells `serve-drafter --no-drafter-cuda-graphs`; --help listed only --drafter-cuda-graphs (on by default, so
    a no-op), hiding the flag that does something. Every option on by default says its --no- form."""
    from pdflash.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping inside a flag's name
    for command, flags in (("serve-drafter", ("--no-drafter-cuda-graphs", "--no-admit-ahead", "--no-verify-stream")),
                           ("serve-verifier", ("--no-cuda-graphs",))):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        for flag in flags:
            assert f"{flag} = off" in text, (command, flag)
    assert _drafter_config(["--no-admit-ahead"]).admit_ahead is False


@pytest.mark.parametrize("argv, graphs", [([], True), (["--no-drafter-cuda-graphs"], False)])
def test_build_factories_passes_the_graphs_option(monkeypatch, tiny, argv, graphs):
    import drafter_svc.server as server
    from drafter_svc.drafters import make_factory

    seen = {}

    def spy(kind, *args, **opts):
        if kind == "dflash":
            seen.update(opts)
        return make_factory(kind, *args, **opts)

    monkeypatch.setattr(server, "make_factory", spy)
    target, drafter = tiny.target("qwen3_moe"), tiny.drafter("qwen3_moe")
    cfg = _drafter_config(["--model", str(target), "--drafter", str(drafter), "--device", "cpu", *argv])
    server.build_factories(cfg, str(target))
    assert seen["cuda_graphs"] is graphs


def test_the_drafter_config_reaches_the_dflash_drafter(tiny):
    from drafter_svc.server import build_factories
    from drafter_svc.servicer import FrontDoor
    from pdflash.types import DrafterKind

    target, drafter = tiny.target("qwen3_moe"), tiny.drafter("qwen3_moe")
    cfg = _drafter_config(["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--dtype", "bfloat16"])
    factories, default, _ = build_factories(cfg, str(target))
    dflash = factories[DrafterKind.DFLASH]
    assert factories[DrafterKind.HYBRID].dflash is dflash
    assert dflash.device == torch.device("cpu") and dflash.dtype == torch.bfloat16
    assert {p.dtype for p in dflash.model.parameters()} == {torch.bfloat16}
    assert dflash.head.embed.dtype == dflash.head.lm_head.dtype == torch.bfloat16
    assert dflash.model.rotary_emb.inv_freq.dtype == torch.float32  # positions keep their precision
    door = FrontDoor(cfg, None, factories, default, None, None, None, str(drafter))
    assert door.dflash_placement() == ("cpu", "bfloat16")
    s = dflash.new_session()
    s.start([3, 4, 5], np.random.default_rng(0).standard_normal((3, dflash.feature_dim)).astype(np.float32))
    drafts = s.propose(7, 5)
    assert len(drafts) == 5 and all(isinstance(t, int) and 0 <= t < dflash.head.vocab_size for t in drafts)
    # n-gram only (no DFlash drafter): the options are accepted and nothing reports a device
    cfg = _drafter_config(["--model", str(target), "--no-dflash", "--device", "cpu"])
    factories, _, _ = build_factories(cfg, str(target))
    assert DrafterKind.DFLASH not in factories
    assert FrontDoor(cfg, None, factories, DrafterKind.NGRAM, None, None, None).dflash_placement() == ("", "")


def test_context_cache_grows_in_place_and_equals_concatenation():
    from drafter_svc.dflash_model import ContextKV

    g = torch.Generator().manual_seed(0)
    cache, ks, vs = ContextKV(2), [], []
    for t in (3, ContextKV.MIN_CAPACITY - 3, 1, 5, ContextKV.MIN_CAPACITY * 2):
        k, v = torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g)
        ks.append(k)
        vs.append(v)
        for layer in range(2):
            cache.append(layer, k, v)
        for layer in range(2):
            got_k, got_v = cache.layer(layer)
            assert torch.equal(got_k, torch.cat(ks, dim=2)) and torch.equal(got_v, torch.cat(vs, dim=2))
    assert ContextKV(1).layer(0) == (None, None)


def test_a_proposals_block_rows_sit_past_the_context_and_never_outlive_it():
    """with_block: the view is context + block (as if concatenated), nothing is committed, and the next rows
    (a commit, or another proposal) overwrite the block's; a block that does not fit grows the buffers first."""
    from drafter_svc.dflash_model import ContextKV

    g = torch.Generator().manual_seed(1)
    cache = ContextKV(1)
    ctx_k, ctx_v = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    cache.append(0, ctx_k, ctx_v)
    for t in (3, 1, ContextKV.MIN_CAPACITY):  # the last one does not fit: the buffers grow, the context comes along
        bk, bv = torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g)
        k, v = cache.with_block(0, bk, bv)
        assert torch.equal(k, torch.cat([ctx_k, bk], 2)) and torch.equal(v, torch.cat([ctx_v, bv], 2))
        assert torch.equal(cache.layer(0)[0], ctx_k) and torch.equal(cache.layer(0)[1], ctx_v)
    more_k, more_v = torch.randn(1, 2, 2, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g)
    cache.append(0, more_k, more_v)
    assert torch.equal(cache.layer(0)[0], torch.cat([ctx_k, more_k], 2))
    assert torch.equal(cache.layer(0)[1], torch.cat([ctx_v, more_v], 2))
    empty = ContextKV(1)  # nothing committed yet: the block attends to itself alone
    assert torch.equal(empty.with_block(0, more_k, more_v)[0], more_k) and empty.layer(0)[0].shape[2] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_rotary_embedding_at_any_offset(dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from drafter_svc.dflash_model import RopeTable

    rotary = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    table = RopeTable(rotary)
    assert table.fixed
    x = torch.zeros(1, 1, 64, dtype=dtype)
    for start, n in [(0, 1), (3, 16), (250, 16), (255, 2), (700, 9), (1, RopeTable.MIN_POSITIONS * 5)]:  # grows twice
        cos, sin = table(x, start, n)
        want_cos, want_sin = rotary(x, torch.arange(start, start + n)[None])
        assert cos.dtype == dtype and cos.shape == (1, 1, n, 32)
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)


def test_model_info_says_where_the_dflash_drafter_runs_and_usage_counts_routed_bytes(stack):
    """The shared stack's drafter runs where conftest pins it (cpu, float32; on a GPU host too); the drafter on CUDA
    (`--device auto` there) is tests/test_drafter_gpu.py."""
    from pdflash.client import Client
    from tests.conftest import DEVICE, DTYPE

    with Client(stack.drafter) as c:
        info = c.model_info()
        assert (info.drafter_device, info.drafter_dtype) == (DEVICE, DTYPE)
        out = c.generate("def f(x):\n", max_tokens=6, drafter="none")
        assert out.usage.routed_expert_bytes > 0  # the verify forwards routed experts, counted by the byte map
