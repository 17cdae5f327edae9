"""Drafting cores (no grpc): one factory per kind per process, one `Drafter` per request.

`make_factory(kind, target_dir, drafter_dir, **opts)` builds the factory for a kind:
  none    proposes nothing (block of 1)              opts: -
  ngram   prompt lookup with n-gram backoff          opts: min_n, max_n, max_block_size, weak_drafts
  dflash  DFlash block drafter                       opts: dtype, device, cuda_graphs, graph_capacity
  hybrid  n-gram on a long match, DFlash otherwise   opts: the dflash ones, min_match, max_n
"""

from __future__ import annotations

import enum
import pathlib

from drafter_svc.drafters.base import Drafter, DrafterFactory
from drafter_svc.drafters.dflash import DFlashFactory
from drafter_svc.drafters.hybrid import HybridFactory
from drafter_svc.drafters.ngram import NgramFactory
from drafter_svc.drafters.none import NoneFactory

KINDS = ("none", "ngram", "dflash", "hybrid")

_OPTIONS = {
    "none": set(),
    "ngram": {"min_n", "max_n", "max_block_size", "weak_drafts"},
    "dflash": {"dtype", "device", "cuda_graphs", "graph_capacity"},
    "hybrid": {"dtype", "device", "cuda_graphs", "graph_capacity", "min_match", "max_n"},
}


def default_kind(drafter_dir: str | pathlib.Path | None) -> str:
    """Hybrid when a DFlash drafter is configured, else n-gram."""
    return "hybrid" if drafter_dir else "ngram"


def make_factory(
    kind: str | enum.Enum,
    target_dir: str | pathlib.Path,
    drafter_dir: str | pathlib.Path | None = None,
    **opts,
) -> DrafterFactory:
    """The factory for `kind` ("none", "ngram", "dflash", "hybrid"; a DrafterKind works too)."""
    name = (kind.name if isinstance(kind, enum.Enum) else str(kind)).strip().lower()
    if name not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; choose one of {', '.join(KINDS)}")
    unknown = sorted(set(opts) - _OPTIONS[name])
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[name])) or "none"
        raise ValueError(f"drafter kind {name!r} takes no option(s) {', '.join(unknown)}; it takes: {allowed}")
    if name == "none":
        return NoneFactory()
    if name == "ngram":
        return NgramFactory(**opts)
    if not drafter_dir:
        raise ValueError(f"drafter kind {name!r} needs a DFlash drafter checkpoint directory (drafter_dir)")
    if not pathlib.Path(drafter_dir).is_dir():
        raise ValueError(f"DFlash drafter directory {drafter_dir} does not exist")
    dflash_opts = {k: v for k, v in opts.items() if k in _OPTIONS["dflash"]}
    dflash = DFlashFactory(target_dir, drafter_dir, **dflash_opts)
    if name == "dflash":
        return dflash
    return HybridFactory(dflash, **{k: v for k, v in opts.items() if k not in _OPTIONS["dflash"]})


__all__ = ["KINDS", "Drafter", "DrafterFactory", "default_kind", "make_factory"]
