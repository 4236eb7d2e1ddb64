"""Safetensors files written and read directly: header, then one ``mmap``.

Shards are plain safetensors files, written and read here rather than through
``safetensors.torch`` so that a file is hashed while it is written (no second
pass) and a batch of rows is a zero-copy slice of the mapping; tests check both
directions against the ``safetensors`` library.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import xxhash

from speccache.errors import CacheCorruptError
from speccache.format.durable import atomic_write, bytes_view
from speccache.format.names import MAX_ELEMENTS, MAX_HEADER_BYTES
from speccache.format.schema import dtype_of_safetensors_code, safetensors_code

__all__ = ["ShardFile", "WrittenFile", "safetensors_prefix", "write_safetensors"]


@dataclass(frozen=True)
class WrittenFile:
    """What writing a safetensors file produced."""

    path: str
    bytes: int
    checksum: str


def write_safetensors(
    path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> WrittenFile:
    """Write ``tensors`` as a safetensors file at ``path`` (atomically), hashing it as it goes.

    Tensors are laid out by element size (largest first), then name, so every
    tensor starts aligned to its element size and reads back as a zero-copy view;
    each must be a CPU tensor of a storable dtype.

    Returns:
        The path, the file size and the xxh3-128 of the whole file.
    """
    prefix, names = safetensors_prefix({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)
    offset = 0
    views = []
    for name in names:
        t = tensors[name]
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        view = bytes_view(t)
        offset += view.nbytes
        views.append(view)
    hasher = xxhash.xxh3_128()

    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            _write_hashed(f, hasher, prefix)
            for view in views:
                _write_hashed(f, hasher, view)

    atomic_write(path, _write)
    return WrittenFile(path=path, bytes=len(prefix) + offset, checksum=hasher.hexdigest())


def safetensors_prefix(
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The bytes :func:`write_safetensors` puts before the data of tensors of these dtypes and shapes.

    Size estimates build it from shapes alone, so it must stay the one place the header is made.

    Returns:
        ``(length field + JSON header, tensor names in data order)``.
    """
    names = sorted(layout, key=lambda n: (-layout[n][0].itemsize, n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in names:
        dtype, shape = layout[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": safetensors_code(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, names


def _write_hashed(f: BinaryIO, hasher: xxhash.xxh3_128, data: bytes | memoryview) -> None:
    hasher.update(data)
    f.write(data)


class ShardFile:
    """A safetensors file opened for reading: parsed header and one read-only mapping.

    Tensors are zero-copy views of the mapping. The header is checked against the
    file size, so a truncated or padded file fails here with :class:`CacheCorruptError`
    rather than returning short data.

    Args:
        path: the file.

    Raises:
        FileNotFoundError: no such file.
        CacheCorruptError: the header is unreadable or does not match the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # The file stays open (closed with this object) so that readers pread through the same file the
        # mapping shows, instead of opening it a second time and checking it is still the same file.
        f = self.handle = open(path, "rb")
        try:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CacheCorruptError(
                    f"{path}: file is {size} bytes, too short for a safetensors header (truncated?)"
                )
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise CacheCorruptError(
                    f"{path}: header length {header_len} exceeds the file size {size} "
                    "(truncated or not a safetensors file)"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise CacheCorruptError(f"{path}: safetensors header is not valid JSON ({exc})") from None
            if not isinstance(header, dict):
                raise CacheCorruptError(f"{path}: safetensors header is not a JSON object")
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise CacheCorruptError(f"{path}: safetensors __metadata__ must map strings to strings")
            self.metadata: dict[str, str] = meta
            self.data_start = 8 + header_len
            self.entries = _check_entries(path, header, size - self.data_start)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > self.data_start else None
        except BaseException:
            f.close()
            raise
        self.size = size
        self._buf = (
            torch.frombuffer(self._mm, dtype=torch.uint8) if self._mm is not None else torch.empty(0, dtype=torch.uint8)
        )
        self._views: dict[str, torch.Tensor] = {}

    def keys(self) -> Iterable[str]:
        """Tensor names in the file."""
        return self.entries.keys()

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of tensor ``name``.

        Raises:
            KeyError: no such tensor.
        """
        view = self._views.get(name)
        if view is None:
            dtype, shape, begin, end = self.entries[name]
            raw = self._buf[self.data_start + begin : self.data_start + end]
            if (self.data_start + begin) % dtype.itemsize:
                raw = raw.clone()  # valid safetensors need not be aligned (speccache's own files are): copy
            view = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
            self._views[name] = view
        return view

    def tensor_bytes(self, name: str) -> memoryview:
        """Zero-copy view of tensor ``name``'s bytes in the mapping (cheaper to make than :meth:`tensor`).

        Raises:
            KeyError: no such tensor.
        """
        _, _, begin, end = self.entries[name]
        if self._mm is None or begin == end:
            return memoryview(b"")
        return memoryview(self._mm)[self.data_start + begin : self.data_start + end]

    def close(self) -> None:
        """Close the file; the mapping goes once no tensor made from it is left."""
        self._views.clear()
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._mm = None
        self.handle.close()

    def __getstate__(self) -> None:
        raise TypeError("ShardFile holds a memory mapping and cannot be pickled; reopen it by path")


def _check_entries(
    path: str, header: dict[str, Any], data_len: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype = dtype_of_safetensors_code(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise CacheCorruptError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        if math.prod(d for d in shape if d) >= MAX_ELEMENTS:  # an empty tensor's other dimensions still make strides
            raise CacheCorruptError(
                f"{path}: tensor {name!r} header says shape {list(shape)}, which no tensor can have"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            raise CacheCorruptError(
                f"{path}: tensor {name!r} header says shape {list(shape)} but spans bytes [{begin}, {end})"
            )
        entries[name] = (dtype, shape, begin, end)
        spans.append((begin, end))
    spans.sort()
    position = 0
    for begin, end in spans:
        if begin != position:
            raise CacheCorruptError(f"{path}: tensor data is not contiguous at byte {position} (damaged header)")
        position = end
    if position != data_len:
        state = "truncated" if position > data_len else "longer than its header says"
        raise CacheCorruptError(
            f"{path}: file is {state} (header covers {position} data bytes, file has {data_len}). "
            "Delete the shard and re-run the producer with --resume."
        )
    return entries
