"""A deterministic synthetic producer: the native format without a model.

It writes what an EAGLE-3 cache holds (ragged ``input_ids``, ``loss_mask``,
``hidden`` rows and a fixed ``sample_id``) from a seeded generator, through the
same :class:`speccache.write.CacheWriter` lifecycle as the real
producers. Tests, benchmarks and the crash harness use it where a model would
only cost time; ``python -m speccache.testing.synthetic OUT`` runs it as a process, and
``torchrun --nproc_per_node N -m speccache.testing.synthetic OUT`` as N ranks (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from speccache.format import LENGTHS_KEY, KeySpec, Manifest, Schema
from speccache.write import CacheWriter, Comm, DiskCap, compute_shard_runs, init_from_env, shutdown

__all__ = ["SyntheticSamples", "collate_samples", "make_compute", "main", "synthetic_schema", "write_synthetic_cache"]

log = logging.getLogger(__name__)


def synthetic_schema(hidden: int, dtype: torch.dtype = torch.bfloat16, encoding: str = "raw") -> Schema:
    """The key schema the synthetic producer writes."""
    specs = [
        KeySpec("input_ids", torch.int32, (), ragged=True),
        KeySpec("loss_mask", torch.bool, (), ragged=True),
        KeySpec("hidden", dtype, (hidden,), ragged=True, encoding=encoding),
        KeySpec("sample_id", torch.int64, ()),
    ]
    return {s.name: s for s in specs}


class SyntheticSamples(Dataset):
    """Sample ``i``: a length in ``[min_len, max_len]`` and its token ids, both derived from ``(seed, i)``."""

    def __init__(self, num_samples: int, min_len: int, max_len: int, seed: int) -> None:
        self.num_samples, self.min_len, self.max_len, self.seed = num_samples, min_len, max_len, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        return {"index": index, "input_ids": torch.randint(0, 32000, (length,), generator=g, dtype=torch.int32)}


def collate_samples(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep the samples of a batch as a list (the synthetic compute step is per sample)."""
    return {"items": items}


def make_compute(hidden: int, dtype: torch.dtype, seed: int):
    """The synthetic 'forward': hidden rows seeded by the sample index, like a deterministic target."""

    def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        ids, masks, rows, sample_ids = [], [], [], []
        for item in batch["items"]:
            g = torch.Generator().manual_seed(seed * 7_919 + item["index"])
            n = item["input_ids"].shape[0]
            ids.append(item["input_ids"])
            masks.append(torch.arange(n) >= n // 3)
            rows.append(torch.randn(n, hidden, generator=g).to(dtype))
            sample_ids.append(item["index"])
        return {
            "input_ids": torch.cat(ids),
            "loss_mask": torch.cat(masks),
            "hidden": torch.cat(rows),
            "sample_id": torch.tensor(sample_ids, dtype=torch.int64),
            LENGTHS_KEY: torch.tensor([t.shape[0] for t in ids], dtype=torch.int64),
        }

    return compute


def write_synthetic_cache(
    out: str,
    *,
    num_samples: int = 64,
    shard_size: int = 8,
    batch_size: int = 4,
    hidden: int = 32,
    min_len: int = 1,
    max_len: int = 48,
    seed: int = 0,
    encoding: str = "raw",
    resume: bool = False,
    overlap: bool = True,
    comm: Comm | None = None,
    cap: DiskCap | None = None,
    compute_delay: float = 0.0,
) -> Manifest:
    """Write a synthetic cache at ``out`` and return its sealed manifest.

    ``cap`` pauses the writer at a disk cap (as ``precompute --max-cache-bytes``); ``compute_delay`` seconds are
    spent on each batch, standing in for a target's forward (the streaming benchmark sets the producer's speed).
    """
    schema = synthetic_schema(hidden, encoding=encoding)
    config = {
        "method": "synthetic",
        "seed": seed,
        "hidden": hidden,
        "min_len": min_len,
        "max_len": max_len,
        "batch_size": batch_size,
    }
    writer = CacheWriter(
        out,
        cache_name="synthetic",
        schema=schema,
        shard_size=shard_size,
        num_samples=num_samples,
        config=config,
        resume=resume,
        comm=comm,
        cap=cap,
    )
    loader = DataLoader(
        SyntheticSamples(num_samples, min_len, max_len, seed), batch_size=batch_size, collate_fn=collate_samples
    )
    compute = make_compute(hidden, torch.bfloat16, seed)
    if compute_delay:
        plain = compute

        def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
            time.sleep(compute_delay)
            return plain(batch)

    ragged = [k for k, s in schema.items() if s.ragged]
    sync = writer.comm.max_int if writer.comm.world_size > 1 else None
    with writer.writing(overlap=overlap) as run:
        compute_shard_runs(
            loader, out, shard_size, run.shards, compute, run.write_shard, log, ragged_keys=ragged, sync_max_steps=sync
        )
    return writer.manifest


def main(argv: list[str] | None = None) -> None:
    """``python -m speccache.testing.synthetic OUT [--samples N] ...``: write a synthetic cache."""
    p = argparse.ArgumentParser(prog="python -m speccache.testing.synthetic", description=main.__doc__)
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--max-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoding", default="raw")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sync", action="store_true", help="write shards synchronously")
    p.add_argument("--max-cache-bytes", type=int, default=None, help="the disk cap, as precompute's")
    p.add_argument("--max-cache-shards", type=int, default=None, help="the disk cap in shards, as precompute's")
    p.add_argument("--compute-delay", type=float, default=0.0, help="seconds spent on each batch")
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="under torchrun: seconds a rank waits for the others (joining, and at each collective) before failing",
    )
    a = p.parse_args(argv)
    comm = init_from_env(torch.device("cpu"), a.timeout)
    try:
        write_synthetic_cache(
            a.out,
            num_samples=a.samples,
            shard_size=a.shard_size,
            batch_size=a.batch_size,
            hidden=a.hidden,
            max_len=a.max_len,
            seed=a.seed,
            encoding=a.encoding,
            resume=a.resume,
            overlap=not a.sync,
            comm=comm,
            cap=DiskCap(a.out, a.max_cache_bytes, a.max_cache_shards)
            if a.max_cache_bytes or a.max_cache_shards
            else None,
            compute_delay=a.compute_delay,
        )
    finally:
        shutdown(comm)


if __name__ == "__main__":
    main()
