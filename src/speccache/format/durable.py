"""Durable, atomic file writes and the checksums that prove a file's bytes.

A file appears under its final name only whole: it is written to a unique
sibling temporary name, fsynced, renamed, and the directory fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

from speccache.errors import OutputError
from speccache.format.names import TEMP_RE, TMP_MARK

__all__ = [
    "apply_umask",
    "atomic_write",
    "bytes_view",
    "ensure_writable_dir",
    "file_checksum",
    "fsync_dir",
    "remove_temp_files",
    "temp_path",
    "tensor_checksum",
    "write_bytes_file",
    "writes_to",
]

_FIXES = {
    errno.EROFS: "the filesystem is read-only; choose a directory on a writable one",
    errno.EACCES: "choose a directory you may write, or fix its permissions",
    errno.EPERM: "choose a directory you may write, or fix its permissions",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ENOSPC: "free space (or choose a directory on another disk) and re-run",
    errno.EDQUOT: "free space (or raise the quota) and re-run",
    errno.EEXIST: "the path is a file; choose a directory",
    errno.ENOTDIR: "a part of the path is a file; choose a directory",
}


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


def current_umask() -> int:
    """The process's umask, read without changing it: setting it to read it would race other threads' writes."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the only other way to read it
    os.umask(mask)
    return mask


def apply_umask(path: str) -> None:
    """Give ``path`` (a file, or a directory and everything under it) the modes a plain ``open``/``mkdir`` gives
    under the user's umask: ``tempfile`` and safetensors make files 0600 and directories 0700, which other users
    of a shared model or cache could not read."""
    mask = current_umask()
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def atomic_write(path: str, write_fn: Callable[[str], Any]) -> str:
    """Write ``path`` through a unique sibling temporary file and an atomic rename.

    ``write_fn(tmp_path)`` writes the temporary file; it is fsynced, renamed over
    ``path`` and the directory fsynced, so a crash leaves either the old file or
    the new one. The file takes the user's umask (:func:`apply_umask`), whatever mode ``write_fn`` gave it.
    If ``write_fn`` fails, the temporary file is removed and
    ``path`` is untouched.

    Returns:
        ``path``.
    """
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path)
    try:
        write_fn(tmp)
        apply_umask(tmp)
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


def output_error(directory: str, exc: Exception) -> OutputError:
    """``exc``, a refused write under ``directory``, as an :class:`OutputError` naming the path and the fix."""
    code: int | None = getattr(exc, "errno", None)
    reason = getattr(exc, "strerror", None) or str(exc)
    filename = getattr(exc, "filename", None)
    name, top = None if filename is None else os.path.normpath(os.fspath(filename)), os.path.normpath(directory)
    # a file in the directory is one of our temporary names, which would tell the user nothing
    where = "" if name in (None, top) or os.path.dirname(name) == top else f" ({filename})"
    fix = (code is not None and _FIXES.get(code)) or "check that it is writable and has free space, then re-run"
    error = OutputError(f"cannot write output directory {directory}: {reason}{where}; {fix}")
    error.errno = code
    return error


@contextlib.contextmanager
def writes_to(directory: str, *also: type[Exception]) -> Iterator[None]:
    """Turn a write the operating system refuses under ``directory`` (``OSError``, or ``also``) into an
    :class:`OutputError`; atomic writes leave nothing half-written under a final name."""
    refusals: tuple[type[Exception], ...] = (OSError, *also)
    try:
        yield
    except refusals as exc:
        if isinstance(exc, OutputError):
            raise
        raise output_error(directory, exc) from None


def ensure_writable_dir(directory: str) -> None:
    """Create ``directory`` if needed and prove a file can be created in it (the probe is removed).

    Raises:
        OutputError: the operating system refused (read-only, no permission, name too long...).
    """
    with writes_to(directory):
        os.makedirs(directory, exist_ok=True)
        probe = temp_path(os.path.join(directory, ".speccache-probe"))  # a temp name: swept if a kill leaves it
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        with contextlib.suppress(FileNotFoundError):  # swept already by the writer that holds the lock
            os.unlink(probe)


def remove_temp_files(cache_dir: str) -> list[str]:
    """Delete temporary files left by interrupted writers; return their names.

    Only names a speccache writer gives its temporary files (``TEMP_RE``) are removed, never a user's file.
    Only the lock holder may call this: another live writer's temp files would go too.
    """
    if not os.path.isdir(cache_dir):
        return []
    removed = [name for name in os.listdir(cache_dir) if TEMP_RE.match(name)]
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
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


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
