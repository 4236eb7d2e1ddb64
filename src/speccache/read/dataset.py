"""Reading caches: :class:`CacheDataset`, a lazy map-style dataset of a cache's samples.

:class:`CacheDataset` reads the manifest and lists the directory once; shards
are opened (one ``mmap`` each, :mod:`speccache.read._shard`) on first use in each process, kept in an LRU of
``max_open_shards``, and never pickled, so DataLoader workers of any start
method each open their own. ``__getitems__`` (used by the DataLoader for a whole
batch) returns :class:`SampleView` objects, which only record where each sample
lies; the collators then read each sample's bytes once, straight from the shard
file into the batch tensors (:mod:`speccache.read._batch`). :meth:`CacheDataset.prefetch` lets a sampler
announce the next samples, which a background thread then reads into the page
cache in file order while batches are collated (see :class:`speccache.read._io._ReadAhead`); the data read is
checked against the shards' checksums first (:mod:`speccache.read._checked`).

A view directory, or a cache read while it is written, is opened by :func:`speccache.read.source.open_dataset`,
which ``CacheDataset(...)`` asks for them (``CacheDataset.__new__``).
"""

from __future__ import annotations

import errno
import functools
import operator
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from speccache.errors import CacheCorruptError, CacheFormatError, CacheIncompleteError
from speccache.format import (
    OFFSETS_KEY,
    Manifest,
    NativeShard,
    Schema,
    existing_shard_indices,
    expected_parts,
    get_encoding,
    manifest_path,
    num_shards,
    shard_path,
    validate_contiguous_shards,
)
from speccache.format.reclaim import refuse_reclaimed
from speccache.format.view import is_view
from speccache.read._checked import _Checker, _DataCheck
from speccache.read._io import _PREAD_BYTES, _cached_prefix, _ReadAhead
from speccache.read._shard import KeyLayout, Sample, SampleView, _key_layout, _OpenShard, _shared

__all__ = ["NO_VERIFY_HELP", "CacheDataset"]

NO_VERIFY_HELP = (
    "read the shards without checking the tensors read against their checksums (verify=False): a first epoch "
    "from the page cache about a third shorter, from disk within ~10%%; a damaged byte is then read as data "
    "(docs/benchmarks.md)"
)
"""The help of the ``--no-verify`` flag of the commands that read caches (``%`` doubled for argparse)."""

_OPENER: list[Callable[..., Any]] = []
"""What ``CacheDataset(...)`` hands a view or a following reader to: :func:`speccache.read.source.open_dataset`,
which that module puts here as it loads (``speccache.read`` imports it, so before any reader is made). The readers
it opens build on this module, which therefore imports none of them."""


class CacheDataset(Dataset):
    """A native cache directory as a map-style dataset of per-sample tensor dicts.

    Fixed keys come back with their per-sample shape, ragged keys at each
    sample's true length ``[T, *shape]``. Every tensor handed out is the caller's
    own. ``__getitems__`` (what a DataLoader calls for a batch) returns
    :class:`SampleView` objects; ``ds[i]`` is ``dict(ds.__getitems__([i])[0])``, so a
    subclass customises samples by overriding ``__getitems__`` alone.

    A view directory is read as the samples it selects from its sources (see ``__new__``;
    :func:`speccache.read.source.open_dataset` says which reader it returns).

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
        """A view directory (``speccache merge``/``subset``), or ``follow``, opens what
        :func:`speccache.read.source.open_dataset` opens for this class: a :class:`speccache.read.view.ViewDataset`
        whose sources are read by this class, or a :class:`speccache.read.follow.FollowDataset`."""
        # (unpickling calls __new__ without arguments)
        if cache_dir is not None and (follow is not False or is_view(cache_dir)):
            return _OPENER[0](cache_dir, *args, dataset_cls=cls, follow=follow, **kwargs)
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
