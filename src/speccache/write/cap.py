"""The disk cap of a cache a trainer reads while it is written (``--max-cache-bytes``, ``--max-cache-shards``).

Before each shard is written, the producer waits while the cache's unconsumed shards (those on disk without
a reclaim record) reach the cap; a trainer reading with ``reclaim`` deletes the shards it has finished,
which lets the producer go on. The check comes before the write, so the shards on disk never exceed the cap
by more than the one being written (one per producer rank under torchrun). Without a reclaiming trainer the
producer waits for good, saying so periodically; nothing is ever deleted by the cap itself.
"""

from __future__ import annotations

import logging
import os
import time

from speccache.format.names import existing_shard_indices, shard_path
from speccache.format.reclaim import finish_reclaims, read_reclaims
from speccache.units import human_bytes

log = logging.getLogger(__name__)

__all__ = ["DiskCap"]


class DiskCap:
    """Pauses a producer while the unconsumed shards of ``cache_dir`` reach ``max_bytes`` or ``max_shards``.

    Args:
        cache_dir: the cache directory.
        max_bytes: the most bytes of unconsumed shards before a write (``None``: no byte cap).
        max_shards: the most unconsumed shards after a write (``None``: no shard cap).
        poll: seconds between looks at the directory while paused.
        report_every: seconds between the log lines of a long pause.

    Attributes:
        waited: seconds spent paused so far.
        pauses: how many writes waited.
        high_water: the most bytes of unconsumed shards seen on disk.
    """

    def __init__(
        self,
        cache_dir: str,
        max_bytes: int | None = None,
        max_shards: int | None = None,
        poll: float = 0.2,
        report_every: float = 60.0,
    ) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_shards", max_shards)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"the disk cap's {name} must be an integer >= 1, got {value!r}")
        self.cache_dir = cache_dir
        self.max_bytes, self.max_shards = max_bytes, max_shards
        self.poll, self.report_every = poll, report_every
        self.waited = 0.0
        self.pauses = 0
        self.high_water = 0

    def unconsumed(self) -> tuple[int, int]:
        """``(shards, bytes)`` on disk that no trainer has reclaimed; completes reclaims a trainer left half-done."""
        reclaims = read_reclaims(self.cache_dir)
        finish_reclaims(self.cache_dir, reclaims)
        count = total = 0
        for index in existing_shard_indices(self.cache_dir) - set(reclaims):
            try:
                total += os.stat(shard_path(self.cache_dir, index)).st_size
            except FileNotFoundError:
                continue  # reclaimed meanwhile
            count += 1
        self.high_water = max(self.high_water, total)
        return count, total

    def _full(self, count: int, total: int) -> bool:
        return (self.max_shards is not None and count >= self.max_shards) or (
            self.max_bytes is not None and total >= self.max_bytes
        )

    def wait(self, shard_index: int) -> None:
        """Return once shard ``shard_index`` may be written (at once while the cache is under its cap)."""
        count, total = self.unconsumed()
        if not self._full(count, total):
            return
        started = reported = time.monotonic()
        self.pauses += 1
        log.log(
            logging.WARNING if self.pauses == 1 else logging.INFO,  # the first pause is news; later ones are the rhythm
            "%s: paused before shard %d: %d unconsumed shards (%s) reach the cap (%s); waiting for a trainer "
            "reading with reclaim to finish some",
            self.cache_dir,
            shard_index,
            count,
            human_bytes(total),
            self._describe(),
        )
        try:
            while self._full(count, total):
                time.sleep(self.poll)
                if time.monotonic() - reported >= self.report_every:
                    reported = time.monotonic()
                    log.warning(
                        "%s: still paused before shard %d after %.0f s (%d unconsumed shards, %s)",
                        self.cache_dir,
                        shard_index,
                        reported - started,
                        count,
                        human_bytes(total),
                    )
                count, total = self.unconsumed()
        finally:
            self.waited += time.monotonic() - started

    def _describe(self) -> str:
        parts = []
        if self.max_bytes is not None:
            parts.append(f"--max-cache-bytes {human_bytes(self.max_bytes)}")
        if self.max_shards is not None:
            parts.append(f"--max-cache-shards {self.max_shards}")
        return ", ".join(parts)
