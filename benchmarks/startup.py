"""Section 5: reader start-up (open and first batch) on a cache of many shards, against the seed reader.

A fresh process (imports done) times the dataset's construction and its first batch of 64 through a DataLoader in
locality order, warm and cold (page cache dropped before the process starts); the best of ``--rounds``. The seed
reader (NeMo AutoModel 0.7.0, from ``--upstream`` or downloaded into the work directory) is left out when neither
works.

The report goes between ``<!-- startup-benchmark:begin -->`` and ``<!-- startup-benchmark:end -->`` of ``--out``.

Usage: python benchmarks/startup.py --out docs/benchmarks.md [--work bench-out] [--rounds 3] [--shards 10000]
[--upstream FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import types
from typing import Any

from torch.utils.data import DataLoader

from fixtures import (  # benchmarks/, beside this script
    SEED_KEYS,
    SEED_VERSION,
    Kind,
    Pool,
    add_upstream_flag,
    load_upstream,
    shard_paths,
    write_native_cache,
    write_seed_cache,
)
from harness import PageCache, Report, bench_args, start, write_report
from speccache.read import CacheDataset, PadCollator
from speccache.read.sampler import LocalityShuffleSampler


def write_many_shards(cache_dir: str, seed_dir: str | None, shards: int) -> None:
    kind = Kind("startup", num_samples=2 * shards, shard_size=2, hidden=16, min_len=4, max_len=8, batch=64)
    pool = Pool(kind.hidden, 1024, seed=4)
    write_native_cache(cache_dir, kind, pool)
    if seed_dir is not None:
        write_seed_cache(seed_dir, kind, pool)


def startup_child(cache_dir: str, reader: str, upstream_path: str) -> None:
    """Runs in a fresh process: time opening the cache and reading its first batch (in locality order)."""
    if reader == "ours":
        t = time.perf_counter()
        ds: Any = CacheDataset(cache_dir)
        opened = time.perf_counter() - t
        collate: Any = PadCollator(ds.ragged_keys)
    else:
        upstream, _ = load_upstream(upstream_path, os.path.dirname(cache_dir))
        assert upstream is not None
        t = time.perf_counter()
        ds = upstream.CachedTensorDataset(
            cache_dir=cache_dir, cache_name="bench", format_version=SEED_VERSION, disk_keys=SEED_KEYS
        )
        opened = time.perf_counter() - t
        collate = functools.partial(upstream.collate_cached, keys=SEED_KEYS)
    sampler = LocalityShuffleSampler(len(ds), ds.shard_size)
    next(iter(DataLoader(ds, batch_size=64, sampler=sampler, collate_fn=collate)))
    print(json.dumps({"open": opened, "total": time.perf_counter() - t}))


def bench_startup(
    report: Report,
    work: str,
    rounds: int,
    upstream: types.ModuleType | None,
    upstream_path: str,
    cache: PageCache,
    shards: int,
) -> None:
    native_dir = os.path.join(work, "startup")
    seed_dir = os.path.join(work, "startup-seed")
    t = time.perf_counter()
    write_many_shards(native_dir, seed_dir if upstream is not None else None, shards)
    built = time.perf_counter() - t

    def child(cache_dir: str, reader: str, drop: bool) -> dict[str, float]:
        if drop:
            cache.drop([os.path.join(cache_dir, "manifest.json"), *shard_paths(cache_dir)[:: max(1, shards // 1000)]])
        out = subprocess.run(
            [sys.executable, __file__, "--startup-child", cache_dir, reader, "--upstream", upstream_path],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    results: dict[str, dict[str, float]] = {}
    readers = [("ours", native_dir)] + ([("seed", seed_dir)] if upstream is not None else [])
    for _ in range(rounds):
        for reader, d in readers:
            for state in ("warm", "cold"):
                got = child(d, reader, state == "cold")
                key = f"{reader} {state}"
                if key not in results or got["total"] < results[key]["total"]:
                    results[key] = got
    report.add(f"## 5. Reader start-up on a {shards:,}-shard cache")
    report.add()
    origin = f"built in {built:.0f} s" if built >= 1 else "built by an earlier run"
    report.add(
        f"Caches of {shards:,} shards of 2 samples ({origin}, kept in the work directory). A fresh "
        "process (imports done) times the dataset's construction (manifest, shard listing) and then its first "
        "batch of 64 through a DataLoader in locality order. Cold: page cache dropped before the process starts."
    )
    report.add()
    rows = []
    for state in ("warm", "cold"):
        o = results[f"ours {state}"]
        row = [state, f"{o['open'] * 1e3:.0f} ms", f"{o['total'] * 1e3:.0f} ms"]
        if upstream is not None:
            s = results[f"seed {state}"]
            row += [f"{s['open'] * 1e3:.0f} ms", f"{s['total'] * 1e3:.0f} ms", f"{s['total'] / o['total']:.2f}x"]
        rows.append(row)
        report.target(f"start-up on {shards:,} shards < 1 s ({state})", f"{o['total']:.3f} s", o["total"] < 1.0)
    header = ["cache", "speccache open", "speccache open + first batch"]
    if upstream is not None:
        header += ["seed open", "seed open + first batch", "seed / speccache"]
    report.table(header, rows)


def main(argv: list[str] | None = None) -> None:
    p = bench_args(__doc__, scale=None)
    add_upstream_flag(p)
    p.add_argument("--shards", type=int, default=10_000, help="shards of the start-up cache")
    p.add_argument("--startup-child", nargs=2, metavar=("CACHE", "READER"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.startup_child:
        startup_child(*a.startup_child, a.upstream)
        return
    args, run = start(p, __file__, argv)
    upstream, where = load_upstream(args.upstream, args.work)
    report = Report()
    bench_startup(
        report, args.work, args.rounds, upstream, args.upstream if upstream is None else where, PageCache(), args.shards
    )
    report.add(f"Seed module: {where}.")
    write_report("startup", report, run, args.out)


if __name__ == "__main__":
    main()
