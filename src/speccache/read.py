"""Reading caches: a lazy map-style dataset and the collators that batch its samples.

:class:`CacheDataset` reads the manifest and lists the directory once; shards
are opened (one ``mmap`` each) on first use in each process, kept in an LRU of
``max_open_shards``, and never pickled, so DataLoader workers of any start
method each open their own. ``__getitems__`` (used by the DataLoader for a whole
batch) returns :class:`SampleView` objects, which only record where each sample
lies; the collators then read each sample's bytes once, straight from the shard
file into the batch tensors: long runs with ``pread`` (faulting a fresh mapping
in costs about as much as the copy itself), the uncached ones of a batch
announced to the kernel together so that the disk reads them in parallel;
short runs from the mapping. :meth:`CacheDataset.prefetch` lets a sampler
announce the next samples while a batch is read.
"""

from __future__ import annotations

import errno
import itertools
import math
import mmap
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Iterator, Mapping, MutableMapping, Sequence

import torch
from torch.utils.data import Dataset, get_worker_info

from speccache.errors import CacheCorruptError, CacheFormatError, CacheIncompleteError
from speccache.format import (
    FORMAT_VERSION,
    SHARD_META_CHECKSUMS,
    Schema,
    ShardFile,
    bytes_view,
    check_cache_name,
    check_format_version,
    existing_shard_indices,
    file_checksum,
    load_manifest_json,
    manifest_counts,
    manifest_path,
    num_shards,
    schema_from_json,
    shard_path,
    shard_table,
    validate_contiguous_shards,
)
from speccache.shard import NativeShard, verify_tensor_checksums

Sample = dict[str, torch.Tensor]

__all__ = ["CacheDataset", "PadCollator", "PackCollator", "Sample", "SampleView"]


class _SeedShard:
    """A shard of the seed layout (fixed keys stacked ``[n, ...]``), read with the native interface."""

    def __init__(self, path: str, keys: Sequence[str], num_samples: int, verify: bool) -> None:
        self.file = ShardFile(path)
        if verify and SHARD_META_CHECKSUMS in self.file.metadata:
            verify_tensor_checksums(self.file)
        self.path = path
        self.num_samples = num_samples
        self.row_offsets = list(range(num_samples + 1))
        for key in keys:
            if key not in self.file.entries:
                raise CacheFormatError(
                    f"{path}: has no tensor {key!r} (it holds {sorted(self.file.keys())}). "
                    "Re-run the producer that wrote this cache, or read the keys it has."
                )
            rows = self.file.entries[key][1][:1]
            if rows != (num_samples,):
                raise CacheFormatError(f"{path}: tensor {key!r} holds {rows[0] if rows else 0} samples, expected {num_samples}")

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.file.tensor(name)[start:end]


