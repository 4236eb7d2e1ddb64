"""Writing caches: shard partitioning, the accumulator, shard writers and precompute loops.

The loops take a ``compute_batch`` callable and a ``write_shard_fn`` so that
methods (EAGLE-3...) supply the model side and the format stays here. The
layout of the shards depends only on ``shard_size`` and the sample order,
never on the batch sizes fed in, so a resumed or distributed run writes the
same shards as one uninterrupted process.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Collection, Iterable, Mapping

import torch
from torch.utils.data import DataLoader, Subset

from speccache.errors import ShardWriteError
from speccache.format import (
    LENGTHS_KEY,
    SHARD_META_CHECKSUMS,
    Schema,
    check_shard_size,
    num_shards,
    shard_path,
    tensor_checksum,
    write_safetensors,
)
from speccache.shard import write_shard_file

Batch = dict[str, torch.Tensor]
WriteShardFn = Callable[[str, int, Batch], str]
ComputeBatchFn = Callable[[Any], Batch]

__all__ = [
    "partition_cache_shards",
    "resume_start_sample",
    "dataloader_from_sample",
    "write_tensor_shard",
    "NativeShardWriter",
    "ShardRecord",
    "encoding_error_summary",
    "OverlappedShardWriter",
    "write_cache_shards",
    "write_cache_shards_distributed",
    "compute_shard_runs",
]


def partition_cache_shards(num_samples: int, shard_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """Assign ``rank`` a contiguous, shard-aligned block of samples.

    The ``ceil(num_samples / shard_size)`` shards are split into contiguous runs;
    the first ``total_shards % world_size`` ranks take one extra shard; ranks
    beyond the shard count get no samples.

    Returns:
        ``(start_shard_index, start_sample, num_local_samples)``.

    Raises:
        ValueError: ``world_size < 1``, ``rank`` outside ``[0, world_size)`` or ``shard_size < 1``.
    """
    if not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
    total = num_shards(num_samples, shard_size)
    base, extra = divmod(total, world_size)
    start_shard = rank * base + min(rank, extra)
    local_shards = base + (1 if rank < extra else 0)
    start_sample = start_shard * shard_size
    end_sample = min((start_shard + local_shards) * shard_size, num_samples)
    return start_shard, start_sample, max(0, end_sample - start_sample)


def resume_start_sample(existing_shards: set[int], shard_size: int) -> int:
    """Sample index where a sequential resume starts: ``len(existing) * shard_size``.

    Raises:
        ValueError: ``existing_shards`` is not exactly ``{0, ..., k-1}``.
    """
    expected = set(range(len(existing_shards)))
    if set(existing_shards) != expected:
        raise ValueError(
            f"--resume expects existing shards to be a contiguous prefix {sorted(expected)}, "
            f"but found {sorted(existing_shards)}. Delete stale shards or restart from a clean directory."
        )
    return len(existing_shards) * shard_size


# ---------------------------------------------------------------------------
# data loader helpers


def _sequential_subset_loader(dataloader: DataLoader, start: int, end: int) -> DataLoader:
    """A sequential loader over ``dataset[start:end)`` with ``dataloader``'s batching and worker settings."""
    worker_kwargs: dict[str, Any] = {}
    num_workers = int(getattr(dataloader, "num_workers", 0))
    if num_workers > 0:
        worker_kwargs["persistent_workers"] = getattr(dataloader, "persistent_workers", False)
        # Producers put the target on CUDA before iterating, so fork-started workers would inherit
        # a live CUDA context: keep the source loader's start method.
        context = getattr(dataloader, "multiprocessing_context", None)
        if context is not None:
            worker_kwargs["multiprocessing_context"] = context
    return DataLoader(
        Subset(dataloader.dataset, range(start, end)),
        batch_size=getattr(dataloader, "batch_size", None) or 1,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=bool(getattr(dataloader, "pin_memory", False)),
        collate_fn=getattr(dataloader, "collate_fn", None),
        drop_last=False,
        **worker_kwargs,
    )


