"""The benchmarks' data: synthetic samples in speccache's layout and in the seed's (NeMo AutoModel 0.7.0's offline
cache), the caches written from them (kept in the work directory and reused while their settings match), the seed's
module itself, and one DataLoader epoch over a dataset."""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from speccache.format import LENGTHS_KEY, shard_path
from speccache.read.view import make_merge_view
from speccache.testing.synthetic import synthetic_schema
from speccache.write import CacheWriter

UPSTREAM_DEFAULT = "/tmp/nemo/nemo_automodel/components/datasets/llm/offline_cache.py"
UPSTREAM_MEMBER = "nemo_automodel/components/datasets/llm/offline_cache.py"
SEED_KEYS = ("input_ids", "loss_mask", "hidden", "sample_id")
SEED_VERSION = 1


@dataclass
class Kind:
    """A family of samples: ``min_len..max_len`` tokens of ``hidden`` bf16 values each."""

    name: str
    num_samples: int
    shard_size: int
    hidden: int
    min_len: int
    max_len: int
    batch: int

    def scaled(self, scale: float) -> Kind:
        n = max(self.shard_size * 4, int(self.num_samples * scale) // self.shard_size * self.shard_size)
        return Kind(self.name, n, self.shard_size, self.hidden, self.min_len, self.max_len, self.batch)


LARGE = Kind("large", num_samples=640, shard_size=32, hidden=4096, min_len=192, max_len=256, batch=8)
SMALL = Kind("small", num_samples=16384, shard_size=256, hidden=256, min_len=48, max_len=64, batch=64)


class Pool:
    """Random bf16 rows that samples are cut from (views; content does not matter to raw reads and writes)."""

    def __init__(self, hidden: int, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        self.rng = np.random.default_rng(seed)

    def take(self, n: int) -> torch.Tensor:
        start = int(self.rng.integers(0, self.rows.shape[0] - n + 1))
        return self.rows[start : start + n]


def sample_lengths(kind: Kind, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(kind.min_len, kind.max_len + 1, kind.num_samples).tolist()


def native_shard(lengths: Sequence[int], first: int, pool: Pool) -> dict[str, torch.Tensor]:
    """One shard's samples as the native writers take them (ragged keys with ``__lengths__``)."""
    total = int(sum(lengths))
    ids = torch.arange(total, dtype=torch.int32) % 32000
    return {
        "input_ids": ids,
        "loss_mask": ids % 3 != 0,
        "hidden": pool.take(total),
        "sample_id": torch.arange(first, first + len(lengths), dtype=torch.int64),
        LENGTHS_KEY: torch.tensor(lengths, dtype=torch.int64),
    }


def seed_shard(lengths: Sequence[int], first: int, width: int, pool: Pool) -> dict[str, torch.Tensor]:
    """The same samples in the seed's layout: fixed keys, every sample padded to ``width`` tokens."""
    n = len(lengths)
    real = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    ids = (torch.arange(n * width, dtype=torch.int32) % 32000).view(n, width) * real
    return {
        "input_ids": ids,
        "loss_mask": real & (ids % 3 != 0),
        "hidden": pool.take(n * width).view(n, width, -1),
        "sample_id": torch.arange(first, first + n, dtype=torch.int64),
    }


def shard_paths(cache_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache_dir, "shard-*.safetensors")))


def write_native_cache(cache_dir: str, kind: Kind, pool: Pool) -> None:
    """A sealed native cache of ``kind`` through the producer path (reused when a previous run left it)."""
    config = {
        "bench": kind.name,
        "n": kind.num_samples,
        "shard_size": kind.shard_size,
        "hidden": kind.hidden,
        "len": [kind.min_len, kind.max_len],
    }
    if _sealed(cache_dir, config):
        return
    shutil.rmtree(cache_dir, ignore_errors=True)
    lengths = sample_lengths(kind)
    writer = CacheWriter(
        cache_dir,
        cache_name="synthetic",
        schema=synthetic_schema(kind.hidden),
        shard_size=kind.shard_size,
        num_samples=kind.num_samples,
        config=config,
    )
    with writer.writing() as run:
        for index in run.shards:
            a = index * kind.shard_size
            run.write_shard(cache_dir, index, native_shard(lengths[a : a + kind.shard_size], a, pool))


def merged_view(work: str, kind: Kind, native_dir: str) -> tuple[str, list[str]]:
    """A view merging the cache at ``native_dir`` with a second cache of ``kind`` (other rows), and the shard files
    of both (reused when a previous run left them)."""
    other = os.path.join(work, f"read-{kind.name}-b")
    pool = Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=4)
    write_native_cache(other, kind, pool)
    del pool
    view_dir = os.path.join(work, f"read-{kind.name}-view")
    shutil.rmtree(view_dir, ignore_errors=True)  # its sources' identities change when they are rewritten
    make_merge_view([native_dir, other], view_dir)
    return view_dir, shard_paths(native_dir) + shard_paths(other)