@dataclass(frozen=True)
class _KeyInfo:
    """How one key's samples are laid out: ``shape`` is per row of a ragged key, per sample of a fixed one."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    ragged: bool
    row_bytes: int


def _key_info(dtype: torch.dtype, shape: tuple[int, ...], ragged: bool) -> _KeyInfo:
    return _KeyInfo(dtype, tuple(shape), ragged, math.prod(shape) * dtype.itemsize)


class _OpenShard:
    """A shard opened by a :class:`CacheDataset`: its decoder plus what reading raw rows from the file needs."""

    __slots__ = ("shard", "path", "keys", "infos", "bases", "mapped", "long", "row_offsets", "fd")

    def __init__(self, shard: Any, keys: tuple[str, ...], infos: dict[str, _KeyInfo], raw: Sequence[str]) -> None:
        self.shard = shard
        self.path: str = shard.path
        self.keys = keys
        self.infos = infos
        entries = shard.file.entries
        self.bases: dict[str, int | None] = {k: None for k in keys}
        """File offset of each raw key's first row; ``None`` for an encoded key (decoded through the shard)."""
        self.bases.update({k: shard.file.data_start + entries[k][2] for k in raw})
        self.mapped = {k: bytes_view(shard.file.tensor(k)) for k in raw}
        """The bytes of each raw key in the shard's mapping."""
        self.row_offsets: list[int] = shard.row_offsets
        most = max((b - a for a, b in zip(self.row_offsets, self.row_offsets[1:])), default=0)
        self.long = {
            k: shard.file.data_start + entries[k][2]
            for k in raw
            if (most if infos[k].ragged else 1) * infos[k].row_bytes >= _PREAD_BYTES
        }
        """The file offsets of the raw keys with samples long enough for ``pread``, which :meth:`CacheDataset.prefetch` announces."""
        self.fd: int = shard.file.handle.fileno()  # the file the mapping shows, kept open by the shard

    def span(self, key: str, local: int) -> tuple[int, int]:
        """Byte range of sample ``local``'s rows of raw key ``key``, from the key's first row."""
        info = self.infos[key]
        if info.ragged:
            return self.row_offsets[local] * info.row_bytes, self.row_offsets[local + 1] * info.row_bytes
        return local * info.row_bytes, (local + 1) * info.row_bytes

    def sample(self, key: str, local: int) -> torch.Tensor:
        """Sample ``local``'s tensor of ``key``: a view of the mapping, or decoded."""
        rows = self.shard.rows(key, local, local + 1)
        return rows if self.infos[key].ragged else rows[0]


class SampleView(MutableMapping[str, torch.Tensor]):
    """One sample of a :class:`CacheDataset`, as returned by ``__getitems__``: a dict of tensors made on access.

    Reading a key returns a view of the shard's mapping (decoded for encoded keys);
    keys can be set and removed like a dict's. Collators copy the keys left as
    read straight from the shard file into the batch, so a batch costs no
    per-sample tensors. Pickling turns it into a plain ``dict``.
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
"""Runs of rows at least this long are read with ``pread`` (announcing the uncached ones first, ``POSIX_FADV_WILLNEED``).

Shorter ones are copied from the mapping: a syscall each would cost more than the
copy, and a fault on a cold page reads its neighbours too (read-around).
"""

_advise = getattr(os, "posix_fadvise", None)
_ADVICE_BYTES = 128 << 10
"""The kernel reads at most its read-ahead size (128 KiB by default) per ``WILLNEED``: longer ranges are announced in pieces."""


def _will_need(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + nbytes)`` of ``fd`` into the page cache."""
    if _advise is None:
        return
    end = offset + nbytes
    while offset < end:
        _advise(fd, offset, min(_ADVICE_BYTES, end - offset), os.POSIX_FADV_WILLNEED)
        offset += _ADVICE_BYTES


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
                f"{source.path}: ends before byte {offset + len(dst)} that its header promises (truncated while open?). "
                "Delete the shard and re-run the producer with --resume."
            )
        done += got


