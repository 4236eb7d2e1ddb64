"""Checked reads by default: no reader hands out a byte of a tensor whose checksum does not match.

A byte flipped in any stored tensor of an EAGLE-3 cache written by ``speccache precompute`` raises
:class:`CacheCorruptError` naming the shard and the tensor from the default readers (``CacheDataset``,
``build_eagle3_dataloader`` with its prefetching sampler and in DataLoader workers), from ``speccache train``
(exit 1, no traceback) and from ``speccache export`` in every layout; ``verify=False`` / ``--no-verify`` return
the damaged bytes (the documented opt-out); each shard is hashed once per process, whatever the epochs and
however often the LRU reopens it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.errors import CacheCorruptError
from speccache.format import Manifest, ShardFile, shard_path
from speccache.format.names import OFFSETS_KEY
from speccache.methods.eagle3 import Eagle3CacheDataset, build_eagle3_dataloader
from speccache.read import CacheDataset
from speccache.read import _checked as checked_module
from support.cachecmp import same_samples

pytestmark = pytest.mark.usefixtures("offline_single_thread")

BS = ["--batch-size", "3", "--shard-size", "3", "--dtype", "fp32"]
RUNS = {
    "eagle3": ("llama", ["--method", "eagle3", "--draft-vocab-size", "300", *BS]),
    "layers": ("llama", ["--method", "layers", "--layers", "1,3,4", "--last-hidden", "--last-prenorm", *BS]),
    "dflash": ("llama", ["--method", "dflash", *BS]),
    "dspark": ("llama", ["--method", "dspark", *BS]),
}
DAMAGED = 1  # the shard whose bytes are flipped (of 4)


@pytest.fixture(scope="module")
def runs(precompute_runs):
    return precompute_runs(RUNS, demo_data_path("sharegpt"), 12, 64)


def _tensors(cache: str) -> list[str]:
    """Every tensor of a shard of ``cache``: its keys' parts and the row offsets."""
    return sorted(ShardFile(shard_path(cache, DAMAGED)).keys())


def _damaged_copy(cache: str, tmp_path, tensor: str) -> str:
    """A copy of ``cache`` with one bit flipped in the middle of ``tensor`` of shard ``DAMAGED``."""
    copy = str(tmp_path / f"damaged-{tensor}")
    shutil.copytree(cache, copy)
    path = shard_path(copy, DAMAGED)
    file = ShardFile(path)
    _, _, begin, end = file.entries[tensor]
    pos = file.data_start + (begin + end) // 2
    file.close()
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x01]))  # the lowest bit: an offset stays non-decreasing, a value stays finite
    return copy


def _read_all(cache: str, **kwargs) -> list[dict[str, torch.Tensor]]:
    ds = CacheDataset(cache, **kwargs)
    return [dict(s) for s in ds.__getitems__(range(len(ds)))]


def _names_shard_and_tensor(message: str, cache: str, tensor: str) -> bool:
    return shard_path(cache, DAMAGED) in message and repr(tensor) in message and "--resume" in message


