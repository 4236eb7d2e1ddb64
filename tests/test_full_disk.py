"""A full disk: a write that fails for lack of space stops cleanly and a resume completes the cache.

The disk is simulated in-process: ``open`` in the modules of :mod:`speccache.format`
that write every shard, side file and manifest (:mod:`speccache.format.safetensors_file`
and :mod:`speccache.format.manifest`) is replaced by one whose files share a byte
budget; the write that crosses it writes what fits, then fails with ``ENOSPC``, as
a real full filesystem does. (The real-kernel variant, a file-size limit in a
separate producer process failing with ``EFBIG``, is in tests/test_crash.py.)

After the failure: the error names the shard (or the manifest), no shard is left
under a final name unless whole and correct, no temporary file is left, the lock
is released; once space returns, ``resume`` writes the cache byte-identical to an
uninterrupted run.
"""

from __future__ import annotations

import builtins
import errno
import json
import os

import pytest

import speccache.format as fmt
import speccache.format.manifest as manifest_module
import speccache.format.safetensors_file as safetensors_module
from speccache.errors import CacheExistsError, ShardWriteError
from speccache.format.lock import LOCK_NAME
from speccache.read.verify import verify_cache
from speccache.testing.synthetic import write_synthetic_cache
from support.cachecmp import file_tree

ARGS = dict(num_samples=40, shard_size=4, hidden=32, max_len=32)
WRITING_MODULES = (manifest_module, safetensors_module)
"""The modules whose ``open`` writes every file of a cache but the lock."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "cache")
    write_synthetic_cache(path, overlap=False, **ARGS)
    return file_tree(path)


class _Disk:
    """A byte budget shared by every file :data:`WRITING_MODULES` open for writing."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.failures = 0

    def open(self, file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if "w" not in mode and "a" not in mode:
            return f
        disk = self
        real_write = f.write

        def write(data):
            size = len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
            if size > disk.free:
                fits = disk.free
                if fits:
                    real_write(data[:fits] if isinstance(data, str) else memoryview(data).cast("B")[:fits])
                disk.free = 0
                disk.failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            disk.free -= size
            return real_write(data)

        class _File:
            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        wrapper = _File()
        wrapper.write = write  # type: ignore[attr-defined]
        return wrapper


def _fill_disk(monkeypatch, disk: _Disk) -> None:
    """From now on (until ``monkeypatch.undo()``), cache files are written to ``disk``."""
    for module in WRITING_MODULES:
        monkeypatch.setattr(module, "open", disk.open, raising=False)


def _check_clean(path: str, reference: dict[str, bytes]) -> None:
    for name, data in file_tree(path).items():
        assert fmt.TMP_MARK not in name, f"temporary file {name} left behind"
        assert name != LOCK_NAME, "the lock was not released"
        if fmt.SHARD_RE.match(name):
            assert data == reference[name], f"{name} under its final name is not the whole, correct shard"


def _unsealed_manifest_bytes(reference) -> int:
    """Size of the unsealed manifest ``CacheWriter.writing`` writes before any shard."""
    manifest = json.loads(reference["manifest.json"])
    for key in ("shards", "num_tokens", "total_bytes"):
        manifest.pop(key)
    manifest["complete"] = False
    return len(json.dumps(manifest, indent=2, sort_keys=True)) + 1


def _shard_bytes(reference) -> list[int]:
    return [len(data) for name, data in sorted(reference.items()) if fmt.SHARD_RE.match(name)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("where", ["first shard", "middle shard", "last shard"])
def test_disk_full_during_a_shard_write(tmp_path, monkeypatch, reference, overlap, where):
    sizes = _shard_bytes(reference)
    manifest = _unsealed_manifest_bytes(reference)
    failing = {"first shard": 0, "middle shard": len(sizes) // 2, "last shard": len(sizes) - 1}[where]
    disk = _Disk(manifest + sum(sizes[:failing]) + sizes[failing] // 2)
    _fill_disk(monkeypatch, disk)
    out = str(tmp_path / "cache")
    with pytest.raises(ShardWriteError) as info:
        write_synthetic_cache(out, overlap=overlap, **ARGS)
    message = str(info.value)
    assert f"shard-{failing:06d}.safetensors" in message and "No space left on device" in message, message
    assert "--resume" in message, message
    assert disk.failures == 1
    _check_clean(out, reference)
    assert sorted(n for n in os.listdir(out) if fmt.SHARD_RE.match(n)) == [
        f"shard-{i:06d}.safetensors" for i in range(failing)
    ]
    monkeypatch.undo()  # space returns
    with pytest.raises(CacheExistsError):
        write_synthetic_cache(out, overlap=overlap, **ARGS)
    write_synthetic_cache(out, overlap=overlap, resume=True, **ARGS)
    assert file_tree(out) == reference
    assert verify_cache(out).ok


@pytest.mark.parametrize("when", ["begin", "seal"])
def test_disk_full_during_a_manifest_write(tmp_path, monkeypatch, reference, when):
    sizes = _shard_bytes(reference)
    begin = _unsealed_manifest_bytes(reference)
    disk = _Disk(begin // 2 if when == "begin" else begin + sum(sizes) + 500)
    _fill_disk(monkeypatch, disk)
    out = str(tmp_path / "cache")
    with pytest.raises(OSError) as info:
        write_synthetic_cache(out, overlap=False, **ARGS)
    assert info.value.errno == errno.ENOSPC
    assert disk.failures == 1
    _check_clean(out, reference)
    assert not os.path.exists(os.path.join(out, "manifest.json")) or when == "seal"
    monkeypatch.undo()
    write_synthetic_cache(out, overlap=False, resume=True, **ARGS)
    assert file_tree(out) == reference


def test_repeated_disk_full_then_resume(tmp_path, monkeypatch, reference):
    """Space runs out again and again (shared scratch); every resume makes progress, and the end is identical."""
    out = str(tmp_path / "cache")
    sizes = _shard_bytes(reference)
    budget = _unsealed_manifest_bytes(reference) + 3 * max(sizes)
    resume = False
    for attempt in range(len(sizes) + 2):
        disk = _Disk(budget)
        _fill_disk(monkeypatch, disk)
        try:
            write_synthetic_cache(out, overlap=bool(attempt % 2), resume=resume, **ARGS)
        except (ShardWriteError, OSError):
            _check_clean(out, reference)
            resume = True
            continue
        finally:
            monkeypatch.undo()
        break
    else:
        pytest.fail("the resumes made no progress")
    assert attempt > 1
    assert file_tree(out) == reference


def test_failed_write_leaves_an_existing_shard_untouched(tmp_path, monkeypatch, reference):
    """Rewriting a shard (a resume replacing a damaged one) that fails keeps whatever was there; resume fixes it."""
    out = str(tmp_path / "cache")
    write_synthetic_cache(out, overlap=False, **ARGS)
    victim = fmt.shard_path(out, 3)
    with open(victim, "r+b") as f:
        f.seek(200)
        f.write(b"\x00\xff")
    damaged = open(victim, "rb").read()
    _fill_disk(monkeypatch, _Disk(_unsealed_manifest_bytes(reference) + 1000))
    with pytest.raises((ShardWriteError, OSError)):
        write_synthetic_cache(out, overlap=False, resume=True, **ARGS)
    assert open(victim, "rb").read() == damaged
    assert not any(fmt.TMP_MARK in n for n in os.listdir(out))
    monkeypatch.undo()
    write_synthetic_cache(out, overlap=False, resume=True, **ARGS)
    assert file_tree(out) == reference
