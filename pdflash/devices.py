"""Torch device and dtype options (`--device`, `--dtype`), checked before anything loads, in one line a user can act on.

torch is imported only for a CUDA device: `auto` and `cpu` are checked without it.
"""

from __future__ import annotations

from pdflash.config import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_device(value: str, flag: str = "--device") -> None:
    """ConfigError when `value` is not auto, cpu, cuda or cuda:N, or names a CUDA device this host lacks."""
    kind, sep, index = value.strip().lower().partition(":")
    if kind in ("auto", "cpu") and not sep:
        return
    if kind != "cuda" or (sep and not index.isdigit()):
        raise ConfigError(f"{flag} {value!r}: choose auto, cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else " (this torch is a CPU-only build)"
        raise ConfigError(f"{flag} {value}: CUDA is not available on this host{build}; use {flag} cpu (or auto)")
    count = torch.cuda.device_count()
    if sep and int(index) >= count:
        raise ConfigError(f"{flag} {value}: this host has {count} CUDA device{'s' if count != 1 else ''} "
                          f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")


def check_dtype(value: str, flag: str = "--dtype") -> None:
    if value not in DTYPES:
        raise ConfigError(f"{flag} {value!r}: choose {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")


def resolve_device(value: str) -> str:
    """auto -> cuda when torch sees a CUDA device, else cpu; anything else as given (lower case)."""
    value = value.strip().lower()
    if value != "auto":
        return value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(value: str, device: str) -> str:
    """auto -> bfloat16 on CUDA, float32 on the CPU; anything else as given."""
    if value != "auto":
        return value
    return "bfloat16" if device.startswith("cuda") else "float32"
