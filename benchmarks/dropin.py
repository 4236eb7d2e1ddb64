"""Section 4b: the NeMo drop-in (``speccache.offline_cache``) against the module it replaces.

``CachedTensorDataset`` + ``collate_cached`` of ``speccache.offline_cache`` against NeMo AutoModel 0.7.0's
``offline_cache`` module (loaded from ``--upstream`` or downloaded into the work directory; the section says so and
measures nothing when neither works), the same calls on the same seed-layout caches as section 4, batches of 8, warm
and cold, in paired rounds as section 3 (``benchmarks/reads.py``).

The report goes between ``<!-- dropin-benchmark:begin -->`` and ``<!-- dropin-benchmark:end -->`` of ``--out``.

Usage: python benchmarks/dropin.py --out docs/benchmarks.md [--work bench-out] [--scale 1.0] [--rounds 7]
[--upstream FILE]
"""

from __future__ import annotations

import functools
import mmap
import os
import types
from collections.abc import Callable, Sequence

import numpy as np

from fixtures import (  # benchmarks/, beside this script
    LARGE,
    SEED_KEYS,
    SEED_VERSION,
    SMALL,
    Kind,
    Pool,
    add_upstream_flag,
    epoch,
    load_upstream,
    shard_paths,
    write_seed_cache,
)
from harness import PageCache, Report, bench_args, cooled, paired_rounds, start, verdict, warmed, write_report

DROPIN_BATCH = 8


def bench_dropin(
    report: Report, work: str, kinds: Sequence[Kind], rounds: int, upstream: types.ModuleType, cache: PageCache
) -> None:
    """``speccache.offline_cache`` against NeMo AutoModel 0.7.0's module: same calls, same seed-layout cache."""
    import speccache.offline_cache as dropin

    rows = []
    buf = mmap.mmap(-1, 16 << 20)
    for kind in kinds:
        seed_dir = os.path.join(work, f"read-{kind.name}-seed")
        write_seed_cache(seed_dir, kind, Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=3))
        files = shard_paths(seed_dir)
        order = np.random.default_rng(1).permutation(kind.num_samples).tolist()

        def reader(module: types.ModuleType, seed_dir: str = seed_dir, order: list[int] = order) -> Callable[[], float]:
            def run() -> float:
                ds = module.CachedTensorDataset(
                    cache_dir=seed_dir, cache_name="bench", format_version=SEED_VERSION, disk_keys=SEED_KEYS
                )
                return epoch(ds, order, DROPIN_BATCH, functools.partial(module.collate_cached, keys=SEED_KEYS))

            return run

        jobs = {}
        for state, prepare in (("warm", functools.partial(warmed, buf)), ("cold", functools.partial(cooled, cache))):
            jobs[f"drop-in {state}"] = prepare(files, reader(dropin))
            jobs[f"seed {state}"] = prepare(files, reader(upstream))
        runs = paired_rounds(rounds, jobs)
        for state in ("warm", "cold"):
            ours, theirs = runs[f"drop-in {state}"], runs[f"seed {state}"]
            r = runs.ratio(f"seed {state}", f"drop-in {state}")
            rows.append(
                [
                    f"{kind.name} ({kind.num_samples} samples, {sum(map(os.path.getsize, files)) / 1e6:.0f} MB)",
                    state,
                    f"{ours:.2f}",
                    f"{theirs:.2f}",
                    f"{r:.2f}x",
                    runs.spread(f"seed {state}", f"drop-in {state}"),
                    ">= 1.2x",
                    verdict(r >= 1.2),
                ]
            )
            report.target(f"NeMo drop-in {kind.name} {state} reads >= 1.2x the original module", f"{r:.2f}x", r >= 1.2)
    buf.close()
    report.add("## 4b. The NeMo drop-in against the module it replaces")
    report.add()
    report.add(
        "`speccache.offline_cache.CachedTensorDataset` + `collate_cached` against the same two of nemo-automodel "
        "0.7.0's `offline_cache` module, called the same way on the same seed-layout caches as in section 4 "
        f"(`DataLoader(dataset, batch_size={DROPIN_BATCH}, sampler=<one uniform permutation>, collate_fn="
        "partial(collate_cached, keys=...), num_workers=0)`, a fresh dataset each time). Section 4 compares the "
        "native reader with the original; this one is what a NeMo user gets by switching the import. "
        "Ratio: original time / drop-in time, in rounds and with statistics as in section 3."
    )
    report.add()
    report.table(["samples", "cache", "drop-in s", "original s", "speedup", "rounds", "target", ""], rows)
    report.add(cache.describe())
    report.add()


def main(argv: list[str] | None = None) -> None:
    p = bench_args(__doc__, rounds=7)
    add_upstream_flag(p)
    args, run = start(p, __file__, argv)
    upstream, where = load_upstream(args.upstream, args.work)
    report = Report()
    if upstream is None:
        report.add("## 4b. The NeMo drop-in against the module it replaces")
        report.add()
        report.add(f"Not measured: {where}.")
    else:
        kinds = [LARGE.scaled(args.scale), SMALL.scaled(args.scale)]
        bench_dropin(report, args.work, kinds, args.rounds, upstream, PageCache())
        report.add(f"Seed module: {where}.")
    write_report("dropin", report, run, args.out)


if __name__ == "__main__":
    main()
