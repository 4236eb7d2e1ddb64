"""Reading a cache while it is written: shards in the order they are sealed, disk reclaimed behind the trainer.

A producer writes each shard under a temporary name and renames it, so a shard under its final name is
whole; the follower opens it with every tensor's checksum checked (``verify``), so a torn or replaced
shard raises :class:`speccache.errors.CacheCorruptError` as in any reader. The stream ends when the
producer seals the manifest and this reader has had every shard of its share.

The order. Shards are shared among trainer ranks by index (shard ``i`` is rank ``i % world_size``'s), so
the shares are disjoint whatever the order shards appear in. A rank takes its shards as they appear
(the lowest sealed index first), or, with ``ordered``, strictly in index order (waiting for the next one
even when later ones are sealed): the sample sequence is then the same in every run. Either way it is a
pure function of ``(seed, the order the shards were taken in)``, which the state records.

Passes and the replay window. The ``p``-th shard taken opens pass ``p``, which yields the samples of the
window of the last ``replay`` shards taken (``replay=1``: that shard alone), shuffled with
``(seed, p)``. When the stream ends, ``replay - 1`` more passes drain the window, so every shard is read
exactly ``replay`` times, as in ``replay`` epochs, but with its repeats within ``replay`` shards of each
other instead of an epoch apart, and with only ``replay`` shards kept on disk.

Checkpoints and reclaiming. The sampler runs in the main process; the trainer (or :class:`FollowLoader`,
which counts for it) says how many samples it has consumed: ``state_dict(consumed)`` records the
position and the order taken, and ``acknowledge(consumed)`` reclaims, with ``reclaim``, every shard
whose last pass lies wholly within those samples (format/reclaim.py: a durable record first, then
the file is deleted or moved), so that a producer paused at its disk cap goes on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from speccache.dist import distributed_position, group_position
from speccache.errors import CacheCorruptError, CacheFormatError, FollowTimeoutError, UsageError
from speccache.format import Manifest, existing_shard_indices, manifest_path, num_shards, shard_path
from speccache.format.durable import writes_to
from speccache.format.reclaim import read_reclaims, reclaim_shard
from speccache.read._shard import Sample
from speccache.read.collate import PadCollator
from speccache.read.dataset import CacheDataset, _identity

log = logging.getLogger(__name__)

__all__ = ["Follow", "FollowDataset", "FollowLoader", "FollowSampler", "check_follow_loader", "follow_settings"]

_STATE_CHECKED = ("seed", "shuffle", "replay", "ordered", "rank", "world_size")


@dataclass(frozen=True)
class Follow:
    """How a reader follows a cache that is being written (``CacheDataset(path, follow=Follow(...))``).

    Attributes:
        shuffle: shuffle the samples of each pass (with ``seed`` and the pass number); else stored order.
        seed: the shuffling seed, the same on every rank.
        ordered: take this rank's shards strictly in index order (the same sequence in every run) instead of
            as they appear (the least waiting).
        replay: every shard is read this many times, within a window of the last ``replay`` shards taken
            (``replay`` epochs over a bounded window; the disk keeps ``replay`` shards per rank).
        reclaim: delete each shard once its samples' last use is acknowledged (see :meth:`FollowSampler.acknowledge`);
            without it nothing is ever deleted.
        reclaim_to: move reclaimed shards into this directory instead of deleting them.
        timeout: seconds to wait for the next shard (or for the manifest) before :class:`FollowTimeoutError`.
        poll: seconds between looks at the directory while waiting.
        rank, world_size: this trainer's share (default: the initialised process group's, else the whole cache).
    """

    shuffle: bool = False
    seed: int = 0
    ordered: bool = False
    replay: int = 1
    reclaim: bool = False
    reclaim_to: str | None = None
    timeout: float = 600.0
    poll: float = 0.5
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.replay, bool) or not isinstance(self.replay, int) or self.replay < 1:
            raise UsageError(f"replay must be an integer >= 1 (shards in the window), got {self.replay!r}")
        if not self.timeout > 0 or not self.poll > 0:
            raise UsageError(f"timeout and poll must be positive seconds, got {self.timeout!r} and {self.poll!r}")
        if self.reclaim_to is not None and not self.reclaim:
            raise UsageError("reclaim_to moves reclaimed shards: it needs reclaim=True")
        if (self.rank is None) != (self.world_size is None):
            raise UsageError("pass both rank and world_size, or neither")
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside [0, world_size={self.world_size})")

    def position(self) -> tuple[int, int]:
        """``(rank, world_size)``: the given ones, the initialised process group's, or ``(0, 1)``."""
        if self.rank is not None and self.world_size is not None:  # both or neither (__post_init__)
            return self.rank, self.world_size
        return group_position() or (0, 1)


