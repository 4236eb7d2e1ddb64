"""Section 1: the write throughput of a cache against writing the same bytes to plain files.

``CacheWriter`` + ``NativeShardWriter`` (encode, hash, temp file, fsync, rename) against writing each shard's tensor
bytes to one plain file with fsync; the best of ``--rounds`` interleaved rounds.

The report goes between ``<!-- write-benchmark:begin -->`` and ``<!-- write-benchmark:end -->`` of ``--out``.

Usage: python benchmarks/write.py --out docs/benchmarks.md [--work bench-out] [--scale 1.0] [--rounds 3]
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from fixtures import Kind, Pool, native_shard, sample_lengths, shard_paths  # benchmarks/, beside this script
from harness import Report, bench_args, best_of, start, write_report
from speccache.testing.synthetic import synthetic_schema
from speccache.write import CacheWriter


def bench_write(report: Report, work: str, scale: float, rounds: int) -> None:
    kind = Kind(
        "write",
        num_samples=max(64, int(384 * scale)) // 8 * 8,
        shard_size=8,
        hidden=4096,
        min_len=256,
        max_len=256,
        batch=8,
    )
    pool = Pool(kind.hidden, 8192, seed=1)
    lengths = sample_lengths(kind)
    shards = [
        native_shard(lengths[a : a + kind.shard_size], a, pool) for a in range(0, kind.num_samples, kind.shard_size)
    ]
    out = os.path.join(work, "write")
    schema = synthetic_schema(kind.hidden)

    def cache() -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        writer = CacheWriter(
            out,
            cache_name="synthetic",
            schema=schema,
            shard_size=kind.shard_size,
            num_samples=kind.num_samples,
            config={"bench": "write"},
        )
        with writer.writing(overlap=False) as run:
            for index in run.shards:
                run.write_shard(out, index, shards[index])
        return time.perf_counter() - t

    def plain() -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()
        t = time.perf_counter()
        for index, shard in enumerate(shards):
            with open(os.path.join(out, f"plain-{index}"), "wb") as f:
                for value in shard.values():
                    f.write(memoryview(value.contiguous().view(torch.uint8).numpy()))
                os.fsync(f.fileno())
        return time.perf_counter() - t

    best = best_of(rounds, {"cache": cache, "plain": plain})
    nbytes = sum(os.path.getsize(p) for p in shard_paths(out)) if shard_paths(out) else 0
    if not nbytes:
        cache()
        nbytes = sum(os.path.getsize(p) for p in shard_paths(out))
    shutil.rmtree(out, ignore_errors=True)
    report.add("## 1. Write throughput")
    report.add()
    report.add(
        f"{len(shards)} shards of {kind.shard_size} samples x {kind.max_len} tokens x {kind.hidden} bf16 "
        f"({nbytes / 1e6:.0f} MB). The cache path encodes, hashes (per tensor and per file), writes a temp "
        "file, fsyncs, renames and fsyncs the directory per shard, then seals the manifest; the plain path "
        "writes the same tensor bytes to one file per shard and fsyncs it."
    )
    report.add()
    report.table(
        ["path", "seconds", "MB/s"],
        [
            ["speccache cache write", f"{best['cache']:.2f}", f"{nbytes / best['cache'] / 1e6:.0f}"],
            ["plain write + fsync", f"{best['plain']:.2f}", f"{nbytes / best['plain'] / 1e6:.0f}"],
        ],
    )
    r = best["plain"] / best["cache"]
    report.add(f"Cache write throughput / plain write throughput: **{r:.2f}x**.")
    report.add()
    report.target("write throughput vs plain write + fsync (reported, no target)", f"{r:.2f}x", None)


def main(argv: list[str] | None = None) -> None:
    args, run = start(bench_args(__doc__), __file__, argv)
    report = Report()
    bench_write(report, args.work, args.scale, args.rounds)
    write_report("write", report, run, args.out)


if __name__ == "__main__":
    main()
