"""One producer run over one cache directory: lock, manifest, resume, seal.

The lifecycle every native producer follows (and the crash-safety argument):

1. ``begin``: take the lock, check the directory against the run's configuration
   (nothing is written if that fails), remove temp files of dead writers, write
   the manifest with ``complete: false``, and list the shards still to compute
   (on ``resume``, present shards that pass their checksums are kept).
2. shards are written atomically (temp file, fsync, rename), so a shard under its
   final name is always whole.
3. ``seal``: gather the shard table and rewrite the manifest with ``complete: true``.

A crash anywhere leaves a directory that ``resume`` completes: at worst an
unsealed manifest and a subset of whole shards.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import time
from typing import Any, Callable

from speccache import __version__
from speccache.dist import Comm, LocalComm
from speccache.errors import CacheExistsError, ConfigMismatchError, DistributedError, SpeccacheError
from speccache.faults import fault_point
from speccache.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARD_META_ERROR,
    Schema,
    existing_shard_indices,
    file_checksum,
    load_manifest_json,
    manifest_path,
    num_shards,
    remove_temp_files,
    schema_to_json,
    shard_path,
    write_manifest,
)
from speccache.lock import CacheLock
from speccache.shard import NativeShard
from speccache.write import NativeShardWriter, ShardRecord, encoding_error_summary, partition_cache_shards

log = logging.getLogger(__name__)

SHARED_FS_WAIT_S = 60.0
"""How long a rank waits to see the manifest rank 0 wrote (NFS caches negative lookups for up to ~60 s)."""

_COMPARED = ("cache_name", "format_version", "keys", "shard_size", "num_samples", "config")


class CacheWriter:
    """Owns a cache directory for one producer run (every rank of it).

    Args:
        cache_dir: output directory.
        cache_name: kind of cache (``"eagle3"``...), recorded and checked by readers.
        schema: the key schema.
        shard_size: samples per shard.
        num_samples: samples the finished cache holds.
        config: producer configuration; a resume must match it exactly.
        resume: continue an interrupted run instead of refusing an existing cache.
        comm: the process group (one process by default).

    Raises:
        CacheExistsError, ConfigMismatchError, CacheLockedError: from :meth:`begin`,
            raised identically on every rank.
    """

    def __init__(
        self,
        cache_dir: str,
        *,
        cache_name: str,
        schema: Schema,
        shard_size: int,
        num_samples: int,
        config: dict[str, Any],
        resume: bool = False,
        comm: Comm | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        self.schema = schema
        self.comm = comm or LocalComm()
        self.resume = resume
        self.shard_size = shard_size
        self.num_samples = num_samples
        self.manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "cache_name": cache_name,
            "producer": {"name": "speccache", "version": __version__},
            "keys": schema_to_json(schema),
            "shard_size": shard_size,
            "num_samples": num_samples,
            "config": config,
            "complete": False,
        }
        self.shard_writer = NativeShardWriter(schema)
        self._lock = CacheLock(cache_dir)
        start_shard, _, local = partition_cache_shards(num_samples, shard_size, self.comm.world_size, self.comm.rank)
        self.local_shards = list(range(start_shard, start_shard + num_shards(local, shard_size)))

    # -- collective error handling: a failure on one rank becomes the same exception on all

    def _on_all_ranks(self, fn: Callable[[], Any]) -> Any:
        # Any exception is caught: a rank that raised before the all_gather would leave the others waiting in it.
        # The first failing rank's error is raised everywhere (type and message; by name, which always pickles).
        error: Exception | None = None
        result = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
        report = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
        try:
            reports = self.comm.all_gather(report)
        except DistributedError:
            if error is not None:
                raise error
            raise
        for rank, item in enumerate(reports):
            if item is not None:
                if rank == self.comm.rank and error is not None:
                    raise error
                raise _rebuild_error(rank, *item)
        return result

    def preflight(self) -> None:
        """Check the directory against this run without taking the lock or writing anything.

        Lets a producer fail before loading a model; :meth:`begin` checks again under the lock.
        """
        self._on_all_ranks(self._check_directory if self.comm.rank == 0 else lambda: None)

    def begin(self, write_side_files: Callable[[], None] | None = None) -> list[int]:
        """Lock, check, prepare the directory; return the shard indices this rank must compute.

        Args:
            write_side_files: rank 0 calls it after the checks pass and before the manifest is written.
        """

        def _prepare() -> None:
            if os.path.exists(self.cache_dir) and not os.path.isdir(self.cache_dir):
                # before the lock, which would try to create the directory
                raise CacheExistsError(f"output path {self.cache_dir} is a file; choose a directory")
            self._lock.acquire()
            try:
                self._check_directory()
                removed = remove_temp_files(self.cache_dir)
                if removed:
                    log.warning("removed %d temporary files of an interrupted writer in %s", len(removed), self.cache_dir)
                if write_side_files is not None:
                    write_side_files()
                write_manifest(self.cache_dir, self.manifest, FORMAT_VERSION)
                fault_point("after_manifest_begin")
            except BaseException:
                self._lock.release()
                raise

        try:
            self._on_all_ranks(_prepare if self.comm.rank == 0 else lambda: None)
            return self._on_all_ranks(self._shards_to_compute)
        except BaseException:
            self.close()
            raise

    def _check_directory(self) -> None:
        has_manifest = os.path.exists(manifest_path(self.cache_dir))
        has_shards = bool(existing_shard_indices(self.cache_dir))
        if not (has_manifest or has_shards):
            return
        if not self.resume:
            raise CacheExistsError(
                f"{self.cache_dir} already holds a cache ({MANIFEST_NAME} or shards). Pass --resume to continue it, "
                "or choose an empty directory; nothing was changed."
            )
        if not has_manifest:
            raise CacheExistsError(
                f"{self.cache_dir} holds shards but no {MANIFEST_NAME}, so they cannot be checked against this run. "
                "Move them away or choose an empty directory; nothing was changed."
            )
        found = load_manifest_json(manifest_path(self.cache_dir))
        # Compare as stored: JSON turns tuples into lists and dict keys into strings.
        wanted = json.loads(json.dumps({key: self.manifest[key] for key in _COMPARED}))
        differing = [key for key in _COMPARED if found.get(key) != wanted[key]]
        if differing:
            details = "; ".join(_describe_difference(key, found.get(key), wanted[key]) for key in differing)
            raise ConfigMismatchError(
                f"cannot resume {self.cache_dir}: the existing cache was written with a different configuration "
                f"({details}). Re-run with the original settings, or write to a new directory; nothing was changed."
            )

    def _check_shared_directory(self) -> None:
        # Rank 0 wrote the manifest before the collective that started this step: a rank that cannot see it
        # writes to another filesystem (a node-local disk), and the sealed manifest would list shards rank 0 lacks.
        path = manifest_path(self.cache_dir)
        deadline = time.monotonic() + SHARED_FS_WAIT_S
        while not os.path.exists(path):
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"rank {self.comm.rank} of {self.comm.world_size} (host {socket.gethostname()}) does not see {path}, "
                    f"which rank 0 wrote, after {SHARED_FS_WAIT_S:g} s: the output directory must be on a filesystem "
                    "every rank shares (NFS, Lustre, GPFS...), not a node-local disk. Nothing was computed."
                )
            time.sleep(0.5)

    def _shards_to_compute(self) -> list[int]:
        if self.comm.world_size > 1:
            self._check_shared_directory()
        todo = []
        present = existing_shard_indices(self.cache_dir)
        for index in self.local_shards:
            if index in present and self._keep_existing(index):
                continue
            todo.append(index)
        return todo

    def _keep_existing(self, index: int) -> bool:
        path = shard_path(self.cache_dir, index)
        expected = min(self.shard_size, self.num_samples - index * self.shard_size)
        try:
            shard = NativeShard(path, self.schema, index, expected, verify=True)
            errors = json.loads(shard.file.metadata.get(SHARD_META_ERROR, "{}"))
        except (SpeccacheError, OSError, ValueError) as exc:  # OSError: e.g. listed by a stale NFS directory cache, then gone
            log.warning("recomputing %s: %s", path, exc)
            return False
        tokens = int(shard.offsets[-1]) if any(s.ragged for s in self.schema.values()) else 0
        self.shard_writer.records[index] = ShardRecord(index, shard.num_samples, tokens, shard.file.size, file_checksum(path), errors)
        return True

    def seal(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Gather the shard table, write the complete manifest, release the lock.

        Args:
            extra: fields added to the manifest (counts, side files...).

        Returns:
            The sealed manifest.
        """
        try:
            # The all_gather is the barrier: every rank has written (fsynced, renamed) all its shards.
            tables = self.comm.all_gather([r.to_json() for r in self.shard_writer.records.values()])
            shards = sorted((row for table in tables for row in table), key=lambda row: row["index"])
            if [row["index"] for row in shards] != list(range(num_shards(self.num_samples, self.shard_size))):
                raise SpeccacheError(f"cannot seal {self.cache_dir}: shard table is incomplete ({len(shards)} shards)")
            self.manifest.update(extra or {})
            error = encoding_error_summary(shards)
            if error:
                self.manifest["stats"] = {**self.manifest.get("stats", {}), "encoding_error": error}
            self.manifest.update(
                shards=shards,
                num_tokens=sum(row["tokens"] for row in shards),
                total_bytes=sum(row["bytes"] for row in shards),
                complete=True,
            )

            def _write_sealed() -> None:
                if self.comm.rank == 0:
                    fault_point("before_seal")
                    write_manifest(self.cache_dir, self.manifest, FORMAT_VERSION)
                    fault_point("after_seal")
                    self.close()

            # Every rank returns only once the sealed manifest is on disk and the lock is free; a failed write fails all.
            self._on_all_ranks(_write_sealed)
        except BaseException:
            self.close()
            raise
        return self.manifest

    def close(self) -> None:
        """Release the lock without sealing (after a failure)."""
        self._lock.release()


def _rebuild_error(rank: int, module: str, qualname: str, message: str) -> Exception:
    """Rank ``rank``'s exception, recreated here: the same type for speccache and built-in errors."""
    kind: Any = None
    if module == "builtins" or module == "speccache" or module.startswith("speccache."):
        try:
            kind = importlib.import_module(module)
            for part in qualname.split("."):
                kind = getattr(kind, part)
        except (ImportError, AttributeError):
            kind = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            pass
    return DistributedError(f"rank {rank} failed: {module}.{qualname}: {message}")


def _describe_difference(key: str, found: Any, wanted: Any) -> str:
    if isinstance(found, dict) and isinstance(wanted, dict):
        fields = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        return ", ".join(f"{key}.{k}: cache has {found.get(k)!r}, this run has {wanted.get(k)!r}" for k in fields)
    return f"{key}: cache has {found!r}, this run has {wanted!r}"
