"""An open shard and its samples: each key's layout (:class:`KeyLayout`), what reading raw rows from the file
needs (:class:`_OpenShard`, also for NeMo's stacked files: :func:`open_stacked_file`), and :class:`SampleView`, the
sample ``CacheDataset.__getitems__`` returns, which only records where the sample lies."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speccache.errors import CacheCorruptError
from speccache.format import NativeShard, ShardFile
from speccache.read._checked import _DataCheck
from speccache.read._io import _PREAD_BYTES, _advice_bytes, _ReadAhead

Sample = dict[str, torch.Tensor]


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
