"""Token ranges of long samples: reading some rows of a sample, and each sequence-parallel rank its own.

A 128K-token sample of an 8B target holds gigabytes of features; a rank of a sequence-parallel group
(Ulysses, ring attention) trains on a contiguous part of its tokens and needs only those rows. The reader's
:meth:`speccache.read.CacheDataset.read` (``rows=slice(a, b)``) reads only the bytes of those rows, and
:class:`SequenceParallelDataset` gives rank ``r`` of a group of ``n`` its rows of every sample
(:func:`sequence_parallel_rows`), plus the whole of the keys a method needs whole (the token ids and the loss
mask, for the targets and the loss at the part's edges).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from speccache.dist import group_position
from speccache.errors import UsageError
from speccache.read.collate import PadCollator

if TYPE_CHECKING:
    from speccache.read.dataset import CacheDataset

__all__ = [
    "SP_LENGTH_KEY",
    "SP_ROWS_KEY",
    "SequenceParallelCollator",
    "SequenceParallelDataset",
    "sequence_parallel_rows",
]

SP_ROWS_KEY = "sp_rows"
"""Key of a sequence-parallel sample's int64 ``[2]``: the ``[start, stop)`` rows of the sample this rank holds."""
SP_LENGTH_KEY = "sp_length"
"""Key of a sequence-parallel sample's int64 scalar: the whole sample's length in rows."""


def sequence_parallel_rows(length: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous rows of a sample of ``length`` rows, in a group of ``world_size``.

    Every rank holds ``ceil(length / world_size)`` rows but the last ones, which hold the rest (a rank past the
    end holds none): the split of a sample padded to a multiple of ``world_size``, as Ulysses and ring attention
    shard it, without reading the padding.

    Raises:
        UsageError: ``rank`` is outside ``[0, world_size)``.
        ValueError: ``length`` is negative.
    """
    world_size, rank, length = operator.index(world_size), operator.index(rank), operator.index(length)
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"sequence-parallel rank {rank} is outside [0, world_size={world_size})")
    if length < 0:
        raise ValueError(f"a sample's length must be >= 0, got {length}")
    each = -(-length // world_size)
    return slice(min(rank * each, length), min((rank + 1) * each, length))


class SequenceParallelDataset(Dataset):
    """Rank ``rank`` of a sequence-parallel group's part of every sample of ``dataset``.

    Sample ``i`` holds this rank's rows (:func:`sequence_parallel_rows`) of each ragged key, the whole of each key
    in ``whole`` and of each fixed key, and :data:`SP_ROWS_KEY` / :data:`SP_LENGTH_KEY` (which rows, of how
    many); only the rows it holds are read from disk. Every rank of a group must read the same sample indices:
    give the group's ranks the same sampler (data parallelism splits samples across groups, not within one).

    Args:
        dataset: the cache reader (a :class:`speccache.read.CacheDataset` or a view of caches).
        rank, world_size: this rank's place in its sequence-parallel group (default: ``group``'s).
        group: the ``torch.distributed`` group of the sequence-parallel ranks (default: the whole world), used
            when ``rank`` and ``world_size`` are not given.
        whole: ragged keys every rank reads whole (those the dataset does not hold are skipped).

    Raises:
        ValueError: only one of ``rank`` and ``world_size``, a rank outside the group, or a ``whole`` key that is
            not ragged.
        RuntimeError: no rank given and no process group initialised.
    """

    def __init__(
        self,
        dataset: CacheDataset,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        group: Any = None,
        whole: Sequence[str] = ("input_ids", "loss_mask"),
    ) -> None:
        if (rank is None) != (world_size is None):
            raise UsageError("pass both rank and world_size, or neither (to take them from the process group)")
        if rank is None:
            position = group_position(group)
            if position is None:
                raise RuntimeError(
                    "SequenceParallelDataset without rank and world_size needs an initialised process group "
                    "(torchrun + torch.distributed.init_process_group), or pass rank= and world_size="
                )
            rank, world_size = position
        assert world_size is not None  # both or neither, checked above
        sequence_parallel_rows(0, rank, world_size)  # checks the rank
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        ragged = set(dataset.ragged_keys)
        fixed = [k for k in whole if k in dataset.keys and k not in ragged]
        if fixed:
            raise ValueError(f"whole={list(whole)}: {fixed} are fixed keys, which every rank reads whole anyway")
        self.whole = tuple(k for k in dataset.keys if k in set(whole) or k not in ragged)
        self.split = tuple(k for k in dataset.keys if k not in self.whole)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = self.dataset.sample_length(index)
        rows = sequence_parallel_rows(length, self.rank, self.world_size)
        sample = self.dataset.read(index, rows, keys=self.split) if self.split else {}
        if self.whole:
            sample.update(self.dataset.read(index, keys=self.whole))
        sample[SP_ROWS_KEY] = torch.tensor([rows.start, rows.stop], dtype=torch.int64)
        sample[SP_LENGTH_KEY] = torch.tensor(length, dtype=torch.int64)
        return sample

    def collator(self, pad_values: Mapping[str, float | int | bool] | None = None) -> SequenceParallelCollator:
        """The collator of these samples (:class:`SequenceParallelCollator`)."""
        ragged = set(self.dataset.ragged_keys)
        return SequenceParallelCollator([k for k in self.split if k in ragged], [k for k in self.whole if k in ragged],
                                        pad_values)  # fmt: skip


class SequenceParallelCollator:
    """Batches of :class:`SequenceParallelDataset` samples: this rank's rows of each split key padded to the
    batch's longest part, with ``lengths`` and ``attention_mask`` of those rows (as :class:`PadCollator`); the
    whole keys padded to the batch's longest sample (their lengths are :data:`SP_LENGTH_KEY`).

    Args:
        split: the ragged keys each rank holds its rows of.
        whole: the ragged keys each rank holds whole.
        pad_values: per-key pad value (default 0).
    """

    def __init__(
        self, split: Sequence[str], whole: Sequence[str], pad_values: Mapping[str, float | int | bool] | None = None
    ) -> None:
        self.whole = frozenset(whole)
        self.part = PadCollator(split, pad_values)
        self.full = PadCollator(whole, pad_values)

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = self.part([{k: v for k, v in s.items() if k not in self.whole} for s in samples])
        if self.whole:
            full = self.full([{k: s[k] for k in self.whole} for s in samples])
            batch.update({k: full[k] for k in self.whole})
        return batch
