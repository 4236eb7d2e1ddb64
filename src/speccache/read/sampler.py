"""A shuffling sampler that keeps reads within a few shards, for distributed, resumable training.

A uniform permutation of a large cache makes every batch touch as many shards
as it has samples: cold reads become random I/O over the whole cache and the
reader keeps reopening shards. :class:`LocalityShuffleSampler` shuffles at two
levels instead: the order of the shards, then the samples inside windows of
``window`` consecutive shards of that order. Every window is read to the end
before the next begins, so a stretch of the sequence one window long
(``window * shard_size`` samples) touches at most ``2 * window`` shards, or
``3 * window`` where it straddles the one window shortened by the cache's
partial last shard.

Resuming. A DataLoader draws indices ahead of what the training loop has seen
(``prefetch_factor * num_workers`` batches), so the sampler cannot know how far
training got. The trainer counts the samples (or batches) it consumed in the
epoch and records them; on resume it hands that count back::

    # when checkpointing, inside epoch ``epoch`` after ``steps`` batches of this pass
    state = sampler.state_dict(consumed=sampler.start + steps * batch_size)
    ...
    # in the resumed job, before building the DataLoader's iterator
    sampler.load_state_dict(state)
    for epoch in range(state["epoch"], num_epochs):
        sampler.set_epoch(epoch)  # keeps the offset for the resumed epoch, clears it for the next
        for batch in loader: ...

The sequence is computed in the main process, so the number of DataLoader
workers does not change it, and it is a pure function of
``(seed, epoch, len, shard_size, window, world_size, rank, drop_last)``.

Reading ahead. With ``prefetch=dataset.prefetch`` (see
:meth:`speccache.read.CacheDataset.prefetch`) the sampler announces the samples
it will yield next, so that the disk reads them while the current batch is
copied. A window's samples are announced together (when ``prefetch_ahead``
holds a window), so that the reader can take its shards in file order instead
of one shuffled sample after another.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler, Sampler

from speccache.dist import distributed_position

__all__ = ["LocalityShuffleSampler", "default_sampler"]

_CHECKED = ("seed", "window", "shard_size", "num_samples", "world_size", "drop_last")


class LocalityShuffleSampler(Sampler[int]):
    """Shuffles shard order, then samples within windows of ``window`` shards; split across ranks.

    The epoch's global sequence (every sample once) is padded by repeating its
    head (or, with ``drop_last``, cut) to a multiple of ``world_size`` and split
    into ``world_size`` contiguous runs, one per rank: ranks get the same number
    of indices, are disjoint before padding, and each reads its own shards.

    Args:
        data: the dataset (anything with ``len``) or its length.
        shard_size: samples per shard of the cache (``CacheDataset.shard_size``).
        seed: seed shared by every rank.
        window: shards whose samples are shuffled together; larger mixes more, reads less locally.
        rank: this process's rank.
        world_size: number of ranks.
        drop_last: drop the tail that does not divide evenly among ranks instead of padding.
        prefetch: called with indices this rank will yield soon, keeping ``prefetch_ahead`` of them
            announced beyond the current position, e.g. :meth:`speccache.read.CacheDataset.prefetch`,
            so that the disk reads the next batches while this one is processed. It runs where the
            sampler is iterated: the DataLoader's main process, whose page cache its workers share.
            When a window's samples fit in ``prefetch_ahead``, each call announces one whole window
            (this rank's part of it), as soon as the window starts within ``prefetch_ahead`` of the
            current position; otherwise calls announce ``prefetch_ahead // 2`` indices at a time.
        prefetch_ahead: how many indices ``prefetch`` stays ahead (default ``window * shard_size``:
            one window, so that the next window's shards are read while this one's are used).
        weights: per-sample mixture weights (e.g. :meth:`speccache.read.view.ViewDataset.sample_weights` of a
            merge made with ``--weights``): sample ``i`` appears ``floor(w)`` times per epoch, plus once more for a
            fixed seeded choice of a ``frac(w)`` share of the samples of weight ``w``; the copies are spread by the
            same windowed shuffle, so reads stay local.

    Raises:
        ValueError: a non-positive ``shard_size``, ``window`` or ``world_size``, or ``rank`` out of range.
    """

    def __init__(
        self,
        data: int | Sized,
        shard_size: int,
        *,
        seed: int = 0,
        window: int = 8,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        prefetch: Callable[[list[int]], object] | None = None,
        prefetch_ahead: int | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        num_samples = len(data) if isinstance(data, Sized) else operator.index(data)
        if num_samples < 0:
            raise ValueError(f"dataset length must be >= 0, got {num_samples}")
        self.copies: np.ndarray | None = None
        """The sample behind each position of the epoch, when ``weights`` repeat samples."""
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (num_samples,) or not np.all(np.isfinite(w)) or np.any(w < 0):
                raise ValueError(f"weights must give one finite weight >= 0 per sample ({num_samples})")
            extra = np.random.default_rng([seed, 0x5EED]).random(num_samples) < w - np.floor(w)
            self.copies = np.repeat(np.arange(num_samples, dtype=np.int64), np.floor(w).astype(np.int64) + extra)
            num_samples = len(self.copies)
        prefetch_ahead = window * shard_size if prefetch_ahead is None else prefetch_ahead
        shard_size, window, world_size, prefetch_ahead = (
            _positive(name, value)
            for name, value in (
                ("shard_size", shard_size),
                ("window", window),
                ("world_size", world_size),
                ("prefetch_ahead", prefetch_ahead),
            )
        )
        try:
            rank = operator.index(rank)
        except TypeError:
            rank = -1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
        self.num_samples = num_samples
        self.shard_size = shard_size
        self.seed = seed
        self.window = window
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.prefetch_ahead = prefetch_ahead
        if drop_last:
            self.per_rank = num_samples // world_size
        else:
            self.per_rank = -(-num_samples // world_size)
        self.epoch = 0
        self.start = 0
        """Offset into this rank's epoch sequence where the next pass begins (set by :meth:`load_state_dict`)."""

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts from its beginning."""
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The global sequence of ``epoch`` (default: the current one), before the rank split: every sample once
        (with ``weights``, as many times as its weight gives)."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int | None) -> tuple[np.ndarray, list[int]]:
        """:meth:`epoch_order` and where each window ends in it."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        n, size = self.num_samples, self.shard_size
        shards = rng.permutation(-(-n // size))
        lengths = np.minimum(size, n - shards * size)
        ends = np.cumsum(lengths)
        # Sample j of the sequence sits in block b at position j - (ends[b] - lengths[b]).
        order = np.arange(n, dtype=np.int64) + np.repeat(shards * size - (ends - lengths), lengths)
        window_ends = []
        for first in range(0, len(shards), self.window):
            last = min(first + self.window, len(shards))
            rng.shuffle(order[ends[first] - lengths[first] : ends[last - 1]])
            window_ends.append(int(ends[last - 1]))
        return (order if self.copies is None else self.copies[order]), window_ends

    def rank_order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's whole sequence for ``epoch`` (default: the current one), ignoring :attr:`start`."""
        return self._rank(epoch)[0]

    def _rank(self, epoch: int | None) -> tuple[np.ndarray, list[int]]:
        """:meth:`rank_order` and where its stretches of one window each end in it."""
        order, window_ends = self._epoch(epoch)
        total = self.per_rank * self.world_size
        if total > len(order):
            order = np.resize(order, total) if len(order) else order
        first = self.rank * self.per_rank
        ends = [e - first for e in window_ends if 0 < e - first < self.per_rank]
        return order[first : first + self.per_rank], [*ends, self.per_rank]

    def __iter__(self) -> Iterator[int]:
        order, ends = self._rank(None)
        order = order[self.start :].tolist()
        if self.prefetch is None:
            return iter(order)
        if self.window * self.shard_size <= self.prefetch_ahead:
            return self._prefetching_windows(order, [e - self.start for e in ends if e > self.start])
        return self._prefetching(order)

    def _prefetching_windows(self, order: list[int], ends: list[int]) -> Iterator[int]:
        """Yield ``order``, each stretch up to the next of ``ends`` announced in one call, once it starts within
        ``prefetch_ahead`` of the position."""
        assert self.prefetch is not None
        starts = [0, *ends[:-1]]
        announced = 0  # stretches announced
        for start, end in zip(starts, ends):
            while announced < len(ends) and starts[announced] <= start + self.prefetch_ahead:
                self.prefetch(order[starts[announced] : ends[announced]])
                announced += 1
            yield from order[start:end]

    def _prefetching(self, order: list[int]) -> Iterator[int]:
        assert self.prefetch is not None
        step = max(1, self.prefetch_ahead // 2)
        announced = 0
        for a in range(0, len(order), step):
            want = min(len(order), a + step + self.prefetch_ahead)
            if want > announced:
                self.prefetch(order[announced:want])
                announced = want
            yield from order[a : a + step]

    def __len__(self) -> int:
        """Indices the next pass yields: ``per_rank - start``."""
        return self.per_rank - self.start

    def state_dict(self, consumed: int) -> dict[str, int | bool]:
        """The resume state after the trainer consumed ``consumed`` samples of this rank's current epoch.

        ``consumed`` counts from the beginning of the epoch, not of the pass: a
        trainer counting batches since its loop started adds :attr:`start`. It
        must come from the trainer: the DataLoader has drawn more indices than
        training used.

        Raises:
            ValueError: ``consumed`` outside ``[0, per_rank]``.
        """
        consumed = operator.index(consumed)  # a 0-d integer tensor or numpy integer becomes a JSON-able int
        if not 0 <= consumed <= self.per_rank:
            raise ValueError(f"consumed={consumed} must be in [0, {self.per_rank}] (samples of this rank's epoch)")
        return {
            "epoch": self.epoch,
            "consumed": consumed,
            "seed": self.seed,
            "window": self.window,
            "shard_size": self.shard_size,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continue epoch ``state["epoch"]`` after its first ``state["consumed"]`` samples.

        Only ``epoch`` and ``consumed`` are required; the other keys of
        :meth:`state_dict`, when present, must match this sampler, since the
        remaining sequence would differ otherwise.

        Raises:
            ValueError: a mismatching setting or ``consumed`` out of range.
        """
        differing = [k for k in _CHECKED if k in state and state[k] != getattr(self, k)]
        if differing:
            details = ", ".join(f"{k}: state has {state[k]!r}, sampler has {getattr(self, k)!r}" for k in differing)
            raise ValueError(f"cannot resume: the sampler state was saved with other settings ({details})")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.per_rank:
            raise ValueError(f"consumed={consumed} must be in [0, {self.per_rank}] (samples of this rank's epoch)")
        self.epoch = int(state["epoch"])
        self.start = consumed


def _positive(name: str, value: Any) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def default_sampler(
    dataset: Sized,
    shard_size: int,
    *,
    shuffle: bool,
    distributed: bool,
    seed: int = 0,
    prefetch: Callable[[list[int]], object] | None = None,
    weights: Sequence[float] | None = None,
) -> Sampler[int] | None:
    """The sampler the dataloader builders use: locality shuffling when ``shuffle``, this rank's share when
    ``distributed``, ``None`` (the DataLoader's sequential order) otherwise.

    Raises:
        RuntimeError: ``distributed`` without an initialised process group.
    """
    if not (shuffle or distributed):
        return None
    rank, world_size = distributed_position() if distributed else (0, 1)
    if shuffle:
        return LocalityShuffleSampler(
            dataset, shard_size, seed=seed, rank=rank, world_size=world_size, prefetch=prefetch, weights=weights
        )
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)  # type: ignore[arg-type]
