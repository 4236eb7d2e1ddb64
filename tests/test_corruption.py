"""Damaged caches: every kind of damage is reported by ``speccache verify`` and never read as data.

For each damage (truncation at seeded random offsets, bit flips in headers and in
tensor data, missing / stray / duplicated shards, edited manifests):

* ``speccache verify`` exits 1 and prints a ``PROBLEM`` line naming the damaged
  file with the reason;
* :class:`CacheDataset` with ``verify=True`` raises a speccache error (naming the
  shard for shard damage) or returns exactly the undamaged data; it never returns
  a wrong tensor;
* with ``verify=False``, structural damage (truncation, a bad header) is still an
  error, never an interpreter crash or a sample of the wrong length; data damage
  may go unnoticed without verification, but only speccache errors come out.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from speccache import cli
from speccache.errors import CacheCorruptError, CacheIncompleteError, SpeccacheError
from speccache.format import MANIFEST_NAME, ShardFile, shard_path
from speccache.read import CacheDataset
from speccache.read.verify import verify_cache
from speccache.testing.synthetic import write_synthetic_cache
from support.cachecmp import same_samples

SAMPLES, SHARD = 22, 4  # 6 shards, the last one partial
NUM_SHARDS = -(-SAMPLES // SHARD)
CASES = 10  # seeded random positions per damage kind and encoding


def _read_all(path: str, verify: bool) -> list[dict[str, torch.Tensor]]:
    ds = CacheDataset(path, verify=verify)
    return [{k: v.clone() for k, v in s.items()} for s in ds.__getitems__(range(len(ds)))]


@pytest.fixture(scope="module", params=["raw", "zbf16"])
def pristine(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"pristine-{request.param}") / "cache")
    write_synthetic_cache(
        path, num_samples=SAMPLES, shard_size=SHARD, hidden=16, max_len=24, encoding=request.param, overlap=False
    )
    return path, _read_all(path, verify=True)


@pytest.fixture
def cache(pristine, tmp_path):
    path = str(tmp_path / "cache")
    shutil.copytree(pristine[0], path)
    return path


def assert_verify_reports(path: str, capsys, file: str, *fragments: str) -> None:
    """``speccache verify`` exits 1 with a PROBLEM line for ``file`` whose reason holds every fragment."""
    report = verify_cache(path)
    reasons = [p.reason for p in report.problems if p.file == file]
    assert reasons, f"verify did not report {file}: {report.problems}"
    assert any(all(f in r for f in fragments) for r in reasons), f"{file}: {reasons} lack {fragments}"
    capsys.readouterr()
    assert cli.main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM  {file}: " in out, out


def assert_reader_safe(path: str, reference, name_in_error: str | None, structural: bool) -> None:
    """The verifying reader fails (naming ``name_in_error``) or returns the reference; the plain one never crashes.

    ``structural``: the damage must be an error even without verification.
    """
    try:
        got = _read_all(path, verify=True)
    except SpeccacheError as exc:
        if name_in_error is not None:
            assert name_in_error in str(exc), f"error does not name {name_in_error}: {exc}"
    else:
        assert same_samples(got, reference), "the verifying reader returned wrong data"
        assert name_in_error is None, "the verifying reader accepted a damaged cache"
    try:
        got = _read_all(path, verify=False)
    except SpeccacheError as exc:
        if name_in_error is not None:
            assert name_in_error in str(exc), f"error does not name {name_in_error}: {exc}"
    else:
        assert not structural, "structural damage was read without an error"
        assert [{k: v.shape for k, v in s.items()} for s in got] == [
            {k: v.shape for k, v in s.items()} for s in reference
        ], "damage changed a sample's length without an error"


def _shard(path: str, index: int) -> tuple[str, str, bytes]:
    full = shard_path(path, index)
    with open(full, "rb") as f:
        return full, os.path.basename(full), f.read()


def _rewrite(full: str, data: bytes) -> None:
    with open(full, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------------------
# shard damage


def test_truncated_shard_at_random_offsets(cache, pristine, capsys):
    rng = random.Random(1)
    for _case in range(CASES):
        index = rng.randrange(NUM_SHARDS)
        full, name, data = _shard(cache, index)
        data_start = ShardFile(full).data_start
        cut = rng.choice(
            [0, 1, 7, 8, rng.randrange(9, data_start), data_start, rng.randrange(data_start, len(data)), len(data) - 1]
        )
        _rewrite(full, data[:cut])
        assert_verify_reports(cache, capsys, name)
        assert_reader_safe(cache, pristine[1], name, structural=True)
        with pytest.raises(CacheCorruptError, match="truncated|too short|exceeds the file size|not valid JSON"):
            ShardFile(full)
        _rewrite(full, data)
    assert verify_cache(cache).ok


def test_bit_flips_in_shard_headers(cache, pristine, capsys):
    """A flipped bit anywhere in the 8-byte length or the JSON header; only flips the format ignores pass unverified."""
    rng = random.Random(2)
    for case in range(CASES * 3):
        index = rng.randrange(NUM_SHARDS)
        full, name, data = _shard(cache, index)
        data_start = ShardFile(full).data_start
        pos = rng.randrange(8) if case % 5 == 0 else rng.randrange(data_start)
        damaged = bytearray(data)
        damaged[pos] ^= 1 << rng.randrange(8)
        _rewrite(full, bytes(damaged))
        assert_verify_reports(cache, capsys, name)
        assert_reader_safe(cache, pristine[1], name, structural=False)
        _rewrite(full, data)


def test_bit_flips_in_tensor_data(cache, pristine, capsys):
    rng = random.Random(3)
    for _case in range(CASES * 2):
        index = rng.randrange(NUM_SHARDS)
        full, name, data = _shard(cache, index)
        shard = ShardFile(full)
        tensor = rng.choice(sorted(n for n, e in shard.entries.items() if e[3] > e[2]))
        _, _, begin, end = shard.entries[tensor]
        pos = shard.data_start + rng.randrange(begin, end)
        del shard
        damaged = bytearray(data)
        damaged[pos] ^= 1 << rng.randrange(8)
        _rewrite(full, bytes(damaged))
        assert_verify_reports(cache, capsys, name, "checksum")
        assert_reader_safe(cache, pristine[1], name, structural=False)
        _rewrite(full, data)


def test_deleted_shard(cache, pristine, capsys):
    full, name, _ = _shard(cache, 2)
    os.unlink(full)
    assert_verify_reports(cache, capsys, name, "missing shard")
    for verify in (True, False):
        with pytest.raises(SpeccacheError, match=r"missing \[2\].*--resume"):
            CacheDataset(cache, verify=verify)


def test_stray_shard(cache, pristine, capsys):
    full, _, data = _shard(cache, 1)
    stray = shard_path(cache, 40)
    _rewrite(stray, data)
    assert_verify_reports(cache, capsys, os.path.basename(stray), "unexpected shard")
    for verify in (True, False):
        with pytest.raises(SpeccacheError, match=r"unexpected \[40\]"):
            CacheDataset(cache, verify=verify)


@pytest.mark.parametrize("source, target", [(1, 3), (4, 2), (0, 5)])
def test_shard_duplicated_under_another_index(cache, pristine, capsys, source, target):
    _, _, data = _shard(cache, source)
    full, name, _ = _shard(cache, target)
    _rewrite(full, data)
    assert_verify_reports(cache, capsys, name)
    assert_reader_safe(cache, pristine[1], name, structural=True)
    with pytest.raises(SpeccacheError, match="records shard index|holds"):
        _read_all(cache, verify=False)


def test_temp_files_and_other_names_are_never_read_as_shards(cache, pristine, capsys):
    _, _, data = _shard(cache, 1)
    for junk in (
        "shard-000009.safetensors.tmp-host-1-abcd",
        "shard-9.safetensors",
        "shard-000009.safetensors.bak",
        ".tmp",
    ):
        _rewrite(os.path.join(cache, junk), data)
    assert verify_cache(cache).ok
    assert same_samples(_read_all(cache, verify=True), pristine[1])


# ---------------------------------------------------------------------------
# manifest edits


def _edit_manifest(path: str, edit) -> None:
    mpath = os.path.join(path, MANIFEST_NAME)
    with open(mpath) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _set(path: tuple, value):
    def edit(m):
        target = m
        for key in path[:-1]:
            target = target[key]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value(target[path[-1]]) if callable(value) else value

    return edit


DELETE = object()

# (edit, the file verify names, a fragment of its reason, a fragment the reader's error must hold or None when
# the reader may read the cache because the edit does not change what it returns)
MANIFEST_EDITS = {
    "num_samples+1": (_set(("num_samples",), lambda n: n + 1), "shard-000005.safetensors", "manifest expects", "holds"),
    "num_samples+3": (
        _set(("num_samples",), lambda n: n + 3),
        "shard-000006.safetensors",
        "missing shard",
        "missing [6]",
    ),
    "num_samples-1": (_set(("num_samples",), lambda n: n - 1), "shard-000005.safetensors", "manifest expects", "holds"),
    "num_samples-2": (
        _set(("num_samples",), lambda n: n - 2),
        "shard-000005.safetensors",
        "unexpected shard",
        "unexpected [5]",
    ),
    "num_samples=str": (_set(("num_samples",), "many"), MANIFEST_NAME, "malformed manifest", "integer"),
    "shard_size": (
        _set(("shard_size",), lambda n: n + 1),
        "shard-000000.safetensors",
        "manifest expects",
        "unexpected [5]",
    ),
    "shard_size=0": (_set(("shard_size",), 0), MANIFEST_NAME, "shard_size", "shard_size"),
    "num_tokens": (_set(("num_tokens",), lambda n: n + 1), MANIFEST_NAME, "num_tokens", None),
    "table samples": (_set(("shards", 3, "samples"), lambda n: n + 1), "shard-000003.safetensors", "shard table", None),
    "table tokens": (_set(("shards", 3, "tokens"), lambda n: n - 1), "shard-000003.safetensors", "shard table", None),
    # the reader checks each shard's size against the table whenever it opens it
    "table bytes": (
        _set(("shards", 3, "bytes"), lambda n: n + 8),
        "shard-000003.safetensors",
        "shard table",
        "shard table records",
    ),
    # the reader checks the tensors it reads against the shard's own checksums, not the file against the table
    "table checksum": (_set(("shards", 3, "xxh3_128"), "0" * 32), "shard-000003.safetensors", "shard table", None),
    "table row missing": (lambda m: m["shards"].pop(4), MANIFEST_NAME, "shard table lists", None),
    "table missing": (_set(("shards",), DELETE), MANIFEST_NAME, "shard table lists", None),
    "schema dtype": (
        _set(("keys", "input_ids", "dtype"), "int64"),
        "shard-000000.safetensors",
        "input_ids",
        "input_ids",
    ),
    "schema unknown dtype": (
        _set(("keys", "input_ids", "dtype"), "int128"),
        MANIFEST_NAME,
        "unknown dtype",
        "unknown dtype",
    ),
    "schema shape": (_set(("keys", "hidden", "shape"), [17]), "shard-000000.safetensors", "hidden", "hidden"),
    "schema ragged": (
        _set(("keys", "sample_id", "ragged"), True),
        "shard-000000.safetensors",
        "sample_id",
        "sample_id",
    ),
    "schema encoding": (_set(("keys", "loss_mask", "encoding"), "fp8"), MANIFEST_NAME, "fp8", "fp8"),
    "schema key removed": (_set(("keys", "loss_mask"), DELETE), "shard-000000.safetensors", "loss_mask", "loss_mask"),
    "schema key renamed": (
        lambda m: m["keys"].update(mask=m["keys"].pop("loss_mask")),
        "shard-000000.safetensors",
        "mask",
        "mask",
    ),
    "schema empty": (_set(("keys",), {}), MANIFEST_NAME, "keys", "keys"),
    "format_version": (_set(("format_version",), 2), MANIFEST_NAME, "format_version=2", "format_version=2"),
    "format_version missing": (
        _set(("format_version",), DELETE),
        MANIFEST_NAME,
        "format_version=None",
        "format_version=None",
    ),
    "complete=false": (_set(("complete",), False), MANIFEST_NAME, "not complete", "--resume"),
    "complete missing": (_set(("complete",), DELETE), MANIFEST_NAME, "not complete", "--resume"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_edited_manifest(cache, pristine, capsys, edit):
    change, file, reason, reader_fragment = MANIFEST_EDITS[edit]
    _edit_manifest(cache, change)
    assert_verify_reports(cache, capsys, file, reason)
    if reader_fragment is None:
        # the edit does not touch what the reader uses: it must still return exactly the data
        for verify in (True, False):
            assert same_samples(_read_all(cache, verify=verify), pristine[1])
        return
    for verify in (True, False):
        with pytest.raises(SpeccacheError) as info:
            _read_all(cache, verify=verify)
        assert reader_fragment in str(info.value), str(info.value)
        if edit.startswith("complete"):
            assert isinstance(info.value, CacheIncompleteError)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '{"format_version": 1', "\xff\xfe"])
def test_unreadable_manifest(cache, capsys, text):
    with open(os.path.join(cache, MANIFEST_NAME), "w", encoding="latin-1") as f:
        f.write(text)
    assert_verify_reports(cache, capsys, MANIFEST_NAME)
    with pytest.raises(SpeccacheError, match="manifest"):
        CacheDataset(cache)


def test_missing_manifest(cache, capsys):
    os.unlink(os.path.join(cache, MANIFEST_NAME))
    assert_verify_reports(cache, capsys, MANIFEST_NAME, "not found")
    with pytest.raises(FileNotFoundError, match="--resume"):
        CacheDataset(cache)
