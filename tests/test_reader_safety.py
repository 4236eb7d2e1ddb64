"""The trainer side never returns wrong data and never dies: isolated tensors, replaced and truncated shards,
seals kept by a no-op resume, ranks checked, empty samples, and the small cases of the reader's arguments."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import speccache.read._checked as checked_module
from speccache.dist import distributed_position
from speccache.errors import CacheCorruptError, CacheFormatError
from speccache.format import KeySpec, manifest_path, shard_path
from speccache.read import CacheDataset, LocalityShuffleSampler, PackCollator, PadCollator
from speccache.testing.synthetic import write_synthetic_cache
from speccache.write import CacheWriter

RAGGED = ["input_ids", "loss_mask", "hidden"]
ARGS = dict(num_samples=24, shard_size=8, batch_size=4, hidden=64, max_len=600, overlap=False)


@pytest.fixture(params=["raw", "fp8", "zbf16"])
def cache(tmp_path, request):
    path = str(tmp_path / "cache")
    write_synthetic_cache(path, encoding=request.param, **ARGS)
    return path


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------
# tensors handed out are the caller's own


def test_in_place_edits_of_returned_tensors_never_change_later_reads(cache):
    ds = CacheDataset(cache)
    want = {i: {k: v.clone() for k, v in ds[i].items()} for i in range(len(ds))}
    for sample in ds.__getitems__(range(len(ds))):  # what a custom collate_fn receives
        for value in sample.values():
            value.zero_() if value.dtype != torch.bool else value.fill_(False)
    for i in range(len(ds)):
        ds[i]["hidden"].fill_(7)
    for i, sample in enumerate(ds.__getitems__(range(len(ds)))):
        assert all(torch.equal(sample[k], want[i][k]) for k in want[i]), i
    # the collators' two read paths (file bytes, sample tensors) still agree with the cache
    for collate in (PadCollator(RAGGED), PackCollator(RAGGED)):
        from_files = collate(ds.__getitems__(range(len(ds))))
        from_tensors = collate([want[i] for i in range(len(ds))])
        assert all(torch.equal(from_files[k], from_tensors[k]) for k in from_files)


def _keep_samples(samples):
    """A custom collate that hands samples (and slices of them) back from the worker."""
    return [{"hidden": s["hidden"][:2], "input_ids": s["input_ids"]} for s in samples]


def test_samples_returned_from_workers_carry_only_their_own_bytes(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, num_samples=16, shard_size=16, batch_size=4, hidden=256, max_len=400, overlap=False)
    loader = DataLoader(CacheDataset(path), batch_size=4, num_workers=1, collate_fn=_keep_samples)
    for batch in loader:
        for sample in batch:
            for value in sample.values():
                # the storage shipped through shared memory is the sample's, not the whole shard mapping
                assert value.untyped_storage().nbytes() <= 600 * 256 * 2, value.untyped_storage().nbytes()


# ---------------------------------------------------------------------------
# shards replaced, regenerated or truncated under an open reader


def _regenerate(path: str, seed: int) -> None:
    """The same cache shape with other data, written in place (a rerun into the same directory)."""
    tmp = path + ".new"
    write_synthetic_cache(tmp, seed=seed, min_len=600, encoding="raw", **{**ARGS, "max_len": 600})
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(path, name))
    os.rmdir(tmp)


def test_a_cache_regenerated_in_place_is_refused_at_reopen(tmp_path):
    path = str(tmp_path / "c")
    # fixed lengths: the regenerated shards have the very same sizes and counts
    write_synthetic_cache(path, seed=0, min_len=600, encoding="raw", **{**ARGS, "max_len": 600})
    ds = CacheDataset(path, max_open_shards=1)
    first = ds[0]["hidden"].clone()
    _regenerate(path, seed=1)
    assert torch.equal(ds[0]["hidden"], first)  # shard 0 stays open: it still serves the cache this reader opened
    with pytest.raises(CacheCorruptError, match="changed since this reader opened the cache"):
        ds[8]  # shard 1 opens now: it would come from the new cache
    with pytest.raises(CacheCorruptError, match="changed since this reader opened the cache"):
        list(DataLoader(ds, batch_size=4, num_workers=1, collate_fn=PadCollator(RAGGED)))  # a fresh worker
    assert not torch.equal(CacheDataset(path)[0]["hidden"], first)  # a new reader reads the new cache


def test_a_shard_replaced_by_another_size_is_refused_at_reopen(tmp_path):
    path, other = str(tmp_path / "c"), str(tmp_path / "d")
    write_synthetic_cache(path, seed=0, **ARGS)
    write_synthetic_cache(other, seed=1, **ARGS)
    ds = CacheDataset(path, max_open_shards=1)
    ds[0]
    with open(shard_path(other, 1), "rb") as src, open(shard_path(path, 1), "r+b") as dst:
        dst.truncate(0)
        dst.write(src.read())
    with pytest.raises(CacheCorruptError, match="shard table records"):
        ds[8]


@pytest.mark.parametrize("where", ["mapping", "pread"])
def test_a_shard_truncated_while_open_raises_instead_of_sigbus(tmp_path, where):
    path = str(tmp_path / "c")
    # short samples are copied from the mapping, long ones read with pread: both must fail cleanly
    long = where == "pread"
    write_synthetic_cache(path, min_len=500 if long else 2, encoding="raw", **{**ARGS, "max_len": 600 if long else 8})
    code = f"""
