"""Durable, atomic file writes and the checksums that prove a file's bytes.

A file appears under its final name only whole: it is written to a unique
sibling temporary name, fsynced, renamed, and the directory fsynced.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from speccache.format.names import TMP_MARK


def temp_path(path: str) -> str:
    """A sibling temporary name unique to this writer (host, process, random)."""
    return f"{path}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_bytes_file(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically and durably.

    Returns:
        The xxh3-128 hex digest of ``data`` (what :func:`file_checksum` gives for the file).
    """

    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, _write)
    return xxhash.xxh3_128_hexdigest(data)


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write_fn: Callable[[str], Any]) -> str:
    """Write ``path`` through a unique sibling temporary file and an atomic rename.

    ``write_fn(tmp_path)`` writes the temporary file; it is fsynced, renamed over
    ``path`` and the directory fsynced, so a crash leaves either the old file or
    the new one. If ``write_fn`` fails, the temporary file is removed and
    ``path`` is untouched.

    Returns:
        ``path``.
    """
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path)
    try:
        write_fn(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(parent)
    return path


def remove_temp_files(cache_dir: str) -> list[str]:
    """Delete temporary files left by interrupted writers; return their names.

    Only the lock holder may call this: another live writer's temp files would go too.
    """
    if not os.path.isdir(cache_dir):
        return []
    removed = [name for name in os.listdir(cache_dir) if TMP_MARK in name or name.endswith(".tmp")]
    for name in removed:
        try:
            os.unlink(os.path.join(cache_dir, name))
        except (FileNotFoundError, IsADirectoryError):
            pass
    return removed


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-128 hex digest of a contiguous tensor's bytes."""
    return xxhash.xxh3_128_hexdigest(bytes_view(tensor))


def file_checksum(path: str, chunk_bytes: int = 16 << 20) -> str:
    """xxh3-128 hex digest of a file, streamed."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        # no bigger than the file: zeroing a 16 MiB buffer costs more than hashing a small shard
        buf = bytearray(max(1, min(chunk_bytes, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()
