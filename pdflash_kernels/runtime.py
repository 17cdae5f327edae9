"""Where the kernels run: Triton when it is importable (compiled on CUDA, or numpy under TRITON_INTERPRET=1
for CPU tests of the kernels' logic), the torch references otherwise."""

from __future__ import annotations

import functools
import os

import torch

try:  # triton is optional: CPU installs serve through the torch references
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def interpreting() -> bool:
    """Triton's CPU interpreter (bf16 dots are computed in float32 there: its bf16 dot is unreliable)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def env_flag(name: str, default: bool = False) -> bool:
    """An on/off option from the environment: "1" on, "0" off, unset `default`; anything else stops the import with a
    message naming the variable (a typo must not silently leave a kernel option off)."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def triton_usable(device: torch.device | str) -> bool:
    dev = torch.device(device)
    if triton is None:
        return False
    return dev.type == "cuda" or (dev.type == "cpu" and interpreting())


# Programmatic dependent launch (CUDA only): the forward's kernels are launched with launch_pdl and each program starts
# with `pdl_begin`: it waits until the previous kernel has finished and its writes are visible (griddepcontrol.wait,
# unconditionally, in every program: so a kernel never finishes before the one before it, and a kernel that is not
# launched this way waits for everything before it as usual) and lets the next kernel's programs launch (before or
# after that wait: PDL_TRIGGER below). Launch
# latency hides under the previous kernel's tail; the arithmetic is untouched. On by default where every CUDA device is
# sm_90 or newer (griddepcontrol is Hopper's; the H200 measured a qwen3-8l block-1 forward 0.864 -> 0.764 ms, tokens
# unchanged: benchmarks/results/gpu_runs_h200.md, stop 24); PDFLASH_PDL=0 turns it off, =1 forces it. Deciding the
# default reads the devices' compute capability, which initializes CUDA in the importing process on a GPU host (a forked
# child could then not use CUDA); setting PDFLASH_PDL skips that query.
def _pdl_default() -> bool:
    if "PDFLASH_PDL" in os.environ:
        return env_flag("PDFLASH_PDL")
    if interpreting() or not torch.cuda.is_available():
        return False
    return all(torch.cuda.get_device_capability(i) >= (9, 0) for i in range(torch.cuda.device_count()))


PDL = _pdl_default() and not interpreting()

# Where a program lets the next kernel launch (PDFLASH_PDL_TRIGGER): "after-wait" (the default) triggers once this
# kernel's own wait is over, so at most the next kernel is launched ahead; "start" triggers before the wait, so the next
# kernel's programs may launch, take their SM slots and wait while the one before this kernel still runs, and a run of
# small kernels that fit beside each other launches many kernels ahead, each holding its shared memory. On the H200
# "start" made every gptoss-24l forward 20% slower once the linear's 16-row tiles fit two programs an SM (block 1: 3.91
# vs 3.10 ms after-wait), and qwen3-8l's block-1 forward measured 0.915 (start) vs 0.767 ms (after-wait)
# (benchmarks/results/gpu_runs_h200.md, stop 25). The order of the arithmetic is the same either way (the tokens too:
# tests/test_pdl_gpu.py).
PDL_TRIGGER = os.environ.get("PDFLASH_PDL_TRIGGER", "after-wait")
if PDL_TRIGGER not in ("start", "after-wait"):
    raise ValueError(f"PDFLASH_PDL_TRIGGER must be 'start' or 'after-wait', got {PDL_TRIGGER!r}")


def pdl_launch() -> dict:
    """The launch option of a kernel that starts with `pdl_begin` ({} where PDL is off)."""
    return {"launch_pdl": True} if PDL else {}


@functools.lru_cache(maxsize=None)
def sm_count(device: int | None = None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).multi_processor_count
    return 132  # an H200's count: CPU/interpreter runs pick the same tiles the GPU would


if triton is not None:
    from triton.language.extra import cuda as _cuda

    _PDL = tl.constexpr(PDL)
    _PDL_AFTER_WAIT = tl.constexpr(PDL_TRIGGER == "after-wait")

    @triton.jit
    def pdl_begin():
        """A forward kernel's first statement (nothing where PDL is off): see PDL above."""
        if _PDL:
            if _PDL_AFTER_WAIT:
                _cuda.gdc_wait()
                _cuda.gdc_launch_dependents()
            else:
                _cuda.gdc_launch_dependents()
                _cuda.gdc_wait()

    @triton.jit
    def to_bf16(x, EMULATE: tl.constexpr):
        """fp32 -> bf16, round to nearest even. EMULATE: do the rounding in integer ops first (Triton's CPU
        interpreter truncates on this cast; the GPU rounds)."""
        if EMULATE:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
        return x.to(tl.bfloat16)

    @triton.jit
    def to_out(x, out_ptr, EMULATE: tl.constexpr):
        """Cast to the element type of out_ptr, rounding like the GPU does."""
        if out_ptr.dtype.element_ty == tl.bfloat16:
            return to_bf16(x, EMULATE)
        return x.to(out_ptr.dtype.element_ty)
