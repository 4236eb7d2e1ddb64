"""The reader's syscalls: ``pread`` into batch buffers, what the page cache holds, ``WILLNEED`` announcements and the
read-ahead thread (:class:`_ReadAhead`).

Long runs of rows are read with ``pread`` (faulting a fresh mapping in costs about as much as the copy itself),
the uncached ones of a batch announced to the kernel together, in file order and neighbours merged, so that the
disk reads them in parallel and in long requests. The functions take any open file that names its descriptor,
path and advice size (:class:`FileSource`): the open shards of :mod:`speccache.read._shard` are such files.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from speccache.errors import CacheCorruptError


class FileSource(Protocol):
    """An open file the reader reads from: its descriptor, its path (for messages) and its bytes per ``WILLNEED``."""

    fd: int
    path: str
    advice: int


_PREAD_BYTES = 64 << 10
"""Runs of rows at least this long are read with ``pread`` (the uncached ones announced first, ``POSIX_FADV_WILLNEED``).

Shorter ones are copied from the mapping: a syscall each would cost more than the
copy, and a fault on a cold page reads its neighbours too (read-around).
"""

_advise = getattr(os, "posix_fadvise", None)
_ADVICE_BYTES = 128 << 10
"""What the kernel reads per ``WILLNEED`` where its device's limits are unknown (the default read-ahead size)."""


