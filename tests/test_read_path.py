"""The batch read path: SampleView as a dict, collation straight from the files, reused batch memory, prefetch."""

from __future__ import annotations

import operator
import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from speccache.errors import CacheCorruptError
from speccache.format import shard_path
from speccache.read import CacheDataset, PackCollator, PadCollator, SampleView
from speccache.read.sampler import LocalityShuffleSampler
from speccache.testing.synthetic import write_synthetic_cache
from support.residency import HAS_SMAPS, mapped_resident_bytes

RAGGED = ["input_ids", "loss_mask", "hidden"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_batches_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(bits(a[key]), bits(b[key])), key


@pytest.fixture(scope="module", params=["raw", "zbf16"])
def cache(tmp_path_factory, request):
    path = str(tmp_path_factory.mktemp(request.param))
    # hidden 64 bf16 x up to 600 rows: long samples go through pread, short ones through the mapping
    write_synthetic_cache(
        path,
        num_samples=40,
        shard_size=8,
        batch_size=4,
        hidden=64,
        min_len=0,
        max_len=600,
        encoding=request.param,
        overlap=False,
    )
    return path


def copies(samples) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in s.items()} for s in samples]


@pytest.mark.parametrize("collate", [
    PadCollator(RAGGED), PadCollator(RAGGED, pad_values={"input_ids": -100, "loss_mask": True, "hidden": 1.5}),
    PackCollator(RAGGED), PadCollator(["hidden"]),
])  # fmt: skip
def test_collating_views_equals_collating_copies(cache, collate):
    ds = CacheDataset(cache)
    for indices in ([5, 0, 39, 17, 18, 3], [7], [12, 12, 13]):
        try:
            want = collate(copies(ds.__getitems__(indices)))
        except RuntimeError:  # PadCollator(["hidden"]) stacks ragged keys: fails unless the lengths agree
            with pytest.raises(RuntimeError):
                collate(ds.__getitems__(indices))
            continue
        assert_batches_equal(collate(ds.__getitems__(indices)), want)


def test_sample_view_is_a_dict_of_tensors(cache):
    ds = CacheDataset(cache)
    view = ds.__getitems__([9])[0]
    plain = ds[9]
    assert isinstance(view, SampleView) and list(view) == list(plain) == list(ds.keys) and len(view) == len(plain)
    assert "hidden" in view and "nope" not in view
    with pytest.raises(KeyError):
        view["nope"]
    ids = view.pop("input_ids")
    assert torch.equal(ids, plain["input_ids"]) and "input_ids" not in view
    view["extra"] = torch.ones(2)
    assert list(view) == [k for k in plain if k != "input_ids"] + ["extra"]
    restored = pickle.loads(pickle.dumps(view))
    assert type(restored) is dict and list(restored) == list(view)
    assert torch.equal(restored["hidden"].view(torch.int16), plain["hidden"].view(torch.int16))


def test_modified_views_collate_like_dicts(cache):
    ds = CacheDataset(cache)
    collate = PadCollator(RAGGED + ["doubled"])
    views = ds.__getitems__([1, 20, 33])
    for v in views:
        v["doubled"] = v["input_ids"].repeat(2)
        v["hidden"] = v["hidden"] * 2
        del v["sample_id"]
    dicts = [dict(v.items()) for v in views]
    assert_batches_equal(collate(views), collate(dicts))


def test_samples_of_two_caches_collate_together(cache, tmp_path):
    other = str(tmp_path / "other")
    write_synthetic_cache(other, num_samples=8, shard_size=8, hidden=64, max_len=30, overlap=False)
    a, b = CacheDataset(cache), CacheDataset(other)
    mixed = a.__getitems__([3]) + b.__getitems__([2, 5])
    assert_batches_equal(PackCollator(RAGGED)(mixed), PackCollator(RAGGED)(copies(mixed)))


