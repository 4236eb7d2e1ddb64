"""LocalityShuffleSampler: coverage across ranks, determinism, locality and exact mid-epoch resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from speccache.read.sampler import LocalityShuffleSampler


def rank_sequences(n: int, shard_size: int, world_size: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        s = LocalityShuffleSampler(n, shard_size, rank=rank, world_size=world_size, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize(
    "n, shard_size, world_size", [(100, 10, 1), (100, 10, 4), (103, 7, 3), (97, 16, 8), (5, 4, 8), (1, 1, 3)]
)
def test_every_sample_exactly_once_per_epoch(n: int, shard_size: int, world_size: int) -> None:
    seqs = rank_sequences(n, shard_size, world_size, epoch=2, window=3)
    per_rank = -(-n // world_size)
    assert all(len(s) == per_rank for s in seqs)
    flat = [i for s in seqs for i in s]
    assert set(flat) == set(range(n))
    # padding repeats samples, but only as many as needed and never inside one rank's real share
    counts = Counter(flat)
    assert sum(c - 1 for c in counts.values()) == per_rank * world_size - n
    real = [i for s in seqs for i in s][:n]
    assert sorted(real) == list(range(n))


@pytest.mark.parametrize("n, shard_size, world_size", [(103, 7, 3), (97, 16, 8), (100, 10, 4)])
def test_drop_last_gives_disjoint_equal_shares(n: int, shard_size: int, world_size: int) -> None:
    seqs = rank_sequences(n, shard_size, world_size, drop_last=True)
    assert all(len(s) == n // world_size for s in seqs)
    flat = [i for s in seqs for i in s]
    assert len(flat) == len(set(flat)) and set(flat) <= set(range(n))


def test_deterministic_per_seed_and_epoch_and_epochs_differ() -> None:
    a = rank_sequences(1000, 50, 2, epoch=3, seed=7)
    assert a == rank_sequences(1000, 50, 2, epoch=3, seed=7)
    assert a != rank_sequences(1000, 50, 2, epoch=4, seed=7)
    assert a != rank_sequences(1000, 50, 2, epoch=3, seed=8)
    s = LocalityShuffleSampler(1000, 50, seed=7)
    orders = []
    for epoch in range(3):
        s.set_epoch(epoch)
        orders.append(list(s))
    assert len({tuple(o) for o in orders}) == 3
    assert all(sorted(o) == list(range(1000)) for o in orders)


@pytest.mark.parametrize("shard_size, window, world_size", [(64, 4, 1), (50, 2, 3), (7, 8, 2)])
def test_reads_stay_within_few_shards(shard_size: int, window: int, world_size: int) -> None:
    span = window * shard_size
    # whole shards only: the sequence is a series of windows of exactly `window` shards
    n = 60 * shard_size
    order = LocalityShuffleSampler(n, shard_size, window=window, seed=2).epoch_order().tolist()
    for a in range(0, n, span):
        assert len({i // shard_size for i in order[a : a + span]}) <= window
    # a partial last shard shortens one window; any stretch a window long still touches few shards
    n += shard_size // 2 + 1
    per = -(-n // world_size)
    for rank, seq in enumerate(rank_sequences(n, shard_size, world_size, epoch=1, window=window)):
        real = seq[: max(0, min(per, n - rank * per))]
        for a in range(len(real)):
            assert len({i // shard_size for i in real[a : a + span]}) <= 3 * window
        assert real != sorted(real)


def test_shuffles_within_windows_and_across_shards() -> None:
    s = LocalityShuffleSampler(10_000, 100, window=4, seed=1)
    order = s.epoch_order()
    first_window = order[:400]
    assert len({int(i) // 100 for i in first_window}) == 4
    # not shard-by-shard: the first 100 samples mix the window's 4 shards
    assert len({int(i) // 100 for i in order[:100]}) == 4
    assert [int(i) // 100 for i in order[::400]] != sorted(int(i) // 100 for i in order[::400])


def test_state_round_trip_and_checks() -> None:
    s = LocalityShuffleSampler(100, 10, seed=3, world_size=2, rank=1)
    s.set_epoch(5)
    state = s.state_dict(consumed=20)
    t = LocalityShuffleSampler(100, 10, seed=3, world_size=2, rank=1)
    t.load_state_dict(state)
    assert (t.epoch, t.start, len(t)) == (5, 20, 30)
    t.set_epoch(5)
    assert t.start == 20
    t.set_epoch(6)
    assert (t.start, len(t)) == (0, 50)
    with pytest.raises(ValueError, match="seed"):
        LocalityShuffleSampler(100, 10, seed=4, world_size=2, rank=1).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=51)
    with pytest.raises(ValueError):
        LocalityShuffleSampler(100, 10, rank=2, world_size=2)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_gives_the_remaining_sequence(world_size: int) -> None:
    for rank in range(world_size):
        full = LocalityShuffleSampler(1000, 32, seed=11, rank=rank, world_size=world_size)
        full.set_epoch(2)
        whole = list(full)
        for consumed in (0, 1, 137, len(whole)):
            resumed = LocalityShuffleSampler(1000, 32, seed=11, rank=rank, world_size=world_size)
            resumed.load_state_dict(full.state_dict(consumed=consumed))
            resumed.set_epoch(2)
            assert whole[:consumed] + list(resumed) == whole


class Indices(Dataset):
    def __len__(self) -> int:
        return 700

    def __getitem__(self, i: int) -> int:
        return i


def _loader(sampler: LocalityShuffleSampler, workers: int) -> DataLoader:
    return DataLoader(
        Indices(), batch_size=8, sampler=sampler, num_workers=workers, prefetch_factor=4 if workers else None
    )


@pytest.mark.parametrize("before, after", [(0, 2), (2, 0), (2, 2)])
def test_resume_with_dataloader_prefetching_and_other_worker_count(before: int, after: int) -> None:
    def sampler() -> LocalityShuffleSampler:
        return LocalityShuffleSampler(700, 25, seed=5, window=3, rank=1, world_size=2)

    reference = sampler()
    reference.set_epoch(1)
    expected = [int(i) for batch in _loader(reference, 0) for i in batch]

    first = sampler()
    first.set_epoch(1)
    seen: list[int] = []
    steps = 0
    for batch in _loader(first, before):  # workers have prefetched well past this point
        seen.extend(int(i) for i in batch)
        steps += 1
        if steps == 13:
            break
    state = first.state_dict(consumed=first.start + steps * 8)

    second = sampler()
    second.load_state_dict(state)
    second.set_epoch(1)
    assert len(_loader(second, after)) == -(-(350 - 104) // 8)
    rest = [int(i) for batch in _loader(second, after) for i in batch]
    assert seen + rest == expected

    # the epoch after a resumed one starts from its beginning
    second.set_epoch(2)
    reference.set_epoch(2)
    assert list(second) == list(reference)


def test_accepts_a_dataset_and_empty() -> None:
    assert len(LocalityShuffleSampler(torch.zeros(9), 4)) == 9
    assert list(LocalityShuffleSampler(0, 4, world_size=2)) == []


@pytest.mark.parametrize("world_size, start", [(1, 0), (3, 0), (2, 37)])
def test_prefetch_announces_whole_windows_a_window_ahead(world_size: int, start: int) -> None:
    n, shard_size, window = 103, 7, 2  # a partial last shard shortens one window
    for rank in range(world_size):
        seen: list[int] = []
        calls: list[tuple[int, list[int]]] = []

        def record(ix: list[int], seen: list[int] = seen, calls: list[tuple[int, list[int]]] = calls) -> None:
            calls.append((len(seen), ix))

        s = LocalityShuffleSampler(n, shard_size, window=window, rank=rank, world_size=world_size, prefetch=record)
        s.start = start
        for i in s:
            assert i in {j for _, ix in calls for j in ix}
            seen.append(i)
        assert [j for _, ix in calls for j in ix] == seen
        first = 0
        for at, ix in calls:
            assert at <= first <= at + window * shard_size  # the window starts within prefetch_ahead of the position
            assert len({i // shard_size for i in ix}) <= window  # one window's samples
            first += len(ix)
        for _, ix in calls[1:-1]:  # whole windows (a rank's first and last stretch may be parts of one)
            assert len(ix) == sum(min(shard_size, n - k * shard_size) for k in {i // shard_size for i in ix})
