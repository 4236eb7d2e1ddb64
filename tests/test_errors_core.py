"""Bad inputs to the core: each raises a specific exception whose message names the file or
argument at fault and the fix, and leaves the directory exactly as it was."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from speccache.errors import (
    CacheCorruptError,
    CacheExistsError,
    CacheFormatError,
    CacheLockedError,
    ConfigMismatchError,
    ShardWriteError,
)
from speccache.format import (
    FORMAT_VERSION,
    KeySpec,
    ShardFile,
    manifest_path,
    shard_path,
    write_safetensors,
)
from speccache.format.lock import LOCK_NAME, CacheLock
from speccache.offline_cache import (
    CachedTensorDataset,
    _ShardAccumulator,
    partition_cache_shards,
    write_tensor_shard,
)
from speccache.read import CacheDataset
from speccache.testing.synthetic import synthetic_schema, write_synthetic_cache
from speccache.write import CacheWriter, NativeShardWriter

LOG = logging.getLogger("test_errors_core")
SHARD_SIZE = 4
NUM_SAMPLES = 10


def snapshot(directory) -> dict[str, bytes]:
    """Names and bytes of every file under ``directory`` (empty when it does not exist)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in files + [d + "/" for d in dirs]:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = b"" if name.endswith("/") else open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pristine") / "cache")
    write_synthetic_cache(path, num_samples=NUM_SAMPLES, shard_size=SHARD_SIZE, hidden=8, max_len=6, overlap=False)
    return path


@pytest.fixture
def cache(pristine, tmp_path):
    """A fresh copy of a sound synthetic cache (3 shards: 4, 4, 2 samples)."""
    path = str(tmp_path / "cache")
    shutil.copytree(pristine, path)
    return path


def writer_for(cache_dir: str, **overrides) -> CacheWriter:
    """A writer with the synthetic producer's settings (those of ``pristine``), with overrides."""
    config = {"method": "synthetic", "seed": 0, "hidden": 8, "min_len": 1, "max_len": 6, "batch_size": 4}
    kwargs = dict(
        cache_name="synthetic",
        schema=synthetic_schema(8),
        shard_size=SHARD_SIZE,
        num_samples=NUM_SAMPLES,
        config=config,
    )
    kwargs.update(overrides)
    return CacheWriter(cache_dir, **kwargs)


def rewrite_shard(path: str, edit) -> None:
    """Rewrite a shard with ``edit(tensors)`` applied, keeping its metadata."""
    f = ShardFile(path)
    tensors = {name: f.tensor(name).clone() for name in f.keys()}
    metadata = dict(f.metadata)
    del f
    edit(tensors)
    write_safetensors(path, tensors, metadata)


def read_everything(cache_dir: str, **kwargs) -> None:
    ds = CacheDataset(cache_dir, **kwargs)
    for i in range(len(ds)):
        ds[i]


# ---------------------------------------------------------------------------
# manifests


def test_missing_manifest(cache):
    os.unlink(manifest_path(cache))
    before = snapshot(cache)
    with pytest.raises(FileNotFoundError) as info:
        CacheDataset(cache)
    assert manifest_path(cache) in str(info.value) and "--resume" in str(info.value)
    with pytest.raises(FileNotFoundError, match="manifest"):
        CacheDataset(cache, cache_name="synthetic")
    assert snapshot(cache) == before


def test_invalid_manifest(cache):
    with open(manifest_path(cache), "w") as f:
        f.write('{"format_version": 1,')
    before = snapshot(cache)
    for kwargs in ({}, {"cache_name": "synthetic"}):
        with pytest.raises(CacheFormatError) as info:
            CacheDataset(cache, **kwargs)
        message = str(info.value)
        assert manifest_path(cache) in message and "not valid JSON" in message and "re-run the producer" in message
    assert snapshot(cache) == before


def test_manifest_that_is_not_an_object(cache):
    with open(manifest_path(cache), "w") as f:
        f.write("[1, 2]")
    before = snapshot(cache)
    with pytest.raises(CacheFormatError, match="JSON object"):
        CacheDataset(cache, cache_name="synthetic")
    assert snapshot(cache) == before


def test_wrong_version_manifest(cache):
    manifest = json.load(open(manifest_path(cache)))
    manifest["format_version"] = FORMAT_VERSION + 1
    with open(manifest_path(cache), "w") as f:
        json.dump(manifest, f)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)
    message = str(info.value)
    assert f"format_version={FORMAT_VERSION + 1}" in message and f"expected {FORMAT_VERSION}" in message
    assert "Regenerate the cache with this speccache" in message and cache in message
    assert snapshot(cache) == before