class CacheDataset(Dataset):
    """A cache directory as a map-style dataset of per-sample tensor dicts.

    Fixed keys come back with their per-sample shape, ragged keys at each
    sample's true length ``[T, *shape]``.

    Args:
        cache_dir: the cache directory.
        keys: keys to read (default: every key of the schema; required for a seed-layout cache).
        cache_name: kind of cache expected; default: whatever the manifest says.
        format_version: version the caller reads (native caches: :data:`speccache.format.FORMAT_VERSION`).
        verify: check each shard's checksum the first time this process opens it.
        max_open_shards: LRU bound on open shards per process.
        allow_incomplete: read the whole shards of an unsealed cache (the contiguous prefix).

    Raises:
        FileNotFoundError: no manifest.
        CacheFormatError: wrong version or cache name, malformed manifest, missing or extra shards.
        CacheIncompleteError: the cache is not sealed and ``allow_incomplete`` is off.
    """

    def __init__(
        self,
        cache_dir: str,
        keys: Sequence[str] | None = None,
        *,
        cache_name: str | None = None,
        format_version: int = FORMAT_VERSION,
        verify: bool = False,
        max_open_shards: int = 64,
        allow_incomplete: bool = False,
    ) -> None:
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.cache_dir = cache_dir
        manifest = load_manifest_json(manifest_path(cache_dir))
        recorded = manifest.get("cache_name")
        if cache_name is None:
            cache_name = recorded if isinstance(recorded, str) else os.path.basename(os.path.normpath(cache_dir))
        self.cache_name = cache_name
        check_format_version(manifest, cache_dir, cache_name, format_version)
        self.manifest = manifest
        self.shard_size, self.num_samples = manifest_counts(self.manifest, f"{cache_dir}/manifest.json")
        self.native = "keys" in self.manifest
        if self.native:
            check_cache_name(self.manifest, cache_dir, cache_name)
        self.verify = verify
        self.max_open_shards = max_open_shards
        if self.native:
            schema = schema_from_json(self.manifest["keys"], f"{cache_dir}/manifest.json")
            keys = list(schema) if keys is None else list(keys)
            unknown = [k for k in keys if k not in schema]
            if unknown:
                raise CacheFormatError(f"{cache_dir}: keys {unknown} are not in the cache; it holds {sorted(schema)}")
            self.schema: Schema = {k: schema[k] for k in keys}
            self._shard_schema: Schema = schema  # shards hold every key; only self.keys are read
        elif keys is None:
            raise CacheFormatError(
                f"{cache_dir}: a cache without a key schema ('keys' in its manifest, as in seed-layout caches) "
                "needs the keys to read (disk_keys)"
            )
        else:
            self.schema = {}
            self._shard_schema = {}
        self.keys: tuple[str, ...] = tuple(keys)
        table = shard_table(self.manifest, f"{cache_dir}/manifest.json") if self.native else {}
        self._checksums = {index: row.get("xxh3_128") for index, row in table.items()}
        if self.native and self.manifest.get("complete") is not True:
            if not allow_incomplete:
                raise CacheIncompleteError(
                    f"cache at {cache_dir} is not complete: it is still being written or its writer was interrupted. "
                    "Finish it by re-running the same precompute command with --resume (or pass allow_incomplete=True "
                    "to read its whole shards)."
                )
            self.num_samples = _complete_prefix(cache_dir, self.num_samples, self.shard_size)
        else:
            validate_contiguous_shards(cache_dir, self.cache_name, self.num_samples, self.shard_size)
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._infos: dict[tuple[tuple[str, _KeyInfo], ...], dict[str, _KeyInfo]] = {}

    @property
    def ragged_keys(self) -> frozenset[str]:
        """Keys whose samples have their own number of rows."""
        return frozenset(k for k, s in self.schema.items() if s.ragged)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _shard(self, index: int) -> Any:
        """The open shard ``index`` (a :class:`speccache.shard.NativeShard` or a seed-layout shard)."""
        return self._open_shard(index).shard

    def _open_shard(self, index: int) -> _OpenShard:
        opened = self._open.get(index)
        if opened is not None:
            self._open.move_to_end(index)
            return opened
        path = shard_path(self.cache_dir, index)
        expected = min(self.shard_size, self.num_samples - index * self.shard_size)
        if self.verify and self._checksums.get(index) and file_checksum(path) != self._checksums[index]:
            raise CacheCorruptError(
                f"{path}: file checksum differs from the manifest's shard table (damaged shard). "
                "Delete it and re-run the producer with --resume."
            )
        if self.native:
            shard = NativeShard(path, self._shard_schema, index, expected, verify=self.verify and not self._checksums.get(index))
        else:
            shard = _SeedShard(path, self.keys, expected, self.verify)
        opened = self._wrap(shard)
        self._open[index] = opened
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return opened

    def _wrap(self, shard: Any) -> _OpenShard:
        entries = shard.file.entries
        if self.native:
            infos = {k: _key_info(s.dtype, s.shape, s.ragged) for k, s in self.schema.items()}
            raw = [k for k in self.keys if self.schema[k].encoding == "raw"]
        else:
            infos = {k: _key_info(entries[k][0], entries[k][1][1:], False) for k in self.keys}
            raw = list(self.keys)
        # Shards with the same layout share one dict, so a collator checks a batch with one identity test per sample.
        infos = self._infos.setdefault(tuple(infos.items()), infos)
        return _OpenShard(shard, self.keys, infos, raw)

    def __getitem__(self, index: int) -> Sample:
        """One sample, copied out of the shard (through a subclass's ``__getitems__``, if it has one)."""
        fetch = self.__getitems__ if type(self).__getitems__ is not CacheDataset.__getitems__ else self._views
        return {k: v.clone() for k, v in fetch([index])[0].items()}

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """Samples at ``indices`` (in that order) as :class:`SampleView` objects; their tensors are read-only by contract.

        A subclass that overrides ``__getitem__`` but not ``__getitems__`` (as the seed's readers
        do) gets ``[self[i] for i in indices]``, so batched DataLoaders, which call
        ``__getitems__``, still go through its ``__getitem__``.
        """
        cls = type(self)
        if cls.__getitem__ is not CacheDataset.__getitem__ and cls.__getitems__ is CacheDataset.__getitems__:
            return [self[i] for i in indices]
        return self._views(indices)

    def _views(self, indices: Sequence[int]) -> list[Sample]:
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        out: list[Sample] = []
        for index in indices:
            shard, local = self._split(index)
            out.append(SampleView(self._open_shard(shard), local))
        return out

    def _split(self, index: int) -> tuple[int, int]:
        """``(shard, sample within the shard)`` of sample ``index`` (negative counts from the end)."""
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index out of range for a cache of {self.num_samples} samples")
        return divmod(i, self.shard_size)

    def prefetch(self, indices: Iterable[int]) -> None:
        """Ask the kernel to start reading these samples' long raw rows into the page cache; returns at once.

        The ``prefetch`` hook of :class:`speccache.sampler.LocalityShuffleSampler`, which
        announces the next samples while the current batch is read, so that the disk
        never waits for the reader. Only reads that would go to ``pread`` and are not
        cached are announced; short ones rely on the kernel's read-around of the mapping.
        """
        probe = memoryview(bytearray(1))
        for index in indices:
            shard, local = self._split(index)
            opened = self._open_shard(shard)
            for key, base in opened.long.items():
                start, end = opened.span(key, local)
                if end - start >= _PREAD_BYTES and not _cached_prefix(opened, probe, base + start):
                    _will_need(opened.fd, base + start, end - start)

    def sample_lengths(self) -> list[int]:
        """Rows of each sample's ragged keys (all 1 when no key is ragged); reads only shard offsets."""
        lengths: list[int] = []
        for index in range(num_shards(self.num_samples, self.shard_size)):
            o = self._shard(index).row_offsets
            lengths.extend(o[i + 1] - o[i] for i in range(len(o) - 1))
        return lengths


