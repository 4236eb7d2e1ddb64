"""One producer run over one cache directory: lock, manifest, resume, overlapped writes, seal.

The lifecycle every native producer follows (and the crash-safety argument):

1. ``preflight`` (optional, before the model is loaded): check the directory
   against the run's configuration, and that the operating system lets a file be
   created in it, without writing anything else.
2. :meth:`CacheWriter.writing` enters the run: take the lock, check the directory
   again, verify the shards a resume would keep, remove temp files of dead writers,
   write the side files and the manifest with ``complete: false`` (unless nothing
   is left to write), and hand out the shards still to compute with the function
   that writes them (on a background thread by default).
3. shards are written atomically (temp file, fsync, rename), so a shard under its
   final name is always whole.
4. leaving the block normally seals: gather the shard table and rewrite the
   manifest with ``complete: true``; leaving it with an exception stops the writer
   and releases the lock without sealing.

A crash anywhere leaves a directory that a resume completes: at worst an
unsealed manifest and a subset of whole shards. A resume of a sealed cache with
nothing to write never un-seals it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speccache.errors import CacheExistsError, ConfigMismatchError, DistributedError, SpeccacheError
from speccache.format import (
    MANIFEST_NAME,
    CacheLock,
    Manifest,
    NativeShard,
    Schema,
    ShardRecord,
    SideFileRecord,
    existing_shard_indices,
    file_checksum,
    load_manifest_json,
    manifest_path,
    num_shards,
    remove_temp_files,
    shard_path,
    write_bytes_file,
    write_safetensors,
)
from speccache.format.durable import ensure_writable_dir, writes_to
from speccache.format.lock import lock_path
from speccache.format.manifest import COMPARED_ON_RESUME, resume_identity
from speccache.format.names import check_no_foreign_files
from speccache.format.reclaim import finish_reclaims, read_reclaims, shard_record
from speccache.write.cap import DiskCap
from speccache.write.dist import Comm, LocalComm, agree
from speccache.write.loops import WriteShardFn, partition_cache_shards
from speccache.write.writers import NativeShardWriter, OverlappedShardWriter

log = logging.getLogger(__name__)

__all__ = ["CacheWriter", "SideFile", "WriteRun"]

SHARED_FS_WAIT_S = 60.0
"""How long a rank waits to see the manifest rank 0 wrote (NFS caches negative lookups for up to ~60 s)."""


@dataclass(frozen=True)
class SideFile:
    """A side file written once, by rank 0, before any shard: safetensors tensors, or plain bytes.

    Attributes:
        name: the file name inside the cache directory.
        tensors: called on rank 0 only, when the file is written (so other ranks never build them).
        metadata: the safetensors metadata.
        content: instead of ``tensors``, the file's bytes (e.g. ``skipped_rows.jsonl``), called like ``tensors``.
        rewritten_on_append: an append writes it again (it covers every data file, e.g. ``skipped_rows.jsonl``);
            the other side files of a sealed cache are kept as they are.
    """

    name: str
    tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    content: Callable[[], bytes] | None = None
    rewritten_on_append: bool = False


@dataclass
class WriteRun:
    """What :meth:`CacheWriter.writing` hands the producer.

    Attributes:
        shards: the shard indices this rank must compute (a resume leaves out the intact ones).
        write_shard: the ``write_shard_fn`` for the loops.
        stats: producer statistics to record in the sealed manifest; set them before leaving the block.
    """

    shards: list[int]
    write_shard: WriteShardFn
    stats: dict[str, Any] = field(default_factory=dict)


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
        append_fields: grow an existing cache: its sample count and these ``config`` fields (the data) may differ
            from the cache's; every other field must match. Shards that still fit are kept, the rest computed.
        cap: pause before each shard while the cache's unconsumed shards reach this cap (a trainer following the
            cache with ``reclaim`` frees them); a run setting, not part of the cache's configuration.
        command: the command line that runs this producer (``speccache`` left out), recorded with the working
            directory in the manifest's ``producer`` (informational; a resume does not compare it, and keeps the
            command that started the cache).

    Raises:
        CacheExistsError, ConfigMismatchError, CacheLockedError, OutputError: from :meth:`preflight` and
            :meth:`writing`, raised identically on every rank.
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
        append_fields: frozenset[str] | None = None,
        cap: DiskCap | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        self.comm = comm or LocalComm()
        self.append_fields = append_fields
        self.resume = resume or append_fields is not None
        self.manifest = Manifest(
            cache_name=cache_name,
            schema=schema,
            shard_size=shard_size,
            num_samples=num_samples,
            config=config,
            path=manifest_path(cache_dir),
        )
        if command is not None:
            self.manifest.producer.update(argv=list(command), cwd=os.getcwd())
        self._producer = self.manifest.producer
        self.shard_writer = NativeShardWriter(schema, before_write=None if cap is None else cap.wait)
        self.cap = cap
        self._lock = CacheLock(cache_dir)
        self._sealed_on_disk: Manifest | None = None
        self._written_side_files: list[str] = []
        start_shard, _, local = partition_cache_shards(num_samples, shard_size, self.comm.world_size, self.comm.rank)
        self.local_shards = list(range(start_shard, start_shard + num_shards(local, shard_size)))

    def preflight(self) -> None:
        """Check the directory against this run without taking the lock: create it, prove a file can be created
        in it, refuse what the run could not use; nothing else is written.

        Lets a producer fail before loading a model; :meth:`writing` checks again under the lock.

        Raises:
            OutputError: the operating system refuses the directory (read-only, no permission, name too long).
            CacheExistsError, ConfigMismatchError: as :meth:`writing`.
        """

        def _check() -> None:
            self._check_output()
            self._check_directory()

        agree(self.comm, _check if self.comm.rank == 0 else lambda: None)

    @contextlib.contextmanager
    def writing(self, side_files: tuple[SideFile, ...] = (), overlap: bool = True) -> Iterator[WriteRun]:
        """The run: lock and prepare the directory, yield the shards to compute, seal on a normal exit.

        Args:
            side_files: the method's side files (rank 0 writes them before the manifest).
            overlap: write shards on a background thread while the producer computes.

        Yields:
            The shards this rank computes and the function that writes them.

        Raises:
            CacheExistsError, ConfigMismatchError, CacheLockedError, OutputError: the directory cannot be used
                (nothing changed).
            ShardWriteError: a shard could not be written (the lock is released; shards already written are kept).
        """
        todo = self._begin(side_files)
        try:
            with (
                OverlappedShardWriter(self.shard_writer)
                if overlap
                else contextlib.nullcontext(self.shard_writer) as write
            ):
                run = WriteRun(todo, write)
                yield run
        except BaseException:
            self._lock.release()
            raise
        self._seal(run.stats)

    def _begin(self, side_files: tuple[SideFile, ...]) -> list[int]:
        def _prepare() -> None:
            self._check_output()  # before the lock, which would try to create the directory
            self._lock.acquire()
            try:
                found = self._check_directory()
                if found is not None and "argv" in found.producer:  # the command that started the cache stays
                    self._producer = {**self._producer, **{k: found.producer.get(k) for k in ("argv", "cwd")}}
                    self.manifest.producer = self._producer
                removed = remove_temp_files(self.cache_dir)
                finish_reclaims(self.cache_dir, read_reclaims(self.cache_dir))  # a reclaimer killed half-way
                if removed:
                    log.warning(
                        "removed %d temporary files of an interrupted writer in %s", len(removed), self.cache_dir
                    )
                self._sealed_on_disk = (
                    found if found is not None and found.complete and self._side_files_intact(found) else None
                )
                if self._sealed_on_disk is None:
                    with writes_to(self.cache_dir):
                        for side in side_files:
                            self._write_side_file(side)
                else:  # a sealed cache with nothing to rewrite stays byte for byte as it is, producer included
                    self.manifest.side_files = dict(self._sealed_on_disk.side_files)
                    self.manifest.producer = self._sealed_on_disk.producer
            except BaseException:
                self._lock.release()
                raise

        try:
            agree(self.comm, _prepare if self.comm.rank == 0 else lambda: None)
            todo = agree(self.comm, self._shards_to_compute)
            # A sealed cache stays sealed (readers keep reading it) unless some rank has a shard to rewrite.
            states = self.comm.all_gather((bool(todo), self._sealed_on_disk is not None))
            if not states[0][1] or any(has_work for has_work, _ in states):
                agree(self.comm, (lambda: self._unseal(side_files)) if self.comm.rank == 0 else lambda: None)
            return todo
        except BaseException:
            self._drop_unlisted_side_files()
            self._lock.release()
            raise

    def _drop_unlisted_side_files(self) -> None:
        """Remove the side files this run wrote when no manifest lists them (it failed before writing one): a
        rerun would take them for someone else's files and refuse the directory."""
        if os.path.lexists(manifest_path(self.cache_dir)):
            return
        for path in self._written_side_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _unseal(self, side_files: tuple[SideFile, ...]) -> None:
        sealed, self._sealed_on_disk = self._sealed_on_disk, None
        if sealed is not None:  # rewriting shards of a sealed cache: its side files are the ones listed
            self.manifest.side_files = dict(sealed.side_files)
            self.manifest.producer = self._producer
        with writes_to(self.cache_dir):
            self.manifest.write(self.cache_dir)
        if sealed is not None and self.append_fields is not None:
            # Only now: no sealed manifest ever lists a side file that changed after it was written.
            for side in side_files:
                if side.rewritten_on_append:
                    self._write_side_file(side)

    def _side_files_intact(self, found: Manifest) -> bool:
        for name, record in found.side_files.items():
            try:
                if file_checksum(os.path.join(self.cache_dir, name)) != record.checksum:
                    return False
            except OSError:
                return False
        return True

    def _write_side_file(self, side: SideFile) -> None:
        path = os.path.join(self.cache_dir, side.name)
        if side.content is not None:
            data = side.content()
            self.manifest.side_files[side.name] = SideFileRecord(len(data), write_bytes_file(path, data))
        elif side.tensors is None:
            raise ValueError(f"side file {side.name} has neither tensors nor content")
        else:
            written = write_safetensors(path, side.tensors(), side.metadata)
            self.manifest.side_files[side.name] = SideFileRecord(written.bytes, written.checksum)
        self._written_side_files.append(path)

    def _check_output(self) -> None:
        """Refuse a path that is a file, one the OS will not let us write, and a directory of someone else's files."""
        if os.path.exists(self.cache_dir) and not os.path.isdir(self.cache_dir):
            raise CacheExistsError(f"output path {self.cache_dir} is a file; choose a directory")
        # What sits beside a manifest, shards or a lock (a writer killed before its first manifest) is a cache's:
        # its side files; _check_directory judges that cache.
        marks = (manifest_path(self.cache_dir), lock_path(self.cache_dir))
        if not any(map(os.path.lexists, marks)) and not existing_shard_indices(self.cache_dir):
            check_no_foreign_files(self.cache_dir)
        ensure_writable_dir(self.cache_dir)

    def _check_directory(self) -> Manifest | None:
        """Refuse a directory this run cannot write; return the manifest found there (``None`` when empty)."""
        has_manifest = os.path.lexists(manifest_path(self.cache_dir))
        has_shards = bool(existing_shard_indices(self.cache_dir)) or bool(read_reclaims(self.cache_dir))
        if not (has_manifest or has_shards):
            return None
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
        body = load_manifest_json(manifest_path(self.cache_dir))
        wanted = self.manifest.resume_identity()
        found_identity = resume_identity(body, wanted["config"])
        if self.append_fields is not None:  # an append grows the cache and changes its data, nothing else
            for identity in (found_identity, wanted):
                identity["num_samples"] = None
                config = identity["config"] or {}
                identity["config"] = {k: v for k, v in config.items() if k not in self.append_fields}
        differing = [key for key in COMPARED_ON_RESUME if found_identity[key] != wanted[key]]
        if differing:
            details = "; ".join(_describe_difference(key, found_identity[key], wanted[key]) for key in differing)
            raise ConfigMismatchError(
                f"cannot resume {self.cache_dir}: the existing cache was written with a different configuration "
                f"({details}). Re-run with the original settings, or write to a new directory; nothing was changed."
            )
        return Manifest.from_json(body, manifest_path(self.cache_dir))

    def _check_shared_directory(self) -> None:
        # Rank 0 took the lock before the collective that started this step: a rank that cannot see the lock file
        # writes to another filesystem (a node-local disk), and the sealed manifest would list shards rank 0 lacks.
        deadline = time.monotonic() + SHARED_FS_WAIT_S
        while not os.path.exists(lock_path(self.cache_dir)):
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"rank {self.comm.rank} of {self.comm.world_size} (host {socket.gethostname()}) does not see "
                    f"{lock_path(self.cache_dir)}, which rank 0 holds, after {SHARED_FS_WAIT_S:g} s: "
                    "the output directory must be on a filesystem every rank shares (NFS, Lustre, GPFS...), "
                    "not a node-local disk. Nothing was computed."
                )
            time.sleep(0.5)

    def _shards_to_compute(self) -> list[int]:
        if self.comm.world_size > 1:
            self._check_shared_directory()
        present = existing_shard_indices(self.cache_dir)
        reclaims = read_reclaims(self.cache_dir)
        todo = []
        for index in self.local_shards:
            if index in reclaims and reclaims[index].record.samples == self.manifest.shard_samples(index):
                self.shard_writer.records[index] = reclaims[index].record  # read and deleted by a trainer: done
            elif index in reclaims and self.append_fields is None:
                raise ConfigMismatchError(
                    f"cannot resume {self.cache_dir}: shard {index} was reclaimed by a following trainer with "
                    f"{reclaims[index].record.samples} samples, this run's shard holds "
                    f"{self.manifest.shard_samples(index)}. Re-run with the original settings; nothing was changed."
                )
            elif not (index in present and self._keep_existing(index)):
                todo.append(index)
        return todo

    def _keep_existing(self, index: int) -> bool:
        path = shard_path(self.cache_dir, index)
        if self.append_fields is not None and self._grown_by_append(index):
            return False
        try:
            record = self._record_of_existing(index)
        except (
            SpeccacheError,
            OSError,
            ValueError,
        ) as exc:  # OSError: e.g. listed by a stale NFS directory cache, then gone
            log.warning("recomputing %s: %s", path, exc)
            return False
        self.shard_writer.records[index] = record
        return True

    def _grown_by_append(self, index: int) -> bool:
        """Whether shard ``index`` holds fewer samples than this run's: the cache's old partial last shard, which an
        append recomputes with the first new samples (an expected rewrite, not a damaged shard to warn about)."""
        try:
            shard = NativeShard(shard_path(self.cache_dir, index), self.manifest.schema, index, None)
        except (SpeccacheError, OSError, ValueError):
            return False  # a bad shard: _keep_existing's own check reports it
        try:
            return shard.num_samples < self.manifest.shard_samples(index)
        finally:
            shard.close()

    def _record_of_existing(self, index: int) -> ShardRecord:
        """The shard table row of shard ``index`` as found on disk, after checking it whole."""
        return shard_record(
            shard_path(self.cache_dir, index), self.manifest.schema, index, self.manifest.shard_samples(index)
        )

    def _seal(self, stats: Mapping[str, Any]) -> None:
        """Gather the shard table, write the complete manifest (unless it is on disk already), release the lock."""
        try:
            # The all_gather is the barrier: every rank has written (fsynced, renamed) all its shards.
            tables = self.comm.all_gather(list(self.shard_writer.records.values()))
            reclaimed = read_reclaims(self.cache_dir) if self.comm.rank == 0 else {}
            sealed = self.manifest.sealed((r for table in tables for r in table), stats, reclaimed)
            self.manifest = sealed

            def _write_sealed() -> None:
                if self.comm.rank == 0:
                    if self._sealed_on_disk is None or self._sealed_on_disk.to_json() != sealed.to_json():
                        with writes_to(self.cache_dir):
                            sealed.write(self.cache_dir)
                    self._lock.release()

            # Every rank returns once the sealed manifest is on disk and the lock is free; a failed write fails all.
            agree(self.comm, _write_sealed)
        finally:
            self._lock.release()


def _describe_difference(key: str, found: Any, wanted: Any) -> str:
    if isinstance(found, dict) and isinstance(wanted, dict):
        fields = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        return ", ".join(f"{key}.{k}: cache has {found.get(k)!r}, this run has {wanted.get(k)!r}" for k in fields)
    return f"{key}: cache has {found!r}, this run has {wanted!r}"
