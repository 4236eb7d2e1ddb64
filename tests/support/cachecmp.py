"""Comparing caches in tests: their files byte for byte, and their samples tensor for tensor."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from speccache.format import load_manifest_json, manifest_path, shard_path
from speccache.read import CacheDataset


def file_tree(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file of a cache directory by name, with its bytes."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def all_samples(path: str, **kwargs) -> list[dict[str, torch.Tensor]]:
    """Every sample of the cache at ``path`` (owned copies), read through :class:`CacheDataset`."""
    ds = CacheDataset(path, **kwargs)
    return [{k: v.clone() for k, v in s.items()} for s in ds.__getitems__(range(len(ds)))]


def same_samples(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    """Whether two sample lists hold the same keys and tensors, in order."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def written_bytes(cache: str) -> int:
    """The bytes the run wrote: every file of the cache but its manifest (shards and side files)."""
    manifest = load_manifest_json(manifest_path(cache))
    files = [shard_path(cache, s["index"]) for s in manifest["shards"]]
    files += [os.path.join(cache, name) for name in manifest["side_files"]]
    # nothing but the files the manifest lists (no stray temporary file counted by chance)
    assert sorted(files) == sorted(os.path.join(cache, n) for n in os.listdir(cache) if n != "manifest.json")
    return sum(os.path.getsize(f) for f in files)


def max_relative_error(got: str | os.PathLike[str], want: str | os.PathLike[str]) -> float:
    """The largest ``max|got - want| / max|want|`` over the float tensors of two caches' shards, whose other
    tensors (ids, masks, positions, offsets) must be equal and whose files must have the same names."""
    names = sorted(n for n in os.listdir(want) if not n.startswith("."))
    assert sorted(n for n in os.listdir(got) if not n.startswith(".")) == names
    worst = 0.0
    for name in names:
        if not name.startswith("shard-"):
            continue
        a, b = load_file(os.path.join(got, name)), load_file(os.path.join(want, name))
        assert a.keys() == b.keys()
        for key in b:
            if b[key].is_floating_point() and b[key].numel():  # a shard of text rows stores no image_embeds row
                diff = (a[key].double() - b[key].double()).abs().max()
                worst = max(worst, float(diff / b[key].double().abs().max()))
            else:
                assert torch.equal(a[key], b[key]), (name, key)
    return worst
