"""Reading caches: a lazy map-style dataset and the collators that batch its samples.

:class:`CacheDataset` reads the manifest and lists the directory once; shards
are opened (one ``mmap`` each) on first use in each process, kept in an LRU of
``max_open_shards``, and never pickled, so DataLoader workers of any start
method each open their own. ``__getitems__`` (used by the DataLoader for a whole
batch) returns :class:`SampleView` objects, which only record where each sample
lies; the collators then read each sample's bytes once, straight from the shard
file into the batch tensors: long runs with ``pread`` (faulting a fresh mapping
in costs about as much as the copy itself), the uncached ones of a batch
announced to the kernel together, in file order and neighbours merged, so
that the disk reads them in parallel and in long requests; short runs from
the mapping. :meth:`CacheDataset.prefetch` lets a sampler
announce the next samples, which a background thread then reads into the page
cache in file order while batches are collated (see :class:`_ReadAhead`).
"""

from __future__ import annotations

import errno
import functools
import math
import operator
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import Dataset

from speccache.errors import CacheCorruptError, CacheFormatError, CacheIncompleteError
from speccache.format import (
    OFFSETS_KEY,
    Manifest,
    NativeShard,
    Schema,
    ShardFile,
    bytes_view,
    existing_shard_indices,
    expected_parts,
    get_encoding,
    manifest_path,
    num_shards,
    shard_path,
    validate_contiguous_shards,
)
from speccache.format.reclaim import refuse_reclaimed
from speccache.format.shard import checksum_mismatch, recorded_checksums
from speccache.format.view import is_view

Sample = dict[str, torch.Tensor]

__all__ = ["NO_VERIFY_HELP", "CacheDataset", "Sample", "SampleView", "open_stacked_file"]

NO_VERIFY_HELP = (
    "read the shards without checking the tensors read against their checksums (verify=False): a first epoch "
    "from the page cache about a third shorter, from disk within ~10%%; a damaged byte is then read as data "
    "(docs/benchmarks.md)"
)
"""The help of the ``--no-verify`` flag of the commands that read caches (``%`` doubled for argparse)."""


