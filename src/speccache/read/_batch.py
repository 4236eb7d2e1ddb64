"""The collators' fast path: the samples of a batch read straight from their shard files into the batch tensors,
long runs with ``pread`` (:mod:`speccache.read._io`), short ones from the mapping, encoded keys decoded in place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from speccache.format import bytes_view
from speccache.read._io import _PREAD_BYTES, _announce, _cached_prefix, _pread_into
from speccache.read._shard import KeyLayout, SampleView, _OpenShard


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
