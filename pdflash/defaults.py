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
