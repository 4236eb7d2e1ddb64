"""Names and counts of a cache directory: file names, shard numbering, reserved tensor names, limits.

Every rule about what a file in a cache is called, and how many samples shard
``i`` holds, lives here.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Sequence

from speccache.errors import CacheExistsError, CacheFormatError, UsageError

__all__ = [
    "DROPPED_FIELDS_FILE",
    "FORMAT_VERSION",
    "LENGTHS_KEY",
    "LOCK_GUARD_NAME",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "MAX_ELEMENTS",
    "MAX_HEADER_BYTES",
    "MAX_SHARDS",
    "OFFSETS_KEY",
    "RECLAIM_RE",
    "SAMPLE_TURN_KEY",
    "SHARD_RE",
    "SKIPPED_ROWS_FILE",
    "SOURCE_ROW_KEY",
    "STAT_PREFIX",
    "TEMP_RE",
    "TMP_MARK",
    "ceil_div",
    "check_no_foreign_files",
    "check_shard_size",
    "existing_shard_indices",
    "manifest_path",
    "num_shards",
    "reclaim_path",
    "shard_path",
    "shard_samples",
    "validate_contiguous_shards",
]

FORMAT_VERSION = 1
"""Version of the native layout (key schema, offsets, shard table). See docs/format.md."""

MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-([0-9]{6})\.safetensors\Z")
r"""Shard file names: exactly six ASCII digits (``\Z``, not ``$``, so a trailing newline is no match)."""
RECLAIM_RE = re.compile(r"^shard-([0-9]{6})\.reclaimed\Z")
"""Reclaim records: a shard a following trainer finished and deleted (or moved) on purpose (format/reclaim.py)."""
TMP_MARK = ".tmp-"
"""Temporary files are ``<final name>.tmp-<host>-<pid>-<random>``; no reader matches them."""
LOCK_NAME = ".speccache.lock"
"""The writer lock of a cache directory (format/lock.py)."""
LOCK_GUARD_NAME = LOCK_NAME + TMP_MARK + "recover"
"""The short-lived guard a writer taking over a stale lock holds."""
TEMP_RE = re.compile(
    r"^(?:.+\.tmp-.+-[0-9]+-[0-9a-f]{8}"  # temp_path: <final name>.tmp-<host>-<pid>-<8 hex digits>
    r"|(?:shard-[0-9]{6}\.safetensors|manifest\.json)\.tmp"  # the seed layout's writers: <final name>.tmp
    r"|" + re.escape(LOCK_GUARD_NAME) + r")\Z"
)
"""Exactly the names of the temporary files speccache's writers create: only they are ever swept. A user's
``thesis.tmp`` or ``backup.tmp-2024-01-01`` is no match."""
OFFSETS_KEY = "__offsets__"
"""Shard tensor: int64 ``[n + 1]`` row offsets shared by every ragged key."""
LENGTHS_KEY = "__lengths__"
"""In-memory batch entry: int64 ``[n]`` per-sample lengths of the ragged keys."""
STAT_PREFIX = "__stat__."
"""In-memory batch entries ``__stat__.NAME``: float ``[n]`` per-sample statistics a producer computed (e.g. the
target's mean entropy); the shard writer keeps them in the shard's ``sample_stats`` metadata, not as tensors."""
SOURCE_ROW_KEY = "source_row"
"""Fixed int64 key: each sample's 0-based row in the data file it was built from (every method's schema has it)."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_ELEMENTS = 2**62
"""Bound on a tensor's element count (of its non-zero dimensions): beyond it torch's strides overflow."""
MAX_SHARDS = 1_000_000
"""Shard names have six digits."""
SOURCE_ROW_KEY = "source_row"
"""Fixed int64 key: each sample's 0-based row in the data file (every method's schema has it)."""
SAMPLE_TURN_KEY = "sample_turn"
"""Fixed int64 key of an --expand-turns cache: each sample's 0-based assistant turn."""
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"
"""Side file: the data rows a producer left out, one JSON object per line (docs/format.md)."""
DROPPED_FIELDS_FILE = "dropped_fields.jsonl"
"""Side file: the fields of kept rows that the chat template drops from their rendering, one per line."""


