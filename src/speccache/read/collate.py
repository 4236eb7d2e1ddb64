"""Collators: a batch of samples into tensors, padded (:class:`PadCollator`) or packed (:class:`PackCollator`).

Samples that are :class:`speccache.read.SampleView` objects are read
straight from the shard files into the batch tensors (one copy of each byte);
other samples are copied from their tensors. Both paths give the same bytes.
"""

from __future__ import annotations

import itertools
import math
import mmap
import sys
import threading
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info

from speccache.format import bytes_view
from speccache.read._batch import BatchRows, batch_rows, read_into, readable_layout
from speccache.read._shard import Sample

__all__ = ["PadCollator", "PackCollator"]


def _pin() -> bool:
    # Pinning from a worker process would initialise CUDA there; the DataLoader pins in the main process.
    return torch.cuda.is_available() and get_worker_info() is None


class BufferPool:
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


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, pool: BufferPool | None) -> torch.Tensor:
    """An uninitialised batch tensor: pinned if asked, in shared memory in a DataLoader worker, else from ``pool``."""
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if get_worker_info() is not None:
        # A worker hands its batch over through shared memory; allocating it there saves a copy (as default_collate).
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
    return pool.empty(shape, dtype) if pool is not None else torch.empty(shape, dtype=dtype)


def _stack(tensors: list[torch.Tensor], pin: bool, pool: BufferPool | None) -> torch.Tensor:
    first = tensors[0]
    return torch.stack(tensors, out=batch_tensor((len(tensors), *first.shape), first.dtype, pin, pool))


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
        if pin_memory and not torch.cuda.is_available():
            # as torch's DataLoader does: pinning needs an accelerator; without one, warn and leave memory pageable
            warnings.warn("pin_memory=True but no CUDA device is available: batches are not pinned", stacklevel=2)
            pin_memory = False
        self.pin_memory = pin_memory
        self._pool = BufferPool()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pool"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = BufferPool()

    def __call__(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        pin = _pin() if self.pin_memory is None else self.pin_memory
        rows = batch_rows(samples)
        batch: dict[str, torch.Tensor] = {}
        lengths: list[int] | None = None
        counts: list[int] | None = None  # rows per sample, shared by every ragged key read from the shards
        for key in samples[0]:
            ragged = key in self.ragged_keys
            info = readable_layout(samples, rows, key, ragged)
            if not ragged:
                if info is None:
                    batch[key] = _stack([s[key] for s in samples], pin, self._pool)
                else:
                    assert rows is not None  # readable_layout finds a layout only in a batch read from shards
                    batch[key] = out = batch_tensor((len(samples), *info.shape), info.dtype, pin, self._pool)
                    read_into(out, rows, key, info, [i * info.row_bytes for i in range(len(samples))])
            elif info is not None:
                assert rows is not None
                lengths = counts = counts or rows.counts()
                batch[key] = self._ragged_from_files(rows, key, info, counts, pin)
            else:
                tensors = [s[key] for s in samples]
                lengths = [t.shape[0] for t in tensors]
                batch[key] = self._ragged_from_tensors(key, tensors, lengths, pin)
        if lengths is not None:
            batch.update(self._length_tensors(lengths))
        return batch

    def _ragged_from_files(self, rows: BatchRows, key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        raise NotImplementedError

    def _ragged_from_tensors(
        self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool
    ) -> torch.Tensor:
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
        self,
        ragged_keys: Collection[str],
        pad_values: Mapping[str, float | int | bool] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(ragged_keys, pin_memory)
        self.pad_values = dict(pad_values or {})

    def _ragged_from_files(self, rows: BatchRows, key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        longest = max(lengths)
        out = batch_tensor((len(lengths), longest, *info.shape), info.dtype, pin, self._pool)
        stride = longest * info.row_bytes
        read_into(out, rows, key, info, [i * stride for i in range(len(lengths))])
        _pad_rows(out, lengths, self.pad_values.get(key, 0))
        return out

    def _ragged_from_tensors(
        self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool
    ) -> torch.Tensor:
        first = tensors[0]
        out = batch_tensor((len(tensors), max(lengths), *first.shape[1:]), first.dtype, pin, self._pool)
        pad = self.pad_values.get(key, 0)
        for row, t in zip(out, tensors):
            row[: t.shape[0]].copy_(t)
            row[t.shape[0] :].fill_(pad)
        return out

    def _length_tensors(self, lengths: list[int]) -> dict[str, torch.Tensor]:
        lens = torch.tensor(lengths, dtype=torch.int64)
        return {
            "lengths": lens,
            "attention_mask": (torch.arange(max(lengths)).unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64),
        }


class PackCollator(_Collator):
    """Batches samples by concatenating ragged keys (no padding), for varlen attention.

    Output: ragged keys ``[sum T, *shape]``, ``cu_seqlens`` (int32 ``[B + 1]``),
    ``lengths`` (int64 ``[B]``); fixed keys stacked ``[B, *shape]``. Reads
    :class:`SampleView` samples as :class:`PadCollator` does.

    Args:
        ragged_keys: keys to concatenate.
        pin_memory: as for :class:`PadCollator`.
    """

    def _ragged_from_files(self, rows: BatchRows, key: str, info: Any, lengths: list[int], pin: bool) -> torch.Tensor:
        out = batch_tensor((sum(lengths), *info.shape), info.dtype, pin, self._pool)
        starts = itertools.accumulate(lengths[:-1], initial=0)
        read_into(out, rows, key, info, [start * info.row_bytes for start in starts])
        return out

    def _ragged_from_tensors(
        self, key: str, tensors: list[torch.Tensor], lengths: list[int], pin: bool
    ) -> torch.Tensor:
        first = tensors[0]
        out = batch_tensor((sum(lengths), *first.shape[1:]), first.dtype, pin, self._pool)
        return torch.cat(tensors, out=out)

    def _length_tensors(self, lengths: list[int]) -> dict[str, torch.Tensor]:
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        return {"lengths": lens, "cu_seqlens": cu}
