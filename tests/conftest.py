"""Shared fixtures: tiny checkpoints made on the spot, and real three-process stacks on free ports."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

# Without CUDA, Triton kernels (kernels/) run under Triton's CPU interpreter; set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdflash.stack import Stack, StackSpec, free_ports
from pdflash.tiny import make_tiny_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The processes tests start (stacks, `pdflash up`, the CLI) import this checkout's code, whatever is
# installed and wherever they run.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and pathlib.Path(p).resolve() != ROOT]])

# The plugin client developers get (fixtures pdflash_stub, pdflash_stack). An installed pdflash registers it
# under this same name through its pytest11 entry point; named here too, the suite also runs from a checkout
# whose installed metadata predates it (pytest loads a plugin once by name).
pytest_plugins = ["pdflash.testing", "checkout_guard"]  # checkout_guard: the run must leave `git status --porcelain` as it found it


class TinyModels:
    """Lazily made tiny random checkpoints (target + a random DFlash drafter), once per session."""

    def __init__(self, root: pathlib.Path):
        self.root = root

    def target(self, arch: str) -> pathlib.Path:
        d = self.root / f"target-{arch}"
        if not (d / "config.json").exists():
            make_tiny_checkpoint(d, arch)
        return d

    def drafter(self, arch: str) -> pathlib.Path:
        from drafter_svc.drafters.dflash import make_tiny_dflash

        d = self.root / f"drafter-{arch}"
        if not (d / "config.json").exists():
            make_tiny_dflash(self.target(arch), d, num_layers=1, block_size=8)
        return d


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


def start_stack(model: pathlib.Path | str, drafter: pathlib.Path | str | None, log_dir: pathlib.Path, **kw) -> Stack:
    ports = free_ports(6)
    spec = StackSpec(
        model=str(model),
        drafter=str(drafter) if drafter else "",
        no_dflash=drafter is None,
        drafter_port=ports[0],
        scheduler_port=ports[1],
        verifier_port=ports[2],
        metrics_ports=(ports[3], ports[4], ports[5]),
        log_dir=str(log_dir),
        **kw,
    )
    stack = Stack(spec).start()
    try:
        stack.wait_ready(timeout=180)
    except Exception:
        stack.stop()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("*.log")))
        raise RuntimeError(f"stack did not start:\n{logs}")
    return stack


@pytest.fixture(scope="session")
def stack(tiny, tmp_path_factory):
    """The stack on a tiny qwen3_moe target with a (random) DFlash drafter: all drafter kinds available."""
    s = start_stack(tiny.target("qwen3_moe"), tiny.drafter("qwen3_moe"), tmp_path_factory.mktemp("stack-logs"))
    yield s
    s.stop()
