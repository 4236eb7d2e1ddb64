"""A test hook: kill the process at a named point of the write path.

This exists only for the crash tests (tests/test_crash.py). When the environment
variable ``SPECCACHE_FAULT`` is unset (always, outside those tests) a call costs
one dictionary lookup and does nothing.

``SPECCACHE_FAULT=POINT`` or ``POINT:N`` makes the N-th call (1-based; default 1)
of ``fault_point(POINT)`` in this process send itself ``SIGKILL``: no Python
cleanup runs, exactly as when a scheduler kills a job. Named points:

``after_manifest_begin``
    :meth:`speccache.cache_writer.CacheWriter.begin`, after the unsealed manifest is written.
``mid_shard_write``
    :func:`speccache.format.write_safetensors`, with the header and part of the tensor
    data in the temporary file (flushed), before the fsync and the rename.
``mid_manifest_write``
    :func:`speccache.format.write_manifest`, with half of the JSON in the temporary file.
``before_seal``
    :meth:`speccache.cache_writer.CacheWriter.seal`, every shard written, before the sealed manifest.
``after_seal``
    the same, after the sealed manifest is written and before the lock is released.
"""

from __future__ import annotations

import os
import signal
from typing import IO, Any

ENV = "SPECCACHE_FAULT"
POINTS = ("after_manifest_begin", "mid_shard_write", "mid_manifest_write", "before_seal", "after_seal")

_hits: dict[str, int] = {}


def fault_point(name: str, flush: IO[Any] | None = None) -> None:
    """Kill this process with ``SIGKILL`` if ``SPECCACHE_FAULT`` names this call (see the module doc).

    Args:
        name: one of :data:`POINTS`.
        flush: a file to flush first, so that what was written so far is on disk as a killed writer leaves it.
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        if flush is not None:
            flush.flush()
        os.kill(os.getpid(), signal.SIGKILL)
