"""The native on-disk format: round trips, safetensors interop, metadata, checksums, readers and collators."""

from __future__ import annotations

import builtins
import json
import logging
import multiprocessing
import os
import pickle
import struct

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

import speccache.read.dataset as read_module
from speccache.errors import CacheCorruptError, CacheIncompleteError
from speccache.format import (
    FORMAT_VERSION,
    LENGTHS_KEY,
    OFFSETS_KEY,
    KeySpec,
    ShardFile,
    bytes_view,
    file_checksum,
    manifest_path,
    shard_path,
    write_safetensors,
)
from speccache.format.schema import schema_to_json
from speccache.offline_cache import write_cache_shards
from speccache.read import CacheDataset, PackCollator, PadCollator
from speccache.write import CacheWriter

LOG = logging.getLogger("test_format")

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "f8e4m3": torch.float8_e4m3fn,
    "f8e5m2": torch.float8_e5m2,
    "bool": torch.bool,
    "i32": torch.int32,
    "i64": torch.int64,
}
ST_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.bool: "BOOL", torch.int32: "I32", torch.int64: "I64",
}  # fmt: skip


# ---------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, what
    assert tuple(a.shape) == tuple(b.shape), what
    assert torch.equal(bits(a), bits(b)), what


def random_values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # every bit pattern: NaNs, infinities, subnormals, -0


