"""The precompute loops: which shards a rank owns, the accumulator that cuts fixed-size shards, lockstep.

The loops take a ``compute_batch`` callable and a ``write_shard_fn`` so that
methods supply the model side and the format stays below. The layout of the
shards depends only on ``shard_size`` and the sample order, never on the batch
sizes fed in, so a resumed or distributed run writes the same shards as one
uninterrupted process.

Which samples share a forward is decided per shard, from that shard alone
(:func:`shard_batches`: its samples sorted by length, then cut by count or by a
token budget), so every resume, append or world size computes the same batches
and writes the same bytes; a padded batch then wastes little compute on padding.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from speccache.format import LENGTHS_KEY, ceil_div, check_shard_size, num_shards

Batch = dict[str, torch.Tensor]
WriteShardFn = Callable[[str, int, Batch], str]
ComputeBatchFn = Callable[[Any], Batch]

__all__ = [
    "Batch",
    "ComputeBatchFn",
    "LOCKSTEP_SYNC_EVERY",
    "ShardAccumulator",
    "WriteShardFn",
    "batch_span",
    "compute_shard_runs",
    "shard_batches",
    "partition_cache_shards",
    "subset_loader",
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


def batch_span(index: int, batch_size: int, num_samples: int) -> range:
    """The samples :func:`compute_shard_runs` computes in one forward together with sample ``index``.

    A run starts at a shard boundary, a multiple of the batch size (``--shard-size`` is one), so every batch,
    in any resume, append or distributed run, is ``[k * batch_size, (k + 1) * batch_size)`` cut at the end.
    """
    start = index - index % batch_size
    return range(start, min(start + batch_size, num_samples))


def shard_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int | None = None) -> list[list[int]]:
    """One shard's forwards: its samples (local indices) by descending length, ties by index, cut into batches.

    Args:
        lengths: each sample's token count, in stored order.
        batch_size: samples per batch (without ``max_batch_tokens``).
        max_batch_tokens: instead, the most padded tokens (samples x the longest of them) a batch may hold; a
            sample longer than the budget gets a batch of its own.

    Returns:
        The batches, longest first (so the largest forward comes first: a memory limit shows at once).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            fits = (
                len(batch) < batch_size
                if max_batch_tokens is None
                else (len(batch) + 1) * lengths[batch[0]] <= max_batch_tokens
            )
            if fits:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def batch_of(
    index: int, lengths: Sequence[int], shard_size: int, batch_size: int, max_batch_tokens: int | None
) -> list[int]:
    """The samples (cache indices, in batch order) computed in one forward with sample ``index``, by
    :func:`shard_batches` of its shard; ``lengths`` are the lengths of every sample of the cache."""
    start = index - index % shard_size
    stop = min(start + shard_size, len(lengths))
    for batch in shard_batches(lengths[start:stop], batch_size, max_batch_tokens):
        if index - start in batch:
            return [start + i for i in batch]
    raise AssertionError("unreachable: every sample of a shard is in one of its batches")


def _worker_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    worker_kwargs: dict[str, Any] = {
        "num_workers": int(getattr(dataloader, "num_workers", 0)),
        "pin_memory": bool(getattr(dataloader, "pin_memory", False)),
        "collate_fn": getattr(dataloader, "collate_fn", None),
    }
    if worker_kwargs["num_workers"] > 0:
        worker_kwargs["persistent_workers"] = getattr(dataloader, "persistent_workers", False)
        # Producers put the target on CUDA before iterating, so fork-started workers would inherit
        # a live CUDA context: keep the source loader's start method.
        context = getattr(dataloader, "multiprocessing_context", None)
        if context is not None:
            worker_kwargs["multiprocessing_context"] = context
    return worker_kwargs


def subset_loader(
    dataloader: DataLoader,
    start: int,
    end: int,
    loader_cls: type[DataLoader] = DataLoader,
    subset_cls: type[Subset] = Subset,
) -> DataLoader:
    """A sequential loader over ``dataset[start:end)`` with ``dataloader``'s batching and worker settings.

    ``loader_cls`` and ``subset_cls`` let the NeMo-compatible module build it from the
    names in its own namespace (which its users' tests patch).
    """
    return loader_cls(
        subset_cls(dataloader.dataset, range(start, end)),
        batch_size=getattr(dataloader, "batch_size", None) or 1,
        shuffle=False,
        drop_last=False,
        **_worker_kwargs(dataloader),
    )


def batch_num_samples(batch: Mapping[str, torch.Tensor]) -> int:
    """Samples in a computed batch: ``__lengths__`` if present, else the first dim of ``input_ids`` (or of any key)."""
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


class ShardAccumulator:
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
    shard_plan: Callable[[int, int], list[list[int]]] | None = None,
) -> int:
    """Write the given shards (any subset, e.g. those a resume still lacks), keeping lockstep.

    With ``shard_plan`` (``(start, end) -> batches of sample indices``, a partition of one shard's samples, e.g.
    by :func:`shard_batches`), each shard is computed in those batches and its rows put back in stored order.
    Without it, consecutive indices are computed as one run with ``dataloader``'s batching, so
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
    plans: dict[int, list[list[int]]] = {}
    if shard_plan is not None:
        for first, last in runs:
            for shard in range(first, last):
                start, end = shard * shard_size, min((shard + 1) * shard_size, num_samples)
                if end > start:
                    plans[shard] = shard_plan(start, end)
        local_steps = sum(len(batches) for batches in plans.values())
    else:
        local_steps = sum(ceil_div(end - start, batch_size) for start, end in spans if end > start)
    global_steps = local_steps if sync_max_steps is None else sync_max_steps(local_steps)
    steps = 0
    every = LOCKSTEP_SYNC_EVERY if sync_every is None else sync_every

    def step_done() -> None:
        nonlocal steps
        steps += 1
        if sync_max_steps is not None and every > 0 and steps % every == 0:
            sync_max_steps(0)  # the same step numbers on every rank: real steps, then dummy ones

    for shard, batches in plans.items():
        rows: dict[int, Batch] = {}
        loader = DataLoader(dataset, batch_sampler=batches, **_worker_kwargs(dataloader))
        for indices, batch in zip(batches, loader):
            out = compute_batch(batch)
            step_done()
            pending = _Pending(out, frozenset(ragged_keys))
            for index in indices:
                rows[index] = pending.take(1)
            if on_batch is not None:
                on_batch(out)
        ordered = [rows[i] for i in sorted(rows)]
        path = write_shard_fn(output_dir, shard, {k: torch.cat([r[k] for r in ordered]) for k in ordered[0]})
        logger.info("Wrote %s (%d samples)", path, len(ordered))
    for (first_shard, _), (start, end) in zip(runs, spans if shard_plan is None else ()):
        if end <= start:
            continue
        accumulator = ShardAccumulator(output_dir, shard_size, first_shard, write_shard_fn, logger, ragged_keys)
        for batch in subset_loader(dataloader, start, end):
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