def wait_for_manifest(cache_dir: str, timeout: float, poll: float) -> None:
    """Return once ``cache_dir`` has a manifest (a producer started on it).

    Raises:
        FollowTimeoutError: none appeared within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not os.path.exists(manifest_path(cache_dir)):
        if time.monotonic() >= deadline:
            raise FollowTimeoutError(
                f"{cache_dir}: no {os.path.basename(manifest_path(cache_dir))} after {timeout:g} s of following: no "
                "producer has started on this directory. Start speccache precompute --out on it (or check the "
                "path), or give the reader a longer timeout."
            )
        time.sleep(poll)


class FollowSampler(Sampler[int]):
    """This rank's sample indices of a cache being written, shard by shard as each is sealed (see the module).

    Args:
        dataset: a reader of the cache opened with ``follow`` (any :class:`CacheDataset` subclass).
        follow: the settings.
        prefetch: the reader's ``prefetch`` hook, called with each pass's indices.

    Raises:
        FollowTimeoutError: (iterating) no new shard of this rank's share within ``follow.timeout`` seconds.
    """

    def __init__(
        self, dataset: CacheDataset, follow: Follow, prefetch: Callable[[list[int]], object] | None = None
    ) -> None:
        self.dataset = dataset
        self.follow = follow
        self.cache_dir = dataset.cache_dir
        self.rank, self.world_size = follow.position()
        self.prefetch = prefetch
        manifest = dataset.manifest
        self.share = list(range(self.rank, num_shards(manifest.num_samples, manifest.shard_size), self.world_size))
        self.arrived: list[int] = []
        """This rank's shards in the order taken."""
        self.start = 0
        """Samples of the sequence already consumed (a loaded state's); iteration resumes there."""
        self.yielded = 0
        """Samples of the sequence yielded so far (ahead of what the trainer consumed, by the loader's prefetch)."""
        self.reclaimed: set[int] = set()
        self._ends: list[int] = []  # cumulative sample counts at the end of each pass
        self._skipped: set[int] = set()
        self._ended = False
        self._sealed = manifest.complete
        self._manifest_stat = _identity(manifest_path(self.cache_dir))

    # -- the sequence

    def _samples(self, shard: int) -> int:
        return self.dataset.manifest.shard_samples(shard)

    def _passes(self) -> int:
        """Passes known so far: one per shard taken, plus the draining passes once the stream has ended."""
        n = len(self.arrived)
        return n + (self.follow.replay - 1 if self._ended and n else 0)

    def _window(self, p: int) -> list[int]:
        return self.arrived[max(0, p - self.follow.replay + 1) : min(p + 1, len(self.arrived))]

    def _pass_order(self, p: int) -> list[int]:
        size = self.dataset.shard_size
        order = [s * size + i for s in self._window(p) for i in range(self._samples(s))]
        if self.follow.shuffle:
            perm = np.random.default_rng([self.follow.seed, p]).permutation(len(order))
            order = [order[i] for i in perm]
        return order

    def _pass_end(self, p: int) -> int:
        while len(self._ends) <= p:
            q = len(self._ends)
            self._ends.append((self._ends[-1] if self._ends else 0) + sum(map(self._samples, self._window(q))))
        return self._ends[p]

    def __iter__(self) -> Iterator[int]:
        resume_at = self.yielded = self.start
        p = 0
        while True:
            while len(self.arrived) <= p and not self._ended:
                self._take_next()
            if p >= self._passes():
                self.start = self.yielded
                return
            begin = self._pass_end(p - 1) if p else 0
            if self._pass_end(p) > resume_at:  # passes before a loaded state's position are skipped whole
                order = self._pass_order(p)[max(0, resume_at - begin) :]
                if self.prefetch is not None and order:
                    self.prefetch(order)
                for index in order:
                    self.yielded += 1
                    yield index
            p += 1

    def __len__(self) -> int:
        """Samples of the whole sequence (this rank's share, each shard ``replay`` times)."""
        return self.follow.replay * sum(map(self._samples, self.share))

    # -- waiting for shards

    def _take_next(self) -> None:
        """Append the next shard of this rank's share to :attr:`arrived`, or mark the stream ended."""
        deadline = time.monotonic() + self.follow.timeout
        taken = set(self.arrived)
        while True:
            self._refresh_manifest()
            present = existing_shard_indices(self.cache_dir)
            reclaims = read_reclaims(self.cache_dir)
            left = [s for s in self.share if s not in taken and s not in self._skipped]
            gone = [s for s in left if s in reclaims]
            if gone:
                log.warning(
                    "%s: shards %s of this reader's share were reclaimed before it took them (a trainer restarted "
                    "from a state older than its acknowledgments?); they are skipped",
                    self.cache_dir,
                    gone,
                )
                self._skipped.update(gone)
                left = [s for s in left if s not in reclaims]
            if not left:
                self._ended = True
                return
            ready = [s for s in left if s in present]
            if self.follow.ordered:
                ready = ready[:1] if ready and ready[0] == left[0] else []
            if ready:
                self.arrived.append(ready[0])
                return
            if time.monotonic() >= deadline:
                raise FollowTimeoutError(self._timeout_message(left))
            time.sleep(self.follow.poll)

    def _refresh_manifest(self) -> None:
        current = _identity(manifest_path(self.cache_dir))
        if current == self._manifest_stat:
            return
        self._manifest_stat = current
        try:
            found = Manifest.read(self.cache_dir, self.dataset.cache_name)
        except (FileNotFoundError, CacheFormatError):
            return  # the opening of the shard reports a rewritten cache
        self._sealed = found.complete

    def _timeout_message(self, left: Sequence[int]) -> str:
        state = "sealed" if self._sealed else "not sealed: its producer is still running, stopped or paused"
        return (
            f"{self.cache_dir}: no new shard for this reader (rank {self.rank} of {self.world_size}) after "
            f"{self.follow.timeout:g} s; it waits for shard {left[0]} ({len(left)} of its share left) and the "
            f"cache is {state}. Resume the producer (speccache precompute ... --resume), check that its disk cap "
            "holds what every trainer rank reads before it acknowledges (its replay window, the loader's read-ahead "
            "and, with acknowledge='manual', the samples between two checkpoints)"
            + (
                " and, with ordered=True and several producer ranks, the shards this rank waits behind"
                if self.follow.ordered
                else ""
            )
            + ", or give the reader a longer timeout."
        )

    # -- state and reclaiming

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """The position after ``consumed`` samples of the sequence, and the shards taken (a JSON-able dict).

        Args:
            consumed: samples the trainer has finished with, counted from the start of the sequence.
        """
        if not 0 <= consumed <= max(self.yielded, self.start):
            raise ValueError(f"consumed={consumed} is outside the {max(self.yielded, self.start)} samples yielded")
        state: dict[str, Any] = {k: getattr(self.follow, k) for k in ("seed", "shuffle", "replay", "ordered")}
        state.update(rank=self.rank, world_size=self.world_size, consumed=consumed, arrived=list(self.arrived))
        state["skipped"] = sorted(self._skipped)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict`'s position, with its shards taken in its order, and acknowledge it (a
        loaded state was saved: with ``reclaim`` the shards it has finished are reclaimed).

        Raises:
            ValueError: the state was taken with other settings (names the field).
        """
        mine = {k: getattr(self.follow, k, None) for k in _STATE_CHECKED}
        mine.update(rank=self.rank, world_size=self.world_size)
        for key in _STATE_CHECKED:
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"cannot load a follow state taken with {key}={state.get(key)!r} into a reader with "
                    f"{key}={mine[key]!r}; build the reader with the checkpoint's settings"
                )
        foreign = [s for s in state["arrived"] if s not in self.share]
        if foreign:
            raise ValueError(f"the follow state lists shards {foreign} outside this rank's share")
        self.arrived = list(state["arrived"])
        self._skipped = set(state.get("skipped", ()))
        self._ends, self._ended = [], False
        self.start = self.yielded = int(state["consumed"])
        # A loaded state is one the trainer saved: what it has consumed is done with, and a producer paused at its
        # disk cap may be waiting for exactly those shards (a trainer killed between its checkpoint and its
        # acknowledgment left them).
        self.acknowledge(self.start)

    def acknowledge(self, consumed: int) -> list[int]:
        """Reclaim (with ``follow.reclaim``) every shard whose last use lies within the first ``consumed`` samples.

        Returns:
            The shards reclaimed by this call.

        Raises:
            CacheCorruptError: a shard to reclaim is damaged (it is kept, and no record is written).
            OutputError: the reclaim record cannot be written (a full disk): the shard is kept.
        """
        if not self.follow.reclaim:
            return []
        done = []
        for a, shard in enumerate(self.arrived):
            last = a + self.follow.replay - 1
            if shard in self.reclaimed or last >= self._passes() or self._pass_end(last) > consumed:
                continue
            if not os.path.lexists(shard_path(self.cache_dir, shard)):
                if shard in read_reclaims(self.cache_dir):
                    self.reclaimed.add(shard)  # by an earlier life of this trainer
                    continue
                raise CacheCorruptError(
                    f"{shard_path(self.cache_dir, shard)} vanished after this reader read it, with no reclaim record: "
                    "something other than a following reader deleted it. Nothing was reclaimed; restore the shard "
                    "or re-run the producer with --resume."
                )
            with writes_to(self.cache_dir):
                reclaim_shard(
                    self.cache_dir, shard, self.dataset.manifest.schema, self._samples(shard), self.follow.reclaim_to
                )
            self.reclaimed.add(shard)
            done.append(shard)
        return done


class FollowLoader(DataLoader):
    """A DataLoader over a cache being written that counts what the trainer consumed, for exact checkpoints
    and reclaiming (what :meth:`FollowDataset.loader` and the builders' ``follow=`` return).

    A batch counts as consumed once the trainer asks for the next one (its step is done). With
    ``acknowledge="auto"`` the loader then reclaims the shards it finished; with ``"manual"`` nothing is
    reclaimed until the trainer calls :meth:`acknowledge` with a state it has saved, so that a trainer
    restarted from its last checkpoint never finds a shard of its future deleted.

    Args:
        dataset: the cache reader (opened with ``follow``).
        sampler: its :class:`FollowSampler`.
        batch_size: samples per batch.
        acknowledge: ``"auto"`` or ``"manual"``.
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ``pin_memory``...).
    """

    def __init__(
        self,
        dataset: CacheDataset,
        sampler: FollowSampler,
        batch_size: int,
        acknowledge: str = "auto",
        **kwargs: Any,
    ) -> None:
        if acknowledge not in ("auto", "manual"):
            raise ValueError(f"acknowledge must be 'auto' or 'manual', got {acknowledge!r}")
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self.follow_sampler = sampler
        self.auto_acknowledge = acknowledge == "auto"
        self.consumed = sampler.start

    def __iter__(self) -> Iterator[Any]:
        sampler = self.follow_sampler
        start = self.consumed = sampler.start
        for batches, batch in enumerate(super().__iter__(), 1):
            if self.auto_acknowledge:
                sampler.acknowledge(self.consumed)
            # the batch sampler has drawn these samples, in order: all full batches but perhaps the last
            self.consumed = start + min(batches * self.batch_size, sampler.yielded - start)  # type: ignore[operator]
            yield batch
        if self.auto_acknowledge:
            sampler.acknowledge(self.consumed)

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches the trainer has consumed (see :meth:`FollowSampler.state_dict`)."""
        return self.follow_sampler.state_dict(self.consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (before iterating)."""
        self.follow_sampler.load_state_dict(state)
        self.consumed = self.follow_sampler.start

    def acknowledge(self, state: dict[str, Any] | None = None) -> list[int]:
        """Reclaim what ``state`` (default: what is consumed now) has finished; returns the shards reclaimed."""
        return self.follow_sampler.acknowledge(self.consumed if state is None else int(state["consumed"]))


class FollowDataset(IterableDataset):
    """A cache being written, as an iterable of samples (``CacheDataset(path, follow=True)`` returns one).

    Iterating it yields this rank's samples as their shards are sealed and ends once the producer has sealed
    the cache (see the module). For batches with DataLoader workers, and checkpoints that count only what
    the trainer consumed, use :meth:`loader`; iterated directly (or by a DataLoader without workers) it
    counts the samples it has yielded, and each sample is consumed once the next one is asked for.

    Args:
        dataset_cls: the reader class (``CacheDataset`` or a method's subclass).
        cache_dir: the cache directory (waited for, up to ``follow.timeout``, if no producer has started yet).
        *args: passed to the reader after the directory (``keys``, or a layer reader's ``fields``).
        follow: the settings (``True``: the defaults).
        **kwargs: passed to the reader (``max_open_shards``...).

    Raises:
        FollowTimeoutError: no manifest appeared within the timeout.
        CacheFormatError: as for the reader; a view (views select samples of sealed caches only).
    """

    def __init__(
        self, dataset_cls: type[CacheDataset], cache_dir: str, *args: Any, follow: Follow | bool = True, **kwargs: Any
    ) -> None:
        self.follow = follow if isinstance(follow, Follow) else Follow()
        wait_for_manifest(cache_dir, self.follow.timeout, self.follow.poll)
        reader = object.__new__(dataset_cls)
        reader.__init__(cache_dir, *args, follow=True, **kwargs)
        self.reader = reader
        self.sampler = FollowSampler(reader, self.follow, prefetch=reader.prefetch)
        self.consumed = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("reader", "__setstate__"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.reader, name)  # the reader's description: manifest, schema, collator...

    def __iter__(self) -> Iterator[Sample]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "a FollowDataset iterated in DataLoader workers would give each worker the whole stream; "
                "build the loader with dataset.loader(batch_size, num_workers=N) (or a builder's follow=) instead"
            )
        self.consumed = self.sampler.start
        for index in self.sampler:
            self.sampler.acknowledge(self.consumed)
            self.consumed += 1
            yield self.reader[index]
        self.sampler.acknowledge(self.consumed)

    def state_dict(self) -> dict[str, Any]:
        """The position after the samples iterated so far (see :meth:`FollowSampler.state_dict`)."""
        return self.sampler.state_dict(self.consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (before iterating)."""
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.start

    def loader(self, batch_size: int, acknowledge: str = "auto", **kwargs: Any) -> FollowLoader:
        """A :class:`FollowLoader` of this stream's batches (``collate_fn`` defaults to the reader's collator).

        Args:
            batch_size: samples per batch.
            acknowledge: ``"auto"`` (reclaim as batches are consumed) or ``"manual"`` (on ``loader.acknowledge``).
            **kwargs: passed to ``DataLoader``; ``collate_fn`` defaults to the reader's ``collator()``, or a
                :class:`speccache.read.PadCollator` of its ragged keys.
        """
        if "collate_fn" not in kwargs:  # a method's reader brings its own; plain samples pad their ragged keys
            collator = getattr(self.reader, "collator", None)
            kwargs["collate_fn"] = collator() if collator is not None else PadCollator(set(self.reader.ragged_keys))
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        return FollowLoader(self.reader, self.sampler, batch_size, acknowledge, **kwargs)


def follow_settings(follow: Follow | bool, *, shuffle: bool, seed: int, distributed: bool) -> Follow:
    """``follow`` (``True`` or settings) with a loader builder's ``shuffle``, ``seed`` and ``distributed`` applied:
    ``distributed`` gives each rank of the process group its share, else this process reads every shard.

    Raises:
        RuntimeError: ``distributed`` without an initialised process group.
    """
    base = follow if isinstance(follow, Follow) else Follow()
    if distributed:
        rank, world_size = distributed_position()
    else:
        rank, world_size = (
            (base.rank, base.world_size) if base.rank is not None and base.world_size is not None else (0, 1)
        )
    return replace(base, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)


def check_follow_loader(dataset: FollowDataset, shuffle: bool, sampler: Sampler | None) -> None:
    """Refuse a loader builder's ``sampler`` or ``shuffle`` that contradicts a following dataset's own settings.

    Raises:
        ValueError: names the argument and the fix.
    """
    if sampler is not None:
        raise ValueError("a following dataset orders its samples itself (FollowSampler): pass no sampler=")
    if shuffle != dataset.follow.shuffle:
        raise ValueError(
            f"shuffle={shuffle} contradicts the following dataset's Follow(shuffle={dataset.follow.shuffle}); "
            "set shuffle in its Follow settings and pass the same value"
        )
