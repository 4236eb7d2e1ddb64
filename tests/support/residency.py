"""What of a file this process has mapped in memory (``/proc/self/smaps``), for the read-path tests."""

from __future__ import annotations

import os

HAS_SMAPS = os.path.exists("/proc/self/smaps")


def mapped_resident_bytes(path: str) -> int:
    """This process's resident bytes of its mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: range, perms, ..., path
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total