def test_manifest_without_counts(cache):
    manifest = json.load(open(manifest_path(cache)))
    del manifest["shard_size"]
    with open(manifest_path(cache), "w") as f:
        json.dump(manifest, f)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError, match="manifest.json.*shard_size"):
        CacheDataset(cache)
    assert snapshot(cache) == before


def test_manifest_with_a_malformed_key_schema(cache):
    manifest = json.load(open(manifest_path(cache)))
    manifest["keys"]["hidden"]["dtype"] = "float128"
    with open(manifest_path(cache), "w") as f:
        json.dump(manifest, f)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)
    assert "manifest.json" in str(info.value) and "hidden" in str(info.value) and "float128" in str(info.value)
    assert snapshot(cache) == before


def test_a_cache_of_another_cache_name(cache):
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache, cache_name="eagle3")
    message = str(info.value)
    assert "'synthetic'" in message and "'eagle3'" in message and cache in message
    with pytest.raises(CacheFormatError, match="'synthetic' cache, not 'eagle3'"):
        CachedTensorDataset(cache, "eagle3", FORMAT_VERSION, ("hidden",))
    assert snapshot(cache) == before


def test_reading_keys_the_cache_does_not_hold(cache):
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache, keys=["hidden", "logits"])
    assert "['logits']" in str(info.value) and "hidden" in str(info.value)
    assert snapshot(cache) == before


# ---------------------------------------------------------------------------
# the shard set


@pytest.mark.parametrize(
    "damage,mentions",
    [
        (lambda c: os.unlink(shard_path(c, 1)), "missing [1]"),
        (lambda c: os.unlink(shard_path(c, 2)), "missing [2]"),
        (lambda c: shutil.copy(shard_path(c, 0), shard_path(c, 3)), "unexpected [3]"),
        (
            lambda c: (os.unlink(shard_path(c, 0)), shutil.copy(shard_path(c, 1), shard_path(c, 7))),
            "missing [0], unexpected [7]",
        ),
    ],
)
def test_missing_extra_or_non_contiguous_shards(cache, damage, mentions):
    damage(cache)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)
    message = str(info.value)
    assert mentions in message and cache in message and "--resume" in message
    assert snapshot(cache) == before


def test_a_shard_with_a_missing_key(cache):
    path = shard_path(cache, 1)
    rewrite_shard(path, lambda t: t.pop("sample_id"))
    before = snapshot(cache)
    ds = CacheDataset(cache)
    ds[0]
    with pytest.raises(CacheFormatError) as info:
        ds[SHARD_SIZE]
    message = str(info.value)
    assert path in message and "missing ['sample_id']" in message and "re-run the producer with --resume" in message
    assert snapshot(cache) == before


def test_a_shard_with_an_unexpected_key(cache):
    path = shard_path(cache, 0)
    rewrite_shard(path, lambda t: t.update(extra=torch.zeros(3)))
    before = snapshot(cache)
    with pytest.raises(CacheFormatError, match=r"unexpected \['extra'\]"):
        CacheDataset(cache)[0]
    assert snapshot(cache) == before


def test_a_shard_with_a_wrong_dtype(cache):
    path = shard_path(cache, 2)
    rewrite_shard(path, lambda t: t.update(sample_id=t["sample_id"].to(torch.int32)))
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)[NUM_SAMPLES - 1]
    message = str(info.value)
    assert path in message and "'sample_id'" in message and "torch.int32" in message and "torch.int64" in message
    assert "--resume" in message
    assert snapshot(cache) == before


def test_a_shard_with_a_wrong_shape(cache):
    path = shard_path(cache, 0)
    rewrite_shard(path, lambda t: t.update(hidden=t["hidden"][:, :4].contiguous()))
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)[0]
    message = str(info.value)
    assert path in message and "'hidden'" in message and "4]" in message and "8]" in message
    assert snapshot(cache) == before


def test_a_shard_with_the_wrong_sample_count(cache):
    path = shard_path(cache, 2)
    shutil.copy(shard_path(cache, 0), path)  # a whole shard of 4 where the last holds 2
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CacheDataset(cache)[NUM_SAMPLES - 1]
    assert path in str(info.value)
    assert snapshot(cache) == before


def test_a_truncated_shard(cache):
    path = shard_path(cache, 1)
    os.truncate(path, os.path.getsize(path) - 10)
    before = snapshot(cache)
    with pytest.raises(CacheCorruptError) as info:
        read_everything(cache)
    message = str(info.value)
    assert path in message and "truncated" in message and "--resume" in message
    assert snapshot(cache) == before