def dataloader_from_sample(dataloader: DataLoader, start_sample: int) -> DataLoader:
    """A sequential loader equivalent to ``dataloader`` from ``start_sample`` on.

    Returns ``dataloader`` itself when ``start_sample <= 0`` and an empty loader
    past the end. Samples before ``start_sample`` are never read.
    """
    if start_sample <= 0:
        return dataloader
    end = len(dataloader.dataset)  # type: ignore[arg-type]
    if start_sample >= end:
        # Nothing left (a finished run resumed): no worker processes to start, as in the seed.
        return DataLoader(
            Subset(dataloader.dataset, range(0)),
            batch_size=getattr(dataloader, "batch_size", None) or 1,
            shuffle=False,
            num_workers=0,
            collate_fn=getattr(dataloader, "collate_fn", None),
            drop_last=False,
        )
    return _sequential_subset_loader(dataloader, start_sample, end)


# ---------------------------------------------------------------------------
# shard writers


def write_tensor_shard(
    cache_dir: str, shard_index: int, samples: Mapping[str, torch.Tensor], keys: tuple[str, ...], cache_name: str
) -> str:
    """Write one fixed-shape shard holding exactly ``keys`` (the seed layout).

    The safetensors metadata records each tensor's xxh3-128 under ``xxh3_128``
    (as in native shards), so readers with ``verify`` can check it.

    Returns:
        The shard path.

    Raises:
        ValueError: a key in ``keys`` is missing from ``samples``.
    """
    missing = [key for key in keys if key not in samples]
    if missing:
        raise ValueError(f"write_shard is missing required {cache_name} cache fields: {missing}")
    tensors = {key: samples[key].detach().cpu().contiguous() for key in keys}
    checksums = json.dumps({key: tensor_checksum(t) for key, t in sorted(tensors.items())}, sort_keys=True, separators=(",", ":"))
    return write_safetensors(shard_path(cache_dir, shard_index), tensors, {SHARD_META_CHECKSUMS: checksums}).path


@dataclass(frozen=True)
class ShardRecord:
    """One row of the manifest's shard table.

    ``encoding_error`` holds the error sums of the shard's lossy keys
    (:func:`speccache.shard.encoding_error_sums`); empty when there are none.
    """

    index: int
    samples: int
    tokens: int
    bytes: int
    checksum: str
    encoding_error: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest entry."""
        row: dict[str, Any] = {
            "index": self.index, "samples": self.samples, "tokens": self.tokens, "bytes": self.bytes, "xxh3_128": self.checksum
        }
        if self.encoding_error:
            row["encoding_error"] = {k: dict(v) for k, v in self.encoding_error.items()}
        return row


def encoding_error_summary(shard_rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Whole-cache error of each lossy key from the shard table's per-shard sums.

    Returns:
        ``{key: {"rms": relative RMS error over every value, "max": largest error relative
        to its row's amax}}``, as :func:`speccache.encoding.fp8.fp8_error` defines them;
        empty when no shard recorded any.
    """
    totals: dict[str, list[float]] = {}
    for row in shard_rows:
        for key, sums in (row.get("encoding_error") or {}).items():
            t = totals.setdefault(key, [0.0, 0.0, 0.0])
            t[0] += float(sums["sq_err"])
            t[1] += float(sums["sq_ref"])
            t[2] = max(t[2], float(sums["max"]))
    out = {}
    for key, (sq_err, sq_ref, worst) in totals.items():
        rms = math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf)
        out[key] = {"rms": rms, "max": worst}
    return out