def test_a_flipped_byte_in_any_tensor_raises_from_the_default_readers(runs, tmp_path):
    cache = runs("eagle3")
    pristine = _read_all(cache)
    tensors = _tensors(cache)
    assert OFFSETS_KEY in tensors and set(Manifest.read(cache).schema) <= set(tensors)
    for tensor in tensors:
        copy = _damaged_copy(cache, tmp_path, tensor)
        with pytest.raises(CacheCorruptError) as info:
            _read_all(copy)
        assert _names_shard_and_tensor(str(info.value), copy, tensor), str(info.value)
        # the trainer's path: a prefetching locality sampler, which opens shards ahead of their batches
        loader = build_eagle3_dataloader(copy, batch_size=2, shuffle=True)
        with pytest.raises(CacheCorruptError) as info:
            list(loader)
        assert _names_shard_and_tensor(str(info.value), copy, tensor), str(info.value)
        if tensor == OFFSETS_KEY:
            continue  # damaged offsets move rows between samples: what verify=False returns is not one key's bytes
        # the documented opt-out returns the damaged bytes, in that key of that shard's samples only
        unchecked = _read_all(copy, verify=False)
        shard_size = Manifest.read(cache).shard_size
        changed = {
            (i, k) for i, (a, b) in enumerate(zip(unchecked, pristine)) for k in a if not torch.equal(a[k], b[k])
        }
        assert changed and {k for _, k in changed} == {tensor}, changed
        assert {i // shard_size for i, _ in changed} == {DAMAGED}, changed


def test_a_reader_of_a_key_subset_hashes_only_the_tensors_it_reads(runs, tmp_path):
    cache = runs("eagle3")
    copy = _damaged_copy(cache, tmp_path, "aux_hidden_states")
    keys = ["input_ids", "loss_mask"]
    assert same_samples(_read_all(copy, keys=keys), _read_all(cache, keys=keys))
    with pytest.raises(CacheCorruptError, match="aux_hidden_states"):
        _read_all(copy, keys=["input_ids", "aux_hidden_states"])


def test_dataloader_workers_check_for_themselves(runs, tmp_path):
    cache = runs("eagle3")
    copy = str(tmp_path / "copy")
    shutil.copytree(cache, copy)
    ds = Eagle3CacheDataset(copy)
    ds[DAMAGED * 3]  # this process checked the shard ...
    damaged = _damaged_copy(copy, tmp_path, "last_hidden_state")
    shutil.copy(shard_path(damaged, DAMAGED), shard_path(copy, DAMAGED))  # ... before its bytes changed
    loader = torch.utils.data.DataLoader(
        ds, batch_size=3, num_workers=1, collate_fn=ds.collator(), multiprocessing_context="spawn"
    )
    with pytest.raises(CacheCorruptError, match="last_hidden_state"):
        list(loader)


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The shard paths this process hashes from now on, in order (``_DataCheck._hash`` recorded)."""
    paths: list[str] = []
    real = checked_module._DataCheck._hash
    monkeypatch.setattr(
        checked_module._DataCheck, "_hash", lambda self, source: (paths.append(source.path), real(self, source))[1]
    )
    return paths


def test_each_shard_is_hashed_once_per_process(runs, hashed):
    cache = runs("eagle3")
    # one shard open at a time: every shard is reopened in every epoch, and opened ahead by the prefetch
    loader = build_eagle3_dataloader(cache, batch_size=2, shuffle=True, max_open_shards=1)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for _ in loader:
            pass
    shards = Manifest.read(cache).num_shards
    assert sorted(hashed) == [shard_path(cache, i) for i in range(shards)]


def test_train_stops_on_a_damaged_tensor_and_no_verify_trains_on_it(runs, tmp_path, capsys):
    copy = _damaged_copy(runs("eagle3"), tmp_path, "aux_hidden_states")
    argv = ["train", copy, "--batch-size", "4", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "draft")]) == 1
    err = capsys.readouterr().err
    assert _names_shard_and_tensor(err, copy, "aux_hidden_states") and "Traceback" not in err, err
    assert main([*argv, "--out", str(tmp_path / "unchecked"), "--no-verify"]) == 0


EXPORTS = [
    ("nemo-eagle3", "eagle3", []),
    ("specforge", "eagle3", []),
    ("nemo-eagle3", "layers", ["--layers", "1,3,4"]),
    ("specforge", "layers", ["--layers", "1,3,4"]),
    ("speculators", "layers", ["--layers", "1,3,4"]),
    ("nemo-dspark", "dspark", []),
    ("specforge-dspark", "dspark", []),
    ("specforge-dflash", "dflash", []),
]


@pytest.mark.parametrize(("to", "run", "extra"), EXPORTS, ids=[f"{to}-{run}" for to, run, _ in EXPORTS])
def test_export_stops_on_a_damaged_tensor(runs, tmp_path, capsys, to, run, extra):
    copy = _damaged_copy(runs(run), tmp_path, "input_ids")
    argv = ["export", "--to", to, *extra, copy]
    assert main([*argv, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert _names_shard_and_tensor(err, copy, "input_ids") and "Traceback" not in err, err
    assert main(["export", "--no-verify", "--to", to, *extra, copy, str(tmp_path / "unchecked")]) == 0


def test_a_loaders_main_process_hashes_nothing_for_its_workers(runs, hashed):
    cache = runs("eagle3")
    # the sampler's prefetch runs in this process and opens every shard; the (forked) worker reads and checks them
    loader = build_eagle3_dataloader(cache, batch_size=2, shuffle=True, num_workers=1)
    assert sum(len(batch["input_ids"]) for batch in loader) == Manifest.read(cache).num_samples
    assert hashed == []


def test_audit_stops_on_a_damaged_tensor_and_no_verify_compares_it(runs, tmp_path, capsys):
    copy = _damaged_copy(runs("eagle3"), tmp_path, "aux_hidden_states")
    argv = ["audit", copy, "--samples", "12", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _names_shard_and_tensor(err, copy, "aux_hidden_states") and "Traceback" not in err, err
    # unchecked, the damaged sample is compared with the live forward instead (the lowest bit: within tolerance)
    assert main([*argv, "--no-verify"]) in (0, 1)
    assert "error" not in capsys.readouterr().err