@functools.cache
def _advice_bytes(device: int) -> int:
    """The most the kernel reads per ``WILLNEED`` on files of ``device`` (an ``st_dev``): the larger of the block
    device's read-ahead size and its largest request (``force_page_cache_ra``); longer ranges go in pieces.

    Pieces any smaller turn one long read into many small requests, which a disk serves several times slower.
    """
    queue = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for where in (queue + "/queue", queue + "/../queue"):  # a whole disk, or a partition of one
        try:
            limits = [int(_read_text(f"{where}/{name}")) for name in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(_ADVICE_BYTES, max(limits) << 10)
    return _ADVICE_BYTES


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _will_need(source: FileSource, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + nbytes)`` of ``source``'s file into the page cache."""
    if _advise is None:
        return
    end = offset + nbytes
    while offset < end:
        _advise(source.fd, offset, min(source.advice, end - offset), os.POSIX_FADV_WILLNEED)
        offset += source.advice


def _announce(ranges: Sequence[tuple[Any, ...]]) -> None:
    """``WILLNEED`` for each ``(source, offset, nbytes, ...)`` of ``ranges`` (sorted by source, then offset):
    touching or overlapping ranges of a file go as one, so that the disk streams through it in long requests."""
    first, start, end = ranges[0][0], ranges[0][1], ranges[0][1]
    for source, offset, nbytes, *_ in ranges:
        if source is not first or offset > end:
            _will_need(first, start, end - start)
            first, start = source, offset
        end = max(end, offset + nbytes)
    _will_need(first, start, end - start)


_NOWAIT = [getattr(os, "RWF_NOWAIT", 0)]
"""``RWF_NOWAIT`` while the kernel and file system take it (a one-element list: switched off on the first refusal)."""


def _cached_prefix(source: FileSource, dst: memoryview, offset: int) -> int:
    """Read what the page cache holds of ``dst``'s range without waiting for the disk; the bytes read."""
    if not _NOWAIT[0]:
        return 0
    try:
        return os.preadv(source.fd, [dst], offset, _NOWAIT[0])
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        _NOWAIT[0] = 0
        return 0


def _pread_into(source: FileSource, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        got = os.preadv(source.fd, [dst[done:]], offset + done)
        if got <= 0:
            raise CacheCorruptError(
                f"{source.path}: ends before byte {offset + len(dst)} that its header promises "
                "(truncated while open?). "
                "Delete the shard and re-run the producer with --resume."
            )
        done += got


class _ReadAhead:
    """Reads announced ranges into the page cache on a daemon thread, in the order given (file order).

    A cold epoch then streams through its shards as a plain sequential read does, while
    batches are collated, instead of waiting on each batch's reads in turn; and a batch
    that needs a range the thread will reach within :data:`_WAIT_BYTES` waits for it
    (:meth:`wait`) rather than seeking for it in the middle of the stream. Ranges that
    touch are read as one run, in one ``sendfile`` to ``/dev/null``: the kernel streams it
    with its own read-ahead, without coming back for the GIL between samples, and copies
    nothing, so the thread's memory is its queue of runs, which the sampler's
    ``prefetch_ahead`` bounds. Nothing is announced with ``WILLNEED`` here: a deep queue
    of streaming requests would hold up the small synchronous reads the main thread
    still makes (the headers of shards it opens). The thread runs only while runs are
    queued, and only the process that made this object uses it: a forked DataLoader
    worker inherits the object (its lock perhaps held) but not the thread.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._queue: deque[tuple[FileSource, int, int, list[tuple[int, int]]]] = deque()
        """Runs to read: ``(source, offset, nbytes, keys of the ranges in it)``."""
        self._pending: dict[tuple[int, int], int] = {}
        """``(id(source), offset)`` of each queued range: the bytes queued up to the end of its run. The queue
        holds ``source``, so its id is nobody else's meanwhile."""
        self._queued = 0
        self._read = 0
        self._running = False

    def submit(self, ranges: Iterable[tuple[FileSource, int, int]]) -> None:
        """Queue ``(source, offset, nbytes)`` ranges to be read in this order after those queued before, those that
        touch as one run; returns at once."""
        with self._cond:
            run: list[Any] = []
            for source, offset, nbytes in ranges:
                if (id(source), offset) in self._pending:
                    continue
                if run and run[0] is source and run[1] + run[2] == offset:
                    run[2] += nbytes
                else:
                    self._push(run)
                    run = [source, offset, nbytes, []]
                run[3].append((id(source), offset))
                self._pending[id(source), offset] = -1  # not queued yet: a duplicate in ``ranges`` is skipped
            self._push(run)
            if self._queue and not self._running:
                self._running = True
                threading.Thread(target=self._run, name="speccache-read-ahead", daemon=True).start()

    def _push(self, run: list[Any]) -> None:
        if run:
            self._queued += run[2]
            self._pending.update(dict.fromkeys(run[3], self._queued))
            self._queue.append(tuple(run))

    def wait(self, source: FileSource, offset: int) -> None:
        """Return once the range of ``source`` at ``offset`` is read, or at once if it is not queued or the
        thread has more than :data:`_WAIT_BYTES` to read before it."""
        key = (id(source), offset)
        # Without the lock: only the caller's thread adds keys, so one missing now is not queued (or read already).
        if key not in self._pending or self.pid != os.getpid():
            return
        with self._cond:
            while (end := self._pending.get(key)) is not None and end - self._read <= _WAIT_BYTES:
                self._cond.wait()

    def close(self) -> None:
        """Drop what is queued; the thread ends after the range it is reading."""
        if self.pid != os.getpid():
            return
        with self._cond:
            self._queue.clear()
            self._pending.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        done = False
        try:
            with open(os.devnull, "wb", buffering=0) as sink:
                while True:
                    with self._cond:
                        if not self._queue:
                            self._running = False
                            done = True
                            return
                        source, offset, nbytes, keys = self._queue.popleft()
                    try:
                        _fill_page_cache(source, offset, nbytes, sink.fileno())
                    except OSError:
                        pass  # the batch that needs the range reads it itself, and reports what is wrong
                    with self._cond:
                        self._read += nbytes
                        for key in keys:
                            self._pending.pop(key, None)
                        self._cond.notify_all()
        finally:
            if not done:  # whatever ended the thread, nobody waits for ranges it will not read
                with self._cond:
                    self._running = False
                    self._queue.clear()
                    self._pending.clear()
                    self._cond.notify_all()


_WAIT_BYTES = 1 << 30
"""A batch waits for the read-ahead thread only for ranges it reaches within this many bytes (well under a
second of a fast disk); farther ones it reads itself."""


def _fill_page_cache(source: FileSource, offset: int, nbytes: int, sink: int) -> None:
    """Read ``[offset, offset + nbytes)`` of ``source``'s file into the page cache, into ``sink`` (``/dev/null``)."""
    end = offset + nbytes
    while offset < end:
        sent = os.sendfile(sink, source.fd, offset, end - offset)
        if sent <= 0:  # past the end of a file truncated under the reader: the batch's own read reports it
            return
        offset += sent