import os, sys
from speccache.errors import CacheCorruptError
from speccache.read import CacheDataset, PadCollator
ds = CacheDataset({path!r})
views = ds.__getitems__(range(8))
os.truncate({shard_path(path, 0)!r}, 100)  # what copying a backup over the file does, mid-way
for attempt in (lambda: PadCollator({RAGGED!r})(views), lambda: ds.__getitems__([3])[0]["hidden"]):
    try:
        attempt()
    except CacheCorruptError as exc:
        print("refused:", exc)
    else:
        print("read")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7 would be SIGBUS
    assert out.stdout.count("refused:") == 2 and "shrank" in out.stdout, out.stdout


def test_a_shard_truncated_under_a_dataloader_worker_raises_instead_of_sigbus(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, min_len=2, encoding="raw", **{**ARGS, "max_len": 8})
    code = f"""
import os
from torch.utils.data import DataLoader
from speccache.errors import CacheCorruptError
from speccache.read import CacheDataset, PadCollator
ds = CacheDataset({path!r})
# shard 0, then shard 1, then shard 0 again: the worker has shard 0 open when it is truncated
order = [[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7]]
collate = PadCollator({RAGGED!r})
batches = iter(DataLoader(ds, batch_sampler=order, num_workers=1, prefetch_factor=1, collate_fn=collate))
next(batches)
os.truncate({shard_path(path, 0)!r}, 100)
next(batches)
try:
    next(batches)
except CacheCorruptError as exc:
    print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused:" in out.stdout and "shrank" in out.stdout, out.stdout + out.stderr[-2000:]


# ---------------------------------------------------------------------------
# a no-op resume keeps the seal


def test_a_no_op_resume_never_unseals_the_cache(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    before = open(manifest_path(path), "rb").read()
    stat = os.stat(manifest_path(path))
    seen: list[object] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                seen.append(json.loads(open(manifest_path(path), "rb").read())["complete"])
                CacheDataset(path)  # a reader starting meanwhile is never refused
            except Exception as exc:
                seen.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            write_synthetic_cache(path, resume=True, **ARGS)
    finally:
        stop.set()
        poller.join()
    assert seen and all(s is True for s in seen), [s for s in seen if s is not True][:3]
    assert open(manifest_path(path), "rb").read() == before
    assert os.stat(manifest_path(path)).st_ino == stat.st_ino  # not even rewritten


def test_a_resume_with_work_unseals_and_reseals_to_the_same_bytes(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    before = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    os.unlink(shard_path(path, 1))
    write_synthetic_cache(path, resume=True, **ARGS)
    assert {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)} == before


# ---------------------------------------------------------------------------
# distributed readers need a process group


def test_distributed_without_a_process_group_raises_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="init_process_group.*rank= and world_size=|WORLD_SIZE=4"):
        distributed_position()
    with pytest.raises(RuntimeError, match="init_process_group"):
        LocalityShuffleSampler(24, 8, **dict(zip(("rank", "world_size"), distributed_position())))


# ---------------------------------------------------------------------------
# empty samples and zero-width rows


@pytest.mark.parametrize("encoding", ["raw", "fp8", "zbf16"])
@pytest.mark.parametrize("collate_cls", [PadCollator, PackCollator])
def test_an_all_empty_batch_collates(tmp_path, encoding, collate_cls):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, num_samples=6, shard_size=3, batch_size=3, hidden=8, min_len=0, max_len=0,
                          encoding=encoding, overlap=False)  # fmt: skip
    ds = CacheDataset(path)
    collate = collate_cls(RAGGED)
    batch = collate(ds.__getitems__([0, 4, 2]))
    assert batch["lengths"].tolist() == [0, 0, 0]
    assert batch["hidden"].shape[-1] == 8 and batch["hidden"].numel() == 0
    copies = [{k: v.clone() for k, v in s.items()} for s in ds.__getitems__([0, 4, 2])]
    assert all(torch.equal(batch[k], v) for k, v in collate(copies).items())


def test_a_ragged_key_with_zero_width_rows_batches(tmp_path):
    path = str(tmp_path / "c")
    schema = {
        "ids": KeySpec("ids", torch.int32, (), ragged=True),
        "nothing": KeySpec("nothing", torch.bfloat16, (0,), ragged=True),
    }
    writer = CacheWriter(path, cache_name="zw", schema=schema, shard_size=4, num_samples=4, config={})
    with writer.writing(overlap=False) as run:
        lengths = torch.tensor([3, 0, 2, 5])
        rows = {"ids": torch.arange(10, dtype=torch.int32), "nothing": torch.empty(10, 0, dtype=torch.bfloat16)}
        run.write_shard(path, 0, {**rows, "__lengths__": lengths})
    ds = CacheDataset(path)
    for collate in (PadCollator(["ids", "nothing"]), PackCollator(["ids", "nothing"])):
        batch = collate(ds.__getitems__(range(4)))
        assert batch["lengths"].tolist() == [3, 0, 2, 5] and batch["nothing"].shape[-1] == 0


# ---------------------------------------------------------------------------
# availability: descriptors, verification cost, the CLI


def test_a_refused_shard_keeps_no_descriptor(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    ds = CacheDataset(path)
    write_synthetic_cache(str(tmp_path / "d"), seed=3, **ARGS)
    shutil.copy(shard_path(str(tmp_path / "d"), 1), shard_path(path, 1))  # another cache's shard: refused at open
    before = _fds()
    for _ in range(5):
        with pytest.raises((CacheCorruptError, CacheFormatError)) as info:
            ds[8]
    assert _fds() == before, info.value


def test_too_many_open_files_says_what_to_change(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    code = f"""
import resource
from speccache.read import CacheDataset
ds = CacheDataset({path!r})
import os
used = len(os.listdir('/proc/self/fd'))
resource.setrlimit(resource.RLIMIT_NOFILE, (used, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))  # listing used one
try:
    ds[0]