class NativeShardWriter:
    """A ``write_shard_fn`` for the native layout that records each shard for the manifest.

    Args:
        schema: the key schema every shard follows.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.records: dict[int, ShardRecord] = {}

    def __call__(self, output_dir: str, shard_index: int, samples: Batch) -> str:
        path = shard_path(output_dir, shard_index)
        try:
            written, n, tokens, errors = write_shard_file(path, shard_index, samples, self.schema)
        except OSError as exc:  # disk full, file-size limit, permissions: name the shard and say what to do
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
                self._error = exc if isinstance(exc, ShardWriteError) else _write_failure(shard_path(output_dir, index), exc)
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

    def __enter__(self) -> "OverlappedShardWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
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


# ---------------------------------------------------------------------------
# the accumulator


def batch_num_samples(batch: Mapping[str, torch.Tensor]) -> int:
    """Samples in a computed batch: ``__lengths__`` when present, else the leading dim of ``input_ids`` (or the first key)."""
    if LENGTHS_KEY in batch:
        return int(batch[LENGTHS_KEY].shape[0])
    first = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    return int(first.shape[0])


class _Pending:
    """A computed batch, partly consumed from the front."""

    def __init__(self, batch: Batch, ragged_keys: Collection[str]) -> None:
        self.batch = batch
        self.n = batch_num_samples(batch)
        self.start = 0
        self.ragged = [k for k in batch if k in ragged_keys]
        # Python ints: indexing a tensor for every key of every piece costs more than the slicing itself.
        self.row_offsets: list[int] | None = None
        if self.ragged:
            self.row_offsets = [0, *torch.cumsum(batch[LENGTHS_KEY].to(torch.int64).reshape(-1), 0).tolist()]

    def take(self, count: int) -> Batch:
        a, b = self.start, self.start + count
        self.start = b
        piece = {}
        for key, value in self.batch.items():
            if key in self.ragged:
                assert self.row_offsets is not None
                piece[key] = value[self.row_offsets[a] : self.row_offsets[b]]
            else:
                piece[key] = value[a:b]
        return piece


class _ShardAccumulator:
    """Buffers computed batches and writes fixed-size sequential shards.

    Shards hold exactly ``shard_size`` samples and are numbered from
    ``start_shard_index``; :meth:`finalize` writes a trailing partial shard.
    Whatever the batch sizes, the same samples give the same shards. A shard is
    assembled with one copy per key (none when one batch covers it).

    Args:
        output_dir: the cache directory.
        shard_size: samples per shard.
        start_shard_index: index of the first shard written.
        write_shard_fn: ``(output_dir, shard_index, samples) -> path``.
        logger: where each write is logged.
        ragged_keys: keys concatenated along rows, sliced with ``__lengths__``.
    """

    def __init__(
        self,
        output_dir: str,
        shard_size: int,
        start_shard_index: int,
        write_shard_fn: WriteShardFn,
        logger: logging.Logger,
        ragged_keys: Collection[str] = (),
    ) -> None:
        check_shard_size(shard_size)
        self._output_dir = output_dir
        self._shard_size = shard_size
        self._write_shard_fn = write_shard_fn
        self._logger = logger
        self._ragged_keys = frozenset(ragged_keys)
        self._shard_index = start_shard_index
        self._pending: list[_Pending] = []
        self._buffered = 0

    @property
    def next_shard_index(self) -> int:
        """Index the next written shard will get."""
        return self._shard_index

    def add(self, batch_cache: Batch) -> None:
        """Append one computed batch, writing every shard it completes."""
        pending = _Pending(batch_cache, self._ragged_keys)
        if pending.n == 0:
            return
        self._pending.append(pending)
        self._buffered += pending.n
        while self._buffered >= self._shard_size:
            self._flush(self._shard_size)

    def finalize(self) -> None:
        """Write the trailing partial shard, if any."""
        if self._buffered:
            self._flush(self._buffered)

    def _flush(self, count: int) -> None:
        pieces: list[Batch] = []
        need = count
        while need:
            head = self._pending[0]
            take = min(need, head.n - head.start)
            pieces.append(head.take(take))
            need -= take
            if head.start == head.n:
                self._pending.pop(0)
        shard = pieces[0] if len(pieces) == 1 else {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
        path = self._write_shard_fn(self._output_dir, self._shard_index, shard)
        self._logger.info("Wrote %s (%d samples)", path, count)
        self._buffered -= count
        self._shard_index += 1


# ---------------------------------------------------------------------------
# loops


def write_cache_shards(
    dataloader: Iterable[Any],
    output_dir: str,
    shard_size: int,
    start_shard_index: int,
    compute_batch: ComputeBatchFn,
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    ragged_keys: Collection[str] = (),
) -> None:
    """Compute every batch of ``dataloader`` and write sequential shards from ``start_shard_index``."""
    accumulator = _ShardAccumulator(output_dir, shard_size, start_shard_index, write_shard_fn, logger, ragged_keys)
    for batch in dataloader:
        accumulator.add(compute_batch(batch))
    accumulator.finalize()


LOCKSTEP_SYNC_EVERY = 16
"""Compute steps between two meetings of all ranks in :func:`compute_shard_runs` (distributed runs)."""


def compute_shard_runs(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    shard_indices: Iterable[int],
    compute_batch: ComputeBatchFn,
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    *,
    ragged_keys: Collection[str] = (),
    sync_max_steps: Callable[[int], int] | None = None,
    on_batch: Callable[[Batch], None] | None = None,
    sync_every: int | None = None,
) -> int:
    """Write the given shards (any subset, e.g. those a resume still lacks), keeping lockstep.

    Consecutive indices are computed as one run with ``dataloader``'s batching, so
    the batches (and therefore the bytes) equal those of an uninterrupted run as
    long as ``shard_size`` is a multiple of the batch size. When ``sync_max_steps``
    is given (distributed), this rank pads its step count to the global maximum
    with one-sample dummy batches whose outputs are discarded, and every
    ``sync_every`` steps (default :data:`LOCKSTEP_SYNC_EVERY`; 0: never) all ranks
    meet again (``sync_max_steps(0)``), so a rank with less (or cheaper, dummy)
    work never waits at one collective for longer than that many steps of the
    slowest rank: the collective timeout need not cover a whole run's imbalance
    (uneven blocks, a resume with most shards present).

    Returns:
        The number of ``compute_batch`` calls made.
    """
    dataset = dataloader.dataset
    num_samples = len(dataset)  # type: ignore[arg-type]
    runs = _consecutive_runs(sorted(shard_indices))
    batch_size = int(getattr(dataloader, "batch_size", None) or 1)
    spans = [(a * shard_size, min(b * shard_size, num_samples)) for a, b in runs]
    local_steps = sum(-(-(end - start) // batch_size) for start, end in spans if end > start)
    global_steps = local_steps if sync_max_steps is None else sync_max_steps(local_steps)
    steps = 0
    every = LOCKSTEP_SYNC_EVERY if sync_every is None else sync_every

    def step_done() -> None:
        nonlocal steps
        steps += 1
        if sync_max_steps is not None and every > 0 and steps % every == 0:
            sync_max_steps(0)  # the same step numbers on every rank: real steps, then dummy ones

    for (first_shard, _), (start, end) in zip(runs, spans):
        if end <= start:
            continue
        accumulator = _ShardAccumulator(output_dir, shard_size, first_shard, write_shard_fn, logger, ragged_keys)
        for batch in _sequential_subset_loader(dataloader, start, end):
            out = compute_batch(batch)
            step_done()
            accumulator.add(out)
            if on_batch is not None:
                on_batch(out)
        accumulator.finalize()
    if steps < global_steps:
        collate_fn = getattr(dataloader, "collate_fn", None)
        dummy = collate_fn([dataset[0]]) if collate_fn is not None else dataset[0]
        for _ in range(global_steps - steps):
            compute_batch(dummy)
            step_done()
    return global_steps


def _consecutive_runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def write_cache_shards_distributed(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    world_size: int,
    rank: int,
    compute_batch: ComputeBatchFn,
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    sync_max_steps: Callable[[int], int] | None = None,
    ragged_keys: Collection[str] = (),
) -> None:
    """Distributed precompute: this rank writes its contiguous shard block in lockstep with the others.

    ``compute_batch`` may be a collective (a target sharded across ranks), so every
    rank calls it ``sync_max_steps(local_steps)`` times; ranks with fewer batches
    pad with a one-sample dummy batch (read only if needed) whose output is
    discarded. With ``world_size == 1`` this writes what :func:`write_cache_shards` writes.
    """
    num_samples = len(dataloader.dataset)  # type: ignore[arg-type]
    start_shard, start_sample, local = partition_cache_shards(num_samples, shard_size, world_size, rank)
    local_shards = range(start_shard, start_shard + num_shards(local, shard_size)) if local else range(0)
    logger.info(
        "Rank %d/%d: samples [%d, %d) -> shards from %d", rank, world_size, start_sample, start_sample + local, start_shard
    )
    compute_shard_runs(
        dataloader,
        output_dir,
        shard_size,
        local_shards,
        compute_batch,
        write_shard_fn,
        logger,
        ragged_keys=ragged_keys,
        sync_max_steps=sync_max_steps,
        sync_every=0,  # the seed's contract: sync_max_steps is called once
    )