def shard_path(cache_dir: str, shard_index: int) -> str:
    """Return the path of shard ``shard_index`` inside ``cache_dir``."""
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.safetensors")


def reclaim_path(cache_dir: str, shard_index: int) -> str:
    """Return the path of shard ``shard_index``'s reclaim record inside ``cache_dir``."""
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.reclaimed")


def manifest_path(cache_dir: str) -> str:
    """Return the manifest path inside ``cache_dir``."""
    return os.path.join(cache_dir, MANIFEST_NAME)


def check_no_foreign_files(
    directory: str,
    own: Sequence[str] = (MANIFEST_NAME,),
    own_re: re.Pattern[str] | None = SHARD_RE,
    writer: str = "speccache",
) -> None:
    """Refuse an output directory that holds files ``writer`` does not create (so none of them can be touched).

    A writer's own are the names ``own`` (a cache's manifest by default), those ``own_re`` matches (shards), the
    lock, temporary files (``TEMP_RE``) and reclaim records (``RECLAIM_RE``); a missing directory passes.
    ``own_re`` ``None``: the writer names every file it writes in ``own``.

    Raises:
        CacheExistsError: names the directory, the files and the fix.
    """
    if not os.path.isdir(directory):
        return
    foreign = sorted(
        name
        for name in os.listdir(directory)
        if name not in (*own, LOCK_NAME)
        and not (own_re is not None and own_re.match(name))
        and not TEMP_RE.match(name)
        and not RECLAIM_RE.match(name)
    )
    if foreign:
        raise CacheExistsError(
            f"{directory} holds files {writer} did not write {_short(foreign)}; "
            "choose a new or empty directory. Nothing was changed."
        )


def existing_shard_indices(cache_dir: str) -> set[int]:
    """Return the indices of the shards present in ``cache_dir`` (empty if it does not exist)."""
    if not os.path.isdir(cache_dir):
        return set()
    return {int(m.group(1)) for m in map(SHARD_RE.match, os.listdir(cache_dir)) if m is not None}


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def check_shard_size(shard_size: int) -> None:
    """Raise :class:`UsageError` unless ``shard_size`` is an integer ``>= 1`` (numpy integers included)."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, numbers.Integral) or shard_size < 1:
        raise UsageError(f"shard_size must be an integer >= 1, got {shard_size!r}")


def num_shards(num_samples: int, shard_size: int) -> int:
    """Number of shards ``num_samples`` samples fill at ``shard_size`` per shard."""
    check_shard_size(shard_size)
    return ceil_div(num_samples, shard_size)


def shard_samples(index: int, num_samples: int, shard_size: int) -> int:
    """Samples in shard ``index`` of a cache of ``num_samples`` (all full but the last)."""
    return max(0, min(shard_size, num_samples - index * shard_size))


def validate_contiguous_shards(cache_dir: str, cache_name: str, num_samples: int, shard_size: int) -> list[int]:
    """Return ``[0..N-1]`` for ``N = ceil(num_samples / shard_size)`` shards, checking they are all there.

    Raises:
        CacheFormatError: shards are missing, extra or not contiguous; the message lists them.
    """
    indices = sorted(existing_shard_indices(cache_dir))
    expected = num_shards(num_samples, shard_size)
    if indices != list(range(expected)):
        present = set(indices)
        missing = sorted(set(range(expected)) - present)
        extra = sorted(present - set(range(expected)))
        raise CacheFormatError(
            f"{cache_name} cache at {cache_dir} declares {num_samples} samples ({expected} shards of {shard_size}) "
            f"but found shard indices {_short(indices)} (missing {_short(missing)}, unexpected {_short(extra)}). "
            "Re-run the producer with --resume to write missing shards; remove unexpected shards only if they are "
            "not from this cache."
        )
    return indices


def _short(items: Sequence[object], limit: int = 20) -> str:
    if len(items) <= limit:
        return str(items)
    return f"[{', '.join(map(str, items[:limit]))}, ... ({len(items)} in all)]"
