"""OverlappedShardWriter and the shard accumulator: the bytes of synchronous writes, errors, waiting, bounds, copies."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import speccache.write.loops as write_module
from speccache.errors import ShardWriteError
from speccache.format import LENGTHS_KEY, shard_path
from speccache.testing.synthetic import write_synthetic_cache
from speccache.write import OverlappedShardWriter, compute_shard_runs
from speccache.write.loops import ShardAccumulator as _ShardAccumulator

log = logging.getLogger(__name__)


def read_tree(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("shard-"):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out


@pytest.mark.parametrize("encoding", ["raw", "fp8"])
@pytest.mark.parametrize("shard_size, batch_size", [(8, 4), (6, 4), (4, 8), (5, 5)])
def test_overlapped_writer_gives_byte_identical_shards(tmp_path, encoding, shard_size, batch_size):
    args = dict(num_samples=37, shard_size=shard_size, batch_size=batch_size, hidden=16, max_len=20, encoding=encoding)
    sync = write_synthetic_cache(str(tmp_path / "sync"), overlap=False, **args)
    overlapped = write_synthetic_cache(str(tmp_path / "overlapped"), overlap=True, **args)
    files = read_tree(str(tmp_path / "sync"))
    assert len(files) == -(-37 // shard_size)
    assert read_tree(str(tmp_path / "overlapped")) == files
    assert sync.shards == overlapped.shards


def _shard(n: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n, 3), value)}


def test_an_error_surfaces_at_the_next_call_and_at_close_naming_the_shard(tmp_path):
    written: list[int] = []

    def write(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        if index == 1:
            raise OSError(28, "No space left on device")
        written.append(index)
        return shard_path(output_dir, index)

    writer = OverlappedShardWriter(write, depth=2)
    writer(str(tmp_path), 0, _shard(2))
    writer(str(tmp_path), 1, _shard(2))
    deadline = time.monotonic() + 10
    with pytest.raises(ShardWriteError) as raised:
        index = 2
        while time.monotonic() < deadline:  # calls succeed until the writer thread has met the failure
            writer(str(tmp_path), index, _shard(2))
            index += 1
            time.sleep(0.01)
    assert shard_path(str(tmp_path), 1) in str(raised.value) and "No space left" in str(raised.value)
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(ShardWriteError) as at_close:
        writer.close()
    assert at_close.value is raised.value
    assert written == [0]  # nothing after the failed shard is written, so no gap can hide


def test_close_waits_for_every_queued_write(tmp_path):
    written: list[int] = []

    def slow(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        time.sleep(0.05)
        written.append(index)
        return shard_path(output_dir, index)

    writer = OverlappedShardWriter(slow, depth=8)
    for index in range(6):
        writer(str(tmp_path), index, _shard(1))
    assert len(written) < 6
    writer.close()
    assert written == list(range(6))


@pytest.mark.parametrize("depth", [1, 3])
def test_a_slow_write_blocks_the_producer_after_depth_queued_shards(tmp_path, depth):
    writing = threading.Event()
    release = threading.Event()

    def blocked(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        writing.set()
        release.wait(10)
        return shard_path(output_dir, index)

    writer = OverlappedShardWriter(blocked, depth=depth)
    writer(str(tmp_path), 0, _shard(1))
    assert writing.wait(10)  # shard 0 is being written; the queue is empty
    for index in range(1, depth + 1):
        writer(str(tmp_path), index, _shard(1))  # these fit in the queue and return at once
    done = threading.Event()
    producer = threading.Thread(target=lambda: (writer(str(tmp_path), depth + 1, _shard(1)), done.set()))
    producer.start()
    assert not done.wait(0.3)  # the queue is full: the producer waits
    release.set()
    assert done.wait(10)
    producer.join()
    writer.close()


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _batch(first: int, n: int, width: int) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([1 + (first + i) % 3 for i in range(n)], dtype=torch.int64)
    rows = int(lengths.sum())
    return {
        "hidden": torch.arange(rows * width, dtype=torch.float32).view(rows, width) + first,
        "sample_id": torch.arange(first, first + n),
        LENGTHS_KEY: lengths,
    }


def test_peak_memory_of_overlapped_writes_is_within_depth_plus_one_shards(tmp_path):
    depth, shard_size, batch_size, n = 2, 4, 2, 48
    release = threading.Event()
    alive: list[weakref.ref] = []
    handed = threading.Semaphore(0)

    def blocked(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        release.wait(10)
        return shard_path(output_dir, index)

    writer = OverlappedShardWriter(blocked, depth=depth)

    def tracking(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        alive.append(weakref.ref(samples["hidden"]))
        handed.release()
        return writer(output_dir, index, samples)

    loader = DataLoader(_Indices(n), batch_size=batch_size, collate_fn=lambda items: items[0])
    producer = threading.Thread(
        target=compute_shard_runs,
        args=(
            loader,
            str(tmp_path),
            shard_size,
            range(n // shard_size),
            lambda first: _batch(first, batch_size, 8),
            tracking,
            log,
        ),
        kwargs={"ragged_keys": ["hidden"]},
    )
    producer.start()
    for _ in range(depth + 2):  # one being written, `depth` queued, one in the producer's hand
        assert handed.acquire(timeout=10)
    assert not handed.acquire(timeout=0.3)  # the producer is blocked: no further shard is assembled
    gc.collect()
    held = sum(ref() is not None for ref in alive)
    # A synchronous writer holds the shard it writes; overlapping adds at most depth + 1 more.
    assert held - 1 <= depth + 1
    release.set()
    producer.join(10)
    writer.close()
    assert len(alive) == n // shard_size


def test_flush_copies_each_buffered_batch_at_most_once(tmp_path, monkeypatch):
    shards: list[dict[str, torch.Tensor]] = []

    def keep(output_dir: str, index: int, samples: dict[str, torch.Tensor]) -> str:
        shards.append(samples)
        return shard_path(output_dir, index)

    # One batch per shard: the shard is the batch itself, not a copy.
    batch = _batch(0, 4, 8)
    acc = _ShardAccumulator(str(tmp_path), 4, 0, keep, log, ragged_keys=["hidden"])
    acc.add(batch)
    assert all(shards[0][k].data_ptr() == batch[k].data_ptr() for k in batch)

    # Batches smaller than a shard: one torch.cat per key and shard, nothing else copies.
    cats: list[int] = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        cats.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(write_module.torch, "cat", counting_cat)
    shards.clear()
    acc = _ShardAccumulator(str(tmp_path), 6, 0, keep, log, ragged_keys=["hidden"])
    batches = [_batch(first, 4, 8) for first in range(0, 12, 4)]
    for b in batches:
        acc.add(b)
    acc.finalize()
    assert len(shards) == 2 and len(cats) == 2 * len(batches[0])
    monkeypatch.undo()
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    assert torch.equal(torch.cat([s["hidden"] for s in shards]), whole["hidden"])
    assert torch.equal(torch.cat([s[LENGTHS_KEY] for s in shards]), whole[LENGTHS_KEY])
