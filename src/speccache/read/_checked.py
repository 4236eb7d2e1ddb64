"""Checked reads: each tensor a reader reads from a shard hashed against the checksum the shard records, once per
process and shard, before the shard's first read returns a byte (:class:`_DataCheck`), on a thread of its own for
the shards a sampler announces (:class:`_Checker`)."""

from __future__ import annotations

import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import xxhash

from speccache.errors import CacheCorruptError
from speccache.format import ShardFile
from speccache.format.shard import checksum_mismatch, recorded_checksums
from speccache.read._io import FileSource, _pread_into


class CheckedSource(FileSource, Protocol):
    """An open shard whose data a reader checks: its pending check (``None``: passed, or not asked for)."""

    check: _DataCheck | None


_CHECK_CHUNK = 1 << 20
"""Bytes read and hashed at a time by :class:`_DataCheck` (a buffer that stays in the CPU's cache while hashed)."""


class _DataCheck:
    """The check of an open shard's data, once per process: each tensor the reader reads (its keys' parts) hashed
    against the xxh3-128 the shard's metadata records, before the shard's first read returns a byte.

    The tensors are streamed with ``pread`` through one small buffer (not the mapping, whose touched pages would
    stay mapped), in file order, which leaves them in the page cache for the reads that follow. Tensors the
    reader does not read are not hashed. A shard that ``prefetch`` announces is checked by the
    :class:`_Checker` thread while the batches before it are read; the first read runs the check itself if
    the thread has not started it, or waits for the thread that has.
    """

    def __init__(self, file: ShardFile, names: Iterable[str], passed: Callable[[], None]) -> None:
        # Holds no file: a reader keeps the checks of shards it has closed (LRU) until they run.
        recorded = recorded_checksums(file)
        start, entries = file.data_start, file.entries
        self.tensors = [(n, start + entries[n][2], entries[n][3] - entries[n][2], recorded.get(n)) for n in names]
        """``(name, file offset, nbytes, recorded checksum)`` of each tensor to check, in file order."""
        self.tensors.sort(key=operator.itemgetter(1))
        self._passed = passed
        self.queued_by: int | None = None
        """The process whose :class:`_Checker` it was handed to (once is enough)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._done = False
        self._error: CacheCorruptError | None = None

    def run(self, source: CheckedSource, wait: bool = True) -> None:
        """Check the tensors (read from ``source``, the shard open now) unless this process did; another thread
        checking them is waited for, or with ``wait=False`` (the :class:`_Checker` thread) left to it, and a
        failure is kept for the reader to raise.

        Raises:
            CacheCorruptError: (``wait`` only) a tensor differs from its checksum, or the file was truncated.
        """
        if self._pid != os.getpid():  # a forked worker: the parent's lock may be held by a thread it lacks
            self._pid, self._lock = os.getpid(), threading.Lock()
        if not self._lock.acquire(blocking=wait):
            return
        try:
            if not self._done:
                try:
                    self._hash(source)
                except CacheCorruptError as exc:
                    self._error = exc
                self._done = True
                if self._error is None:
                    self._passed()
        finally:
            self._lock.release()
        if wait and self._error is not None:
            raise CacheCorruptError(str(self._error))

    def _hash(self, source: CheckedSource) -> None:
        buf = memoryview(bytearray(min(_CHECK_CHUNK, max((t[2] for t in self.tensors), default=0))))
        for name, offset, nbytes, recorded in self.tensors:
            h = xxhash.xxh3_128()
            end = offset + nbytes
            while offset < end:
                chunk = buf[: min(len(buf), end - offset)]
                _pread_into(source, chunk, offset)
                h.update(chunk)
                offset += len(chunk)
            if h.hexdigest() != recorded:
                raise checksum_mismatch(source.path, name)


class _Checker:
    """Runs shards' data checks (:class:`_DataCheck`) on a daemon thread, in the order submitted.

    ``prefetch`` submits the shards it announces, so that each is checked while the batches
    before it are read, on another core: the hashing (``pread`` and xxh3 release the GIL)
    then costs the reader little more than the wait for the first shard's check. The thread
    runs only while checks are queued; only the process that made this object uses it.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._queue: deque[tuple[_DataCheck, CheckedSource]] = deque()
        self._running = False

    def submit(self, source: CheckedSource) -> None:
        """Queue the pending check of ``source`` unless it was queued before; returns at once."""
        check = source.check
        if check is None or check.queued_by == self.pid:
            return
        check.queued_by = self.pid
        with self._lock:
            self._queue.append((check, source))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="speccache-check", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                check, source = self._queue.popleft()
            try:
                check.run(source, wait=False)
            except OSError:
                pass  # the shard's first read checks it again, and reports what is wrong
