"""Properties of shard partitioning and of the shard accumulator (hypothesis)."""

from __future__ import annotations

import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from speccache.format import LENGTHS_KEY
from speccache.offline_cache import _ShardAccumulator, partition_cache_shards

LOG = logging.getLogger("test_properties")


# ---------------------------------------------------------------------------
# partitioning


@settings(max_examples=300, deadline=None)
@given(num_samples=st.integers(0, 2000), shard_size=st.integers(1, 64), world_size=st.integers(1, 40))
def test_partition_gives_every_sample_to_exactly_one_rank_in_contiguous_shard_aligned_balanced_blocks(
    num_samples, shard_size, world_size
):
    blocks = [partition_cache_shards(num_samples, shard_size, world_size, rank) for rank in range(world_size)]
    owner = [0] * num_samples
    position = 0
    total_shards = -(-num_samples // shard_size)
    for start_shard, start_sample, count in blocks:
        assert count >= 0
        # shard aligned: a block starts on a shard boundary, at its first shard
        assert start_sample == start_shard * shard_size
        if count:
            # contiguous, and in rank order: each block starts where the previous one ended
            assert start_sample == position
            # whole shards, except that the last block may end with the final partial shard
            end = start_sample + count
            assert count % shard_size == 0 or end == num_samples
            for i in range(start_sample, end):
                owner[i] += 1
            position = end
        assert 0 <= start_shard <= max(total_shards, 0)
    assert owner == [1] * num_samples
    assert position == num_samples
    # balanced within one shard: shard counts differ by at most one, the larger blocks first
    counts = [count for _, _, count in blocks]
    shards_per_rank = [-(-count // shard_size) for count in counts]
    assert max(shards_per_rank) - min(shards_per_rank) <= 1
    assert shards_per_rank == sorted(shards_per_rank, reverse=True)
    assert sum(shards_per_rank) == total_shards
    # so in samples no rank holds more than one shard's worth beyond another (the final partial shard aside)
    full = [count if count % shard_size == 0 else -(-count // shard_size) * shard_size for count in counts]
    assert max(full) - min(full) <= shard_size


# ---------------------------------------------------------------------------
# the accumulator


def _bytes_of(shard: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in shard.items()})


class _Recorder:
    def __init__(self) -> None:
        self.shards: list[tuple[int, bytes, dict[str, torch.Tensor]]] = []

    def __call__(self, output_dir: str, shard_index: int, samples: dict[str, torch.Tensor]) -> str:
        self.shards.append((shard_index, _bytes_of(samples), {k: v.clone() for k, v in samples.items()}))
        return f"{output_dir}/shard-{shard_index:06d}.safetensors"


def _feed(batches: list[dict[str, torch.Tensor]], shard_size: int, start: int, ragged: tuple[str, ...]) -> _Recorder:
    rec = _Recorder()
    acc = _ShardAccumulator("out", shard_size, start, rec, LOG, ragged_keys=ragged)
    for batch in batches:
        acc.add(batch)
    acc.finalize()
    return rec


def _split(samples: dict[str, torch.Tensor], cuts: list[int], row_offsets: list[int] | None, ragged: tuple[str, ...]):
    """Cut a batch of all samples into consecutive batches at sample positions ``cuts``."""
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = {}
        for key, value in samples.items():
            if key in ragged:
                assert row_offsets is not None
                piece[key] = value[row_offsets[a] : row_offsets[b]].clone()
            else:
                piece[key] = value[a:b].clone()
        out.append(piece)
    return out


@st.composite
def _batches(draw, ragged: bool):
    n = draw(st.integers(0, 40))
    shard_size = draw(st.integers(1, 12))
    start = draw(st.integers(0, 5))
    inner = sorted(draw(st.lists(st.integers(0, n), max_size=12)))  # repeats give empty batches
    cuts = [0, *inner, n]
    lengths = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)) if ragged else None
    return n, shard_size, start, cuts, lengths


def _samples(n: int, lengths: list[int] | None, seed: int) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    g = torch.Generator().manual_seed(seed)
    samples = {
        "input_ids": torch.arange(n, dtype=torch.int64) * 10,
        "fixed": torch.randn(n, 3, generator=g).to(torch.bfloat16),
    }
    if lengths is None:
        return samples, None
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    rows = offsets[-1]
    samples["hidden"] = torch.randn(rows, 4, generator=g).to(torch.float16)
    samples["mask"] = torch.rand(rows, generator=g) > 0.5
    samples[LENGTHS_KEY] = torch.tensor(lengths, dtype=torch.int64)
    return samples, offsets


@settings(max_examples=120, deadline=None)
@given(case=_batches(ragged=False))
def test_accumulator_writes_the_same_shards_for_any_batch_sizes(case):
    n, shard_size, start, cuts, _ = case
    samples, _ = _samples(n, None, seed=n)
    reference = _feed([samples] if n else [], shard_size, start, ())
    got = _feed(_split(samples, cuts, None, ()), shard_size, start, ())
    assert [(i, b) for i, b, _ in got.shards] == [(i, b) for i, b, _ in reference.shards]
    # exact shard sizes, numbered from the start index, with a trailing partial shard
    sizes = [int(s["input_ids"].shape[0]) for _, _, s in got.shards]
    assert sizes == [shard_size] * (n // shard_size) + ([n % shard_size] if n % shard_size else [])
    assert [i for i, _, _ in got.shards] == list(range(start, start + len(sizes)))
    written = torch.cat([s["input_ids"] for _, _, s in got.shards]) if sizes else torch.empty(0, dtype=torch.int64)
    assert torch.equal(written, samples["input_ids"])


@settings(max_examples=120, deadline=None)
@given(case=_batches(ragged=True))
def test_accumulator_writes_the_same_ragged_shards_for_any_batch_sizes(case):
    n, shard_size, start, cuts, lengths = case
    ragged = ("hidden", "mask")
    samples, offsets = _samples(n, lengths, seed=n)
    reference = _feed([samples] if n else [], shard_size, start, ragged)
    got = _feed(_split(samples, cuts, offsets, ragged), shard_size, start, ragged)
    assert [(i, b) for i, b, _ in got.shards] == [(i, b) for i, b, _ in reference.shards]
    # every shard carries its own samples' lengths and exactly their rows
    for k, (index, _, shard) in enumerate(got.shards):
        assert index == start + k
        a = k * shard_size
        b = min(a + shard_size, n)
        assert shard[LENGTHS_KEY].tolist() == lengths[a:b]
        assert torch.equal(shard["hidden"], samples["hidden"][offsets[a] : offsets[b]])
        assert torch.equal(shard["mask"], samples["mask"][offsets[a] : offsets[b]])
        assert torch.equal(shard["input_ids"], samples["input_ids"][a:b])
    assert sum(int(s[LENGTHS_KEY].shape[0]) for _, _, s in got.shards) == n