def test_held_batches_keep_their_data_and_dropped_ones_are_reused(cache):
    ds = CacheDataset(cache)
    collate = PackCollator(RAGGED)
    collate._pool.MIN_BYTES = 0  # pool every tensor of these small batches
    indices = [list(range(a, a + 8)) for a in range(0, 40, 8)]
    held = [collate(ds.__getitems__(batch)) for batch in indices]  # all alive at once
    for batch, got in zip(indices, held):
        assert_batches_equal(got, collate(copies(ds.__getitems__(batch))))
    view = held[0]["hidden"][1:3]  # a view keeps its batch's memory from being reused
    del held
    for batch in indices:
        collate(ds.__getitems__(batch))
    want = collate(copies(ds.__getitems__(indices[0])))["hidden"][1:3]
    assert torch.equal(bits(view), bits(want))
    reused = {collate(ds.__getitems__(indices[1]))["hidden"].data_ptr() for _ in range(4)}
    assert len(reused) == 1  # nothing holds the batches: the same buffer serves every one


def test_prefetch_changes_nothing_but_the_page_cache(cache):
    ds = CacheDataset(cache)
    collate = PadCollator(RAGGED)
    announced: list[int] = []

    def prefetch(indices: list[int]) -> None:
        announced.extend(indices)
        ds.prefetch(indices)

    sampler = LocalityShuffleSampler(ds, ds.shard_size, seed=3, window=2, prefetch=prefetch, prefetch_ahead=6)
    got = list(DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate))
    order = sampler.rank_order().tolist()
    assert announced == order
    want = [collate(copies(ds.__getitems__(order[a : a + 4]))) for a in range(0, len(order), 4)]
    for g, w in zip(got, want):
        assert_batches_equal(g, w)


def test_prefetch_stays_ahead_of_iteration():
    seen: list[int] = []
    calls: list[tuple[int, list[int]]] = []
    sampler = LocalityShuffleSampler(
        100, 10, seed=1, prefetch=lambda ix: calls.append((len(seen), ix)), prefetch_ahead=8
    )
    for i in sampler:
        assert i in {j for _, ix in calls for j in ix}
        seen.append(i)
    assert [j for _, ix in calls for j in ix] == seen
    assert all(len(ix) <= 8 + 4 for _, ix in calls)


def test_a_shard_truncated_after_opening_raises(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, num_samples=8, shard_size=8, hidden=256, min_len=300, max_len=300, overlap=False)
    # Only "hidden": it goes through pread. (Mapped bytes past the end of a truncated file raise SIGBUS.)
    ds = CacheDataset(path, keys=["hidden"])
    views = ds.__getitems__([6, 7])
    os.truncate(shard_path(path, 0), os.path.getsize(shard_path(path, 0)) - 4096)
    with pytest.raises(CacheCorruptError, match="truncated"):
        PackCollator(["hidden"])(views)


@pytest.mark.skipif(not HAS_SMAPS, reason="needs /proc/self/smaps")
def test_long_runs_are_read_with_pread_and_leave_no_pages_mapped(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, num_samples=8, shard_size=8, hidden=256, min_len=300, max_len=300, overlap=False)
    shard = shard_path(path, 0)
    with open(shard, "rb") as f:
        f.read()  # cached: the reader would copy it from the mapping if it did so for long runs
    ds = CacheDataset(path, keys=["hidden"])
    batch = PackCollator(["hidden"])(ds.__getitems__([5, 0, 7, 2, 3, 6, 1, 4]))
    assert batch["hidden"].shape == (8 * 300, 256)
    # 8 samples of 150 KiB read; what stays mapped (the header's offsets, the kernel's fault-around) is less than one
    assert mapped_resident_bytes(shard) < 300 * 256 * 2


