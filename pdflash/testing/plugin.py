"""The pytest plugin's hooks and fixtures (pdflash.testing re-exports them: pytest registers that module)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("pdflash", "pdflash.testing (fixtures pdflash_stub, pdflash_stack)")
    group.addoption("--pdflash-model", default="", metavar="DIR",
                    help="pdflash_stack serves this checkpoint (and --pdflash-drafter's DFlash drafter) instead of a "
                         "tiny random one")
    group.addoption("--pdflash-drafter", default="", metavar="DIR", help="DFlash drafter for --pdflash-model")
    group.addoption("--pdflash-device", default="cpu", metavar="DEVICE",
                    help="where pdflash_stack's verifier and DFlash drafter run: cpu (default, in float32, on any host), "
                         "auto (cuda when available, in bfloat16), cuda, cuda:N")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "pdflash_stub(**options): options of the pdflash_stub fixture's stub "
                                       "(the flags of `pdflash stub`, as keyword arguments)")


@pytest.fixture
def pdflash_stub(request):
    """A stub of the public API on a free port (pdflash.testing.StubServer), for this test."""
    from pdflash.testing.stub import StubServer

    marker = request.node.get_closest_marker("pdflash_stub")
    options = dict(marker.kwargs) if marker is not None else {}
    options.update(getattr(request, "param", None) or {})  # @pytest.mark.parametrize("pdflash_stub", [{...}], indirect=True)
    options.setdefault("port", 0)
    with StubServer(**options) as stub:
        yield stub


@dataclasses.dataclass
class StackHandle:
    """A running stack: `address` of its public API, a ready `client`, and the `stack` (pdflash.stack.Stack)."""

    address: str
    client: object
    stack: object


def start_stack(root: pathlib.Path, model: str = "", drafter: str = "", timeout: float = 300.0,
                device: str = "cpu") -> StackHandle:
    """The three services on free loopback ports, on `model` or else a tiny random qwen3_moe made under root
    (with a tiny DFlash drafter, so every drafter kind is served, as by `pdflash up`). Logs in root/logs.
    device: the verifier's and the DFlash drafter's `--device`; on the CPU (the default, on any host, also one with a
    GPU) they serve float32, elsewhere the services choose the dtype (`auto`: bfloat16 on CUDA)."""
    from pdflash.client import Client
    from pdflash.stack import Stack, StackSpec, free_ports

    if not model:
        from drafter_svc.drafters.dflash import make_tiny_dflash
        from pdflash.tiny import make_tiny_checkpoint

        model = str(make_tiny_checkpoint(root / "target"))
        drafter = str(make_tiny_dflash(model, root / "drafter", num_layers=1, block_size=8))
    ports = free_ports(3)
    placement = ["--device", device] + (["--dtype", "float32"] if device == "cpu" else [])
    spec = StackSpec(model=model, drafter=drafter, no_dflash=not drafter, drafter_port=ports[0], scheduler_port=ports[1],
                     verifier_port=ports[2], metrics_ports=(-1, -1, -1), log_dir=str(root / "logs"), pin=False,
                     verifier_args=list(placement), drafter_args=list(placement))
    stack = Stack(spec).start()
    try:
        stack.wait_ready(timeout)
    except Exception as e:
        stack.stop()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "logs").glob("*.log")))
        raise RuntimeError(f"pdflash stack did not start: {e}\n{logs}") from None
    return StackHandle(stack.drafter, Client(stack.drafter), stack)


@pytest.fixture(scope="session")
def pdflash_stack(request, tmp_path_factory):
    """The real stack (scheduler, verifier, drafter processes) on free ports, shared by the session; on the CPU in
    float32 unless `--pdflash-device` says otherwise (a GPU host too: `--device auto` would pick its GPU)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"pdflash_stack needs pdflash's serving dependencies ({e.name} is missing): "
                    "pip install 'pdflash[serve]' (with torch first: see pdflash's README)")
    handle = start_stack(tmp_path_factory.mktemp("pdflash-stack"), request.config.getoption("pdflash_model"),
                         request.config.getoption("pdflash_drafter"), device=request.config.getoption("pdflash_device"))
    try:
        yield handle
    finally:
        handle.client.close()
        handle.stack.stop()
