"""Where the default model comes from when none is given.

The embedded demo pair ships in pdflash/assets/demo (target + DFlash drafter). If it is absent (a
checkout without the assets), a tiny random-weight qwen3_moe checkpoint is made once under
~/.cache/pdflash and used instead: the serving path is real, the text is not.
"""

from __future__ import annotations

import os
import pathlib

ASSETS = pathlib.Path(__file__).resolve().parent / "assets" / "demo"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PDFLASH_CACHE", pathlib.Path.home() / ".cache" / "pdflash"))


def default_target_dir() -> pathlib.Path:
    if (ASSETS / "target" / "config.json").exists():
        return ASSETS / "target"
    out = cache_dir() / "tiny-qwen3_moe"
    if not (out / "config.json").exists():
        from pdflash.tiny import make_tiny_checkpoint

        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        make_tiny_checkpoint(tmp, "qwen3_moe")
        tmp.rename(out)
    return out


def default_drafter_dir() -> pathlib.Path | None:
    d = ASSETS / "drafter"
    return d if (d / "config.json").exists() else None


def is_embedded_target(model: str | os.PathLike) -> bool:
    """Is `model` (empty = the default) the embedded demo target?"""
    embedded = ASSETS / "target"
    if not (embedded / "config.json").exists():
        return False
    if not model:
        return True
    try:
        return pathlib.Path(model).resolve() == embedded.resolve()
    except OSError:
        return False


def default_drafter_for(model: str | os.PathLike) -> tuple[pathlib.Path | None, str]:
    """The DFlash drafter to serve with target `model` when none is named, and why there is none.

    The embedded drafter belongs to the embedded target: it reads that model's hidden states and shares its
    vocabulary. With any other target there is no default DFlash drafter; the reason says so (empty when
    there is nothing to explain).
    """
    drafter = default_drafter_dir()
    if drafter is None:
        return None, ""
    if is_embedded_target(model):
        return drafter, ""
    return None, (f"serving n-gram drafting: the embedded DFlash drafter was made for the embedded demo target, "
                  f"not for {model}; pass --drafter DIR for a DFlash drafter made for this model")