def test_uncached_reads_of_a_batch_are_announced_in_file_order_neighbours_as_one_range(tmp_path, monkeypatch):
    import speccache.read._io as io_module

    path = str(tmp_path / "c")
    write_synthetic_cache(path, num_samples=8, shard_size=8, hidden=256, min_len=300, max_len=300, overlap=False)
    announced: list[tuple[int, int]] = []
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # nothing counts as cached
    monkeypatch.setattr(io_module, "_advise", lambda fd, offset, n, advice: announced.append((offset, n)))
    ds = CacheDataset(path, keys=["hidden"])
    order = [5, 2, 3, 6, 4]  # samples 2-6 lie back to back in the file
    PackCollator(["hidden"])(ds.__getitems__(order))
    piece = ds._open_shard(0).advice  # the device's read-ahead limit per WILLNEED
    start, sample = ds._open_shard(0).bases["hidden"], 300 * 256 * 2
    span = (start + 2 * sample, 5 * sample)
    # one range, asked for in file order in pieces of the device's limit (not one 128 KiB request after another)
    assert announced == [(span[0] + a, min(piece, span[1] - a)) for a in range(0, span[1], piece)]


def _sequential_cache(path: str) -> None:
    write_synthetic_cache(path, num_samples=16, shard_size=8, hidden=256, min_len=300, max_len=300, overlap=False)


def test_prefetched_samples_are_read_ahead_in_file_order(tmp_path, monkeypatch):
    import speccache.read._io as io_module

    path = str(tmp_path / "c")
    _sequential_cache(path)
    filled: list[tuple[str, int, int]] = []
    fill = io_module._fill_page_cache
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # nothing counts as cached
    monkeypatch.setattr(
        io_module, "_fill_page_cache", lambda s, o, n, sink: (filled.append((s.path, o, n)), fill(s, o, n, sink))
    )
    ds = CacheDataset(path, keys=["hidden"])
    ds.prefetch([13, 5, 2, 9, 3])  # returns at once; a thread reads shard 1, then shard 0, each in file order
    first, second = ds._open_shard(0), ds._open_shard(1)
    ds._read_ahead().wait(first, first.bases["hidden"] + first.span("hidden", 5)[0])
    start, sample = first.bases["hidden"], 300 * 256 * 2
    assert filled == [
        (second.path, start + sample, sample),
        (second.path, start + 5 * sample, sample),
        (first.path, start + 2 * sample, 2 * sample),  # samples 2 and 3 in one read
        (first.path, start + 5 * sample, sample),
    ]
    assert PackCollator(["hidden"])(ds.__getitems__([13, 5]))["hidden"].shape == (600, 256)


