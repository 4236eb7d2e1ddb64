"""Shard writers: the native synchronous writer and the background thread that overlaps writing with compute.

Both raise :class:`speccache.errors.ShardWriteError`, naming the shard, for any
failed write (a full disk, or samples that do not fit the schema).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from types import TracebackType

from speccache.errors import ShardWriteError
from speccache.format import Schema, ShardRecord, shard_path, write_shard_file
from speccache.write.loops import Batch, WriteShardFn

__all__ = ["NativeShardWriter", "OverlappedShardWriter"]


class NativeShardWriter:
    """A ``write_shard_fn`` for the native layout that records each shard for the manifest.

    Args:
        schema: the key schema every shard follows.
        before_write: called with each shard's index before it is written (the disk cap's pause).
    """

    def __init__(self, schema: Schema, before_write: Callable[[int], None] | None = None) -> None:
        self.schema = schema
        self.records: dict[int, ShardRecord] = {}
        self.before_write = before_write

    def __call__(self, output_dir: str, shard_index: int, samples: Batch) -> str:
        path = shard_path(output_dir, shard_index)
        if self.before_write is not None:
            self.before_write(shard_index)
        try:
            written, n, tokens, errors = write_shard_file(path, shard_index, samples, self.schema)
        except Exception as exc:  # a full disk, permissions, samples that do not fit the schema: name the shard
            raise _write_failure(path, exc) from exc
        self.records[shard_index] = ShardRecord(shard_index, n, tokens, written.bytes, written.checksum, errors)
        return written.path


def _write_failure(path: str, exc: BaseException) -> ShardWriteError:
    """The :class:`ShardWriteError` for a failed write of ``path``."""
    hint = ""
    if isinstance(exc, OSError):
        hint = (
            " No partial shard is left under that name. Free space (or fix the cause), then re-run the producer "
            "with --resume: the shards already written are kept."
        )
    error = ShardWriteError(f"writing shard {path} failed: {exc}.{hint}")
    error.__cause__ = exc
    return error


class OverlappedShardWriter:
    """Runs a ``write_shard_fn`` on a background thread so compute continues while shards are written.

    At most ``depth`` shards wait in the queue (plus one being written), which
    bounds the extra host memory. A failed write is raised, as
    :class:`ShardWriteError` naming the shard, at the next call or at :meth:`close`;
    shards queued after a failure are dropped, never written out of order.

    Args:
        write_shard_fn: the synchronous writer to run.
        depth: queue depth.
    """

    def __init__(self, write_shard_fn: WriteShardFn, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"writer queue depth must be >= 1, got {depth}")
        self._write = write_shard_fn
        self._queue: queue.Queue[tuple[str, int, Batch] | None] = queue.Queue(maxsize=depth)
        self._error: ShardWriteError | None = None
        self._stop = threading.Event()
        self._writing = False
        self._thread = threading.Thread(target=self._run, name="speccache-shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None or self._stop.is_set():
                return
            if self._error is not None:
                continue
            output_dir, index, samples = item
            self._writing = True
            try:
                self._write(output_dir, index, samples)
            except BaseException as exc:  # noqa: BLE001 - surfaced in the caller's thread
                self._error = (
                    exc if isinstance(exc, ShardWriteError) else _write_failure(shard_path(output_dir, index), exc)
                )
            finally:
                self._writing = False

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def __call__(self, output_dir: str, shard_index: int, samples: Batch) -> str:
        self._raise_pending()
        self._queue.put((output_dir, shard_index, samples))
        return shard_path(output_dir, shard_index)

    def close(self) -> None:
        """Wait for every queued shard, then raise the first failure if any."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_pending()

    def __enter__(self) -> OverlappedShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            self._error = self._error or ShardWriteError("writing stopped after an error in the producer")
            # Stop without touching the queue: a KeyboardInterrupt that landed inside a put() can leave the
            # queue's lock held, and a put or get would then wait forever. Let the shard being written finish
            # (atomic_write removes its temp file on failure); a thread stuck on that lock is abandoned (daemon).
            self._stop.set()
            idle_since = None
            while self._thread.is_alive():
                self._thread.join(0.05)
                if self._writing:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > 1.0:
                    break
