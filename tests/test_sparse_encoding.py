"""The ``sparse`` encoding (docs/format.md §4.2): only rows with a bit set are stored, and every row decodes bit for
bit (``-0.0`` and NaN payloads included); a cache of a sparse key reads back through the dataset, the batch path,
the collator, ``verify``, ``inspect`` and the size estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccache.errors import CacheCorruptError
from speccache.format import LENGTHS_KEY, KeySpec, ShardFile, shard_path
from speccache.format.encoding import get_encoding
from speccache.precompute.estimate import estimate_shards
from speccache.read import CacheDataset, PadCollator, inspect_cache, open_dataset, verify_cache
from speccache.write import CacheWriter
from support.cachecmp import all_samples

SPARSE = get_encoding("sparse")


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int64)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns, so that -0.0 differs from 0.0 and NaNs compare by payload."""
    return x.contiguous().view(torch.uint8)


def mostly_zero(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of which about one in three is set, with a -0.0 row and a NaN-payload row among them."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, width, dtype=dtype)
    kept = torch.rand(rows, generator=g) < 1 / 3
    out[kept] = torch.randn(int(kept.sum()), width, generator=g).to(dtype)
    if rows > 3:
        out[1] = -0.0  # a float equal to zero whose bits are not: kept
        as_int = out.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
        as_int[2] = torch.tensor([0x7FC1, -45] if dtype.itemsize == 2 else [0x7FC00001, -4194299]).repeat(width)[
            :width
        ]  # NaNs with payloads (and a sign)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_round_trip_is_bit_exact_and_stores_only_rows_with_a_bit_set(dtype):
    rows = mostly_zero(40, 6, torch.float32 if dtype == torch.int32 else dtype)
    if dtype == torch.int32:
        rows = rows.nan_to_num(0.0).mul(100).to(torch.int32)
    lengths = [7, 0, 13, 20]
    offsets = offsets_of(lengths)
    parts = SPARSE.encode(rows, offsets)
    set_rows = (bits(rows).reshape(40, -1) != 0).any(dim=1)
    assert parts[""].shape == (int(set_rows.sum()), 6) and parts[""].dtype == rows.dtype
    assert parts["index"].dtype == torch.int32 and parts["index"].shape == (40,)
    assert torch.equal(parts["index"] >= 0, set_rows)
    assert torch.equal(bits(SPARSE.decode(parts, offsets, 0, 4, rows.dtype)), bits(rows))
    assert torch.equal(bits(SPARSE.decode(parts, offsets, 1, 3, rows.dtype)), bits(rows[7:20]))
    for sample, (first, last) in enumerate([(2, 5), (0, 0), (0, 13), (19, 20)]):
        got = SPARSE.decode_rows(parts, offsets, sample, first, last, rows.dtype)
        base = int(offsets[sample])
        assert torch.equal(bits(got), bits(rows[base + first : base + last]))
    if dtype != torch.int32:
        assert torch.signbit(SPARSE.decode(parts, offsets, 0, 1, dtype)[1]).all()  # -0.0 kept


def test_all_zero_rows_and_an_empty_shard():
    zeros = torch.zeros(9, 4, dtype=torch.bfloat16)
    offsets = offsets_of([4, 5])
    parts = SPARSE.encode(zeros, offsets)
    assert parts[""].shape == (0, 4) and torch.equal(parts["index"], torch.full((9,), -1, dtype=torch.int32))
    assert torch.equal(bits(SPARSE.decode(parts, offsets, 0, 2, torch.bfloat16)), bits(zeros))
    empty = SPARSE.encode(torch.zeros(0, 4), offsets_of([0, 0]))
    assert empty[""].shape == (0, 4) and empty["index"].shape == (0,)
    assert SPARSE.decode(empty, offsets_of([0, 0]), 0, 2, torch.float32).shape == (0, 4)


def test_an_index_beyond_the_stored_rows_is_an_error():
    rows = mostly_zero(10, 3, torch.float32)
    parts = SPARSE.encode(rows, offsets_of([10]))
    parts["index"] = parts["index"].clone()
    parts["index"][0] = parts[""].shape[0]
    with pytest.raises(ValueError, match="sparse: row index"):
        SPARSE.decode(parts, offsets_of([10]), 0, 1, torch.float32)


SCHEMA = {
    s.name: s
    for s in (
        KeySpec("input_ids", torch.int32, (), ragged=True),
        KeySpec("embeds", torch.bfloat16, (8,), ragged=True, encoding="sparse"),
    )
}


def _samples(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(0, 50, (n,), generator=g, dtype=torch.int32)
        embeds = torch.where((ids < 15)[:, None], torch.randn(n, 8, generator=g), 0.0).to(torch.bfloat16)
        out.append({"input_ids": ids, "embeds": embeds})
    return out


def _write(out: str, samples: list[dict[str, torch.Tensor]], shard_size: int) -> None:
    writer = CacheWriter(
        out, cache_name="sparsetest", schema=SCHEMA, shard_size=shard_size, num_samples=len(samples), config={}
    )
    with writer.writing(overlap=False) as run:
        for index in run.shards:
            chunk = samples[index * shard_size : (index + 1) * shard_size]
            rows = {k: torch.cat([s[k] for s in chunk]) for k in SCHEMA}
            rows[LENGTHS_KEY] = torch.tensor([len(s["input_ids"]) for s in chunk])
            run.write_shard(out, index, rows)


def test_a_cache_of_a_sparse_key_reads_back_verifies_and_is_estimated_exactly(tmp_path):
    lengths = [5, 0, 17, 9, 30, 1, 12]
    samples = _samples(lengths)
    samples[5]["embeds"][:] = 0.0  # a sample with nothing stored
    out = str(tmp_path / "cache")
    _write(out, samples, shard_size=3)
    for got, want in zip(all_samples(out), samples):
        assert torch.equal(bits(got["embeds"]), bits(want["embeds"]))
    ds = open_dataset(out)
    batch = PadCollator(["input_ids", "embeds"])(ds.__getitems__([2, 4, 5]))
    for row, index in enumerate([2, 4, 5]):
        n = lengths[index]
        assert torch.equal(bits(batch["embeds"][row, :n]), bits(samples[index]["embeds"]))
    assert torch.equal(
        bits(CacheDataset(out).read(4, slice(3, 11), "embeds")["embeds"]), bits(samples[4]["embeds"][3:11])
    )
    assert verify_cache(out).ok
    # the key's bytes: 2 per value of the rows at ids < 15, 4 per token; the estimate counts the same
    kept = [int((s["input_ids"] < 15).sum()) for s in samples]
    kept[5] = 0
    info = inspect_cache(out)
    assert info["keys"]["embeds"]["bytes"] == sum(kept) * 8 * 2 + sum(lengths) * 4
    est = estimate_shards(SCHEMA, lengths, 3, 0.4, stored_rows={"embeds": kept})
    assert est["keys"] == {k: v["bytes"] for k, v in info["keys"].items()}
    assert est["total"] == info["shard_bytes"]
    with pytest.raises(ValueError, match="'embeds' \\(sparse\\): give the rows it keeps"):
        estimate_shards(SCHEMA, lengths, 3, 0.4)


def test_a_damaged_index_is_reported_as_the_shard_s_corruption(tmp_path):
    out = str(tmp_path / "cache")
    samples = _samples([6, 6])
    _write(out, samples, shard_size=2)
    path = shard_path(out, 0)
    shard = ShardFile(path)
    _, _, begin, _ = shard.entries["embeds.index"]
    at = shard.data_start + begin
    shard.close()
    data = bytearray(open(path, "rb").read())
    data[at : at + 4] = np.int32(1000).tobytes()  # sample 0's first row: past the stored rows
    open(path, "wb").write(bytes(data))
    with pytest.raises(CacheCorruptError, match="'embeds' cannot be decoded"):
        all_samples(out, verify=False)