@pytest.mark.parametrize(
    "indices",
    [(13, 5, 2, 9, 3), range(13, 1, -4), np.array([13, 5, 2, 9, 3]), [-3, 5, 2, -7, 3], [True, 13], "iterator"],
)
def test_prefetch_groups_any_indices_as_the_reader_reads_them(tmp_path, monkeypatch, indices):
    # A sampler's window of ints is grouped with array operations; other indices one by one: the same reads.
    import speccache.read._io as io_module

    path = str(tmp_path / "c")
    _sequential_cache(path)
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # nothing counts as cached
    submitted: list[list[tuple[str, int, int]]] = []
    monkeypatch.setattr(
        io_module._ReadAhead,
        "submit",
        lambda self, ranges: submitted.append([(r[0].path, r[1], r[2]) for r in ranges]),
    )
    given = iter([13, 5, 2, 9, 3]) if isinstance(indices, str) else indices
    wanted = [operator.index(i) % 16 for i in ([13, 5, 2, 9, 3] if isinstance(indices, str) else indices)]
    ds = CacheDataset(path, keys=["hidden"])
    ds.prefetch(given)
    # Worked out from the shards' spans, not through prefetch: each shard's samples in file order, the shards in
    # the order the indices first need them.
    expected: dict[int, list[tuple[str, int, int]]] = {}
    for i in wanted:
        opened = ds._open_shard(i // 8)
        start, end = opened.span("hidden", i % 8)
        entry = (opened.path, opened.bases["hidden"] + start, end - start)
        if entry not in expected.setdefault(i // 8, []):
            expected[i // 8].append(entry)
    assert submitted == [sorted(r) for r in expected.values()]
    for bad in ([1.5], [[1, 2], [3]]):
        with pytest.raises(TypeError, match="integers"):
            ds.prefetch(bad)
    with pytest.raises(IndexError, match="out of range"):
        ds.prefetch([3, 16])


def test_each_shards_reads_are_queued_before_the_next_shard_is_opened(tmp_path, monkeypatch):
    # The disk starts on the first shard while the next shards' headers are read.
    import speccache.read._io as io_module

    path = str(tmp_path / "c")
    _sequential_cache(path)
    events: list[tuple[str, int | str]] = []
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # nothing counts as cached
    submit, open_shard = io_module._ReadAhead.submit, CacheDataset._open_shard

    def record_submit(self, ranges):
        ranges = list(ranges)
        events.append(("submit", ranges[0][0].path))
        submit(self, ranges)

    def record_open(self, index):
        if index not in self._open:
            events.append(("open", index))
        return open_shard(self, index)

    monkeypatch.setattr(io_module._ReadAhead, "submit", record_submit)
    monkeypatch.setattr(CacheDataset, "_open_shard", record_open)
    ds = CacheDataset(path, keys=["hidden"])
    ds.prefetch([13, 5, 2, 9, 3])
    assert events == [("open", 1), ("submit", shard_path(path, 1)), ("open", 0), ("submit", shard_path(path, 0))]
    ds._read_ahead().close()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_read_ahead_thread_changes_no_batch(cache, monkeypatch, workers):
    import speccache.read._io as io_module

    fills = []
    fill = io_module._fill_page_cache
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # every long read is queued, waited for and read again
    monkeypatch.setattr(io_module, "_fill_page_cache", lambda *a: (fills.append(a[1]), fill(*a)))
    collate = PackCollator(RAGGED)
    plain = CacheDataset(cache)
    order = LocalityShuffleSampler(plain, plain.shard_size, seed=5, window=2).rank_order().tolist()
    want = [collate(copies(plain.__getitems__(order[a : a + 4]))) for a in range(0, len(order), 4)]
    ds = CacheDataset(cache)
    for _ in range(2):  # the second epoch forks its workers from a process that has read ahead
        sampler = LocalityShuffleSampler(ds, ds.shard_size, seed=5, window=2, prefetch=ds.prefetch)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate, num_workers=workers)
        got = list(loader)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_batches_equal(g, w)
    assert fills or ds.schema["hidden"].encoding != "raw"  # the thread read the long raw samples ahead
    pickle.loads(pickle.dumps(ds))  # a dataset that read ahead still pickles (for spawned workers)


def test_a_shard_replaced_under_the_read_ahead_is_refused(tmp_path):
    path, other = str(tmp_path / "c"), str(tmp_path / "d")
    _sequential_cache(path)
    write_synthetic_cache(other, num_samples=16, shard_size=8, hidden=256, min_len=200, max_len=200, overlap=False)
    ds = CacheDataset(path, max_open_shards=1)
    # windows of one shard; the other shard, opened when announced at the start, is reopened for its batch
    sampler = LocalityShuffleSampler(ds, ds.shard_size, seed=0, window=1, prefetch=ds.prefetch, prefetch_ahead=8)
    batches = iter(DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=PackCollator(RAGGED)))
    next(batches)
    second = 1 - sampler.rank_order()[0] // 8
    with open(shard_path(other, second), "rb") as src, open(shard_path(path, second), "r+b") as dst:
        dst.truncate(0)
        dst.write(src.read())
    with pytest.raises(CacheCorruptError, match="shard table records"):
        next(batches)


def test_a_shard_truncated_under_the_read_ahead_raises(tmp_path, monkeypatch):
    import speccache.read._io as io_module

    path = str(tmp_path / "c")
    _sequential_cache(path)
    monkeypatch.setattr(io_module, "_NOWAIT", [0])  # nothing counts as cached: the thread reads everything
    ds = CacheDataset(path, keys=["hidden"])
    views = ds.__getitems__(range(8))
    os.truncate(shard_path(path, 0), os.path.getsize(shard_path(path, 0)) // 2)
    ds.prefetch(range(8))  # the thread stops at the end of the file
    with pytest.raises(CacheCorruptError, match="shrank"):
        PackCollator(["hidden"])(views)
