"""The ``precompute`` and ``estimate`` subcommands (filled in by the method modules)."""

from __future__ import annotations

from typing import Any


def register_commands(sub: Any) -> None:
    """Add the method-driven subcommands to the CLI."""
    return None