def test_a_seed_layout_shard_with_a_missing_key(tmp_path):
    cache = str(tmp_path)
    write_tensor_shard(cache, 0, {"a": torch.zeros(2, 3), "b": torch.ones(2)}, ("a", "b"), "EAGLE-3")
    with open(manifest_path(cache), "w") as f:
        json.dump({"format_version": 2, "num_samples": 2, "shard_size": 2}, f)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError) as info:
        CachedTensorDataset(cache, "EAGLE-3", 2, ("a", "c"))[0]
    assert shard_path(cache, 0) in str(info.value) and "'c'" in str(info.value)
    assert snapshot(cache) == before


# ---------------------------------------------------------------------------
# writing


def test_writing_a_shard_with_missing_keys(tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        write_tensor_shard(str(tmp_path), 0, {"a": torch.zeros(2)}, ("a", "b"), "EAGLE-3")
    assert "['b']" in str(info.value)
    writer = NativeShardWriter(synthetic_schema(8))
    with pytest.raises(ShardWriteError) as info:  # what the overlapped writer raises too
        writer(str(tmp_path), 0, {"input_ids": torch.zeros(3, dtype=torch.int32), "__lengths__": torch.tensor([3])})
    message = str(info.value)
    assert "missing keys" in message and "hidden" in message and "loss_mask" in message and "sample_id" in message
    assert snapshot(tmp_path) == before


def test_writing_a_shard_with_a_wrong_dtype_or_shape(tmp_path):
    writer = NativeShardWriter({"h": KeySpec("h", torch.bfloat16, (4,))})
    before = snapshot(tmp_path)
    for bad in (torch.zeros(2, 4), torch.zeros(2, 5, dtype=torch.bfloat16)):
        with pytest.raises(ShardWriteError, match="key 'h'"):
            writer(str(tmp_path), 0, {"h": bad})
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("shard_size", [0, -1])
def test_shard_size_below_one(tmp_path, shard_size):
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="shard_size"):
        writer_for(str(tmp_path / "c"), shard_size=shard_size)
    with pytest.raises(ValueError, match="shard_size"):
        _ShardAccumulator(str(tmp_path), shard_size, 0, lambda *a: "", LOG)
    with pytest.raises(ValueError, match="shard_size"):
        partition_cache_shards(10, shard_size, 1, 0)
    assert snapshot(tmp_path) == before


def test_shard_size_below_one_in_a_manifest(cache):
    manifest = json.load(open(manifest_path(cache)))
    manifest["shard_size"] = 0
    with open(manifest_path(cache), "w") as f:
        json.dump(manifest, f)
    before = snapshot(cache)
    with pytest.raises(CacheFormatError, match="manifest.json: shard_size must be >= 1"):
        CacheDataset(cache)
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    "world_size,rank,name", [(0, 0, "world_size"), (-2, 0, "world_size"), (2, 2, "rank"), (2, -1, "rank")]
)
def test_bad_world_size_or_rank(tmp_path, world_size, rank, name):
    class Comm:
        def __init__(self):
            self.world_size, self.rank = world_size, rank

    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=name):
        partition_cache_shards(10, 2, world_size, rank)
    with pytest.raises(ValueError, match=name):
        writer_for(str(tmp_path / "c"), comm=Comm())
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------
# the writer lock


class _Interrupted(Exception):
    """Ends a run inside ``CacheWriter.writing`` before its seal."""


@contextmanager
def begun(writer: CacheWriter) -> Iterator[Any]:
    """Enter ``writer.writing()`` and leave it unsealed, as an interrupted run does (lock released)."""
    try:
        with writer.writing(overlap=False) as run:
            yield run
            raise _Interrupted
    except _Interrupted:
        pass