def _sealed(cache_dir: str, config: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(cache_dir, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(manifest.get("complete")) and manifest.get("config") == config


def write_seed_cache(cache_dir: str, kind: Kind, pool: Pool) -> None:
    """The same samples as a seed-layout cache, written as the seed does (``safetensors.torch.save_file``)."""
    from safetensors.torch import save_file

    manifest = {
        "format_version": SEED_VERSION,
        "shard_size": kind.shard_size,
        "num_samples": kind.num_samples,
        "bench": [kind.name, kind.hidden, kind.min_len, kind.max_len],
    }
    try:
        with open(os.path.join(cache_dir, "manifest.json")) as f:
            if json.load(f) == manifest:
                return
    except (OSError, ValueError):
        pass
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(cache_dir)
    lengths = sample_lengths(kind)
    for index, a in enumerate(range(0, kind.num_samples, kind.shard_size)):
        save_file(seed_shard(lengths[a : a + kind.shard_size], a, kind.max_len, pool), shard_path(cache_dir, index))
    with open(os.path.join(cache_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def load_upstream(path: str, work: str) -> tuple[types.ModuleType | None, str]:
    """NeMo AutoModel 0.7.0's offline_cache module, loaded by file with its one import stubbed; or ``None`` and why."""
    if not os.path.exists(path):
        path = _download_upstream(work)
        if path is None:
            return None, "nemo-automodel 0.7.0 not found (pass --upstream FILE, or allow `pip download`)"

    def safe_import_from(module: str, name: str) -> tuple[bool, Any]:
        try:
            return True, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False, None

    for name in ("nemo_automodel", "nemo_automodel.shared"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("nemo_automodel.shared.import_utils")
    utils.safe_import_from = safe_import_from  # type: ignore[attr-defined]
    sys.modules["nemo_automodel.shared.import_utils"] = utils
    spec = importlib.util.spec_from_file_location("nemo_offline_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _download_upstream(work: str) -> str | None:
    target = os.path.join(work, "upstream")
    member = os.path.join(target, UPSTREAM_MEMBER)
    if os.path.exists(member):
        return member
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", target, "nemo-automodel==0.7.0"],
            check=True,
            timeout=300,
        )
        wheel = glob.glob(os.path.join(target, "nemo_automodel-0.7.0-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            z.extract(UPSTREAM_MEMBER, target)
        return member
    except (OSError, subprocess.SubprocessError, IndexError, KeyError):
        return None


def add_upstream_flag(p: argparse.ArgumentParser) -> None:
    """The ``--upstream`` flag of the scripts that compare with the seed module."""
    p.add_argument(
        "--upstream", default=UPSTREAM_DEFAULT, help="nemo_automodel/.../offline_cache.py of nemo-automodel 0.7.0"
    )


def epoch(
    dataset: Dataset, order: Iterable[int], batch: int, collate: Callable[[list[Any]], dict[str, torch.Tensor]]
) -> float:
    loader = DataLoader(dataset, batch_size=batch, sampler=order, collate_fn=collate, num_workers=0)
    t = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t
