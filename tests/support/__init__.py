"""Helpers the test modules share: ``from support import cachecmp`` (tests/ is on ``sys.path`` beside its conftest).

``cachecmp`` compares caches, ``ranks`` launches ``speccache`` over torchrun ranks, ``crashlib`` kills producers
through a fork server, ``follow_trainer`` is the trainer a fork server runs, ``residency`` reads what this process
has mapped in memory, ``faults`` makes the shard writer fail after one shard; ``load_tool`` imports a script of
``tools/``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"

SOAK = os.environ.get("SPECCACHE_SOAK", "") not in ("", "0")
"""``SPECCACHE_SOAK=1`` (``make soak``): ``soak`` tests run instead of skipping, and suites that scale their work by
it (kill points, examples, trials) run more of it."""


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py``: the repository's scripts are not a package (they do not ship in the wheel)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the module runs
    spec.loader.exec_module(module)
    return module
