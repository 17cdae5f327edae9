"""Testing clients of pdflash: a stub server of the public API, and a pytest plugin.

    from pdflash.testing import StubServer
    with StubServer(text="hello world", delay_ms=5) as stub:   # options: `pdflash stub --help`
        print(stub.client.generate("hi").text)

The plugin (registered as `pdflash.testing` through the `pytest11` entry point, so installing pdflash is
enough) gives two fixtures, each yielding an object with `.address` (host:port) and `.client` (a ready
`pdflash.client.Client`):

- `pdflash_stub`: a stub on a free port, for each test; options by marker,
  `@pytest.mark.pdflash_stub(text="hi", fault="UNAVAILABLE")`, by indirect parametrization
  (`@pytest.mark.parametrize("pdflash_stub", [{"fault": "UNAVAILABLE"}], indirect=True)`), or later in the
  test with `pdflash_stub.configure(...)`.
  `pdflash_stub.received` lists what the client sent.
- `pdflash_stack`: the real three-process stack on free ports (CPU) with a tiny random-weight checkpoint
  made on the spot, shared by the session; `--pdflash-model DIR` serves your own checkpoint instead. It
  needs the serving dependencies (`pdflash[serve]`: torch, transformers) and skips without them.

This module is imported by every pytest session of an environment that has pdflash: it imports nothing
beyond pytest until a fixture is used. Outside pytest, StubServer imports without it.
"""

from __future__ import annotations

import sys

__all__ = ["StubServer", "StubConfig", "Script", "Received", "StackHandle", "start_stack"]

# The plugin's hooks and fixtures, when pytest is what imports this (a program using StubServer neither
# needs pytest nor pays for importing it).
if "pytest" in sys.modules:
    from pdflash.testing.plugin import (  # noqa: F401
        StackHandle, pdflash_stack, pdflash_stub, pytest_addoption, pytest_configure, start_stack)


def __getattr__(name: str):
    if name in ("StubServer", "Received"):
        from pdflash.testing import stub

        return getattr(stub, name)
    if name in ("StubConfig", "Script"):
        from pdflash.testing import config

        return getattr(config, name)
    if name in ("StackHandle", "start_stack"):
        from pdflash.testing import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