def _complete_prefix(cache_dir: str, num_samples: int, shard_size: int) -> int:
    present = existing_shard_indices(cache_dir)
    k = 0
    while k in present:
        k += 1
    return min(k * shard_size, num_samples)


# ---------------------------------------------------------------------------
# collation


def _pin() -> bool:
    # Pinning from a worker process would initialise CUDA there; the DataLoader pins in the main process.
    return torch.cuda.is_available() and get_worker_info() is None


class _BufferPool:
    """Hands out batch tensors in memory that earlier batches no longer use.

    Fresh memory costs a page fault per 4 KiB page on first write, about as much
    as copying the data into it; pinned batches get reused memory from CUDA's
    host allocator, and this gives the unpinned ones of the main process the
    same. A buffer is reused only once nothing references it: every tensor made
    from it (views included) holds a reference to its ``mmap`` through its storage.
    Anonymous mappings rather than numpy arrays: numpy asks for transparent huge
    pages, into which the kernel copies file data at half the speed.
    """

    MIN_BYTES = 1 << 20
    CAPACITY = 8

    def __init__(self) -> None:
        self._buffers: list[mmap.mmap] = []
        self._idle_refs: list[int] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor; plain ``torch.empty`` below :attr:`MIN_BYTES` or when every buffer is in use."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:  # until the tensor holds its buffer, another thread would find the buffer idle
            buffer = self._take(nbytes)
            if buffer is None:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def _take(self, nbytes: int) -> mmap.mmap | None:
        idle = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) == self._idle_refs[i]]
        fitting = [i for i in idle if len(self._buffers[i]) >= nbytes]
        if fitting:
            return self._buffers[min(fitting, key=lambda i: len(self._buffers[i]))]
        if len(self._buffers) >= self.CAPACITY:
            if not idle:
                return None
            smallest = min(idle, key=lambda i: len(self._buffers[i]))
            self._buffers.pop(smallest).close()
            del self._idle_refs[smallest]
        # Room for batches somewhat longer than this one, so that varying lengths still find a buffer. Private:
        # a process forked from this one must not write into this one's batches.
        self._buffers.append(mmap.mmap(-1, nbytes + nbytes // 4, flags=mmap.MAP_PRIVATE))
        self._idle_refs.append(sys.getrefcount(self._buffers[-1]))
        return self._buffers[-1]


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, pool: _BufferPool | None) -> torch.Tensor:
    """An uninitialised batch tensor: pinned if asked, in shared memory inside a DataLoader worker, else from ``pool``."""
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if get_worker_info() is not None:
        # A worker hands its batch over through shared memory; allocating it there saves a copy (as default_collate does).
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
    return pool.empty(shape, dtype) if pool is not None else torch.empty(shape, dtype=dtype)


def _stack(tensors: list[torch.Tensor], pin: bool, pool: _BufferPool | None) -> torch.Tensor:
    first = tensors[0]
    return torch.stack(tensors, out=_empty((len(tensors), *first.shape), first.dtype, pin, pool))


def _view_layouts(samples: Sequence[Mapping[str, torch.Tensor]]) -> tuple[dict[str, _KeyInfo] | None, bool]:
    """The key layouts of ``samples`` if all are :class:`SampleView` objects of alike shards, and whether none was modified."""
    first = samples[0] if samples else None
    if type(first) is not SampleView:
        return None, False
    infos = first._shard.infos
    untouched = True
    for s in samples:
        if type(s) is not SampleView or s._shard.infos is not infos:
            return None, False
        untouched = untouched and s._set is None and s._keys is s._shard.keys
    return infos, untouched


def _readable(
    samples: Sequence[Any], infos: dict[str, _KeyInfo] | None, untouched: bool, key: str, ragged: bool
) -> _KeyInfo | None:
    """``key``'s layout when every sample holds it as read from its shard and it is ``ragged`` as the collator treats it."""
    info = infos.get(key) if infos is not None else None
    if info is None or info.ragged != ragged:
        return None
    return info if untouched or all(s._as_read(key) for s in samples) else None


def _row_counts(samples: Sequence[Any]) -> list[int]:
    counts = []
    for s in samples:
        offsets, local = s._shard.row_offsets, s._local
        counts.append(offsets[local + 1] - offsets[local])
    return counts


def _read_into(out: torch.Tensor, samples: Sequence[Any], key: str, info: _KeyInfo, dst: Sequence[int]) -> None:
    """Copy each sample's rows of ``key`` into the bytes of ``out``, sample ``i`` from byte ``dst[i]``."""
    mv = bytes_view(out)
    large: list[tuple[_OpenShard, int, int, int]] = []
    encoded: list[tuple[Any, int]] = []
    row_bytes = info.row_bytes
    for s, d in zip(samples, dst):
        source, local = s._shard, s._local
        base = source.bases[key]
        if base is None:
            encoded.append((s, d))
            continue
        # _OpenShard.span, inlined: this runs for every sample and key of a batch.
        if info.ragged:
            start, end = source.row_offsets[local] * row_bytes, source.row_offsets[local + 1] * row_bytes
        else:
            start = local * row_bytes
            end = start + row_bytes
        if end - start >= _PREAD_BYTES:
            large.append((source, base + start, end - start, d))
        else:
            mv[d : d + end - start] = source.mapped[key][start:end]
    # What is cached is copied at once; the rest is announced as a whole, so the disk works on every miss
    # of the batch at the same time, and then read in order.
    missed: list[tuple[_OpenShard, int, int, int]] = []
    for source, offset, nbytes, d in large:
        got = _cached_prefix(source, mv[d : d + nbytes], offset)
        if got < nbytes:
            missed.append((source, offset + got, nbytes - got, d + got))
    if len(missed) > 1:
        for source, offset, nbytes, _ in missed:
            _will_need(source.fd, offset, nbytes)
    for source, offset, nbytes, d in missed:
        _pread_into(source, mv[d : d + nbytes], offset)
    if encoded:
        _decode_into(mv, encoded, key, info)


def _decode_into(mv: memoryview, members: list[tuple[Any, int]], key: str, info: _KeyInfo) -> None:
    """Decode encoded samples into ``mv``, a run of rows per shard when its samples lie close together."""
    groups: dict[int, tuple[_OpenShard, list[tuple[int, int]]]] = {}
    for s, d in members:
        groups.setdefault(id(s._shard), (s._shard, []))[1].append((s._local, d))
    for source, locals_ in groups.values():
        locals_.sort()
        lo, hi = locals_[0][0], locals_[-1][0] + 1
        spans = [(lo, hi, locals_)] if hi - lo <= 4 * len(locals_) else [(i, i + 1, [(i, d)]) for i, d in locals_]
        offsets = source.row_offsets
        for a, b, part in spans:
            block = source.shard.rows(key, a, b)
            for local, d in part:
                rows = block[offsets[local] - offsets[a] : offsets[local + 1] - offsets[a]] if info.ragged else block[local - a]
                data = bytes_view(rows.contiguous())
                mv[d : d + len(data)] = data


_ZEROS = memoryview(bytes(1 << 16))


def _pad_rows(out: torch.Tensor, lengths: list[int], pad: float | int | bool) -> None:
    """Fill rows ``lengths[b]:`` of each ``out[b]`` with ``pad``."""
    longest = out.shape[1]
    shortest = min(lengths)
    row_bytes = math.prod(out.shape[2:]) * out.element_size()
    if shortest == longest or not row_bytes:
        return
    row_shape = out.shape[2:]
    if bytes(bytes_view(torch.empty((1, *row_shape), dtype=out.dtype).fill_(pad))) == bytes(row_bytes):
        fill = _ZEROS  # zero bytes come from one fixed block, copied as often as needed
    else:
        fill = bytes_view(torch.empty((longest - shortest, *row_shape), dtype=out.dtype).fill_(pad))
    mv = bytes_view(out)
    stride = longest * row_bytes
    for b, n in enumerate(lengths):
        position, end = b * stride + n * row_bytes, (b + 1) * stride
        while position < end:
            step = min(end - position, len(fill))
            mv[position : position + step] = fill[:step]
            position += step


class _Collator:
    """What both collators share: fixed keys stacked, the pool of batch memory, and the batch loop.

    Subclasses say how a ragged key becomes one tensor (from the shard files or
    from sample tensors) and what describes the lengths. The pool stays in the
    process that made it.
    """

    def __init__(self, ragged_keys: Collection[str], pin_memory: bool | None = None) -> None:
        self.ragged_keys = frozenset(ragged_keys)
        self.pin_memory = pin_memory
        self._pool = _BufferPool()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pool"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = _BufferPool()

    def __call__(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        pin = _pin() if self.pin_memory is None else self.pin_memory
        infos, untouched = _view_layouts(samples)
        batch: dict[str, torch.Tensor] = {}
        lengths: list[int] | None = None
        counts: list[int] | None = None  # rows per sample, shared by every ragged key read from the shards
        for key in samples[0]:
            ragged = key in self.ragged_keys
            info = _readable(samples, infos, untouched, key, ragged)
            if not ragged:
                if info is None:
                    batch[key] = _stack([s[key] for s in samples], pin, self._pool)
                else:
                    batch[key] = out = _empty((len(samples), *info.shape), info.dtype, pin, self._pool)
                    _read_into(out, samples, key, info, range(0, len(samples) * info.row_bytes, info.row_bytes))
            elif info is not None:
                lengths = counts = counts or _row_counts(samples)
                batch[key] = self._ragged_from_files(samples, key, info, counts, pin)
            else:
                tensors = [s[key] for s in samples]
                lengths = [t.shape[0] for t in tensors]
                batch[key] = self._ragged_from_tensors(key, tensors, lengths, pin)
        if lengths is not None:
            batch.update(self._length_tensors(lengths))
        return batch

    def _ragged_from_files(self, samples: list[Sample], key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        raise NotImplementedError

    def _ragged_from_tensors(self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool) -> torch.Tensor:
        raise NotImplementedError

    def _length_tensors(self, lengths: list[int]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class PadCollator(_Collator):
    """Batches samples by padding ragged keys to the longest sample.

    Output: fixed keys stacked ``[B, *shape]``; ragged keys ``[B, T_max, *shape]``
    padded with ``pad_values[key]`` (default 0); ``lengths`` (int64 ``[B]``) and
    ``attention_mask`` (int64 ``[B, T_max]``, 1 on real rows). Keys of
    :class:`SampleView` samples are read straight from the shard files; other
    samples are copied from their tensors.

    Args:
        ragged_keys: keys to pad.
        pad_values: per-key pad value.
        pin_memory: allocate the batch in pinned memory (default: when CUDA is available, in the main process).
    """

    def __init__(
        self, ragged_keys: Collection[str], pad_values: Mapping[str, float | int | bool] | None = None, pin_memory: bool | None = None
    ) -> None:
        super().__init__(ragged_keys, pin_memory)
        self.pad_values = dict(pad_values or {})

    def _ragged_from_files(self, samples: list[Sample], key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        longest = max(lengths)
        out = _empty((len(samples), longest, *info.shape), info.dtype, pin, self._pool)
        stride = longest * info.row_bytes
        _read_into(out, samples, key, info, range(0, len(samples) * stride, stride))
        _pad_rows(out, lengths, self.pad_values.get(key, 0))
        return out

    def _ragged_from_tensors(self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool) -> torch.Tensor:
        first = tensors[0]
        out = _empty((len(tensors), max(lengths), *first.shape[1:]), first.dtype, pin, self._pool)
        pad = self.pad_values.get(key, 0)
        for row, t in zip(out, tensors):
            row[: t.shape[0]].copy_(t)
            row[t.shape[0] :].fill_(pad)
        return out

    def _length_tensors(self, lengths: list[int]) -> dict[str, torch.Tensor]:
        lens = torch.tensor(lengths, dtype=torch.int64)
        return {"lengths": lens, "attention_mask": (torch.arange(max(lengths)).unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64)}


class PackCollator(_Collator):
    """Batches samples by concatenating ragged keys (no padding), for varlen attention.

    Output: ragged keys ``[sum T, *shape]``, ``cu_seqlens`` (int32 ``[B + 1]``),
    ``lengths`` (int64 ``[B]``); fixed keys stacked ``[B, *shape]``. Reads
    :class:`SampleView` samples as :class:`PadCollator` does.

    Args:
        ragged_keys: keys to concatenate.
        pin_memory: as for :class:`PadCollator`.
    """

    def _ragged_from_files(self, samples: list[Sample], key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        out = _empty((sum(lengths), *info.shape), info.dtype, pin, self._pool)
        starts = itertools.accumulate(lengths[:-1], initial=0)
        _read_into(out, samples, key, info, [start * info.row_bytes for start in starts])
        return out

    def _ragged_from_tensors(self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool) -> torch.Tensor:
        first = tensors[0]
        out = _empty((sum(lengths), *first.shape[1:]), first.dtype, pin, self._pool)
        return torch.cat(tensors, out=out)

    def _length_tensors(self, lengths: list[int]) -> dict[str, torch.Tensor]:
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        return {"lengths": lens, "cu_seqlens": cu}