@dataclass(frozen=True)
class KeyLayout:
    """How one key's samples are laid out: ``shape`` is per row of a ragged key, per sample of a fixed one."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    ragged: bool
    row_bytes: int


def _key_layout(dtype: torch.dtype, shape: tuple[int, ...], ragged: bool) -> KeyLayout:
    return KeyLayout(dtype, tuple(shape), ragged, math.prod(shape) * dtype.itemsize)


_LAYOUTS: dict[tuple[tuple[str, KeyLayout], ...], dict[str, KeyLayout]] = {}


def _shared(infos: dict[str, KeyLayout]) -> dict[str, KeyLayout]:
    """The one dict of this process for layouts equal to ``infos``: shards of alike layouts (of any reader, a
    view's sources too) share it, so that a collator checks a batch with one identity test per sample."""
    return _LAYOUTS.setdefault(tuple(infos.items()), infos)


class _OpenShard:
    """A shard opened by a :class:`CacheDataset` (or by :func:`open_stacked_file`): its decoder plus what reading
    raw rows from the file needs."""

    __slots__ = (
        "shard", "path", "keys", "infos", "bases", "mapped", "long", "row_offsets", "fd", "size", "advice", "ahead",
        "check",
    )  # fmt: skip

    def __init__(
        self,
        shard: NativeShard,
        keys: tuple[str, ...],
        infos: dict[str, KeyLayout],
        raw: Sequence[str],
        ahead: _ReadAhead | None = None,
    ) -> None:
        self.shard = shard
        self.ahead = ahead
        """The reader that ``prefetch`` hands this shard's announced ranges to, if any."""
        self.size = shard.file.size
        self.path: str = shard.path
        self.keys = keys
        self.infos = infos
        entries = shard.file.entries
        self.bases: dict[str, int | None] = {k: None for k in keys}
        """File offset of each raw key's first row; ``None`` for an encoded key (decoded through the shard)."""
        self.bases.update({k: shard.file.data_start + entries[k][2] for k in raw})
        self.mapped = {k: shard.file.tensor_bytes(k) for k in raw}
        """The bytes of each raw key in the shard's mapping."""
        self.row_offsets: list[int] = shard.row_offsets
        most = max(map(operator.sub, self.row_offsets[1:], self.row_offsets), default=0)
        self.long = {
            k: shard.file.data_start + entries[k][2]
            for k in raw
            if (most if infos[k].ragged else 1) * infos[k].row_bytes >= _PREAD_BYTES
        }
        """File offsets of the raw keys with samples long enough for ``pread`` (which ``prefetch`` announces)."""
        self.fd: int = shard.file.handle.fileno()  # the file the mapping shows, kept open by the shard
        self.advice = _advice_bytes(os.fstat(self.fd).st_dev)
        """Bytes per ``WILLNEED`` (see :func:`_advice_bytes`)."""
        self.check: _DataCheck | None = None
        """This process's pending check of the data read from the shard (``None``: passed, or not asked for)."""

    def span(self, key: str, local: int) -> tuple[int, int]:
        """Byte range of sample ``local``'s rows of raw key ``key``, from the key's first row."""
        info = self.infos[key]
        if info.ragged:
            return self.row_offsets[local] * info.row_bytes, self.row_offsets[local + 1] * info.row_bytes
        return local * info.row_bytes, (local + 1) * info.row_bytes

    def check_size(self) -> None:
        """Refuse to touch the mapping of a file that shrank since it was opened (a read past its end is SIGBUS).

        Raises:
            CacheCorruptError: the file is shorter than when it was opened.
        """
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise CacheCorruptError(
                f"{self.path}: the file shrank from {self.size} to {size} bytes while it was open (truncated, or "
                "overwritten by a copy). Restore the shard, or re-run the producer with --resume, "
                "then restart the reader."
            )

    def check_readable(self) -> None:
        """Refuse to read from a file that shrank (:meth:`check_size`), or whose data fails its checksums (checked
        by the first call of a process unless the :class:`_Checker` thread did).

        Raises:
            CacheCorruptError: the file shrank, or a tensor the reader reads differs from its checksum.
        """
        self.check_size()
        check = self.check
        if check is not None:
            check.run(self)
            self.check = None

    def sample(self, key: str, local: int) -> torch.Tensor:
        """Sample ``local``'s tensor of ``key``, in memory of its own (never a view of the mapping)."""
        self.check_readable()
        rows = self.shard.rows(key, local, local + 1)
        if self.bases[key] is not None:  # a view of the mapping: copy, so that the caller's edits stay the caller's
            rows = rows.clone()
        return rows if self.infos[key].ragged else rows[0]


class _StackedFile:
    """A safetensors file whose every tensor stacks the same ``num_samples`` samples (NeMo's seed layout), read as
    a shard of fixed keys."""

    def __init__(self, path: str, num_samples: int) -> None:
        self.file = ShardFile(path)
        self.path = path
        self.row_offsets = list(range(num_samples + 1))

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        return self.file.tensor(key)[start:end]


def open_stacked_file(path: str, keys: Sequence[str], num_samples: int) -> _OpenShard:
    """``path``, whose tensors ``keys`` each hold ``num_samples`` stacked samples, opened for :class:`SampleView` reads.

    ``SampleView(opened, i)`` is then sample ``i``, which the collators and :func:`read_into` read straight
    from the file; a batch of samples of files of one layout is read as one. The caller checks the file's keys
    and sample counts.

    Raises:
        CacheCorruptError: the header does not match the file (truncated or damaged).
    """
    stacked = _StackedFile(path, num_samples)
    entries = stacked.file.entries
    infos = _shared({k: _key_layout(entries[k][0], entries[k][1][1:], False) for k in keys})
    return _OpenShard(stacked, tuple(keys), infos, keys)  # type: ignore[arg-type]


class SampleView(MutableMapping[str, torch.Tensor]):
    """One sample of a :class:`CacheDataset`, as returned by ``__getitems__``: a dict of tensors made on access.

    Reading a key returns a tensor of its own (copied out of the shard, or decoded), so
    editing it in place never changes what later reads return; keys can be set and
    removed like a dict's. Collators copy the keys left as read straight from the shard
    file into the batch, so a batch costs no per-sample tensors. Pickling turns it into
    a plain ``dict``.
    """

    __slots__ = ("_shard", "_local", "_keys", "_set")

    def __init__(self, shard: _OpenShard, local: int) -> None:
        self._shard = shard
        self._local = local
        self._keys = shard.keys
        self._set: dict[str, torch.Tensor] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._set is not None and key in self._set:
            return self._set[key]
        if key not in self._keys:
            raise KeyError(key)
        return self._shard.sample(key, self._local)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self._set is None:
            self._set = {}
        if key not in self._keys:
            self._keys = (*self._keys, key)
        self._set[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self._keys:
            raise KeyError(key)
        self._keys = tuple(k for k in self._keys if k != key)
        if self._set is not None:
            self._set.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self.items()),))

    def __repr__(self) -> str:
        return f"SampleView({self._shard.path}, sample {self._local}, keys={list(self._keys)})"

    def _as_read(self, key: str) -> bool:
        """Whether ``key`` holds the shard's data (present, never set)."""
        return key in self._keys and (self._set is None or key not in self._set)


# ---------------------------------------------------------------------------
# reading rows from the shard files


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


def _will_need(source: _OpenShard, offset: int, nbytes: int) -> None:
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