except OSError as exc:
    print(exc.errno, exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(errno.EMFILE) in out.stdout and "max_open_shards" in out.stdout and "ulimit -n" in out.stdout, out.stdout


def test_verify_hashes_each_shard_once_per_process(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    hashed: list[str] = []
    real = checked_module._DataCheck._hash
    monkeypatch.setattr(
        checked_module._DataCheck, "_hash", lambda self, source: (hashed.append(source.path), real(self, source))[1]
    )
    ds = CacheDataset(path, max_open_shards=1)  # each shard closed and reopened on every visit
    for _ in range(3):
        for i in (0, 8, 16, 1, 9):
            ds[i]
    assert sorted(os.path.basename(p) for p in hashed) == [f"shard-00000{i}.safetensors" for i in range(3)]


@pytest.mark.parametrize("what", ["manifest dir", "shard dir", "manifest unreadable"])
def test_inspect_and_verify_print_no_traceback(tmp_path, what):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    if what == "manifest dir":
        os.unlink(manifest_path(path))
        os.mkdir(manifest_path(path))
    elif what == "shard dir":
        os.unlink(shard_path(path, 1))
        os.mkdir(shard_path(path, 1))
    else:
        os.chmod(manifest_path(path), 0)
        if os.access(manifest_path(path), os.R_OK):
            pytest.skip("running as a user that reads any file")
    for command, codes in (("inspect", {1}), ("verify", {1})):
        out = subprocess.run(
            [sys.executable, "-m", "speccache", command, path], capture_output=True, text=True, timeout=120
        )
        assert out.returncode in codes, (command, out.returncode, out.stderr)
        assert "Traceback" not in out.stderr + out.stdout, (command, out.stderr)
        if command == "verify":
            assert "PROBLEM" in out.stdout, out.stdout


# ---------------------------------------------------------------------------
# the small items


def test_numpy_and_tensor_integers_are_integers(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    ds = CacheDataset(path, max_open_shards=np.int64(2))
    sampler = LocalityShuffleSampler(ds, np.int64(8), window=np.int32(2), world_size=np.int64(1), rank=np.int64(0))
    assert sorted(sampler) == list(range(24))
    state = sampler.state_dict(consumed=torch.tensor(5))
    assert json.loads(json.dumps(state))["consumed"] == 5
    assert torch.equal(ds[np.int64(3)]["hidden"], ds[3]["hidden"])


def test_a_float_index_is_refused_and_a_single_key_is_one_key(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    ds = CacheDataset(path)
    with pytest.raises(TypeError, match="integers"):
        ds[1.7]
    one = CacheDataset(path, keys="hidden")
    assert one.keys == ("hidden",) and list(one[0]) == ["hidden"]


def test_pin_memory_without_cuda_warns_like_torch(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine pins")
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    with pytest.warns(UserWarning, match="no CUDA"):
        collate = PadCollator(RAGGED, pin_memory=True)
    batch = collate(CacheDataset(path).__getitems__([0, 1]))
    assert not batch["hidden"].is_pinned()


def test_the_worker_start_method_does_not_matter(tmp_path):
    path = str(tmp_path / "c")
    write_synthetic_cache(path, **ARGS)
    ds = CacheDataset(path)
    want = PadCollator(RAGGED)(ds.__getitems__(range(4)))
    context = multiprocessing.get_context("spawn")
    got = next(
        iter(
            DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=context, collate_fn=PadCollator(RAGGED))
        )
    )
    assert all(torch.equal(got[k], want[k]) for k in want)