def make_samples(schema: dict[str, KeySpec], lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        sample = {}
        for name, spec in schema.items():
            shape = (length, *spec.shape) if spec.ragged else spec.shape
            sample[name] = random_values(shape, spec.dtype, g)
        out.append(sample)
    return out


def batch_of(samples: list[dict[str, torch.Tensor]], schema: dict[str, KeySpec]) -> dict[str, torch.Tensor]:
    batch: dict[str, torch.Tensor] = {}
    for name, spec in schema.items():
        tensors = [s[name] for s in samples]
        if spec.ragged:
            batch[name] = torch.cat(tensors) if tensors else torch.empty((0, *spec.shape), dtype=spec.dtype)
            lengths = [t.shape[0] for t in tensors]
            batch[LENGTHS_KEY] = torch.tensor(lengths, dtype=torch.int64)
        else:
            batch[name] = torch.stack(tensors)
    return batch


def write_native_cache(
    cache_dir: str,
    schema: dict[str, KeySpec],
    samples: list[dict[str, torch.Tensor]],
    shard_size: int,
    batch_size: int = 3,
    seal: bool = True,
    config: dict | None = None,
) -> dict:
    writer = CacheWriter(
        cache_dir,
        cache_name="test",
        schema=schema,
        shard_size=shard_size,
        num_samples=len(samples),
        config=config or {"k": 1},
    )
    batches = [batch_of(samples[i : i + batch_size], schema) for i in range(0, len(samples), batch_size)]
    ragged = [k for k, s in schema.items() if s.ragged]
    try:
        with writer.writing(overlap=False) as run:
            assert run.shards == list(range(-(-len(samples) // shard_size)))
            write_cache_shards(batches, cache_dir, shard_size, 0, lambda b: b, run.write_shard, LOG, ragged_keys=ragged)
            run.stats = {"note": "extra fields are kept"}
            if not seal:
                raise _LeaveUnsealed
    except _LeaveUnsealed:
        return json.loads(open(manifest_path(cache_dir)).read())
    return writer.manifest.to_json()


class _LeaveUnsealed(Exception):
    """Raised inside ``CacheWriter.writing`` to stop a run after its shards, before the seal."""


def every_dtype_schema(width: int = 3) -> dict[str, KeySpec]:
    specs = []
    for label, dtype in DTYPES.items():
        specs.append(KeySpec(f"fixed_{label}", dtype, (width,)))
        specs.append(KeySpec(f"ragged_{label}", dtype, (width,), ragged=True))
    specs.append(KeySpec("scalar_ragged", torch.int64, (), ragged=True))
    specs.append(KeySpec("scalar_fixed", torch.int32, ()))
    return {s.name: s for s in specs}


LENGTHS = [3, 0, 5, 1, 0, 0, 7, 2, 0, 4, 1]  # zero-length samples, and shard 2 (samples 4, 5) holds no rows


@pytest.fixture(scope="module")
def mixed_cache(tmp_path_factory):
    """A sealed cache of every dtype, fixed and ragged, shards of 2 (the last one partial)."""
    cache_dir = str(tmp_path_factory.mktemp("mixed") / "cache")
    schema = every_dtype_schema()
    samples = make_samples(schema, LENGTHS, seed=1)
    manifest = write_native_cache(cache_dir, schema, samples, shard_size=2)
    return cache_dir, schema, samples, manifest


# ---------------------------------------------------------------------------
# round trips


def test_round_trip_of_every_dtype_fixed_and_ragged_with_zero_length_samples(mixed_cache):
    cache_dir, schema, samples, _ = mixed_cache
    ds = CacheDataset(cache_dir)
    assert len(ds) == len(samples)
    assert set(ds.keys) == set(schema)  # in the manifest's (sorted) order
    assert ds.ragged_keys == {k for k, s in schema.items() if s.ragged}
    for i, expected in enumerate(samples):
        got = ds[i]
        assert set(got) == set(schema)
        for key in schema:
            assert_same(got[key], expected[key], f"sample {i} key {key}")


def test_round_trip_of_a_fixed_only_cache_has_no_offsets(tmp_path):
    schema = {
        s.name: s
        for s in (
            KeySpec("a", torch.bfloat16, (2, 3)),
            KeySpec("b", torch.bool, ()),
            KeySpec("c", torch.float8_e5m2, (4,)),
        )
    }
    samples = make_samples(schema, [0] * 5, seed=2)
    write_native_cache(str(tmp_path), schema, samples, shard_size=2, batch_size=4)
    assert OFFSETS_KEY not in load_file(shard_path(str(tmp_path), 0))
    ds = CacheDataset(str(tmp_path))
    for i, expected in enumerate(samples):
        for key in schema:
            assert_same(ds[i][key], expected[key])


def test_round_trip_of_a_cache_whose_samples_are_all_empty(tmp_path):
    schema = {"ids": KeySpec("ids", torch.int32, (), ragged=True), "h": KeySpec("h", torch.float16, (8,), ragged=True)}
    samples = make_samples(schema, [0, 0, 0], seed=3)
    manifest = write_native_cache(str(tmp_path), schema, samples, shard_size=2)
    assert manifest["num_tokens"] == 0
    ds = CacheDataset(str(tmp_path))
    assert [tuple(ds[i]["h"].shape) for i in range(3)] == [(0, 8)] * 3


def test_round_trip_of_an_empty_cache(tmp_path):
    schema = {"ids": KeySpec("ids", torch.int32, (), ragged=True)}
    manifest = write_native_cache(str(tmp_path), schema, [], shard_size=4)
    assert manifest["shards"] == [] and manifest["complete"] is True
    assert len(CacheDataset(str(tmp_path))) == 0


def test_reading_a_subset_of_keys(mixed_cache):
    cache_dir, _, samples, _ = mixed_cache
    for keys in (["ragged_bf16"], ["fixed_i64"], ["scalar_fixed", "ragged_bool"]):
        ds = CacheDataset(cache_dir, keys=keys)
        assert ds.keys == tuple(keys)
        for i in (0, 4, 10):
            got = ds[i]
            assert list(got) == keys
            for key in keys:
                assert_same(got[key], samples[i][key])


@pytest.mark.parametrize(
    "encoding,parts", [("raw", {"h"}), ("fp8", {"h", "h.scale"}), ("zbf16", {"h.lo", "h.hi", "h.hi_offsets"})]
)
def test_shard_parts_are_named_key_or_key_dot_suffix_per_encoding(tmp_path, encoding, parts):
    schema = {
        "h": KeySpec("h", torch.bfloat16, (4,), ragged=True, encoding=encoding),
        "n": KeySpec("n", torch.int64, ()),
    }
    g = torch.Generator().manual_seed(0)
    samples = [{"h": torch.randn(k, 4, generator=g).to(torch.bfloat16), "n": torch.tensor(k)} for k in (2, 0, 3)]
    write_native_cache(str(tmp_path), schema, samples, shard_size=3)
    assert set(load_file(shard_path(str(tmp_path), 0))) == parts | {"n", OFFSETS_KEY}
    ds = CacheDataset(str(tmp_path))
    assert [tuple(ds[i]["h"].shape) for i in range(3)] == [(2, 4), (0, 4), (3, 4)]
    if encoding != "fp8":
        for i in range(3):
            assert_same(ds[i]["h"], samples[i]["h"])


# ---------------------------------------------------------------------------
# safetensors interop


def test_native_shards_are_readable_by_the_safetensors_library_and_equal(mixed_cache):
    cache_dir, _, _, manifest = mixed_cache
    for row in manifest["shards"]:
        path = shard_path(cache_dir, row["index"])
        ours = ShardFile(path)
        theirs = load_file(path)
        assert set(theirs) == set(ours.keys())
        for name, tensor in theirs.items():
            assert_same(ours.tensor(name), tensor, name)
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == ours.metadata
            for name in f.keys():
                assert_same(f.get_tensor(name), theirs[name], name)


def test_tensors_written_by_safetensors_save_file_are_readable_by_shard_file(tmp_path):
    g = torch.Generator().manual_seed(5)
    tensors = {f"t_{label}": random_values((3, 5), dtype, g) for label, dtype in DTYPES.items()}
    tensors.update(
        empty=torch.empty(0, 4, dtype=torch.bfloat16),
        scalar=torch.tensor(7, dtype=torch.int64),
        odd=torch.ones(3, dtype=torch.int8),
        u8=torch.arange(5, dtype=torch.uint8),
        f64=torch.randn(2, 2, dtype=torch.float64),
        i16=torch.arange(3, dtype=torch.int16),
    )
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path, metadata={"a": "1", "b": "two"})
    f = ShardFile(path)
    assert f.metadata == {"a": "1", "b": "two"}
    assert set(f.keys()) == set(tensors)
    for name, t in tensors.items():
        assert_same(f.tensor(name), t, name)
        assert bytes(f.tensor_bytes(name)) == bytes(bytes_view(t.contiguous())), name  # the raw-read path's view


def test_shard_file_reads_an_unaligned_safetensors_file(tmp_path):
    # Valid per the safetensors spec: nothing requires a tensor to start at a multiple of its element size.
    header = {
        "a": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path / "u.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.0))
    reference = load_file(str(path))
    f = ShardFile(str(path))
    assert_same(f.tensor("a"), reference["a"])
    assert_same(f.tensor("b"), reference["b"])
    assert f.tensor("b").tolist() == [1.5, -2.0]


def test_write_safetensors_output_matches_the_safetensors_library(tmp_path):
    g = torch.Generator().manual_seed(6)
    tensors = {f"t_{label}": random_values((4, 3), dtype, g) for label, dtype in DTYPES.items()}
    tensors["empty"] = torch.empty(0, dtype=torch.float32)
    written = write_safetensors(str(tmp_path / "a.safetensors"), tensors, {"m": "v"})
    assert written.bytes == os.path.getsize(written.path)
    assert written.checksum == xxhash.xxh3_128_hexdigest((tmp_path / "a.safetensors").read_bytes())
    loaded = load_file(written.path)
    for name, t in tensors.items():
        assert_same(loaded[name], t, name)
    with safe_open(written.path, framework="pt") as f:
        assert f.metadata() == {"m": "v"}
    # every tensor starts aligned to its element size
    f = ShardFile(written.path)
    for dtype, _, begin, _ in f.entries.values():
        assert (f.data_start + begin) % torch.empty((), dtype=dtype).element_size() == 0


# ---------------------------------------------------------------------------
# metadata, manifest, checksums


def test_shard_metadata_records_version_index_counts_and_tensor_checksums(mixed_cache):
    cache_dir, _, samples, manifest = mixed_cache
    for row in manifest["shards"]:
        index = row["index"]
        path = shard_path(cache_dir, index)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        a, b = index * 2, min(index * 2 + 2, len(samples))
        assert meta["speccache_format"] == str(FORMAT_VERSION)
        assert meta["shard_index"] == str(index)
        assert meta["num_samples"] == str(b - a)
        assert meta["num_rows"] == str(sum(LENGTHS[a:b]))
        recorded = json.loads(meta["xxh3_128"])
        tensors = load_file(path)
        assert set(recorded) == set(tensors)
        for name, t in tensors.items():
            assert recorded[name] == xxhash.xxh3_128_hexdigest(bits(t).numpy().tobytes()), name
        assert tensors[OFFSETS_KEY].tolist() == [0, *torch.tensor(LENGTHS[a:b]).cumsum(0).tolist()]


def test_manifest_records_schema_counts_and_a_shard_table_with_whole_file_checksums(mixed_cache):
    cache_dir, schema, samples, manifest = mixed_cache
    on_disk = json.loads(open(manifest_path(cache_dir)).read())
    assert on_disk == manifest
    assert on_disk["format_version"] == FORMAT_VERSION and on_disk["cache_name"] == "test"
    assert on_disk["keys"] == schema_to_json(schema)
    assert on_disk["keys"]["ragged_f8e4m3"] == {
        "dtype": "float8_e4m3fn",
        "shape": [3],
        "ragged": True,
        "encoding": "raw",
    }
    assert on_disk["shard_size"] == 2 and on_disk["num_samples"] == len(samples)
    assert on_disk["config"] == {"k": 1} and on_disk["complete"] is True
    assert on_disk["producer"]["name"] == "speccache"
    assert on_disk["stats"] == {"note": "extra fields are kept"}
    assert [row["index"] for row in on_disk["shards"]] == list(range(6))
    for row in on_disk["shards"]:
        path = shard_path(cache_dir, row["index"])
        data = open(path, "rb").read()
        a, b = row["index"] * 2, min(row["index"] * 2 + 2, len(samples))
        assert row["samples"] == b - a
        assert row["tokens"] == sum(LENGTHS[a:b])
        assert row["bytes"] == len(data)
        assert row["xxh3_128"] == xxhash.xxh3_128_hexdigest(data) == file_checksum(path)
    assert on_disk["num_tokens"] == sum(LENGTHS)
    assert on_disk["total_bytes"] == sum(row["bytes"] for row in on_disk["shards"])


def test_complete_is_false_until_sealed_and_readers_refuse_an_unsealed_cache(tmp_path):
    schema = every_dtype_schema(2)
    samples = make_samples(schema, LENGTHS, seed=4)
    manifest = write_native_cache(str(tmp_path), schema, samples, shard_size=4, seal=False)
    assert manifest["complete"] is False and "shards" not in manifest
    with pytest.raises(CacheIncompleteError, match="--resume"):
        CacheDataset(str(tmp_path))
    # allow_incomplete reads the whole shards present
    os.unlink(shard_path(str(tmp_path), 2))
    ds = CacheDataset(str(tmp_path), allow_incomplete=True)
    assert len(ds) == 8
    assert_same(ds[7]["ragged_bf16"], samples[7]["ragged_bf16"])


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("sealed", [True, False])
def test_verify_on_the_reader_catches_a_flipped_data_byte_and_names_the_shard(tmp_path, sealed):
    schema = every_dtype_schema(2)
    samples = make_samples(schema, LENGTHS, seed=5)
    write_native_cache(str(tmp_path), schema, samples, shard_size=4, seal=sealed)
    damaged = shard_path(str(tmp_path), 1)
    _flip_last_byte(damaged)
    ds = CacheDataset(str(tmp_path), verify=True, allow_incomplete=not sealed)
    ds[0]  # other shards still read
    with pytest.raises(CacheCorruptError) as info:
        ds[5]
    assert damaged in str(info.value) and "--resume" in str(info.value)
    CacheDataset(str(tmp_path), allow_incomplete=not sealed, verify=False)[5]  # the opt-out: the byte goes unnoticed


@pytest.mark.parametrize("cut", [1, 100, "header", "tiny"])
def test_a_truncated_shard_raises_cache_corrupt_error_even_without_verify(mixed_cache, tmp_path, cut):
    cache_dir, _, _, _ = mixed_cache
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(cache_dir, copy)
    path = shard_path(copy, 1)
    size = os.path.getsize(path)
    keep = {"header": 20, "tiny": 4}[cut] if isinstance(cut, str) else size - cut
    os.truncate(path, keep)
    ds = CacheDataset(copy)
    ds[0]
    with pytest.raises(CacheCorruptError) as info:
        ds[2]
    assert path in str(info.value)
    with pytest.raises(CacheCorruptError):
        ShardFile(path)


# ---------------------------------------------------------------------------
# collators


def _ragged_samples():
    return [
        {"ids": torch.tensor([1, 2, 3]), "h": torch.ones(3, 2, dtype=torch.bfloat16), "sid": torch.tensor(0)},
        {
            "ids": torch.tensor([], dtype=torch.int64),
            "h": torch.ones(0, 2, dtype=torch.bfloat16),
            "sid": torch.tensor(1),
        },
        {"ids": torch.tensor([4, 5]), "h": torch.full((2, 2), 2.0, dtype=torch.bfloat16), "sid": torch.tensor(2)},
    ]


def test_pad_collator_pads_ragged_keys_and_adds_lengths_and_attention_mask():
    batch = PadCollator(["ids", "h"], pad_values={"ids": -100})(_ragged_samples())
    assert set(batch) == {"ids", "h", "sid", "lengths", "attention_mask"}
    assert batch["ids"].tolist() == [[1, 2, 3], [-100, -100, -100], [4, 5, -100]]
    assert batch["h"].dtype == torch.bfloat16 and batch["h"].shape == (3, 3, 2)
    assert batch["h"][2].tolist() == [[2, 2], [2, 2], [0, 0]] and batch["h"][1].abs().sum() == 0
    assert batch["sid"].tolist() == [0, 1, 2]
    assert batch["lengths"].dtype == torch.int64 and batch["lengths"].tolist() == [3, 0, 2]
    assert batch["attention_mask"].dtype == torch.int64
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0]]


def test_pad_collator_without_ragged_keys_only_stacks():
    batch = PadCollator([])([{"a": torch.tensor([1, 2])}, {"a": torch.tensor([3, 4])}])
    assert set(batch) == {"a"} and batch["a"].tolist() == [[1, 2], [3, 4]]


def test_pack_collator_concatenates_ragged_keys_with_cu_seqlens():
    batch = PackCollator(["ids", "h"])(_ragged_samples())
    assert set(batch) == {"ids", "h", "sid", "lengths", "cu_seqlens"}
    assert batch["ids"].tolist() == [1, 2, 3, 4, 5]
    assert batch["h"].shape == (5, 2)
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 3, 3, 5]
    assert batch["lengths"].tolist() == [3, 0, 2] and batch["sid"].tolist() == [0, 1, 2]


def test_collators_on_cache_samples_equal_collating_copies(mixed_cache):
    cache_dir, schema, samples, _ = mixed_cache
    ds = CacheDataset(cache_dir)
    ragged = ds.ragged_keys
    indices = [6, 1, 9, 4]
    views = ds.__getitems__(indices)
    for collate in (PadCollator(ragged), PackCollator(ragged)):
        got = collate(views)
        want = collate([samples[i] for i in indices])
        assert set(got) == set(want)
        for key in want:
            assert_same(got[key], want[key], key)


# ---------------------------------------------------------------------------
# __getitems__, pickling, workers, LRU, start-up


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(indices=st.lists(st.integers(-len(LENGTHS), len(LENGTHS) - 1), max_size=25))
def test_getitems_equals_per_item_getitem_in_any_order(mixed_cache, indices):
    cache_dir, schema, _, _ = mixed_cache
    ds = CacheDataset(cache_dir, max_open_shards=2)
    got = ds.__getitems__(indices)
    assert len(got) == len(indices)
    for index, sample in zip(indices, got):
        single = ds[index]
        assert list(sample) == list(single)
        for key in schema:
            assert_same(sample[key], single[key], f"{index} {key}")


def test_getitems_of_far_apart_samples_in_one_shard(tmp_path):
    schema = {"ids": KeySpec("ids", torch.int64, (), ragged=True), "n": KeySpec("n", torch.int64, ())}
    samples = [{"ids": torch.arange(i % 4) + i, "n": torch.tensor(i)} for i in range(64)]
    write_native_cache(str(tmp_path), schema, samples, shard_size=64, batch_size=64)
    ds = CacheDataset(str(tmp_path))
    got = ds.__getitems__([63, 0, 40, 0])
    assert [int(s["n"]) for s in got] == [63, 0, 40, 0]
    assert [s["ids"].tolist() for s in got] == [samples[i]["ids"].tolist() for i in (63, 0, 40, 0)]


def test_dataset_pickles_without_open_handles(mixed_cache):
    cache_dir, schema, samples, _ = mixed_cache
    ds = CacheDataset(cache_dir)
    ds[0]
    ds[5]
    assert len(ds._open) == 2
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # no tensor data travels
    clone = pickle.loads(blob)
    assert len(clone._open) == 0 and len(ds._open) == 2
    assert_same(clone[5]["ragged_fp32"], samples[5]["ragged_fp32"])
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ShardFile(shard_path(cache_dir, 0)))


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_dataset_works_in_dataloader_workers_of_every_start_method(mixed_cache, context):
    cache_dir, schema, samples, _ = mixed_cache
    ds = CacheDataset(cache_dir, keys=["ragged_bf16", "fixed_i64", "ragged_bool"])
    collate = PadCollator(ds.ragged_keys, pad_values={"ragged_bool": False})
    picked = [{k: s[k] for k in ds.keys} for s in samples]
    expected = [collate(picked[a : a + 3]) for a in range(0, len(samples), 3)]
    if context == "forkserver":
        # Workers fork from the server: let it import speccache (and torch) once rather than once per worker.
        multiprocessing.get_context("forkserver").set_forkserver_preload(["speccache.read"])
    loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context=context, collate_fn=collate)
    got = list(loader)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert set(g) == {"ragged_bf16", "fixed_i64", "ragged_bool", "lengths", "attention_mask"}
        for key in g:
            assert_same(g[key], e[key], key)
    assert len(ds._open) == 0  # the workers opened their own shards