def _cached_prefix(source: _OpenShard, dst: memoryview, offset: int) -> int:
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


def _pread_into(source: _OpenShard, dst: memoryview, offset: int) -> None:
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

    def run(self, source: _OpenShard, wait: bool = True) -> None:
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

    def _hash(self, source: _OpenShard) -> None:
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
        self._queue: deque[tuple[_DataCheck, _OpenShard]] = deque()
        self._running = False

    def submit(self, source: _OpenShard) -> None:
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
        self._queue: deque[tuple[_OpenShard, int, int, list[tuple[int, int]]]] = deque()
        """Runs to read: ``(source, offset, nbytes, keys of the ranges in it)``."""
        self._pending: dict[tuple[int, int], int] = {}
        """``(id(source), offset)`` of each queued range: the bytes queued up to the end of its run. The queue
        holds ``source``, so its id is nobody else's meanwhile."""
        self._queued = 0
        self._read = 0
        self._running = False

    def submit(self, ranges: Iterable[tuple[_OpenShard, int, int]]) -> None:
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

    def wait(self, source: _OpenShard, offset: int) -> None:
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


def _fill_page_cache(source: _OpenShard, offset: int, nbytes: int, sink: int) -> None:
    """Read ``[offset, offset + nbytes)`` of ``source``'s file into the page cache, into ``sink`` (``/dev/null``)."""
    end = offset + nbytes
    while offset < end:
        sent = os.sendfile(sink, source.fd, offset, end - offset)
        if sent <= 0:  # past the end of a file truncated under the reader: the batch's own read reports it
            return
        offset += sent


