"""Token-range reads (``CacheDataset.read(i, rows=...)``) and the sequence-parallel reader (speccache.read.ranges).

A range read equals the slice of a full read, for every key and encoding (raw, fp8, zbf16), through views too,
and reads only what the rows need; each rank of a sequence-parallel group gets its contiguous rows of every
sample, which, over the group (two gloo ranks included), are exactly the single-rank sample.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from speccache.format.encoding import fp8
from speccache.read import CacheDataset
from speccache.read.ranges import (
    SP_LENGTH_KEY,
    SP_ROWS_KEY,
    SequenceParallelDataset,
    sequence_parallel_rows,
)
from speccache.read.view import make_merge_view
from speccache.testing.synthetic import write_synthetic_cache

ARGS = dict(num_samples=12, shard_size=5, hidden=16, min_len=1, max_len=40)
ENCODINGS = ("raw", "fp8", "zbf16")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    base = tmp_path_factory.mktemp("ranges")
    found = {}
    for encoding in ENCODINGS:
        found[encoding] = str(base / encoding)
        write_synthetic_cache(found[encoding], overlap=False, encoding=encoding, **ARGS)
    return found


def _slices(length: int) -> list[slice | None]:
    return [
        None,
        slice(None),
        slice(0, 0),
        slice(0, 1),
        slice(length // 3, length - length // 3),
        slice(length - 1, length),
        slice(-5, None),
        slice(None, -2),
        slice(3, 10_000),
        slice(length + 4, length + 9),
        slice(7, 2),
    ]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_range_read_equals_the_slice_of_a_full_read_for_every_key(caches, encoding):
    ds = CacheDataset(caches[encoding])
    assert ds.schema["hidden"].encoding == encoding
    for index in range(len(ds)):
        full = ds[index]
        length = ds.sample_length(index)
        assert length == full["input_ids"].shape[0]
        for rows in _slices(length):
            part = ds.read(index, rows)
            assert set(part) == set(full)
            for key, value in full.items():
                want = value[rows] if ds.schema[key].ragged and rows is not None else value
                assert part[key].dtype == want.dtype and torch.equal(part[key], want), (encoding, index, rows, key)


def test_a_range_read_takes_the_keys_asked_for_and_hands_out_its_own_tensors(caches):
    ds = CacheDataset(caches["raw"])
    part = ds.read(3, slice(1, 4), keys=["hidden", "sample_id"])
    assert list(part) == ["hidden", "sample_id"] and int(part["sample_id"]) == 3
    part["hidden"].fill_(7)  # the caller's own: the next read is unchanged
    assert torch.equal(ds.read(3, slice(1, 4), keys="hidden")["hidden"], ds[3]["hidden"][1:4])
    narrow = CacheDataset(caches["raw"], keys=["input_ids"])
    with pytest.raises(KeyError, match=r"\['hidden'\] are not among this reader's keys \['input_ids'\]"):
        narrow.read(0, keys=["hidden"])
    with pytest.raises(ValueError, match="step 1"):
        ds.read(0, slice(0, 4, 2))
    with pytest.raises(TypeError, match="rows must be a slice"):
        ds.read(0, (0, 4))
    with pytest.raises(IndexError):
        ds.read(len(ds))
    assert torch.equal(ds.read(-1)["input_ids"], ds[len(ds) - 1]["input_ids"])


def test_an_fp8_range_read_decodes_only_its_rows(caches, monkeypatch):
    ds = CacheDataset(caches["fp8"], keys=["hidden"])
    spans = []
    real = fp8._decode_span
    monkeypatch.setattr(
        fp8, "_decode_span", lambda parts, r0, r1, dtype: (spans.append(r1 - r0), real(parts, r0, r1, dtype))[1]
    )
    index = max(range(len(ds)), key=ds.sample_length)
    ds.read(index, slice(2, 5))
    assert spans == [3]


def test_a_raw_range_read_touches_only_its_rows_of_the_mapping(caches):
    ds = CacheDataset(caches["raw"], keys=["hidden"])
    index = max(range(len(ds)), key=ds.sample_length)
    whole = ds.read(index)["hidden"]
    part = ds.read(index, slice(2, 5))["hidden"]
    assert part.untyped_storage().nbytes() == 3 * whole.shape[1] * whole.element_size()  # a copy of 3 rows only


def test_a_view_reads_ranges_of_its_sources(caches, tmp_path):
    view = str(tmp_path / "view")
    make_merge_view([caches["raw"], caches["raw"]], view)
    ds = CacheDataset(view)
    source = CacheDataset(caches["raw"])
    n = len(source)
    for index in (0, n - 1, n, 2 * n - 1):
        rows = slice(1, 3)
        assert ds.sample_length(index) == source.sample_length(index % n)
        for key, value in ds.read(index, rows).items():
            assert torch.equal(value, source.read(index % n, rows)[key])


# ---------------------------------------------------------------------------
# sequence parallelism


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("length", [0, 1, 2, 5, 6, 40, 131_072])
def test_sequence_parallel_rows_split_a_sample_into_contiguous_parts_of_the_padded_split(length, world):
    parts = [sequence_parallel_rows(length, r, world) for r in range(world)]
    assert parts[0].start == 0 and parts[-1].stop == length
    each = -(-length // world)
    for a, b in zip(parts, parts[1:]):
        assert a.stop == b.start
    for r, part in enumerate(parts):
        assert part.stop - part.start == max(0, min(each, length - r * each))
    with pytest.raises(ValueError, match="outside"):
        sequence_parallel_rows(length, world, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ranks_parts_of_a_sample_are_the_sample(caches, world):
    ds = CacheDataset(caches["zbf16"])
    ranks = [SequenceParallelDataset(ds, r, world) for r in range(world)]
    assert ranks[0].whole == ("input_ids", "loss_mask", "sample_id") and ranks[0].split == ("hidden",)
    for index in range(len(ds)):
        full = ds[index]
        parts = [r[index] for r in ranks]
        rows = [p[SP_ROWS_KEY].tolist() for p in parts]
        assert rows == [
            [s.start, s.stop] for s in (sequence_parallel_rows(len(full["input_ids"]), r, world) for r in range(world))
        ]
        assert torch.equal(torch.cat([p["hidden"] for p in parts]), full["hidden"])
        for p in parts:
            assert int(p[SP_LENGTH_KEY]) == len(full["input_ids"])
            for key in ("input_ids", "loss_mask", "sample_id"):
                assert torch.equal(p[key], full[key])


def test_sequence_parallel_settings_are_checked(caches):
    ds = CacheDataset(caches["raw"])
    with pytest.raises(ValueError, match="both rank and world_size"):
        SequenceParallelDataset(ds, rank=0)
    with pytest.raises(ValueError, match="outside"):
        SequenceParallelDataset(ds, 2, 2)
    with pytest.raises(ValueError, match=r"\['sample_id'\] are fixed keys"):
        SequenceParallelDataset(ds, 0, 2, whole=["sample_id"])
    with pytest.raises(RuntimeError, match="initialised process group"):
        SequenceParallelDataset(ds)
    split_all = SequenceParallelDataset(ds, 1, 2, whole=())
    sample = split_all[4]
    rows = slice(*sample[SP_ROWS_KEY].tolist())
    assert torch.equal(sample["input_ids"], ds[4]["input_ids"][rows])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sp_rank(rank: int, world: int, port: int, cache: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ds = SequenceParallelDataset(CacheDataset(cache))  # rank and size from the group
        g = torch.Generator().manual_seed(5)  # the same order on every rank of the group
        order = torch.randperm(len(ds), generator=g).tolist()
        loader = DataLoader(ds, batch_size=4, sampler=order, collate_fn=ds.collator(), num_workers=1)
        batches = []
        for batch in loader:
            lengths = batch["lengths"].tolist()
            batches.append(
                {
                    "sample_id": batch["sample_id"].tolist(),
                    "rows": batch[SP_ROWS_KEY].tolist(),
                    "hidden": [h[:n].float().tolist() for h, n in zip(batch["hidden"], lengths)],
                    "input_ids": [t[:n].tolist() for t, n in zip(batch["input_ids"], batch[SP_LENGTH_KEY].tolist())],
                }
            )
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(batches, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.torchrun
def test_a_sequence_parallel_loader_over_two_gloo_ranks_equals_the_single_rank_rows(caches, tmp_path):
    cache = caches["fp8"]
    mp.spawn(_sp_rank, args=(2, _free_port(), cache, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ds = CacheDataset(cache)
    seen = []
    for b0, b1 in zip(*ranks, strict=True):
        assert b0["sample_id"] == b1["sample_id"]
        for i, sample_id in enumerate(b0["sample_id"]):
            full = ds[sample_id]
            assert b0["rows"][i][1] == b1["rows"][i][0] and b1["rows"][i][1] == len(full["input_ids"])
            joined = torch.tensor(b0["hidden"][i] + b1["hidden"][i]).reshape(-1, full["hidden"].shape[1])
            assert torch.equal(joined, full["hidden"].float())
            assert b0["input_ids"][i] == b1["input_ids"][i] == full["input_ids"].tolist()
            seen.append(sample_id)
    assert sorted(seen) == list(range(len(ds)))
