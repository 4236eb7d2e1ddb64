"""How sizes are printed and read: one rule for every command (binary units, one decimal)."""

from __future__ import annotations

import re

from speccache.errors import UsageError

__all__ = ["counted", "human_bytes", "parse_bytes"]

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGTP])(i?)B?)?\s*B?\s*$", re.IGNORECASE)


def parse_bytes(text: str, flag: str) -> int:
    """``"500G"``, ``"1.5TiB"``, ``"64MB"`` or ``"1000000"`` as a byte count.

    A unit letter alone or with ``iB`` is binary (``G``, ``GiB``: 2**30); with ``B`` alone decimal (``GB``: 10**9).

    Raises:
        ValueError: not a positive size (the message names ``flag``).
    """
    match = _SIZE_RE.match(text)
    if match is None or not text.strip():
        raise UsageError(f"{flag} {text!r} is not a size; give bytes, or a number with K, M, G, T or P (e.g. 500G)")
    number, unit, binary = match.groups()
    scale = 1
    if unit:
        power = "KMGTP".index(unit.upper()) + 1
        decimal = not binary and text.strip().upper().endswith(unit.upper() + "B")
        scale = 1000**power if decimal else 1024**power
    value = int(float(number) * scale)
    if value < 1:
        raise UsageError(f"{flag} {text!r} must be at least one byte")
    return value


def human_bytes(n: float | None) -> str:
    """``n`` bytes as ``"517 B"``, ``"18.6 MiB"``, ``"1.2 TiB"``; ``"-"`` for ``None``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the number it takes: ``"1 row"``, ``"0 rows"``, ``"27 samples"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