class CacheDataset(Dataset):
    """A native cache directory as a map-style dataset of per-sample tensor dicts.

    Fixed keys come back with their per-sample shape, ragged keys at each
    sample's true length ``[T, *shape]``. Every tensor handed out is the caller's
    own. ``__getitems__`` (what a DataLoader calls for a batch) returns
    :class:`SampleView` objects; ``ds[i]`` is ``dict(ds.__getitems__([i])[0])``, so a
    subclass customises samples by overriding ``__getitems__`` alone.

    A view directory is read as the samples it selects from its sources (see ``__new__``).

    Each shard's identity is checked whenever it is (re)opened: its size against the
    manifest's shard table, its recorded index and counts against the manifest, and the
    manifest file against the one this reader started from, so that a cache regenerated
    in place, or a shard replaced or truncated, raises :class:`CacheCorruptError` instead
    of mixing data. With ``verify`` (the default) its data is checked too, once per process
    and shard, before any of it is returned: the xxh3-128 of every tensor the reader reads
    against the one the shard records, so that a damaged byte raises
    :class:`CacheCorruptError` naming the shard and the tensor. The check streams those
    tensors once (and so leaves them in the page cache for the reads that follow), on a
    thread of its own for the shards a sampler announces through :meth:`prefetch`, else
    at the shard's first read; tensors of keys the reader does not read are not hashed,
    and later epochs of the process cost nothing more. ``verify=False`` skips it (its cost measured in
    docs/benchmarks.md): a flipped byte is then returned as read.

    Args:
        cache_dir: the cache directory.
        keys: keys to read (default: every key of the schema); a single name is one key.
        cache_name: kind of cache expected; default: whatever the manifest says.
        verify: check the tensors read from each shard against their checksums before this process's first read
            of it (default); ``False`` returns the bytes unchecked.
        max_open_shards: LRU bound on open shards per process.
        allow_incomplete: read the whole shards of an unsealed cache (the contiguous prefix).
        follow: read the cache while it is written: ``True`` or :class:`speccache.read.follow.Follow` settings
            return a :class:`speccache.read.follow.FollowDataset` of this class's samples, in the order shards
            are sealed (docs/training.md, "Training while the cache is written").

    Raises:
        FileNotFoundError: no manifest.
        CacheFormatError: wrong version or cache name, malformed or seed-layout manifest, unknown keys,
            missing or extra shards.
        CacheIncompleteError: the cache is not sealed and ``allow_incomplete`` is off, or a following trainer
            reclaimed some of its shards.
    """

    def __new__(cls, cache_dir: str | None = None, *args: Any, follow: Any = False, **kwargs: Any) -> Any:
        """A view directory (``speccache merge``/``subset``) opens as a
        :class:`speccache.read.view.ViewDataset` whose sources are read by this class; ``follow`` gives a
        :class:`speccache.read.follow.FollowDataset`."""
        if cache_dir is not None and follow is not False:
            from speccache.read.follow import FollowDataset  # the follower builds on this module

            if is_view(cache_dir):
                raise CacheFormatError(
                    f"{cache_dir} is a view, which selects samples of sealed caches: follow the cache being "
                    "written itself, or read the view once its sources are sealed"
                )
            return FollowDataset(cls, cache_dir, *args, follow=follow, **kwargs)
        if cache_dir is not None and is_view(cache_dir):  # (unpickling calls __new__ without arguments)
            from speccache.read.view import ViewDataset  # the view reader builds on this module

            return ViewDataset(cache_dir, *args, dataset_cls=cls, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        cache_dir: str,
        keys: Sequence[str] | str | None = None,
        *,
        cache_name: str | None = None,
        verify: bool = True,
        max_open_shards: int = 64,
        allow_incomplete: bool = False,
        follow: bool = False,
    ) -> None:
        try:
            max_open_shards = operator.index(max_open_shards)
        except TypeError:
            raise TypeError(f"max_open_shards must be an integer, got {max_open_shards!r}") from None
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.cache_dir = cache_dir
        self._manifest_stat = _identity(manifest_path(cache_dir))
        self.manifest = Manifest.read(cache_dir, cache_name)
        self.cache_name = self.manifest.cache_name
        self.shard_size, self.num_samples = self.manifest.shard_size, self.manifest.num_samples
        self.follow = bool(follow)
        """Opened by a follower: every shard the manifest declares is readable once sealed, each checked whole."""
        self.verify = verify or self.follow
        self.max_open_shards = max_open_shards
        schema = self.manifest.schema
        keys = self._stored_keys([keys] if isinstance(keys, str) else list(schema) if keys is None else list(keys))
        self.schema: Schema = {k: schema[k] for k in keys}
        self.keys: tuple[str, ...] = tuple(keys)
        if self.follow:
            pass  # the follower hands out only sealed shards, and knows which
        elif not self.manifest.complete:
            if not allow_incomplete:
                raise CacheIncompleteError(
                    (
                        f"cache at {cache_dir} is not complete: an append to it is still running or was interrupted. "
                        "Finish it by re-running the same precompute --append command"
                        if self.manifest.config.get("appended")
                        else f"cache at {cache_dir} "
                        "is not complete: it is still being written or its writer was interrupted. "
                        "Finish it by re-running the same precompute command with --resume"
                    )
                    + " (or pass allow_incomplete=True to read its whole shards)."
                )
            self.num_samples = _complete_prefix(cache_dir, self.num_samples, self.shard_size)
        else:
            if self.manifest.reclaimed:
                refuse_reclaimed(cache_dir, self.manifest)
            try:
                validate_contiguous_shards(cache_dir, self.cache_name, self.num_samples, self.shard_size)
            except CacheFormatError:
                # Reclaimed shards are missing shards: say so when records explain them. Read only then, so a
                # whole cache's start-up lists its directory once.
                refuse_reclaimed(cache_dir, self.manifest)
                raise
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._verified: set[int] = set()
        self._checks: dict[int, _DataCheck] = {}
        """Checks of shards not passed yet, kept across reopenings."""
        self._ahead: _ReadAhead | None = None
        self._check_thread: _Checker | None = None
        self._reader_pid: int | None = None
        """The process that reads samples: ``prefetch`` hashes ahead only in it. A DataLoader's workers each
        check for themselves, so the main process, whose sampler calls ``prefetch``, hashes nothing for them
        (see :meth:`_reading`)."""
        self._layout: tuple[dict[str, KeyLayout], list[str]] | None = None
        """The shards' key layouts and raw keys (one schema: computed once; per process, see ``_shared``)."""

    def _stored_keys(self, keys: list[str]) -> list[str]:
        """The stored keys to read for the keys a caller asked for (a subclass adds what its derived fields need).

        Raises:
            CacheFormatError: a key the cache does not hold.
        """
        unknown = [k for k in keys if k not in self.manifest.schema]
        if unknown:
            raise CacheFormatError(
                f"{self.cache_dir}: keys {unknown} are not in the cache; it holds {sorted(self.manifest.schema)}"
            )
        return keys

    @property
    def ragged_keys(self) -> frozenset[str]:
        """Keys whose samples have their own number of rows."""
        return frozenset(k for k, s in self.schema.items() if s.ragged)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["_verified"] = set()  # another process verifies for itself
        state["_checks"] = {}
        state["_ahead"] = None  # and reads ahead for itself
        state["_check_thread"] = None
        state["_reader_pid"] = None
        state["_layout"] = None  # and shares layouts with its own other readers
        return state

    def _read_ahead(self) -> _ReadAhead:
        """This process's :class:`_ReadAhead` (a forked worker makes its own), closed with the dataset."""
        if self._ahead is None or self._ahead.pid != os.getpid():
            self._ahead = _ReadAhead()
            weakref.finalize(self, self._ahead.close)
        return self._ahead

    def _reading(self) -> None:
        """Note that this process reads samples; on its first read, hand the checks of the shards ``prefetch``
        opened before it (a sampler announces its first window before the first batch) to the checker thread."""
        pid = os.getpid()
        if self._reader_pid != pid:
            self._reader_pid = pid
            if self.verify and not self.follow:
                for opened in list(self._open.values()):
                    self._checker().submit(opened)

    def _checker(self) -> _Checker:
        """This process's :class:`_Checker` (a forked worker makes its own)."""
        if self._check_thread is None or self._check_thread.pid != os.getpid():
            self._check_thread = _Checker()
        return self._check_thread

    def _shard(self, index: int) -> NativeShard:
        """The open shard ``index``."""
        return self._open_shard(index).shard

    def _open_shard(self, index: int) -> _OpenShard:
        opened = self._open.get(index)
        if opened is not None:
            self._open.move_to_end(index)
            return opened
        path = shard_path(self.cache_dir, index)
        self._check_manifest_unchanged(path)
        record = self.manifest.shards.get(index)
        verify = self.verify and index not in self._verified
        schema = self.manifest.schema
        # A follower checks each sealed shard whole as it opens it; other readers check the row offsets now (the
        # shard's structure checks read them) and the tensors they read before their first read (_DataCheck).
        check_now: bool | tuple[str, ...] = False
        if verify:
            check_now = True if self.follow else (OFFSETS_KEY,) if OFFSETS_KEY in expected_parts(schema) else ()
        try:
            shard = NativeShard(
                path,
                schema,
                index,
                self.manifest.shard_samples(index),
                verify=check_now,
                expected_bytes=record.bytes if record is not None else None,
            )
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(
                    exc.errno,
                    f"cannot open {path}: too many open files ({exc.strerror}). Each open shard holds two file "
                    f"descriptors and each DataLoader worker keeps up to max_open_shards={self.max_open_shards} open: "
                    "lower max_open_shards or num_workers, or raise the limit (ulimit -n).",
                ) from exc
            raise
        if verify and self.follow:
            self._verified.add(index)
        if self.follow:  # a reclaimed shard's space is freed only once no descriptor holds it
            for gone in [i for i, o in self._open.items() if _unlinked(o.fd)]:
                del self._open[gone]
        opened = self._wrap(shard)
        if verify and not self.follow:
            # A shard reopened before its check ran (evicted by the LRU) keeps that check: hashed once. The
            # checker thread may have passed it since ``verify`` was decided: ``_passed`` marks it verified before
            # dropping the check, so a check not found here is either one never made or one already passed.
            opened.check = self._checks.get(index)
            if opened.check is None and index not in self._verified:
                parts = expected_parts(self.schema) - {OFFSETS_KEY}
                check = _DataCheck(shard.file, parts, functools.partial(self._passed, index))
                opened.check = self._checks[index] = check
        self._open[index] = opened
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)  # closed once no sample of an in-flight batch refers to it
        return opened

    def _passed(self, index: int) -> None:
        """Shard ``index``'s data passed its check (on whichever thread ran it)."""
        self._verified.add(index)
        self._checks.pop(index, None)

    def _check_manifest_unchanged(self, path: str) -> None:
        """Refuse to open ``path`` if the cache was rewritten with another configuration since this reader started.

        The writer of the same run (sealing, or resuming) rewrites the manifest too; its shards are the
        same bytes whoever writes them, so the new manifest (now perhaps sealed) is adopted instead.
        """
        current = _identity(manifest_path(self.cache_dir))
        if current == self._manifest_stat:
            return
        try:
            found = Manifest.read(self.cache_dir, self.cache_name)
        except (FileNotFoundError, CacheFormatError):
            found = None
        if found is not None and _appended_to(self.manifest, found):
            raise CacheCorruptError(
                f"{manifest_path(self.cache_dir)} changed since this reader opened the cache: "
                f"the cache was appended to ({found.num_samples} samples now, "
                f"{'sealed' if found.complete else 'not sealed yet'}), "
                f"so {os.path.basename(path)} may hold other samples than this reader's. Reopen the dataset "
                + ("now." if found.complete else "once the append is sealed (its precompute --append has finished).")
            )
        if found is None or found.resume_identity() != self.manifest.resume_identity():
            raise CacheCorruptError(
                f"{manifest_path(self.cache_dir)} changed since this reader opened the cache (the cache was rewritten "
                f"in place with another configuration), so {os.path.basename(path)} may belong to another cache. "
                "Restart the reader."
            )
        self.manifest, self._manifest_stat = found, current

    def _wrap(self, shard: NativeShard) -> _OpenShard:
        if self._layout is None:
            infos = _shared({k: _key_layout(s.dtype, s.shape, s.ragged) for k, s in self.schema.items()})
            self._layout = infos, [k for k in self.keys if get_encoding(self.schema[k].encoding).zero_copy]
        return _OpenShard(shard, self.keys, *self._layout, self._read_ahead())

    def __getitem__(self, index: int) -> Sample:
        """One sample as a plain dict of tensors the caller owns (what ``__getitems__`` returns for it)."""
        return dict(self.__getitems__([index])[0])

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """Samples at ``indices`` (in that order) as :class:`SampleView` objects."""
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        self._reading()
        out: list[Sample] = []
        opened: dict[int, _OpenShard] = {}  # each shard looked up once per batch
        for index in indices:
            shard, local = self._split(index)
            source = opened.get(shard)
            if source is None:
                source = opened[shard] = self._open_shard(shard)
            out.append(SampleView(source, local))
        return out

    def _split(self, index: int) -> tuple[int, int]:
        """``(shard, sample within the shard)`` of sample ``index`` (negative counts from the end).

        Raises:
            TypeError: ``index`` is not an integer (``1.7`` is not sample 1).
            IndexError: out of range.
        """
        if type(index) is int and 0 <= index < self.num_samples:  # the common case, once per sample read
            return divmod(index, self.shard_size)
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"sample indices must be integers, got {index!r}") from None
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a cache of {self.num_samples} samples")
        return divmod(i, self.shard_size)

    def prefetch(self, indices: Iterable[int]) -> None:
        """Have these samples' long raw rows read into the page cache in the background; returns at once.

        The ``prefetch`` hook of :class:`speccache.read.sampler.LocalityShuffleSampler`, which
        announces the next samples while the current batch is read, so that the disk
        never waits for the reader. Only reads that would go to ``pread`` and are not
        cached are announced; short ones rely on the kernel's read-around of the mapping
        (probing and queueing each would cost more than a fault). A background thread
        reads them shard by shard, in the order the indices first need the shards, each
        in file order, so that the disk streams through them; a shard whose data this
        process has not checked yet is checked on another thread meanwhile (``verify``,
        see :class:`_Checker`; only in a process that reads batches itself, not for a
        DataLoader's workers); a batch that needs one of
        them before it is read waits for it. Each shard's reads are queued as soon as
        that shard is open, so that the disk starts on the first shard while the
        others' headers are read.
        """
        probe = memoryview(bytearray(1))
        for shard, locals_ in self._by_shard(indices).items():
            opened = self._open_shard(shard)
            if opened.check is not None and self._reader_pid == os.getpid():
                self._checker().submit(opened)
            wanted = []
            for key, base in opened.long.items():
                for local in locals_:
                    start, end = opened.span(key, local)
                    if end - start >= _PREAD_BYTES and not _cached_prefix(opened, probe, base + start):
                        wanted.append((base + start, end - start))
            if wanted:
                wanted.sort()
                self._read_ahead().submit((opened, offset, nbytes) for offset, nbytes in wanted)

    def _by_shard(self, indices: Iterable[int]) -> dict[int, list[int]]:
        """The samples (within their shard) that ``indices`` need of each shard, the shards in the order first needed.

        A sampler's window of in-range integers is grouped with array operations; any other indices go one by one
        through :meth:`_split`, which refuses what it must.
        """
        items = indices if isinstance(indices, (list, tuple, np.ndarray)) else list(indices)
        try:
            idx = np.asarray(items)
        except ValueError:  # ragged nesting: not indices, as _split says
            idx = np.empty(0, dtype=object)
        if (
            idx.ndim == 1
            and idx.dtype.kind in "iu"
            and (not idx.size or 0 <= idx.min() <= idx.max() < self.num_samples)
        ):
            of, within = np.divmod(idx, self.shard_size)
            shards, first = np.unique(of, return_index=True)
            return {shard: within[of == shard].tolist() for shard in shards[np.argsort(first)].tolist()}
        by_shard: dict[int, list[int]] = {}
        for index in items:
            shard, local = self._split(index)
            by_shard.setdefault(shard, []).append(local)
        return by_shard

    def sample_length(self, index: int) -> int:
        """Rows of sample ``index``'s ragged keys (1 when no key is ragged); reads only its shard's offsets."""
        shard, local = self._split(index)
        offsets = self._open_shard(shard).row_offsets
        return offsets[local + 1] - offsets[local]

    def read(
        self, index: int, rows: slice | None = None, keys: Sequence[str] | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Sample ``index`` with its ragged keys cut to token positions ``rows``, reading only those rows' bytes.

        The range read of long samples (a sequence-parallel rank's part: :mod:`speccache.read.ranges`).
        ``read(i)`` is ``ds[i]`` restricted to ``keys``; ``read(i, slice(a, b))`` equals it with each ragged key
        sliced ``[a:b]``, fixed keys whole. Raw and fp8 keys touch only the rows' bytes; a zbf16 key also
        decompresses the sample's high-byte frame, which is stored whole.

        Args:
            index: the sample.
            rows: a slice of token positions (step 1; Python slice rules), ``None`` for all.
            keys: the stored keys to read (default: the reader's ``keys``); a single name is one key.

        Returns:
            The keys' tensors, each the caller's own.

        Raises:
            KeyError: a key this reader was not opened with (the message lists those it was).
            TypeError, ValueError: ``rows`` is not a slice of step 1.
            IndexError: ``index`` is out of range.
        """
        names = self.keys if keys is None else (keys,) if isinstance(keys, str) else tuple(keys)
        unknown = [k for k in names if k not in self.keys]
        if unknown:
            raise KeyError(f"keys {unknown} are not among this reader's keys {list(self.keys)}; open it with them")
        shard, local = self._split(index)
        self._reading()
        opened = self._open_shard(shard)
        first, last = _row_range(rows, opened.row_offsets[local + 1] - opened.row_offsets[local])
        opened.check_readable()
        out: dict[str, torch.Tensor] = {}
        for key in names:
            if self.schema[key].ragged:
                value = opened.shard.sample_rows(key, local, first, last)
            else:
                value = opened.shard.rows(key, local, local + 1)[0]
            out[key] = value.clone() if opened.bases[key] is not None else value  # a view of the mapping: copy
        return out

    def sample_lengths(self) -> list[int]:
        """Rows of each sample's ragged keys (all 1 when no key is ragged); reads only shard offsets."""
        lengths: list[int] = []
        for index in range(num_shards(self.num_samples, self.shard_size)):
            o = self._shard(index).row_offsets
            lengths.extend(o[i + 1] - o[i] for i in range(len(o) - 1))
        return lengths


def _row_range(rows: slice | None, length: int) -> tuple[int, int]:
    """``(first, last)`` rows of a sample of ``length`` rows that ``rows`` selects (``None``: all of them).

    Python slice rules apply (negative bounds count from the end, bounds past it are cut to it).

    Raises:
        TypeError: ``rows`` is not a slice.
        ValueError: a step other than 1 (rows are read as one contiguous run).
    """
    if rows is None:
        return 0, length
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice of token positions, e.g. slice(0, 4096), got {rows!r}")
    first, last, step = rows.indices(length)
    if step != 1:
        raise ValueError(f"rows={rows!r}: a token range is read as one contiguous run; give a slice with step 1")
    return first, max(first, last)


def _appended_to(opened: Manifest, found: Manifest) -> bool:
    """Whether ``found`` is the manifest of an append to the cache ``opened`` describes (its appended files extend)."""
    before, after = opened.config.get("appended") or [], found.config.get("appended") or []
    return isinstance(after, list) and len(after) > len(before) and after[: len(before)] == before


def _unlinked(fd: int) -> bool:
    """Whether the file open as ``fd`` has been deleted (reclaimed) since."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def _identity(path: str) -> tuple[int, int, int, int] | None:
    """What changes when a file is replaced or rewritten: device, inode, size and modification time."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _complete_prefix(cache_dir: str, num_samples: int, shard_size: int) -> int:
    present = existing_shard_indices(cache_dir)
    k = 0
    while k in present:
        k += 1
    return min(k * shard_size, num_samples)


# ---------------------------------------------------------------------------
# reading samples of a batch straight from the shard files (the collators' fast path)


class BatchRows:
    """Where the samples of a batch of :class:`SampleView` objects of alike shards lie in their shards, gathered
    in one pass for every key the batch reads (:func:`batch_rows`); each shard's file size is checked once here.

    Attributes:
        infos: the key layouts the samples' shards share.
        untouched: whether every sample holds every key as read from its shard.
        sources: each sample's open shard.
        locals: each sample's index within its shard; ``nexts`` the one after it (a fixed key's rows).
        starts, ends: each sample's rows of the ragged keys within its shard.
    """

    __slots__ = ("infos", "untouched", "sources", "locals", "nexts", "starts", "ends")

    def __init__(self, samples: Sequence[SampleView], infos: dict[str, KeyLayout], untouched: bool) -> None:
        self.infos = infos
        self.untouched = untouched
        self.sources = [s._shard for s in samples]
        self.locals = [s._local for s in samples]
        self.nexts = [local + 1 for local in self.locals]
        self.starts = [source.row_offsets[local] for source, local in zip(self.sources, self.locals)]
        self.ends = [source.row_offsets[local] for source, local in zip(self.sources, self.nexts)]
        for source in {id(source): source for source in self.sources}.values():
            source.check_readable()  # before any read touches a mapping: a read past a file's end is SIGBUS

    def counts(self) -> list[int]:
        """Rows of each sample's ragged keys."""
        return [end - start for start, end in zip(self.starts, self.ends)]


def batch_rows(samples: Sequence[Mapping[str, torch.Tensor]]) -> BatchRows | None:
    """The rows of ``samples`` in their shards if all are :class:`SampleView` of alike shards, else ``None``.

    Raises:
        CacheCorruptError: a shard file shrank since it was opened.
    """
    first = samples[0] if samples else None
    if type(first) is not SampleView:
        return None
    infos = first._shard.infos
    untouched = True
    for s in samples:
        if type(s) is not SampleView or s._shard.infos is not infos:
            return None
        untouched = untouched and s._set is None and s._keys is s._shard.keys
    return BatchRows(samples, infos, untouched)  # type: ignore[arg-type]


def readable_layout(samples: Sequence[Any], rows: BatchRows | None, key: str, ragged: bool) -> KeyLayout | None:
    """``key``'s layout when every sample holds it as read from its shard, ``ragged`` as the collator treats it."""
    info = rows.infos.get(key) if rows is not None else None
    if rows is None or info is None or info.ragged != ragged:
        return None
    return info if rows.untouched or all(s._as_read(key) for s in samples) else None


def read_into(out: torch.Tensor, rows: BatchRows, key: str, info: KeyLayout, dst: Sequence[int]) -> None:
    """Copy each sample's rows of ``key`` into the bytes of ``out``, sample ``i`` from byte ``dst[i]``."""
    mv = bytes_view(out)
    row_bytes = info.row_bytes
    large: list[tuple[_OpenShard, int, int, int]] = []
    encoded: list[tuple[_OpenShard, int, int]] = []
    starts, ends = (rows.starts, rows.ends) if info.ragged else (rows.locals, rows.nexts)
    previous = None
    # This loop runs for every sample and key of every batch: one shard's lookups serve its run of samples.
    for source, local, start, end, d in zip(rows.sources, rows.locals, starts, ends, dst):
        if source is not previous:
            previous, base, mapped = source, source.bases[key], source.mapped.get(key)
        if base is None:
            encoded.append((source, local, d))
            continue
        start *= row_bytes
        end *= row_bytes
        if end - start >= _PREAD_BYTES:
            large.append((source, base + start, end - start, d))
        elif end > start:  # an empty sample or zero-width rows copy nothing (and an empty view is read-only)
            assert mapped is not None  # a key with a base offset is stored raw, so it is mapped
            mv[d : d + end - start] = mapped[start:end]
    if large:
        _read_large(mv, large)
    if encoded:
        decode_into(mv, encoded, key, info)


def _read_large(mv: memoryview, large: list[tuple[_OpenShard, int, int, int]]) -> None:
    """Read runs of ``(source, file offset, nbytes, destination)`` into ``mv`` with ``pread`` (not from the mapping:
    pages a mapping touched stay mapped, and counted in the trainer's resident memory, while the shard is open)."""
    # What is cached is copied at once; the rest is announced as a whole, so the disk works on every miss
    # of the batch at the same time, and then read in order.
    missed: list[tuple[_OpenShard, int, int, int]] = []
    for source, offset, nbytes, d in large:
        if source.ahead is not None:  # announced and not read yet: the read-ahead thread is on its way to it
            source.ahead.wait(source, offset)
        got = _cached_prefix(source, mv[d : d + nbytes], offset)
        if got < nbytes:
            missed.append((source, offset + got, nbytes - got, d + got))
    missed.sort(key=lambda m: (id(m[0]), m[1]))  # in file order, as _announce asks the disk for them
    if len(missed) > 1:
        _announce(missed)
    for source, offset, nbytes, d in missed:
        _pread_into(source, mv[d : d + nbytes], offset)


def decode_into(mv: memoryview, members: list[tuple[_OpenShard, int, int]], key: str, info: KeyLayout) -> None:
    """Decode ``(source, local, destination)`` samples into ``mv``, a run of rows per shard when its samples lie
    close together."""
    groups: dict[int, tuple[_OpenShard, list[tuple[int, int]]]] = {}
    for source, local, d in members:
        groups.setdefault(id(source), (source, []))[1].append((local, d))
    for source, locals_ in groups.values():
        locals_.sort()
        lo, hi = locals_[0][0], locals_[-1][0] + 1
        spans = [(lo, hi, locals_)] if hi - lo <= 4 * len(locals_) else [(i, i + 1, [(i, d)]) for i, d in locals_]
        offsets = source.row_offsets
        for a, b, part in spans:
            block = source.shard.rows(key, a, b)
            for local, d in part:
                rows = (
                    block[offsets[local] - offsets[a] : offsets[local + 1] - offsets[a]]
                    if info.ragged
                    else block[local - a]
                )
                data = bytes_view(rows.contiguous())
                if len(data):
                    mv[d : d + len(data)] = data
