"""How sizes are printed: one rule for every command (binary units, one decimal)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float | None) -> str:
    """``n`` bytes as ``"517 B"``, ``"18.6 MiB"``, ``"1.2 TiB"``; ``"-"`` for ``None``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