def test_open_shards_are_bounded_by_max_open_shards(mixed_cache, monkeypatch):
    cache_dir, _, _, _ = mixed_cache
    opened: list[int] = []
    real = read_module.NativeShard

    def counting(path, schema, index, expected, **kwargs):
        opened.append(index)
        return real(path, schema, index, expected, **kwargs)

    monkeypatch.setattr(read_module, "NativeShard", counting)
    ds = CacheDataset(cache_dir, max_open_shards=2)
    for sample in (0, 2, 1, 4, 0, 3, 10, 2, 8, 6):  # shards 0, 1, 0, 2, 0, 1, 5, 1, 4, 3
        ds[sample]
        assert len(ds._open) <= 2
    assert opened == [0, 1, 2, 1, 5, 4, 3]
    ds.__getitems__(list(range(len(LENGTHS))))
    assert len(ds._open) <= 2
    with pytest.raises(ValueError, match="max_open_shards"):
        CacheDataset(cache_dir, max_open_shards=0)


def test_start_up_on_ten_thousand_shards_lists_the_directory_once_and_opens_no_shard(tmp_path, monkeypatch):
    n = 10_000
    schema = {"ids": KeySpec("ids", torch.int32, (), ragged=True)}
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    for i in range(n):
        os.link(empty, shard_path(str(tmp_path), i))  # empty: opening one would fail; links are quick to make
    empty.unlink()
    manifest = {
        "format_version": FORMAT_VERSION, "cache_name": "tiny", "keys": schema_to_json(schema), "shard_size": 2,
        "num_samples": 2 * n, "config": {}, "complete": True,
        "shards": [{"index": i, "samples": 2, "tokens": 0, "bytes": 0, "xxh3_128": "0" * 32} for i in range(n)],
    }  # fmt: skip
    with open(manifest_path(str(tmp_path)), "w") as f:
        json.dump(manifest, f)

    listings = []
    opened = []
    real_listdir, real_scandir, real_open, real_os_open = os.listdir, os.scandir, builtins.open, os.open
    monkeypatch.setattr(os, "listdir", lambda *a: (listings.append(a), real_listdir(*a))[1])
    monkeypatch.setattr(os, "scandir", lambda *a: (listings.append(a), real_scandir(*a))[1])

    def tracking_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def tracking_os_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", tracking_open)
    monkeypatch.setattr(os, "open", tracking_os_open)
    ds = CacheDataset(str(tmp_path))
    ds_verify = CacheDataset(str(tmp_path), verify=True)
    monkeypatch.undo()
    assert len(ds) == len(ds_verify) == 2 * n
    assert len(listings) == 2  # once per dataset
    assert not [p for p in opened if "shard-" in p]
    with pytest.raises(CacheCorruptError):
        ds[2 * n - 1]  # the (empty) shard is only opened on first use


# ---------------------------------------------------------------------------
# docs/format.md stays in step with what the code writes


def test_format_doc_names_every_manifest_field_metadata_key_and_dtype(mixed_cache):
    from pathlib import Path

    from speccache.format.schema import _DTYPES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    cache_dir, _, _, manifest = mixed_cache
    assert f"**`format_version` {FORMAT_VERSION}**" in doc
    for field in manifest:
        assert f"`{field}`" in doc, f"manifest field {field} is not documented"
    for field in manifest["shards"][0]:
        assert f'"{field}"' in doc, f"shard table field {field} is not documented"
    for key in ShardFile(shard_path(cache_dir, 0)).metadata:
        assert f"`{key}`" in doc, f"shard metadata key {key} is not documented"
    for name, (_, st_name) in _DTYPES.items():
        assert f"| `{name}` | `{st_name}` |" in doc, name
    for marker in ("`__offsets__`", ".speccache.lock", ".tmp-", "XXH3-128", "`raw`", "`fp8`", "`zbf16`"):
        assert marker in doc, marker
