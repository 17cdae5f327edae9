"""Shared fixtures: tiny checkpoints made on the spot, and real three-process stacks on free ports."""

from __future__ import annotations

import os
import pathlib


def _worker_cores() -> None:
    """Under pytest-xdist (`-n N`): each worker process (and every stack it starts) runs on its own slice of this
    host's cores, set before torch reads them. On the GPU machine (16 cores, `-n 8`) a worker has 2 cores, like CI's
    machine; without it, eight workers' stacks would each take every core for their forwards and pin their drafters
    and schedulers to the same last core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()) or not hasattr(os, "sched_setaffinity"):
        return
    if os.environ.get("PYTEST_PDFLASH_WORKER_CORES", "").startswith(worker + ":"):
        return  # sliced already (this module imported again as tests.conftest, or a process this worker started)
    cores = sorted(os.sched_getaffinity(0))
    index, count = int(worker[2:]), int(count)
    per = max(1, len(cores) // count)
    start = (index * per) % len(cores)
    mine = cores[start:start + per]
    os.sched_setaffinity(0, mine)
    os.environ["PYTEST_PDFLASH_WORKER_CORES"] = f"{worker}:{','.join(map(str, mine))}"


_worker_cores()

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_PDFLASH_WORKER_CORES"):  # an xdist worker: torch's threads as its slice (if a plugin imported torch first)
    torch.set_num_threads(len(os.sched_getaffinity(0)))

# Without CUDA, Triton kernels (pdflash_kernels/) run under Triton's CPU interpreter; set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdflash.stack import Stack, StackSpec, free_ports  # noqa: E402
from pdflash.tiny import make_tiny_checkpoint  # noqa: E402

# Where the suite's stacks and references run unless a test names another device: the CPU, in float32, on every host.
# The services' default (`--device auto`, `--dtype auto`) would serve bf16 on a GPU host while a reference computed with
# transformers on the CPU is fp32; so `start_stack` passes both to the verifier and the drafter, and every in-process
# reference names them. Tests that cover the GPU say so in their ids ("cuda-bfloat16") and take their reference there
# (tests/test_e2e_identity.py, tests/test_*_gpu.py).
DEVICE, DTYPE = "cpu", "float32"

from pdflash_kernels import runtime as _kernels_runtime  # noqa: E402

# The kernels' logic on a CPU runs under Triton's interpreter: a platform condition (triton installed), not a way around
# a failing test. (On a GPU host the GPU test files compile the same kernels for real.)
needs_triton = pytest.mark.skipif(not _kernels_runtime.triton_usable("cpu"), reason="needs triton (interpreted on CPU)")

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


def start_stack(model: pathlib.Path | str, drafter: pathlib.Path | str | None, log_dir: pathlib.Path,
                device: str = DEVICE, dtype: str = DTYPE, **kw) -> Stack:
    """The three services on free ports, the verifier and the DFlash drafter on `device` in `dtype` (pinned: never
    `auto`). On CUDA the verifier's paged KV pool is 1 GiB (its default, a quarter of the free memory, is too much
    for several test processes sharing one GPU)."""
    if device == "auto" or dtype == "auto":
        raise ValueError("start_stack: name the device and dtype (the test's reference runs on one of them)")
    ports = free_ports(6)
    placement = ["--device", device, "--dtype", dtype]
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
    spec.verifier_args = [*placement, *(["--kv-cache-gb", "1"] if device.startswith("cuda") else []), *spec.verifier_args]
    spec.drafter_args = [*placement, *spec.drafter_args]
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
    """The stack on a tiny qwen3_moe target with a (random) DFlash drafter: all drafter kinds available. CPU, float32."""
    s = start_stack(tiny.target("qwen3_moe"), tiny.drafter("qwen3_moe"), tmp_path_factory.mktemp("stack-logs"))
    yield s
    s.stop()


# On a CUDA host the GPU modules go first, the longest first (measured on the H200: tests/test_gpu_verifier.py alone
# runs 5+ minutes on its worker). xdist hands out whole modules in collection order (below), so a long module collected
# late outlasts every other worker: stop 23's and stop 24's suite runs hit their limit with it still running.
_GPU_FIRST = ("tests/test_gpu_verifier.py", "tests/test_offload_gpu.py", "tests/test_kernels_gpu.py", "tests/test_pdl_gpu.py",
              "tests/test_drafter_gpu.py", "tests/test_e2e_identity.py")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return
    rank = {path: i for i, path in enumerate(_GPU_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # (stable: the rest keep their order)


# Modules whose module-scoped model is parametrized by architecture (a real-shape checkpoint and its CUDA graphs per
# architecture): each architecture's tests are a work unit of their own, so the architectures run on different workers
# (stop 45: tests/test_gpu_verifier.py's three on one worker outlasted a 290 s call with its mixtral rows unstarted).
_ARCH_SCOPED = ("tests/test_gpu_verifier.py", "tests/test_offload_gpu.py")
_ARCHS = ("qwen3_moe", "gpt_oss", "mixtral")


def xdist_scope(nodeid: str) -> str:
    """The work unit of a test under `pytest -n N`: its module (xdist's loadscope), or in an `_ARCH_SCOPED` module its
    module and architecture (the parameter id naming one of `_ARCHS`)."""
    module = nodeid.split("::", 1)[0]
    if module in _ARCH_SCOPED and nodeid.endswith("]") and "[" in nodeid:
        ids = nodeid[nodeid.index("[") + 1:-1].split("-")
        arch = next((a for a in _ARCHS if a in ids), None)
        if arch is not None:
            return f"{module}[{arch}]"
    return nodeid.rsplit("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` hands out whole modules (xdist's loadscope), not single tests: a module's tests share its
    module-scoped stacks and models, which `--dist load` would start again in every worker that gets one of its tests
    (on the GPU machine, real-shape models and their CUDA graphs); an architecture-parametrized module's tests by
    architecture (`xdist_scope`). An explicit `--dist` is obeyed."""
    if any(a == "--dist" or a.startswith("--dist=") or a == "-d" for a in config.invocation_params.args):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return _Scopes(config, log)
