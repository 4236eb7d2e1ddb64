"""One benchmark's section of a shared Markdown report (docs/benchmarks.md), replaced in place."""

from __future__ import annotations

import os


def replace_section(path: str, text: str, begin: str, end: str) -> None:
    """Write ``text`` (which starts with ``begin`` and ends with ``end`` and a newline) over the section between
    those markers in ``path``, or append it when the file has none; the rest of the file is kept."""
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) + 1 :]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)
