"""The directory ``speccache regenerate`` writes, as data: its file names, its progress record, its rows.

A regenerated directory holds ``regenerate.json`` (the progress record: settings, hashes, and each part
written so far with its row count and xxh3-128 checksum; ``complete`` once every part is) and the parts
``part-00000.jsonl``, ``part-00001.jsonl``... (JSON lines, the rows in input order). Precompute reads a
complete directory as one data set, part after part; an unfinished one is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from speccache.errors import CacheFormatError, DataError
from speccache.format.names import check_no_foreign_files

__all__ = [
    "PART_RE",
    "REGENERATE_FORMAT",
    "REGENERATE_NAME",
    "check_regenerate_dir",
    "is_regenerated",
    "part_name",
    "read_progress",
    "regenerated_rows",
]

REGENERATE_NAME = "regenerate.json"
REGENERATE_FORMAT = "speccache-regenerate"
PART_RE = re.compile(r"^part-([0-9]{5})\.jsonl\Z")


def part_name(index: int) -> str:
    """The file name of part ``index``."""
    return f"part-{index:05d}.jsonl"


def is_regenerated(path: str) -> bool:
    """Whether ``path`` is a directory ``speccache regenerate`` writes (it holds ``regenerate.json``)."""
    return os.path.isfile(os.path.join(path, REGENERATE_NAME))


def read_progress(directory: str) -> dict[str, Any]:
    """The progress record of a regenerated directory.

    Raises:
        CacheFormatError: ``regenerate.json`` is not a regenerate record (damaged, or another tool's file).
    """
    path = os.path.join(directory, REGENERATE_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise CacheFormatError(
            f"{path}: not a readable regenerate record ({e}); regenerate into a new directory"
        ) from e
    if (
        not isinstance(record, dict)
        or record.get("format") != REGENERATE_FORMAT
        or not isinstance(record.get("parts"), list)
    ):
        raise CacheFormatError(
            f"{path}: not a speccache regenerate record (no format {REGENERATE_FORMAT!r} with a parts list); "
            "regenerate into a new directory"
        )
    return record


def check_regenerate_dir(directory: str) -> None:
    """Refuse an output directory holding files ``regenerate`` does not write (so none of them is touched).

    Raises:
        CacheExistsError: names the directory, the files and the fix.
    """
    check_no_foreign_files(directory, (REGENERATE_NAME,), PART_RE, "speccache regenerate")


def regenerated_rows(directory: str) -> Iterator[tuple[int, str, bytes]]:
    """``(0-based row number, where, raw line)`` of a complete regenerated directory, part after part.

    Parts hold one row per line (their writer puts no blank line in them), so the row number counts lines.

    Raises:
        DataError: the run is unfinished (its record is not ``complete``), or a part it lists is missing.
    """
    record = read_progress(directory)
    if record.get("complete") is not True:
        raise DataError(
            f"--data {directory}: an unfinished speccache regenerate run ({len(record['parts'])} parts written); "
            "finish it with the same speccache regenerate command and --resume"
        )
    row = 0
    for part in record["parts"]:
        path = os.path.join(directory, str(part.get("name")))
        try:
            f = open(path, "rb")
        except OSError as e:
            raise DataError(
                f"--data {directory}: {part.get('name')}, a part of the regenerate record, cannot be read ({e}); "
                "restore it, or regenerate into a new directory"
            ) from e
        with f:
            for line_no, raw in enumerate(f, start=1):
                yield row, f"{path}:{line_no}", raw
                row += 1
