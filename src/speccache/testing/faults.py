"""Fault injection for the crash tests: kill the process at a named point of the write path.

Nothing in speccache imports this module. :func:`install` wraps the atomic
writes of the manifest and of safetensors files (the names
:mod:`speccache.format.manifest` and :mod:`speccache.format.safetensors_file`
look up at call time), so that the N-th write of a kind sends the process
``SIGKILL``: no Python cleanup runs, exactly as when a scheduler kills a job.

Fault points (``POINT`` or ``POINT:N``, N 1-based, default 1):

``after_manifest_begin``
    right after an unsealed manifest (``complete: false``) is on disk.
``mid_manifest_write``
    with half of the manifest's JSON in its temporary file.
``mid_shard_write``
    with the header and half of a safetensors file's bytes in its temporary file, before the rename.
``mid_view_write``
    with half of a view's ``view.json`` in its temporary file (``speccache merge`` / ``subset``).
``before_seal``
    every shard written, before the sealed manifest is.
``after_seal``
    the sealed manifest is on disk, the lock not yet released.

``python -m speccache.testing.faults MODULE [ARGS...]`` installs the point named by the
``SPECCACHE_FAULT`` environment variable (if any), then runs ``MODULE.main(ARGS)``: how
the tests kill ``speccache.cli`` or ``speccache.testing.synthetic`` in a fresh interpreter
(or every rank under ``torchrun``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from speccache.format import durable, manifest, safetensors_file, view

ENV = "SPECCACHE_FAULT"
POINTS = (
    "after_manifest_begin",
    "mid_manifest_write",
    "mid_shard_write",
    "mid_view_write",
    "before_seal",
    "after_seal",
)

__all__ = ["ENV", "POINTS", "install", "install_from_env", "main"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _torn(path: str, write_fn: Callable[[str], Any]) -> None:
    """Leave what a writer killed half-way through leaves: a temporary file holding half the bytes."""
    tmp = durable.temp_path(path)
    write_fn(tmp)
    with open(tmp, "r+b") as f:
        f.truncate(os.fstat(f.fileno()).st_size // 2)
    _die()


def install(spec: str) -> Callable[[], None]:
    """Arm fault point ``spec`` (``POINT`` or ``POINT:N``) in this process; returns a function that disarms it.

    Raises:
        ValueError: an unknown point or a bad count.
    """
    point, _, nth = spec.partition(":")
    if point not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown fault point; choose one of {', '.join(POINTS)}")
    target = int(nth or 1)
    if target < 1:
        raise ValueError(f"{ENV}={spec!r}: the count must be >= 1")
    hits = [0]
    real_manifest_write, real_file_write, real_view_write = (
        manifest.atomic_write,
        safetensors_file.atomic_write,
        view.atomic_write,
    )

    def hit() -> bool:
        hits[0] += 1
        return hits[0] == target

    def manifest_write(path: str, write_fn: Callable[[str], Any]) -> str:
        if point == "mid_manifest_write" and hit():
            _torn(path, write_fn)
        sealed = _writes_sealed(write_fn)
        if point == "before_seal" and sealed and hit():
            _die()
        result = real_manifest_write(path, write_fn)
        if (point == "after_manifest_begin" and not sealed or point == "after_seal" and sealed) and hit():
            _die()
        return result

    def file_write(path: str, write_fn: Callable[[str], Any]) -> str:
        if point == "mid_shard_write" and hit():
            _torn(path, write_fn)
        return real_file_write(path, write_fn)

    def view_write(path: str, write_fn: Callable[[str], Any]) -> str:
        if point == "mid_view_write" and hit():
            _torn(path, write_fn)
        return real_view_write(path, write_fn)

    manifest.atomic_write = manifest_write
    safetensors_file.atomic_write = file_write
    view.atomic_write = view_write

    def disarm() -> None:
        manifest.atomic_write = real_manifest_write
        safetensors_file.atomic_write = real_file_write
        view.atomic_write = real_view_write

    return disarm


def _writes_sealed(write_fn: Callable[[str], Any]) -> bool:
    """Whether this manifest write seals the cache (its text says ``"complete": true``)."""
    probe = durable.temp_path(os.path.join(os.environ.get("TMPDIR", "/tmp"), "speccache-fault-probe"))
    try:
        write_fn(probe)
        with open(probe) as f:
            return json.load(f).get("complete") is True
    finally:
        os.unlink(probe)


def install_from_env() -> None:
    """Arm the point ``SPECCACHE_FAULT`` names, if it is set."""
    spec = os.environ.get(ENV)
    if spec:
        install(spec)


def main(argv: list[str] | None = None) -> Any:
    """``python -m speccache.testing.faults MODULE [ARGS...]``: arm ``SPECCACHE_FAULT``, run ``MODULE.main(ARGS)``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m speccache.testing.faults MODULE [ARGS...]")
    install_from_env()
    return importlib.import_module(args[0]).main(args[1:])


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