def test_a_second_writer_on_the_same_directory(tmp_path):
    cache = str(tmp_path / "c")
    with begun(writer_for(cache)):
        before = snapshot(cache)
        with pytest.raises(CacheLockedError) as info:
            with begun(writer_for(cache)):
                pass
        message = str(info.value)
        assert str(os.getpid()) in message and socket.gethostname() in message
        assert os.path.join(cache, LOCK_NAME) in message and "--resume" in message
        assert snapshot(cache) == before
    assert not os.path.exists(os.path.join(cache, LOCK_NAME))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_from_a_dead_process_on_this_host_is_recovered(tmp_path):
    cache = str(tmp_path / "c")
    os.makedirs(cache)
    with open(os.path.join(cache, LOCK_NAME), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": _dead_pid(), "since": 0}, f)
    with begun(writer_for(cache)):
        holder = CacheLock(cache).holder()
        assert holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert not os.path.exists(os.path.join(cache, LOCK_NAME))


def test_a_lock_held_from_another_host_is_refused_with_the_way_out(tmp_path):
    cache = str(tmp_path / "c")
    os.makedirs(cache)
    with open(os.path.join(cache, LOCK_NAME), "w") as f:
        json.dump({"host": "elsewhere.example", "pid": 4242, "since": 0}, f)
    before = snapshot(cache)
    with pytest.raises(CacheLockedError) as info:
        with begun(writer_for(cache)):
            pass
    message = str(info.value)
    assert (
        "4242" in message and "elsewhere.example" in message and f"delete {os.path.join(cache, LOCK_NAME)}" in message
    )
    assert snapshot(cache) == before


# ---------------------------------------------------------------------------
# resume


def test_resume_with_a_changed_config_names_every_differing_field(cache):
    before = snapshot(cache)
    writer = writer_for(
        cache,
        resume=True,
        shard_size=5,
        schema=synthetic_schema(16),
        config={
            "method": "synthetic",
            "seed": 1,
            "hidden": 8,
            "min_len": 1,
            "max_len": 6,
            "batch_size": 4,
            "new": True,
        },
    )
    with pytest.raises(ConfigMismatchError) as info:
        with begun(writer):
            pass
    message = str(info.value)
    for field in (
        "shard_size: cache has 4, this run has 5",
        "config.seed: cache has 0, this run has 1",
        "config.new",
        "keys.hidden",
    ):
        assert field in message, field
    for same in ("num_samples", "cache_name", "config.hidden", "config.method"):
        assert same not in message, same
    assert "nothing was changed" in message and cache in message
    assert snapshot(cache) == before


def test_resume_with_the_same_config_given_as_tuples_is_accepted(tmp_path):
    cache = str(tmp_path / "c")
    config = {"layers": (1, 2, 3), "nested": {"ids": (4, 5)}}
    with begun(writer_for(cache, config=config)):
        pass
    with begun(writer_for(cache, config=config, resume=True)) as run:
        assert run.shards == [0, 1, 2]


def test_without_resume_an_existing_cache_is_refused(cache):
    before = snapshot(cache)
    with pytest.raises(CacheExistsError) as info:
        with begun(writer_for(cache)):
            pass
    assert cache in str(info.value) and "--resume" in str(info.value) and "nothing was changed" in str(info.value)
    assert snapshot(cache) == before


def test_without_resume_a_directory_holding_only_shards_is_refused(cache):
    os.unlink(manifest_path(cache))
    before = snapshot(cache)
    with pytest.raises(CacheExistsError, match="--resume"):
        with begun(writer_for(cache)):
            pass
    with pytest.raises(CacheExistsError, match="holds shards but no manifest.json"):
        with begun(writer_for(cache, resume=True)):
            pass
    assert snapshot(cache) == before


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a directory")
    before = snapshot(tmp_path)
    with pytest.raises(CacheExistsError) as info:
        with begun(writer_for(str(path))):
            pass
    assert str(path) in str(info.value) and "choose a directory" in str(info.value)
    assert snapshot(tmp_path) == before


def test_stale_temp_files_are_removed_when_a_writer_starts(cache):
    stale = [
        "shard-000001.safetensors.tmp-otherhost-123-0badf00d",
        "manifest.json.tmp-otherhost-123-deadbeef",
        "shard-000002.safetensors.tmp",  # the seed's temp name
    ]
    for name in stale:
        with open(os.path.join(cache, name), "wb") as f:
            f.write(b"partial")
    with writer_for(cache, resume=True).writing() as run:
        assert run.shards == []  # every shard passes its checksums
        assert not set(stale) & set(os.listdir(cache))
    read_everything(cache, verify=True)


def test_resume_recomputes_a_damaged_shard(cache):
    path = shard_path(cache, 1)
    os.truncate(path, os.path.getsize(path) - 1)
    with begun(writer_for(cache, resume=True)) as run:
        assert run.shards == [1]  # shards 0 and 2 pass their checksums and are kept


def test_the_top_level_exports_every_public_exception():
    """``from speccache import XError`` works for every error class speccache raises (and ``Follow``)."""
    import inspect

    import speccache
    import speccache.errors

    classes = {
        name
        for name, obj in vars(speccache.errors).items()
        if inspect.isclass(obj) and issubclass(obj, speccache.errors.SpeccacheError) and not name.startswith("_")
    }
    assert classes <= set(speccache.__all__), sorted(classes - set(speccache.__all__))
    assert all(getattr(speccache, name) is getattr(speccache.errors, name) for name in classes)
    assert "Follow" in speccache.__all__ and speccache.Follow.__module__ == "speccache.read.follow"
